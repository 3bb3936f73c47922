"""Shared fixtures. With the validation layer on (VK_INSTANCE_LAYERS=VK_LAYER_KHRONOS_validation or
VKGRAPH_VALIDATION=1), any validation message during a test fails that test."""

from __future__ import annotations

import os

import pytest

# The suite holds quantized matvecs to float references (5e-4); the int8-activation path, the default on
# devices that accelerate int8 dot products, is tested against its own reference where a test asks for it.
os.environ.setdefault("VKGRAPH_INT_DOT", "0")

from vkgraph.runtime import device as device_module


@pytest.fixture(autouse=True)
def _no_validation_messages():
    dev = device_module._DEVICE
    before = len(dev.validation_messages) if dev is not None else 0
    yield
    dev_after = device_module._DEVICE
    if dev_after is None:
        return
    start = before if dev_after is dev else 0
    new = dev_after.validation_messages[start:]
    if new:
        del dev_after.validation_messages[start:]
        pytest.fail("Vulkan validation messages:\n" + "\n".join(new[:10]))


def pytest_collection_modifyitems(config, items):
    """Tests marked `last` (checks over what the other tests recorded) run after all others."""
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)


@pytest.fixture
def dev():
    return device_module.get_device()


def pytest_sessionfinish(session, exitstatus):
    """Close the device at the end, so that validation reports leaked objects, and fail on any message."""
    dev = device_module._DEVICE
    if dev is None or dev.closed:
        return
    dev.close()
    if dev.validation_messages:
        print("\nVulkan validation messages at teardown:\n" + "\n".join(dev.validation_messages[:10]))
        session.exitstatus = 1
