"""Matvec templates against float64 numpy on the dequantized weights, for every format."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_templates_common import check, device, quantize_q8_ref, snapshot, upload, weights

from vkgraph import quant, templates
from vkgraph.templates import matvec as mv
from vkgraph.templates import norms

FORMATS = sorted(mv.TEMPLATE)


def _k_for(fmt: str, blocks: int) -> int:
    f = quant.FORMATS[fmt]
    return blocks * (f.block_size if f.block_size > 1 else 8)


def _run(fmt, n, k, batch, act, bias, residual, config=None, seed=0):
    dev = device()
    rng = np.random.default_rng(seed)
    qt = weights(rng.standard_normal((n, k)).astype(np.float32), fmt, seed)
    w = qt.dequantize().astype(np.float64)
    x = rng.standard_normal((batch, k)).astype(mv.ACT_DTYPES[act])
    ref = x.astype(np.float64) @ w.T
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    r = rng.standard_normal((batch, n)).astype(np.float32) if residual else None
    ref += (b if bias else 0) + (r if residual else 0)
    dw = mv.upload_weights(dev, qt)
    since = snapshot()
    y = mv.matvec(dev, dw, upload(dev, x), batch, act_dtype=act, bias=None if b is None else upload(dev, b),
                  residual=None if r is None else upload(dev, r), config=config)
    check(dev.download(y, np.float32, (batch, n)), ref, since)


# the drawn tests' examples: a few in the default run (each compiles its variants), many under the slow marker
FAST = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SWEEPS = [pytest.param(SLOW, marks=pytest.mark.slow, id="slow"), pytest.param(FAST, id="fast")]


@pytest.mark.parametrize("sweep", SWEEPS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_matvec_fuzz(fmt, sweep):
    @sweep
    @given(n=st.integers(1, 70), blocks=st.integers(1, 40), batch=st.integers(1, 8),
           act=st.sampled_from(["f32", "f16"]), bias=st.booleans(), residual=st.booleans(), seed=st.integers(0, 1000))
    def run(n, blocks, batch, act, bias, residual, seed):
        if quant.FORMATS[fmt].block_size == 256:
            blocks = 1 + blocks % 5
        _run(fmt, n, _k_for(fmt, blocks), batch, act, bias, residual, seed=seed)

    run()


@pytest.mark.parametrize("fmt", FORMATS)
def test_matvec_long_rows(fmt):
    """K >= 4096 and a row count that is not a multiple of the rows per workgroup."""
    _run(fmt, 67, 4352 if quant.FORMATS[fmt].block_size == 256 else 4128, 3, "f32", True, False)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("config", [mv.MatvecConfig(32, 3, False), mv.MatvecConfig(64, 1, True),
                                    mv.MatvecConfig(16, 4, True)])
def test_matvec_launch_configs(fmt, config):
    """Both reductions (subgroupAdd and shared memory), odd rows per workgroup, a workgroup wider than K."""
    if config.use_subgroup and "arithmetic" not in device().info.subgroup_ops:
        pytest.skip("no subgroup arithmetic on this device")
    _run(fmt, 29, _k_for(fmt, 3), 2, "f32", False, True, config=config)


# The workgroup launch with rounds of units in flight (unroll), in workgroups of one subgroup (the sums meet
# without shared memory) and of two: K short of one round, a round cut off, several rounds (40 Q4_0 units against
# rounds of 16 or 48; Q4_K's 3 super-blocks are 24 units), rows past the last full workgroup.
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "F16"])
@pytest.mark.parametrize("subgroups,rows,unroll", [(1, 3, 2), (2, 2, 3)])
def test_matvec_workgroup_unroll(fmt, subgroups, rows, unroll):
    if "arithmetic" not in device().info.subgroup_ops:
        pytest.skip("no subgroup arithmetic on this device")
    cfg = mv.MatvecConfig(subgroups * device().info.min_subgroup_size, rows, True, unroll=unroll)
    blocks = 3 if quant.FORMATS[fmt].block_size == 256 else 40
    _run(fmt, 29, _k_for(fmt, blocks), 2, "f32", True, False, config=cfg)


def _needs_shuffle():
    if "shuffle" not in device().info.subgroup_ops:
        pytest.skip("no subgroup shuffles on this device")


# groups of one lane to a whole subgroup, odd rows and units in flight, several groups per workgroup
SUBGROUP_ROWS = [mv.MatvecConfig(32, 3, True, tpr=8, unroll=3), mv.MatvecConfig(64, 1, True, tpr=4, unroll=1),
                 mv.MatvecConfig(32, 2, True, tpr=1, unroll=2)]


@pytest.mark.parametrize("fmt", ["Q4_0", "Q6_K", "F16", "IQ4_XS"])
@pytest.mark.parametrize("config", SUBGROUP_ROWS)
def test_matvec_subgroup_rows_configs(fmt, config):
    """The subgroup-rows launch: a row count that leaves a workgroup's last groups without rows, units that
    do not fill the last round of `unroll`, bias and residual."""
    _needs_shuffle()
    _run(fmt, 37, _k_for(fmt, 7), 3, "f32", True, True, config=config)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "Q4_K"])
@pytest.mark.parametrize("config", SUBGROUP_ROWS[:2])
def test_matvec_subgroup_rows_int_dot(fmt, config):
    _needs_int_dot()
    _needs_shuffle()
    n, k, batch = 29, 11 * 32 if fmt != "Q4_K" else 512, 5
    _int_dot_case(np.random.default_rng(3), fmt, n, k, batch, dataclasses.replace(config, int_dot=True), 3)


@pytest.mark.parametrize("batch", [17, 32])
def test_matvec_subgroup_rows_many_rows(batch):
    """Past the workgroup launch's 8 rows, one call of the subgroup-rows launch takes up to 32."""
    _needs_shuffle()
    cfg = mv.MatvecConfig(32, 1, True, tpr=4, unroll=2)  # one row per group: the smallest body to compile
    _run("Q4_0", 21, _k_for("Q4_0", 6), batch, "f16", False, True, config=cfg, seed=batch)
    if device().info.integer_dot_product:
        _run_int_dot("Q4_0", 21, _k_for("Q4_0", 6), batch, "f32", True, False, rows=1, seed=batch)


