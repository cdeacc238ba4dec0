"""The aten decoder: a whole cpu step of an fms decoder in aten ops over the model's modules.

The cpu runner's step where neither native decoder runs (``prepare.cpu_decoder`` picks).
``AtenDecoder`` runs the same tensor ops in the same order as fms's forward over the
``cpu_inference_copy`` modules (the fast or native RMS norm and rotary embedding, the projections
whatever their kernel, the QKV and feed-forward modules, our paged-attention store and compute,
the family's scalars), so the logits and KV writes are the same bits, with the glue between them
cut to the few views the ops need.

It covers the families of ``base.FAMILIES`` (fms's LLaMA, Granite, Mistral, Qwen3) with fast RMS
norms, fused or unfused QKV weights (Qwen3's per-head query and key norms, which its unfused QKV
module applies, included), plain RoPE on the fast path with explicit positions, a gated linear
unit (fused or not), no dropout, no sinks, and layers of one shape. ``unsupported_reason`` says
why another model is not covered; the runner then uses fms's forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from fms.modules.attention import FusedQKV, MultiHeadAttention, UnfusedQKV
from fms.modules.feedforward import GatedLinearUnit

from spyre_server.model.cpu.decoders.base import (
    Decoder,
    Layer,
    Project,
    StepShape,
    bound_forward,
    family_reason,
)
from spyre_server.model.cpu.ops.fast_norm import FastRMSNorm
from spyre_server.model.cpu.ops.fast_rope import FastRotaryEmbedding
from spyre_server.model.cpu.paged_attention import AttentionPlan, store_and_attend
from spyre_server.model.runner import KVCaches

ProjectQKV = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
"""A QKV module's forward on one input: the queries, keys and values."""


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``AtenDecoder`` cannot run ``model`` (a ``cpu_inference_copy``), or None when it can."""
    if (reason := family_reason(model)) is not None:
        return reason
    base = model.base_model
    for norm in [base.dec_norm, *(m for layer in base.layers for m in (layer.ln, layer.ff_ln))]:
        if not isinstance(norm, FastRMSNorm):
            return f"a norm is {type(norm).__name__}, not the fast RMS norm"
    for layer in base.layers:
        attn, ff = layer.attn, layer.ff_sub_layer
        if not isinstance(attn, MultiHeadAttention) or not isinstance(
            attn.in_proj, (FusedQKV, UnfusedQKV)
        ):
            return "an attention is not fms's with a fused or unfused QKV"
        if attn.has_sinks:
            return "an attention has sinks"
        if attn.apply_norm_per_head and not isinstance(attn.in_proj, UnfusedQKV):
            return "an attention has per-head norms on fused QKV weights"
        if attn.emb_kq_per_head != attn.emb_v_per_head:
            return "the keys and values differ in head size"
        rope = attn.position_encoder
        if (
            not isinstance(rope, FastRotaryEmbedding)
            or rope.rope_type == "yarn"
            or rope.partial_rope != 1.0
        ):
            return "the position encoding is not plain RoPE on the fast path"
        if not isinstance(ff, GatedLinearUnit):
            return "a feed-forward is not fms's gated linear unit"
    if len({StepShape.of_layer(layer) for layer in base.layers}) != 1:
        return "the layers differ in heads, sizes, scale or rotary embedding"
    return None


def qkv_forward(in_proj: torch.nn.Module) -> ProjectQKV:
    """A QKV module's forward on one input (self-attention), as its ops: a fused projection's
    bound forward split into the three, or the unfused module's own forward (its projections,
    and the per-head norms where it has them)."""
    if isinstance(in_proj, FusedQKV):
        fused, splits = in_proj.qkv_fused.forward, in_proj.splits

        def project_fused(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return fused(x).split(splits, dim=-1)

        return project_fused
    forward = in_proj.forward

    def project(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(forward(x, None, None))

    return project


class AtenDecoder(Decoder[Project, ProjectQKV, Project, Project]):
    """The step in aten ops: every part of a layer is its module's bound forward."""

    _unsupported_reason = staticmethod(unsupported_reason)

    @staticmethod
    def _layer(layer: torch.nn.Module) -> Layer[Project, ProjectQKV, Project, Project]:
        return Layer.of(layer, bound_forward, qkv_forward, bound_forward, bound_forward)

    def _residual_stream(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        slot_mapping: torch.Tensor,
        plan: AttentionPlan,
        kv_caches: KVCaches,
    ) -> torch.Tensor:
        batch, seq = input_ids.shape
        shape = self._shape
        heads, kvheads, head_dim = shape.nheads, shape.kvheads, shape.head_dim
        residual = self._scalars.residual
        x = self._embed(input_ids)
        cos, signed_sin = shape.rope._tables(x.device, position_ids)
        rotate = shape.rope._rotate
        for layer, (key_cache, value_cache) in zip(self._layers, kv_caches, strict=True):
            # x + attention(norm(x)), as the family's block and fms's MultiHeadAttention.
            q, k, v = layer.qkv(layer.attn_norm(x))
            queries = rotate(q.view(batch, seq, heads, head_dim), cos, signed_sin)
            keys = rotate(k.view(batch, seq, kvheads, head_dim), cos, signed_sin)
            values = v.view(batch, seq, kvheads, head_dim)
            attended = store_and_attend(
                queries,
                keys,
                values,
                key_cache,
                value_cache,
                slot_mapping,
                plan,
                shape.scale_factor,
                self._attention,
            )
            out = layer.dense(attended.view(batch, seq, heads * head_dim))
            if self._reduce is not None:
                out = self._reduce(out)
            x = (out if residual is None else out * residual) + x
            out = layer.feed_forward(layer.ff_norm(x))
            if self._reduce is not None:
                out = self._reduce(out)
            x = (out if residual is None else out * residual) + x
        return x
