"""Shared fixtures for the serving tests: a byte tokenizer and a tiny random fms llama engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

VOCAB_SIZE = 256


class ByteTokenizer:
    """Token ids 0..255 are the bytes of the UTF-8 text, so a multi-byte character spans several
    tokens. ``special_ids`` (e.g. an eos id) are dropped by ``decode(skip_special_tokens=True)``."""

    def __init__(self, special_ids: Sequence[int] = ()) -> None:
        self.special_ids = frozenset(special_ids)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [t for t in token_ids if not (skip_special_tokens and t in self.special_ids)]
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.fixture(scope="session")
def micro_model(request: pytest.FixtureRequest) -> Any:
    """A random-weight fms llama (vocab 256, 5 layers, 4 query / 2 KV heads, float32, seed 0);
    stateless, so engines can share it. The suite-wide ``tiny_llama`` (tests/conftest.py) is the
    same model: reuse it when it is there, so that a full run builds it once."""
    try:
        return request.getfixturevalue("tiny_llama")
    except pytest.FixtureLookupError:
        pass
    import fms.models
    import torch

    torch.manual_seed(0)
    return fms.models.get_model(
        "llama", "micro", data_type=torch.float32, nheads=4, kvheads=2
    ).eval()


ENGINE_DEFAULTS: dict[str, Any] = {
    "cache.num_blocks": 64,
    "model.max_model_len": 1024,
    "scheduler.chunk_size": 128,
}


@pytest.fixture
def make_engine(micro_model: Any) -> Iterator[Callable[..., Any]]:
    """``make_engine(eos_token_id=None, tokenizer=None, **overrides)`` -> a fresh LLMEngine on the
    micro model (with a ByteTokenizer unless ``tokenizer`` is given).
    Overrides use config keys with ``__`` for the dot: ``cache__num_blocks=8``.

    Runs torch on one thread while the test lasts: the micro model's ops are far too small to
    gain from more, and on a busy 2-core machine two threads make a decode step 5-10x slower."""
    import torch

    from spyre_server.config import load_config
    from spyre_server.engine.factory import build_engine
    from spyre_server.model.loading import LoadedModel

    def make(eos_token_id: int | None = None, tokenizer: Any = None, **overrides: Any) -> Any:
        values = ENGINE_DEFAULTS | {k.replace("__", "."): v for k, v in overrides.items()}
        config = load_config(environ={}, overrides=values)
        loaded = LoadedModel(
            path=Path("micro"),
            name="micro",
            model=micro_model,
            tokenizer=tokenizer or ByteTokenizer(),
            dtype=torch.float32,
            eos_token_id=eos_token_id,
            vocab_size=VOCAB_SIZE,
        )
        return build_engine(config, loaded)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield make
    finally:
        torch.set_num_threads(threads)


def assert_pool_clean(engine: Any) -> None:
    """No request holds a block: every usable block is free (cached or not) and the pool's
    invariants hold."""
    scheduler = engine.scheduler
    assert not scheduler.has_unfinished_requests
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_usable_blocks
    scheduler.check_integrity()


@pytest.fixture
def both_widths() -> tuple[Any, Any]:
    """The native kernels twice, one library: their float32 code on AVX2 and 512 bits wide
    (``load_native_kernels(..., avx512=False | True)``); skips on CPUs without AVX512F, where
    there is no second code path to compare."""
    from spyre_server.model.cpu.kernels.library import default_kernel_dir, load_native_kernels

    avx2 = load_native_kernels(default_kernel_dir(), avx512=False)
    avx512 = load_native_kernels(default_kernel_dir(), avx512=True)
    if not avx512.avx512:
        pytest.skip("this CPU lacks avx512f: the kernels have only their AVX2 code here")
    assert not avx2.avx512
    return avx2, avx512
