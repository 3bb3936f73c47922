"""bench_matvec_launch.py with Q4_K's matvec in its earlier form, for old against new on one checkout:

    python benchmarks/bench_matvec_q4k_word.py [bench_matvec_launch.py's arguments, e.g. --formats Q4_K]

The earlier form (matvec_q4_k_word.comp beside this file) takes a unit of one nibble word (16 bytes, 32 elements)
and loads and decodes the super-block's header for each; the current template takes the pair of words of a
64-element chunk, one header load and one decoding of its scales and mins per 32 bytes. Here the earlier source
replaces the template of the same name in this process, with the unit size and the launch tables it was measured
with (INT_DOT_PREFERRED, PREFERRED; no INT_DOT_ONE_ROW entry), and bench_matvec_launch runs as given.
"""

from __future__ import annotations

from pathlib import Path

import bench_matvec_launch

from vkgraph.runtime.interface import expand_includes, parse_interface
from vkgraph.templates import catalog
from vkgraph.templates import matvec as mv

WORD_SOURCE = Path(__file__).with_name("matvec_q4_k_word.comp")


def use_word_units() -> None:
    """Q4_K's matvec in its one-word-unit form, with the tables it was measured with, for this process."""
    source = WORD_SOURCE.read_text()
    interface = parse_interface(expand_includes(source, [catalog.GLSL_DIR]))
    catalog.registry()["matvec_q4_k"] = catalog.Template("matvec_q4_k", WORD_SOURCE, source, interface)
    mv.UNIT_ELEMS["Q4_K"] = 32
    mv.PREFERRED["Q4_K"] = (64, 128, 8)
    mv.INT_DOT_PREFERRED["Q4_K"] = {1: (128, 128, 4), 2: (32, 64, 4), 4: (32, 64, 4), 8: (32, 64, 4)}
    mv.INT_DOT_ONE_ROW.pop("Q4_K", None)


if __name__ == "__main__":
    use_word_units()
    print("Q4_K: the earlier matvec (units of one nibble word)")
    bench_matvec_launch.main()
