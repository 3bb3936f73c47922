#version 450
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
#extension GL_EXT_shader_atomic_int64 : require
#extension GL_KHR_memory_scope_semantics : require
// The sum over `world` devices of each one's part (n float32 values), through host memory every device imports
// (vkgraph/parallel.py: PeerAllReduce), with no host in the loop. Each value is posted as one 8-byte cell (the
// call's sequence number, and the value's bits), written and read by 64-bit atomic stores and loads, so a reader
// that sees the number sees the value with it, without a fence between data and flag (the low-latency protocol
// of NCCL), and a load in a waiting loop is never hoisted out of it. Workgroup g numbers its calls in counters[g]
// (every rank makes the same calls, so the numbers agree); it posts its values, then waits for each other rank's
// cell to carry the same number and adds the parts in rank order (every rank gets the same bits). A wait longer
// than spin_limit loads gives up: the value is NaN and the first word of cell 0 is set for the host to see.
layout(local_size_x_id = 0) in;
layout(constant_id = 0) const uint WG = 256;
layout(constant_id = 1) const uint PER = 4;  // values per invocation
layout(constant_id = 2) const uint BURN = 0;  // sin() evaluations between two loads of a waiting loop
layout(set = 0, binding = 0) readonly buffer Part { float part[]; };
layout(set = 0, binding = 1) buffer Cells { uint64_t cells[]; };
layout(set = 0, binding = 2) writeonly buffer Out { float outv[]; };
layout(set = 0, binding = 3) buffer Counters { uint counters[]; };

layout(push_constant) uniform Push {
    uint n;
    uint rank;
    uint world;
    uint slots;  // first cell of this call's slot set: world rows of n cells
    uint spin_limit;
} pc;

shared uint seq;

uint64_t load_cell(uint k) {
    return atomicLoad(cells[k], gl_ScopeDevice, gl_StorageSemanticsBuffer, gl_SemanticsRelaxed | gl_SemanticsVolatile);
}

void main() {
    const uint g = gl_WorkGroupID.x;
    const uint lid = gl_LocalInvocationID.x;
    if (lid == 0) {
        seq = counters[g] + 1u;
        counters[g] = seq;
    }
    barrier();
    const uint s = seq;
    const uint base = g * WG * PER + lid;
    [[unroll]] for (uint j = 0; j < PER; j++) {
        const uint i = base + j * WG;
        if (i < pc.n) {
            const uint64_t cell = (uint64_t(s) << 32) | uint64_t(floatBitsToUint(part[i]));
            atomicStore(cells[pc.slots + pc.rank * pc.n + i], cell, gl_ScopeDevice, gl_StorageSemanticsBuffer,
                        gl_SemanticsRelaxed);
        }
    }
    [[unroll]] for (uint j = 0; j < PER; j++) {
        const uint i = base + j * WG;
        if (i >= pc.n) continue;
        precise float acc = 0.0;
        for (uint r = 0; r < pc.world; r++) {
            float v;
            if (r == pc.rank) {
                v = part[i];
            } else {
                const uint k = pc.slots + r * pc.n + i;
                uint64_t c = load_cell(k);
                float idle = float(c & 0xffu);
                for (uint spins = 0u; uint(c >> 32) != s && spins < pc.spin_limit; spins++) {
                    // BURN > 0 (CPU drivers): arithmetic between loads, since llvmpipe ends a shader's loops after
                    // 65535 iterations in all, and a wait must outlast the other device's thread being descheduled
                    [[unroll]] for (uint b = 0u; b < BURN; b++) idle = sin(idle) * 1.5 + 0.25;
                    c = load_cell(k);
                }
                if (idle == -7.0) atomicOr(cells[0], uint64_t(2));  // never: keeps the arithmetic
                if (uint(c >> 32) != s) {
                    atomicOr(cells[0], uint64_t(1));
                    v = uintBitsToFloat(0x7fc00000u);
                } else {
                    v = uintBitsToFloat(uint(c));
                }
            }
            acc = r == 0u ? v : acc + v;
        }
        outv[i] = acc;
    }
}
