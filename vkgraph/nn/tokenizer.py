"""Text <-> token ids through Hugging Face `tokenizers`, from tokenizer.json or from a GGUF file's vocabulary.

GGUF: byte-level BPE vocabularies (tokenizer.ggml.model "gpt2": Llama 3, Qwen2, GPT-2 style) are rebuilt as a
`tokenizers` BPE model from the embedded tokens, merges and token types, with the pre-tokenizer regex that
tokenizer.ggml.pre names (gpt-2, llama-bpe/llama3, qwen2, and GPT-2's with every digit alone for smollm,
starcoder and the others llama.cpp groups with them; others fall back to GPT-2's, with a warning).
SentencePiece vocabularies (model "llama": Llama 1/2, Mistral, TinyLlama) carry tokens and scores but no merges:
they become a `tokenizers` BPE whose merges are every split of a normal token into two tokens, ranked by the
merged token's score, with byte fallback (<0xXX> tokens) and "▁" for spaces (one prefixed to each text between
special tokens, as llama.cpp does when tokenizer.ggml.add_space_prefix holds). Merging the adjacent pair whose
result scores highest is exactly llama.cpp's SentencePiece tokenizer (tests/test_tokenizer.py runs a port of it).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import ModelFormatError, UnsupportedModelError, gguf_value
from .model_file import ModelSource, open_gguf, open_model

# pre-tokenizer regexes, as llama.cpp's llama-vocab.cpp and the models' tokenizer.json files define them
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
             r"\s*[\r\n]+|\s+(?!\S)|\s+")
_PRE_REGEX = {"llama-bpe": _LLAMA3_RE, "llama3": _LLAMA3_RE, "smaug-bpe": _LLAMA3_RE, "qwen2": _QWEN2_RE}
_GPT2_PRE = ("gpt-2", "gpt2", "default")
# GPT-2's split after one that isolates every digit (llama.cpp: "\p{N}" before GPT-2's regex; these models'
# tokenizer.json: Digits(individual_digits) then ByteLevel)
_DIGITS_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4  # gguf.TokenType


class Tokenizer:
    """encode/decode plus the ids generation needs (BOS, end-of-sequence ids)."""

    def __init__(self, tok: Any, *, bos_id: int | None, eos_ids: Sequence[int]) -> None:
        if not eos_ids:
            raise ValueError("a tokenizer for generation needs at least one end-of-sequence id")
        self.tok = tok
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)

    @property
    def eos_id(self) -> int:
        return self.eos_ids[0]

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids; add_special_tokens adds what the tokenizer's template adds (usually BOS)."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def stream(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)

    @classmethod
    def load(cls, source: ModelSource) -> Tokenizer:
        """From a .gguf file, a tokenizer.json, or a model directory holding one (or a weights file inside it,
        such as model.safetensors, as `load_weights` takes), by path or as an open `ModelFile`."""
        m = open_model(source)
        if m.gguf is not None:
            return cls.from_gguf(m.gguf)
        p = m.path
        return cls.from_file(m.folder if p.is_file() and p.suffix != ".json" else p)

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """tokenizer.json; BOS/EOS ids from generation_config.json, config.json or tokenizer_config.json beside it."""
        from tokenizers import Tokenizer as HFTokenizer

        p = Path(path)
        p = p / "tokenizer.json" if p.is_dir() else p
        if not p.exists():
            raise FileNotFoundError(f"no tokenizer.json at {p}")
        tok = HFTokenizer.from_file(str(p))
        bos, eos = _hf_special_ids(p.parent, tok)
        return cls(tok, bos_id=bos, eos_ids=eos)

    @classmethod
    def from_gguf(cls, source: str | Path | Any) -> Tokenizer:
        """From a GGUF path or an open `gguf.GGUFReader`."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
        from tokenizers import Tokenizer as HFTokenizer

        reader = open_gguf(source) if isinstance(source, str | Path) else source
        get = _VocabFields(reader)
        kind = get("tokenizer.ggml.model", str)
        if kind not in ("gpt2", "llama"):
            raise UnsupportedModelError(f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and "
                                        "SentencePiece 'llama' are); load the model's tokenizer.json instead")
        tokens: list[str] = get("tokenizer.ggml.tokens", list, of=str)
        types: list[int] = get("tokenizer.ggml.token_type", list, [1] * len(tokens), of=int, length=len(tokens))
        pre = get("tokenizer.ggml.pre", str, "default")
        if kind == "llama":  # SentencePiece: no pre-tokenizer, it sees the whole text
            tok = _sentencepiece(tokens, types, get("tokenizer.ggml.scores", list, None, of=float),
                                 get("tokenizer.ggml.add_space_prefix", bool, True))
        else:
            merges = [tuple(m.split(" ", 1)) for m in get("tokenizer.ggml.merges", list, [], of=str)]
            if any(len(m) != 2 for m in merges):
                raise ModelFormatError("GGUF metadata tokenizer.ggml.merges: a merge is not two tokens and a space")
            tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
            if pre in _PRE_REGEX:
                tok.pre_tokenizer = pre_tokenizers.Sequence([
                    pre_tokenizers.Split(Regex(_PRE_REGEX[pre]), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
            elif pre in _DIGITS_PRE:
                tok.pre_tokenizer = pre_tokenizers.Sequence([
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
            else:
                if pre not in _GPT2_PRE:
                    warnings.warn(f"GGUF pre-tokenizer {pre!r} unknown; splitting words as GPT-2 does", stacklevel=2)
                tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty == _CONTROL])
        tok.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
        bos, eos, eot = (get(f"tokenizer.ggml.{k}_token_id", int, None, below=len(tokens))
                         for k in ("bos", "eos", "eot"))
        # llama.cpp adds BOS by default for SentencePiece vocabularies, not for byte-level BPE ones
        if bos is not None and get("tokenizer.ggml.add_bos_token", bool, kind == "llama"):
            tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]}:0 $A:0",
                                                               special_tokens=[(tokens[bos], bos)])
        eos_ids = [i for i in (eos, eot) if i is not None]
        if not eos_ids:
            raise ModelFormatError("GGUF metadata names no end of sequence (tokenizer.ggml.eos_token_id, eot_token_id)")
        return cls(tok, bos_id=bos, eos_ids=list(dict.fromkeys(eos_ids)))


