"""The cpu backend's copy of the model and the kernels it runs, as the config chooses them.

``cpu_inference_copy`` copies the loaded fms model, sharing every parameter and buffer with it
(only the module objects are new; the loaded model is left as it was, and dropping it frees the
unpacked linear weights), and puts the copy's rotary embeddings, RMS norms and linear layers on
faster kernels (``model.linear_kernel``; a bfloat16 copy's element-wise ops run on ours whatever
its linear kernel). ``cpu_attention_kernel`` picks the paged-attention op's kernel
(``model.attention_kernel``) and ``cpu_decoder`` the step that runs them all.

``auto`` picks: for the linears ``native`` (float32 or bfloat16) on CPUs with AVX2 and FMA, else
``onednn``: ours compute each row the same way in a step of any size, which the prefix cache
needs, and oneDNN's do not;
for attention ours (``native``) in float32, in bfloat16 our dot-product kernel on AMX, else on
AVX512-BF16, else ``native``, and SDPA's ``flash`` where ours cannot compute the model; for the
steps the first decoder that covers the model. docs/cpu-backend.md describes the kernels.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
from typing import Literal

import torch

from spyre_server.model.cpu.decoders.aten import AtenDecoder
from spyre_server.model.cpu.decoders.aten import unsupported_reason as aten_unsupported_reason
from spyre_server.model.cpu.decoders.base import SumAcrossRanks
from spyre_server.model.cpu.decoders.native import NativeDecoder
from spyre_server.model.cpu.decoders.native import unsupported_reason as native_unsupported_reason
from spyre_server.model.cpu.decoders.native_bf16 import NativeBf16Decoder
from spyre_server.model.cpu.decoders.native_bf16 import (
    unsupported_reason as bf16_unsupported_reason,
)
from spyre_server.model.cpu.errors import (
    AttentionKernelError,
    KernelUnavailableError,
    LinearKernelError,
)
from spyre_server.model.cpu.kernels.library import (
    DOT_BF16_NOT_COMPILED,
    NativeKernelError,
    NativeKernels,
    NativeKernelSettings,
    bf16_dot_unsupported_reason,
    unsupported_cpu_reason,
)
from spyre_server.model.cpu.ops.fast_norm import use_fast_rms_norm
from spyre_server.model.cpu.ops.fast_rope import use_fast_rope
from spyre_server.model.cpu.ops.native_attention import (
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    NativePagedAttention,
)
from spyre_server.model.cpu.ops.native_elementwise import use_native_elementwise
from spyre_server.model.cpu.ops.native_linear import NATIVE_DTYPES, use_native_linears
from spyre_server.model.cpu.ops.packed_linear import check_onednn, pack_linears
from spyre_server.model.fp8 import Fp8Linear

logger = logging.getLogger(__name__)


LinearKernel = Literal["auto", "native", "onednn", "aten"]
DEFAULT_KERNEL_SETTINGS = NativeKernelSettings()
"""The native kernels in ``default_kernel_dir()``, 512 bits wide where the CPU has AVX512F."""


def resolve_linear_kernel(
    requested: LinearKernel, dtype: torch.dtype
) -> Literal["native", "onednn", "aten"]:
    """The kernel ``model.linear_kernel`` stands for with ``dtype`` on this machine; raises
    LinearKernelError for ``native`` with a dtype other than float32 and bfloat16."""
    if requested == "auto":
        native = dtype in NATIVE_DTYPES and unsupported_cpu_reason() is None
        return "native" if native else "onednn"
    if requested == "native" and dtype not in NATIVE_DTYPES:
        raise LinearKernelError(
            f"model.linear_kernel 'native' computes float32 and bfloat16, and the model runs "
            f"in {dtype}; set model.linear_kernel: onednn (or auto), or model.dtype: float32"
        )
    return requested


AttentionKernel = Literal["auto", "native", "amx", "avx512_bf16", "mixed", "flash"]
ResolvedAttentionKernel = Literal["native", "amx", "avx512_bf16", "mixed", "flash"]


def resolve_attention_kernel(
    requested: AttentionKernel, dtype: torch.dtype, head_dim: int
) -> ResolvedAttentionKernel:
    """The kernel ``model.attention_kernel`` stands for (``mixed``: native for decode steps,
    flash for prefill chunks); raises AttentionKernelError for a kernel that cannot compute
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
        # AMX.
        if bf16_dot_unsupported_reason("amx") is None:
            return "amx"
        return "avx512_bf16" if bf16_dot_unsupported_reason("avx512_bf16") is None else "native"
    if requested in ("native", "mixed") and not supported:
        raise AttentionKernelError(
            f"model.attention_kernel '{requested}' computes float32 or bfloat16 with head_dim "
            f"64 or 128, and the model runs {dtype} with head_dim {head_dim}; set "
            "model.attention_kernel: flash (or auto)"
        )
    if requested == "amx" or requested == "avx512_bf16":
        if dtype != torch.bfloat16 or head_dim not in SUPPORTED_HEAD_DIMS:
            raise AttentionKernelError(
                f"model.attention_kernel '{requested}' computes bfloat16 with head_dim 64 or "
                f"128, and the model runs {dtype} with head_dim {head_dim}; set "
                "model.attention_kernel: auto"
            )
        if (reason := bf16_dot_unsupported_reason(requested)) is not None:
            raise AttentionKernelError(
                f"model.attention_kernel '{requested}' cannot run here: {reason}; set "
                "model.attention_kernel: auto"
            )
    return requested


