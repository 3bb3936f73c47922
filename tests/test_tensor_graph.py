"""The graph: hash-consing, constant folding and identities (no GPU work)."""

from __future__ import annotations

import math

import numpy as np

from vkgraph import graph as g
from vkgraph.dtype import dtypes
from vkgraph.graph import Op, ReduceOp
from vkgraph.tensor import Tensor

f32, i8 = dtypes.float32, dtypes.int8


def test_equal_subgraphs_are_one_object():
    a = g.iota(5)
    x = g.alu(Op.CAST, f32, a)
    assert g.alu(Op.ADD, f32, x, g.const(2.0, f32, (5,))) is g.alu(Op.ADD, f32, x, g.const(2.0, f32, (5,)))
    assert g.reduce(x, ReduceOp.SUM, (0,)) is g.reduce(x, ReduceOp.SUM, (0,))
    assert g.const(0.0, f32) is not g.const(-0.0, f32)
    assert g.const(math.nan, f32) is g.const(math.nan, f32)


def test_constant_folding_uses_the_dtype():
    three = g.alu(Op.ADD, f32, g.const(1.0, f32), g.const(2.0, f32))
    assert three.op is Op.CONST and three.arg == 3.0
    wrapped = g.alu(Op.ADD, i8, g.const(100, i8), g.const(100, i8))
    assert wrapped.arg == -56
    assert g.alu(Op.IDIV, i8, g.const(-7, i8), g.const(2, i8)).arg == -4
    assert g.alu(Op.CMPLT, dtypes.bool, g.const(1, i8), g.const(2, i8)).arg is True
    assert g.alu(Op.CAST, dtypes.float16, g.const(1 / 3, f32)).arg == float(np.float16(1 / 3))


def test_identities_fold_away():
    x = g.alu(Op.CAST, f32, g.iota(4))
    zero, one = g.const(0.0, f32, (4,)), g.const(1.0, f32, (4,))
    neg_zero = g.const(-0.0, f32, (4,))
    # IEEE: x + -0.0 and x - 0.0 are x for every x; x + 0.0 and x - -0.0 are not (x = -0.0 gives 0.0)
    assert g.alu(Op.ADD, f32, x, neg_zero) is x and g.alu(Op.ADD, f32, neg_zero, x) is x
    assert g.alu(Op.SUB, f32, x, zero) is x
    assert g.alu(Op.ADD, f32, x, zero).op is Op.ADD and g.alu(Op.ADD, f32, zero, x).op is Op.ADD
    assert g.alu(Op.SUB, f32, x, neg_zero).op is Op.SUB
    assert g.alu(Op.ADD, dtypes.int32, g.iota(4), g.const(0, dtypes.int32, (4,))) is g.iota(4)
    # x // 1 is floor(x) for floats (nan for inf), x for integers
    assert g.alu(Op.IDIV, f32, x, one).op is Op.IDIV
    assert g.alu(Op.IDIV, dtypes.int32, g.iota(4), g.const(1, dtypes.int32, (4,))) is g.iota(4)
    assert g.alu(Op.MUL, f32, one, x) is x
    assert g.alu(Op.CAST, f32, x) is x
    i = g.iota(4)
    assert g.alu(Op.MUL, dtypes.int32, i, g.const(0, dtypes.int32, (4,))).op is Op.CONST
    # x * 0 stays for floats: x may be inf or nan
    assert g.alu(Op.MUL, f32, x, g.const(0.0, f32, (4,))).op is Op.MUL
    assert g.alu(Op.WHERE, f32, g.const(True, dtypes.bool, (4,)), x, zero) is x


def test_views_fold():
    x = g.iota(6)
    v = g.movement(g.movement(x, lambda st: st.reshape((2, 3))), lambda st: st.permute((1, 0)))
    assert v.op is Op.VIEW and v.srcs[0] is x and len(v.arg.views) == 1
    c = g.movement(g.const(2.0, f32, (3,)), lambda st: st.reshape((3, 1)).expand((3, 5)))
    assert c.op is Op.CONST and c.shape == (3, 5)
    padded = g.movement(g.const(2.0, f32, (3,)), lambda st: st.pad(((1, 1),)))
    assert padded.op is Op.VIEW


def test_substitute_rebuilds_through_the_builders():
    x = g.alu(Op.CAST, f32, g.iota(3))
    y = g.alu(Op.ADD, f32, x, g.const(1.0, f32, (3,)))
    z = g.substitute(y, {x: g.const(2.0, f32, (3,))})
    assert z.op is Op.CONST and z.arg == 3.0


def test_interned_nodes_leave_the_table_when_they_die():
    x = g.alu(Op.CAST, f32, g.iota(7))
    before = len(g._interned)
    y = g.alu(Op.EXP, f32, x)
    assert len(g._interned) == before + 1
    del y
    assert len(g._interned) == before
    assert g.alu(Op.EXP, f32, x).srcs == (x,)  # built again after its entry went


def test_scalar_operands_build_the_nodes_of_the_general_path():
    x = Tensor(g.iota(4)).float().reshape(2, 2)
    assert (x * 0.5).node is (x * np.float32(0.5)).node  # a numpy scalar takes the general path
    assert (2 - x).node is x.__rsub__(np.int32(2)).node
    ints = Tensor(g.iota(4)).cast(i8)
    assert (ints + 100).node is (ints + np.int64(100)).node  # weak both ways: the tensor's dtype
    assert (ints / 2).node is (ints / np.int64(2)).node  # true division computes in float32


def test_same_dtype_operands_build_the_nodes_of_the_general_path():
    """Two tensors of the operation's dtype skip promotion; a mixed pair goes the general way to the same nodes."""
    x = Tensor(g.iota(6)).float().reshape(2, 3)
    row = Tensor(g.iota(3)).float()
    assert (x - row).node is g.alu(Op.SUB, f32, x.node, row.reshape(1, 3).expand(2, 3).node)
    assert (row - x).node is g.alu(Op.SUB, f32, row.reshape(1, 3).expand(2, 3).node, x.node)
    half = Tensor(g.iota(3)).cast(dtypes.float16)
    mixed = x - half  # float32 - float16: the general path, half cast to float32 and broadcast
    assert mixed.node is (x - half.float()).node
    assert (row / row).node is row.div(row).node and (row / row).node.op is Op.DIV
    ints = Tensor(g.iota(3))
    assert (ints / ints).dtype is f32  # true division promotes: not the same-dtype path's result


def test_float32_constants_round_as_numpy():
    """Constants round to float32 as numpy's cast does: ties to even, subnormals, overflow to infinity, NaN."""
    import struct
    import warnings
    bits = np.array([0, 0x8000000000000000, 0x7FF0000000000000, 0x7FF8000000000001, 0xFFF4000000000000,
                     0x36A0000000000000, 0x36A0000000000001, 0x369FFFFFFFFFFFFF, 0x47EFFFFFF0000000,
                     0x47EFFFFFEFFFFFFF, 0x47EFFFFFE0000000, 0x3FF0000010000000, 0x3FF0000030000000], np.uint64)
    values = [*bits.view(np.float64).tolist(), 1e39, -1e300, 2.0**-149, 2.0**-150, 1 / 3, 0.1]
    for v in values:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = float(np.float32(v))
        got = g.const(v, f32).arg
        assert struct.pack("<d", got) == struct.pack("<d", want), (v, got, want)
