"""The engine under pressure: a KV pool too small for every running request (preemption by recompute),
exceptions and KeyboardInterrupts at any point of a step (rolled back or finished with an error, blocks
returned), and aborts (nothing left behind)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vkgraph.nn import tiny_model as mk
from vkgraph.nn.engine import Engine
from vkgraph.nn.llama import LlamaModel
from vkgraph.nn.tokenizer import Tokenizer
from vkgraph.nn.weights import load_weights

BLOCK = 16
PROMPTS = [[5, 17, 42, 99, 7], [3, 250, 11, 9, 8, 7, 6, 5, 4, 3, 2, 20, 21, 22, 23, 24, 25, 26, 27], [44]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return mk.write_model(tmp_path_factory.mktemp("pressure"), mk.tiny_config(), gguf_types=())["hf"]


@pytest.fixture(scope="module")
def weights(model_dir):
    return load_weights(model_dir, progress=False)


def model(weights, num_blocks: int, blocks_per_seq: int = 8) -> LlamaModel:
    return LlamaModel(weights, num_blocks=num_blocks, block_size=BLOCK, kv_dtype="f32",
                      max_blocks_per_seq=blocks_per_seq, float_dtype="float32")


def drain(engine: Engine, outs: dict[int, list[int]] | None = None) -> dict[int, list[int]]:
    outs = {} if outs is None else outs
    while engine.has_work():
        for ev in engine.step():
            if ev.token is not None:
                outs.setdefault(ev.request_id, []).append(ev.token)
    return outs


def assert_all_blocks_free(engine: Engine) -> None:
    engine.kv.check_invariants()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and not engine.kv.seqs
    assert not engine.decoders


@pytest.fixture(scope="module")
def alone(weights):
    """Each prompt run alone in a pool that holds it, greedy: what every test below must reproduce."""
    engine = Engine(model(weights, 16), max_batch=4)
    out = {}
    for i, p in enumerate(PROMPTS):
        rid = engine.add_request(p, max_tokens=40, stop_token_ids=[])
        out[i] = drain(engine)[rid]
    return out


def test_running_requests_that_outgrow_the_pool_are_preempted_and_recomputed(weights, alone):
    """8 blocks of 16: each request fits alone (prompt + 39 tokens <= 4 blocks) but not all three together.
    Before preemption, step() raised OutOfKVBlocks after sampling a token, which was lost."""
    engine = Engine(model(weights, 8), max_batch=4)
    ids = [engine.add_request(p, max_tokens=40, stop_token_ids=[]) for p in PROMPTS]
    outs = drain(engine)
    assert [outs[i] for i in ids] == [alone[i] for i in range(len(PROMPTS))]
    assert engine.stats["preemptions"] > 0
    assert_all_blocks_free(engine)


def test_the_two_prompt_command_line_case_completes(weights):
    """`generate --num-blocks 8 --max-tokens 100` with two prompts crashed and lost all output."""
    engine = Engine(model(weights, 8, blocks_per_seq=32), max_batch=4, prefix_caching=False)
    ids = [engine.add_request(p, max_tokens=100, stop_token_ids=[]) for p in PROMPTS[:2]]
    outs = drain(engine)
    assert [len(outs[i]) for i in ids] == [100, 100] and engine.stats["preemptions"] > 0
    assert_all_blocks_free(engine)


def test_a_request_larger_than_the_pool_is_refused_at_admission(weights):
    engine = Engine(model(weights, 4, blocks_per_seq=32), max_batch=4)  # the context follows the pool: 64
    with pytest.raises(ValueError, match="context of 64 tokens"):
        engine.add_request(PROMPTS[0], max_tokens=100)  # 104 slots > 64: it would block every other request
    rid = engine.add_request(PROMPTS[0], max_tokens=59, stop_token_ids=[])  # 64 tokens: exactly the pool
    assert len(drain(engine)[rid]) == 59
    assert_all_blocks_free(engine)


def test_abort_leaves_nothing_behind(model_dir, weights):
    engine = Engine(model(weights, 64), Tokenizer.load(model_dir), max_batch=32)
    for _ in range(3):
        ids = [engine.add_request(PROMPTS[i % 3], max_tokens=20) for i in range(24)]
        engine.step()  # every request emitted a token through its decoder
        assert len(engine.decoders) == sum(r.finished is None for r in engine.running)
        for i in ids:
            engine.abort(i)
        assert not engine.has_work()
        assert_all_blocks_free(engine)


# ---- failures inside step() --------------------------------------------------------------------------------------

def _fail_on_call(monkeypatch, obj, name: str, n: int, exc: BaseException) -> None:
    """Make the n-th call of obj.name raise exc (once)."""
    real = getattr(obj, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise exc
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)


POINTS = [("engine", "_prefill", 1), ("engine", "_sample", 1), ("engine", "_decode", 3), ("kv", "append_tokens", 4),
          ("kv", "mark_computed", 2), ("kv", "batch", 3), ("engine", "_emit", 5), ("engine", "_admit", 2)]


@pytest.mark.parametrize("where,name,n", POINTS)
def test_keyboard_interrupt_in_a_step_rolls_every_request_back(weights, alone, monkeypatch, where, name, n):
    engine = Engine(model(weights, 8), max_batch=4)
    ids = [engine.add_request(p, max_tokens=40, stop_token_ids=[]) for p in PROMPTS]
    _fail_on_call(monkeypatch, engine if where == "engine" else engine.kv, name, n, KeyboardInterrupt())
    outs: dict[int, list[int]] = {}
    with pytest.raises(KeyboardInterrupt):
        drain(engine, outs)
    assert not engine.running and engine.kv.num_free_blocks == engine.kv.num_blocks  # nothing held
    assert {r.id for r in engine.waiting} == {i for i in ids if len(outs.get(i, [])) < 40}  # nothing lost
    assert engine.stats["failed_steps"] == 1
    drain(engine, outs)  # resumes where the last good step left each request
    assert [outs[i] for i in ids] == [alone[i] for i in range(len(PROMPTS))]
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("where,name,n", POINTS[:5])
def test_an_exception_in_a_step_finishes_its_requests_with_an_error(weights, alone, monkeypatch, where, name, n):
    engine = Engine(model(weights, 8), max_batch=2)
    ids = [engine.add_request(p, max_tokens=40, stop_token_ids=[]) for p in PROMPTS]
    _fail_on_call(monkeypatch, engine if where == "engine" else engine.kv, name, n, RuntimeError("injected"))
    outs: dict[int, list[int]] = {}
    with pytest.raises(RuntimeError, match="injected"):
        drain(engine, outs)
    assert not engine.running and engine.kv.num_free_blocks == engine.kv.num_blocks
    events = engine.step()  # the failed requests' error events come first
    errors = [e.request_id for e in events if e.finished == "error"]
    assert errors and all(e.token is None for e in events if e.finished == "error")
    for e in events:
        if e.token is not None:
            outs.setdefault(e.request_id, []).append(e.token)
    drain(engine, outs)
    for i, rid in enumerate(ids):
        if rid in errors:
            assert outs.get(rid, []) == alone[i][:len(outs.get(rid, []))]  # what it had streamed was right
        else:
            assert outs[rid] == alone[i]  # the others are untouched
    assert_all_blocks_free(engine)
    again = engine.add_request(PROMPTS[2], max_tokens=40, stop_token_ids=[])  # and the engine works
    assert drain(engine)[again] == alone[2]


def _interrupt_at_line(k: int, count: list[int] | None = None):
    """A tracer that raises KeyboardInterrupt at the k-th line executed in the engine or the KV manager (k 0:
    never; `count` receives the lines seen)."""
    files = {str(Path(m.__file__)) for m in (sys.modules["vkgraph.nn.engine"], sys.modules["vkgraph.nn.kv_cache"])}
    count = [0] if count is None else count

    def local(frame, event, arg):
        if event == "line":
            count[0] += 1
            if count[0] == k:
                raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename in files else None

    return tracer


def _workload_lines(weights) -> int:
    engine = Engine(model(weights, 8), max_batch=4)
    for p in PROMPTS:
        engine.add_request(p, max_tokens=12, stop_token_ids=[])
    count = [0]
    sys.settrace(_interrupt_at_line(0, count))
    try:
        drain(engine)
    finally:
        sys.settrace(None)
    return count[0]


def _interrupt_anywhere(weights, alone, points: int) -> None:
    total = _workload_lines(weights)
    for k in range(1, total, max(1, total // points)):
        engine = Engine(model(weights, 8), max_batch=4)
        ids = [engine.add_request(p, max_tokens=12, stop_token_ids=[]) for p in PROMPTS]
        outs: dict[int, list[int]] = {}
        sys.settrace(_interrupt_at_line(k))
        try:
            with pytest.raises(KeyboardInterrupt):
                drain(engine, outs)
        finally:
            sys.settrace(None)
        drain(engine, outs)
        assert [outs[i] for i in ids] == [alone[i][:12] for i in range(len(PROMPTS))], k
        assert_all_blocks_free(engine)


def test_keyboard_interrupt_at_any_line_of_a_step(weights, alone):
    """Ctrl-C lands wherever the interpreter is, inside the KV manager's bookkeeping too."""
    _interrupt_anywhere(weights, alone, 6)


