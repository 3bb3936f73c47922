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
