"""A rank's shard: exactly its heads' rows of the QKV projection, its columns of the output
projections, its rows of the gate and up projections; biases of the partial sums on rank 0."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from spyre_server.model.loading import load_model
from spyre_server.model.parallel.shard import (
    shard_,
    shard_head_,
    tensor_parallel_reason,
    vocabulary_part,
)
from tests.conformance.checkpoints import ARCHITECTURES, build_checkpoint
from tests.spyre_server.model.parallel.checkpoints import build_tp_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    return build_tp_checkpoint("llama", tmp_path_factory.mktemp("llama"), smollm2_path)


def heads(weight: torch.Tensor, first: int, count: int, head_dim: int) -> torch.Tensor:
    return weight[first * head_dim : (first + count) * head_dim]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_keeps_exactly_its_heads_and_columns(llama: Path, fused: bool, rank: int) -> None:
    whole = load_model(llama, torch.float32, fused_weights=fused).model
    part = load_model(llama, torch.float32, fused_weights=fused).model
    shard_(part, rank, 2)
    for full_layer, layer in zip(whole.base_model.layers, part.base_model.layers, strict=True):
        attn, full = layer.attn, full_layer.attn
        d = full.emb_kq_per_head  # 64: 4 query heads, 2 key/value heads
        assert (attn.nheads, attn.kvheads) == (2, 1)
        if fused:
            q, k, v = full.in_proj.qkv_fused.weight.split(full.in_proj.splits)
            want = torch.cat([heads(q, 2 * rank, 2, d), heads(k, rank, 1, d), heads(v, rank, 1, d)])
            assert torch.equal(attn.in_proj.qkv_fused.weight, want)
            assert attn.in_proj.splits == [2 * d, d, d]
        else:
            assert torch.equal(
                attn.in_proj.query.weight, heads(full.in_proj.query.weight, 2 * rank, 2, d)
            )
            assert torch.equal(attn.in_proj.key.weight, heads(full.in_proj.key.weight, rank, 1, d))
            assert torch.equal(
                attn.in_proj.value.weight, heads(full.in_proj.value.weight, rank, 1, d)
            )
        columns = slice(rank * 2 * d, (rank + 1) * 2 * d)
        assert torch.equal(attn.dense.weight, full.dense.weight[:, columns])
        ff, full_ff = layer.ff_sub_layer, full_layer.ff_sub_layer
        rows = slice(rank * 256, (rank + 1) * 256)  # intermediate 512
        assert ff.hidden_dim == 256
        if fused:
            gate, up = full_ff.wg1_fused.weight.split(512)
            assert torch.equal(ff.wg1_fused.weight, torch.cat([gate[rows], up[rows]]))
        else:
            assert torch.equal(ff.wg.weight, full_ff.wg.weight[rows])
            assert torch.equal(ff.w1.weight, full_ff.w1.weight[rows])
        assert torch.equal(ff.w2.weight, full_ff.w2.weight[:, rows])
    # Whole on every rank: the embedding, the norms, the LM head (shard_head_ splits it).
    assert torch.equal(part.base_model.embedding.weight, whole.base_model.embedding.weight)
    assert torch.equal(part.head.weight, whole.head.weight)


def test_the_sum_of_the_shards_is_the_whole_projection(llama: Path) -> None:
    whole = load_model(llama, torch.float32).model
    parts = [load_model(llama, torch.float32).model for _ in range(2)]
    for rank, part in enumerate(parts):
        shard_(part, rank, 2)
    x = torch.randn(1, 5, 256, generator=torch.Generator().manual_seed(0))
    # The feed-forward of layer 0: each rank's partial result, summed, is the whole one's.
    want = whole.base_model.layers[0].ff_sub_layer(x)
    got = sum(p.base_model.layers[0].ff_sub_layer(x) for p in parts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_biases_of_partial_sums_stay_on_rank_0(tmp_path: Path, smollm2_path: Path) -> None:
    # gpt-bigcode has a bias on every projection; multi-head here (2 key/value heads).
    arch = ARCHITECTURES["gpt-bigcode"]
    arch = dataclasses.replace(arch, fields={**arch.fields, "multi_query": False})
    path = build_checkpoint(arch, tmp_path / "bigcode", smollm2_path)
    whole = load_model(path, torch.float32).model
    parts = [load_model(path, torch.float32).model for _ in range(2)]
    for rank, part in enumerate(parts):
        shard_(part, rank, 2)
    full, first, second = (m.base_model.layers[0] for m in (whole, *parts))
    d = full.attn.emb_kq_per_head  # 128: 2 heads of each kind, one per rank
    q, k, v = full.attn.in_proj.qkv_fused.bias.split(full.attn.in_proj.splits)
    for rank, layer in enumerate((first, second)):
        want = torch.cat(
            [
                q[rank * d : (rank + 1) * d],
                k[rank * d : (rank + 1) * d],
                v[rank * d : (rank + 1) * d],
            ]
        )
        assert torch.equal(layer.attn.in_proj.qkv_fused.bias, want)
    for module in ("dense", "w2"):
        owner = (
            (lambda layer: layer.attn.dense)
            if module == "dense"
            else (lambda layer: layer.ff_sub_layer.w2)
        )
        assert torch.equal(owner(first).bias, owner(full).bias)
        assert not owner(second).bias.any()
    x = torch.randn(1, 3, 256, generator=torch.Generator().manual_seed(0))
    got = first.ff_sub_layer(x) + second.ff_sub_layer(x)
    torch.testing.assert_close(got, full.ff_sub_layer(x), rtol=1e-5, atol=1e-5)


def test_multi_query_attention_is_not_split(tmp_path: Path, smollm2_path: Path) -> None:
    path = build_checkpoint(ARCHITECTURES["gpt-bigcode"], tmp_path / "bigcode", smollm2_path)
    model = load_model(path, torch.float32).model
    assert tensor_parallel_reason(model, 2) == (
        "2 query heads and 1 key/value heads do not divide by 2 ranks "
        "(model.tensor_parallel_size must divide both)"
    )
    with pytest.raises(ValueError, match="cannot split the model over 2 ranks"):
        shard_(model, 0, 2)


def test_a_mixture_of_experts_is_not_split(tmp_path: Path, smollm2_path: Path) -> None:
    path = build_checkpoint(ARCHITECTURES["mixtral-kv8"], tmp_path / "mixtral", smollm2_path)
    model = load_model(path, torch.float32).model
    reason = tensor_parallel_reason(model, 2)
    assert reason is not None and "mixture of experts" in reason


def test_the_lm_head_splits_by_vocabulary_the_embedding_stays_whole(llama: Path) -> None:
    assert [vocabulary_part(10, r, 4) for r in range(4)] == [
        slice(0, 3),
        slice(3, 6),
        slice(6, 9),
        slice(9, 10),
    ]
    assert vocabulary_part(49155, 1, 2) == slice(24578, 49155)
    whole = load_model(llama, torch.float32).model
    for rank in (0, 1):
        part = load_model(llama, torch.float32).model  # tied embeddings (SmolLM2's shape)
        assert part.head.weight is part.base_model.embedding.weight
        vocabulary = shard_head_(part, rank, 2)
        assert vocabulary == slice(rank * 24576, (rank + 1) * 24576)
        assert torch.equal(part.head.weight, whole.head.weight[vocabulary])
        assert part.head.out_features == 24576
        assert torch.equal(part.base_model.embedding.weight, whole.base_model.embedding.weight)
