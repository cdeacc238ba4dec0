"""The native decoder: a whole cpu step of an fms decoder in float32 on the native kernels.

``NativeDecoder`` runs the kernels of the native modules that
``cpu_inference_copy(linear_kernel="native")`` gives every linear, RMS norm, GLU and rotary
embedding, in the same order as fms's forward over those modules (the logits and KV writes are
the same bits), calling them directly into buffers it keeps. It folds each residual add into
the projection before it (``linear_add``); where the family scales the projection's output
first (Granite's residual multiplier) the projection writes a buffer, which is scaled and added
as fms's two ops do it.

It covers what the native kernels compute, in fms's LLaMA, Granite and Mistral (any sliding
window is the attention plan's): fused QKV and GLU weights, RMS norms with a scale only, plain
RoPE with explicit positions, SiLU, no biases, no dropout, no per-head norms or sinks, head_dim
64 or 128. ``unsupported_reason`` says why another model is not covered; the runner then uses
the native bfloat16 or the aten decoder (``prepare.cpu_decoder``) or fms's forward.
"""

from __future__ import annotations

import torch
from fms.modules.attention import FusedQKV

from spyre_server.model.cpu.decoders.aten import unsupported_reason as aten_unsupported_reason
from spyre_server.model.cpu.decoders.base import (
    Decoder,
    Glu,
    Layer,
    NormWeight,
    SumAcrossRanks,
    fused_glu,
    fused_qkv,
)
from spyre_server.model.cpu.kernels.library import NativeKernels
from spyre_server.model.cpu.ops.native_attention import (
    SUPPORTED_HEAD_DIMS,
    NativePagedAttention,
    check_caches,
)
from spyre_server.model.cpu.ops.native_elementwise import (
    NativeGatedLinearUnit,
    NativeRMSNorm,
    NativeRotaryEmbedding,
)
from spyre_server.model.cpu.ops.native_linear import NativeLinear
from spyre_server.model.cpu.paged_attention import AttentionPlan
from spyre_server.model.runner import KVCaches


def panels(linear: torch.nn.Module) -> int:
    """A native linear's weight as the kernels take it: its packed panels' data pointer."""
    return linear.panels.data_ptr()


