"""bench_matvec_launch.py with another form of the matvec templates, for old against new on one checkout:

    python benchmarks/bench_matvec_forms.py --mantissa-cvt [bench_matvec_launch.py's arguments]
    python benchmarks/bench_matvec_forms.py --h2h TEMPLATE:DEFINE[,TEMPLATE:DEFINE ...]
                                            [--formats Q4_K] [--batches 1,8] [--shapes 8b] [--products o,down]
                                            [--rounds 6]

--mantissa-cvt: the integer path's conversions of the integer dot products and activation sums to float
(matvec_common.glsl's `float(...)`, one per run or unit, row and activation row) done through the mantissa of
1.5 * 2^23, exact for |v| < 2^22 (every such value the formats give: results bit for bit the same), where an
integer-to-float conversion runs at a fraction of the float rate on NVIDIA; every matvec template of the process
takes it. The form replaces the templates of the same names in this process only; bench_matvec_launch then runs
as given.

--h2h: each TEMPLATE:DEFINE is a form of a template, its source compiled with DEFINE set (the template keeps the
form it is compared with behind that define); every format whose template it is runs both forms head to head in one
process: per product and batch, the default launch (choose_config), the workgroup and the subgroup-rows one, the
same configurations for both forms, all captured first, then replayed in turn --rounds times after the clocks are
raised (as bench_matvec_launch --wg-sweep). GB/s of weight bytes, int8 activations where the integer path runs.
"""

from __future__ import annotations

import argparse
import re
import sys

import bench_matvec_launch
import numpy as np
from bench_kernels import _release_weights, _weight_copies
from bench_matvec_launch import SHAPES, _acts, _wg_name, product_run
from common import capture_graph, raise_clocks, replay_many_us

from vkgraph.quant import FORMATS
from vkgraph.runtime import get_device
from vkgraph.runtime.interface import expand_includes, parse_interface
from vkgraph.templates import catalog
from vkgraph.templates import matvec as mv

I2F = ("float i2f_mantissa(int v) { return uintBitsToFloat(uint(v + 0x4B400000)) - 12582912.0; }\n"
       "void accumulate(uint base, uint u)")


def use_mantissa_cvt() -> None:
    """Every matvec template of this process with the integer path's int-to-float conversions through the
    mantissa (the shared body inlined into each, its `float(` calls on integers replaced)."""
    common = (catalog.GLSL_DIR / "matvec_common.glsl").read_text()
    body = common.replace("void accumulate(uint base, uint u)", I2F, 1)
    body, count = re.subn(r"float\((d|xsu|xs|run_idot\(q\[base \+ r\], j, xq, xs\))\)", r"i2f_mantissa(\1)", body)
    if count != 4:
        raise RuntimeError(f"matvec_common.glsl changed: {count} conversions found where 4 were expected")
    for name in [n for n in catalog.registry() if n.startswith("matvec_")]:
        t = catalog.get(name)
        if '#include "matvec_common.glsl"' in t.source:
            source = t.source.replace('#include "matvec_common.glsl"', body)
            interface = parse_interface(expand_includes(source, [catalog.GLSL_DIR]))
            catalog.registry()[name] = catalog.Template(name, t.path, source, interface)


def define_form(name: str, define: str) -> str:
    """Register template `name` compiled with `define` set as a template of its own; returns its name."""
    t = catalog.get(name)
    head, rest = t.source.split("\n", 1)  # the #version line first
    source = f"{head}\n#define {define} 1\n{rest}"
    form = f"{name}@{define}"
    catalog.registry()[form] = catalog.Template(form, t.path, source, t.interface)
    return form


def head_to_head(forms: list[tuple[str, str]], argv: list[str]) -> None:
    """What --h2h promises."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="Q4_K")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--shapes", default="8b")
    ap.add_argument("--products", default="")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args(argv)
    dev = get_device()
    rng = np.random.default_rng(0)
    print(f"{dev.info.name}: GB/s of weight bytes per form; (r): the form's speed over base's, same launch")
    for fmt in a.formats.split(","):
        f, base = FORMATS[fmt], mv.TEMPLATE[fmt]
        variants = [(define, define_form(name, define)) for name, define in forms if name == base]
        if not variants:
            print(f"{fmt}: no form of {base} given")
            continue
        names = [("base", base), *variants]
        for shape in a.shapes.split(","):
            for product, n, k in SHAPES[shape]:
                if a.products and product not in a.products.split(","):
                    continue
                nbytes = n * f.row_bytes(k)
                ws = _weight_copies(dev, rng, fmt, n, k)
                for batch in [int(b) for b in a.batches.split(",")]:
                    auto = mv.choose_config(dev, f, n, k, batch)
                    cfgs = list(dict.fromkeys([auto, mv.choose_config(dev, f, n, k, batch, subgroup_rows=False),
                                               mv.choose_config(dev, f, n, k, batch, subgroup_rows=True)]))
                    x, bufs = _acts(dev, rng, batch, k, auto.int_dot)
                    y = dev.alloc(batch * n * 4)
                    graphs = {}
                    try:
                        for label, template in names:
                            mv.TEMPLATE[fmt] = template
                            for w in ws:
                                w.pipelines.clear()
                            for cfg in cfgs:
                                graphs[(label, cfg)] = capture_graph(dev, product_run(dev, ws, x, y, batch, cfg))
                        mv.TEMPLATE[fmt] = base
                        raise_clocks(1.0)
                        us = replay_many_us(dev, graphs, a.rounds)
                    finally:
                        mv.TEMPLATE[fmt] = base
                        for graph in graphs.values():
                            graph.destroy()
                        for w in ws:
                            w.pipelines.clear()
                    for cfg in cfgs:
                        tag = ("default " if cfg == auto else "") + _wg_name(cfg)
                        base_gbs = nbytes / us[("base", cfg)] / 1e3
                        cells = ", ".join(f"{label} {nbytes / us[(label, cfg)] / 1e3:.0f} "
                                          f"({us[('base', cfg)] / us[(label, cfg)]:.3f}x)" for label, _ in variants)
                        print(f"{fmt:>5s} {product:>8s} {n:>6d}x{k:<6d} b{batch} {tag:<28s} base {base_gbs:.0f}, "
                              f"{cells}", flush=True)
                    for buf in (*bufs, y):
                        buf.release()
                _release_weights(ws)


if __name__ == "__main__":
    if "--h2h" in sys.argv:
        i = sys.argv.index("--h2h")
        spec = sys.argv[i + 1]
        head_to_head([tuple(s.split(":", 1)) for s in spec.split(",")], sys.argv[1:i] + sys.argv[i + 2:])
        sys.exit(0)
    if "--mantissa-cvt" in sys.argv:
        sys.argv.remove("--mantissa-cvt")
        use_mantissa_cvt()
        print("form: --mantissa-cvt")
    bench_matvec_launch.main()
