"""Small rewrites of compiled SPIR-V for what the in-process glslang cannot spell.

`mark_bfloat16`: glslang 13 has no `bfloat16_t` (GL_EXT_bfloat16 came later), but a program whose only 16-bit
float type is that of its cooperative-matrix operands (kept in shared memory as raw 16-bit patterns, never
computed with as values) becomes the bfloat16 program by giving that type the BFloat16KHR encoding
(SPV_KHR_bfloat16) and declaring the two capabilities it needs.
"""

from __future__ import annotations

import struct

# A generated program's source holds this line when its float16_t cooperative-matrix operands are bfloat16.
BF16_FRAGMENTS = "// vkgraph: float16_t fragments are bfloat16"

_OP_CAPABILITY, _OP_EXTENSION, _OP_TYPE_FLOAT = 17, 10, 22
_CAP_BF16_TYPE, _CAP_BF16_COOP = 5116, 5118
_ENC_BF16 = 0


def _string_words(s: str) -> list[int]:
    raw = s.encode() + b"\0"
    raw += b"\0" * (-len(raw) % 4)
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def mark_bfloat16(spirv: bytes) -> bytes:
    """spirv with its 16-bit float type made bfloat16 (see the module's docstring)."""
    words = list(struct.unpack(f"<{len(spirv) // 4}I", spirv))
    out = words[:5]
    i, caps_done, found = 5, False, False
    while i < len(words):
        count, op = words[i] >> 16, words[i] & 0xFFFF
        inst = words[i:i + count]
        if not caps_done and op != _OP_CAPABILITY:
            out += [(2 << 16) | _OP_CAPABILITY, _CAP_BF16_TYPE, (2 << 16) | _OP_CAPABILITY, _CAP_BF16_COOP]
            ext = _string_words("SPV_KHR_bfloat16")
            out += [((1 + len(ext)) << 16) | _OP_EXTENSION] + ext
            caps_done = True
        if op == _OP_TYPE_FLOAT and count == 3 and inst[2] == 16:
            inst = [(4 << 16) | _OP_TYPE_FLOAT, inst[1], 16, _ENC_BF16]
            found = True
        out += inst
        i += count
    if not found:
        raise ValueError("mark_bfloat16: the program has no 16-bit float type")
    return struct.pack(f"<{len(out)}I", *out)
