"""Would one persistent kernel per decode layer beat a dispatch per product? A chain of dependent phases, each
streaming its own weights, three ways.

    python benchmarks/probe_persistent.py [--phases 32] [--mb 14] [--groups 132,264,528] [--reps 10]

A batch-1 decode layer is a chain of products, each waiting for the one before (a barrier, then its launch and
its first loads: RESULTS.md, fourteenth session, measured 3-4 us a product against an overlapped launch). The probe
models a layer's chain as `--phases` phases; phase p streams its own `--mb` MB of "weights" (fresh bytes, past the
L2 over the chain) and reads a value the phase before wrote (the dependency), and writes one value per workgroup:
- dispatches: one dispatch per phase, the queue's barrier between them (as the decode step runs today);
- persistent: one dispatch of `--groups` workgroups looping over the phases, a grid-wide barrier (an atomic count
  and a spin) between phases; only correct where every workgroup is resident at once, so the groups are a
  multiple of the multiprocessors that fits (the H200 has 132);
- persistent+prefetch: the same, each workgroup loading the next phase's weights into registers before it waits
  at the barrier (the weights do not depend on the phase before);
- dispatches +warm: one dispatch per phase, each workgroup touching the first quarter (or all) of its words of the
  next phase once its own are done, so that they reach the L2 before the next dispatch asks for them.
Prints microseconds per phase (GPU time through replayed graphs) and GB/s of weights. Checks that each way leaves
the same values. On a CPU driver only one workgroup runs (its workgroups may not all run at once).
"""

from __future__ import annotations

import argparse

import numpy as np
from common import raise_clocks, replay_us

from vkgraph.runtime import get_device

SOURCE = """#version 450
#extension GL_KHR_shader_subgroup_arithmetic : enable
#extension GL_EXT_control_flow_attributes : require
layout(local_size_x = 256) in;
layout(constant_id = 0) const uint R = 4;          // 16-byte words an invocation streams per phase
layout(constant_id = 1) const bool PREFETCH = false;
layout(constant_id = 2) const uint WARM = 0;         // dispatches: words of the next phase each invocation touches
layout(set = 0, binding = 0) readonly buffer W { uvec4 w[]; };        // [phases][groups][R][256]
layout(set = 0, binding = 1) coherent buffer Act { uint act[]; };     // [phases + 1][groups]
layout(set = 0, binding = 2) coherent volatile buffer Sync { uint arrived[]; };
layout(push_constant) uniform Push { uint phase0; uint phases; uint next; } pc;   // next: a phase follows
shared uint part[256];   // per subgroup (subgroups of 1 lane at most)

uvec4 q[R];

void load(uint p) {
    const uint g = gl_NumWorkGroups.x, base = ((p * g + gl_WorkGroupID.x) * R) * 256 + gl_LocalInvocationID.x;
    [[unroll]] for (uint i = 0; i < R; i++) q[i] = w[base + i * 256];
}

void run(uint p) {   // phase p: this workgroup's words and one value of phase p - 1 -> act[p + 1][wg]
    const uint g = gl_NumWorkGroups.x, wg = gl_WorkGroupID.x;
    uint h = act[p * g + (wg * 7u + 1u) % g];   // the dependency: written by another workgroup's phase p - 1
    [[unroll]] for (uint i = 0; i < R; i++) h += q[i].x ^ q[i].y ^ q[i].z ^ q[i].w;
    h = subgroupAdd(h);
    if (gl_SubgroupInvocationID == 0) part[gl_SubgroupID] = h;
    barrier();
    if (gl_LocalInvocationID.x == 0) {
        uint s = 0;
        for (uint i = 0; i < gl_NumSubgroups; i++) s += part[i];
        act[(p + 1) * g + wg] = s;
    }
}

void grid_barrier(uint n) {   // the n-th of this dispatch: every workgroup's writes before, visible after
    memoryBarrierBuffer();
    barrier();
    if (gl_LocalInvocationID.x == 0) {
        atomicAdd(arrived[0], 1u);
        while (arrived[0] < n * gl_NumWorkGroups.x) {}
    }
    barrier();
    memoryBarrierBuffer();
}

// The first WARM of this invocation's words of phase p, loaded and dropped (kept only by a write no run makes):
// they come to the L2 while this dispatch ends, so the next dispatch's first loads hit it.
void warm(uint p) {
    const uint g = gl_NumWorkGroups.x, base = ((p * g + gl_WorkGroupID.x) * R) * 256 + gl_LocalInvocationID.x;
    uint h = 0;
    [[unroll]] for (uint i = 0; i < WARM; i++) h ^= w[base + i * 256].x;
    if (h == 0x9e3779b9u && pc.phases == 0u) act[0] = h;   // never: phases >= 1
}

void main() {
    const uint last = pc.phase0 + pc.phases;
    if (PREFETCH) load(pc.phase0);
    for (uint p = pc.phase0; p < last; p++) {
        if (!PREFETCH) load(p);
        run(p);
        if (PREFETCH && p + 1 < last) load(p + 1);   // before the wait: nothing in it depends on phase p
        if (p + 1 < last) grid_barrier(p + 1 - pc.phase0);
    }
    if (WARM > 0 && pc.next > 0u) warm(last);
}
"""

