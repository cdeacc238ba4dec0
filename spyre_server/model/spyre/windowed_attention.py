"""The spyre backend's attention for a model with a sliding window: fms's ``spyre_paged_attn``
with its compute swapped for the reference stack's windowed op.

The card's programs reach a window through one op: ``spyre::paged_attn_compute_with_sinks``
(ibm-fms 1.13.1, ``fms.utils.spyre.paged``), the op the reference (sendnn-inference 2.6.3) runs
Granite's sliding-window models with, through fms's ``spyre_paged_attn_with_sinks``. That name
takes its window from the attention module's own ``sliding_window`` argument, which only fms's
models with attention sinks pass; ``WINDOWED_ATTN_NAME`` here is the same store and validation
as ``spyre_paged_attn`` with that op as the compute, its window and sinks taken from the step's
keyword arguments (``windowed_attention_kwargs``).

The op masks the keys outside each query's window with HF transformers' semantics (the query at
position p attends the keys at p - W + 1 .. p: the keys of a row's context are indexed from its
left padding, so key index j is position j). It also scales each output by
sigmoid(lse - sink), a learned sink per head: here ``NO_SINK``, for which that factor is
exactly 1.
"""

from __future__ import annotations

import math
from typing import Any

import fms.utils.spyre.paged  # noqa: F401  (registers "spyre_paged_attn" with fms)
import torch
from fms.modules.attention import get_attention_type, register_attention_op

WINDOWED_ATTN_NAME = "spyre_server_paged_attn_windowed"
NO_SINK = -1.0e4
"""The attention sink that changes nothing: sigmoid(lse - NO_SINK) rounds to 1 in float16 and
float32 for any log-sum-exp of the scores above -9000."""


def windowed_attention_kwargs(window: int, nheads: int, dtype: torch.dtype) -> dict[str, Any]:
    """The keyword arguments of an fms forward that select this attention with a window of
    ``window`` keys, for a model of ``nheads`` query heads in ``dtype``."""
    return {
        "attn_name": WINDOWED_ATTN_NAME,
        "attention_window": window,
        "attention_sinks": torch.full((nheads,), NO_SINK, dtype=dtype),
    }


def _compute(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    nheads: int,
    kvheads: int,
    p_dropout: float,
    scale_factor: float | None,
    **attn_kwargs: Any,
) -> torch.Tensor:
    scale = scale_factor if scale_factor is not None else 1 / math.sqrt(query.shape[-1])
    return torch.ops.spyre.paged_attn_compute_with_sinks(  # type: ignore[no-any-return]
        query,
        key_cache,
        value_cache,
        scale,
        attn_kwargs["current_tkv_mask"],
        attn_kwargs["left_padded_prompt_mask"],
        attn_kwargs["block_table"],
        attn_kwargs["attention_sinks"],
        attn_kwargs["attention_window"],
    )


def _register() -> None:
    paged = get_attention_type(attn_name="spyre_paged_attn")
    register_attention_op(
        WINDOWED_ATTN_NAME,
        paged["store"],
        _compute,
        is_prefill_op=lambda **_: False,  # the steps always pass a block table
        validate_attn_kwargs_op=paged["validate_attn_kwargs"],
    )


_register()
