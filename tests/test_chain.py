"""Chained dispatches (runtime/chain.py): kernels that wait for the dispatch before them inside themselves give what
the same kernels behind barriers give, eagerly, in captured graphs replayed again and again, and past a flags reset."""

import numpy as np
import pytest

from vkgraph import Tensor
from vkgraph.nn import tiny_model
from vkgraph.nn.layers import StepInputs
from vkgraph.nn.llama import LlamaModel
from vkgraph.nn.weights import load_weights
from vkgraph.quant import random_blocks
from vkgraph.runtime import chain, get_device
from vkgraph.runtime.interface import parse_interface
from vkgraph.templates import matvec as mv
from vkgraph.templates import norms

N, K = 256, 256  # a square product, so that its output feeds the next link's norm


def needs_int_dot():
    if not get_device().info.integer_dot_product:
        pytest.skip("no shaderIntegerDotProduct on this device")


def test_the_flags_binding_orders_nothing_and_macro_qualifiers_parse():
    iface = parse_interface("""#version 450
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) CHAIN_COHERENT readonly buffer X { float x[]; };
layout(set = 0, binding = 1) CHAIN_COHERENT buffer Y { float y[]; };
layout(set = 0, binding = 2) coherent volatile buffer ChainFlags { uint chain_flags[]; };
void main() {}
""")
    assert [(b.name, b.written) for b in iface.bindings] == [("X", False), ("Y", True), ("ChainFlags", False)]


def test_chain_flag_values(monkeypatch):
    dev = get_device()
    monkeypatch.setenv("VKGRAPH_CHAIN", "0")
    assert not chain.enabled(dev)
    monkeypatch.setenv("VKGRAPH_CHAIN", "1")
    assert chain.enabled(dev)
    monkeypatch.setenv("VKGRAPH_CHAIN", "yes")
    with pytest.raises(ValueError, match="VKGRAPH_CHAIN"):
        chain.enabled(dev)


class Links:
    """`links` rounds of (rmsnorm_q8, matvec) over one weight: each kernel reads what the one before wrote, as in a
    decode step. Built under the VKGRAPH_CHAIN value set when it is made (kernels are cached on its weights)."""

    def __init__(self, dev, rng, links: int):
        self.dev = dev
        self.w = mv.upload_weights(dev, random_blocks(rng, "Q4_0", N, K, d_range=(1e-2, 2e-2)))
        self.gamma = dev.alloc(K * 4)
        dev.upload(self.gamma, (1 + 0.1 * rng.standard_normal(K)).astype(np.float32))
        self.x = dev.alloc(K * 4)
        self.acts = dev.alloc(mv.Q8Acts.layout(1, K)[0])
        self.ys = [dev.alloc(N * 4) for _ in range(2)]
        self.links = links

    def record(self) -> None:
        src = self.x
        for i in range(self.links):
            norms.rmsnorm_q8(self.dev, src, self.gamma, 1, K, out=self.acts)
            src = mv.matvec(self.dev, self.w, mv.Q8Acts.in_buffer(self.acts, 1, K), 1, out=self.ys[i % 2])

    def run(self, x: np.ndarray) -> np.ndarray:
        self.dev.upload(self.x, x)
        self.record()
        return self.dev.download(self.ys[(self.links - 1) % 2], np.float32, (N,))


def test_a_chain_of_products_equals_the_same_behind_barriers(monkeypatch):
    dev = get_device()
    needs_int_dot()
    rng = np.random.default_rng(0)
    x = rng.standard_normal(K).astype(np.float32)
    monkeypatch.setenv("VKGRAPH_CHAIN", "0")
    want = Links(dev, np.random.default_rng(1), 6).run(x)
    monkeypatch.setenv("VKGRAPH_CHAIN", "1")
    links = Links(dev, np.random.default_rng(1), 6)
    before = dev.queue.stats["chained"]
    got = links.run(x)
    # every kernel after the first waits for the one before it: 11 of the 12, unless a flags reset came between
    assert dev.queue.stats["chained"] - before >= 10
    np.testing.assert_array_equal(got, want)


