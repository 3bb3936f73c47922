"""Every template file in vkgraph/templates/glsl/ is registered, dispatched by a test and compared with numpy.

Marked `last` so it runs after the other template tests, whose records it reads. When
those tests are not part of the session (a single file was selected), it skips rather than guess.
"""

import os

import pytest
import test_templates_common as common

from vkgraph import templates

pytestmark = pytest.mark.last


def test_every_file_is_registered():
    files = {p.stem for p in templates.GLSL_DIR.glob("*.comp")}
    assert files, "no templates found"
    assert files == set(templates.registry())
    for t in templates.registry().values():
        assert t.interface.bindings, f"{t.name} declares no bindings"


def test_every_template_dispatched_and_checked(request):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker sees only its own share of the tests
        pytest.skip("the records are per process; run the template tests without -n to check coverage")
    ran = {item.path.name for item in request.session.items}
    template_tests = {p.name for p in request.path.parent.glob("test_templates_*.py")} - {request.path.name,
                                                                                        "test_templates_common.py"}
    if not template_tests <= ran:
        pytest.skip(f"needs the template tests in this session; not selected: {sorted(template_tests - ran)}")
    names = set(templates.registry())
    never_dispatched = sorted(n for n in names if templates.DISPATCHES[n] == 0)
    never_checked = sorted(names - common.CHECKED)
    assert not never_dispatched, f"templates no test dispatched: {never_dispatched}"
    assert not never_checked, f"templates never compared with numpy: {never_checked}"