# The integer path's options (fold, stage) beside the plain body, from 2 to 16 activation rows: K past a round of
# tpr * unroll units or short of it (a last round cut off), row counts past the last group's rows, formats with
# and without UNIT_COEFFS (fold) and with super-blocks (stage rounds of whole super-blocks).
@pytest.mark.parametrize("sweep", SWEEPS)
def test_matvec_int_dot_options(sweep):
    _needs_int_dot()
    _needs_shuffle()

    @sweep
    @given(fmt=st.sampled_from(["Q4_0", "Q8_0", "Q5_1", "IQ4_XS", "Q4_K", "Q6_K"]), n=st.integers(1, 40),
           blocks=st.integers(1, 12), batch=st.integers(2, 16), rows=st.integers(1, 4),
           tpr=st.sampled_from([2, 4, 8]), unroll=st.integers(1, 3), wg_groups=st.sampled_from([1, 2, 4]),
           fold=st.booleans(), stage=st.booleans(), seed=st.integers(0, 1000))
    def run(fmt, n, blocks, batch, rows, tpr, unroll, wg_groups, fold, stage, seed):
        dev = device()
        f = quant.FORMATS[fmt]
        tpr = min(tpr, dev.info.min_subgroup_size)
        wg = max(wg_groups * tpr, dev.info.max_subgroup_size)
        cfg = mv.MatvecConfig(wg, rows, True, True, tpr, unroll, fold=fold and fmt in mv.FOLD_FORMATS)
        if stage and f.block_size == 256:  # stage takes rounds of whole super-blocks
            cfg = dataclasses.replace(cfg, unroll=max(1, 256 // (tpr * mv.UNIT_ELEMS[fmt])))
        cfg = dataclasses.replace(cfg, stage=stage and mv.stage_fits(dev, f, cfg, batch))
        assert cfg.stage == stage  # every drawn case fits lavapipe's shared memory
        k = _k_for(fmt, 1 + blocks % 3 if f.block_size == 256 else blocks)
        _int_dot_case(np.random.default_rng(seed), fmt, n, k, batch, cfg, seed, residual=True)

    run()


def test_matvec_int_dot_table(monkeypatch):
    """SG_INT_DOT_PREFERRED's entry for a format and bucket sets the integer path's launch; other formats, the
    float path and buckets without an entry keep SG_PREFERRED's, without fold or stage."""
    _needs_shuffle()
    dev = device()
    monkeypatch.setenv("VKGRAPH_MATVEC_LAUNCH", "subgroup")
    monkeypatch.setitem(mv.SG_INT_DOT_PREFERRED, "Q4_0", {8: (128, 4, 2, True, True)})
    q40, q4k = quant.FORMATS["Q4_0"], quant.FORMATS["Q4_K"]
    cfg = mv.choose_config(dev, q40, 4096, 4096, 7, int_dot=True)
    assert (cfg.rows, cfg.fold, cfg.stage) == (4, True, mv.stage_fits(dev, q40, cfg, 8))
    for other, bucket in ((mv.choose_config(dev, q4k, 4096, 4096, 7, int_dot=True), 8),
                          (mv.choose_config(dev, q40, 4096, 4096, 7, int_dot=False), 8),
                          (mv.choose_config(dev, q40, 4096, 4096, 3, int_dot=True), 4)):
        assert (other.rows, other.fold, other.stage) == (mv.SG_PREFERRED[bucket][1], False, False)


def test_matvec_int_dot_one_row_table(monkeypatch):
    """INT_DOT_ONE_ROW's first entry whose ranges hold the shape sets one activation row's launch on the integer path:
    rounds in flight cut to those the row has, fold only where the format takes it, the subgroup-rows launch where
    the entry says so (unless a launch is forced: then INT_DOT_PREFERRED's or SG_PREFERRED's parameters); more
    rows, the float path and larger shapes keep INT_DOT_PREFERRED's."""
    dev = device()
    monkeypatch.setenv("VKGRAPH_MATVEC_LAUNCH", "auto")
    q40, q4k = quant.FORMATS["Q4_0"], quant.FORMATS["Q4_K"]
    monkeypatch.setitem(mv.INT_DOT_ONE_ROW, "Q4_0", [((1, 4096), (1, 4096), mv.OneRow(64, 4, 2, True)),
                                                     ((1, 8192), (1, 16384), mv.OneRow(128, 8, 4, False)),
                                                     ((8193, 9000), (4096, 4096),
                                                      mv.OneRow(128, 1, 2, True, subgroup=True))])
    monkeypatch.setitem(mv.INT_DOT_ONE_ROW, "Q4_K", [((1, 4096), (1, 4096), mv.OneRow(64, 4, 2, True))])
    sg = dev.info.subgroup_size
    pick = mv.choose_config(dev, q40, 4096, 4096, 1, int_dot=True)
    assert (pick.wg, pick.rows, pick.unroll, pick.fold, pick.tpr) == (max(64, sg), 4, 2 if sg <= 64 else 1, True, 0)
    pick = mv.choose_config(dev, q40, 6144, 4096, 1, int_dot=True)  # the second entry; K = 4096 has one round
    assert (pick.wg, pick.rows, pick.unroll, pick.fold) == (max(128, sg), 8, 1, False)
    assert mv.choose_config(dev, q40, 4096, 14336, 1, int_dot=True).unroll == 4  # 448 units: four rounds of 128
    assert mv.choose_config(dev, q40, 512, 64, 1, int_dot=True).unroll == 1  # 2 units: one round
    assert not mv.choose_config(dev, q4k, 4096, 4096, 1, int_dot=True).fold
    for cfg, rows in ((mv.choose_config(dev, q40, 4096, 4096, 2, int_dot=True), mv.INT_DOT_PREFERRED["Q4_0"][2][2]),
                      (mv.choose_config(dev, q40, 16384, 4096, 1, int_dot=True), mv.INT_DOT_PREFERRED["Q4_0"][1][2]),
                      (mv.choose_config(dev, q40, 8200, 2048, 1, int_dot=True), mv.INT_DOT_PREFERRED["Q4_0"][1][2]),
                      (mv.choose_config(dev, q40, 4096, 4096, 1, int_dot=False), mv.PREFERRED["Q4_0"][2])):
        assert (cfg.rows, cfg.unroll, cfg.fold) == (rows, 1, False)
    shuffles = "shuffle" in dev.info.subgroup_ops
    pick = mv.choose_config(dev, q40, 8200, 4096, 1, int_dot=True)  # the third entry: the subgroup-rows launch
    assert (pick.tpr > 0, pick.rows, pick.fold) == ((True, 1, True) if shuffles else
                                                   (False, mv.INT_DOT_PREFERRED["Q4_0"][1][2], False))
    forced = mv.choose_config(dev, q40, 8200, 4096, 1, int_dot=True, subgroup_rows=False)
    assert (forced.tpr, forced.rows, forced.fold) == (0, mv.INT_DOT_PREFERRED["Q4_0"][1][2], False)
    if shuffles:
        forced = mv.choose_config(dev, q40, 4096, 4096, 1, int_dot=True, subgroup_rows=True)  # a workgroup entry
        assert (forced.rows, forced.fold) == (mv.SG_PREFERRED[1][1], False)
        monkeypatch.setenv("VKGRAPH_MATVEC_LAUNCH", "workgroup")
        assert mv.choose_config(dev, q40, 8200, 4096, 1, int_dot=True).tpr == 0


def test_matvec_int_dot_one_row_entries():
    """Each of INT_DOT_ONE_ROW's entries as choose_config makes it on this device at its smallest shape, on 37 rows
    of that K (rows past the last group or workgroup) against numpy: the configurations one-row decode runs."""
    _needs_int_dot()
    dev = device()
    rng = np.random.default_rng(11)
    for fmt, entries in mv.INT_DOT_ONE_ROW.items():
        f = quant.FORMATS[fmt]
        for (n_lo, _), (k_lo, _), _ in entries:
            _int_dot_case(rng, fmt, 37, k_lo, 1, mv.choose_config(dev, f, n_lo, k_lo, 1, int_dot=True), 11)


def test_matvec_auto_launch_by_rows(monkeypatch):
    """auto keeps the integer path of Q4_0 and Q4_K on the workgroup launch up to AUTO_WORKGROUP_ROWS rows, and up
    to 8 where K > LONG_K; other formats, the float path and past 8 rows take the subgroup one; a forced launch wins
    (without INT_DOT_ONE_ROW's entries by shape)."""
    _needs_shuffle()
    dev = device()
    q40, q4k = quant.FORMATS["Q4_0"], quant.FORMATS["Q4_K"]
    monkeypatch.setitem(mv.AUTO_WORKGROUP_ROWS, "Q4_0", 4)
    monkeypatch.setitem(mv.AUTO_WORKGROUP_ROWS, "Q4_K", 1)
    monkeypatch.setattr(mv, "INT_DOT_ONE_ROW", {})  # one row by shape: test_matvec_int_dot_one_row_table
    monkeypatch.setenv("VKGRAPH_MATVEC_LAUNCH", "auto")
    for fmt, k, batch, int_dot, wide in ((q40, 4096, 3, True, False), (q40, 4096, 4, True, False),
                                         (q40, 4096, 5, True, True), (q40, 14336, 8, True, False),
                                         (q40, 14336, 9, True, True), (q40, 4096, 3, False, True),
                                         (q4k, 4096, 3, True, True), (q4k, 14336, 8, True, False),
                                         (q4k, 14336, 9, True, True), (q40, 4096, 1, True, False)):
        assert (mv.choose_config(dev, fmt, 512, k, batch, int_dot=int_dot).tpr > 0) == wide, (fmt.name, k, batch)
    monkeypatch.setenv("VKGRAPH_MATVEC_LAUNCH", "subgroup")
    assert mv.choose_config(dev, q40, 512, 4096, 3, int_dot=True).tpr > 0


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "Q4_K"])
@pytest.mark.parametrize("batch,subgroups,rows,unroll,fold", [(1, 1, 4, 3, True), (1, 2, 2, 2, False),
                                                              (3, 1, 1, 2, False)])
