"""The command line: user errors are one line on stderr and exit code 2 (before anything loads where the
arguments alone tell), `--debug` shows the traceback, `--help` shows defaults, a .safetensors file works as
--model, and the random demo model says so."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vkgraph import generate
from vkgraph.nn import tiny_model as mk

ROOT = Path(__file__).resolve().parents[1]
# the checkout first, then what PYTHONPATH already holds (dependencies may live in a folder on it)
CHILD_PYTHONPATH = os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return mk.write_model(tmp_path_factory.mktemp("cli"), mk.tiny_config(n_layers=1), gguf_types=("Q8_0",))


def run_cli(*args: str, module: str = "vkgraph.generate") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH)
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("python -m vkgraph.generate: error: "), err
    return lines[0]


def in_process(capsys, *args: str) -> tuple[int, str, str]:
    try:
        rc = generate.main(list(args))
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("args, words", [
    (["--max-tokens", "-1"], "--max-tokens must be at least 1"),
    (["--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["--max-context", "0"], "--max-context must be at least 1"),
    (["--num-blocks", "0"], "--num-blocks must be at least 1"),
    (["--top-p", "2"], "--top-p must be in (0, 1]"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--max-tokens", "ten"], "invalid int value"),
    (["--quantize", "Q3_X"], "invalid choice"),
    (["--quantize", "IQ4_XS"], "invalid choice"),  # no quantizer
    (["--prompt", "b", "--draft", "{hf}"], "--draft decodes one prompt at a time"),
])
def test_bad_arguments_refused_before_loading(tiny, capsys, monkeypatch, args, words):
    def no_load(*a, **k):
        raise AssertionError("loaded a model for arguments that cannot work")

    monkeypatch.setattr("vkgraph.nn.weights.load_weights", no_load)
    args = [a.format(hf=tiny["hf"]) for a in args]
    rc, out, err = in_process(capsys, "--model", str(tiny["Q8_0"]), "--prompt", "a", *args)
    assert rc == 2 and out == ""
    assert words in one_error_line(err)


@pytest.mark.parametrize("args, words", [
    (["--num-blocks", "1", "--max-tokens", "40"], "need 3 KV cache blocks of 16 tokens; --num-blocks is 1"),
    (["--max-context", "8", "--max-tokens", "10"], "exceeds the context of 8 tokens"),
    (["--prompt", "b", "--num-blocks", "1", "--max-tokens", "20"], "need 2 KV cache blocks"),
])
def test_prompts_that_cannot_fit_refused_before_streaming(tiny, capsys, monkeypatch, args, words):
    def no_model(*a, **k):
        raise AssertionError("built a model for prompts that cannot fit")

    monkeypatch.setattr("vkgraph.nn.llama.LlamaModel", no_model)
    rc, out, err = in_process(capsys, "--model", str(tiny["Q8_0"]), "--prompt", "Hello", *args)
    assert rc == 2 and out == ""
    assert words in one_error_line(err)


def test_fit_counts_the_last_token_as_unstored():
    generate.check_fit([16], 1, 64, 1)  # 16 prompt tokens + one generated, never written back: one block
    with pytest.raises(generate.UsageError):
        generate.check_fit([16], 2, 64, 1)


def test_missing_and_corrupt_files(tiny, tmp_path, capsys):
    rc, out, err = in_process(capsys, "--model", str(tmp_path / "none.gguf"), "--prompt", "a")
    assert rc == 2 and "no such file" in one_error_line(err)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(200))
    rc, out, err = in_process(capsys, "--model", str(bad), "--prompt", "a")
    assert rc == 2 and "bad.gguf" in one_error_line(err)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny["Q8_0"].read_bytes()[:-1000])
    rc, out, err = in_process(capsys, "--model", str(cut), "--prompt", "a")
    assert rc == 2 and "truncated" in one_error_line(err)


def test_unsupported_architecture_named(tiny, tmp_path, capsys):
    import json
    import shutil

    cfg = json.loads((tiny["hf"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"model_type": "gpt2"}))
    shutil.copy(tiny["hf"] / "tokenizer.json", tmp_path)
    shutil.copy(tiny["hf"] / "model.safetensors", tmp_path)
    rc, out, err = in_process(capsys, "--model", str(tmp_path), "--prompt", "a")
    assert rc == 2 and "'gpt2'" in one_error_line(err)


def test_help_shows_defaults(capsys):
    rc, out, _ = in_process(capsys, "--help")
    assert rc == 0
    assert "(default: 64)" in out and "(default: 512)" in out and "(default: f16)" in out


def test_debug_shows_the_traceback(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(100))
    plain = run_cli("--model", str(bad), "--prompt", "a")
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    one_error_line(plain.stderr)
    debug = run_cli("--model", str(bad), "--prompt", "a", "--debug")
    assert debug.returncode == 2 and "Traceback (most recent call last)" in debug.stderr


def test_safetensors_file_as_model_and_random_weights_said(tiny):
    r = run_cli("--model", str(tiny["hf"] / "model.safetensors"), "--prompt", "Hello", "--max-tokens", "3")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hello")
    note = r.stderr.index("weights are random")
    assert note < r.stderr.index("[vkgraph] prompt:")  # said before the completion's report


def test_flags_module_runs_without_runpy_warning():
    r = run_cli(module="vkgraph.flags")
    assert r.returncode == 0 and "VKGRAPH_DEVICE" in r.stdout
    assert "RuntimeWarning" not in r.stderr, r.stderr


def run_chat(model: Path, lines: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH)
    return subprocess.run([sys.executable, "-m", "vkgraph.generate", "--model", str(model), "--chat", *args],
                          input=lines, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("kind", ["Q8_0", "hf"])
def test_chat_keeps_earlier_turns_in_the_cache(tiny, kind):
    turn = "Once upon a time there was a little model that wanted to run on every GPU in the world."
    r = run_chat(tiny[kind], f"{turn}\n\nThe quick brown fox.\n", "--max-tokens", "3")
    assert r.returncode == 0, r.stderr
    reports = [line for line in r.stderr.splitlines() if "prompt tokens" in line]
    assert len(reports) == 2, r.stderr  # the empty line is no turn
    first, second = ([int(w) for w in line.split() if w.isdigit()] for line in reports)
    assert first[1] == 0 and second[1] >= 16 and second[1] <= first[0] + 3  # a full block of turn one reused


def test_chat_template_renders_as_hugging_face_does(tiny):
    from vkgraph.nn.chat import ChatTemplate
    from vkgraph.nn.tokenizer import Tokenizer

    tok = Tokenizer.load(tiny["hf"])
    t = ChatTemplate.load(tiny["hf"], tok)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert t.render(msgs) == "<|begin_of_text|>user: Hi<|eot_id|>assistant: Hello<|eot_id|>assistant: "
    assert t.render(msgs[:1], add_generation_prompt=False) == "<|begin_of_text|>user: Hi<|eot_id|>"
    assert ChatTemplate.load(tiny["Q8_0"], Tokenizer.load(tiny["Q8_0"])).render(msgs) == t.render(msgs)
    boom = ChatTemplate("{{ raise_exception('only user turns') }}")
    with pytest.raises(ValueError, match="only user turns"):
        boom.render(msgs)


def test_chat_without_a_template_or_with_a_prompt_refused(tiny, tmp_path, capsys):
    import shutil

    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        shutil.copy(tiny["hf"] / name, tmp_path)
    rc, out, err = in_process(capsys, "--model", str(tmp_path), "--chat")
    assert rc == 2 and "has no chat template" in one_error_line(err)
    rc, out, err = in_process(capsys, "--model", str(tiny["hf"]), "--chat", "--prompt", "x")
    assert rc == 2 and "--chat takes neither --prompt" in one_error_line(err)
    rc, out, err = in_process(capsys, "--model", str(tiny["hf"]))
    assert rc == 2 and "--prompt is required (or --chat)" in one_error_line(err)


def test_a_gguf_file_is_parsed_once_per_run(tiny, capsys, monkeypatch):
    import io

    import gguf

    opened = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            opened.append(path)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # a chat that ends at once: tokenizer, weights, template
    rc, out, err = in_process(capsys, "--model", str(tiny["Q8_0"]), "--chat")
    assert rc == 0, err
    assert "weights are random" in err  # the demo-model check read the same open file
    assert len(opened) == 1, opened


def test_quantize_on_load_to_a_format_the_rows_cannot_hold(tiny, capsys):
    rc, out, err = in_process(capsys, "--model", str(tiny["hf"]), "--prompt", "a", "--quantize", "Q4_K")
    assert rc == 2 and "not a multiple of the block size 256" in one_error_line(err)


def test_warmup_fills_the_disk_caches_and_a_later_run_compiles_nothing_from_glsl(tiny, tmp_path):
    cache = {"VKGRAPH_CACHE_DIR": str(tmp_path), "VKGRAPH_DISK_CACHE": "1"}
    env = dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH, **cache)

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", "import sys, vkgraph, vkgraph.generate as g; rc = g.main("
                               "sys.argv[1:]); print(vkgraph.stats()['device']['compiles'], file=sys.stderr); "
                               "sys.exit(rc)", *args], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)

    w = cli("--model", str(tiny["Q8_0"]), "--warmup")
    assert w.returncode == 0 and w.stdout == "", w.stderr
    assert "[vkgraph] warm-up:" in w.stderr and "compiled from GLSL" in w.stderr
    assert any((tmp_path / "spirv").rglob("*.spv")) and any((tmp_path / "pipelines").glob("*.bin"))
    r = cli("--model", str(tiny["Q8_0"]), "--prompt", "Hello", "--max-tokens", "3")
    assert r.returncode == 0 and r.stdout.startswith("Hello"), r.stderr
    assert "'misses': 0" in r.stderr  # every program came from the disk cache the warm-up filled
    assert "not counted:" in r.stderr and "compiling kernels" in r.stderr


def test_warmup_call_reports_what_it_compiled(dev):
    import numpy as np

    import vkgraph

    x = np.linspace(-1, 1, 37, dtype=np.float32)
    vkgraph.clear_caches()  # the program may have been compiled by an earlier test
    w = vkgraph.warmup(lambda t: (t * 2.5 + 0.125).exp().sum(), vkgraph.Tensor(x))
    assert w.pipelines >= 1 and w.compile_seconds > 0 and w.seconds >= w.compile_seconds
    np.testing.assert_allclose(w.result.numpy(), np.exp(x * 2.5 + 0.125).sum(), rtol=1e-5)
    again = vkgraph.warmup(lambda t: (t * 2.5 + 0.125).exp().sum(), vkgraph.Tensor(x))
    assert again.pipelines == 0 and again.spirv_compiled == 0 and again.compile_seconds == 0
