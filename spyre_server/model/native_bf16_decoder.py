"""A whole cpu step of an fms LLaMA in bfloat16: the projections on their modules (oneDNN on
CPUs with AMX or AVX512-BF16, where bfloat16 is the default dtype), everything between them in
one native call per gap.

Between a layer's four projections the aten decoder still runs ~20 tensor ops and 5 native
calls per layer (a norm, a split, two rotations, two KV copies, the attention, two residual
adds, the GLU's activation), each a few microseconds of dispatch on SmolLM2's small rows.
``NativeBf16Decoder`` runs per layer: the QKV projection; one call that rotates the queries and
writes the rotated keys and the values into their cache slots (``rope_store_bf16``); the
attention; the dense projection; one call for the residual add and the next norm
(``add_rms_norm_bf16``); the gate/up projection; the SiLU-and-multiply; the down projection; and
again the add with the next layer's norm. The kernels round where fms's ops round, so the logits
and KV writes are the same bits as fms's forward over the same modules (tested step by step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spyre_server.model.aten_decoder import Project, StepShape
from spyre_server.model.native_decoder import checked_slots, native_modules_reason
from spyre_server.model.native_elementwise import NativeRMSNorm
from spyre_server.model.native_kernels import NativeKernels
from spyre_server.model.paged_attention import (
    AttentionPlan,
    PagedAttentionKernel,
    attend,
)
from spyre_server.model.runner import KVCaches


@dataclass(frozen=True, slots=True)
class _Layer:
    """A decoder layer as the step calls it: the projections' bound forwards, the norms' weight
    pointers and epsilons."""

    attn_norm: int
    attn_eps: float
    qkv: Project
    dense: Project
    ff_norm: int
    ff_eps: float
    gate_up: Project
    down: Project

    @classmethod
    def of(cls, layer: torch.nn.Module) -> _Layer:
        ff = layer.ff_sub_layer
        return cls(
            layer.ln.weight.data_ptr(),
            layer.ln.eps,
            layer.attn.in_proj.qkv_fused.forward,
            layer.attn.dense.forward,
            layer.ff_ln.weight.data_ptr(),
            layer.ff_ln.eps,
            ff.wg1_fused.forward,
            ff.w2.forward,
        )


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``NativeBf16Decoder`` cannot run ``model`` (a ``cpu_inference_copy``), or None when it
    can: the native modules in bfloat16, with norms as fms computes them in bfloat16."""
    if (reason := native_modules_reason(model)) is not None:
        return reason
    base = model.base_model
    if base.embedding.weight.dtype != torch.bfloat16:
        return f"the model is in {base.embedding.weight.dtype}, not bfloat16"
    for norm in [base.dec_norm, *(m for layer in base.layers for m in (layer.ln, layer.ff_ln))]:
        if norm.weight.dtype != torch.bfloat16 or not norm.use_high_precision_pow:
            return "a norm is not a bfloat16 RMS norm with a float32 pow"
    if base.layers[0].attn.emb_v_per_head % 8:
        return "the head size is not a multiple of 8"
    return None


class NativeBf16Decoder:
    """``decoder(input_ids, position_ids, slot_mapping, plan, kv_caches, last_n_tokens)``: the
    logits of the last ``last_n_tokens`` positions of each row, as the model's forward with
    ``paged_attention_kwargs(slot_mapping, plan, attention)`` and ``use_cache=True`` computes
    them, writing the same KV; None for ``last_n_tokens`` 0 (the KV only: a chunk that samples
    nothing, whose LM head would be wasted)."""

    def __init__(
        self, model: torch.nn.Module, attention: PagedAttentionKernel | None = None
    ) -> None:
        if (reason := unsupported_reason(model)) is not None:
            raise ValueError(f"NativeBf16Decoder cannot run this model: {reason}")
        base = model.base_model
        self._model = model
        self._attention = attention
        self._shape = StepShape.of(model)
        self._layers = [_Layer.of(layer) for layer in base.layers]
        dec_norm: NativeRMSNorm = base.dec_norm
        self._kernels: NativeKernels = dec_norm.native_kernels

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
        tokens = batch * seq
        k, shape = self._kernels, self._shape
        hidden_dim, mlp_dim = shape.hidden_dim, shape.mlp_dim
        heads, kvheads, head_dim = shape.nheads, shape.kvheads, shape.head_dim
        slots = checked_slots(slot_mapping, tokens, kv_caches, kvheads, head_dim, torch.bfloat16)
        # The residual stream, updated in place (the embedding's output is a new tensor).
        x = self._model.base_model.embedding(input_ids).reshape(tokens, hidden_dim)
        normed = torch.empty(tokens, hidden_dim, dtype=torch.bfloat16)
        queries = torch.empty(batch, seq, heads, head_dim, dtype=torch.bfloat16)
        activated = torch.empty(tokens, mlp_dim, dtype=torch.bfloat16)
        cos, signed_sin = shape.rope._tables(x.device, position_ids)
        x_ptr, normed_ptr, slots_ptr = x.data_ptr(), normed.data_ptr(), slots.data_ptr()
        cos_ptr, sin_ptr, queries_ptr = cos.data_ptr(), signed_sin.data_ptr(), queries.data_ptr()
        first = self._layers[0]
        k.rms_norm_bf16(
            x_ptr, hidden_dim, first.attn_norm, normed_ptr, tokens, hidden_dim, first.attn_eps
        )
        for i, (layer, (key_cache, value_cache)) in enumerate(
            zip(self._layers, kv_caches, strict=True)
        ):
            # x + attention(norm(x)), as fms's LLaMABlock: QKV, RoPE, KV store, attention, dense.
            qkv = layer.qkv(normed)
            k.rope_store_bf16(
                qkv.data_ptr(),
                qkv.shape[1],
                cos_ptr,
                sin_ptr,
                queries_ptr,
                key_cache.data_ptr(),
                value_cache.data_ptr(),
                slots_ptr,
                tokens,
                heads,
                kvheads,
                head_dim,
            )
            attended = attend(
                queries, key_cache, value_cache, plan, shape.scale_factor, self._attention
            )
            out = layer.dense(attended.view(tokens, heads * head_dim))
            k.add_rms_norm_bf16(
                x_ptr, out.data_ptr(), layer.ff_norm, normed_ptr, tokens, hidden_dim, layer.ff_eps
            )
            # x + GLU(norm(x)), then the next layer's norm.
            gate_up = layer.gate_up(normed)
            k.silu_mul_bf16(gate_up.data_ptr(), activated.data_ptr(), tokens, mlp_dim)
            out = layer.down(activated)
            if i + 1 < len(self._layers):
                after = self._layers[i + 1]
                k.add_rms_norm_bf16(
                    x_ptr, out.data_ptr(), after.attn_norm, normed_ptr, tokens, hidden_dim,
                    after.attn_eps,
                )  # fmt: skip
            else:
                x += out
        if last_n_tokens == 0:
            return None
        last = x.view(batch, seq, hidden_dim)[:, seq - last_n_tokens :]
        return self._model.head(self._model.base_model.dec_norm(last))
