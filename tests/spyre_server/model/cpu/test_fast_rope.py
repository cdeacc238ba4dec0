"""The cpu backend's rotary embedding against fms's own (the oracle): the same bits."""

from __future__ import annotations

import copy

import pytest
import torch
from fms.modules.positions import RotaryEmbedding

from spyre_server.model.cpu.ops.fast_rope import FastRotaryEmbedding, use_fast_rope


def pair() -> tuple[RotaryEmbedding, RotaryEmbedding]:
    fms_rope = RotaryEmbedding(dim=64, ratio=100000.0, max_seq_len=4096)
    fast = copy.deepcopy(fms_rope)
    fast.__class__ = FastRotaryEmbedding
    return fms_rope, fast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("batch", "starts", "length"),
    [(1, [0], 256), (1, [1344], 64), (3, [5, 700, 2100], 1), (2, [0, 64], 17)],
)
def test_the_same_bits_as_fms(
    batch: int, starts: list[int], length: int, dtype: torch.dtype
) -> None:
    fms_rope, fast = pair()
    generator = torch.Generator().manual_seed(length)
    q = torch.randn(batch, length, 9, 64, generator=generator).to(dtype)
    k = torch.randn(batch, length, 3, 64, generator=generator).to(dtype)
    positions = torch.stack([torch.arange(s, s + length) for s in starts])
    want_q, want_k = fms_rope.adjusted_qk(q, k, positions)
    got_q, got_k = fast.adjusted_qk(q, k, positions)
    assert got_q.dtype == dtype and got_k.dtype == dtype
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_each_forward_gets_its_own_positions() -> None:
    """The entries are reused for the layers of one forward (the same position tensor), never
    for another forward's positions."""
    fms_rope, fast = pair()
    q, k = torch.randn(1, 4, 9, 64), torch.randn(1, 4, 3, 64)
    first = torch.arange(10, 14).unsqueeze(0)
    assert torch.equal(fast.adjusted_qk(q, k, first)[0], fms_rope.adjusted_qk(q, k, first)[0])
    assert torch.equal(fast.adjusted_qk(q, k, first)[0], fms_rope.adjusted_qk(q, k, first)[0])
    second = torch.arange(500, 504).unsqueeze(0)  # same shape, other positions
    assert torch.equal(fast.adjusted_qk(q, k, second)[0], fms_rope.adjusted_qk(q, k, second)[0])


def test_without_position_ids_it_is_fms() -> None:
    fms_rope, fast = pair()
    q, k = torch.randn(2, 5, 9, 64), torch.randn(2, 5, 3, 64)
    for got, want in zip(fast.adjusted_qk(q, k), fms_rope.adjusted_qk(q, k), strict=True):
        assert torch.equal(got, want)


def test_use_fast_rope_switches_the_shared_instance(tiny_llama_factory: object) -> None:
    model = tiny_llama_factory()  # type: ignore[operator]
    assert use_fast_rope(model) == 1
    encoders = {id(layer.attn.position_encoder) for layer in model.base_model.layers}
    assert len(encoders) == 1
    assert type(model.base_model.layers[0].attn.position_encoder) is FastRotaryEmbedding
    assert use_fast_rope(model) == 0