@pytest.mark.slow
def test_keyboard_interrupt_at_any_line_of_a_step_long(weights, alone):
    _interrupt_anywhere(weights, alone, 300)


# ---- the command line ----------------------------------------------------------------------------------------------

def test_command_line_prompts_that_together_outgrow_the_pool(model_dir, capsys):
    """Each prompt fits the 2 blocks alone, both together do not: the second waits or is preempted, and both
    texts come out whole."""
    from vkgraph import generate

    rc = generate.main(["--model", str(model_dir), "--prompt", "Hello", "--prompt", "The lazy dog",
                        "--num-blocks", "2", "--max-tokens", "20"])
    out = capsys.readouterr().out
    assert rc == 0 and out.count("--- ") == 2
    for p in ("Hello", "The lazy dog"):
        assert len(generate_texts(out)[p]) > len(p)


def test_command_line_ctrl_c_keeps_the_output_so_far(model_dir, capsys, monkeypatch):
    from vkgraph import generate

    real, calls = Engine.step, [0]

    def step(self):
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt
        return real(self)

    monkeypatch.setattr(Engine, "step", step)
    rc = generate.main(["--model", str(model_dir), "--prompt", "Hello", "--prompt", "The lazy dog",
                        "--max-tokens", "20"])
    out = capsys.readouterr().out
    assert rc == 130
    texts = generate_texts(out)
    assert all(len(texts[p]) > len(p) for p in ("Hello", "The lazy dog"))  # three steps' text, printed


