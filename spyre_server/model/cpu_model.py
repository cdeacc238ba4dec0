"""The cpu backend's own copy of the model, with the CPU kernels it runs faster with.

``cpu_inference_copy`` returns a copy of the loaded fms model that shares every parameter and
buffer with it (only the module objects are new), then, on the copy only:

- its rotary embedding computes with the rotation's entries (``fast_rope.py``: the same result
  bit for bit);
- its RMS norms run as one aten op each (``fast_norm.py``: the same result bit for bit);
- with ``linear_kernel="onednn"``, its linear layers hold their weights packed for oneDNN
  (``packed_linear.py``: float32 rounding differences from ``F.linear``).

The loaded model is left as it was (tests share one model between engines and oracles). Drop it
to free the unpacked linear weights.
"""

from __future__ import annotations

import copy
import itertools
import logging
from typing import Literal

import torch

from spyre_server.model.fast_norm import use_fast_rms_norm
from spyre_server.model.fast_rope import use_fast_rope
from spyre_server.model.packed_linear import check_onednn, pack_linears

logger = logging.getLogger(__name__)


def cpu_inference_copy(
    model: torch.nn.Module, *, linear_kernel: Literal["onednn", "aten"], dtype: torch.dtype
) -> torch.nn.Module:
    """``linear_kernel``: ``onednn`` (raises LinearKernelError where oneDNN cannot run
    ``dtype``) or ``aten`` (F.linear), as ``model.linear_kernel`` validated it."""
    if linear_kernel == "onednn":
        check_onednn(dtype)
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    clone = copy.deepcopy(model, shared)
    num_rope = use_fast_rope(clone)
    num_norms = use_fast_rms_norm(clone)
    num_packed = pack_linears(clone) if linear_kernel == "onednn" else 0
    logger.info(
        "cpu kernels: %d linear layers packed for oneDNN, %d rotary embeddings and %d RMS norms "
        "on the fast path",
        num_packed,
        num_rope,
        num_norms,
    )
    return clone
