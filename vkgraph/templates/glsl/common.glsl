// Shared helpers for the templates in kernels/. Included once per kernel (the runtime's #include is "once").
#extension GL_EXT_control_flow_attributes : require
#ifdef INT_DOT
// SPV_KHR_integer_dot_product through GL_EXT_spirv_intrinsics (the compilers the project can install know no
// GLSL extension for it): dot products of four int8 lanes packed in a uint (packed-vector format 0).
// Capabilities 6018 DotProductInput4x8BitPackedKHR, 6019 DotProductKHR; opcodes OpSDotKHR, OpSUDotKHR.
#extension GL_EXT_spirv_intrinsics : require
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4450)
int dot_s8(uint a, uint b, spirv_literal int packed_format);   // int8 a . int8 b
spirv_instruction(extensions = ["SPV_KHR_integer_dot_product"], capabilities = [6019, 6018], id = 4452)
int dot_s8u8(uint a, uint b, spirv_literal int packed_format); // int8 a . uint8 b

// 16 lanes: int8 x . int8 w, and int8 x . uint8 w
int dot16_s8(uvec4 x, uvec4 w) {
    return (dot_s8(x.x, w.x, 0) + dot_s8(x.y, w.y, 0)) + (dot_s8(x.z, w.z, 0) + dot_s8(x.w, w.w, 0));
}
int dot16_s8u8(uvec4 x, uvec4 w) {
    return (dot_s8u8(x.x, w.x, 0) + dot_s8u8(x.y, w.y, 0)) + (dot_s8u8(x.z, w.z, 0) + dot_s8u8(x.w, w.w, 0));
}
#endif

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

// The low nibbles of bytes 0..3 of w, each times a power of two that multiplying its activation by NIB_LO
// undoes; nibbles_hi: the high nibbles, undone by NIB_HI.
vec4 nibbles_lo(uint w) {
    return uintBitsToFloat(uvec4(w & 0xFu, w & 0xF00u, w & 0xF0000u, (w >> 12) & 0xF000u) | 0x4B000000u)
         - 8388608.0;
}
vec4 nibbles_hi(uint w) {
    const uint v = w >> 12;
    return uintBitsToFloat(uvec4(w & 0xF0u, w & 0xF000u, v & 0xF00u, v & 0xF0000u) | 0x4B000000u) - 8388608.0;
}
const vec4 NIB_LO = vec4(1.0, 1.0 / 256.0, 1.0 / 65536.0, 1.0 / 4096.0);
const vec4 NIB_HI = vec4(1.0 / 16.0, 1.0 / 4096.0, 1.0 / 256.0, 1.0 / 65536.0);

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

// Four bits (bit i: byte i) moved to bit 0 of each byte: ORed into levels as their high bit after a shift.
uint spread4(uint hb) {
    return (hb & 1u) | ((hb & 2u) << 7) | ((hb & 4u) << 14) | ((hb & 8u) << 21);
}

#ifdef IQ4_TABLE
// IQ4_NL's and IQ4_XS's non-linear levels (ggml's kvalues_iq4nl), looked up by the nibbles of the weights.
// The tables live in shared memory: a constant array indexed by each invocation's own nibble is read one distinct
// address at a time (NVIDIA's constant cache serializes them: IQ4 matvecs ran at ~150 GB/s on the H200 against
// ~1.5 TB/s for Q4_0), while 16 words in 16 banks serve every invocation of a subgroup in one access, as in
// llama.cpp's Vulkan shaders. iq4_init_tables() fills them: the first call of main, before any return.
const float IQ4_VALUES[16] = float[16](-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
                                       1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0);
shared float iq4_values[16];
#ifdef INT_DOT
// the levels as int8 bytes (two's complement of IQ4_VALUES), entry 16 l + n holding level n in byte lane l
const uint IQ4_BYTES[16] = uint[16](0x81u, 0x98u, 0xADu, 0xBFu, 0xCFu, 0xDDu, 0xEAu, 0xF6u,
                                    0x01u, 0x0Du, 0x19u, 0x26u, 0x35u, 0x45u, 0x59u, 0x71u);
shared uint iq4_lanes[64];
#endif

void iq4_init_tables() {
    const uint n = gl_WorkGroupSize.x * gl_WorkGroupSize.y * gl_WorkGroupSize.z;
    for (uint i = gl_LocalInvocationIndex; i < 16; i += n) iq4_values[i] = IQ4_VALUES[i];
#ifdef INT_DOT
    for (uint i = gl_LocalInvocationIndex; i < 64; i += n) iq4_lanes[i] = IQ4_BYTES[i & 15u] << (8u * (i >> 4));
#endif
    barrier();
}

vec4 iq4_levels(uint nib) {   // nib: four nibbles, one in the low half of each byte
    return vec4(iq4_values[nib & 15u], iq4_values[(nib >> 8) & 15u], iq4_values[(nib >> 16) & 15u],
                iq4_values[nib >> 24]);
}

#ifdef INT_DOT
uvec4 iq4_bytes(uvec4 v) {    // the int8 levels of the low nibble of each byte of v
    uvec4 r;
    [[unroll]] for (uint i = 0; i < 4; i++) {
        const uint w = v[i];
        r[i] = (iq4_lanes[w & 15u] | iq4_lanes[16u + ((w >> 8) & 15u)])
             | (iq4_lanes[32u + ((w >> 16) & 15u)] | iq4_lanes[48u + ((w >> 24) & 15u)]);
    }
    return r;
}
#endif
#endif

float hsum(vec4 v) {
    return (v.x + v.y) + (v.z + v.w);
}