ZERO = """#version 450
layout(local_size_x = 1) in;
layout(set = 0, binding = 0) buffer Sync { uint arrived[]; };
void main() { arrived[0] = 0u; }
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phases", type=int, default=32)
    ap.add_argument("--mb", type=float, default=14.0, help="weights per phase, MB (the 8B q/k/v product's 14.2)")
    ap.add_argument("--groups", default="132,264,528")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    dev = get_device()
    cpu = dev.info.device_type == "cpu"
    zero = dev.pipeline(ZERO, name="zero")
    sync = dev.alloc(256)
    print(f"{dev.info.name}: {a.phases} dependent phases of ~{a.mb:g} MB each; us per phase (GB/s)")
    print(f"{'groups':>6s} {'MB':>6s} {'dispatches':>16s} {'+warm 1/4':>16s} {'+warm all':>16s} "
          f"{'persistent':>16s} {'persist+prefetch':>18s}")
    for groups in ([1] if cpu else [int(g) for g in a.groups.split(",")]):
        probe(dev, zero, sync, groups, a.phases, a.mb, a.reps)


def probe(dev, zero, sync, groups: int, phases: int, mb_asked: float, reps: int) -> None:
    r = max(1, round(mb_asked * 1e6 / (groups * 256 * 16)))
    words = phases * groups * r * 256
    w = dev.alloc(words * 16)
    dev.upload(w, np.random.default_rng(groups).integers(0, 2**32, words * 4, dtype=np.uint32))
    act = dev.alloc((phases + 1) * groups * 4)
    dev.upload(act, np.arange((phases + 1) * groups, dtype=np.uint32))
    kern = {pf: dev.pipeline(SOURCE, spec={"R": r, "PREFETCH": pf}, name="phases" + ("_pf" if pf else ""))
            for pf in (False, True)}
    warmed = {n: dev.pipeline(SOURCE, spec={"R": r, "WARM": n}, name=f"phases_warm{n}") for n in {max(1, r // 4), r}}

    def dispatches(warm: int = 0):
        def run() -> None:
            k = warmed[warm] if warm else kern[False]
            for p in range(phases):
                dev.dispatch(k, [w, act, sync], (groups, 1, 1), {"phase0": p, "phases": 1, "next": p + 1 < phases})
        return run

    def persistent(pf: bool):
        def run() -> None:
            dev.dispatch(zero, [sync], (1, 1, 1))
            dev.dispatch(kern[pf], [w, act, sync], (groups, 1, 1), {"phase0": 0, "phases": phases, "next": 0})
        return run

    ways = (dispatches(), dispatches(max(1, r // 4)), dispatches(r), persistent(False), persistent(True))
    results = []
    for run in ways:
        run()
        results.append(dev.download(act, np.uint32))
    if not all(np.array_equal(results[0], x) for x in results[1:]):
        raise SystemExit(f"groups={groups}: the ways left different values")
    raise_clocks()
    mb = groups * r * 256 * 16 / 1e6
    cells = []
    for run in ways:
        us = replay_us(dev, run, reps, per_graph=10) / phases
        cells.append(f"{us:7.2f} ({mb * 1e3 / us:5.0f})")
    print(f"{groups:6d} {mb:6.1f} " + " ".join(f"{c:>16s}" for c in cells[:-1]) + f" {cells[-1]:>18s}", flush=True)
    w.release()
    act.release()


if __name__ == "__main__":
    main()
