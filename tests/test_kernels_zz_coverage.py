"""Every template file in kernels/ is registered, dispatched by a test and compared with numpy.

Marked `last` so it runs after the other template tests, whose records it reads. When
those tests are not part of the session (a single file was selected), it skips rather than guess.
"""

import os

import pytest
import test_kernels_common as common

from vkgraph import kernels
from vkgraph.runtime.pipeline import kernel_include_dirs

pytestmark = pytest.mark.last


def test_every_file_is_registered():
    files = {p.stem for p in kernel_include_dirs()[0].glob("*.comp")}
    assert files, "no templates found"
    assert files == set(kernels.templates())
    for t in kernels.templates().values():
        assert t.interface.bindings, f"{t.name} declares no bindings"


def test_every_template_dispatched_and_checked(request):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker sees only its own share of the tests
        pytest.skip("the records are per process; run the template tests without -n to check coverage")
    ran = {item.path.name for item in request.session.items}
    template_tests = {p.name for p in request.path.parent.glob("test_kernels_*.py")} - {request.path.name,
                                                                                        "test_kernels_common.py"}
    if not template_tests <= ran:
        pytest.skip(f"needs the template tests in this session; not selected: {sorted(template_tests - ran)}")
    names = set(kernels.templates())
    never_dispatched = sorted(n for n in names if kernels.DISPATCHES[n] == 0)
    never_checked = sorted(names - common.CHECKED)
    assert not never_dispatched, f"templates no test dispatched: {never_dispatched}"
    assert not never_checked, f"templates never compared with numpy: {never_checked}"
