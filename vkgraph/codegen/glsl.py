"""GLSL spelling of dtypes, literals, loads, stores, casts and elementwise ops.

Values are computed in 32-bit types (``float``, ``int``, ``uint``), ``int64_t`` or ``bool``; narrow integers are
wrapped back to their width after each op that can overflow, so results match numpy bit for bit. Helper
functions (floor division, pow, erf, bfloat16 rounding, the random number hash) are emitted only when a kernel
uses them.
"""

from __future__ import annotations

import math

import numpy as np

from ..dtype import DType, dtypes
from ..graph import Op

HELPERS: dict[str, str] = {
    "bf16": """uint f2bf(float f) {
  uint u = floatBitsToUint(f);
  if (isnan(f)) return 0x7fc0u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
}
float bf2f(uint b) { return uintBitsToFloat(b << 16); }""",
    "f16round": """float f16r(float x) {  // x rounded to the nearest float16 (ties to even), on any vendor
  if (isnan(x) || isinf(x)) return x;
  uint sign = floatBitsToUint(x) & 0x80000000u;
  float a = abs(x);
  if (a >= 65520.0) return uintBitsToFloat(sign | 0x7f800000u);
  if (a < 6.103515625e-05) {  // subnormal: a multiple of 2^-24
    return uintBitsToFloat(sign | floatBitsToUint(roundEven(a * 16777216.0) * 5.9604644775390625e-08));
  }
  uint m = floatBitsToUint(a);
  return uintBitsToFloat(sign | ((m + 0xfffu + ((m >> 13) & 1u)) & 0xffffe000u));
}""",
    "fdiv": """float fdiv(float a, float b) {  // IEEE a / b: Vulkan bounds a / b only for |b| in [2^-126, 2^126]
  float m = abs(b);
  if (m > 8.50705917e37) { precise float q = (a * 0.25) / (b * 0.25); return q; }  // scaled by powers of two: exact
  if (m < 1.17549435e-38 && m != 0.0) { precise float q = (a / (b * 16777216.0)) * 16777216.0; return q; }
  return a / b;
}""",
    "fpow": """float fpow(float a, float b) {  // C's powf (numpy's) at every special value
  const float INF = uintBitsToFloat(0x7f800000u);
  if (b == 0.0 || a == 1.0) return 1.0;  // even for a NaN
  if (isnan(a) || isnan(b)) return uintBitsToFloat(0x7fc00000u);
  if (isinf(b)) return abs(a) == 1.0 ? 1.0 : ((abs(a) > 1.0) == (b > 0.0) ? INF : 0.0);
  bool odd = floor(b) == b && mod(b, 2.0) == 1.0;  // an odd integer (every float past 2^24 is even)
  bool neg = (floatBitsToUint(a) >> 31) != 0u;  // -0.0 included
  if (a == 0.0 || isinf(a)) {  // +-0 and +-inf: 0 or inf by the sign of b (and of a for an odd b)
    float m = (a == 0.0) == (b < 0.0) ? INF : 0.0;
    return odd && neg ? -m : m;
  }
  if (neg && floor(b) != b) return uintBitsToFloat(0x7fc00000u);
  // |a|^b as exp2(b * log2|a|), with subnormal |a| and results scaled by 2^24 (exact) around log2 and exp2,
  // which some drivers compute only for normal numbers
  float m = abs(a);
  precise float l = m < 1.17549435e-38 ? log2(m * 16777216.0) - 24.0 : log2(m);
  precise float e = b * l;
  precise float r = e < -126.0 ? exp2(e + 24.0) * 5.9604644775390625e-08 : exp2(e);
  return neg && odd ? -r : r;
}""",
    "flog": """// log and log2 with subnormal inputs scaled by 2^24 (exact) first: some drivers take logs of normal
// numbers only
float flog2(float x) { return abs(x) < 1.17549435e-38 && x != 0.0 ? log2(x * 16777216.0) - 24.0 : log2(x); }
float flog(float x) {
  return abs(x) < 1.17549435e-38 && x != 0.0 ? log(x * 16777216.0) - 16.635532333438686 : log(x);
}""",
    "ftanh": """// tanh with relative accuracy near 0 (drivers' tanh errs absolutely), NaN kept, no overflow
float ftanh(float x) {
  if (isnan(x)) return x;
  float a = abs(x);
  if (a < 0.625) {  // Cephes' tanhf polynomial; returns x itself (with its sign) for tiny x
    float z = x * x;
    return ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
            - 3.33332819422e-1) * z * x + x;
  }
  float r = 1.0 - 2.0 / (exp(2.0 * a) + 1.0);  // exp overflows to inf for large a: r is 1
  return x < 0.0 ? -r : r;
}""",
    "erf": """float erf_(float x) {  // Abramowitz-Stegun 7.1.26, |error| < 1.5e-7
  float t = 1.0 / (1.0 + 0.3275911 * abs(x));
  float p = ((((1.061405429 * t - 1.453152027) * t + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t;
  return sign(x) * (1.0 - p * exp(-x * x));
}""",
    "rng": """uint pcg(uint v) {
  uint s = v * 747796405u + 2891336453u;
  uint w = ((s >> ((s >> 28u) + 4u)) ^ s) * 277803737u;
  return (w >> 22u) ^ w;
}
float rng(uint seed, uint ctr) {
  uint h = pcg(pcg(ctr + pcg(seed)) ^ seed);
  return float(h >> 8) * (1.0 / 16777216.0);
}""",
}

