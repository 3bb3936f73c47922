"""An RMSNorm folded into a matvec's epilogue (matvec.NormFold, -DNORM_Q8) and its consumer (-DX_INV), against numpy.

The producer's workgroups each own a few rows of a block of 32; the last to count its rows quantizes the block, so
lavapipe's workgroups, run by several CPU threads, race for every block here."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_templates_common import check, device, snapshot, upload, weights

from vkgraph import quant, templates
from vkgraph.templates import matvec as mv
from vkgraph.templates import norms

EPS = 1e-5


def _needs_int_dot():
    if not device().info.integer_dot_product:
        pytest.skip("no shaderIntegerDotProduct on this device")


def _launches(dev, n, k, batch):
    """Launch variants of different rows per workgroup: the workgroup launch (ROWS 1, 3, 5: blocks shared by
    several workgroups and workgroups straddling two blocks; 8 rows x NB) and the subgroup-rows one."""
    base = mv.choose_config(dev, quant.FORMATS["Q4_0"], n, k, batch, int_dot=False, subgroup_rows=False)
    out = [dataclasses.replace(base, rows=r) for r in (1, 3, 5)]
    if "shuffle" in dev.info.subgroup_ops:
        sg = dev.info.max_subgroup_size
        out.append(mv.MatvecConfig(max(sg, 16), 3, True, tpr=min(4, dev.info.min_subgroup_size)))
        out.append(mv.MatvecConfig(sg * 2, 2, True, tpr=1))  # 64 or more rows per workgroup: several blocks
    return out


def _expected(y: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy's fold of y [rows, n]: int8 levels and scales of y * g per block of 32, and inv per row."""
    xw = (y * g).astype(np.float32).reshape(-1, 32)
    d = (np.abs(xw).max(1) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[:, None] > 0, np.clip(np.rint(xw / d[:, None]), -127, 127), 0)
    y64 = y.astype(np.float64)
    inv = 1 / np.sqrt((y64 ** 2).mean(1) + EPS)
    return q.reshape(y.shape).astype(np.int64), d, inv