def test_matvec_int_dot_workgroup_unroll(fmt, batch, subgroups, rows, unroll, fold):
    """The integer path on the workgroup launch with units in flight (one activation row: the decode step's
    products), one or two subgroups a workgroup, fold where the format takes it."""
    _needs_int_dot()
    if "arithmetic" not in device().info.subgroup_ops:
        pytest.skip("no subgroup arithmetic on this device")
    n, k = 27, 25 * 32 if fmt != "Q4_K" else 768
    cfg = mv.MatvecConfig(subgroups * device().info.min_subgroup_size, rows, True, True, unroll=unroll,
                          fold=fold and fmt in mv.FOLD_FORMATS)
    _int_dot_case(np.random.default_rng(batch + unroll), fmt, n, k, batch, cfg, 5)


def test_matvec_int_dot_options_refused():
    """fold where runs do not share their scale, stage off the subgroup-rows launch, over part of a super-block or
    past the shared memory: ValueError before any GPU work."""
    _needs_int_dot()
    _needs_shuffle()
    dev = device()
    x = upload(dev, np.ones((2, 256), np.float32))
    q4k = mv.upload_weights(dev, quant.quantize(np.ones((8, 256), np.float32), "Q4_K"))
    q40 = mv.upload_weights(dev, quant.quantize(np.ones((8, 256), np.float32), "Q4_0"))
    big = mv.MatvecConfig(32, 1, True, True, tpr=1, unroll=1, stage=True)
    big_rows = dev.info.max_shared_memory // 16  # int8 words alone past the device's shared memory
    assert not mv.stage_fits(dev, quant.FORMATS["Q8_0"], dataclasses.replace(big, unroll=2), big_rows)
    for w, cfg in ((q4k, mv.MatvecConfig(32, 1, True, True, fold=True)),
                   (q40, mv.MatvecConfig(32, 1, True, False, fold=True)),
                   (q40, mv.MatvecConfig(32, 1, True, True, stage=True)),
                   (q4k, mv.MatvecConfig(32, 1, True, True, tpr=2, unroll=1, stage=True)),
                   (q40, mv.MatvecConfig(32, 1, True, False, tpr=2, unroll=1, stage=True))):
        with pytest.raises(ValueError, match="fold|stage"):
            mv.matvec(dev, w, x, 2, config=cfg)


def test_matvec_subgroup_rows_bad_config():
    _needs_shuffle()
    dev = device()
    dw = mv.upload_weights(dev, quant.quantize(np.ones((8, 64), np.float32), "Q8_0"))
    x = upload(dev, np.ones(64, np.float32))
    sg = dev.info.min_subgroup_size
    for cfg in (mv.MatvecConfig(64, 1, True, tpr=3), mv.MatvecConfig(64, 1, True, tpr=2 * sg),
                mv.MatvecConfig(dev.info.max_subgroup_size + 1, 1, True, tpr=1),
                mv.MatvecConfig(64, 1, True, tpr=1, unroll=17), mv.MatvecConfig(64, 1, True, unroll=0)):
        with pytest.raises(ValueError):
            mv.matvec(dev, dw, x, config=cfg)
    with pytest.raises(ValueError, match="workgroup launch"):
        mv.matvec_id(dev, dw, 1, x, upload(dev, np.zeros(1, np.int32)), 1, config=SUBGROUP_ROWS[0])


def test_matvec_launch_flag(monkeypatch):
    dev = device()
    fmt = quant.FORMATS["Q4_0"]
    monkeypatch.setenv("VKGRAPH_MATVEC_LAUNCH", "workgroup")
    assert mv.choose_config(dev, fmt, 4096, 4096, 1).tpr == 0
    monkeypatch.setenv("VKGRAPH_MATVEC_LAUNCH", "subgroup")
    assert mv.choose_config(dev, fmt, 4096, 4096, 1).tpr == ("shuffle" in dev.info.subgroup_ops) * min(
        dev.info.min_subgroup_size, 32)
    monkeypatch.setenv("VKGRAPH_MATVEC_SG", "1:64,3,2,1; 32:256,4,1")
    if "shuffle" in dev.info.subgroup_ops:
        cfg = mv.choose_config(dev, fmt, 4096, 4096, 1)
        assert (cfg.wg, cfg.rows, cfg.tpr) == (64, 3, 1) and cfg.unroll in (1, 2)  # one on a CPU device
        assert mv.choose_config(dev, fmt, 4096, 4096, 32).rows == 4
        monkeypatch.setenv("VKGRAPH_MATVEC_SG", "8:64,2,1,0,1,1")  # derived group width, fold and stage
        cfg = mv.choose_config(dev, fmt, 4096, 4096, 8, int_dot=True)
        assert (cfg.rows, cfg.fold, cfg.stage) == (2, True, mv.stage_fits(dev, fmt, cfg, 8)) and cfg.tpr >= 1
        assert not mv.choose_config(dev, quant.FORMATS["Q4_K"], 4096, 4096, 8, int_dot=True).fold
        assert not mv.choose_config(dev, fmt, 4096, 4096, 8, int_dot=False).fold
    for bad in ("3:64,1,1", "1:64,1", "1:64,0,1", "1:a,1,1", "64,1,1", "8:64,2,1,0,2,0", "8:64,2,1,0,1"):
        monkeypatch.setenv("VKGRAPH_MATVEC_SG", bad)
        with pytest.raises(ValueError, match="VKGRAPH_MATVEC_SG"):
            mv.choose_config(dev, fmt, 4096, 4096, 1)
    monkeypatch.delenv("VKGRAPH_MATVEC_SG")
    monkeypatch.setenv("VKGRAPH_MATVEC_LAUNCH", "sometimes")
    with pytest.raises(ValueError, match="VKGRAPH_MATVEC_LAUNCH"):
        mv.choose_config(dev, fmt, 4096, 4096, 1)


def test_matvec_residual_in_place():
    dev = device()
    rng = np.random.default_rng(5)
    qt = quant.quantize(rng.standard_normal((40, 256)).astype(np.float32), "Q8_0")
    x = rng.standard_normal((2, 256)).astype(np.float32)
    r = rng.standard_normal((2, 40)).astype(np.float32)
    rbuf = upload(dev, r)
    since = snapshot()
    mv.matvec(dev, mv.upload_weights(dev, qt), upload(dev, x), 2, out=rbuf, residual=rbuf)
    check(dev.download(rbuf, np.float32, (2, 40)), x.astype(np.float64) @ qt.dequantize().T + r, since)