def generate_texts(out: str) -> dict[str, str]:
    """The multi-prompt output of the command line: prompt -> its text."""
    texts = {}
    for part in out.split("--- ")[1:]:
        head, _, body = part.partition("\n")
        texts[head.strip("'\"")] = body.rstrip("\n")
    return texts


def test_a_stop_string_across_streamed_pieces_is_never_streamed(model_dir, weights):
    """The start of a stop string may arrive a token before its end: it is held back, not streamed."""
    tok = Tokenizer.load(model_dir)
    engine = Engine(model(weights, 16), tok, max_batch=4)
    prompt = tok.encode("Hello world!")
    pieces = [e.text for e in engine.generate([prompt], max_tokens=16, stop_token_ids=[])]
    full = "".join(pieces)
    bounds = [sum(len(p) for p in pieces[:i]) for i in range(1, len(pieces))]
    spanning = [b for b in bounds if 0 < b < len(full) - 1 and full[b - 1:b + 1] not in full[:b - 1]]
    assert spanning, pieces
    for b in spanning[:4]:
        stop = full[b - 1:b + 1]  # its first character ends one piece, its second begins the next
        events = list(engine.generate([prompt], max_tokens=16, stop=[stop], stop_token_ids=[]))
        assert "".join(e.text for e in events) == full[:full.index(stop)] and events[-1].finished == "stop"
    assert_all_blocks_free(engine)


def test_a_seeded_request_samples_the_same_alone_in_a_batch_and_when_preempted(weights):
    from vkgraph.nn.sampling import SamplingParams

    seeded = SamplingParams(temperature=1.0, seed=1234)
    engine = Engine(model(weights, 16), max_batch=4)
    rid = engine.add_request(PROMPTS[1], seeded, max_tokens=40, stop_token_ids=[])
    alone = drain(engine)[rid]
    other = SamplingParams(temperature=1.0, top_k=50)
    crowded = Engine(model(weights, 8), max_batch=4, seed=5)  # too few blocks for all three: preemption
    ids = [crowded.add_request(PROMPTS[0], other, max_tokens=40, stop_token_ids=[]),
           crowded.add_request(PROMPTS[1], seeded, max_tokens=40, stop_token_ids=[]),
           crowded.add_request(PROMPTS[2], other, max_tokens=40, stop_token_ids=[])]
    outs = drain(crowded)
    assert crowded.stats["preemptions"] > 0
    assert outs[ids[1]] == alone
    rid = engine.add_request(PROMPTS[1], SamplingParams(temperature=1.0, seed=4321), max_tokens=40,
                             stop_token_ids=[])
    assert drain(engine)[rid] != alone
