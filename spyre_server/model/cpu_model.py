"""The cpu backend's own copy of the model, with the CPU kernels it runs faster with.

``cpu_inference_copy`` returns a copy of the loaded fms model that shares every parameter and
buffer with it (only the module objects are new), then, on the copy only:

- its rotary embedding computes with the rotation's entries (``fast_rope.py``: the same result
  bit for bit);
- its RMS norms run as one aten op each (``fast_norm.py``: the same result bit for bit);
- its linear layers hold their weights packed for our own float32 kernel
  (``linear_kernel="native"``, ``native_linear.py``) or for oneDNN (``"onednn"``,
  ``packed_linear.py``), or stay ``F.linear`` (``"aten"``); the packed kernels differ from
  ``F.linear`` by float32 rounding. With ``native``, its RMS norms, GLU activations and rotary
  embeddings run on our own kernels too (``native_elementwise.py``, float32 rounding again).
  ``"auto"`` is ``native`` for float32 on CPUs with AVX2 and FMA, ``onednn`` otherwise
  (``resolve_linear_kernel``).

``cpu_attention_kernel`` gives the runner its kernel for the paged-attention op
(``model.attention_kernel``; in bfloat16 ``auto`` is our bfloat16 dot-product kernel on AMX where
the CPU has AMX, else on AVX512-BF16 where it has that, else ours for decode steps and SDPA's
flash for prefill chunks), and ``cpu_decoder`` its step without
fms's module machinery: the native one (``native_decoder.py``) when both kernels are native,
the native bfloat16 one (``native_bf16_decoder.py``) for a bfloat16 model on the native
element-wise kernels, else the aten one (``aten_decoder.py``). A bfloat16 copy gets the native
element-wise kernels whatever its linear kernel.

The loaded model is left as it was (tests share one model between engines and oracles). Drop it
to free the unpacked linear weights.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
from pathlib import Path
from typing import Literal

import torch

from spyre_server.model.aten_decoder import AtenDecoder
from spyre_server.model.aten_decoder import unsupported_reason as aten_unsupported_reason
from spyre_server.model.fast_norm import use_fast_rms_norm
from spyre_server.model.fast_rope import use_fast_rope
from spyre_server.model.native_attention import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    NativePagedAttention,
)
from spyre_server.model.native_bf16_decoder import NativeBf16Decoder
from spyre_server.model.native_bf16_decoder import unsupported_reason as bf16_unsupported_reason
from spyre_server.model.native_decoder import NativeDecoder
from spyre_server.model.native_decoder import unsupported_reason as native_unsupported_reason
from spyre_server.model.native_elementwise import use_native_elementwise
from spyre_server.model.native_kernels import (
    DOT_BF16_NOT_COMPILED,
    NativeKernelError,
    NativeKernels,
    bf16_dot_unsupported_reason,
    default_kernel_dir,
    load_native_kernels,
    unsupported_cpu_reason,
)
from spyre_server.model.native_linear import use_native_linears
from spyre_server.model.packed_linear import LinearKernelError, check_onednn, pack_linears

logger = logging.getLogger(__name__)


LinearKernel = Literal["auto", "native", "onednn", "aten"]


def resolve_linear_kernel(
    requested: LinearKernel, dtype: torch.dtype
) -> Literal["native", "onednn", "aten"]:
    """The kernel ``model.linear_kernel`` stands for with ``dtype`` on this machine; raises
    LinearKernelError for ``native`` with a dtype other than float32."""
    if requested == "auto":
        native = dtype == torch.float32 and unsupported_cpu_reason() is None
        return "native" if native else "onednn"
    if requested == "native" and dtype != torch.float32:
        raise LinearKernelError(
            f"model.linear_kernel 'native' computes in float32, and the model runs in {dtype}; "
            "set model.linear_kernel: onednn (or auto), or model.dtype: float32"
        )
    return requested


AttentionKernel = Literal["auto", "native", "amx", "avx512_bf16", "mixed", "flash"]
ResolvedAttentionKernel = Literal["native", "amx", "avx512_bf16", "mixed", "flash"]


def resolve_attention_kernel(
    requested: AttentionKernel, dtype: torch.dtype, head_dim: int
) -> ResolvedAttentionKernel:
    """The kernel ``model.attention_kernel`` stands for (``mixed``: native for decode steps,
    flash for prefill chunks); raises LinearKernelError for a kernel that cannot compute
    ``dtype`` and ``head_dim`` here (``native`` and ``mixed``: float32 or bfloat16 with head_dim
    64 or 128; ``amx`` and ``avx512_bf16``: bfloat16 with those head sizes on a CPU with that
    unit)."""
    supported = dtype in SUPPORTED_DTYPES and head_dim in SUPPORTED_HEAD_DIMS
    if requested == "auto":
        if not supported or unsupported_cpu_reason() is not None:
            return "flash"
        if dtype == torch.float32:
            return "native"
        # In bfloat16 our dot-product kernels multiply bfloat16 for both the prefill chunks
        # and the decode steps, on AMX or else AVX512-BF16. Without either, ours computing in
        # float32 beats SDPA's flash kernel at both: flash multiplies bfloat16 fast only on
        # AMX (RESULTS.md, session 14: without AMX flash ran prefill chunks at 78-130 GFLOP/s,
        # ours at 140-290).
        if bf16_dot_unsupported_reason("amx") is None:
            return "amx"
        return "avx512_bf16" if bf16_dot_unsupported_reason("avx512_bf16") is None else "native"
    if requested in ("native", "mixed") and not supported:
        raise LinearKernelError(
            f"model.attention_kernel '{requested}' computes float32 or bfloat16 with head_dim "
            f"64 or 128, and the model runs {dtype} with head_dim {head_dim}; set "
            "model.attention_kernel: flash (or auto)"
        )
    if requested == "amx" or requested == "avx512_bf16":
        if dtype != torch.bfloat16 or head_dim not in SUPPORTED_HEAD_DIMS:
            raise LinearKernelError(
                f"model.attention_kernel '{requested}' computes bfloat16 with head_dim 64 or "
                f"128, and the model runs {dtype} with head_dim {head_dim}; set "
                "model.attention_kernel: auto"
            )
        if (reason := bf16_dot_unsupported_reason(requested)) is not None:
            raise LinearKernelError(
                f"model.attention_kernel '{requested}' cannot run here: {reason}; set "
                "model.attention_kernel: auto"
            )
    return requested


def cpu_attention_kernel(
    attention_kernel: AttentionKernel,
    *,
    dtype: torch.dtype,
    head_dim: int,
    kernel_dir: Path | None = None,
    native_avx512: bool = True,
) -> NativePagedAttention | None:
    """The cpu runner's kernel for the paged-attention op: ours, or None for SDPA's flash
    kernel; raises LinearKernelError where ours cannot run here. ``native_avx512``: as
    ``cpu_inference_copy``'s."""
    resolved = resolve_attention_kernel(attention_kernel, dtype, head_dim)
    if resolved == "flash":
        logger.info("cpu kernels: attention_kernel flash (%s)", attention_kernel)
        return None
    kernels = _native_kernels(kernel_dir, native_avx512)
    if (resolved == "amx" or resolved == "avx512_bf16") and not kernels.dot_bf16_compiled:
        if attention_kernel == resolved:
            raise LinearKernelError(
                f"model.attention_kernel '{resolved}' cannot run here: {DOT_BF16_NOT_COMPILED}; "
                "set model.attention_kernel: auto"
            )
        logger.warning("cpu kernels: attention_kernel not %s: %s", resolved, DOT_BF16_NOT_COMPILED)
        # With AMX, flash's products run on it (faster than ours in float32 at prefill chunks).
        resolved = "mixed" if resolved == "amx" else "native"
    if resolved == "mixed":
        logger.info(
            "cpu kernels: attention_kernel native for decode steps, flash for prefill chunks (%s)",
            attention_kernel,
        )
        return NativePagedAttention(kernels, prefill=False)
    logger.info("cpu kernels: attention_kernel %s (%s)", resolved, attention_kernel)
    if resolved == "native":
        return NativePagedAttention(kernels)
    return NativePagedAttention(kernels, bf16_dot=resolved)