def _sentencepiece(tokens: list[str], types: list[int], scores: list[float] | None, add_space_prefix: bool) -> Any:
    """A `tokenizers` BPE equivalent to llama.cpp's SentencePiece tokenizer over this vocabulary (module docstring)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    if scores is None or len(scores) != len(tokens):
        raise UnsupportedModelError("GGUF SentencePiece vocabulary without a score per token")
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = {t for t, ty in zip(tokens, types) if ty == _NORMAL}
    ranked = []
    for t in normal:
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            if left in normal and right in normal:
                ranked.append((-scores[vocab[t]], vocab[t], k, left, right))
    ranked.sort()
    unk = next((t for t, ty in zip(tokens, types) if ty == _UNKNOWN), None)
    tok = HFTokenizer(models.BPE(vocab, [(m[3], m[4]) for m in ranked], unk_token=unk, fuse_unk=True,
                                 byte_fallback=True))
    steps = [normalizers.Prepend("\u2581")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "\u2581")])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     *strip])
    return tok


_REQUIRED = object()


class _VocabFields:
    """GGUF tokenizer metadata, each value checked for its type (and items, length, range) before use, so a
    malformed file is a `ModelFormatError` naming the key rather than a TypeError deep in the tokenizer."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader

    def __call__(self, key: str, kind: type, default: Any = _REQUIRED, *, of: type | None = None,
                 length: int | None = None, below: int | None = None) -> Any:
        v = gguf_value(self.reader, key)
        if v is None:
            if default is _REQUIRED:
                raise ModelFormatError(f"GGUF metadata lacks {key}")
            return default
        ok = isinstance(v, kind) and not (kind is int and isinstance(v, bool))
        if ok and of is not None:
            ok = all(isinstance(x, of) or of is float and isinstance(x, int) for x in v)
        if ok and length is not None:
            ok = len(v) == length
        if ok and below is not None:
            ok = 0 <= v < below
        if not ok:
            want = [f"a {kind.__name__}", f"of {of.__name__}" if of else "",
                    f"of length {length}" if length is not None else "", f"in [0, {below})" if below else ""]
            raise ModelFormatError(f"GGUF metadata {key} must be {' '.join(w for w in want if w)}, got {str(v)[:60]}")
        return v


class IncrementalDecoder:
    """Text for a growing list of ids, piece by piece, holding back an incomplete UTF-8 character.
    Decodes only a short window per token (the scheme vLLM's detokenizer uses), not the whole sequence."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to text already returned
        self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        done = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(done):]
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes as U+FFFD), at the end of a stream."""
        done = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(done):]

    def mark(self) -> tuple[int, int, int]:
        """A point to `rewind` to (ids are only ever appended, so three counters hold the whole state)."""
        return len(self.ids), self.prefix, self.read

    def rewind(self, mark: tuple[int, int, int]) -> None:
        """Forget every push and flush since `mark` (a generation step that was rolled back)."""
        n, self.prefix, self.read = mark
        del self.ids[n:]


def _hf_special_ids(d: Path, tok: Any) -> tuple[int | None, list[int]]:
    bos: int | None = None
    eos: list[int] = []
    for name in ("generation_config.json", "config.json"):
        f = d / name
        if not f.exists():
            continue
        cfg = json.loads(f.read_text())
        if bos is None and isinstance(cfg.get("bos_token_id"), int):
            bos = cfg["bos_token_id"]
        e = cfg.get("eos_token_id")
        eos += [e] if isinstance(e, int) else list(e or [])
    tc = d / "tokenizer_config.json"
    if tc.exists():
        cfg = json.loads(tc.read_text())

        def token_id(v: Any) -> int | None:
            return tok.token_to_id(v["content"] if isinstance(v, dict) else v) if v else None

        bos = bos if bos is not None else token_id(cfg.get("bos_token"))
        e = token_id(cfg.get("eos_token"))
        eos += [e] if e is not None else []
    return bos, list(dict.fromkeys(eos))
