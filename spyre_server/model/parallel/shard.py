"""A rank's shard of a loaded fms decoder (Megatron-style tensor parallelism, as fms's TP modules
split a model: ``fms/modules/attention.py`` ``TPMultiHeadAttention``, ``fms/modules/
feedforward.py`` ``TPGatedLinearUnit``).

Rank ``r`` of ``n`` keeps, in every layer:
- the query heads ``[r*H/n, (r+1)*H/n)`` and the key/value heads ``[r*K/n, (r+1)*K/n)`` of the
  QKV projection (fused or not; per-head query/key norms act on one head and stay whole), and
  the matching input columns of the attention's output projection (``dense``);
- the rows ``[r*I/n, (r+1)*I/n)`` of the feed-forward's gate and up projections and the matching
  input columns of its down projection (``w2``).
The output projections then give partial sums: the model computes only once they are summed
across the ranks (``group.RankGroup.sum_``), so their biases stay on rank 0 alone. The token
embedding and the norms stay whole on every rank (fms's TP modules split the embedding by its
width and gather it; a lookup is cheap, so we do not). ``shard_head_`` splits the LM head by
the vocabulary, as fms's TP head does (cpu backend: each rank writes its columns of the logits
into the shared buffer, which is the gather).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from fms.modules.attention import FusedQKV, MultiHeadAttention, UnfusedQKV
from fms.modules.feedforward import FeedForwardBlock, GatedLinearUnit

Module = torch.nn.Module


def _layers(model: Module) -> list[Module]:
    base = getattr(model, "base_model", None)
    layers = getattr(base, "layers", None)
    return list(layers) if layers is not None else []


def tensor_parallel_reason(model: Module, size: int) -> str | None:
    """Why ``model`` cannot be split over ``size`` ranks, or None when it can."""
    if size == 1:
        return None
    layers = _layers(model)
    if not layers:
        return f"{type(model).__name__} has no decoder layers (base_model.layers) to split"
    for layer in layers:
        attn = getattr(layer, "attn", None)
        ff = getattr(layer, "ff_sub_layer", None)
        if not isinstance(attn, MultiHeadAttention) or not isinstance(
            attn.in_proj, (FusedQKV, UnfusedQKV)
        ):
            return "an attention is not fms's multi-head attention with a QKV projection"
        if attn.nheads % size or attn.kvheads % size:
            return (
                f"{attn.nheads} query heads and {attn.kvheads} key/value heads do not divide by "
                f"{size} ranks (model.tensor_parallel_size must divide both)"
            )
        if attn.has_sinks:
            return "attention sinks are not split across ranks"
        if not isinstance(ff, (GatedLinearUnit, FeedForwardBlock)):
            return (
                f"the feed-forward {type(ff).__name__} (a mixture of experts) is not split across "
                "ranks"
            )
        if ff.hidden_dim % size:
            return f"the feed-forward width {ff.hidden_dim} does not divide by {size} ranks"
    return None


def shard_(model: Module, rank: int, size: int) -> None:
    """Keep ``model``'s layers' share for ``rank`` of ``size`` ranks (the module docstring says
    which), in place: the weights become new tensors of the shard's size (the full ones are
    freed once nothing else holds them). ValueError when the model cannot be split
    (``tensor_parallel_reason``)."""
    if (reason := tensor_parallel_reason(model, size)) is not None:
        raise ValueError(f"cannot split the model over {size} ranks: {reason}")
    if size == 1:
        return
    for layer in _layers(model):
        _shard_attention(layer.attn, rank, size)
        _shard_feed_forward(layer.ff_sub_layer, rank, size)


def vocabulary_part(vocab_size: int, rank: int, size: int) -> slice:
    """The logits (LM head rows) of ``rank``: ``ceil(V / size)`` each, the last rank the rest."""
    width = -(-vocab_size // size)
    return slice(min(rank * width, vocab_size), min((rank + 1) * width, vocab_size))


def shard_head_(model: Module, rank: int, size: int) -> slice:
    """Keep the LM head's rows of ``vocabulary_part`` for ``rank`` (a new weight: tied
    embeddings stay whole); returns that part of the vocabulary."""
    head = model.head
    part = vocabulary_part(head.out_features, rank, size)
    _set_rows(head, [part])
    return part


def _part(n: int, rank: int, size: int) -> slice:
    width = n // size
    return slice(rank * width, (rank + 1) * width)


def _set_rows(linear: Module, rows: list[slice]) -> None:
    """Keep ``rows`` (output features) of ``linear``, concatenated in order."""
    weight = torch.cat([linear.weight.data[r] for r in rows]).contiguous()
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        bias = torch.cat([linear.bias.data[r] for r in rows]).contiguous()
        linear.bias = torch.nn.Parameter(bias, requires_grad=False)
    linear.out_features = weight.shape[0]


def _set_columns(linear: Module, columns: slice, rank: int) -> None:
    """Keep the input features ``columns`` of ``linear``: its output becomes a partial sum, so
    its bias stays on rank 0 only (zero elsewhere)."""
    weight = linear.weight.data[:, columns].contiguous()
    linear.weight = torch.nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None and rank != 0:
        linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias.data), requires_grad=False)
    linear.in_features = weight.shape[1]


def _shard_attention(attn: MultiHeadAttention, rank: int, size: int) -> None:
    kq, v = attn.emb_kq_per_head, attn.emb_v_per_head
    heads, kvheads = attn.nheads, attn.kvheads
    query_rows = _part(heads * kq, rank, size)
    key_rows = _part(kvheads * kq, rank, size)
    value_rows = _part(kvheads * v, rank, size)
    in_proj = attn.in_proj
    if isinstance(in_proj, FusedQKV):
        q_width, k_width = heads * kq, kvheads * kq
        _set_rows(
            in_proj.qkv_fused,
            [
                query_rows,
                slice(q_width + key_rows.start, q_width + key_rows.stop),
                slice(q_width + k_width + value_rows.start, q_width + k_width + value_rows.stop),
            ],
        )
    else:
        _set_rows(in_proj.query, [query_rows])
        _set_rows(in_proj.key, [key_rows])
        _set_rows(in_proj.value, [value_rows])
    local_heads, local_kvheads = heads // size, kvheads // size
    for module in (attn, in_proj):
        module.nheads = local_heads
        module.kvheads = local_kvheads
    if isinstance(in_proj, FusedQKV):
        in_proj.splits = [local_heads * kq, local_kvheads * kq, local_kvheads * v]
    _set_columns(attn.dense, _part(heads * v, rank, size), rank)


def _shard_feed_forward(ff: Module, rank: int, size: int) -> None:
    hidden = ff.hidden_dim
    rows = _part(hidden, rank, size)
    if isinstance(ff, GatedLinearUnit) and ff.fused:
        _set_rows(ff.wg1_fused, [rows, slice(hidden + rows.start, hidden + rows.stop)])
    elif isinstance(ff, GatedLinearUnit):
        _set_rows(ff.wg, [rows])
        _set_rows(ff.w1, [rows])
    else:
        _set_rows(ff.w1, [rows])
    _set_columns(ff.w2, rows, rank)
    ff.hidden_dim = hidden // size


def sum_partial_outputs(model: Module, reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Make the forward of a shard (fms's forward, through the modules' ``__call__``) sum each
    layer's attention output projection and feed-forward down projection across the ranks, as
    fms's TP modules do: ``reduce`` (``group.RankGroup``) replaces each one's output."""
    for layer in _layers(model):
        for module in (layer.attn.dense, layer.ff_sub_layer.w2):
            module.register_forward_hook(lambda _module, _inputs, output: reduce(output))
