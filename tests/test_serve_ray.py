"""Replicas on Ray Serve (vkgraph/serve/ray.py): two replicas on this machine's device behind one ingress,
driven with the official openai client: both serve, a prompt prefix keeps to one replica, and killing a
replica loses no request that had not started answering. Slow (starts Ray): `pytest -m slow`."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")
pytest.importorskip("ray.serve")

from ray import serve  # noqa: E402
from test_serve import CHAT_TEMPLATE, free_port  # noqa: E402

from vkgraph.nn import tiny_model as mk  # noqa: E402
from vkgraph.serve.ray import build_app, routing_text  # noqa: E402

pytestmark = pytest.mark.slow


def test_routing_text_reads_prompts_and_messages():
    assert routing_text(b'{"prompt": "abc"}') == "abc"
    assert routing_text(b'{"prompt": [5, 6]}') == routing_text(b'{"prompt": [5, 6]}') != ""
    assert routing_text(b'{"messages": [{"role": "user", "content": "hi"}]}') == "hi"
    assert routing_text(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}') == "x"
    assert routing_text(b"not json") == "" and routing_text(b"[1]") == ""
    assert len(routing_text(json.dumps({"prompt": "a" * 5000}).encode())) == 1024


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = mk.write_model(tmp_path_factory.mktemp("ray"), mk.tiny_config(n_layers=1), gguf_types=())["hf"]
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE,
                                                         "bos_token": "<|begin_of_text|>"}))
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        argv = ["--model", str(d), "--served-model-name", "tiny", "--num-blocks", "64", "--max-context", "256",
                "--log-level", "warning"]
        serve.run(build_app(argv, replicas=2, cpus_per_replica=1), name="vkgraph", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def complete(client, prompt: str, **kw):
    """(text, replica) of a greedy completion."""
    raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt, temperature=0,
                                                      **({"max_tokens": 8} | kw))
    return raw.parse().choices[0].text, raw.headers["x-vkgraph-replica"]


def replicas() -> set[str]:
    """Ids of the Replica deployment's live replica actors (Ray names them SERVE_REPLICA::app#deployment#id)."""
    prefix = "SERVE_REPLICA::vkgraph#Replica#"
    return {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def test_two_replicas_serve_and_a_prefix_keeps_to_one(cluster):
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0)
    prompts = [f"{i} shared system prompt, then question {i}" for i in range(12)]
    first = [complete(client, p) for p in prompts]
    assert len({r for _, r in first}) == 2  # both replicas answered some
    again = [complete(client, p) for p in prompts]
    assert again == first  # the same prompt: the same replica, the same greedy text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)


def test_a_dead_replica_loses_no_request_that_can_be_retried(cluster):
    client = openai.OpenAI(base_url=cluster + "/v1", api_key="none", max_retries=0, timeout=300)
    prompts = [f"q{i}" for i in range(8)]  # under one KV block: no prefix-cache hit changes the arithmetic
    alone = [complete(client, p, max_tokens=220) for p in prompts]
    before = replicas()
    victim = alone[0][1]
    assert len(before) == 2 and victim in before and sum(r == victim for _, r in alone) < len(prompts)
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(complete, client, p, max_tokens=220) for p in prompts]
        time.sleep(0.5)  # requests in flight: none has answered yet (not streamed: the answer is whole)
        ray.kill(ray.get_actor(f"SERVE_REPLICA::vkgraph#Replica#{victim}", namespace="serve"), no_restart=True)
        got = [f.result() for f in futures]
    assert [t for t, _ in got] == [t for t, _ in alone]  # every request answered, as it was alone
    assert sum(r == victim for _, r in got) < sum(r == victim for _, r in alone)  # some were retried elsewhere
    deadline = time.monotonic() + 120  # Ray replaces the dead replica
    while time.monotonic() < deadline and (len(replicas()) < 2 or victim in replicas()):
        time.sleep(1)
    assert len(replicas()) == 2 and victim not in replicas()
    assert complete(client, prompts[0], max_tokens=220)[0] == alone[0][0]
