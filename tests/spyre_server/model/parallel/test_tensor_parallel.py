"""Tensor parallelism on the cpu backend: 2 ranks give the tokens of one, cache on or off, and
start-up refuses what cannot be split. Every run is float32 and greedy."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from spyre_server.config import load_config
from spyre_server.engine.factory import check_tensor_parallel
from spyre_server.entrypoints.llm import LLM
from spyre_server.model.errors import ModelLoadError
from spyre_server.model.parallel.placement import usable_cores
from tests.conformance.checkpoints import ARCHITECTURES, build_checkpoint
from tests.spyre_server.model.parallel.checkpoints import Run, build_tp_checkpoint, generate

pytestmark = pytest.mark.slow

LOGPROB_TOLERANCE = 1e-4
"""Between 1 and 2 ranks: the output projections' sums are added in another order (float32)."""


@pytest.fixture(scope="module")
def checkpoint(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path
) -> Iterator[Callable[[str], Path]]:
    root = tmp_path_factory.mktemp("tp-checkpoints")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_tp_checkpoint(name, root / name, smollm2_path)
        return built[name]

    yield get


@pytest.fixture(scope="module")
def run(checkpoint: Callable[[str], Path]) -> Callable[..., Run]:
    memo: dict[tuple[str, int, bool], Run] = {}

    def get(name: str, size: int, *, caching: bool = True) -> Run:
        key = (name, size, caching)
        if key not in memo:
            memo[key] = generate(checkpoint(name), size, **{"cache.enable_prefix_caching": caching})
        return memo[key]

    return get


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    worst = max((abs(g - w) for g, w in zip(got, want, strict=True)), default=0.0)
    assert worst <= LOGPROB_TOLERANCE, worst


@pytest.mark.parametrize("name", ["llama", "granite", "qwen3"])
def test_two_ranks_give_the_tokens_of_one(run: Callable[..., Run], name: str) -> None:
    one, two = run(name, 1), run(name, 2)
    assert two.tokens == one.tokens
    assert two.cached == one.cached
    assert one.cached[2] == 256 and one.cached[3] == 256  # the cache was hit (chunk 128)
    for got, want in zip(two.logprobs, one.logprobs, strict=True):
        assert_close(got, want)
    assert two.prompt_logprobs is not None and one.prompt_logprobs is not None
    assert_close(two.prompt_logprobs, one.prompt_logprobs)  # every position's logits
    assert all(math.isfinite(lp) for lp in two.prompt_logprobs)


def test_cache_on_gives_the_bits_of_cache_off_at_two_ranks(run: Callable[..., Run]) -> None:
    on, off = run("llama", 2), run("llama", 2, caching=False)
    assert off.cached == [0, 0, 0, 0]
    assert on.tokens == off.tokens
    assert on.logprobs == off.logprobs  # each rank's rows are row-invariant; the sum is too


def test_start_refuses_heads_that_do_not_divide(tmp_path: Path, smollm2_path: Path) -> None:
    path = build_checkpoint(ARCHITECTURES["llama3"], tmp_path / "llama3", smollm2_path)  # 2:1
    config = load_config(
        environ={},
        overrides={
            "model.path": str(path),
            "model.dtype": "float32",
            "model.tensor_parallel_size": 2,
            "model.num_threads": 1,
        },
    )
    with pytest.raises(ModelLoadError, match="2 query heads and 1 key/value heads do not divide"):
        LLM.from_config(config)


def test_start_refuses_more_ranks_than_cores() -> None:
    size = len(usable_cores()) + 1
    config = load_config(environ={}, overrides={"model.tensor_parallel_size": size})
    with pytest.raises(ModelLoadError, match="needs a core per rank; this process may use"):
        check_tensor_parallel(config)


def test_compile_and_precompiled_graphs_need_one_rank() -> None:
    config = load_config(environ={}, overrides={"model.tensor_parallel_size": 2})
    with pytest.raises(ModelLoadError, match="tensor_parallel_size 1 only"):
        check_tensor_parallel(config, compile_only=True)
