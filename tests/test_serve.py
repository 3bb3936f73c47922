"""The OpenAI-compatible server: the real process on a free loopback port, driven by the official `openai`
client (streaming and not) and by raw HTTP for malformed bodies, backpressure, disconnects and shutdown."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from reference_llama import ReferenceLlama

openai = pytest.importorskip("openai")

from vkgraph.nn import tiny_model as mk  # noqa: E402
from vkgraph.nn.tokenizer import Tokenizer  # noqa: E402
from vkgraph.nn.weights import load_weights  # noqa: E402
from vkgraph.serve.logprobs import TokenNames  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# the checkout first, then what PYTHONPATH already holds (dependencies may live in a folder on it)
CHILD_PYTHONPATH = os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MAX_PENDING = 6


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH)
        self.proc = subprocess.Popen([sys.executable, "-m", "vkgraph.serve", "--model", str(model), "--port",
                                     str(self.port), "--served-model-name", "tiny", "--log-level", "warning", *args],
                                    env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not start")

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self) -> tuple[int, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return self.proc.returncode, out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = mk.write_model(tmp_path_factory.mktemp("serve"), mk.tiny_config(n_layers=1), gguf_types=())["hf"]
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE,
                                                         "bos_token": "<|begin_of_text|>"}))
    return d


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir, "--max-pending", str(MAX_PENDING), "--num-blocks", "64", "--max-context", "256")
    yield s
    s.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def complete(client, prompt, **kw):
    kw = {"max_tokens": 12, "temperature": 0} | kw
    return client.completions.create(model="tiny", prompt=prompt, **kw)


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in ("vkgraph_requests_total", "vkgraph_prompt_tokens_total", "vkgraph_generation_tokens_total",
                 "vkgraph_time_to_first_token_seconds", "vkgraph_inter_token_latency_seconds",
                 "vkgraph_requests_waiting", "vkgraph_kv_blocks_used", "vkgraph_prefix_cache_hit_rate"):
        assert name in text, name


def test_completion_streamed_and_not(server, client):
    full = complete(client, "Hello world")
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == len(mk.build_tokenizer(300).encode("Hello world").ids)
    chunks = list(complete(client, "Hello world", stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_concurrent_greedy_requests_equal_each_alone(client):
    prompts = ["Hello world", "The lazy dog", "one two three", "Vulkan compute"]
    alone = [complete(client, p).choices[0].text for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: complete(client, p).choices[0].text, prompts))
    assert together == alone


def test_n_choices_stop_and_token_prompts(client):
    out = complete(client, [5, 17, 42], n=2)
    assert [c.index for c in out.choices] == [0, 1] and out.choices[0].text == out.choices[1].text
    text = complete(client, "Hello world", max_tokens=20).choices[0].text
    if len(text) >= 4:
        stop = text[2:4]
        cut = complete(client, "Hello world", max_tokens=20, stop=[stop]).choices[0]
        assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)]


def test_chat_completion_uses_the_chat_template(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    prompt = "<|begin_of_text|><|system|>Be brief.\n<|user|>Hello\n<|assistant|>"
    want = complete(client, mk.build_tokenizer(300).encode(prompt, add_special_tokens=False).ids, max_tokens=8)
    assert full.choices[0].message.content == want.choices[0].text
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == want.choices[0].text


def test_sampling_parameters(client):
    greedy = complete(client, "Hello", max_tokens=8).choices[0].text
    top1 = complete(client, "Hello", temperature=1.5, max_tokens=8, extra_body={"top_k": 1}).choices[0].text
    assert top1 == greedy  # top_k 1 leaves only the argmax, whatever the temperature
    tiny_p = complete(client, "Hello", temperature=1.5, top_p=1e-6, max_tokens=8).choices[0].text
    assert tiny_p == greedy  # as does a top_p below the largest probability
    sampled = {complete(client, "Hello", temperature=1.5, max_tokens=8,
                        extra_body={"min_p": 0.0}).choices[0].text for _ in range(3)}
    assert sampled != {greedy}
    seeded = [complete(client, "Hello", temperature=1.5, max_tokens=8, seed=s).choices[0].text for s in (7, 7, 8)]
    assert seeded[0] == seeded[1] != seeded[2]
    with pytest.raises(openai.BadRequestError):
        complete(client, "Hello", temperature=-1)


def test_errors_in_openai_shape(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, [5] * 250, max_tokens=20)
    assert e.value.body["code"] == "context_length_exceeded"
    for body, param in ((b"{not json", None), (b'{"model": "tiny"}', "prompt"),
                        (b'{"model": "tiny", "prompt": "x", "max_tokens": 0}', "max_tokens"),
                        (b'{"model": "tiny", "prompt": []}', "prompt"),
                        (b'{"model": "tiny", "messages": []}', "messages")):
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, body
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        if param:
            assert param in (err["param"] or err["message"]), (body, err)


def _blocks_back(server, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.metric("vkgraph_kv_blocks_used") == 0 and server.metric("vkgraph_requests_in_flight") == 0:
            return True
        time.sleep(0.1)
    return False


def test_a_client_that_disconnects_frees_its_blocks(server):
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert any(line.startswith("data: ") for line in got)
        assert server.metric("vkgraph_kv_blocks_used") > 0
    assert _blocks_back(server)


def test_a_client_that_gives_up_on_a_whole_response_frees_its_blocks(server):
    """Not streamed: the handler sees the disconnect, aborts the request, and ends (it does not wait forever)."""
    def aborted() -> float:
        return server.metric('vkgraph_requests_total{outcome="abort",route="completions"}')

    before = aborted()
    body = {"model": "tiny", "prompt": "Hello world", "max_tokens": 240, "temperature": 0, "n": 4}
    with pytest.raises(httpx.ReadTimeout):  # 240 decode steps of 4 rows take longer than this
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.15)
    assert _blocks_back(server)
    deadline = time.monotonic() + 10
    while aborted() == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted() == before + 1


def test_a_full_queue_answers_429(server, client):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 200, "temperature": 0}
    codes: list[int] = []
    start = threading.Barrier(MAX_PENDING + 6)

    def post() -> None:
        with httpx.Client(timeout=120) as c:
            c.get(server.url + "/health")  # connected before the race
            start.wait()
            codes.append(c.post(server.url + "/v1/completions", json=body).status_code)

    threads = [threading.Thread(target=post) for _ in range(MAX_PENDING + 6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes.count(200) >= MAX_PENDING and 429 in codes and set(codes) <= {200, 429}
    assert _blocks_back(server)


def test_graceful_shutdown_finishes_requests_in_flight(model_dir):
    s = Server(model_dir, "--num-blocks", "32", "--max-context", "256")
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 80, "temperature": 0}
    result: dict = {}

    def post() -> None:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=120)
        result["status"], result["json"] = r.status_code, r.json()

    t = threading.Thread(target=post)
    t.start()
    deadline = time.monotonic() + 30
    while s.metric("vkgraph_generation_tokens_total") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    rc, out = s.stop()
    t.join(60)
    assert result["status"] == 200 and result["json"]["usage"]["completion_tokens"] == 80, result
    assert rc in (0, -signal.SIGTERM), out  # uvicorn re-raises the signal once it has shut down cleanly
    assert "Traceback" not in out, out


@pytest.fixture(scope="module")
def reference(model_dir):
    """A numpy log-softmax of the model's logits (float64 reference forward), and token names back to ids."""
    ref = ReferenceLlama(load_weights(model_dir, progress=False))
    tok = Tokenizer.load(model_dir)
    names = TokenNames(tok)
    ids = {names.name(i): i for i in range(tok.vocab_size)}

    def log_softmax(prompt: list[int], generated: list[int]) -> np.ndarray:
        logits = ref.forward(prompt + generated)[len(prompt) - 1:-1]
        z = logits - logits.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    return tok, ids, log_softmax