def test_chained_graphs_replay_and_slots_wrap(monkeypatch):
    """A captured chain replayed with new inputs (its flags are zeroed at its start, so no replay sees the one
    before's), eager chains running out of slots between (a reset kernel clears them), and the eager flags
    untouched by the graph's."""
    dev = get_device()
    needs_int_dot()
    monkeypatch.setenv("VKGRAPH_CHAIN", "0")
    ref = Links(dev, np.random.default_rng(2), 4)
    monkeypatch.setenv("VKGRAPH_CHAIN", "1")
    monkeypatch.setattr(chain, "SLOTS", 5)  # a reset every 5 links
    links = Links(dev, np.random.default_rng(2), 4)
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(K).astype(np.float32) for _ in range(4)]
    monkeypatch.setenv("VKGRAPH_CHAIN", "0")
    wants = [ref.run(x) for x in xs]
    monkeypatch.setenv("VKGRAPH_CHAIN", "1")
    links.run(xs[0])  # compiles
    q = dev.queue
    q.begin_capture()
    links.record()
    graph = q.end_capture()
    try:
        for x, want in zip(xs, wants):
            dev.upload(links.x, x)
            graph.replay()
            np.testing.assert_array_equal(dev.download(links.ys[1], np.float32, (N,)), want)
            # eagerly, in between: the eager slots, 8 dispatches past a reset or two
            np.testing.assert_array_equal(links.run(x), want)
    finally:
        graph.destroy()


@pytest.fixture(scope="module")
def head32_model(tmp_path_factory):
    paths = tiny_model.write_model(tmp_path_factory.mktemp("chain"),
                                   tiny_model.tiny_config(n_heads=2, n_kv_heads=1, head_dim=32),
                                   gguf_types=("Q4_0",), safetensors=False)
    return paths["Q4_0"]


@pytest.mark.parametrize("int_dot", ["1", "0"])
def test_a_decode_step_chained_equals_it_behind_barriers(head32_model, int_dot, monkeypatch):
    """The fused decode step (q/k/v with its norm, the attention writing the new token and int8 rows, the products
    with their epilogues) chains most of its kernels and gives the same logits bit for bit."""
    dev = get_device()
    if int_dot == "1":
        needs_int_dot()
    monkeypatch.setenv("VKGRAPH_INT_DOT", int_dot)

    def step(mode: str) -> tuple[np.ndarray, int]:
        monkeypatch.setenv("VKGRAPH_CHAIN", mode)
        model = LlamaModel(load_weights(head32_model, progress=False), num_blocks=48, block_size=16, kv_dtype="f32",
                           max_blocks_per_seq=6, float_dtype="float32")
        prompt = [5, 17, 42, 99, 7, 3]
        n = len(prompt)
        pos = Tensor(np.arange(n, dtype=np.int32))
        model(Tensor(np.array(prompt, np.int32)), StepInputs(pos, pos, cu_seqlens=Tensor(np.array([0, n], np.int32)),
                                                             max_seq_len=n)).numpy()
        before = dev.queue.stats["chained"]
        one = Tensor(np.array([n], np.int32))
        got = model(Tensor(np.array([11], np.int32)), StepInputs(
            one, one, block_tables=Tensor(np.array([[0, 1, 2, 3, 4, 5]], np.int32)),
            context_lens=Tensor(np.array([n + 1], np.int32)))).numpy()
        return got, dev.queue.stats["chained"] - before

    chained, links = step("1")
    plain, none = step("0")
    # on the float path generated kernels (norms, the gated unit) part most of the templates
    assert none == 0 and links >= (8 if int_dot == "1" else 1)
    np.testing.assert_array_equal(chained, plain)
