"""Tiny random-weight checkpoints whose heads divide by 2 ranks (the conformance checkpoints
with 4 query and 2 key/value heads), and offline runs of them at a tensor-parallel size."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spyre_server.config import load_config
from spyre_server.entrypoints.llm import LLM
from spyre_server.sample.sampler import SamplingParams
from tests.conformance.checkpoints import ARCHITECTURES, build_checkpoint

HEAD_DIMS = {"llama": 64, "granite": 64, "qwen3": 128}
"""The checkpoints split over ranks: fused QKV (llama: SmolLM2's shape), Granite's multipliers,
unfused QKV with per-head query/key norms (qwen3)."""


def build_tp_checkpoint(name: str, directory: Path, tokenizer_dir: Path) -> Path:
    """``name``'s conformance checkpoint with 4 query and 2 key/value heads."""
    arch = ARCHITECTURES[name]
    fields = {
        **arch.fields,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": HEAD_DIMS[name],
    }
    return build_checkpoint(dataclasses.replace(arch, fields=fields), directory, tokenizer_dir)


def prompts() -> list[list[int]]:
    """Prompts that cross 128-position chunks, hit the cache (the last shares 256 tokens with
    the second, and the third repeats it) and decode together."""
    long = [(7 * i) % 4000 + 100 for i in range(300)]
    return [
        [(11 * i) % 3000 + 50 for i in range(70)],
        long,
        long,
        long[:256] + [(13 * i) % 2000 + 900 for i in range(50)],
    ]


@dataclass(frozen=True)
class Run:
    tokens: list[list[int]]
    logprobs: list[list[float]]
    cached: list[int]
    prompt_logprobs: list[float] | None
    """The chosen tokens' prompt logprobs of the first prompt (echo with logprobs; None on a
    backend without prompt logits)."""
    graphs: dict[str, int]
    """The compiled graphs per kind (spyre backend; rank 0's with tensor parallelism)."""
    graphs_after_warmup: int


def generate(
    path: Path, tensor_parallel_size: int, *, score_prompt: bool = True, **overrides: Any
) -> Run:
    """Greedy outputs of ``prompts()`` (and the first prompt scored, with ``score_prompt``) in
    float32, on the cpu backend unless ``overrides`` say otherwise, 4 requests decoding
    together, chunks of 128."""
    config = load_config(
        environ={},
        overrides={
            "model.path": str(path),
            "model.dtype": "float32",
            "model.tensor_parallel_size": tensor_parallel_size,
            "model.num_threads": 1,
            "model.max_model_len": 512,
            "scheduler.chunk_size": 128,
            "scheduler.max_num_seqs": 4,
            "cache.num_blocks": 64,
            **overrides,
        },
    )
    greedy = SamplingParams(max_tokens=24, temperature=0, logprobs=0)
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    batch = prompts()
    extra = [batch[0]] if score_prompt else []
    with LLM.from_config(config) as llm:
        outputs = llm.generate([*batch, *extra], [greedy] * len(batch) + [scored] * len(extra))
        stats = llm.engine.runner.program_stats()
    generated = outputs[: len(batch)]
    scoring = outputs[len(batch) :]
    return Run(
        tokens=[o.token_ids for o in generated],
        logprobs=[[lp.logprob for lp in o.logprobs] for o in generated],
        cached=[o.num_cached_tokens for o in generated],
        prompt_logprobs=[
            e.logprob for o in scoring for e in (o.prompt_logprobs or []) if e is not None
        ]
        or None,
        graphs=dict(stats.graphs) if stats else {},
        graphs_after_warmup=stats.graphs_after_warmup if stats else 0,
    )