def name_bytes(name: str) -> bytes:
    """A token's bytes from its OpenAI name (text, or "bytes:" and escapes for part of a character)."""
    if name.startswith("bytes:"):
        return bytes(int(h, 16) for h in name[len("bytes:"):].split("\\x")[1:])
    return name.encode()


LP_TOL = 1e-2  # the server keeps weights and KV cache in float16; the reference is float64


def test_completion_logprobs_equal_numpy_log_softmax(client, reference):
    tok, ids, log_softmax = reference
    kw = dict(max_tokens=10, temperature=1.0, seed=11, logprobs=3)  # sampled: not only the most likely tokens
    full = complete(client, "Hello world", **kw).choices[0]
    lp = full.logprobs
    assert len(lp.tokens) == 10  # a random model: tokens may hold parts of characters, named "bytes:\\x.."
    assert b"".join(name_bytes(t) for t in lp.tokens).decode("utf-8", "replace") == full.text
    generated = [ids[t] for t in lp.tokens]
    for j, offset in enumerate(lp.text_offset):  # where each token's text starts, once its characters are whole
        before = tok.decode(generated[:j])
        if not before.endswith("\ufffd"):
            assert offset == len(before), (j, lp.text_offset)
    want = log_softmax(tok.encode("Hello world"), generated)
    np.testing.assert_allclose(lp.token_logprobs, want[np.arange(10), generated], atol=LP_TOL)
    for j, top in enumerate(lp.top_logprobs):
        best = np.argsort(-want[j])[:3]
        assert set(top) == {lp.tokens[j], *(tok_name for tok_name, i in ids.items() if i in best)}
        for name, v in top.items():
            assert abs(v - want[j, ids[name]]) < LP_TOL
    assert any(want[j].argmax() != g for j, g in enumerate(generated))  # some draws were not the argmax
    chunks = [c.choices[0] for c in complete(client, "Hello world", stream=True, **kw)]
    streamed = [c.logprobs for c in chunks if c.logprobs is not None]
    assert [t for c in streamed for t in c.tokens] == lp.tokens
    # a later request may reuse the prompt's cached KV: the same values, computed another way
    np.testing.assert_allclose([v for c in streamed for v in c.token_logprobs], lp.token_logprobs, atol=LP_TOL)
    assert [o for c in streamed for o in c.text_offset] == lp.text_offset
    assert complete(client, "Hello world", max_tokens=4).choices[0].logprobs is None


