"""IEEE results as numpy's through the driver's compiler: precise temporaries, hidden special constants, float
controls where the device honours them (issue 13)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from numerics import ieee_matches

import vkgraph.realize as realize_mod
from vkgraph.codegen import lower
from vkgraph.realize import limits
from vkgraph.schedule import create_schedule
from vkgraph.tensor import Tensor

SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 1e-40, 3e38], np.float32)
CONSTANTS = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, 2.0]
OPS = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b}


def same_bits(got: np.ndarray, want: np.ndarray) -> bool:
    """Equal bit for bit, any NaN matching any NaN (numpy's NaN payloads are the hardware's)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return bool(np.all((got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))))


@pytest.fixture(params=["float controls", "precise only"])
def ieee_limits(request, monkeypatch):
    """The device's own limits, and the same without float controls: `precise` alone must hold as well (the
    path of devices that lack SignedZeroInfNanPreserve)."""
    if request.param == "precise only":
        lim = dataclasses.replace(limits(), float_modes=())
        monkeypatch.setattr(realize_mod, "limits", lambda: lim)
    return request.param


def test_x_minus_x_times_nan_is_nan(ieee_limits):
    x = Tensor(np.array([1.0, 2.0, -3.5], np.float32))
    assert np.isnan(((x - x) * float("nan")).numpy()).all()


def test_fused_log2_product_exp2_matches_the_unfused_result(ieee_limits):
    a, b = Tensor(np.array([0.0], np.float32)), Tensor(np.array([-0.7], np.float32))
    fused = (a.log2() * b).exp2().numpy()
    unfused = (a.log2() * b).realize().exp2().numpy()
    with np.errstate(divide="ignore"):
        want = np.exp2(np.log2(np.float32(0.0)) * np.float32(-0.7))
    assert fused[0] == np.inf and same_bits(fused, unfused) and same_bits(fused, [want])


@pytest.mark.parametrize("op", list(OPS))
def test_special_constants_on_either_side_give_numpy_bits(op, ieee_limits):
    """x op c and c op x for special x and special literal c (0.0, -0.0, inf, nan, subnormal): the shader compiler
    folded literal zeros (x * 0.0 = 0 for infinite x, 0.0 / 0.0 = garbage on lavapipe) until they were hidden."""
    x = Tensor(SPECIAL)
    fn = OPS[op]
    with np.errstate(all="ignore"):
        for c in CONSTANTS:
            for left in (True, False):
                got = (fn(x, c) if left else fn(c, x)).numpy()
                args = (SPECIAL, np.float32(c)) if left else (np.float32(c), SPECIAL)
                assert ieee_matches(got, fn, *args).all(), (op, c, left, got, fn(*args))


def test_adding_zero_keeps_ieee_signs():
    """Graph folding: -0.0 + 0.0 is 0.0 (not -0.0), -0.0 - -0.0 is 0.0; x + -0.0 and x - 0.0 are x."""
    x = Tensor(SPECIAL)
    add, sub, z, nz = np.add, np.subtract, np.float32(0.0), np.float32(-0.0)
    for got, fn, args in [(x + 0.0, add, (SPECIAL, z)), (0.0 + x, add, (z, SPECIAL)), (x - (-0.0), sub, (SPECIAL, nz)),
                          (x + (-0.0), add, (SPECIAL, nz)), (x - 0.0, sub, (SPECIAL, z))]:
        assert ieee_matches(got.numpy(), fn, *args).all(), (fn, args, got.numpy())


def test_floor_division_by_one_floors():
    x = np.array([1.5, -1.5, np.inf, np.nan, -0.0], np.float32)
    with np.errstate(invalid="ignore"):
        assert same_bits((Tensor(x) // 1).numpy(), x // np.float32(1))


def test_sum_of_special_values_matches_numpy(ieee_limits):
    for vals in ([-0.0, -0.0], [np.inf, -np.inf], [np.nan, 1.0], [np.inf, 1.0], [1e-40, 1e-40]):
        a = np.array(vals * 50, np.float32)
        assert ieee_matches(Tensor(a).sum().numpy(), np.sum, a).all(), vals


def _glsl(t: Tensor, lim) -> str:
    sched = create_schedule([t.node], realize_mod.REALIZED)
    return "\n".join(p.src for p in lower(sched.items[0], lim).programs)


def test_marking_follows_the_limits():
    x = Tensor(SPECIAL)
    lim = limits()
    src = _glsl(x * 0.0 + 1.5, dataclasses.replace(lim, precise=True, float_modes=("signed_zero_inf_nan_preserve",)))
    assert "precise float" in src and "spirv_execution_mode(capabilities = [4466], 4461, 32);" in src
    assert "pc.z" in src and " 0.0)" not in src  # the zero is hidden from the compiler
    plain = _glsl(x * 0.0 + 1.5, dataclasses.replace(lim, precise=False, float_modes=()))
    assert "precise" not in plain and "spirv_execution_mode" not in plain and "pc.z" not in plain
