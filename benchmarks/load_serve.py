"""Load test of `python -m vkgraph.serve`: concurrent streaming clients on the loopback interface.

    python benchmarks/load_serve.py --clients 32 --duration 60 --check           # lavapipe, tiny model: correctness
    python benchmarks/load_serve.py --model /tmp/m8b/model-q4_0.gguf --clients 1,8,32,64 --duration 10  # H200

The script writes a random-weight model (the tiny shape, or the Llama-3-8B shape as Q4_0 GGUF) unless --model
is given, starts the server on a free 127.0.0.1 port, and for each concurrency level runs that many clients,
each streaming greedy completions back to back for --duration seconds. It prints, per level: requests, output
tokens/s over the level's wall time, time to first token and time per output token (p50/p90/p99, from each
request's own stream; the clients ask for logprobs 0, so every token arrives in a chunk of its own).

--check (meant for small models) first runs every prompt alone, then holds every response under load to it:
the same greedy text, token count and finish (no request lost, cut or duplicated), or the same tokens up to a
near-tie (--near-tie nats between the alone run's first and second choice, where the load took the second: a
batch runs other kernels than one row, whose sums round differently); at the end the server's
KV blocks must be back to 0, and within each level, after its first quarter (by then every batch size has been
captured), the server's resident memory must not grow past --rss-slack MiB. Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
# the checkout first, then what PYTHONPATH already holds (dependencies may live in a folder on it)
CHILD_PYTHONPATH = os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "Once upon a time there was a little",
           "What is the capital of France?", "one two three four five six", "Vulkan compute shaders read weights,",
           "A lazy tensor waits until the last moment", "Hello, tiny model."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_model(preset: str, out: Path) -> Path:
    sys.path.insert(0, str(ROOT))
    from vkgraph.nn import tiny_model as mk

    if preset == "llama3-8b":
        return mk.write_model(out, mk.llama3_8b_config(), gguf_types=("Q4_0",), safetensors=False,
                              random_quants=True)["Q4_0"]
    return mk.write_model(out, mk.tiny_config(n_layers=2), gguf_types=())["hf"]


def start_server(model: Path, args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=CHILD_PYTHONPATH)
    proc = subprocess.Popen([sys.executable, "-m", "vkgraph.serve", "--model", str(model), "--port", str(port),
                             "--served-model-name", "m", "--log-level", "warning", *args], env=env, cwd=ROOT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start within 600 s")


def metric(url: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", httpx.get(url + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def rss_mib(pid: int) -> float:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024


def _sample_rss(pid: int, out: list[float], done: threading.Event) -> None:
    while True:
        out.append(rss_mib(pid))
        if done.wait(1.0):
            out.append(rss_mib(pid))
            return


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, top: int = 0) -> dict:
    """One streamed greedy completion: its text, tokens (names and log-probabilities, with the `top` most likely
    alternatives at each position), finish reason and timings."""
    # logprobs 0 gives every token a chunk of its own: a random-weight model mostly samples reserved tokens, whose
    # empty text is otherwise carried by the next chunk with text, which would time the first token late
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "logprobs": top, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    text, usage, finish = "", None, None
    tokens: list[tuple[str, float, dict]] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"status": 500, "error": chunk["error"]}
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                if first is None:
                    first = time.perf_counter()
                text += c["text"]
                finish = c["finish_reason"] or finish
                lp = c.get("logprobs") or {}
                tokens += zip(lp.get("tokens", []), lp.get("token_logprobs", []), lp.get("top_logprobs") or
                              [{}] * len(lp.get("tokens", [])))
    end = time.perf_counter()
    n = usage["completion_tokens"] if usage else 0
    return {"status": 200, "text": text, "tokens": n, "finish": finish, "steps": tokens, "ttft": (first or end) - t0,
            "tpot": (end - (first or end)) / max(1, n - 1), "prompt": prompt}


async def level(url: str, clients: int, duration: float, max_tokens: int) -> tuple[list[dict], float]:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        stop_at = time.perf_counter() + duration
        results: list[dict] = []

        async def worker(i: int) -> None:
            k = i
            while time.perf_counter() < stop_at:
                results.append(await one_request(client, url, PROMPTS[k % len(PROMPTS)], max_tokens))
                k += clients

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(clients)))
        return results, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="a model to serve (default: write one of --preset)")
    ap.add_argument("--preset", choices=("tiny", "llama3-8b"), default="tiny")
    ap.add_argument("--clients", default="32", help="comma-separated concurrency levels")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: enough for every client)")
    ap.add_argument("--check", action="store_true", help="hold every response to the prompt run alone")
    ap.add_argument("--near-tie", type=float, default=1e-2,
                    help="nats within which a response under load may take the alone run's second token (--check)")
    ap.add_argument("--rss-slack", type=float, default=32.0, help="MiB the server may grow in a level (--check)")
    a = ap.parse_args()
    levels = [int(c) for c in a.clients.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or write_model(a.preset, Path(tmp))
        blocks = a.num_blocks or max(levels) * (-(-(a.max_tokens + 32) // 16) + 1)
        proc, url = start_server(model, ["--max-batch", str(max(levels)), "--max-pending", str(4 * max(levels)),
                                         "--num-blocks", str(blocks), "--max-context", "256"])
        failures: list[str] = []
        try:
            want = {p: asyncio.run(_alone(url, p, a.max_tokens)) for p in PROMPTS} if a.check else {}
            print(f"model {model.name}, max_tokens {a.max_tokens}, {blocks} KV blocks")
            print("clients  requests  out tok/s   ttft p50/p90/p99 ms      tpot p50/p90/p99 ms   rss MiB (after)")
            near_ties: list[float] = []
            for c in levels:
                asyncio.run(_warm(url, c))
                samples: list[float] = []
                sampling = threading.Event()
                sampler = threading.Thread(target=_sample_rss, args=(proc.pid, samples, sampling))
                sampler.start()
                results, wall = asyncio.run(level(url, c, a.duration, a.max_tokens))
                sampling.set()
                sampler.join()
                rss = samples[-1]
                # after the first quarter every batch size has been seen and captured: the rest must be flat
                steady = samples[len(samples) // 4:]
                if a.check and max(steady) - steady[0] > a.rss_slack:
                    failures.append(f"{c} clients: server memory grew {max(steady) - steady[0]:.1f} MiB after the "
                                    "first quarter of the level")
                ok = [r for r in results if r["status"] == 200]
                toks = sum(r["tokens"] for r in ok)
                ttft = [1000 * r["ttft"] for r in ok]
                tpot = [1000 * r["tpot"] for r in ok]
                print(f"{c:7d}  {len(results):8d}  {toks / wall:9.1f}   "
                      f"{pct(ttft, .5):6.1f} {pct(ttft, .9):6.1f} {pct(ttft, .99):7.1f}   "
                      f"{pct(tpot, .5):6.1f} {pct(tpot, .9):6.1f} {pct(tpot, .99):7.1f}   {rss:7.1f}", flush=True)
                if len(ok) != len(results):
                    failures.append(f"{c} clients: {len(results) - len(ok)} requests failed")
                for r in ok:
                    got = (r["text"], r["tokens"], r["finish"])
                    if r["finish"] not in ("length", "stop") or r["finish"] == "length" and r["tokens"] != a.max_tokens:
                        failures.append(f"{c} clients: {r['tokens']} tokens ({r['finish']}) for {r['prompt']!r}")
                    elif a.check and got != want[r["prompt"]][:3]:
                        why, gap = _diverges(r["steps"], want[r["prompt"]][3], a.near_tie)
                        if why:
                            failures.append(f"{c} clients: the response to {r['prompt']!r} differs from it alone: "
                                            f"{why}")
                        else:
                            near_ties.append(gap)
            if a.check:
                print(f"{len(near_ties)} responses left the alone run's tokens at a near-tie (largest gap "
                      f"{max(near_ties, default=0):.2g} nats; at most {a.near_tie} allowed)")
                time.sleep(0.5)
                if metric(url, "vkgraph_kv_blocks_used") != 0:
                    failures.append(f"{metric(url, 'vkgraph_kv_blocks_used')} KV blocks still held at the end")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    for f in failures[:20]:
        print("FAIL:", f)
    print("ok" if not failures else f"{len(failures)} failures")
    return 1 if failures else 0


async def _warm(url: str, clients: int) -> None:
    """One short request per client at once: the engine captures its step for this batch size."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=clients + 4)) as c:
        await asyncio.gather(*(one_request(c, url, PROMPTS[i % len(PROMPTS)], 4) for i in range(clients)))


async def _alone(url: str, prompt: str, max_tokens: int) -> tuple[str, int, str, list]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        r = await one_request(client, url, prompt, max_tokens, top=2)
        return r["text"], r["tokens"], r["finish"], r["steps"]


def _diverges(got: list, alone: list, near_tie: float) -> tuple[str, float]:
    """Why a response under load is not the request run alone ("" where the two leave each other at a near-tie),
    and the gap in nats where they part:
    at the first token where they differ, the alone run ranked the token taken under load second, within
    `near_tie` nats of its first. Sums in another order (a batch takes other kernels than one row) move logits by
    rounding, so such a tie may fall either way; a response mixed up with another request's diverges elsewhere."""
    for i, ((tok, _, _), (want_tok, want_lp, top)) in enumerate(zip(got, alone)):
        if tok != want_tok:
            gap = want_lp - top[tok] if tok in top else float("inf")
            return ("" if gap <= near_tie else f"token {i} is {tok!r} where alone it was {want_tok!r} "
                    f"(gap {gap:.3g} nats)"), gap
    if len(got) != len(alone):
        return f"{len(got)} tokens where alone there were {len(alone)}", float("inf")
    return "the same tokens, another text or finish", float("inf")


if __name__ == "__main__":
    raise SystemExit(main())