def cpu_decoder(
    model: torch.nn.Module, attention: NativePagedAttention | None
) -> NativeDecoder | NativeBf16Decoder | AtenDecoder | None:
    """The runner's step for ``model`` (a ``cpu_inference_copy``) with ``attention``: the first
    of the native decoder (float32), the native bfloat16 decoder and the aten decoder that covers
    them, else None: fms's forward runs the steps. The log says which, and why not the others."""
    native_reason = (
        "the attention kernel is flash" if attention is None else native_unsupported_reason(model)
    )
    if native_reason is None:
        assert attention is not None
        logger.info("cpu kernels: steps on the native decoder")
        return NativeDecoder(model, attention)
    bf16_reason = bf16_unsupported_reason(model)
    if bf16_reason is None:
        logger.info("cpu kernels: steps on the native bfloat16 decoder")
        return NativeBf16Decoder(model, attention)
    aten_reason = aten_unsupported_reason(model)
    if aten_reason is None:
        logger.info(
            "cpu kernels: steps on the aten decoder (not native: %s; not native bfloat16: %s)",
            native_reason,
            bf16_reason,
        )
        return AtenDecoder(model, attention)
    logger.info(
        "cpu kernels: steps through fms's forward (not native: %s; not aten: %s)",
        native_reason,
        aten_reason,
    )
    return None


