"""Bad input raises a clear error while the graph is built, before any GPU work; custom ops enter the graph."""

from __future__ import annotations

import numpy as np
import pytest

from vkgraph import graph as g
from vkgraph.dtype import dtypes
from vkgraph.realize import count_kernels
from vkgraph.tensor import Tensor, cat, custom


@pytest.fixture
def x():
    return Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))


CASES = [
    (lambda x: x + Tensor(np.zeros((2, 4), np.float32)), ValueError, "do not broadcast"),
    (lambda x: x.sum(2), IndexError, "axis 2 is out of range"),
    (lambda x: x.max((0, 0)), ValueError, "repeated axis"),
    (lambda x: x.permute(0, 0), ValueError, "not a permutation"),
    (lambda x: x.reshape(5, 3), ValueError, "cannot reshape"),
    (lambda x: x.expand(2, 4), ValueError, "cannot expand"),
    (lambda x: x[3], IndexError, "out of range"),
    (lambda x: x[0, -5], IndexError, "out of range"),
    (lambda x: x[0, 0, 0], IndexError, "too many indices"),
    (lambda x: x[[0, 3]], IndexError, "out of range"),
    (lambda x: x[np.array([0.5])], IndexError, "must be integers"),
    (lambda x: x & x, TypeError, "not defined for dtypes.float32"),
    (lambda x: x << 1, TypeError, "not defined"),
    (lambda x: ~x, TypeError, "not defined"),
    (lambda x: x.bitcast("int16"), TypeError, "item sizes differ"),
    (lambda x: x.cast("complex64"), TypeError, "dtype"),
    (lambda x: Tensor(np.zeros(3, np.uint64)), TypeError, "no vkgraph equivalent"),
    (lambda x: x @ Tensor(np.zeros((3, 2), np.float32)), ValueError, "inner dimensions"),
    (lambda x: x.bool() - x.bool(), TypeError, "sub is not defined"),
    (lambda x: -(x.bool()), TypeError, "negation of a bool"),
    (lambda x: cat([x, Tensor(np.zeros((2, 5), np.float32))], 0), ValueError, "differ outside axis"),
    (lambda x: x.split([1, 1], 0), ValueError, "do not add up"),
    (lambda x: x.pad(((1, 1),)), ValueError, "pairs"),
    (lambda x: x.gelu("fast"), ValueError, "approximate"),
    (lambda x: x.layer_norm(5), ValueError, "normalized_shape"),
    (lambda x: Tensor.arange(0, 5, 0), ValueError, "step"),
    (lambda x: Tensor.randint(5, 5), ValueError, "empty range"),
]


@pytest.mark.parametrize("fn,exc,msg", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_input_raises_before_gpu_work(x, fn, exc, msg):
    with count_kernels() as c:
        with pytest.raises(exc, match=msg):
            fn(x)
    assert c.count == 0


def test_setitem_shape_mismatch(x):
    with pytest.raises(ValueError, match="cannot assign"):
        x[0] = Tensor(np.zeros(3, np.float32))


ADD_ONE = """#version 450
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) readonly buffer A { float a[]; };
layout(set = 0, binding = 1) writeonly buffer B { float b[]; };
layout(push_constant) uniform P { uint n; } pc;
void main() { uint i = gl_GlobalInvocationID.x; if (i < pc.n) b[i] = a[i] + 1.0; }
"""


def _add_one(dev, out, inputs):
    k = dev.pipeline(ADD_ONE, name="add_one")
    n = out.size // 4
    dev.dispatch(k, [inputs[0], out], groups=((n + 63) // 64, 1, 1), push={"n": n})


def test_custom_op_enters_the_graph_and_fuses_around():
    a = np.arange(100, dtype=np.float32)
    t = Tensor(a)
    y = custom(_add_one, [t * 2], t.shape, dtypes.float32, key=("add_one",), name="add_one")
    out = (y * 3).sum()
    with count_kernels() as c:
        got = out.numpy()
    assert c.count == 3 and "add_one" in c.names  # producer, the custom op, the consumer
    np.testing.assert_allclose(got, ((a * 2 + 1) * 3).sum(), rtol=1e-6)
    again = custom(_add_one, [t * 2], t.shape, dtypes.float32, key=("add_one",), name="add_one")
    assert again.node is y.node
    assert isinstance(y.node.arg, g.CustomOp)