def _read_fold(dev, state, rows, n):
    acts = mv.fold_acts(state, rows, n)
    q = dev.download(acts.xq, np.int8, (rows, n)).astype(np.int64)
    d = dev.download(acts.xd, np.float32, (rows * n // 32,))
    s = dev.download(acts.xs, np.int32, (rows * n // 16,))
    inv = dev.download(acts.inv, np.float32, (rows,))
    return q, d, s, inv


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blocks=st.integers(1, 6), kblocks=st.integers(1, 6), batch=st.integers(1, 8), launch=st.integers(0, 4),
       zero_row=st.booleans(), seed=st.integers(0, 1000))
def test_folded_norm_matches_numpy(blocks, kblocks, batch, launch, zero_row, seed):
    """y = W x + residual as the plain product writes it, and the int8 blocks of y * g (one rounding step of
    numpy's at most, rarely), their scales, exact half sums and inv = 1 / sqrt(mean(y^2) + eps) per row; three
    calls on one state (its counters zero again after each); a zero row gives scales 0, levels 0."""
    dev = device()
    rng = np.random.default_rng(seed)
    n, k = 32 * blocks, 32 * kblocks
    cfgs = _launches(dev, n, k, batch)
    cfg = cfgs[launch % len(cfgs)]
    dw = mv.upload_weights(dev, weights(rng.standard_normal((n, k)).astype(np.float32), "Q4_0", seed))
    g = rng.standard_normal(n).astype(np.float32)
    state = dev.alloc(mv.fold_layout(n)[0])
    dev.upload(state, np.zeros(mv.fold_layout(n)[0] // 4, np.uint32))
    for call in range(3):
        x = rng.standard_normal((batch, k)).astype(np.float32)
        r = (rng.standard_normal((batch, n)) * 2).astype(np.float32)
        if zero_row and call == 1:
            x[-1], r[-1] = 0, 0
        fold = mv.NormFold(upload(dev, g), state, batch, EPS)
        since = snapshot()
        plain = mv.matvec(dev, dw, upload(dev, x), batch, residual=upload(dev, r), config=cfg)
        y_buf = mv.matvec(dev, dw, upload(dev, x), batch, residual=upload(dev, r), config=cfg, norm=fold)
        y = dev.download(y_buf, np.float32, (batch, n))
        np.testing.assert_array_equal(y, dev.download(plain, np.float32, (batch, n)))
        q, d, s, inv = _read_fold(dev, state, batch, n)
        q_ref, d_ref, inv_ref = _expected(y, g)
        assert np.abs(q - q_ref).max() <= 1 and (q != q_ref).mean() < 0.02
        np.testing.assert_allclose(d, d_ref, rtol=1e-6)
        assert (s == q.reshape(-1, 16).sum(1)).all()
        np.testing.assert_allclose(inv, inv_ref, rtol=1e-5)
        check(q.astype(np.float64), q_ref.astype(np.float64), since, tol=2e-2)
        assert (templates.DISPATCHES - since)["matvec_q4_0+norm"] == 1
        if zero_row and call == 1:
            assert (q[-1] == 0).all() and (d.reshape(batch, -1)[-1] == 0).all()
        nblk = n // 32
        counters = dev.download(state, np.uint32, (2 * mv.FOLD_ROWS * nblk + mv.FOLD_ROWS,))
        assert not counters[:mv.FOLD_ROWS * (nblk + 1)].any()


def test_folded_norm_of_rows_whose_squares_overflow():
    """Rows near 1e20 (their squares past float32) and near 1e-20: inv as numpy's float64 gives it, the int8
    blocks as for any row."""
    dev = device()
    rng = np.random.default_rng(3)
    n, k, rows = 128, 32, 3
    dw = mv.upload_weights(dev, weights(np.zeros((n, k), np.float32), "Q4_0"))
    r = rng.standard_normal((rows, n)).astype(np.float32) * np.array([[1e20], [1e-20], [1.0]], np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    state = upload(dev, np.zeros(mv.fold_layout(n)[0] // 4, np.uint32))
    since = snapshot()
    y = mv.matvec(dev, dw, upload(dev, np.zeros((rows, k), np.float32)), rows, residual=upload(dev, r),
                  norm=mv.NormFold(upload(dev, g), state, rows, EPS))
    np.testing.assert_array_equal(dev.download(y, np.float32, (rows, n)), r)
    q, d, _, inv = _read_fold(dev, state, rows, n)
    q_ref, d_ref, inv_ref = _expected(r, g)
    np.testing.assert_allclose(inv, inv_ref, rtol=1e-5)
    assert np.abs(q - q_ref).max() <= 1
    check(d.astype(np.float64), d_ref.astype(np.float64), since, tol=1e-6)


def test_folded_norm_in_calls_of_fewer_rows():
    """Rows 3..5 and 0..2 of one product by two calls (r0), into one state: what one call of all rows writes."""
    dev = device()
    rng = np.random.default_rng(5)
    n, k, rows = 96, 64, 6
    dw = mv.upload_weights(dev, weights(rng.standard_normal((n, k)).astype(np.float32), "Q4_0", 5))
    x = rng.standard_normal((rows, k)).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    xb, gb = upload(dev, x), upload(dev, g)
    words = np.zeros(mv.fold_layout(n)[0] // 4, np.uint32)
    states = [upload(dev, words), upload(dev, words)]
    mv.matvec(dev, dw, xb, rows, norm=mv.NormFold(gb, states[0], rows, EPS))
    out = dev.alloc(rows * n * 4)
    for r0 in (3, 0):
        mv.matvec(dev, dw, xb.view(r0 * k * 4, 3 * k * 4), 3, out=out.view(r0 * n * 4, 3 * n * 4),
                  norm=mv.NormFold(gb, states[1], rows, EPS, r0=r0))
    one, two = (_read_fold(dev, s, rows, n) for s in states)
    for a, b in zip(one, two, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q6_K"])
def test_product_of_folded_activations_equals_rmsnorm_q8(fmt):
    """The consumer (-DX_INV: results times the row's inv) over a fold's activations gives what it gives over
    rmsnorm_q8's of the same y, within the rare one-step rounding difference of the two quantizations; bias
    added after the scaling; rows in calls of fewer rows (Q8Acts.rows carries inv's row)."""
    _needs_int_dot()
    dev = device()
    rng = np.random.default_rng(11)
    n, k, m, rows = 64, 96, 40, 5
    if fmt == "Q6_K":
        n = 256
    producer = mv.upload_weights(dev, weights(rng.standard_normal((n, k)).astype(np.float32), "Q4_0", 1))
    consumer = mv.upload_weights(dev, weights(rng.standard_normal((m, n)).astype(np.float32), fmt, 2))
    x = rng.standard_normal((rows, k)).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    bias = upload(dev, rng.standard_normal(m).astype(np.float32))
    state = upload(dev, np.zeros(mv.fold_layout(n)[0] // 4, np.uint32))
    y = mv.matvec(dev, producer, upload(dev, x), rows, norm=mv.NormFold(upload(dev, g), state, rows, EPS))
    since = snapshot()
    want = mv.matvec(dev, consumer, mv.Q8Acts.in_buffer(norms.rmsnorm_q8(dev, y, upload(dev, g), rows, n, eps=EPS),
                                                        rows, n), rows, bias=bias)
    acts = mv.fold_acts(state, rows, n)
    got = dev.alloc(rows * m * 4)
    for r0, b in ((0, 2), (2, 3)):
        mv.matvec(dev, consumer, acts.rows(r0, b, n), b, bias=bias, out=got.view(r0 * m * 4, b * m * 4))
    check(dev.download(got, np.float32, (rows, m)), dev.download(want, np.float32, (rows, m)).astype(np.float64),
          since, tol=3e-3)
    assert (templates.DISPATCHES - since)[mv.TEMPLATE[fmt] + "+inv"] == 2  # the consumer's variant, once per call


def test_folded_norm_bad_input():
    dev = device()
    dw = mv.upload_weights(dev, weights(np.ones((40, 32), np.float32), "Q4_0"))
    x, g = upload(dev, np.ones(32, np.float32)), upload(dev, np.ones(40, np.float32))
    state = dev.alloc(mv.fold_layout(64)[0])
    with pytest.raises(ValueError, match="N % 32"):
        mv.matvec(dev, dw, x, norm=mv.NormFold(g, state, 1, EPS))
    dw = mv.upload_weights(dev, weights(np.ones((32, 32), np.float32), "Q4_0"))
    with pytest.raises(ValueError, match="takes 1..32 rows"):
        mv.matvec(dev, dw, x, norm=mv.NormFold(g, state, 1, EPS, r0=1))
    with pytest.raises(ValueError, match="fold state"):
        mv.matvec(dev, dw, x, norm=mv.NormFold(g, dev.alloc(64), 1, EPS))
