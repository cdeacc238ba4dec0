"""Our own CPU kernels (C++ in ``kernels/``): compiled once per sources and flags, loaded with
ctypes.

The shared library lives in a directory (``model.kernel_dir``, default ``default_kernel_dir()``)
under a name that carries a hash of the sources and the compiler flags, so a changed source
builds anew and a stale library is never loaded. It is built with the C++ compiler (``$CXX``,
else ``g++``) the first time it is needed, or ahead of time with
``python -m spyre_server.model.cpu.kernels.library`` (the image does this in a build stage, so the
server itself needs no compiler). The kernels need x86-64 with AVX2 and FMA; the AMX attention
and linear kernels are compiled on any x86-64 (their own target pragma) and run where
``amx_unsupported_reason`` says they can.

This module imports neither torch nor the package at import time, so the image's build stage
runs it alone (with ``--into``). ``load_native_kernels`` imports torch before the library: its
OpenMP calls then bind to the libgomp torch loaded, and run on torch's thread pool.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

KERNELS = Path(__file__).resolve().parent
"""The C++ sources, beside this file."""
SOURCES = (
    KERNELS / "linear_f32.cpp",
    KERNELS / "linear_bf16.cpp",
    KERNELS / "linear_amx.cpp",
    KERNELS / "attention.cpp",
    KERNELS / "elementwise_f32.cpp",
    KERNELS / "elementwise_bf16.cpp",
    KERNELS / "attention_dot_bf16.cpp",
    KERNELS / "rank_sync.cpp",
)
HEADERS = tuple(sorted(KERNELS.glob("*.h")))
"""Every header beside the sources (what they include): hashed into the library's name with them,
so an edited header rebuilds it."""
FLAGS = (
    "-std=c++17",
    "-O3",
    "-mavx2",
    "-mfma",
    "-fopenmp",
    "-fno-exceptions",
    "-fno-rtti",
    "-shared",
    "-fPIC",
)
REQUIRED_CPU_FLAGS = ("avx2", "fma")
AVX512_BF16_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")
"""What ``kernels/attention_dot_bf16.cpp``'s AVX512-BF16 kernel runs on (compiled for them
whatever the build machine)."""
AMX_CPU_FLAGS = ("amx_tile", "amx_bf16", "avx512vbmi", *AVX512_BF16_CPU_FLAGS)
"""What its AMX kernel runs on, and ``kernels/linear_amx.cpp``'s (its FP8 conversion's byte
tables: AVX512-VBMI, which every CPU with AMX has)."""
DOT_BF16_NOT_COMPILED = (
    "the native kernels were compiled without AMX intrinsics, which the bfloat16 dot-product "
    "attention kernels (amx, avx512_bf16) are built with (they need g++ 11 or later)"
)
"""Why those kernels cannot run where ``NativeKernels.dot_bf16_compiled`` is False."""
_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


class NativeKernelError(RuntimeError):
    """The native kernels cannot be built or loaded here; the message says why and what to do."""


_OTHER_KERNEL = "model.linear_kernel: onednn and model.attention_kernel: flash"
_WHO = "the native kernels (model.linear_kernel / model.attention_kernel native)"


def default_kernel_dir() -> Path:
    """``kernels`` beside the default model cache (``~/.cache/spyre-server/kernels``)."""
    from spyre_server.model.store import default_cache_dir

    return default_cache_dir().parent / "kernels"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``); empty where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {
        flag
        for line in text.splitlines()
        if line.startswith("flags")
        for flag in line.partition(":")[2].split()
    }


def library_name() -> str:
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    digest.update("\0".join(FLAGS).encode())
    return f"spyre_kernels-{digest.hexdigest()[:16]}.so"


def unsupported_cpu_reason() -> str | None:
    """Why this CPU cannot run the kernels, or None when it can."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"they are x86-64 AVX2 code and this machine is {platform.machine()}"
    flags = cpu_flags()
    if not flags:
        return "the CPU's flags cannot be read from /proc/cpuinfo to check for AVX2 and FMA"
    missing = [f for f in REQUIRED_CPU_FLAGS if f not in flags]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