def native_modules_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` (a ``cpu_inference_copy``) is not what the aten decoder runs with every RMS
    norm, rotary embedding and GLU on its native kernel, or None when it is."""
    if (reason := aten_unsupported_reason(model)) is not None:
        return reason
    base = model.base_model
    for norm in [base.dec_norm, *(m for layer in base.layers for m in (layer.ln, layer.ff_ln))]:
        if type(norm) is not NativeRMSNorm:
            return f"a norm is {type(norm).__name__}, not the native RMS norm"
        if norm.use_mean or norm.elementwise_shift or not norm.elementwise_scale:
            return "a norm is not a plain RMS norm with a scale"
    for layer in base.layers:
        attn, ff = layer.attn, layer.ff_sub_layer
        if not isinstance(attn.in_proj, FusedQKV) or attn.apply_norm_per_head:
            return "an attention's QKV is not one fused projection without per-head norms"
        if type(attn.position_encoder) is not NativeRotaryEmbedding:
            return "the position encoding is not plain RoPE on the native kernel"
        if (
            type(ff) is not NativeGatedLinearUnit
            or not ff.fused
            or not isinstance(ff.a, torch.nn.SiLU)
        ):
            return "a feed-forward is not a fused SiLU GLU on the native kernel"
    return None


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``NativeDecoder`` cannot run ``model`` (a ``cpu_inference_copy`` with native
    kernels), or None when it can: native modules, native projections, and head sizes the
    native attention computes."""
    if (reason := native_modules_reason(model)) is not None:
        return reason
    for layer in model.base_model.layers:
        attn, ff = layer.attn, layer.ff_sub_layer
        if attn.emb_v_per_head not in SUPPORTED_HEAD_DIMS:
            return f"head_dim {attn.emb_v_per_head} (the native attention computes 64 and 128)"
        linears = (attn.in_proj.qkv_fused, attn.dense, ff.wg1_fused, ff.w2)
        if any(type(m) is not NativeLinear or m.bias is not None for m in linears):
            return "a projection is not a native linear without bias"
    return None


class NativeDecoder(Decoder[NormWeight, int, int, Glu[int]]):
    """The step in float32 on the native kernels, with the native paged attention (required):
    a layer's weights are bound as the data pointers the kernels take."""

    _attention: NativePagedAttention
    _unsupported_reason = staticmethod(unsupported_reason)

    def __init__(
        self,
        model: torch.nn.Module,
        attention: NativePagedAttention,
        reduce: SumAcrossRanks | None = None,
    ) -> None:
        super().__init__(model, attention, reduce)
        self._kernels: NativeKernels = model.base_model.dec_norm.native_kernels
        self._buffers: tuple[torch.Tensor, ...] = ()

    @staticmethod
    def _layer(layer: torch.nn.Module) -> Layer[NormWeight, int, int, Glu[int]]:
        return Layer.of(layer, NormWeight.of, fused_qkv(panels), panels, fused_glu(panels))

    def _workspace(self, num_tokens: int) -> tuple[torch.Tensor, ...]:
        """A step's buffers for ``num_tokens`` rows: views of buffers grown to the largest step
        so far and kept (a fresh multi-MB tensor costs its page faults on every step)."""
        if not self._buffers or self._buffers[0].shape[0] < num_tokens:
            s = self._shape
            qkv_width = (s.nheads + 2 * s.kvheads) * s.head_dim
            self._buffers = (
                torch.empty(num_tokens, s.hidden_dim),  # a norm's output
                torch.empty(num_tokens, qkv_width),
                torch.empty(num_tokens, s.nheads, s.head_dim),  # rotated queries
                torch.empty(num_tokens, s.kvheads, s.head_dim),  # rotated keys
                torch.empty(num_tokens, s.nheads * s.head_dim),  # attention output
                torch.empty(num_tokens, 2 * s.mlp_dim),
                torch.empty(num_tokens, s.mlp_dim),
            )
        return tuple(buffer[:num_tokens] for buffer in self._buffers)

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
        k = self._kernels
        shape = self._shape
        hidden_dim, mlp_dim = shape.hidden_dim, shape.mlp_dim
        heads, kvheads, head_dim = shape.nheads, shape.kvheads, shape.head_dim
        x = self._embed(input_ids).reshape(tokens, hidden_dim)
        normed, qkv, queries, keys, attended, gate_up, activated = self._workspace(tokens)
        cos, signed_sin = shape.rope._tables(x.device, position_ids)
        qkv_width = qkv.shape[1]
        kv_width = kvheads * head_dim
        slots = checked_slots(slot_mapping, tokens, kv_caches, kvheads, head_dim)
        q_view = queries.view(batch, seq, heads, head_dim)
        out_view = attended.view(batch, seq, heads, head_dim)
        x_ptr, normed_ptr, qkv_ptr = x.data_ptr(), normed.data_ptr(), qkv.data_ptr()
        keys_in_qkv = qkv_ptr + heads * head_dim * 4  # float32
        values_in_qkv = keys_in_qkv + kv_width * 4
        slots_ptr = slots.data_ptr()
        cos_ptr, sin_ptr = cos.data_ptr(), signed_sin.data_ptr()
        queries_ptr, keys_ptr, attended_ptr = (
            queries.data_ptr(),
            keys.data_ptr(),
            attended.data_ptr(),
        )
        gate_up_ptr, activated_ptr = gate_up.data_ptr(), activated.data_ptr()
        residual = self._scalars.residual
        reduce = self._reduce

        def add_projection(a: int, weight: int, width: int) -> None:
            """x += the projection of ``a`` (``width`` floats a row), as the family adds it."""
            if residual is None and reduce is None:
                k.linear_add(a, weight, x_ptr, tokens, width, hidden_dim)
                return
            # The projection into the norm's buffer (free once the projection before has read
            # it), summed across the ranks, then fms's ``out * residual + x``: two roundings.
            k.linear(a, weight, normed_ptr, tokens, width, hidden_dim)
            if reduce is not None:
                reduce(normed)
            x.add_(normed if residual is None else normed.mul_(residual))

        for layer, (key_cache, value_cache) in zip(self._layers, kv_caches, strict=True):
            attn_norm, ff_norm, glu = layer.attn_norm, layer.ff_norm, layer.feed_forward
            # x + attention(norm(x)), as the family's block: QKV, RoPE, KV store, attention, dense.
            k.rms_norm(
                x_ptr, hidden_dim, attn_norm.weight, normed_ptr, tokens, hidden_dim, attn_norm.eps
            )
            k.linear(normed_ptr, layer.qkv, qkv_ptr, tokens, hidden_dim, qkv_width)
            k.rope(qkv_ptr, qkv_width, cos_ptr, sin_ptr, queries_ptr, tokens, heads, head_dim)
            k.rope(keys_in_qkv, qkv_width, cos_ptr, sin_ptr, keys_ptr, tokens, kvheads, head_dim)
            k.scatter_rows(keys_ptr, kv_width, slots_ptr, key_cache.data_ptr(), tokens, kv_width)
            k.scatter_rows(
                values_in_qkv, qkv_width, slots_ptr, value_cache.data_ptr(), tokens, kv_width
            )
            self._attention(q_view, key_cache, value_cache, plan, shape.scale, out=out_view)
            add_projection(attended_ptr, layer.dense, heads * head_dim)
            # x + GLU(norm(x)).
            k.rms_norm(
                x_ptr, hidden_dim, ff_norm.weight, normed_ptr, tokens, hidden_dim, ff_norm.eps
            )
            k.linear(normed_ptr, glu.gate_up, gate_up_ptr, tokens, hidden_dim, 2 * mlp_dim)
            k.silu_mul(gate_up_ptr, activated_ptr, tokens, mlp_dim)
            add_projection(activated_ptr, glu.down, mlp_dim)
        return x.view(batch, seq, hidden_dim)


def checked_slots(
    slot_mapping: torch.Tensor,
    tokens: int,
    kv_caches: KVCaches,
    kvheads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The step's KV slots as the scatter kernel reads them (contiguous int64), checked against
    the caches it writes into: every layer's caches as ``check_caches`` wants them, of the first
    layer's shape with ``kvheads`` heads, every slot inside them."""
    first = kv_caches[0][0]
    for key_cache, value_cache in kv_caches:
        check_caches(key_cache, value_cache, head_dim, dtype)
        if key_cache.shape != first.shape or first.shape[-2] != kvheads:
            raise ValueError(f"the KV caches must be of one shape with {kvheads} heads")
    num_slots = first.numel() // (kvheads * head_dim)
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.shape != (tokens,) or (
        tokens and not 0 <= int(slots.min()) <= int(slots.max()) < num_slots
    ):
        raise ValueError(f"slot_mapping must hold {tokens} slots in 0..{num_slots - 1}")
    return slots
