import json
import os
import subprocess
import sys

import numpy as np
import pytest

from vkgraph.runtime import Device, DeviceError, KernelInterfaceError
from vkgraph.runtime.interface import parse_interface

AXPB = """#version 450
// kernel: axpb
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 64;
layout(set = 0, binding = 0) readonly buffer X { float x[]; };
layout(set = 0, binding = 1) writeonly buffer Y { float y[]; };
layout(push_constant) uniform Push { uint n; float a; float b; } pc;
void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i < pc.n) y[i] = pc.a * x[i] + pc.b;
}
"""

ADD_INPLACE = """#version 450
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) buffer Acc { float acc[]; };
layout(set = 0, binding = 1) readonly buffer X { float x[]; };
layout(push_constant) uniform Push { uint n; } pc;
void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i < pc.n) acc[i] += x[i];
}
"""


def test_interface_parsing():
    iface = parse_interface(AXPB)
    assert [(b.index, b.readonly) for b in iface.bindings] == [(0, True), (1, False)]
    assert [(f.name, f.offset) for f in iface.push_fields] == [("n", 0), ("a", 4), ("b", 8)]
    assert iface.push_size == 12 and iface.local_size == ("WG", 1, 1)
    assert iface.spec_constants["WG"].id == 0


def test_push_constant_alignment():
    src = AXPB.replace("uint n; float a; float b;", "uint n; uint64_t big; float a; float b;")
    iface = parse_interface(src)
    assert [(f.name, f.offset) for f in iface.push_fields] == [("n", 0), ("big", 8), ("a", 16), ("b", 20)]
    assert iface.push_struct().size == 24