# integer floor division, modulo and power per GLSL type (T), instantiated on use
_INT_HELPERS = {
    "idiv": """T idiv_T(T a, T b) {  // floor division (division truncates; abs() of the minimum would overflow)
  if (b == Z) return Z;
  if (b == Z - O) return Z - a;  // the minimum // -1 wraps to itself, as numpy's
  T q = a / b;
  if (a - q * b != Z && ((a < Z) != (b < Z))) q -= O;
  return q;
}""",
    "imod": """T imod_T(T a, T b) {
  if (b == Z) return Z;
  return a - b * idiv_T(a, b);
}""",
    "udiv": "T idiv_T(T a, T b) { return b == Z ? Z : a / b; }",
    "umod": "T imod_T(T a, T b) { return b == Z ? Z : a % b; }",
    "ipow": """T ipow_T(T a, T b) {
  T r = O;
  // a negative exponent (numpy raises for those it sees; a tensor's are seen only here): 1 / a^-b truncated
  if (b < Z) return a == O ? O : (a == Z - O ? ((b & O) != Z ? Z - O : O) : Z);
  while (b > Z) { if ((b & O) != Z) r *= a; a *= a; b >>= O; }
  return r;
}""",
}


def int_helper(kind: str, glsl_type: str) -> tuple[str, str]:
    """(name, source) of an integer helper for one GLSL type."""
    zero, one = {"int": ("0", "1"), "uint": ("0u", "1u"), "int64_t": ("0l", "1l")}[glsl_type]
    src = _INT_HELPERS[kind].replace("_T", "_" + glsl_type).replace("T ", glsl_type + " ")
    src = src.replace("Z", zero).replace("O", one)
    return f"{ {'udiv': 'idiv', 'umod': 'imod'}.get(kind, kind)}_{glsl_type}", src


# SPIR-V float controls for 32-bit floats, by DeviceInfo.float_controls name, as GL_EXT_spirv_intrinsics
# declarations (capability, execution mode): IEEE zeros, infinities and NaN kept through every optimisation, and
# subnormals kept rather than flushed, as numpy computes
FLOAT_MODES = {
    "signed_zero_inf_nan_preserve": "spirv_execution_mode(capabilities = [4466], 4461, 32);",
    "denorm_preserve": "spirv_execution_mode(capabilities = [4464], 4459, 32);",
}
_MIN_NORMAL = 2.0**-126


