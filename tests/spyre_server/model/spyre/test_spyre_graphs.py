"""The spyre backend compiles the graphs the reference stack compiles for the card
(sendnn-inference 2.6.3): with ``inductor`` standing in for ``sendnn``, exactly one prefill
graph and one decode graph serve a randomized workload (prompt lengths, prefix-cache hits,
decode batches of every size, block tables of every width), with no compile after warm-up.
Every call of the compiled model is watched: its autograd mode (``torch.no_grad``, never
inference mode), size-oblivious shapes (during the warm-up's first prefill and decode only), and
the dimensions each input has marked dynamic and static (v1/worker/spyre_model_runner.py,
``_mark_input_tensors``)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from torch.fx.experimental import _config as fx_config

from spyre_server.entrypoints.llm import LLM
from spyre_server.model.spyre import runner as spyre_runner
from spyre_server.sample.sampler import SamplingParams

CHUNK = 64  # a one-block window: the warm-up's prefill table has width 1, a decode batch 1
MAX_NUM_SEQS = 4
INPUTS = ("position_ids", "slot_mapping", "block_table", "current_tkv_mask")
INPUTS += ("left_padded_prompt_mask",)

# The reference's marking, per kind: input name -> (dynamic dims, static dims).
REFERENCE_MARKS = {
    "prefill": {
        "input_ids": ({1}, {0}),
        "position_ids": ({1}, {0}),
        "slot_mapping": ({1}, {0}),
        "block_table": ({1}, {0}),
        "current_tkv_mask": (set(), set()),
        "left_padded_prompt_mask": (set(), set()),
    },
    "decode": {
        "input_ids": ({0}, {1}),
        "position_ids": ({0}, {1}),
        "slot_mapping": ({0}, {1}),
        "block_table": ({0, 1}, set()),
        "current_tkv_mask": ({0}, set()),
        "left_padded_prompt_mask": ({0}, set()),
    },
}


@dataclass(frozen=True)
class Call:
    kind: str
    shapes: dict[str, tuple[int, ...]]
    marks: dict[str, tuple[set[int], set[int]]]
    grad_enabled: bool
    inference_mode: bool
    size_oblivious: bool


def marks(tensor: torch.Tensor) -> tuple[set[int], set[int]]:
    return (
        set(getattr(tensor, "_dynamo_dynamic_indices", set())),
        set(getattr(tensor, "_dynamo_static_indices", set())),
    )


class Watch:
    """Stands in for the runner's compiled model: records each call, then makes it."""

    def __init__(self, compiled: Callable[..., Any]) -> None:
        self.compiled = compiled
        self.calls: list[Call] = []

    def __call__(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        tensors = {"input_ids": input_ids} | {k: kwargs[k] for k in INPUTS}
        kind = "prefill" if kwargs["last_n_tokens"] > 1 else "decode"
        self.calls.append(
            Call(
                kind=kind,
                shapes={k: tuple(t.shape) for k, t in tensors.items()},
                marks={k: marks(t) for k, t in tensors.items()},
                grad_enabled=torch.is_grad_enabled(),
                inference_mode=torch.is_inference_mode_enabled(),
                size_oblivious=bool(fx_config.backed_size_oblivious),
            )
        )
        return self.compiled(input_ids, **kwargs)


@pytest.fixture
def watched(monkeypatch: pytest.MonkeyPatch) -> list[Watch]:
    """Every SpyreModelRunner built while the test runs has its compiled model watched."""
    watches: list[Watch] = []
    original = spyre_runner.compile_model

    def compile_model(*args: Any, **kwargs: Any) -> Any:
        compiled, counter = original(*args, **kwargs)
        watches.append(Watch(compiled))
        return watches[-1], counter

    monkeypatch.setattr(spyre_runner, "compile_model", compile_model)
    return watches


def rand_tokens(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1, 256) for _ in range(n)]


@pytest.mark.slow
def test_one_prefill_and_one_decode_graph_serve_a_random_workload(
    make_engine: Callable[..., Any], watched: list[Watch]
) -> None:
    graphs_before = counters["stats"]["unique_graphs"]
    engine = make_engine(
        model__backend="spyre",
        model__compile_backend="inductor",
        scheduler__chunk_size=CHUNK,
        scheduler__max_num_seqs=MAX_NUM_SEQS,
        model__max_model_len=1024,
        cache__num_blocks=64,
    )
    (watch,) = watched
    stats = engine.runner.program_stats()
    assert stats.graphs == {"prefill": 1, "decode": 1}
    assert counters["stats"]["unique_graphs"] - graphs_before == 2

    # The reference's warm-up: a prefill and a decode (batch 1) size-oblivious, then the deploy
    # prefill and decode without it.
    warmup = watch.calls[:4]
    assert [(c.kind, c.size_oblivious) for c in warmup] == [
        ("prefill", True),
        ("decode", True),
        ("prefill", False),
        ("decode", False),
    ]
    assert warmup[0].shapes["block_table"] == (1, 1)  # one-block window
    assert warmup[1].shapes["input_ids"] == (1, 1)  # decode batch 1

    rng = random.Random(31)
    families = [rand_tokens(rng.randint(100, 500), rng) for _ in range(3)]
    llm = LLM(engine)
    llm.generate(families, SamplingParams(max_tokens=2, temperature=0))
    for round_ in range(4):
        prompts, params = [], []
        for _ in range(rng.randint(1, 2 * MAX_NUM_SEQS)):
            prefix = rng.choice(families)[: rng.randint(1, 500)] if rng.random() < 0.6 else []
            prompts.append(prefix + rand_tokens(rng.randint(1, 150), rng))
            params.append(
                SamplingParams(max_tokens=rng.randint(1, 40), temperature=0, ignore_eos=True)
            )
        outputs = llm.generate(prompts, params)
        assert all(o.error is None for o in outputs), (round_, [o.error for o in outputs])

    steps = watch.calls[4:]
    decode_batches = {c.shapes["input_ids"][0] for c in steps if c.kind == "decode"}
    table_widths = {(c.kind, c.shapes["block_table"][1]) for c in steps}
    assert decode_batches == set(range(1, MAX_NUM_SEQS + 1)), decode_batches
    assert len({w for k, w in table_widths if k == "prefill"}) >= 5, table_widths
    assert len({w for k, w in table_widths if k == "decode"}) >= 5, table_widths
    assert engine.scheduler.make_stats().prefix_cache_hits > 0

    # No graph compiled after warm-up, by the runner's compile backend or anyone else's.
    stats = engine.runner.program_stats()
    assert stats.graphs == {"prefill": 1, "decode": 1}
    assert stats.graphs_after_warmup == 0
    assert counters["stats"]["unique_graphs"] - graphs_before == 2
    # Every call: torch.no_grad (never inference mode), the reference's marking,
    # size-oblivious during the warm-up's compile only.
    for call in watch.calls:
        assert not call.grad_enabled and not call.inference_mode, call
        assert call.marks == REFERENCE_MARKS[call.kind], call
    assert not any(c.size_oblivious for c in steps)
    for k, v in engine.runner.kv_caches:
        assert not k.is_inference() and not v.is_inference()