def test_chat_logprobs_equal_numpy_log_softmax(client, reference):
    tok, ids, log_softmax = reference
    msgs = [{"role": "user", "content": "Hello"}]
    prompt = tok.encode("<|begin_of_text|><|user|>Hello\n<|assistant|>", add_special_tokens=False)
    kw = dict(model="tiny", messages=msgs, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**kw).choices[0]
    content = full.logprobs.content
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", "replace") == full.message.content
    generated = [ids[c.token] for c in content]
    want = log_softmax(prompt, generated)
    for j, c in enumerate(content):
        assert c.bytes == list(name_bytes(c.token))
        assert abs(c.logprob - want[j, generated[j]]) < LP_TOL
        assert [ids[t.token] for t in c.top_logprobs] == list(np.argsort(-want[j])[:2])
        assert c.top_logprobs[0].token == c.token  # greedy: the sampled token is the most likely
        np.testing.assert_allclose([t.logprob for t in c.top_logprobs], np.sort(want[j])[::-1][:2], atol=LP_TOL)
    streamed = [x for ch in client.chat.completions.create(stream=True, **kw) if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.content]
    assert [x.token for x in streamed] == [c.token for c in content]
    np.testing.assert_allclose([x.logprob for x in streamed], [c.logprob for c in content], atol=LP_TOL)
    plain = client.chat.completions.create(**(kw | {"top_logprobs": None})).choices[0].logprobs.content
    assert [c.top_logprobs for c in plain] == [[]] * len(plain)


def test_logprobs_requests_out_of_range_are_400(client):
    for kw in ({"logprobs": 21}, {"logprobs": -1}, {"echo": True}):
        with pytest.raises(openai.BadRequestError):
            complete(client, "Hello", **kw)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_logprobs=2)


def test_kv_prefix_tiers_serve_evicted_prefixes_from_disk_and_host_across_a_restart(model_dir, tmp_path):
    rng = np.random.default_rng(1)
    a, *others = ([int(t) for t in rng.integers(3, 250, 70)] for _ in range(4))  # 4 full blocks each
    args = ("--num-blocks", "12", "--max-context", "128", "--kv-disk-dir", str(tmp_path))

    def run(s: Server, prompt: list[int]):
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        ch = complete(c, prompt, max_tokens=6, logprobs=1).choices[0]
        return ch.text, ch.logprobs.token_logprobs

    def hits(s: Server, tier: str) -> float:
        return s.metric(f'vkgraph_prefix_cache_hit_tokens{{tier="{tier}"}}')

    s = Server(model_dir, *args)  # a disk tier only
    try:
        run(s, a)
        want = run(s, a)  # from its prefix still on the GPU
        assert hits(s, "gpu") == 64
        for p in others:
            run(s, p)
        assert s.metric("vkgraph_prefix_store_spilled_blocks") >= 4
        assert run(s, a) == want and hits(s, "disk") == 64
        assert s.metric('vkgraph_prefix_store_blocks{tier="disk"}') >= 4
        assert s.metric('vkgraph_prefix_store_read_bytes{tier="disk"}') > 0
        assert s.metric('vkgraph_prefix_store_read_seconds{tier="disk"}') > 0
    finally:
        s.stop()
    s = Server(model_dir, *args, "--kv-host-gib", "0.001")  # a restart, with a host tier too
    try:
        assert run(s, a) == want and hits(s, "disk") == 64  # from the files the first server left
        for p in others:
            run(s, p)
        assert run(s, a) == want and hits(s, "host") == 64  # disk hits were promoted to host memory
        assert s.metric('vkgraph_prefix_store_bytes{tier="host"}') > 0
        assert _blocks_back(s)
    finally:
        s.stop()