def is_special(value: float) -> bool:
    """Zero (either sign), infinite, NaN or subnormal in float32: the values compilers fold their own way."""
    v = float(value)
    return not math.isfinite(v) or abs(v) < _MIN_NORMAL


def float_bits(value: float) -> int:
    return int(np.array(value, np.float32).view(np.uint32))


def literal(value: object, dtype: DType) -> str:
    if dtype.kind == "b":
        return "true" if value else "false"
    if dtype.is_float:
        v = float(value)
        if math.isnan(v):
            return "uintBitsToFloat(0x7fc00000u)"
        if math.isinf(v):
            return "uintBitsToFloat(0x7f800000u)" if v > 0 else "uintBitsToFloat(0xff800000u)"
        s = repr(float(np.float32(v)))
        return s if v >= 0 else f"({s})"
    v = int(value)
    if dtype is dtypes.int64:
        return f"{v}l" if v >= 0 else f"({v}l)"
    if dtype.kind == "u":
        return f"{v}u"
    if v == -(2**31):
        return "(-2147483647-1)"
    return str(v) if v >= 0 else f"({v})"


def zero(dtype: DType) -> str:
    return literal(0, dtype)


def load(dtype: DType, ref: str) -> str:
    """A buffer element as a computed value."""
    if dtype is dtypes.bfloat16:
        return f"bf2f(uint({ref}))"
    if dtype is dtypes.bool:
        return f"(uint({ref}) != 0u)"
    if dtype.itemsize < 4:
        return f"{dtype.glsl}({ref})"
    return ref


def store(dtype: DType, value: str) -> str:
    """A computed value as a buffer element."""
    if dtype is dtypes.bfloat16:
        return f"uint16_t(f2bf({value}))"
    if dtype is dtypes.bool:
        return f"uint8_t({value} ? 1u : 0u)"
    if dtype.itemsize < 4:
        return f"{dtype.store}({value})"
    return value


def helpers_for_load_store(dtype: DType) -> set[str]:
    return {"bf16"} if dtype is dtypes.bfloat16 else set()


def wrap(dtype: DType, x: str) -> str:
    """Wrap an int/uint computed value to a narrow integer's width."""
    if dtype.is_int and dtype.itemsize < 4:
        if dtype.kind == "i":
            return f"bitfieldExtract({x}, 0, {dtype.bits})"
        return f"({x} & {hex((1 << dtype.bits) - 1)}u)"
    return x


def round_to(dtype: DType, x: str, need: set[str]) -> str:
    """x rounded to what a 16-bit float can hold (identity for other dtypes)."""
    if dtype is dtypes.float16:
        need.add("f16round")
        return f"f16r({x})"
    if dtype is dtypes.bfloat16:
        need.add("bf16")
        return f"bf2f(f2bf({x}))"
    return x


def cast(x: str, src: DType, dst: DType, need: set[str]) -> str:
    if src is dst:
        return x
    if dst.kind == "b":
        return f"({x} != {zero(src)})" if src.kind != "b" else x
    if src.kind == "b":
        return f"({x} ? {literal(1, dst)} : {zero(dst)})"
    if dst is dtypes.float16:
        need.add("f16round")
        return f"f16r(float({x}))"
    if dst is dtypes.bfloat16:
        need.add("bf16")
        return f"bf2f(f2bf(float({x})))"
    if dst.is_float:
        return f"float({x})"
    if src.is_float and dst.kind == "u" and dst.itemsize < 8:
        x = f"int({x})"  # float -> uint of a negative value wraps as numpy does through int
    if dst is dtypes.int64 and src.is_int:
        # built from its two halves: lavapipe (Mesa 22.3) compared int64_t(x) of a 32-bit x with an int64 constant
        # wrongly (int64_t(2) < 64l was false; shifts by such counts gave 0)
        hi = f"({x} >> 31)" if src.kind == "i" else "0"
        return f"packInt2x32(ivec2(int({x}), {hi}))"
    return wrap(dst, f"{dst.glsl}({x})")


