"""Fixtures of the conformance suite: the checkpoints (built once per session), HF's answers on
them, and our server's answers per matrix case (each case served once, its results shared by
the checks)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from tests.conformance import oracle
from tests.conformance.checkpoints import ARCHITECTURES, VOCAB_SIZE, build_checkpoint
from tests.conformance.matrix import PATHS, Case

MAX_TOKENS = 8
ENGINE: dict[str, Any] = {
    "scheduler.chunk_size": 128,
    "scheduler.max_num_seqs": 4,
    "cache.num_blocks": 48,
    "model.max_model_len": 1024,
    "model.num_threads": 1,
}
"""Chunks of 128 (the 700-token prompt spans 6); 4 sequences at a time, so the fifth prompt is
admitted while others decode; a KV cache small enough for the spyre backend's reference
attention, which copies it at every layer of every step, and large enough that the second run
finds every block of the first still cached."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

K = TypeVar("K")
V = TypeVar("V")


def make_prompts() -> list[list[int]]:
    """9 to 700 tokens: one block, two blocks, three chunks (257 = 4 blocks and a token), six
    chunks, and a prompt sharing the 700-token one's first 300 tokens (a hit of 4 blocks within
    the first run, whose boundary chunk is recomputed). Random ids, with the special tokens real
    prompts carry (SmolLM2's ids 0-2: end of text, chat turn start and end; id 0 is the end of
    text of StarCoder's vocabulary too)."""
    rng = random.Random(30)

    def ids(n: int) -> list[int]:
        return [rng.randrange(VOCAB_SIZE) for _ in range(n)]

    long = ids(700)
    long[0:1] = [1]
    long[140:143] = [2, 0, 1]
    return [[1, *ids(8)], ids(70), ids(257), long, long[:300] + ids(150)]


PROMPTS = make_prompts()


_TIMES: dict[str, float] = {}


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny models gain nothing from more threads, and on a busy 2-core machine two threads
    made these runs 3-5 times slower. (``model.num_threads`` is 1 for the refusal starts too.)"""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    started = time.monotonic(), time.process_time()
    yield
    torch.set_num_threads(previous)
    _TIMES["wall"] = time.monotonic() - started[0]
    _TIMES["cpu"] = time.process_time() - started[1]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _TIMES:
        terminalreporter.write_line(
            f"conformance suite: {_TIMES['wall']:.0f} s wall, {_TIMES['cpu']:.0f} s CPU"
        )


class Memo(dict[K, V]):
    """A dict computing missing values, keeping at most ``size`` of them (least recent out)."""

    def __init__(self, compute: Callable[[K], V], size: int | None = None) -> None:
        super().__init__()
        self._compute = compute
        self._size = size

    def __missing__(self, key: K) -> V:
        value = self._compute(key)
        if self._size is not None:
            while len(self) >= self._size:
                del self[next(iter(self))]
        self[key] = value
        return value


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Memo[str, Path]:
    """Architecture name -> its checkpoint folder, built at first use (0.5-1.5 s each)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return Memo(lambda name: build_checkpoint(ARCHITECTURES[name], root / name, smollm2_path))


@pytest.fixture(scope="session")
def hf_models(checkpoints: Memo[str, Path]) -> Memo[tuple[str, str], Any]:
    """(architecture, dtype) -> HF's model of the checkpoint (the last two kept)."""
    return Memo(lambda key: oracle.load(checkpoints[key[0]], DTYPES[key[1]]), size=2)


@pytest.fixture(scope="session")
def hf_greedy(hf_models: Memo[tuple[str, str], Any]) -> Memo[str, list[oracle.Greedy]]:
    """Architecture -> HF's float32 greedy decoding of every prompt."""
    return Memo(
        lambda arch: [oracle.greedy(hf_models[arch, "float32"], p, MAX_TOKENS) for p in PROMPTS]
    )


@dataclass(frozen=True)
class Output:
    tokens: list[int]
    logprobs: list[float]
    cached: int
    error: str | None


@dataclass(frozen=True)
class Served:
    """A case's answers: the first run, the same prompts again (prefix-cache hits), and a server
    with prefix caching off."""

    decoder: str
    attention: str
    first: list[Output]
    rerun: list[Output]
    off: list[Output]


def decoder_name(engine: Any) -> tuple[str, str]:
    """What runs the engine's steps, and with which attention kernel."""
    from spyre_server.model.cpu.runner import CpuModelRunner

    runner = engine.runner
    if not isinstance(runner, CpuModelRunner):
        return "spyre", "spyre_paged_attn"
    names = {
        "NativeDecoder": "native",
        "NativeBf16Decoder": "native-bf16",
        "AtenDecoder": "aten",
        "NoneType": "fms",
    }
    attention = runner.attention
    kernel = "flash" if attention is None else attention.bf16_dot or "native"
    return names[type(runner.decoder).__name__], kernel


def serve(case: Case, loaded: Any) -> Served:
    from spyre_server.config import load_config
    from spyre_server.engine.factory import build_engine
    from spyre_server.entrypoints.llm import LLM
    from spyre_server.sample.sampler import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)

    def run(llm: LLM) -> list[Output]:
        outputs = llm.generate(PROMPTS, params)
        return [
            Output(o.token_ids, [lp.logprob for lp in o.logprobs], o.num_cached_tokens, o.error)
            for o in outputs
        ]

    overrides = ENGINE | dict(PATHS[case.path].overrides) | {"model.dtype": case.dtype}
    engine = build_engine(load_config(environ={}, overrides=overrides), loaded)
    decoder, attention = decoder_name(engine)
    llm = LLM(engine)
    first, rerun = run(llm), run(llm)
    del llm, engine
    off_overrides = overrides | {"cache.enable_prefix_caching": False}
    off = run(LLM(build_engine(load_config(environ={}, overrides=off_overrides), loaded)))
    return Served(decoder, attention, first, rerun, off)


class ServedCases:
    """Case -> ``Served``, each case served at most once per session; an exception raised while
    starting or serving is kept and raised again to every check of the case."""

    def __init__(self, checkpoints: Memo[str, Path]) -> None:
        from spyre_server.model.loading import load_model

        self._loaded: Memo[tuple[str, str], Any] = Memo(
            lambda key: load_model(checkpoints[key[0]], DTYPES[key[1]]), size=1
        )
        self._results: dict[str, Served | BaseException] = {}

    def __getitem__(self, case: Case) -> Served:
        if case.id not in self._results:
            try:
                self._results[case.id] = serve(case, self._loaded[case.arch, case.dtype])
            except Exception as exc:  # kept for every check of the case
                self._results[case.id] = exc
        result = self._results[case.id]
        if isinstance(result, BaseException):
            raise result
        return result


@pytest.fixture(scope="session")
def served(checkpoints: Memo[str, Path]) -> ServedCases:
    return ServedCases(checkpoints)
