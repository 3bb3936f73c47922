// Shared helpers for the templates in kernels/. Included once per kernel (the runtime's #include is "once").
#extension GL_EXT_control_flow_attributes : require

// Element i of a float16 array stored two per uint (no 16-bit storage feature needed).
float half_at_u32(uint word, uint i) {
    return unpackHalf2x16(word >> (16u * (i & 1u))).x;
}

// Four float16 values packed in a uvec2, as a vec4.
vec4 unpack_half4(uvec2 w) {
    return vec4(unpackHalf2x16(w.x), unpackHalf2x16(w.y));
}

// Four bfloat16 values packed in a uvec2, as a vec4.
vec4 unpack_bf16x4(uvec2 w) {
    return uintBitsToFloat(uvec4(w.x << 16, w.x & 0xFFFF0000u, w.y << 16, w.y & 0xFFFF0000u));
}

// The four bytes of a word, each shifted right by `shift` and masked, as floats.
vec4 bytes_bits(uint w, uint shift, uint mask) {
    return vec4((uvec4(w) >> (uvec4(0u, 8u, 16u, 24u) + shift)) & mask);
}

// The four bytes of a word as signed int8 values.
vec4 bytes_i8(uint w) {
    return vec4((ivec4(int(w)) << ivec4(24, 16, 8, 0)) >> 24);
}

float hsum(vec4 v) {
    return (v.x + v.y) + (v.z + v.w);
}