def minmax(fn: str, a: str, b: str, d: DType) -> str:
    """max(a, b) or min(a, b) as numpy computes it: GLSL's may drop a NaN, numpy's propagates it; between equal
    values (+0.0 and -0.0) numpy returns b, where GLSL's choice is the driver's."""
    if d.is_float:
        return f"((isnan({a}) || isnan({b})) ? ({a} + {b}) : ({a} {'>' if fn == 'max' else '<'} {b} ? {a} : {b}))"
    return f"{fn}({a}, {b})"


def _to_bits(x: str, d: DType, need: set[str]) -> str:
    if d is dtypes.float32:
        return f"floatBitsToUint({x})"
    if d is dtypes.float16:
        return f"packHalf2x16(vec2({x}, 0.0))"
    if d is dtypes.bfloat16:
        need.add("bf16")
        return f"f2bf({x})"
    if d.kind == "b":
        return f"uint({x})"
    return f"(uint({x}) & {hex((1 << d.bits) - 1)}u)" if d.itemsize < 4 else f"uint({x})"


def _from_bits(u: str, d: DType, need: set[str]) -> str:
    if d is dtypes.float32:
        return f"uintBitsToFloat({u})"
    if d is dtypes.float16:
        return f"unpackHalf2x16({u}).x"
    if d is dtypes.bfloat16:
        need.add("bf16")
        return f"bf2f({u})"
    if d.kind == "b":
        return f"({u} != 0u)"
    if d.kind == "i":
        return f"bitfieldExtract(int({u}), 0, {d.bits})" if d.itemsize < 4 else f"int({u})"
    return u


def bitcast(x: str, src: DType, dst: DType, need: set[str]) -> str:
    if src is dst:
        return x
    return _from_bits(_to_bits(x, src, need), dst, need)


def shift(op: Op, dtype: DType, s: DType, a: str, b: str) -> str:
    """a << b or a >> b as numpy's: a count past the width (or negative) shifts every bit out, leaving 0, or -1
    for a negative a shifted right (GLSL leaves such counts undefined)."""
    in_range = f"{b} < {literal(s.bits, s)}" if s.kind == "u" else f"({b} >= {zero(s)} && {b} < {literal(s.bits, s)})"
    if op is Op.SHL:
        return f"({in_range} ? {wrap(dtype, f'({a} << {b})')} : {zero(s)})"
    out_of_range = zero(s) if s.kind == "u" else f"({a} < {zero(s)} ? {literal(-1, s)} : {zero(s)})"
    return f"({in_range} ? ({a} >> {b}) : {out_of_range})"


_FLOAT_UNARY = {Op.EXP: "exp", Op.EXP2: "exp2", Op.LOG: "flog", Op.LOG2: "flog2", Op.SIN: "sin", Op.COS: "cos",
                Op.SQRT: "sqrt", Op.RSQRT: "inversesqrt", Op.FLOOR: "floor", Op.CEIL: "ceil",
                Op.ROUND: "roundEven", Op.TRUNC: "trunc"}
_INFIX = {Op.ADD: "+", Op.SUB: "-", Op.MUL: "*", Op.CMPLT: "<", Op.CMPLE: "<=", Op.CMPEQ: "==", Op.CMPNE: "!=",
          Op.SHL: "<<", Op.SHR: ">>"}
_BITWISE = {Op.AND: ("&", "&&"), Op.OR: ("|", "||"), Op.XOR: ("^", "^^")}


