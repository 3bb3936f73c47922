"""Tolerances that scale with the magnitude of what went into a value, not with the value itself.

A sum of signed terms can land near 0 (a mean of 555 normals is about 0.04): an error bound relative to the
result is then far tighter than float32 arithmetic can meet on any device, and whether it passes depends on the
order the device sums in. Rounding errors of a sum are bounded by the magnitude of its terms (sum of |x|), so
bounds are relative to that.
"""

from __future__ import annotations

import numpy as np


def assert_close_to_terms(got, ref, terms, rtol: float) -> None:
    """|got - ref| <= rtol * terms everywhere (terms broadcast against ref: the sum of |x| that gave each value,
    or an upper bound of it); NaN and infinities must match exactly."""
    g = np.asarray(got, np.float64)
    r = np.asarray(ref, np.float64)
    assert g.shape == r.shape, (g.shape, r.shape)
    assert np.array_equal(np.isnan(g), np.isnan(r)), "NaN pattern differs"
    inf = np.isinf(r)
    assert np.array_equal(g[inf], r[inf]), "infinities differ"
    finite = ~np.isnan(r) & ~inf
    bound = rtol * np.broadcast_to(np.asarray(terms, np.float64), r.shape)
    err = np.abs(g - r)
    bad = finite & (err > bound)
    assert not bad.any(), f"error {err[bad].max():.3g} over the bound {bound[bad].min():.3g} at {bad.sum()} places"


# ---- float32 subnormals ---------------------------------------------------------------------------------------
# Vulkan lets a driver flush float32 subnormals to zero unless it offers DenormPreserve (shaderDenormPreserveFloat32)
# and the shader asks for it. NVIDIA's driver offers only SignedZeroInfNanPreserve for 32-bit and flushes; lavapipe
# does not offer DenormPreserve either but keeps subnormals. So on a device without "denorm_preserve" in its float
# controls, a result is accepted when it equals numpy's or numpy's with subnormal inputs and results flushed to a
# zero of the same sign; on a device with it, only numpy's.

F32_TINY = np.float32(np.finfo(np.float32).tiny)  # the smallest normal float32


def may_flush_subnormals() -> bool:
    """True where the device does not promise to keep float32 subnormals (no DenormPreserve)."""
    from vkgraph.runtime import get_device

    return "denorm_preserve" not in get_device().info.float_controls


def flush(x) -> np.ndarray:
    """float32 x with its subnormals replaced by a zero of the same sign."""
    x = np.asarray(x, np.float32)
    return np.where((x != 0) & (np.abs(x) < F32_TINY), np.copysign(np.float32(0), x), x).astype(np.float32)


def flushed(fn, *args) -> np.ndarray:
    """numpy's fn on float32 arguments as a flushing device computes it: subnormal inputs and results flushed."""
    with np.errstate(all="ignore"):
        return flush(fn(*(flush(a) if np.asarray(a).dtype == np.float32 else a for a in args)))


def same_bits(got, want) -> np.ndarray:
    """Elementwise: equal bit for bit, any NaN matching any NaN."""
    got, want = np.broadcast_arrays(np.asarray(got, np.float32), np.asarray(want, np.float32))
    return (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))


def ieee_matches(got, fn, *args) -> np.ndarray:
    """Elementwise: got is numpy's fn(*args) bit for bit, or (where the device may flush subnormals) the flushed
    result bit for bit. NaN is accepted only where the accepted reference is NaN."""
    with np.errstate(all="ignore"):
        ok = same_bits(got, fn(*args))
    if may_flush_subnormals():
        ok = ok | same_bits(got, flushed(fn, *args))
    return ok