def test_matvec_bad_input():
    dev = device()
    qt = quant.quantize(np.ones((8, 64), np.float32), "Q8_0")
    dw = mv.upload_weights(dev, qt)
    x = upload(dev, np.ones((2, 64), np.float32))
    with pytest.raises(ValueError, match="smaller than"):
        mv.matvec(dev, dw, x, 3)
    with pytest.raises(ValueError, match="batch must be"):
        mv.matvec(dev, dw, x, mv.MAX_BATCH_SUBGROUP + 1)
    with pytest.raises(ValueError, match="batch must be"):  # the workgroup launch takes up to 8 rows
        mv.matvec(dev, dw, x, 9, config=mv.MatvecConfig(32, 1, False))
    with pytest.raises(ValueError, match="act_dtype"):
        mv.matvec(dev, dw, x, 1, act_dtype="bf16")
    with pytest.raises(TypeError, match="Buffer"):
        mv.matvec(dev, dw, np.ones(64, np.float32), 1)
    with pytest.raises(ValueError, match="bias"):
        mv.matvec(dev, dw, x, 1, bias=upload(dev, np.ones(4, np.float32)))
    with pytest.raises(ValueError, match="K % 8"):
        mv.upload_weights(dev, quant.quantize(np.ones((2, 12), np.float32), "F16"))