def alu(op: Op, dtype: DType, srcs: list[DType], args: list[str], need: set[str]) -> str:
    """The GLSL expression of an elementwise op. dtype is the result's, srcs the sources' dtypes."""
    a = args[0]
    s = srcs[0]
    if op is Op.CAST:
        return cast(a, s, dtype, need)
    if op is Op.BITCAST:
        return bitcast(a, s, dtype, need)
    if op in _FLOAT_UNARY:
        if not s.is_float:
            return a
        if op in (Op.LOG, Op.LOG2):
            need.add("flog")
        return f"{_FLOAT_UNARY[op]}({a})"
    if op is Op.TANH:
        need.add("ftanh")
        return f"ftanh({a})"
    if op is Op.ERF:
        need.add("erf")
        return f"erf_({a})"
    if op is Op.ISNAN:
        return f"isnan({a})" if s.is_float else "false"
    if op is Op.RECIP:
        return f"(1.0 / {a})"
    if op is Op.NEG:
        return wrap(dtype, f"(-{a})" if s.kind != "u" else f"({zero(s)} - {a})")
    if op is Op.NOT:
        return f"(!{a})" if s.kind == "b" else wrap(dtype, f"(~{a})")
    if op is Op.ABS:
        return a if s.kind in "ub" else wrap(dtype, f"abs({a})")
    if op is Op.SIGN:
        if s.kind in "ub":
            return f"({a} > {zero(s)} ? {literal(1, s)} : {zero(s)})" if s.kind == "u" else a
        return f"sign({a})"
    if op is Op.WHERE:
        return f"({a} ? {args[1]} : {args[2]})"
    b = args[1]
    if s.kind == "b" and op in (Op.CMPLT, Op.CMPLE):
        a, b = f"int({a})", f"int({b})"
    if s.kind == "b" and op in (Op.ADD, Op.MUL, Op.MAX, Op.MIN):
        return f"({a} || {b})" if op in (Op.ADD, Op.MAX) else f"({a} && {b})"
    if op in _BITWISE:
        return f"({a} {_BITWISE[op][1 if s.kind == 'b' else 0]} {b})"
    if op in (Op.SHL, Op.SHR) and s.is_int:
        return shift(op, dtype, s, a, b)
    if op in _INFIX:
        e = f"({a} {_INFIX[op]} {b})"
        return wrap(dtype, e) if op in (Op.ADD, Op.SUB, Op.MUL, Op.SHL) else e
    if op in (Op.MAX, Op.MIN):
        return minmax(op.name.lower(), a, b, s)
    if op is Op.DIV:
        if s.glsl == "float":  # NVIDIA's a / b past that range: x / 2e38 gave 0 for x = -2e38, inf / 1e-40 NaN
            need.add("fdiv")
            return f"fdiv({a}, {b})"
        return f"({a} / {b})"
    if op in (Op.IDIV, Op.MOD):
        if s.is_float:
            if op is Op.IDIV:  # numpy: inf // x is nan
                return f"(isinf({a}) ? uintBitsToFloat(0x7fc00000u) : floor({a} / {b}))"
            return f"({a} - {b} * floor({a} / {b}))"
        kinds = ("idiv", "imod") if s.kind == "i" else ("udiv", "umod")
        name, _ = int_helper(kinds[0], s.glsl)
        need.add(f"int:{kinds[0]}:{s.glsl}")
        if op is Op.MOD:
            name, _ = int_helper(kinds[1], s.glsl)
            need.add(f"int:{kinds[1]}:{s.glsl}")
        return wrap(dtype, f"{name}({a}, {b})")
    if op is Op.POW:
        if s.is_float:
            need.add("fpow")
            return f"fpow({a}, {b})"
        name, _ = int_helper("ipow", s.glsl)
        need.add(f"int:ipow:{s.glsl}")
        return wrap(dtype, f"{name}({a}, {b})")
    raise NotImplementedError(f"no GLSL for {op} on {s}")


def helper_source(need: set[str]) -> str:
    out = []
    for key in sorted(need):
        if key.startswith("int:"):
            _, kind, t = key.split(":")
            if kind in ("imod", "umod"):  # imod calls idiv
                div = "idiv" if kind == "imod" else "udiv"
                if f"int:{div}:{t}" not in need:
                    out.append(int_helper(div, t)[1])
            out.append(int_helper(kind, t)[1])
        else:
            out.append(HELPERS[key])
    # integer division must precede modulo; sorted() puts "idiv" before "imod" and "udiv" before "umod"
    return "\n".join(out)
