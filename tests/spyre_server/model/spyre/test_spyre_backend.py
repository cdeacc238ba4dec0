"""The spyre backend (spyre_server/model/spyre/runner.py) on a CPU: the Spyre programs, compiled
with ``eager`` and ``inductor``, against the cpu backend as the oracle (itself checked against
full forwards in test_model_correctness.py), float32, greedy.

Also: the warmed program set is closed under a randomized workload (no program outside it, no
compilation after warm-up), the per-backend cached-token accounting, and the start-up error
without ``torch_sendnn``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from scheduler import PrefillCompute
from spyre_server.entrypoints.llm import LLM
from spyre_server.model.runner import ProgramShape
from spyre_server.sample.sampler import SamplingParams

CHUNK = 128


def rand_tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def spyre_engine(make_engine: Callable[..., Any], compile_backend: str, **overrides: Any) -> Any:
    settings = {"scheduler__chunk_size": CHUNK, "scheduler__max_num_seqs": 4} | overrides
    return make_engine(model__backend="spyre", model__compile_backend=compile_backend, **settings)


def corpus() -> list[tuple[str, list[int], int]]:
    """(name, prompt, max_tokens), submitted together in this order (FCFS prefills: each
    request's lookup sees every earlier prompt's blocks)."""
    rng = random.Random(11)
    a = rand_tokens(300, rng)
    return [
        ("a", a, 9),
        ("identical", a, 5),  # 4 full blocks hit; chunk 1 recomputed into block 0
        ("partial", a[:260] + rand_tokens(40, rng), 7),  # 4 hit blocks, then new tokens
        ("multiple-of-64", a[:256], 4),  # all 4 blocks hit: only the logits position is new
        ("short", rand_tokens(70, rng), 12),  # one chunk with right padding
        ("long", rand_tokens(520, rng), 3),  # 5 chunks; decodes beside short ones
        ("tiny", rand_tokens(3, rng), 6),
    ]


# Hand-derived for chunk 128, blocks of 64 (DESIGN §4): cpu skips min(hit, L - 1) positions,
# spyre the usable grid part. 300 tokens: padded 320, 3 chunks, 1 pad block, 4 blocks hit ->
# (1 + 4) // 2 = 2 whole chunks -> 4 - 1 = 3 usable blocks. 256 tokens: 2 chunks, no pad,
# 4 hit -> min(2, 2 - 1) = 1 whole chunk -> 2 usable blocks.
EXPECTED_CACHED = {
    PrefillCompute.NEW_POSITIONS: {"identical": 256, "partial": 256, "multiple-of-64": 255},
    PrefillCompute.WHOLE_WINDOWS: {"identical": 192, "partial": 192, "multiple-of-64": 128},
}


def run_corpus(engine: Any) -> dict[str, tuple[list[int], int]]:
    llm = LLM(engine)
    items = corpus()
    outputs = llm.generate(
        [prompt for _, prompt, _ in items],
        [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for *_, m in items],
    )
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return {
        name: (o.token_ids, o.num_cached_tokens)
        for (name, _, _), o in zip(items, outputs, strict=True)
    }


@pytest.mark.slow
@pytest.mark.parametrize("compile_backend", ["eager", "inductor"])
def test_spyre_programs_give_the_cpu_backends_greedy_tokens(
    make_engine: Callable[..., Any], compile_backend: str
) -> None:
    cpu_engine = make_engine(scheduler__chunk_size=CHUNK, scheduler__max_num_seqs=4)
    cpu = run_corpus(cpu_engine)
    spyre_engine_ = spyre_engine(make_engine, compile_backend)
    spyre = run_corpus(spyre_engine_)

    for name, (tokens, _) in cpu.items():
        assert spyre[name][0] == tokens, name
    for engine, result in ((cpu_engine, cpu), (spyre_engine_, spyre)):
        expected = EXPECTED_CACHED[engine.scheduler.config.prefill_compute]
        assert {n: c for n, (_, c) in result.items()} == {n: expected.get(n, 0) for n in result}
    # Decode batches mixed rows of 1 to 9 blocks; every program ran from the warmed set.
    stats = spyre_engine_.runner.program_stats()
    ran = {p for p, n in stats.num_steps.items() if n > 0}
    assert ProgramShape("prefill", f"1x{CHUNK}") in ran
    assert {p for p in ran if p.kind == "decode" and p.shape != "1x1"}, ran
    sched = spyre_engine_.scheduler.make_stats()
    assert (
        sum(stats.num_steps.values()) == sched.num_prefill_chunks_computed + sched.num_decode_steps
    )


def num_compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.slow
def test_warmed_programs_stay_closed_under_a_random_workload(
    make_engine: Callable[..., Any],
) -> None:
    engine = spyre_engine(make_engine, "eager", model__max_model_len=1024)
    stats = engine.runner.program_stats()
    assert stats.warmed == {ProgramShape("prefill", f"1x{CHUNK}")} | {
        ProgramShape("decode", f"{b}x1") for b in range(1, 5)
    }
    graphs_after_warmup = num_compiled_graphs()
    rng = random.Random(5)
    families = [rand_tokens(400, rng) for _ in range(3)]
    llm = LLM(engine)
    llm.generate(families, SamplingParams(max_tokens=2, temperature=0))  # cache the families
    for round_ in range(3):
        prompts, params = [], []
        for _ in range(rng.randint(2, 7)):
            prefix = rng.choice(families)[: rng.randint(1, 400)] if rng.random() < 0.7 else []
            prompts.append(prefix + rand_tokens(rng.randint(1, 200), rng))
            params.append(
                SamplingParams(max_tokens=rng.randint(1, 20), temperature=0, ignore_eos=True)
            )
        outputs = llm.generate(prompts, params)
        assert all(o.error is None for o in outputs), (round_, [o.error for o in outputs])
        assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in params]
    assert num_compiled_graphs() == graphs_after_warmup, "a program compiled after warm-up"
    stats = engine.runner.program_stats()
    assert set(stats.num_steps) == stats.warmed
    sched = engine.scheduler.make_stats()
    assert (
        sum(stats.num_steps.values()) == sched.num_prefill_chunks_computed + sched.num_decode_steps
    )
    assert sched.prefix_cache_hits > 0


def test_a_program_outside_the_warmed_set_fails_the_step(make_engine: Callable[..., Any]) -> None:
    engine = spyre_engine(make_engine, "eager", scheduler__max_num_seqs=2)
    engine.runner.programs = frozenset()  # as if warm-up had missed every program
    engine.runner._num_steps = {}
    llm = LLM(engine)
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
    assert out.error is not None and "was not warmed up" in out.error


def test_without_torch_sendnn_the_server_stops_before_loading_the_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Any
) -> None:
    from spyre_server.entrypoints import cli

    monkeypatch.setenv("SPYRE_SERVER_MODEL__BACKEND", "spyre")
    monkeypatch.setenv("SPYRE_SERVER_MODEL__COMPILE_BACKEND", "sendnn")
    # A model folder that does not exist: had the model been looked at first, the error
    # would name it instead.
    code = cli.main(["serve", "--model", str(tmp_path / "no-such-model"), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert "torch_sendnn" in err and "Spyre runtime image" in err
    assert "no-such-model" not in err


def test_float16_is_refused_on_the_cpu_backend() -> None:
    from spyre_server.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="float16"):
        load_config(environ={}, overrides={"model.dtype": "float16"})
    config = load_config(environ={}, overrides={"model.dtype": "float16", "model.backend": "spyre"})
    assert config.model.dtype == "float16"


def test_auto_dtype_per_backend() -> None:
    from spyre_server.config import load_config
    from spyre_server.model.loading import model_dtype

    def dtype(**overrides: Any) -> torch.dtype:
        return model_dtype(load_config(environ={}, overrides=overrides))

    assert dtype(**{"model.backend": "spyre"}) is torch.float16  # sendnn: the card's precision
    assert dtype(**{"model.backend": "spyre", "model.compile_backend": "eager"}) is torch.float32
    assert dtype(**{"model.backend": "spyre", "model.compile_backend": "inductor"}) is torch.float32


def test_sendnn_gets_the_schedules_limits_before_its_import(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch_sendnn reads these at import time; they must match the programs the scheduler
    issues (vllm-spyre sets the same variables). The import then fails here (no torch_sendnn)."""
    import os

    from spyre_server.config import load_config
    from spyre_server.engine.factory import check_backend
    from spyre_server.model.spyre.compile import CompileBackendError

    names = ["VLLM_DT_CHUNK_LEN", "VLLM_DT_MAX_CONTEXT_LEN", "VLLM_DT_MAX_BATCH_SIZE"]
    names += ["VLLM_DT_MAX_BATCH_TKV_LIMIT", "COMPILATION_MODE", "FLEX_OVERWRITE_NMB_FRAME"]
    for name in names:  # set, so that teardown restores what was there before
        monkeypatch.setenv(name, "before")
    overrides = {
        "model.backend": "spyre",
        "model.max_model_len": 4096,
        "scheduler.chunk_size": 512,
        "scheduler.max_num_seqs": 1,
    }
    with pytest.raises(CompileBackendError, match="torch_sendnn"):
        check_backend(load_config(environ={}, overrides=overrides))
    assert {n: os.environ[n] for n in names} == {
        "VLLM_DT_CHUNK_LEN": "512",
        "VLLM_DT_MAX_CONTEXT_LEN": "4096",
        "VLLM_DT_MAX_BATCH_SIZE": "2",  # the compiler's minimum
        "VLLM_DT_MAX_BATCH_TKV_LIMIT": "4096",  # unset limit: max_model_len * max_num_seqs
        "COMPILATION_MODE": "offline_decoder",
        "FLEX_OVERWRITE_NMB_FRAME": "true",
    }
