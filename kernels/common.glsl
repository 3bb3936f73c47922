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

// Small integers become floats through the mantissa of 2^23 (or the integer in, subtract 2^23: exact),
// not int-to-float conversions, which run at a quarter of the float rate on NVIDIA and bound a matvec.

// The four bytes of a word, each shifted right by `shift` and masked (mask <= 0xFF), as floats.
vec4 bytes_bits(uint w, uint shift, uint mask) {
    return uintBitsToFloat(((uvec4(w) >> (uvec4(0u, 8u, 16u, 24u) + shift)) & mask) | 0x4B000000u) - 8388608.0;
}

// The four bytes of a word as signed int8 values (flipping bit 7 biases them by +128).
vec4 bytes_i8(uint w) {
    return uintBitsToFloat(((uvec4(w) >> uvec4(0u, 8u, 16u, 24u)) & 0xFFu) ^ 0x4B000080u) - 8388736.0;
}

float hsum(vec4 v) {
    return (v.x + v.y) + (v.z + v.w);
}
