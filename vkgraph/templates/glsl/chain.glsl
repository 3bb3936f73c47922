// Chained dispatches (runtime/chain.py): a kernel that waits inside itself for the dispatch before it, which
// then needs no barrier, and signals when it is done for the dispatch after it.
//
// The including kernel declares, with literal binding numbers (the interface parser does not preprocess),
//   layout(set = 0, binding = N) coherent volatile buffer ChainFlags { uint chain_flags[]; };
// the push fields `uint chain_wait; uint chain_signal;` (slots, or CHAIN_NONE; the queue fills them), and every
// buffer another kernel writes or reads after it as CHAIN_COHERENT (common.glsl): coherent when built with
// -DCHAIN, so its loads and stores bypass caches that a barrier would have flushed. It calls chain_wait() before
// its first read of such a buffer and chain_signal() after its last write, both from every invocation of the
// workgroup (they hold barriers). A slot is CHAIN_WORDS words: the count of finished workgroups at its start,
// the flag half-way, in another 128-byte line, so that the waiting workgroups' polls of the flag do not queue
// with the atomic adds of the workgroups they wait for.
const uint CHAIN_NONE = 0xFFFFFFFFu;
const uint CHAIN_WORDS = 64u;   // runtime/chain.py WORDS

void chain_wait() {
#ifdef CHAIN
    if (pc.chain_wait != CHAIN_NONE) {
        if (gl_LocalInvocationIndex == 0u) {
            // a pause between polls (thousands of workgroups may wait at once): arithmetic whose result the
            // compiler cannot drop, as it enters the flag's index through a term that is always 0 (fewer than
            // 2^16 workgroups along z)
            uint pause = 0u;
            while (chain_flags[CHAIN_WORDS * pc.chain_wait + CHAIN_WORDS / 2u + (pause & (gl_NumWorkGroups.z >> 16))]
                   == 0u) {
                [[dont_unroll]] for (uint i = 0u; i < 32u; i++) pause = pause * 1664525u + 1013904223u;
            }
        }
        memoryBarrierBuffer();
        barrier();
    }
#endif
}

void chain_signal() {
#ifdef CHAIN
    if (pc.chain_signal != CHAIN_NONE) {
        memoryBarrierBuffer();  // this invocation's writes, before its workgroup counts itself done
        barrier();
        if (gl_LocalInvocationIndex == 0u) {
            const uint groups = gl_NumWorkGroups.x * gl_NumWorkGroups.y * gl_NumWorkGroups.z;
            if (atomicAdd(chain_flags[CHAIN_WORDS * pc.chain_signal], 1u) == groups - 1u) {
                memoryBarrierBuffer();
                chain_flags[CHAIN_WORDS * pc.chain_signal + CHAIN_WORDS / 2u] = 1u;  // every workgroup's writes are visible
            }
        }
    }
#endif
}
