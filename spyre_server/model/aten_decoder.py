"""A whole cpu step of an fms LLaMA in aten ops, without fms's module machinery.

Where the native decoder does not run (bfloat16, the default on CPUs with AMX or AVX512-BF16;
``model.attention_kernel: flash``; oneDNN or aten projections), the cpu runner's steps used to
run through fms's forward: ~300 module calls, keyword dispatch to the attention op, and ~2,000
view, reshape and transpose objects per step on SmolLM2's 30 layers. ``AtenDecoder`` runs the
same tensor ops in the same order as that forward over the ``cpu_inference_copy`` modules (the
fast or native RMS norm and rotary embedding, the projections whatever their kernel, the
feed-forward module, our paged-attention store and compute), so the logits and KV writes are
the same bits, with the glue between them cut to the few views the ops need.

It covers fms's LLaMA with fused QKV weights, fast RMS norms, plain RoPE on the fast path with
explicit positions, a gated linear unit, no dropout, no per-head norms or sinks, and layers of
one shape. ``unsupported_reason`` says why another model is not covered; the runner then uses
fms's forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from fms.models.llama import LLaMA
from fms.modules.attention import FusedQKV, MultiHeadAttention
from fms.modules.feedforward import GatedLinearUnit

from spyre_server.model.fast_norm import FastRMSNorm
from spyre_server.model.fast_rope import FastRotaryEmbedding
from spyre_server.model.paged_attention import (
    AttentionPlan,
    PagedAttentionKernel,
    store_and_attend,
)
from spyre_server.model.runner import KVCaches

Project = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class _Layer:
    """A decoder layer's parts as the step calls them: bound forwards (no module hooks)."""

    attn_norm: Project
    qkv: Project
    dense: Project
    ff_norm: Project
    feed_forward: Project

    @classmethod
    def of(cls, layer: torch.nn.Module) -> _Layer:
        return cls(
            layer.ln.forward,
            layer.attn.in_proj.qkv_fused.forward,
            layer.attn.dense.forward,
            layer.ff_ln.forward,
            layer.ff_sub_layer.forward,
        )


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``AtenDecoder`` cannot run ``model`` (a ``cpu_inference_copy``), or None when it can."""
    if not isinstance(model, LLaMA):
        return f"{type(model).__name__} is not fms's LLaMA"
    if model.config.p_dropout:
        return "the model has dropout"
    base = model.base_model
    for norm in [base.dec_norm, *(m for layer in base.layers for m in (layer.ln, layer.ff_ln))]:
        if not isinstance(norm, FastRMSNorm):
            return f"a norm is {type(norm).__name__}, not the fast RMS norm"
    for layer in base.layers:
        attn, ff = layer.attn, layer.ff_sub_layer
        if not isinstance(attn, MultiHeadAttention) or not isinstance(attn.in_proj, FusedQKV):
            return "an attention is not fms's with fused QKV weights"
        if attn.apply_norm_per_head or attn.has_sinks:
            return "an attention has per-head norms or sinks"
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


@dataclass(frozen=True, slots=True)
class StepShape:
    """The sizes a decoder step takes from a layer (the decoders run models whose layers all have
    one shape, which ``unsupported_reason`` checks; the rotary embedding compares by identity)."""

    nheads: int
    kvheads: int
    head_dim: int
    hidden_dim: int
    mlp_dim: int
    scale_factor: float | None
    """As fms's attention holds it (None: ``1 / sqrt(head_dim)``)."""
    qkv_splits: tuple[int, ...]
    rope: FastRotaryEmbedding

    @classmethod
    def of_layer(cls, layer: torch.nn.Module) -> StepShape:
        attn = layer.attn
        return cls(
            attn.nheads,
            attn.kvheads,
            attn.emb_kq_per_head,
            attn.emb_dim,
            layer.ff_sub_layer.hidden_dim,
            attn.scale_factor,
            tuple(attn.in_proj.splits),
            attn.position_encoder,
        )

    @classmethod
    def of(cls, model: torch.nn.Module) -> StepShape:
        return cls.of_layer(model.base_model.layers[0])

    @property
    def scale(self) -> float:
        """The attention's scale as the paged-attention op hands it to a kernel."""
        return self.scale_factor if self.scale_factor is not None else 1 / math.sqrt(self.head_dim)


class AtenDecoder:
    """``decoder(input_ids, position_ids, slot_mapping, plan, kv_caches, last_n_tokens)``: the
    logits of the last ``last_n_tokens`` positions of each row, as the model's forward with
    ``paged_attention_kwargs(slot_mapping, plan, attention)`` and ``use_cache=True`` computes
    them, writing the same KV; None for ``last_n_tokens`` 0 (the KV only: a chunk that samples
    nothing, whose LM head would be wasted)."""

    def __init__(
        self, model: torch.nn.Module, attention: PagedAttentionKernel | None = None
    ) -> None:
        if (reason := unsupported_reason(model)) is not None:
            raise ValueError(f"AtenDecoder cannot run this model: {reason}")
        assert isinstance(model, LLaMA)
        base = model.base_model
        self._model = model
        self._attention = attention
        self._shape = StepShape.of(model)
        self._layers = [_Layer.of(layer) for layer in base.layers]

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        slot_mapping: torch.Tensor,
        plan: AttentionPlan,
        kv_caches: KVCaches,
        last_n_tokens: int,
    ) -> torch.Tensor | None:
        batch, seq = input_ids.shape
        shape = self._shape
        heads, kvheads, head_dim = shape.nheads, shape.kvheads, shape.head_dim
        x = self._model.base_model.embedding(input_ids)
        cos, signed_sin = shape.rope._tables(x.device, position_ids)
        rotate = shape.rope._rotate
        for layer, (key_cache, value_cache) in zip(self._layers, kv_caches, strict=True):
            # x + attention(norm(x)), as fms's LLaMABlock and MultiHeadAttention.
            q, k, v = layer.qkv(layer.attn_norm(x)).split(shape.qkv_splits, dim=-1)
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
            x = layer.dense(attended.view(batch, seq, heads * head_dim)) + x
            x = layer.feed_forward(layer.ff_norm(x)) + x
        if last_n_tokens == 0:
            return None
        last = x[:, seq - last_n_tokens :]
        return self._model.head(self._model.base_model.dec_norm(last))
