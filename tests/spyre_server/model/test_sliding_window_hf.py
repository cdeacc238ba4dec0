"""A Mistral-7B-v0.1-style checkpoint (a ``sliding_window`` shorter than the prompts) served end
to end gives HF transformers' float32 greedy tokens: on the cpu backend through every step path
the configuration can choose, and on the spyre backend's programs (``compile_backend: eager``),
with the prompts sent twice (the second time prefix-cache hits, most of them outside the
window).

The checkpoint is a tiny random MistralForCausalLM written with transformers (2 layers, hidden
256, 4 query heads over 2 KV heads of 64, a window of 80 keys) and a word-level tokenizer. Its
weights are drawn at a scale where every greedy step of HF's oracle is far from a tie (checked),
and the window changes HF's tokens (checked), so a server ignoring it fails.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import needs_native_kernels

WINDOW = 80
VOCAB = 512
MAX_TOKENS = 8
MIN_MARGIN = 1e-3
"""HF's top two logits are at least this far apart at every greedy step: far beyond the float32
differences between two implementations of a 2-layer model, so exact token equality is fair."""
ENGINE = {
    "scheduler.chunk_size": 128,
    "scheduler.max_num_seqs": 4,
    "cache.num_blocks": 40,
    "model.max_model_len": 1024,
    "model.num_threads": 1,
    "model.dtype": "float32",
}


def make_prompts() -> list[list[int]]:
    """Longer than the window: 200, 300 and 450 tokens (two to four 128-token chunks), and one
    sharing the 450-token prompt's first 256 tokens (a hit within the first run)."""
    rng = random.Random(80)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (200, 300, 450)]
    return [*prompts, prompts[2][:256] + [rng.randrange(VOCAB) for _ in range(100)]]


PROMPTS = make_prompts()


def build_checkpoint(path: Path, sliding_window: int | None = WINDOW) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import MistralConfig, MistralForCausalLM, PreTrainedTokenizerFast

    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        sliding_window=sliding_window,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = MistralForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="t0", bos_token="t1", eos_token="t2"
    ).save_pretrained(path)
    return path


@torch.no_grad()
def hf_greedy(path: Path, **config_changes: Any) -> tuple[list[list[int]], float]:
    """HF's greedy tokens for every prompt (a full forward per step, no cache), and the
    smallest top-two logit margin seen."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    for key, value in config_changes.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32).eval()
    answers, margin = [], float("inf")
    for prompt in PROMPTS:
        ids = list(prompt)
        for _ in range(MAX_TOKENS):
            logits = model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
            top = torch.topk(logits, 2)
            margin = min(margin, float(top.values[0] - top.values[1]))
            ids.append(int(top.indices[0]))
        answers.append(ids[len(prompt) :])
    return answers, margin


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("mistral-swa"))


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> list[list[int]]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        answers, margin = hf_greedy(checkpoint)
        without_window, _ = hf_greedy(checkpoint, sliding_window=None)
    finally:
        torch.set_num_threads(previous)
    assert margin >= MIN_MARGIN
    assert sum(len(set(a)) for a in answers) > 2 * len(answers), "mostly one token: weak"
    assert sum(a != b for a, b in zip(answers, without_window, strict=True)) >= 2
    return answers


def serve(checkpoint: Path, overrides: dict[str, Any]) -> tuple[Any, list[Any], list[Any]]:
    """The engine of ``overrides``, and its greedy outputs for the prompts, twice."""
    from spyre_server.config import load_config
    from spyre_server.engine.factory import build_engine
    from spyre_server.entrypoints.llm import LLM
    from spyre_server.model.loading import load_model
    from spyre_server.sample.sampler import SamplingParams

    loaded = load_model(checkpoint, torch.float32)
    engine = build_engine(load_config(environ={}, overrides=ENGINE | overrides), loaded)
    llm = LLM(engine)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate(PROMPTS, params)
    rerun = llm.generate(PROMPTS, params)
    for output in (*first, *rerun):
        assert output.error is None, output.error
    return engine, first, rerun


CPU_PATHS = {
    "auto": {},
    "aten-linear": {"model.linear_kernel": "aten"},
    "flash": {"model.linear_kernel": "onednn", "model.attention_kernel": "flash"},
}
"""The cpu backend's step paths for a float32 Mistral: the decoders and attention kernels the
configuration picks (native decoder and kernel; aten projections; SDPA's flash kernel)."""


@needs_native_kernels
@pytest.mark.parametrize("path", CPU_PATHS)
def test_the_cpu_backend_gives_hf_s_greedy_tokens(
    checkpoint: Path, expected: list[list[int]], path: str
) -> None:
    engine, first, rerun = serve(checkpoint, CPU_PATHS[path])
    runner = engine.runner
    assert runner.sliding_window == WINDOW
    print(f"\n{path}: steps on {type(runner.decoder).__name__}, attention {runner.attention}")
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in rerun] == expected
    assert all(o.num_cached_tokens > 0 for o in rerun[1:])


@pytest.mark.slow
def test_the_spyre_programs_give_hf_s_greedy_tokens(
    checkpoint: Path, expected: list[list[int]]
) -> None:
    engine, first, rerun = serve(
        checkpoint, {"model.backend": "spyre", "model.compile_backend": "eager"}
    )
    assert engine.runner.sliding_window == WINDOW
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in rerun] == expected
    assert all(o.num_cached_tokens > 0 for o in rerun[1:])


def test_a_window_not_shorter_than_max_model_len_is_no_window(checkpoint: Path) -> None:
    """Served with ``model.max_model_len`` at most the window, no key is ever outside it: the
    runner plans no window (the steps are those of a model without one)."""
    from spyre_server.model.loading import load_model
    from spyre_server.model.runner import attention_window

    model = load_model(checkpoint, torch.float32).model
    assert attention_window(model, WINDOW) is None
    assert attention_window(model, WINDOW + 1) == WINDOW
