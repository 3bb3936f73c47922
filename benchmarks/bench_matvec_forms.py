"""bench_matvec_launch.py with other forms of the matvec templates, for old against new on one checkout:

    python benchmarks/bench_matvec_forms.py [--q4k-word] [--mantissa-cvt] [bench_matvec_launch.py's arguments]

--q4k-word: Q4_K's matvec in its earlier form (matvec_q4_k_word.comp beside this file): a unit of one nibble
word (16 bytes, 32 elements) that loads and decodes the super-block's header for each, where the current
template takes the pair of words of a 64-element chunk, one header load and one decoding of its scales and mins
per 32 bytes; with the unit size and the launch tables it was measured with (INT_DOT_PREFERRED, PREFERRED; no
INT_DOT_ONE_ROW entry).
--mantissa-cvt: the integer path's conversions of the integer dot products and activation sums to float
(matvec_common.glsl's `float(...)`, one per run or unit and row) done through the mantissa of 1.5 * 2^23, exact
for |v| < 2^22 (every such value the formats give), where an integer-to-float conversion runs at a fraction of
the float rate on NVIDIA; every matvec template of the process takes it.
The forms replace the templates of the same names in this process only; bench_matvec_launch then runs as given.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import bench_matvec_launch

from vkgraph.runtime.interface import expand_includes, parse_interface
from vkgraph.templates import catalog
from vkgraph.templates import matvec as mv

HERE = Path(__file__).resolve().parent
I2F = ("float i2f_mantissa(int v) { return uintBitsToFloat(uint(v + 0x4B400000)) - 12582912.0; }\n"
       "void accumulate(uint base, uint u)")


def _replace(name: str, path: Path, source: str) -> None:
    interface = parse_interface(expand_includes(source, [catalog.GLSL_DIR]))
    catalog.registry()[name] = catalog.Template(name, path, source, interface)


def use_q4k_word() -> None:
    """Q4_K's matvec in its one-word-unit form, with the tables it was measured with, for this process."""
    path = HERE / "matvec_q4_k_word.comp"
    _replace("matvec_q4_k", path, path.read_text())
    mv.UNIT_ELEMS["Q4_K"] = 32
    mv.PREFERRED["Q4_K"] = (64, 128, 8)
    mv.INT_DOT_PREFERRED["Q4_K"] = {1: (128, 128, 4), 2: (32, 64, 4), 4: (32, 64, 4), 8: (32, 64, 4)}
    mv.INT_DOT_ONE_ROW.pop("Q4_K", None)


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
            _replace(name, t.path, t.source.replace('#include "matvec_common.glsl"', body))


if __name__ == "__main__":
    forms = {"--q4k-word": use_q4k_word, "--mantissa-cvt": use_mantissa_cvt}
    for flag in [a for a in sys.argv[1:] if a in forms]:
        forms[flag]()
        sys.argv.remove(flag)
        print(f"form: {flag}")
    bench_matvec_launch.main()