@functools.cache
def amx_unsupported_reason() -> str | None:
    """Why the AMX kernels cannot run in this process, or None when they can: the CPU's
    flags, then Linux's grant of the AMX tile state to the process (asked for here, once; every
    thread may then use the tiles)."""
    if reason := unsupported_cpu_reason():
        return reason
    missing = [f for f in AMX_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        errno = ctypes.get_errno()
        return f"Linux refused the process the AMX tile state ({os.strerror(errno)})"
    return None


def avx512_bf16_unsupported_reason() -> str | None:
    """Why the AVX512-BF16 attention kernel cannot run here (the CPU's flags), or None."""
    if reason := unsupported_cpu_reason():
        return reason
    missing = [f for f in AVX512_BF16_CPU_FLAGS if f not in cpu_flags()]
    return f"this CPU lacks {', '.join(missing)}" if missing else None


Bf16Dot = Literal["amx", "avx512_bf16"]
"""The units ``kernels/attention_dot_bf16.cpp`` runs its bfloat16 dot products on."""


def bf16_dot_unsupported_reason(unit: Bf16Dot) -> str | None:
    """Why the dot-product attention kernel on ``unit`` cannot run here, or None."""
    return amx_unsupported_reason() if unit == "amx" else avx512_bf16_unsupported_reason()


def build(directory: Path) -> Path:
    """Compile the library into ``directory`` unless it is there already; returns its path."""
    target = directory / library_name()
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        raise NativeKernelError(
            f"{_WHO} are compiled once with a C++ compiler, and {compiler!r} is not on PATH: install g++ (Debian: apt-get install g++), set CXX, "
            f"build them ahead of time with `python -m spyre_server.model.cpu.kernels.library`, "
            f"or set {_OTHER_KERNEL}"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # Compile beside the target, then rename: concurrent builders never see a partial file.
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            partial = Path(scratch) / target.name
            result = subprocess.run(
                [compiler, *FLAGS, *map(str, SOURCES), "-o", str(partial)],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                raise NativeKernelError(
                    f"compiling the native kernels ({', '.join(s.name for s in SOURCES)}) with "
                    f"{compiler} failed (or set {_OTHER_KERNEL}):\n"
                    f"{result.stderr.strip()}"
                )
            os.replace(partial, target)
    except OSError as exc:
        raise NativeKernelError(
            f"cannot write the native kernels to {directory} ({exc}); set model.kernel_dir to a "
            f"writable directory, or set {_OTHER_KERNEL}"
        ) from exc
    return target


@dataclass(frozen=True, slots=True)
class NativeKernelSettings:
    """How one engine's native kernels are built and run: ``model.kernel_dir``,
    ``model.native_avx512`` and ``model.native_amx``. Engines in one process with different
    settings each keep theirs."""

    kernel_dir: Path | None = None
    """Where the library is built and loaded from (None: ``default_kernel_dir()``)."""
    avx512: bool = True
    """Whether the float32-compute kernels run 512 bits wide on CPUs with AVX512F."""
    amx: bool = True
    """Whether bfloat16 linear layers with K a multiple of 32 run on AMX tiles where the
    process can use them (``NativeKernels.linear_bf16_on_amx``)."""

    def load(self) -> NativeKernels:
        """The kernels with these settings (``load_native_kernels``)."""
        return load_native_kernels(
            self.kernel_dir or default_kernel_dir(), avx512=self.avx512, amx=self.amx
        )


@dataclass(frozen=True, slots=True)
class NativeKernels:
    """The library's functions, called with data pointers (``tensor.data_ptr()``) and sizes,
    bound to one width for the float32-compute kernels (``avx512``)."""

    path: Path
    avx512: bool
    """Whether this object's float32-compute kernels (``linear`` and ``linear_add`` from 5 rows
    on, ``paged_attention``'s and ``paged_attention_bf16``'s products and softmax) run 512 bits
    wide: asked for, and the CPU has AVX512F. The same bits either way; another object of the
    same library may run the other width in the same process."""
    packed_numel: Callable[[int, int], int]
    """(N, K) -> floats of the panels of an [N, K] weight."""
    pack: Callable[[int, int, int, int], None]
    """(weight, panels, N, K): packs a contiguous float32 [N, K] weight into 32-byte-aligned
    panels."""
    linear: Callable[[int, int, int, int, int, int], int]
    """(x, panels, out, M, K, N) -> 1 where it ran 512 bits wide, else 0: out [M, N] = x [M, K]
    @ weight.T, both contiguous."""
    linear_add: Callable[[int, int, int, int, int, int], int]
    """(x, panels, out, M, K, N) -> as ``linear``: out [M, N] += x [M, K] @ weight.T (a residual
    in place, the same bits as ``linear`` then an add)."""
    linear_bf16_packed_numel: Callable[[int, int], int]
    """(N, K) -> bfloat16 values of the packed form of an [N, K] bfloat16 weight."""
    linear_bf16_pack: Callable[[int, int, int, int], None]
    """(weight, packed, N, K): packs a contiguous bfloat16 [N, K] weight (64-byte-aligned
    ``packed``)."""
    linear_bf16: Callable[[int, int, int | None, int, int, int, int], int]
    """(x, packed, bias or None, out, M, K, N) -> 1 where it ran on AVX512-BF16, else 0 (the same
    bits), -1 where it found no memory: out [M, N] = x [M, K] @ weight.T (+ bias), bfloat16,
    contiguous; each result's arithmetic fixed whatever M (``kernels/linear_bf16.cpp``)."""
    linear_fp8_packed_numel: Callable[[int, int], int]
    """(N, K) -> bytes of the packed form of an [N, K] float8_e4m3fn weight (its scales: one
    float32 per column of 64-column blocks, ``ceil(N / 64) * 64``)."""
    linear_fp8_pack: Callable[[int, int, int, int, int, int, int], int]
    """(weight, scale, num_scales, packed, packed_scale, N, K) -> how many weights are NaN (the
    packing is unusable unless 0): packs a contiguous float8_e4m3fn [N, K] weight and its N (or
    1) float32 scales (64-byte-aligned ``packed``)."""
    linear_fp8: Callable[[int, int, int, int | None, int, int, int, int], int]
    """(x, packed, packed_scale, bias or None, out, M, K, N) -> as ``linear_bf16`` on the FP8
    values (exact in bfloat16), with each float32 sum times its column's scale before the bias:
    out = bf16(sum * scale[n] + bias[n]) (``kernels/linear_bf16.cpp``)."""
    linear_fp8_amx_pack: Callable[[int, int, int, int, int, int, int], int]
    """``linear_fp8_pack`` for ``linear_fp8_amx`` (K a multiple of 32; -1, nothing written,
    for another K or where ``dot_bf16_compiled`` is False)."""
    linear_fp8_amx: Callable[[int, int, int, int | None, int, int, int, int], int]
    """(x, packed, packed_scale, bias or None, out, M, K, N) -> 2 where it ran, 0 where it
    cannot (as the packing), -1 where it found no memory: ``linear_bf16_amx`` on the FP8 values
    (exact in bfloat16), each sum times its column's scale before the bias
    (``kernels/linear_amx.cpp``: it sums the values times 2^-8 and scales back, so a product or
    partial sum below 2^-118 flushes to zero); only where ``linear_bf16_on_amx``."""
    linear_bf16_dot: bool
    """Whether ``linear_bf16`` computes with AVX512-BF16 dot products (``avx512`` and the CPU
    has AVX512-BF16), else with AVX2 and FMA."""
    linear_bf16_amx_pack: Callable[[int, int, int, int], int]
    """(weight, packed, N, K) -> 1, or 0 where it cannot (K not a multiple of 32, or
    ``dot_bf16_compiled`` False): packs a contiguous bfloat16 [N, K] weight for
    ``linear_bf16_amx`` (``linear_bf16_packed_numel`` values, 64-byte aligned)."""
    linear_bf16_amx: Callable[[int, int, int | None, int, int, int, int], int]
    """(x, packed, bias or None, out, M, K, N) -> 2 where it ran, 0 where it cannot (as the
    packing): ``linear_bf16`` with the sums on AMX tiles (``kernels/linear_amx.cpp``: other bits
    than ``linear_bf16``'s, each row's fixed whatever M); only where ``linear_bf16_on_amx``."""
    linear_bf16_on_amx: bool
    """Whether bfloat16 and FP8 linear layers with K a multiple of 32 take ``linear_bf16_amx``
    and ``linear_fp8_amx`` (for every call): asked for (``model.native_amx``), ``linear_bf16_dot``, ``dot_bf16_compiled``,
    and ``amx_unsupported_reason()`` is None."""
    paged_attention_scratch_numel: Callable[[int, int, int, int], int]
    """(head_dim, H, rows, threads) -> floats of scratch ``paged_attention`` needs (-1 for a
    head_dim other than 64 and 128)."""
    paged_attention: Callable[..., int]
    """(head_dim, q, k_cache, v_cache, block_size, H, G, n, nq, shared_blocks, num_shared,
    own_blocks, num_own, positions, window, scale, threads, scratch, out) -> 0, or 1 for a
    head_dim other than 64 and 128: see ``kernels/attention.cpp`` (``window`` 0: none)."""
    paged_attention_bf16: Callable[..., int]
    """``paged_attention`` with bfloat16 queries, caches and output (float32 scratch)."""
    paged_attention_dot_bf16_scratch_numel: Callable[[int, int, int, int], int]
    """``paged_attention_scratch_numel`` for ``paged_attention_amx`` and
    ``paged_attention_avx512_bf16``."""
    paged_attention_amx: Callable[..., int]
    """``paged_attention_bf16`` with bfloat16 products on AMX tiles
    (``kernels/attention_dot_bf16.cpp``): only where ``amx_unsupported_reason()`` is None and
    ``dot_bf16_compiled``."""
    paged_attention_avx512_bf16: Callable[..., int]
    """The same products as AVX512-BF16 dot products: only where
    ``avx512_bf16_unsupported_reason()`` is None and ``dot_bf16_compiled``."""
    dot_bf16_compiled: bool
    """False where the compiler had no AMX intrinsics (GCC before 11): the two kernels above are
    then stubs that refuse every call."""
    rms_norm: Callable[[int, int, int, int, int, int, float], None]
    """(x, ldx, weight, out, M, N, eps): see ``kernels/elementwise_f32.cpp``."""
    silu_mul: Callable[[int, int, int, int], None]
    """(gate_up, out, M, H): out [M, H] = silu(gate_up[:, :H]) * gate_up[:, H:]."""
    rope: Callable[[int, int, int, int, int, int, int, int], None]
    """(x, ldx, cos, signed_sin, out, T, heads, D): rotary embedding of T tokens."""
    scatter_rows: Callable[[int, int, int, int, int, int], None]
    """(src, lds, slots, dst, T, N): dst row slots[t] = src row t (rows of N floats)."""
    rms_norm_bf16: Callable[[int, int, int, int, int, int, float], None]
    """``rms_norm`` for bfloat16 ``x``, ``weight`` and ``out``: see
    ``kernels/elementwise_bf16.cpp``."""
    silu_mul_bf16: Callable[[int, int, int, int], None]
    """``silu_mul`` for bfloat16 (rounding where fms's GLU rounds)."""
    rope_bf16: Callable[[int, int, int, int, int, int, int, int], None]
    """``rope`` for bfloat16 ``x`` and ``out`` (float32 tables)."""
    fake_quantize_fp8_bf16: Callable[[int, float, int, int], None]
    """(x, scale, out, n): n bfloat16 values rounded to FP8 steps of the bfloat16 ``scale``, as
    ``spyre_server.model.fp8.fake_quantize_fp8`` computes them in bfloat16 (the same bits)."""
    fake_quantize_fp8_rows_bf16: Callable[[int, int, int, int], None]
    """(x, out, M, N): each of M rows of N bfloat16 values rounded to FP8 steps of its own
    dynamic scale, as ``fake_quantize_fp8(x, per_token_fp8_scale(x))`` computes it in bfloat16
    (the same bits)."""
    add_rms_norm_bf16: Callable[[int, int, int, int, int, int, float], None]
    """(x, d, weight, out, M, N, eps): x += d in place (rounded), then out = rms_norm(x)."""
    rope_store_bf16: Callable[..., None]
    """(qkv, ldq, cos, signed_sin, q_out, k_cache, v_cache, slots, T, H, KVH, D): a layer's
    RoPE and KV store from its fused QKV output; see ``kernels/elementwise_bf16.cpp``."""
    rank_publish: Callable[[int, int], None]
    """(flag, value): a tensor-parallel rank's flag in shared memory set to value once its
    earlier stores are visible; see ``kernels/rank_sync.cpp``."""
    rank_wait: Callable[[int, int, int, int, int], int]
    """(flags, stride, count, value, max_spins) -> 1 once every flag is at least value, 0 after
    max_spins rounds."""

    def __deepcopy__(self, memo: dict[int, object]) -> NativeKernels:
        return self  # functions of the one loaded library (ctypes objects cannot be copied)


class _Width(ctypes.c_int):
    """First in a row's argument types: the function takes the width (nonzero: 512 bits where
    the CPU has AVX512F), which each NativeKernels binds (``functools.partial``) to its
    ``avx512``."""


# fmt: off
_PTR, _I64, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIZES = (_I64, _I64, _I64, _I64)
"""A scratch size's arguments: (head_dim, H, rows, threads)."""
_ATTENTION = (_I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR,
              _I64, _FLOAT, _I64, _PTR, _PTR)
"""A paged-attention kernel's arguments (``NativeKernels.paged_attention``)."""
_NORM = (_PTR, _I64, _PTR, _PTR, _I64, _I64, _FLOAT)
_ROPE = (_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64)
# Every function of NativeKernels, a row each: C function, argument types, return type, field.
# Adding a kernel is a row here and a field there.
_FUNCTIONS: tuple[tuple[str, tuple[type, ...], type | None, str], ...] = (
    ("spyre_linear_f32_packed_numel", (_I64, _I64), _I64, "packed_numel"),
    ("spyre_linear_f32_pack", (_PTR, _PTR, _I64, _I64), None, "pack"),
    ("spyre_linear_f32", (_Width, _PTR, _PTR, _PTR, _I64, _I64, _I64), _INT, "linear"),
    ("spyre_linear_add_f32", (_Width, _PTR, _PTR, _PTR, _I64, _I64, _I64), _INT, "linear_add"),
    ("spyre_linear_bf16_packed_numel", (_I64, _I64), _I64, "linear_bf16_packed_numel"),
    ("spyre_linear_bf16_pack", (_PTR, _PTR, _I64, _I64), None, "linear_bf16_pack"),
    ("spyre_linear_bf16", (_Width, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64), _INT, "linear_bf16"),
    ("spyre_linear_bf16_amx_pack", (_PTR, _PTR, _I64, _I64), _INT, "linear_bf16_amx_pack"),
    ("spyre_linear_bf16_amx", (_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64), _INT, "linear_bf16_amx"),
    ("spyre_linear_fp8_packed_numel", (_I64, _I64), _I64, "linear_fp8_packed_numel"),
    ("spyre_linear_fp8_pack", (_PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64), _I64, "linear_fp8_pack"),
    ("spyre_linear_fp8", (_Width, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64), _INT, "linear_fp8"),
    ("spyre_linear_fp8_amx_pack", (_PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64), _I64, "linear_fp8_amx_pack"),
    ("spyre_linear_fp8_amx", (_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64), _INT, "linear_fp8_amx"),
    ("spyre_paged_attention_f32_scratch_numel", _SIZES, _I64, "paged_attention_scratch_numel"),
    ("spyre_paged_attention_f32", (_Width, *_ATTENTION), _INT, "paged_attention"),
    ("spyre_paged_attention_bf16", (_Width, *_ATTENTION), _INT, "paged_attention_bf16"),
    ("spyre_paged_attention_dot_bf16_scratch_numel", _SIZES, _I64, "paged_attention_dot_bf16_scratch_numel"),
    ("spyre_paged_attention_amx", _ATTENTION, _INT, "paged_attention_amx"),
    ("spyre_paged_attention_avx512_bf16", _ATTENTION, _INT, "paged_attention_avx512_bf16"),
    ("spyre_rms_norm_f32", _NORM, None, "rms_norm"),
    ("spyre_silu_mul_f32", (_PTR, _PTR, _I64, _I64), None, "silu_mul"),
    ("spyre_rope_f32", _ROPE, None, "rope"),
    ("spyre_scatter_rows_f32", (_PTR, _I64, _PTR, _PTR, _I64, _I64), None, "scatter_rows"),
    ("spyre_rms_norm_bf16", _NORM, None, "rms_norm_bf16"),
    ("spyre_silu_mul_bf16", (_PTR, _PTR, _I64, _I64), None, "silu_mul_bf16"),
    ("spyre_rope_bf16", _ROPE, None, "rope_bf16"),
    ("spyre_fake_quantize_fp8_bf16", (_PTR, _FLOAT, _PTR, _I64), None, "fake_quantize_fp8_bf16"),
    ("spyre_fake_quantize_fp8_rows_bf16", (_PTR, _PTR, _I64, _I64), None, "fake_quantize_fp8_rows_bf16"),
    ("spyre_add_rms_norm_bf16", (_PTR, _PTR, _PTR, _PTR, _I64, _I64, _FLOAT), None, "add_rms_norm_bf16"),
    ("spyre_rope_store_bf16", (_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64), None, "rope_store_bf16"),
    ("spyre_rank_publish", (_PTR, _I64), None, "rank_publish"),
    ("spyre_rank_wait", (_PTR, _I64, _I64, _I64, _I64), _INT, "rank_wait"),
)
# fmt: on


@functools.cache
def load_native_kernels(directory: Path, *, avx512: bool = True, amx: bool = True) -> NativeKernels:
    """Build (if needed) into ``directory`` and load the kernels, their float32-compute code 512
    bits wide where ``avx512`` and the CPU has AVX512F, bfloat16 linear layers on AMX where
    ``amx`` and they can run (``NativeKernels.linear_bf16_on_amx``); raises NativeKernelError
    where they cannot run. One library per directory, whatever the settings."""
    if reason := unsupported_cpu_reason():
        raise NativeKernelError(f"{_WHO} cannot run here: {reason}; set {_OTHER_KERNEL}")
    path, lib = _library(directory)
    # The probes are () -> int: ctypes' default signature.
    wide = avx512 and lib.spyre_native_avx512_supported() == 1
    functions: dict[str, Any] = {}
    for name, argtypes, _, field in _FUNCTIONS:
        function = getattr(lib, name)
        bound = argtypes[:1] == (_Width,)
        functions[field] = functools.partial(function, int(wide)) if bound else function
    compiled = lib.spyre_dot_bf16_compiled() == 1
    linear_dot = wide and lib.spyre_linear_bf16_dot_supported() == 1
    on_amx = amx and linear_dot and compiled and amx_unsupported_reason() is None
    return NativeKernels(
        path=path,
        avx512=wide,
        dot_bf16_compiled=compiled,
        linear_bf16_dot=linear_dot,
        linear_bf16_on_amx=on_amx,
        **functions,
    )


@functools.cache
def _library(directory: Path) -> tuple[Path, ctypes.CDLL]:
    """The library built in ``directory``, loaded, with its functions' signatures set."""
    import torch  # noqa: F401  (first: the library's libgomp.so.1 must resolve to torch's)

    path = build(directory)
    lib = ctypes.CDLL(str(path))
    for name, argtypes, restype, _ in _FUNCTIONS:
        function = getattr(lib, name)
        function.argtypes, function.restype = argtypes, restype
    return path, lib


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Build the native CPU kernels ahead of time (skipped, with the reason, on a "
        "CPU that cannot run them)."
    )
    parser.add_argument(
        "--into", type=Path, default=None, help="directory (default: default_kernel_dir())"
    )
    args = parser.parse_args()
    if reason := unsupported_cpu_reason():
        print(f"native kernels not built: {reason} (the auto kernels are onednn and flash here)")
        return
    try:
        print(build(args.into or default_kernel_dir()))
    except NativeKernelError as exc:
        raise SystemExit(f"error: {exc}") from None


if __name__ == "__main__":
    main()
