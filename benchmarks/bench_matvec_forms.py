"""bench_matvec_launch.py with another form of the matvec templates, for old against new on one checkout:

    python benchmarks/bench_matvec_forms.py --mantissa-cvt [bench_matvec_launch.py's arguments]

--mantissa-cvt: the integer path's conversions of the integer dot products and activation sums to float
(matvec_common.glsl's `float(...)`, one per run or unit, row and activation row) done through the mantissa of
1.5 * 2^23, exact for |v| < 2^22 (every such value the formats give: results bit for bit the same), where an
integer-to-float conversion runs at a fraction of the float rate on NVIDIA; every matvec template of the process
takes it. The form replaces the templates of the same names in this process only; bench_matvec_launch then runs
as given.
"""

from __future__ import annotations

import re
import sys

import bench_matvec_launch

from vkgraph.runtime.interface import expand_includes, parse_interface
from vkgraph.templates import catalog

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


if __name__ == "__main__":
    if "--mantissa-cvt" in sys.argv:
        sys.argv.remove("--mantissa-cvt")
        use_mantissa_cvt()
        print("form: --mantissa-cvt")
    bench_matvec_launch.main()