def warn_unless_row_invariant(
    linear_kernel: LinearKernel,
    attention_kernel: AttentionKernel,
    *,
    dtype: torch.dtype,
    head_dim: int,
    prefix_caching: bool,
) -> None:
    """Log a warning when prefix caching is on and a resolved kernel is not row-invariant (it
    sums a row in another order in a step of another shape: oneDNN's and aten's linear, SDPA's
    flash attention, ``mixed``'s prefill chunks), so a cache hit may change a token; our own
    kernels give a row the same bits in any step (DESIGN §4, test_batch_invariance.py)."""
    if not prefix_caching:
        return
    linear = resolve_linear_kernel(linear_kernel, dtype)
    attention = resolve_attention_kernel(attention_kernel, dtype, head_dim)
    others = [f"linear_kernel {linear}"] if linear != "native" else []
    if attention in ("flash", "mixed"):
        others.append(f"attention_kernel {attention}")
    if others:
        logger.warning(
            "cpu kernels: %s sum a row in another order in steps of other shapes, so a "
            "prefix-cache hit can change a token of a %s model (the native kernels cannot)",
            " and ".join(others),
            str(dtype).removeprefix("torch."),
        )


def cpu_attention_kernel(
    attention_kernel: AttentionKernel,
    *,
    dtype: torch.dtype,
    head_dim: int,
    kernel_settings: NativeKernelSettings = DEFAULT_KERNEL_SETTINGS,
) -> NativePagedAttention | None:
    """The cpu runner's kernel for the paged-attention op: ours, or None for SDPA's flash
    kernel; raises AttentionKernelError where ours cannot run here (KernelUnavailableError
    where the native kernels cannot be built or run). ``kernel_settings``: as
    ``cpu_inference_copy``'s."""
    resolved = resolve_attention_kernel(attention_kernel, dtype, head_dim)
    if resolved == "flash":
        logger.info("cpu kernels: attention_kernel flash (%s)", attention_kernel)
        return None
    kernels = _native_kernels(kernel_settings)
    if (resolved == "amx" or resolved == "avx512_bf16") and not kernels.dot_bf16_compiled:
        if attention_kernel == resolved:
            raise AttentionKernelError(
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
    model: torch.nn.Module,
    attention: NativePagedAttention | None,
    reduce: SumAcrossRanks | None = None,
) -> NativeDecoder | NativeBf16Decoder | AtenDecoder | None:
    """The runner's step for ``model`` (a ``cpu_inference_copy``) with ``attention``: the first
    of the native decoder (float32), the native bfloat16 decoder and the aten decoder that covers
    them, else None: fms's forward runs the steps. The log says which, and why not the others.
    ``reduce``: a tensor-parallel rank's sum across the ranks (``Decoder``)."""
    native_reason = (
        "the attention kernel is flash" if attention is None else native_unsupported_reason(model)
    )
    if native_reason is None:
        assert attention is not None
        logger.info("cpu kernels: steps on the native decoder")
        return NativeDecoder(model, attention, reduce)
    bf16_reason = bf16_unsupported_reason(model)
    if bf16_reason is None:
        logger.info("cpu kernels: steps on the native bfloat16 decoder")
        return NativeBf16Decoder(model, attention, reduce)
    aten_reason = aten_unsupported_reason(model)
    if aten_reason is None:
        logger.info(
            "cpu kernels: steps on the aten decoder (not native: %s; not native bfloat16: %s)",
            native_reason,
            bf16_reason,
        )
        return AtenDecoder(model, attention, reduce)
    logger.info(
        "cpu kernels: steps through fms's forward (not native: %s; not aten: %s)",
        native_reason,
        aten_reason,
    )
    return None


