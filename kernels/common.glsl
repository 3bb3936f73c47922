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

// Small integers become floats through the mantissa of 2^23: or the integer in where it lies, subtract 2^23
// (exact). Not int-to-float conversions (a quarter of the float rate on NVIDIA) and as few shifts as possible:
// a field at bit p becomes q * 2^p, and the caller multiplies the activation by 2^-p instead (exact, and
// shared by every weight row). Bits 0..22 are mantissa, so fields above bit 22 are shifted down first.

// The eight nibbles of w as floats, with no int-to-float conversion and no subtraction: each nibble q is
// masked into the top of a mantissa under the exponent of 1.0, giving 1 + q/256 (lo: the low nibbles of bytes
// 0..3, at mantissa bits 15..18) and 1 + q/16 (hi: the high nibbles, bits 19..22); one shift per byte serves
// both, and the and-or is one instruction. Multiplied by 256 x (lo) or 16 x (hi), the sum over a run is
// 256 (16) times the run's activation sum plus the dot product wanted: the caller subtracts the former once
// per run. The lost low bits (8 at most, of the large term) stay far below the templates' error bound.
void nibbles(uint w, out vec4 lo, out vec4 hi) {
    const uvec4 c = uvec4(w << 15, w << 7, w >> 1, w >> 9);
    lo = uintBitsToFloat((c & 0x00078000u) | 0x3F800000u);
    hi = uintBitsToFloat((c & 0x00780000u) | 0x3F800000u);
}
const float NIB_LO = 256.0, NIB_HI = 16.0;

// The four bytes of w (each < 128) times (1, 2^8, 2^16, 1): multiply the activations by BYTES7.
vec4 bytes7(uint w) {
    return uintBitsToFloat(uvec4(w & 0x7Fu, w & 0x7F00u, w & 0x7F0000u, w >> 24) | 0x4B000000u) - 8388608.0;
}
const vec4 BYTES7 = vec4(1.0, 1.0 / 256.0, 1.0 / 65536.0, 1.0);

// The four bytes of w as int8 values times (1, 2^8, 1, 2^8) (flipping bit 7 biases each by +128): multiply the
// activations by I8.
vec4 bytes_i8(uint w) {
    const uint v = w >> 16;
    return uintBitsToFloat(uvec4(w & 0xFFu, w & 0xFF00u, v & 0xFFu, v & 0xFF00u) ^ uvec2(0x4B000080u, 0x4B008000u).xyxy)
         - vec2(8388736.0, 8421376.0).xyxy;
}
const vec4 I8 = vec4(1.0, 1.0 / 256.0, 1.0, 1.0 / 256.0);

float hsum(vec4 v) {
    return (v.x + v.y) + (v.z + v.w);
}