def _run_id(fmt, n_experts, n, k, tokens, slots, per_pair, act="f32", config=None, seed=0):
    """matvec_id against float64 numpy: ids drawn with repeats, some experts never chosen. With an int_dot
    config the reference takes the int8-quantized activations."""
    dev = device()
    rng = np.random.default_rng(seed)
    qts = [weights(rng.standard_normal((n, k)).astype(np.float32), fmt, seed + e) for e in range(n_experts)]
    ws = [q.dequantize().astype(np.float64) for q in qts]
    pairs = tokens * slots
    ids = rng.integers(0, max(1, n_experts - 1), pairs).astype(np.int32)  # the last expert is never chosen
    x = rng.standard_normal((pairs if per_pair else tokens, k)).astype(mv.ACT_DTYPES[act])
    x_div = 1 if per_pair else slots
    xr = x.astype(np.float64)
    if config is not None and config.int_dot:
        xr = _device_quantized(dev, x)
    ref = np.stack([ws[e] @ xr[p // x_div] for p, e in enumerate(ids)])
    dw = mv.upload_experts(dev, qts)
    since = snapshot()
    y = mv.matvec_id(dev, dw, n_experts, upload(dev, x), upload(dev, ids), pairs, x_div=x_div, act_dtype=act,
                     config=config)
    check(dev.download(y, np.float32, (pairs, n)), ref, since)


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_experts=st.integers(1, 6), n=st.integers(1, 40), blocks=st.integers(1, 12), tokens=st.integers(1, 9),
       slots=st.integers(1, 3), per_pair=st.booleans(), act=st.sampled_from(["f32", "f16"]),
       seed=st.integers(0, 1000))
def test_matvec_id_fuzz(fmt, n_experts, n, blocks, tokens, slots, per_pair, act, seed):
    if quant.FORMATS[fmt].block_size == 256:
        blocks = 1 + blocks % 3
    _run_id(fmt, n_experts, n, _k_for(fmt, blocks), tokens, slots, per_pair, act, seed=seed)


@pytest.mark.parametrize("fmt", FORMATS)
def test_matvec_id_launch_configs(fmt):
    """The shared-memory reduction and odd rows per workgroup, with rows past the last full workgroup."""
    _run_id(fmt, 3, 29, _k_for(fmt, 3), 5, 2, False, config=mv.MatvecConfig(32, 3, False))


def test_matvec_id_unroll():
    """Units in flight with expert-indexed rows: K past one round and short of the second; on the integer path with
    fold too (INT_DOT_ONE_ROW's workgroup entries reach matvec_id)."""
    _run_id("Q4_0", 3, 13, _k_for("Q4_0", 24), 4, 2, True, config=mv.MatvecConfig(16, 2, False, unroll=2))
    if device().info.integer_dot_product:
        _run_id("Q4_0", 3, 13, _k_for("Q4_0", 24), 4, 2, False,
                config=mv.MatvecConfig(16, 2, False, True, unroll=2, fold=True))


def test_matvec_id_2d_grid(monkeypatch):
    """Workgroups folded into y (as past 65535 on a real device): the padding workgroups store nothing."""
    from types import SimpleNamespace

    from vkgraph.templates import common

    few = SimpleNamespace(info=SimpleNamespace(max_workgroup_count=(7, 65535, 65535)))
    monkeypatch.setattr(mv, "grid_2d", lambda dev, groups: common.grid_2d(few, groups))
    _run_id("Q4_K", 4, 19, 256, 6, 2, False, seed=3)


def test_matvec_id_bad_input():
    dev = device()
    dw = mv.upload_experts(dev, [quant.quantize(np.ones((8, 64), np.float32), "Q8_0")] * 2)
    x = upload(dev, np.ones((2, 64), np.float32))
    ids = upload(dev, np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="split into"):
        mv.matvec_id(dev, dw, 3, x, ids, 4, x_div=2)
    with pytest.raises(ValueError, match="multiple of x_div"):
        mv.matvec_id(dev, dw, 2, x, ids, 3, x_div=2)
    with pytest.raises(ValueError, match="smaller than"):
        mv.matvec_id(dev, dw, 2, x, ids, 4)  # x per pair: 4 rows needed
    with pytest.raises(ValueError, match="share format and shape"):
        mv.upload_experts(dev, [quant.quantize(np.ones((8, 64), np.float32), "Q8_0"),
                                quant.quantize(np.ones((8, 64), np.float32), "Q4_0")])


# ---- the integer dot-product path (int8-quantized activations) ----

def _device_quantized(dev, x: np.ndarray) -> np.ndarray:
    """x as the integer path sees it (float64): quantized by quantize_q8 itself, whose rounding may differ
    from numpy's by one step where the device's reciprocal is not correctly rounded (checked on its own in
    test_quantize_activations_matches_numpy)."""
    rows, k = x.shape
    act = "f16" if x.dtype == np.float16 else "f32"
    xbuf = upload(dev, x)
    xq, xd, xs = mv.quantize_activations(dev, xbuf, rows, k, act)
    q = dev.download(xq, np.int8, (rows * k // 32, 32)).astype(np.float64)
    d = dev.download(xd, np.float32, (rows * k // 32, 1))
    for buf in (xbuf, xq, xd, xs):
        buf.release()
    return (q * d).reshape(rows, k)


def _needs_int_dot():
    if not device().info.integer_dot_product:
        pytest.skip("no shaderIntegerDotProduct on this device")


def _int_dot_case(rng, fmt, n, k, batch, config, wseed, residual=False):
    """matvec with `config` (the integer path) against float64 numpy on the dequantized weights and the activations
    as quantize_q8 leaves them: weights [n, k] (quantized with seed wseed), x [batch, k] and, with `residual`, a
    residual [batch, n] added, drawn from rng in that order."""
    dev = device()
    qt = weights(rng.standard_normal((n, k)).astype(np.float32), fmt, wseed)
    x = rng.standard_normal((batch, k)).astype(np.float32)
    res = rng.standard_normal((batch, n)).astype(np.float32) if residual else None
    ref = _device_quantized(dev, x) @ qt.dequantize().astype(np.float64).T
    if res is not None:
        ref = ref + res
    since = snapshot()
    y = mv.matvec(dev, mv.upload_weights(dev, qt), upload(dev, x), batch, config=config,
                  residual=None if res is None else upload(dev, res))
    check(dev.download(y, np.float32, (batch, n)), ref, since)


def _run_int_dot(fmt, n, k, batch, act, bias, residual, rows=None, seed=0):
    """matvec with int_dot against float64 numpy on the dequantized weights and the int8-quantized
    activations; returns the normalised error against the unquantized activations too."""
    dev = device()
    rng = np.random.default_rng(seed)
    qt = weights(rng.standard_normal((n, k)).astype(np.float32), fmt, seed)
    w = qt.dequantize().astype(np.float64)
    x = rng.standard_normal((batch, k)).astype(mv.ACT_DTYPES[act])
    xq = _device_quantized(dev, x)
    extra = np.zeros((batch, n))
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    r = rng.standard_normal((batch, n)).astype(np.float32) if residual else None
    extra += (b if bias else 0) + (r if residual else 0)
    cfg = mv.choose_config(dev, qt.format, n, k, batch, int_dot=True)
    cfg = dataclasses.replace(cfg, rows=rows or cfg.rows, int_dot=True)
    since = snapshot()
    y = mv.matvec(dev, mv.upload_weights(dev, qt), upload(dev, x), batch, act_dtype=act, config=cfg,
                  bias=None if b is None else upload(dev, b), residual=None if r is None else upload(dev, r))
    got = dev.download(y, np.float32, (batch, n))
    check(got, xq @ w.T + extra, since)
    exact = x.astype(np.float64) @ w.T + extra
    return np.linalg.norm(got - exact) / np.linalg.norm(exact)


# 6 examples per format: twelve formats share matvec_common's integer path, each example compiles its variants
@pytest.mark.parametrize("fmt", mv.INT_DOT_FORMATS)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 70), blocks=st.integers(1, 40), batch=st.integers(1, 8), act=st.sampled_from(["f32", "f16"]),
       bias=st.booleans(), residual=st.booleans(), rows=st.sampled_from([1, 3, 4, 8]), seed=st.integers(0, 1000))
def test_matvec_int_dot_fuzz(fmt, n, blocks, batch, act, bias, residual, rows, seed):
    _needs_int_dot()
    if quant.FORMATS[fmt].block_size == 256:
        blocks = 1 + blocks % 5
    _run_int_dot(fmt, n, _k_for(fmt, blocks), batch, act, bias, residual, rows, seed)


@pytest.mark.parametrize("fmt", mv.INT_DOT_FORMATS)
def test_matvec_int_dot_long_rows(fmt):
    """K >= 4096; against the unquantized activations the int8 rounding costs well under 1%."""
    _needs_int_dot()
    assert _run_int_dot(fmt, 67, 4352 if quant.FORMATS[fmt].block_size == 256 else 4128, 2, "f32", True, False) < 1e-2


def test_quantize_activations_matches_numpy():
    """int8 values (a rounding tie may land one step off), scales and half-block sums; zeros give scale 0. (The
    quantization itself needs no integer dot-product support.)"""
    dev = device()
    x = np.random.default_rng(3).standard_normal((3, 320)).astype(np.float32)
    x[1, 32:64] = 0
    since = snapshot()
    xq, xd, xs = mv.quantize_activations(dev, upload(dev, x), 3, 320)
    q = dev.download(xq, np.int8, (3, 320))
    d = dev.download(xd, np.float32, (30,))
    s = dev.download(xs, np.int32, (60,))
    q_ref, d_ref = quantize_q8_ref(x)
    assert np.abs(q.astype(int) - q_ref).max() <= 1 and (q != q_ref).mean() < 0.01
    np.testing.assert_allclose(d, d_ref, rtol=1e-6)
    assert (s == q.reshape(-1, 16).astype(np.int32).sum(1)).all() and d[11] == 0 and (q[1, 32:64] == 0).all()
    check(q.astype(np.float64), q_ref.astype(np.float64), since, tol=1e-2)


@pytest.mark.parametrize("fmt", mv.INT_DOT_FORMATS)
@pytest.mark.parametrize("per_pair", [False, True])
def test_matvec_id_int_dot(fmt, per_pair):
    """The expert-indexed matvec over int8-quantized activations, shared per token or one row per pair."""
    _needs_int_dot()
    _run_id(fmt, 4, 29, _k_for(fmt, 1 if quant.FORMATS[fmt].block_size == 256 else 3), 5, 2, per_pair,
            "f16" if per_pair else "f32", config=mv.MatvecConfig(32, 3, True, int_dot=True))


@pytest.mark.parametrize("fmt", FORMATS)
def test_int_dot_default_follows_the_device(fmt, monkeypatch):
    """auto: int8 activations for INT_DOT_FORMATS where the device accelerates int8 dot products; 1 and 0 force it
    (1 still needs the instructions); any other value is an error."""
    info = device().info
    f = quant.FORMATS[fmt]
    eligible = fmt in mv.INT_DOT_FORMATS

    def chosen(accelerated, has_dot=True):
        fake = SimpleNamespace(info=dataclasses.replace(info, integer_dot_product=has_dot,
                                                        integer_dot_product_accelerated=accelerated))
        return mv.choose_config(fake, f, 4096, 4096, 1).int_dot

    monkeypatch.setenv("VKGRAPH_INT_DOT", "auto")
    assert chosen(True) == eligible and not chosen(False) and not chosen(True, has_dot=False)
    monkeypatch.setenv("VKGRAPH_INT_DOT", "1")
    assert chosen(False) == eligible and not chosen(False, has_dot=False)
    monkeypatch.setenv("VKGRAPH_INT_DOT", "0")
    assert not chosen(True)
    if eligible:
        monkeypatch.setenv("VKGRAPH_INT_DOT", "yes")
        with pytest.raises(ValueError, match="VKGRAPH_INT_DOT must be auto, 0 or 1"):
            chosen(True)


def test_int_dot_bad_input():
    dev = device()
    qt = quant.quantize(np.ones((4, 256), np.float32), "F16")
    x = upload(dev, np.ones(256, np.float32))
    with pytest.raises(ValueError, match="integer dot-product path takes"):
        mv.matvec(dev, mv.upload_weights(dev, qt), x, config=mv.MatvecConfig(64, 1, False, int_dot=True))
    with pytest.raises(ValueError, match="K % 32"):
        mv.quantize_activations(dev, x, 1, 48)


@pytest.mark.parametrize("rows,k", [(1, 32), (3, 320), (9, 4096)])
def test_rmsnorm_q8_matches_numpy(rows, k):
    """The norm written as int8 blocks: values within one rounding step of numpy's quantization of numpy's
    RMSNorm (rarely off), scales to float32 rounding, half-block sums exactly those of the int8 values."""
    dev = device()
    rng = np.random.default_rng(k + rows)
    x = (rng.standard_normal((rows, k)) * 3).astype(np.float32)
    w = rng.standard_normal(k).astype(np.float32)
    w[:32] = 0  # a block of zeros: scale 0, levels 0
    since = snapshot()
    buf = norms.rmsnorm_q8(dev, upload(dev, x), upload(dev, w), rows, k, eps=1e-5)
    acts = mv.Q8Acts.in_buffer(buf, rows, k)
    q = dev.download(acts.xq, np.int8, (rows, k))
    d = dev.download(acts.xd, np.float32, (rows * k // 32,))
    s = dev.download(acts.xs, np.int32, (rows * k // 16,))
    x64 = x.astype(np.float64)
    y = (x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * w).astype(np.float32)
    q_ref, d_ref = quantize_q8_ref(y)
    assert np.abs(q.astype(int) - q_ref).max() <= 1 and (q != q_ref).mean() < 0.01
    np.testing.assert_allclose(d, d_ref, rtol=1e-5)
    assert (s == q.reshape(-1, 16).astype(np.int32).sum(1)).all()
    assert (d.reshape(rows, -1)[:, 0] == 0).all() and (q[:, :32] == 0).all()
    check(q.astype(np.float64), q_ref.astype(np.float64), since, tol=1e-2)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "Q4_K"])
def test_matvec_from_rmsnorm_q8_equals_unfused(fmt):
    """matvec over rmsnorm_q8's int8 blocks gives what matvec gives over rmsnorm's floats on the integer path
    (its own quantization kernel), within the rare one-step rounding difference of the two kernels."""
    _needs_int_dot()
    dev = device()
    rng = np.random.default_rng(7)
    n, k, batch = 40, 512, 3
    qt = weights(rng.standard_normal((n, k)).astype(np.float32), fmt, 7)
    dw = mv.upload_weights(dev, qt)
    x = rng.standard_normal((batch, k)).astype(np.float32)
    g = rng.standard_normal(k).astype(np.float32)
    xb, gb = upload(dev, x), upload(dev, g)
    cfg = mv.choose_config(dev, qt.format, n, k, batch, int_dot=True)
    since = snapshot()
    unfused = mv.matvec(dev, dw, norms.rmsnorm(dev, xb, gb, batch, k, eps=1e-5), batch, config=cfg)
    acts = mv.Q8Acts.in_buffer(norms.rmsnorm_q8(dev, xb, gb, batch, k, eps=1e-5), batch, k)
    fused = mv.matvec(dev, dw, acts, batch)
    want = dev.download(unfused, np.float32, (batch, n)).astype(np.float64)
    check(dev.download(fused, np.float32, (batch, n)), want, since, tol=2e-3)
    with pytest.raises(ValueError, match="integer dot-product path"):
        mv.matvec(dev, dw, acts, batch, config=mv.MatvecConfig(cfg.wg, cfg.rows, cfg.use_subgroup, int_dot=False))


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("rows,f", [(1, 32), (3, 352)])
def test_glu_q8_matches_numpy(gelu, rows, f):
    """act(gate) * up from a stacked gate/up row, written as int8 blocks: against numpy's quantization of
    numpy's gated unit (one rounding step at most, rarely), scales to float32 rounding, exact half-block sums."""
    dev = device()
    rng = np.random.default_rng(f + rows + gelu)
    gu = (rng.standard_normal((rows, 2 * f)) * 4).astype(np.float32)
    gu[:, f:f + 32] = 0  # up is zero over the first block: scale 0
    since = snapshot()
    acts = mv.Q8Acts.in_buffer(norms.glu_q8(dev, upload(dev, gu), rows, f, gelu_tanh=gelu), rows, f)
    q = dev.download(acts.xq, np.int8, (rows, f))
    d = dev.download(acts.xd, np.float32, (rows * f // 32,))
    s = dev.download(acts.xs, np.int32, (rows * f // 16,))
    g, u = gu[:, :f].astype(np.float64), gu[:, f:].astype(np.float64)
    a = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) if gelu else g / (1 + np.exp(-g))
    q_ref, d_ref = quantize_q8_ref((a * u).astype(np.float32))
    assert np.abs(q.astype(int) - q_ref).max() <= 1 and (q != q_ref).mean() < 0.02
    np.testing.assert_allclose(d, d_ref, rtol=1e-5)
    assert (s == q.reshape(-1, 16).astype(np.int32).sum(1)).all() and (d.reshape(rows, -1)[:, 0] == 0).all()
    check(q.astype(np.float64), q_ref.astype(np.float64), since, tol=1e-2)


def _q8_parts(dev, buf, rows, f):
    """The three parts of a Q8Acts buffer as host arrays (the padding between them left out)."""
    a = mv.Q8Acts.in_buffer(buf, rows, f)
    return (dev.download(a.xq, np.int8, (rows, f)), dev.download(a.xd, np.float32, (rows * f // 32,)),
            dev.download(a.xs, np.int32, (rows * f // 16,)))


# The gated unit in the gate/up product's epilogue (-DGLU_Q8) against the product's floats through glu_q8 under the
# same launch: bit for bit. Odd numbers of blocks of h (F = 96, 352), 1 to 8 activation rows, both activations,
# the integer path (float rows quantized first, or a Q8Acts) and the float one.
@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "Q4_K"])
@pytest.mark.parametrize("batch,f,gelu,int_dot", [(1, 96, False, True), (3, 352, True, True), (8, 96, False, True),
                                                  (3, 96, True, False)])
def test_matvec_glu_q8_equals_unfused(fmt, batch, f, gelu, int_dot):
    _needs_shuffle()
    if int_dot:
        _needs_int_dot()
    dev = device()
    rng = np.random.default_rng(batch * f + gelu)
    k = 512
    qt = weights(rng.standard_normal((2 * f, k)).astype(np.float32), fmt, batch)
    dw = mv.upload_weights(dev, qt)
    x = rng.standard_normal((batch, k)).astype(np.float32)
    x[:, :] *= np.linspace(0.1, 3, batch)[:, None]  # rows of different scales
    xb = upload(dev, x)
    cfg = mv.glu_config(dev, qt.format, f, k, batch, int_dot=int_dot)
    assert cfg is not None and cfg.int_dot == int_dot and cfg.rows_per_workgroup == 64
    y = mv.matvec(dev, dw, xb, batch, config=cfg)
    want = _q8_parts(dev, norms.glu_q8(dev, y, batch, f, gelu_tanh=gelu), batch, f)
    label = f"{mv.TEMPLATE[fmt]}+glu_q8"
    before = templates.DISPATCHES[label]
    since = snapshot()
    got = _q8_parts(dev, mv.matvec_glu_q8(dev, dw, xb, batch, gelu_tanh=gelu, config=cfg), batch, f)
    assert templates.DISPATCHES[label] == before + 1
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    # and against numpy: the gated unit of the dequantized product, quantized (within the int8 rounding)
    xr = _device_quantized(dev, x) if int_dot else x.astype(np.float64)
    gu = xr @ qt.dequantize().astype(np.float64).T
    g, u = gu[:, :f], gu[:, f:]
    a = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) if gelu else g / (1 + np.exp(-g))
    h = got[0].astype(np.float64).reshape(batch, -1, 32) * got[1].reshape(batch, -1, 1)
    check(h.reshape(batch, f), a * u, since, tol=2e-2)
    if int_dot:  # the same from activations already quantized (as rmsnorm_q8 writes them), chosen launch
        acts = mv.Q8Acts(*mv.quantize_activations(dev, xb, batch, k))
        again = _q8_parts(dev, mv.matvec_glu_q8(dev, dw, acts, batch, gelu_tanh=gelu), batch, f)
        if mv.glu_config(dev, qt.format, f, k, batch, int_dot=True) == cfg:
            for g, w in zip(again, want, strict=True):
                np.testing.assert_array_equal(g, w)


def test_matvec_glu_q8_refused():
    _needs_shuffle()
    dev = device()
    qt = weights(np.ones((96, 64), np.float32), "Q4_0")
    dw = mv.upload_weights(dev, qt)
    x = upload(dev, np.ones((1, 64), np.float32))
    with pytest.raises(ValueError, match="F % 32"):
        mv.matvec_glu_q8(dev, dw, x, 1)  # 96 rows: F = 48
    assert mv.glu_config(dev, qt.format, 48, 64, 1) is None
    dw = mv.upload_weights(dev, weights(np.ones((64, 64), np.float32), "Q4_0"))
    with pytest.raises(ValueError, match="64 rows per workgroup"):
        mv.matvec_glu_q8(dev, dw, x, 1, config=mv.MatvecConfig(64, 2, True, tpr=4))
    with pytest.raises(ValueError, match="batch"):
        mv.matvec_glu_q8(dev, dw, x, 33)


def test_glu_config_from_the_product_launch(monkeypatch):
    """glu_config on an H200-like device (subgroups of 32, 1024 invocations) at the 8B gate/up shape: the product's
    own launch parameters (INT_DOT_ONE_ROW's workgroup of one subgroup at one row, SG_PREFERRED's groups at 8) in the
    subgroup-rows launch, 64 rows a workgroup within GLU_MAX_WG or a given max_wg (more rows per group within
    GLU_MAX_SUMS, else narrower groups); none without shuffles or with F % 32."""
    monkeypatch.setenv("VKGRAPH_MATVEC_LAUNCH", "auto")
    info = dataclasses.replace(device().info, subgroup_size=32, min_subgroup_size=32, max_subgroup_size=32,
                               max_workgroup_invocations=1024, device_type="discrete-gpu",
                               subgroup_ops=frozenset({"basic", "arithmetic", "shuffle"}), max_shared_memory=49152)
    h200 = SimpleNamespace(info=info)
    q40 = quant.FORMATS["Q4_0"]

    def launch(batch, **kw):
        cfg = mv.glu_config(h200, q40, 14336, 4096, batch, int_dot=True, **kw)
        return cfg.wg, cfg.rows, cfg.tpr, cfg.unroll, cfg.rows_per_workgroup

    entry = mv.one_row_entry(q40, 28672, 4096)
    assert entry is not None and not entry.subgroup  # the table's launch at one row: a workgroup of one subgroup
    assert launch(1) == (64 // entry.rows * 32, entry.rows, 32, entry.unroll, 64)
    # groups of 32 lanes with 2 rows would make 1024 invocations: at 8 activation rows narrower groups (4 rows
    # would be 32 sums an invocation), at one more rows per group
    assert launch(8) == (512, 2, 16, mv.SG_PREFERRED[8][2], 64)
    q80 = mv.glu_config(h200, quant.FORMATS["Q8_0"], 14336, 4096, 1, int_dot=True)
    product = mv.choose_config(h200, quant.FORMATS["Q8_0"], 28672, 4096, 1, int_dot=True)
    assert not product.tpr and product.rows <= 2 and product.wg >= 32  # INT_DOT_PREFERRED's workgroup launch
    assert (q80.wg, q80.rows, q80.tpr) == (512, 4, 32)
    assert launch(8, max_wg=1024) == (1024, 2, 32, mv.SG_PREFERRED[8][2], 64)
    assert launch(8, max_wg=64)[:3] == (64, 8, mv.GLU_MIN_TPR)
    assert mv.glu_config(h200, q40, 14336 + 16, 4096, 1) is None
    flat = SimpleNamespace(info=dataclasses.replace(info, subgroup_ops=frozenset({"basic", "arithmetic"})))
    assert mv.glu_config(flat, q40, 14336, 4096, 1) is None


# ---- the norm in the matvec's prologue (NormedRows: -DNORM_X) ----

def _special_rows(rng, shape, kind: str) -> np.ndarray:
    """Activation rows as a residual stream may hold them: ordinary, a row of zeros, rows whose squares overflow
    float32 (with one value near its largest, whose product with the norm's weight overflows too), tiny rows
    (squares far below eps), all negative."""
    x = rng.standard_normal(shape) * 3
    if kind == "zeros":
        x[0] = 0
    elif kind == "huge":
        x *= 1e30
        x[-1, 0] = 3e38
    elif kind == "tiny":
        x *= 1e-18
    elif kind == "negative":
        x = -np.abs(x)
    return x.astype(np.float32)


def _normed_case(fmt, n, k, batch, kind, config, seed, bias=False, residual=False, eps=1e-5):
    """matvec over NormedRows with `config` (None: norm_config's) against float64 numpy: the rows normalized as
    numpy's rms_norm in float64, quantized as the kernel quantizes them (quantize_q8_ref of x * 2^-e * g in
    float32, e from the row's largest |x|: the same int8 values as the rows' RMSNorm has, up to a rare rounding
    step) times the dequantized weights; and against the unquantized norm within the int8 rounding's reach."""
    dev = device()
    rng = np.random.default_rng(seed)
    qt = weights(rng.standard_normal((n, k)).astype(np.float32), fmt, seed)
    w64 = qt.dequantize().astype(np.float64)
    x = _special_rows(rng, (batch, k), kind)
    g = rng.standard_normal(k).astype(np.float32)
    g[:32] = 0  # a block of zeros: scale 0
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    r = rng.standard_normal((batch, n)).astype(np.float32) if residual else None
    extra = (b if bias else 0) + (r if residual else np.zeros((batch, n)))
    x64 = x.astype(np.float64)
    inv = 1 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + eps)
    _, e = np.frexp(np.abs(x).max(1, keepdims=True))
    e = np.clip(e, -126, 126)
    q, d = quantize_q8_ref(np.ldexp(x, -e).astype(np.float32) * g)
    blocks = (q.reshape(-1, 32).astype(np.float64) * d[:, None]).reshape(batch, k)
    want = blocks @ w64.T * (np.ldexp(1.0, e) * inv) + extra
    since = snapshot()
    y = mv.matvec(dev, mv.upload_weights(dev, qt), mv.NormedRows(upload(dev, x), upload(dev, g), eps), batch,
                  config=config, bias=None if b is None else upload(dev, b),
                  residual=None if r is None else upload(dev, r))
    got = dev.download(y, np.float32, (batch, n))
    assert mv.TEMPLATE[fmt] + "+norm" in set(templates.DISPATCHES - since)
    check(got, want, since)
    normed = x64 * inv * g
    exact = normed @ w64.T + extra
    # the int8 rounding's reach, relative to the terms (not to a sum that cancels), with float32's rounding of the
    # bias and residual added; each row on its own, so a huge row does not hide a tiny one
    terms = np.abs(normed) @ np.abs(w64).T
    for row in range(batch):
        allowed = 1e-2 * np.linalg.norm(terms[row]) + 1e-6 * np.linalg.norm(extra[row])
        assert np.linalg.norm(got[row] - exact[row]) <= allowed, (kind, row)
    return got


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "Q4_K"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_matvec_normed_rows_equals_rmsnorm_q8_route(fmt, batch):
    """The norm in the product's prologue gives what rmsnorm_q8's int8 blocks and the matvec over them give (the
    same int8 values: a rare rounding step apart), with bias and residual; no other kernel runs."""
    _needs_int_dot()
    dev = device()
    n, k, eps = 45, 512, 1e-5
    if mv.norm_config(dev, quant.FORMATS[fmt], n, k, batch) is None:
        pytest.skip("no launch for normalized rows on this device")
    got = _normed_case(fmt, n, k, batch, "normal", None, batch, bias=True, residual=True, eps=eps)
    rng = np.random.default_rng(batch)  # the case's draws again, in its order
    qt = weights(rng.standard_normal((n, k)).astype(np.float32), fmt, batch)
    x = _special_rows(rng, (batch, k), "normal")
    g = rng.standard_normal(k).astype(np.float32)
    g[:32] = 0
    b = rng.standard_normal(n).astype(np.float32)
    r = rng.standard_normal((batch, n)).astype(np.float32)
    acts = mv.Q8Acts.in_buffer(norms.rmsnorm_q8(dev, upload(dev, x), upload(dev, g), batch, k, eps=eps), batch, k)
    since = snapshot()
    route = mv.matvec(dev, mv.upload_weights(dev, qt), acts, batch, bias=upload(dev, b), residual=upload(dev, r))
    check(got, dev.download(route, np.float32, (batch, n)), since, tol=2e-3)


# launches the prologue takes: group widths, rows per group, units in flight (rounds past K or short of it), several
# groups per workgroup, fold, formats with super-blocks; special rows (slow: the default launches are checked above)
@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(["Q4_0", "Q8_0", "Q5_1", "IQ4_XS", "Q4_K", "Q6_K"]), n=st.integers(1, 40),
       blocks=st.integers(1, 12), batch=st.integers(1, 8), kind=st.sampled_from(["normal", "zeros", "huge", "tiny",
                                                                                   "negative"]),
       rows=st.integers(1, 3), tpr=st.sampled_from([2, 4, 8]), unroll=st.integers(1, 3),
       wg_groups=st.sampled_from([1, 2, 4]), fold=st.booleans(), bias=st.booleans(), residual=st.booleans(),
       seed=st.integers(0, 1000))
@example(fmt="Q4_0", n=33, blocks=12, batch=8, kind="huge", rows=2, tpr=8, unroll=1, wg_groups=4, fold=True,
         bias=False, residual=True, seed=1)
@example(fmt="Q4_K", n=7, blocks=2, batch=3, kind="tiny", rows=1, tpr=8, unroll=1, wg_groups=2, fold=False,
         bias=True, residual=False, seed=2)
@example(fmt="Q8_0", n=20, blocks=5, batch=1, kind="zeros", rows=3, tpr=4, unroll=2, wg_groups=1, fold=True,
         bias=False, residual=False, seed=3)
def test_matvec_normed_rows_drawn(fmt, n, blocks, batch, kind, rows, tpr, unroll, wg_groups, fold, bias, residual,
                                  seed):
    _needs_int_dot()
    dev = device()
    if not {"shuffle", "arithmetic"} <= dev.info.subgroup_ops or dev.info.min_subgroup_size < 8:
        pytest.skip("normalized rows need subgroup shuffles and arithmetic on subgroups of 8 lanes or more")
    f = quant.FORMATS[fmt]
    tpr = min(tpr, dev.info.min_subgroup_size)
    unroll = mv.whole_rounds(f, tpr, unroll)   # rounds of whole blocks and super-blocks
    cfg = mv.MatvecConfig(max(wg_groups * tpr, dev.info.max_subgroup_size), rows, True, True, tpr, unroll,
                          fold=fold and fmt in mv.FOLD_FORMATS, stage=True)
    assert mv.stage_fits(dev, f, cfg, batch, norm=True)
    k = _k_for(fmt, 1 + blocks % 3 if f.block_size == 256 else blocks)
    _normed_case(fmt, n, k, batch, kind, cfg, seed, bias=bias, residual=residual)


def test_matvec_normed_rows_long_rows():
    """Llama-3-8B's q/k/v width (K = 4096: many rounds on a CPU device's launch) at 8 activation rows."""
    _needs_int_dot()
    if mv.norm_config(device(), quant.FORMATS["Q4_0"], 96, 4096, 8) is None:
        pytest.skip("no launch for normalized rows on this device")
    _normed_case("Q4_0", 96, 4096, 8, "normal", None, 5, residual=True)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "Q4_K"])
@pytest.mark.parametrize("batch,kind", [(1, "normal"), (3, "huge"), (8, "normal")])
def test_matvec_glu_q8_over_normed_rows(fmt, batch, kind):
    """The norm in the gate/up product's prologue and the gated unit in its epilogue, one kernel: the blocks
    glu_q8 writes from the same launch's product over the normalized rows, bit for bit, and numpy's gated unit of
    the dequantized product of numpy's norm within the int8 rounding."""
    _needs_int_dot()
    dev = device()
    f, k = 96, 512
    cfg = mv.glu_norm_config(dev, quant.FORMATS[fmt], f, k, batch)
    if cfg is None:
        pytest.skip("no launch for normalized rows on this device")
    assert cfg.rows_per_workgroup == 64 and cfg.stage and cfg.int_dot
    rng = np.random.default_rng(batch)
    qt = weights(rng.standard_normal((2 * f, k)).astype(np.float32), fmt, batch)
    dw = mv.upload_weights(dev, qt)
    x = _special_rows(rng, (batch, k), kind)
    g = rng.standard_normal(k).astype(np.float32)
    rows = mv.NormedRows(upload(dev, x), upload(dev, g), 1e-5)
    want = _q8_parts(dev, norms.glu_q8(dev, mv.matvec(dev, dw, rows, batch, config=cfg), batch, f), batch, f)
    label = f"{mv.TEMPLATE[fmt]}+norm+glu_q8"
    before = templates.DISPATCHES[label]
    since = snapshot()
    got = _q8_parts(dev, mv.matvec_glu_q8(dev, dw, rows, batch), batch, f)
    assert templates.DISPATCHES[label] == before + 1
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    x64 = x.astype(np.float64)
    gu = (x64 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + 1e-5) * g) @ qt.dequantize().astype(np.float64).T
    a = gu[:, :f] / (1 + np.exp(-gu[:, :f])) * gu[:, f:]
    h = got[0].astype(np.float64).reshape(batch, -1, 32) * got[1].reshape(batch, -1, 1)
    check(h.reshape(batch, f), a, since, tol=2e-2)


def test_norm_config_table_and_refusals(monkeypatch):
    """NORM_PREFERRED by activation rows, VKGRAPH_NORM_PROLOGUE_SG's entries in its place, rounds raised to whole
    super-blocks; no launch past MAX_BATCH rows, NORM_MAX_ROWS weight rows, formats off the integer path or K not
    a multiple of 32; matvec refuses normalized rows where no launch takes them."""
    _needs_int_dot()
    dev = device()
    q40, q4k = quant.FORMATS["Q4_0"], quant.FORMATS["Q4_K"]
    if mv.norm_config(dev, q40, 4096, 4096, 1) is None:
        pytest.skip("no launch for normalized rows on this device")
    for batch in (1, 3, 8):
        cfg = mv.norm_config(dev, q40, 4096, 4096, batch)
        wg, rows, _, _, fold = mv.NORM_PREFERRED[1 << (batch - 1).bit_length()]
        assert (cfg.rows, cfg.fold, cfg.stage, cfg.int_dot) == (rows, fold, True, True) and cfg.tpr > 0
    cfg = mv.norm_config(dev, q4k, 4096, 4096, 1)
    assert cfg.tpr * cfg.unroll * mv.UNIT_ELEMS["Q4_K"] % 256 == 0 and not cfg.fold
    for fmt, n, k, batch in ((q40, 4096, 4096, 9), (q40, mv.NORM_MAX_ROWS + 1, 4096, 1),
                             (quant.FORMATS["F16"], 64, 64, 1), (q40, 64, 48, 1)):
        assert mv.norm_config(dev, fmt, n, k, batch) is None
    monkeypatch.setenv("VKGRAPH_NORM_PROLOGUE_SG", "1:64,3,1,4,0")
    cfg = mv.norm_config(dev, q40, 4096, 4096, 1)
    assert (cfg.wg, cfg.rows, cfg.tpr, cfg.fold) == (max(64, dev.info.max_subgroup_size), 3, 4, False)
    for bad in ("3:64,1,1,0,0", "1:64,1,1,0", "1:64,0,1,0,0", "1:64,1,1,0,2", "1:a,1,1,0,0"):
        monkeypatch.setenv("VKGRAPH_NORM_PROLOGUE_SG", bad)
        with pytest.raises(ValueError, match="VKGRAPH_NORM_PROLOGUE_SG"):
            mv.norm_config(dev, q40, 4096, 4096, 1)
    monkeypatch.delenv("VKGRAPH_NORM_PROLOGUE_SG")
    w = mv.upload_weights(dev, quant.quantize(np.ones((8, 64), np.float32), "Q4_0"))
    rows = mv.NormedRows(upload(dev, np.ones((2, 64), np.float32)), upload(dev, np.ones(64, np.float32)), 1e-5)
    with pytest.raises(ValueError, match="stage"):
        mv.matvec(dev, w, rows, 2, config=mv.MatvecConfig(32, 1, True, True, tpr=8, unroll=1))
    nine = mv.NormedRows(upload(dev, np.ones((9, 64), np.float32)), rows.gain, 1e-5)
    with pytest.raises(ValueError, match="no launch"):
        mv.matvec(dev, w, nine, 9)
    f16 = mv.upload_weights(dev, quant.quantize(np.ones((8, 64), np.float32), "F16"))
    with pytest.raises(ValueError, match="integer dot-product path takes"):
        mv.matvec(dev, f16, rows, 2)
