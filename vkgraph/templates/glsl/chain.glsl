// Chained dispatches (runtime/chain.py): a kernel that waits inside itself for the dispatch before it, which
// then needs no barrier, and signals when it is done for the dispatch after it.
//
// The including kernel declares, with literal binding numbers (the interface parser does not preprocess),
//   layout(set = 0, binding = N) coherent volatile buffer ChainFlags { uint chain_flags[]; };
// the push fields `uint chain_wait; uint chain_signal;` (slots, or CHAIN_NONE; the queue fills them), and every
// buffer another kernel writes or reads after it as CHAIN_COHERENT (common.glsl): coherent when built with
// -DCHAIN, so its loads and stores bypass caches that a barrier would have flushed. It calls chain_wait() before
// its first read of such a buffer and chain_signal() after its last write, both from every invocation of the
// workgroup (they hold barriers). A slot is two words: the count of finished workgroups, and the flag.
const uint CHAIN_NONE = 0xFFFFFFFFu;

void chain_wait() {
#ifdef CHAIN
    if (pc.chain_wait != CHAIN_NONE) {
        if (gl_LocalInvocationIndex == 0u) {
            while (chain_flags[2u * pc.chain_wait + 1u] == 0u) {}
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
            if (atomicAdd(chain_flags[2u * pc.chain_signal], 1u) == groups - 1u) {
                memoryBarrierBuffer();
                chain_flags[2u * pc.chain_signal + 1u] = 1u;  // every workgroup's writes are visible
            }
        }
    }
#endif
}
