"""The native bfloat16 decoder: a whole cpu step of an fms decoder in bfloat16, the projections
on their modules (oneDNN on CPUs with AMX or AVX512-BF16, where bfloat16 is the default dtype),
everything between them in one native call per gap.

``NativeBf16Decoder`` runs per layer: the QKV projection; one call that rotates the queries and
writes the rotated keys and the values into their cache slots (``rope_store_bf16``); the
attention; the dense projection; one call for the residual add and the next norm
(``add_rms_norm_bf16``); the gate/up projection; the SiLU-and-multiply; the down projection; and
again the add with the next layer's norm. Where the family scales a projection's output before
the add (Granite's residual multiplier), the scaling is fms's own tensor op on that output. The
kernels round where fms's ops round, so the logits and KV writes are the same bits as fms's
forward over the same modules (tested step by step).

It covers the models the native decoder does (``native.native_modules_reason``: fms's LLaMA,
Granite and Mistral with fused QKV and GLU weights), in bfloat16.
"""

from __future__ import annotations

import torch

from spyre_server.model.cpu.decoders.base import (
    Decoder,
    Glu,
    Layer,
    NormWeight,
    Project,
    SumAcrossRanks,
    bound_forward,
    fused_glu,
    fused_qkv,
)
from spyre_server.model.cpu.decoders.native import checked_slots, native_modules_reason
from spyre_server.model.cpu.kernels.library import NativeKernels
from spyre_server.model.cpu.ops.native_elementwise import NativeRMSNorm
from spyre_server.model.cpu.paged_attention import (
    AttentionPlan,
    PagedAttentionKernel,
    attend,
)
from spyre_server.model.runner import KVCaches


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


class NativeBf16Decoder(Decoder[NormWeight, Project, Project, Glu[Project]]):
    """The step in bfloat16: the projections are their modules' bound forwards, the norms what
    the native kernels take."""

    _unsupported_reason = staticmethod(unsupported_reason)

    def __init__(
        self,
        model: torch.nn.Module,
        attention: PagedAttentionKernel | None = None,
        reduce: SumAcrossRanks | None = None,
    ) -> None:
        super().__init__(model, attention, reduce)
        dec_norm: NativeRMSNorm = model.base_model.dec_norm
        self._kernels: NativeKernels = dec_norm.native_kernels

    @staticmethod
    def _layer(layer: torch.nn.Module) -> Layer[NormWeight, Project, Project, Glu[Project]]:
        return Layer.of(
            layer, NormWeight.of, fused_qkv(bound_forward), bound_forward, fused_glu(bound_forward)
        )

    def _residual_stream(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        slot_mapping: torch.Tensor,
        plan: AttentionPlan,
        kv_caches: KVCaches,
    ) -> torch.Tensor:
        batch, seq = input_ids.shape
        tokens = batch * seq
        k, shape = self._kernels, self._shape
        hidden_dim, mlp_dim = shape.hidden_dim, shape.mlp_dim
        heads, kvheads, head_dim = shape.nheads, shape.kvheads, shape.head_dim
        slots = checked_slots(slot_mapping, tokens, kv_caches, kvheads, head_dim, torch.bfloat16)
        residual = self._scalars.residual
        # The residual stream, updated in place (the embedding's output is a new tensor).
        x = self._embed(input_ids).reshape(tokens, hidden_dim)
        normed = torch.empty(tokens, hidden_dim, dtype=torch.bfloat16)
        queries = torch.empty(batch, seq, heads, head_dim, dtype=torch.bfloat16)
        activated = torch.empty(tokens, mlp_dim, dtype=torch.bfloat16)
        cos, signed_sin = shape.rope._tables(x.device, position_ids)
        x_ptr, normed_ptr, slots_ptr = x.data_ptr(), normed.data_ptr(), slots.data_ptr()
        cos_ptr, sin_ptr, queries_ptr = cos.data_ptr(), signed_sin.data_ptr(), queries.data_ptr()
        first = self._layers[0].attn_norm
        k.rms_norm_bf16(x_ptr, hidden_dim, first.weight, normed_ptr, tokens, hidden_dim, first.eps)
        for i, (layer, (key_cache, value_cache)) in enumerate(
            zip(self._layers, kv_caches, strict=True)
        ):
            # x + attention(norm(x)), as the family's block: QKV, RoPE, KV store, attention, dense.
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
            if self._reduce is not None:
                self._reduce(out)
            if residual is not None:
                out.mul_(residual)  # fms's ``out * residual + x``: rounded before the add
            ff_norm, glu = layer.ff_norm, layer.feed_forward
            k.add_rms_norm_bf16(
                x_ptr, out.data_ptr(), ff_norm.weight, normed_ptr, tokens, hidden_dim, ff_norm.eps
            )
            # x + GLU(norm(x)), then the next layer's norm.
            gate_up = glu.gate_up(normed)
            k.silu_mul_bf16(gate_up.data_ptr(), activated.data_ptr(), tokens, mlp_dim)
            out = glu.down(activated)
            if self._reduce is not None:
                self._reduce(out)
            if residual is not None:
                out.mul_(residual)
            if i + 1 < len(self._layers):
                after = self._layers[i + 1].attn_norm
                k.add_rms_norm_bf16(
                    x_ptr, out.data_ptr(), after.weight, normed_ptr, tokens, hidden_dim, after.eps
                )
            else:
                x += out
        return x.view(batch, seq, hidden_dim)
