"""Chat: the model's own chat template (Jinja) rendered with jinja2, and an interactive loop over the engine.

The template comes from where the model ships it: a GGUF file's `tokenizer.chat_template`, or beside the
weights of a Hugging Face folder, `tokenizer_config.json`'s "chat_template" (a string, or a list of named
templates: "default" is taken) or a `chat_template.jinja` file. It is rendered as Hugging Face's
`apply_chat_template` renders it: a sandboxed environment with trim_blocks and lstrip_blocks, the loopcontrols
extension, `raise_exception`, a `tojson` filter, and `bos_token` / `eos_token` from the tokenizer.

The loop renders the whole conversation each turn and submits it as a new request: the engine's prefix cache
(vkgraph.nn.kv_cache) finds the blocks of every earlier turn still cached, so only the new turn is computed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from .config import ModelFormatError, gguf_value
from .model_file import ModelSource, open_model


class NoChatTemplateError(ModelFormatError):
    pass


class ChatTemplate:
    """A Jinja chat template and the special tokens it may name."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelFormatError(f"the model's chat template does not parse: {e}") from None
        self.bos_token, self.eos_token = bos_token, eos_token

    def render(self, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The conversation as the model was trained to read it, ending where the assistant's reply begins."""
        return self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token)

    @classmethod
    def load(cls, model: ModelSource, tokenizer: Any) -> ChatTemplate:
        """From a .gguf file or a Hugging Face folder (or a file inside one), by path or as an open `ModelFile`;
        `tokenizer` names BOS and EOS."""
        m = open_model(model)
        p = m.path
        source: str | None = None
        if m.gguf is not None:
            source = gguf_value(m.gguf, "tokenizer.chat_template")
        else:
            d = m.folder
            cfg = d / "tokenizer_config.json"
            if cfg.exists():
                t = json.loads(cfg.read_text()).get("chat_template")
                if isinstance(t, list):
                    t = next((x.get("template") for x in t if x.get("name") == "default"), None)
                source = t
            if source is None and (d / "chat_template.jinja").exists():
                source = (d / "chat_template.jinja").read_text()
        if not source:
            raise NoChatTemplateError(f"{p} has no chat template (tokenizer.chat_template in GGUF, chat_template "
                                      "in tokenizer_config.json, or chat_template.jinja)")

        def token(i: int | None) -> str:
            return "" if i is None else tokenizer.tok.id_to_token(i) or ""

        return cls(source, bos_token=token(tokenizer.bos_id), eos_token=token(tokenizer.eos_id))


def chat_loop(engine: Any, template: ChatTemplate, params: Any, *, max_tokens: int, stop: Sequence[str] = (),
              read: Callable[[], str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Read user turns (one line each) until end of input; stream each reply. Returns 0."""
    read = read or sys.stdin.readline
    out, err = out or sys.stdout, err or sys.stderr
    messages: list[dict[str, str]] = []
    while True:
        print("> ", end="", file=err, flush=True)
        line = read()
        if not line:
            print(file=err)
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = engine.tokenizer.encode(template.render(messages), add_special_tokens=False)
        cached_before = engine.stats["cached_prompt_tokens"]
        rid = engine.add_request(ids, params, max_tokens=max_tokens, stop=stop)
        reply = ""
        while engine.has_work():
            for ev in engine.step():
                if ev.request_id == rid:
                    reply += ev.text
                    print(ev.text, end="", file=out, flush=True)
        print(file=out, flush=True)
        cached = engine.stats["cached_prompt_tokens"] - cached_before
        print(f"[vkgraph] {len(ids)} prompt tokens, {cached} of them from the cache", file=err, flush=True)
        messages.append({"role": "assistant", "content": reply.strip()})
