"""The cpu backend's own copy of the model, with the CPU kernels it runs faster with.

``cpu_inference_copy`` returns a copy of the loaded fms model that shares every parameter and
buffer with it (only the module objects are new), then, on the copy only:

- its rotary embedding computes with the rotation's entries (``fast_rope.py``: the same result
  bit for bit);
- its RMS norms run as one aten op each (``fast_norm.py``: the same result bit for bit);
- its linear layers hold their weights packed for our own float32 kernel
  (``linear_kernel="native"``, ``native_linear.py``) or for oneDNN (``"onednn"``,
  ``packed_linear.py``), or stay ``F.linear`` (``"aten"``); the packed kernels differ from
  ``F.linear`` by float32 rounding. ``"auto"`` is ``native`` for float32 on CPUs with AVX2 and
  FMA, ``onednn`` otherwise (``resolve_linear_kernel``).

The loaded model is left as it was (tests share one model between engines and oracles). Drop it
to free the unpacked linear weights.
"""

from __future__ import annotations

import copy
import itertools
import logging
from pathlib import Path
from typing import Literal

import torch

from spyre_server.model.fast_norm import use_fast_rms_norm
from spyre_server.model.fast_rope import use_fast_rope
from spyre_server.model.native_kernels import default_kernel_dir, unsupported_cpu_reason
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


def cpu_inference_copy(
    model: torch.nn.Module,
    *,
    linear_kernel: LinearKernel,
    dtype: torch.dtype,
    kernel_dir: Path | None = None,
) -> torch.nn.Module:
    """``linear_kernel`` as ``model.linear_kernel`` validated it; raises LinearKernelError where
    the kernel it stands for cannot run here. ``kernel_dir``: where the native kernels are built
    (``model.kernel_dir``; None: ``default_kernel_dir()``)."""
    kernel = resolve_linear_kernel(linear_kernel, dtype)
    if kernel == "onednn":
        check_onednn(dtype)
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    clone = copy.deepcopy(model, shared)
    num_rope = use_fast_rope(clone)
    num_norms = use_fast_rms_norm(clone)
    if kernel == "native":
        num_replaced = use_native_linears(clone, kernel_dir or default_kernel_dir())
    elif kernel == "onednn":
        num_replaced = pack_linears(clone)
    else:
        num_replaced = 0
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
