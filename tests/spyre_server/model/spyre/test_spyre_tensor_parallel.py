"""Tensor parallelism on the spyre backend (``eager``, float32): 2 ranks give the tokens of one,
cache on or off, each rank compiling the one prefill and one decode graph the card runs, the
sums across ranks traced into them (no graph break, no compile after warm-up)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.spyre_server.model.parallel.checkpoints import build_tp_checkpoint, generate

pytestmark = pytest.mark.slow

SPYRE = {
    "model.backend": "spyre",
    "model.compile_backend": "eager",
    "cache.num_blocks": 40,
}


def test_two_ranks_give_the_tokens_of_one_in_the_same_graphs(
    tmp_path: Path, smollm2_path: Path
) -> None:
    path = build_tp_checkpoint("llama", tmp_path / "llama", smollm2_path)
    one = generate(path, 1, score_prompt=False, **SPYRE)
    two = generate(path, 2, score_prompt=False, **SPYRE)
    assert two.tokens == one.tokens
    assert two.cached == one.cached
    assert one.cached[2] > 0  # the cache was hit
    for got, want in zip(two.logprobs, one.logprobs, strict=True):
        assert max(abs(g - w) for g, w in zip(got, want, strict=True)) <= 1e-4
    assert one.graphs == two.graphs == {"prefill": 1, "decode": 1}
    assert one.graphs_after_warmup == two.graphs_after_warmup == 0
    uncached = generate(
        path, 2, score_prompt=False, **SPYRE, **{"cache.enable_prefix_caching": False}
    )
    assert uncached.cached == [0, 0, 0, 0]
    assert uncached.tokens == two.tokens