def test_dispatch_matches_numpy(dev):
    n = 1000
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    bx, by = dev.alloc(x.nbytes), dev.alloc(x.nbytes)
    dev.upload(bx, x)
    for wg in (32, 64, 128):
        k = dev.pipeline(AXPB, spec={"WG": wg})
        assert k.local_size == (wg, 1, 1)
        dev.dispatch(k, [bx, by], ((n + wg - 1) // wg, 1, 1), push={"n": n, "a": 2.0, "b": -1.0})
        np.testing.assert_allclose(dev.download(by, np.float32, n), 2 * x - 1, rtol=1e-6)


def test_dependent_chain_in_one_submit(dev):
    """50 dispatches, each reading what the one before wrote, recorded into one command buffer."""
    n = 4096
    k_axpb = dev.pipeline(AXPB, spec={"WG": 64})
    k_add = dev.pipeline(ADD_INPLACE)
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    a, b, acc = dev.alloc(x.nbytes), dev.alloc(x.nbytes), dev.alloc(x.nbytes)
    dev.upload(a, x)
    dev.upload(acc, np.zeros(n, np.float32))
    dev.synchronize()
    submits = dev.queue.stats["submits"]
    ref, ref_acc = x.copy(), np.zeros(n, np.float32)
    for i in range(25):
        src, dst = (a, b) if i % 2 == 0 else (b, a)
        dev.dispatch(k_axpb, [src, dst], (n // 64, 1, 1), (n, 1.0, float(i)))
        dev.dispatch(k_add, [acc, dst], (n // 64, 1, 1), (n,))
        ref = ref + np.float32(i)
        ref_acc = ref_acc + ref
    dev.synchronize()
    assert dev.queue.stats["submits"] == submits + 1
    np.testing.assert_allclose(dev.download(acc, np.float32, n), ref_acc, rtol=1e-5, atol=1e-3)


def test_independent_dispatches_need_no_barrier(dev):
    k = dev.pipeline(AXPB, spec={"WG": 64})
    x = dev.alloc(256)
    outs = [dev.alloc(256) for _ in range(8)]
    dev.synchronize()
    dev.dispatch(k, [x, outs[0]], (1, 1, 1), (64, 1.0, 0.0))  # may need one barrier after the upload
    before = dev.queue.stats["barriers"]
    for o in outs[1:]:
        dev.dispatch(k, [x, o], (1, 1, 1), (64, 1.0, 0.0))
    assert dev.queue.stats["barriers"] == before
    dev.dispatch(k, [outs[1], x], (1, 1, 1), (64, 1.0, 0.0))  # reads a written buffer: barrier
    assert dev.queue.stats["barriers"] == before + 1
    dev.synchronize()


def test_push_constant_errors(dev):
    k = dev.pipeline(AXPB, spec={"WG": 64})
    a, b = dev.alloc(64), dev.alloc(64)
    with pytest.raises(KernelInterfaceError, match="missing"):
        dev.dispatch(k, [a, b], (1, 1, 1), {"n": 4})
    with pytest.raises(KernelInterfaceError, match="takes 3"):
        dev.dispatch(k, [a, b], (1, 1, 1), (4, 1.0))
    with pytest.raises(KernelInterfaceError, match="do not fit"):
        dev.dispatch(k, [a, b], (1, 1, 1), {"n": -4, "a": 1.0, "b": 1.0})
    with pytest.raises(KernelInterfaceError, match="declares 2 buffers"):
        dev.dispatch(k, [a], (1, 1, 1), (4, 1.0, 1.0))


def test_push_constant_limit(dev):
    fields = " ".join(f"uint f{i};" for i in range(dev.info.max_push_constants_size // 4 + 1))
    src = AXPB.replace("uint n; float a; float b;", "uint n; float a; float b; " + fields)
    with pytest.raises(KernelInterfaceError, match="push constants take"):
        dev.pipeline(src)


def test_dispatch_limits(dev):
    k = dev.pipeline(AXPB, spec={"WG": 64})
    a, b = dev.alloc(64), dev.alloc(64)
    with pytest.raises(KernelInterfaceError, match="workgroups"):
        dev.dispatch(k, [a, b], (dev.info.max_workgroup_count[0] + 1, 1, 1), (4, 1.0, 1.0))
    with pytest.raises(KernelInterfaceError, match="local size"):
        dev.pipeline(AXPB, spec={"WG": dev.info.max_workgroup_invocations * 2})
    with pytest.raises(KernelInterfaceError, match="not declared"):
        dev.pipeline(AXPB, spec={"NOPE": 1})
    released = dev.alloc(64)
    released.release()
    with pytest.raises(KernelInterfaceError, match="released"):
        dev.dispatch(k, [a, released], (1, 1, 1), (4, 1.0, 1.0))


def test_views_bind_ranges(dev):
    n = 256
    x = np.arange(2 * n, dtype=np.float32)
    big = dev.alloc(x.nbytes)
    out = dev.alloc(x.nbytes)
    dev.upload(big, x)
    k = dev.pipeline(AXPB, spec={"WG": 64})
    dev.dispatch(k, [big.view(n * 4, n * 4), out.view(0, n * 4)], (n // 64, 1, 1), (n, 1.0, 0.0))
    np.testing.assert_array_equal(dev.download(out, np.float32, n), x[n:])
    with pytest.raises(ValueError, match="outside"):
        big.view(8, x.nbytes)


def test_device_selection_by_environment(dev):
    name = dev.info.name
    for sel in ("0", name.split()[0]):
        d = Device(selector=sel)
        try:
            assert d.info.name == name
        finally:
            d.close()
    with pytest.raises(DeviceError, match="matches none"):
        Device(selector="no-such-gpu-xyz")
    with pytest.raises(DeviceError, match="only"):
        Device(selector="99")
    env = dict(os.environ, VKGRAPH_DEVICE="no-such-gpu-xyz")
    r = subprocess.run([sys.executable, "-m", "vkgraph.info"], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "matches none" in r.stderr


def test_info_table():
    r = subprocess.run([sys.executable, "-m", "vkgraph.info"], capture_output=True, text=True)
    assert r.returncode == 0
    for field in ("subgroup_size", "max_storage_buffer_range", "float16", "heaps"):
        assert field in r.stdout


def test_profile_trace(tmp_path):
    script = (
        "import numpy as np\n"
        "from vkgraph.runtime import get_device\n"
        f"src = {AXPB!r}\n"
        "dev = get_device(); k = dev.pipeline(src, spec={'WG': 64})\n"
        "a, b = dev.alloc(4096), dev.alloc(4096)\n"
        "for _ in range(5): dev.dispatch(k, [a, b], (16, 1, 1), (1024, 1.0, 0.0))\n"
        "dev.synchronize()\n"
    )
    trace = tmp_path / "t.json"
    env = dict(os.environ, VKGRAPH_PROFILE="1", VKGRAPH_PROFILE_FILE=str(trace))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert "axpb" in r.stdout and "mean us" in r.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert len(events) == 5 and all(e["name"] == "axpb" and e["dur"] >= 0 for e in events)


def test_binding_count_limit(dev):
    n = dev.info.max_storage_buffers + 1
    if n > 4096:  # NVIDIA reports ~2^32: a shader that large cannot be written, so there is nothing to exceed
        pytest.skip(f"the device allows {n - 1} storage buffers per kernel")
    decls = "\n".join(f"layout(set = 0, binding = {i}) buffer B{i} {{ float b{i}[]; }};" for i in range(n))
    src = f"#version 450\nlayout(local_size_x = 1) in;\n{decls}\nvoid main() {{ b0[0] = 1.0; }}\n"
    with pytest.raises(KernelInterfaceError, match="storage buffers"):
        dev.pipeline(src)


def test_descriptor_cache_eviction_never_frees_the_set_being_bound(dev, monkeypatch):
    """With the cache full, a new set must survive its own eviction pass (binding a freed set crashes NVIDIA)."""
    from vkgraph.runtime import descriptors

    monkeypatch.setattr(descriptors, "CAPACITY", 4)
    k = dev.pipeline(AXPB)
    n = 64
    x, y = dev.alloc(n * 4 * 16), dev.alloc(n * 4 * 16)
    dev.upload(x, np.arange(n * 16, dtype=np.float32))
    q = dev.queue
    for i in range(16):  # every view pair is a new descriptor set
        xv, yv = x.view(i * n * 4, n * 4), y.view(i * n * 4, n * 4)
        dev.dispatch(k, [xv, yv], (1, 1, 1), push={"n": n, "a": 2.0, "b": 1.0})
        dev.synchronize()
        assert any(key[1][0][1] == i * n * 4 for key in q.descriptors.sets), "the set just bound was freed"
        assert len(q.descriptors.sets) <= 4
    np.testing.assert_array_equal(dev.download(y, np.float32, n * 16), np.arange(n * 16) * 2.0 + 1.0)


def test_kernel_statistics_or_a_clear_refusal(monkeypatch):
    """Device.kernel_statistics: with VKGRAPH_PIPELINE_STATS=1 where the driver offers the extension, the driver's
    figures for each executable of a kernel; elsewhere UnsupportedFeature saying why."""
    from vkgraph.runtime import UnsupportedFeature

    src = """#version 450
layout(local_size_x = 64) in;
layout(set = 0, binding = 0) buffer B { float b[]; };
void main() { b[gl_GlobalInvocationID.x] += 1.0; }
"""
    for asked in ("0", "1"):
        monkeypatch.setenv("VKGRAPH_PIPELINE_STATS", asked)
        d = Device()
        try:
            pipe = d.pipeline(src, name="add_one")
            if asked == "1" and d.info.pipeline_statistics:
                stats = d.kernel_statistics(pipe)
                assert stats and all(isinstance(v, int | float | bool) for s in stats.values() for v in s.values())
                assert any(s for s in stats.values())
            else:
                why = "VKGRAPH_PIPELINE_STATS" if d.info.pipeline_statistics else "does not offer"
                with pytest.raises(UnsupportedFeature, match=why):
                    d.kernel_statistics(pipe)
        finally:
            d.close()


def test_a_device_refusing_the_hand_laid_nvidia_extensions_is_made_without_them(monkeypatch):
    """The NVIDIA extensions newer than the `vulkan` package (their structures laid out by hand) are left off, and
    their DeviceInfo rows cleared, where vkCreateDevice refuses them; here a device that lacks them is told it
    has them, so its driver refuses the extension names."""
    from vkgraph.runtime import device as device_mod

    fake = device_mod.CoopVecTypes(*["float16"] * 5, False)
    monkeypatch.setattr(device_mod, "_cooperative_vector", lambda *a: ((fake,), 64))
    d = Device()
    try:
        if device_mod.COOPVEC_EXT in device_mod._device_extensions(d.physical):
            pytest.skip(f"{d.info.name} offers {device_mod.COOPVEC_EXT}: nothing refuses it")
        assert d.info.cooperative_vector == () and d.info.cooperative_vector_max_components == 0
        buf = d.alloc(16)  # a working device
        d.upload(buf, np.arange(4, dtype=np.float32))
        assert d.download(buf, np.float32).tolist() == [0, 1, 2, 3]
        buf.release()
    finally:
        d.close()