def _native_kernels(settings: NativeKernelSettings) -> NativeKernels:
    """The kernels with ``settings``; raises KernelUnavailableError (the start-up error) where
    they cannot be built or run here."""
    try:
        kernels = settings.load()
    except NativeKernelError as exc:
        raise KernelUnavailableError(str(exc)) from exc
    _log_width(kernels.avx512, settings.avx512)
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
    kernel_settings: NativeKernelSettings = DEFAULT_KERNEL_SETTINGS,
) -> torch.nn.Module:
    """``linear_kernel`` as ``model.linear_kernel`` validated it; raises LinearKernelError where
    the kernel it stands for cannot run here, KernelUnavailableError where the native kernels it
    needs cannot be built or run. ``kernel_settings``: where the native kernels are
    built and whether their float32 code runs 512 bits wide on CPUs with AVX512F
    (``model.kernel_dir``, ``model.native_avx512``), for this copy's kernels only."""
    kernel = resolve_linear_kernel(linear_kernel, dtype)
    if kernel != "native" and any(type(m) is Fp8Linear for m in model.modules()):
        raise LinearKernelError(
            f"FP8 checkpoints run on the native linear kernel, not {kernel} "
            f"(model.linear_kernel {linear_kernel})"
        )
    if kernel == "onednn":
        check_onednn(dtype)
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    clone = copy.deepcopy(model, shared)
    num_rope = use_fast_rope(clone)
    num_norms = use_fast_rms_norm(clone)
    code = ""
    if kernel == "native":
        kernels = _native_kernels(kernel_settings)
        num_replaced = use_native_linears(clone, kernels)
        use_native_elementwise(clone, kernels)
        if dtype == torch.bfloat16:
            code = ", AVX512-BF16" if kernels.linear_bf16_dot else ", AVX2"
            if kernels.linear_bf16_on_amx:
                code += " and AMX where the input size is a multiple of 32"
    elif kernel == "onednn":
        num_replaced = pack_linears(clone)
    else:
        num_replaced = 0
    if kernel != "native" and dtype == torch.bfloat16 and unsupported_cpu_reason() is None:
        # The linears are oneDNN's or aten's, the element-wise kernels ours.
        use_native_elementwise(clone, _native_kernels(kernel_settings))
    if dtype == torch.bfloat16 and unsupported_cpu_reason() is None:
        logger.info("cpu kernels: bfloat16 RMS norms, GLU activations and RoPE native")
    logger.info(
        "cpu kernels: linear_kernel %s (%s%s): %d linear layers packed; %d rotary embeddings and "
        "%d RMS norms on the fast path",
        kernel,
        linear_kernel,
        code,
        num_replaced,
        num_rope,
        num_norms,
    )
    if kernel != "native":
        logger.warning(
            "cpu kernels: linear_kernel %s is not batch-invariant: a row's result can depend on "
            "how many rows a step computes, so a prefix-cache hit can change the last bits of a "
            "prompt's KV and, rarely, an answer (DESIGN §4); linear_kernel native does not%s",
            kernel,
            "" if unsupported_cpu_reason() is None else " but cannot run here",
        )
    return clone