def _native_kernels(kernel_dir: Path | None, avx512: bool) -> NativeKernels:
    """The kernels built in (or loaded from) ``kernel_dir`` (None: the default), their float32
    code 512 bits wide where ``avx512`` and the CPU has AVX512F (``model.native_avx512``); or a
    LinearKernelError, the start-up error of a kernel that cannot run here."""
    try:
        kernels = load_native_kernels(kernel_dir or default_kernel_dir())
    except NativeKernelError as exc:
        raise LinearKernelError(str(exc)) from exc
    _log_width(kernels.avx512(int(avx512)) == 1, avx512)
    return kernels


@functools.cache
def _log_width(wide: bool, avx512: bool) -> None:
    """Logs the native kernels' width once per process and setting."""
    logger.info(
        "cpu kernels: native float32 code %d bits wide (model.native_avx512: %s%s)",
        512 if wide else 256,
        str(avx512).lower(),
        ", the CPU lacks avx512f" if avx512 and not wide else "",
    )


def cpu_inference_copy(
    model: torch.nn.Module,
    *,
    linear_kernel: LinearKernel,
    dtype: torch.dtype,
    kernel_dir: Path | None = None,
    native_avx512: bool = True,
) -> torch.nn.Module:
    """``linear_kernel`` as ``model.linear_kernel`` validated it; raises LinearKernelError where
    the kernel it stands for cannot run here. ``kernel_dir``: where the native kernels are built
    (``model.kernel_dir``; None: ``default_kernel_dir()``). ``native_avx512``
    (``model.native_avx512``): whether the native kernels' float32 code runs 512 bits wide on
    CPUs with AVX512F; a setting of the process's kernel library: the last call sets it."""
    kernel = resolve_linear_kernel(linear_kernel, dtype)
    if kernel == "onednn":
        check_onednn(dtype)
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    clone = copy.deepcopy(model, shared)
    num_rope = use_fast_rope(clone)
    num_norms = use_fast_rms_norm(clone)
    if kernel == "native":
        kernels = _native_kernels(kernel_dir, native_avx512)
        num_replaced = use_native_linears(clone, kernels)
        use_native_elementwise(clone, kernels)
    elif kernel == "onednn":
        num_replaced = pack_linears(clone)
    else:
        num_replaced = 0
    if kernel != "native" and dtype == torch.bfloat16 and unsupported_cpu_reason() is None:
        # No native linear computes bfloat16, but the element-wise kernels do.
        use_native_elementwise(clone, _native_kernels(kernel_dir, native_avx512))
        logger.info("cpu kernels: bfloat16 RMS norms, GLU activations and RoPE native")
    logger.info(
        "cpu kernels: linear_kernel %s (%s): %d linear layers packed; %d rotary embeddings and "
        "%d RMS norms on the fast path",
        kernel,
        linear_kernel,
        num_replaced,
        num_rope,
        num_norms,
    )
    return clone
