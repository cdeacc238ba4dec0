"""FP8 checkpoints on the spyre backend (spyre_server/model/spyre/fp8.py), as the reference stack
runs them on the card: fms-model-optimizer's FP8 linear layers and ``spyre_paged_attn_fp8``
over a float8_e4m3fn KV cache with unit scales, decode batches of 1 run as 2.

The oracle is HF transformers on the same checkpoint (compressed-tensors' FP8 layers, float32)
with its keys and values rounded to float8_e4m3fn before attention, which is what a cache of
FP8 values with scale 1.0 holds: an attention function registered with HF's
``AttentionInterface`` that rounds them and calls HF's own SDPA attention. HF without the
rounding is the control: it shows how far the KV cache's quantization moves the logprobs, so the
checks would catch a cache that is not stored in FP8.

Importing the addon replaces aten's CPU ``_scaled_mm`` for the whole test process (fp8.py's
docstring); nothing in the suite calls ``_scaled_mm`` on its own.
"""

from __future__ import annotations

import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from spyre_server.config import load_config
from spyre_server.engine.factory import build_engine
from spyre_server.entrypoints.llm import LLM
from spyre_server.model.errors import ModelLoadError
from spyre_server.model.fp8 import InputScales
from spyre_server.model.loading import fp8_scale_dtype_for, load_model
from spyre_server.model.runner import ProgramShape
from spyre_server.model.spyre import fp8
from spyre_server.sample.sampler import SamplingParams
from tests.conformance import oracle
from tests.conformance.checkpoints import ARCHITECTURES, build_checkpoint
from tests.conformance.conftest import ENGINE as CONFORMANCE_ENGINE
from tests.conformance.conftest import MAX_TOKENS, PROMPTS
from tests.conformance.fp8_checkpoints import quantize

pytest.importorskip("compressed_tensors", reason="HF transformers' FP8 oracle")
pytest.importorskip("fms_mo", reason="fms-model-optimizer's FP8 addon (scripts/setup.sh)")

ENGINE: dict[str, Any] = CONFORMANCE_ENGINE | {
    "model.backend": "spyre",
    "model.compile_backend": "eager",
    "model.dtype": "float32",
}
"""The conformance suite's engine (4 sequences at a time, 48 blocks) on the spyre backend: of
its five prompts (9 to 700 tokens) the fifth is admitted while others decode, and the last to
finish decodes alone, a batch of 1."""

SCHEMES: dict[str, tuple[bool, InputScales]] = {
    "tensor-static": (False, "static"),
    "channel-dynamic": (True, "dynamic"),
    "tensor-none": (False, None),
}
"""What fms-model-optimizer's FP8Linear runs: one weight scale per tensor with a static input
scale, per-channel weight scales with per-token input scales (FP8_DYNAMIC), no input
quantization."""
REFUSED_SCHEME = {"channel-static": (True, "static")}
"""Per-channel weight scales with a static input scale: fms-model-optimizer's FP8Linear asserts
against it."""

MEAN_TOL = 0.05
"""Mean |ours - oracle| of the chosen tokens' logprobs, nats. What is left is where float32
rounding differs by an ulp at a value that FP8 rounds (an input, a key) and the FP8 step moves
it: measured 1e-4 without input quantization, 1.4e-2 to 2.1e-2 with it."""
KV_SHARE = 0.1
"""... and at most this share of the distance from HF without FP8 keys and values (measured
0.36 to 0.59 nats)."""
BEST_TOL = 0.25
"""Each chosen token's oracle logprob within this of the oracle's best at its position: ours
is greedy on logits within the rounding above (measured gaps: 0 to 0.07)."""


def fp8_kv_attention(module: Any, query: Any, key: Any, value: Any, mask: Any, **kw: Any) -> Any:
    """HF's SDPA attention over keys and values rounded to float8_e4m3fn."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float8_e4m3fn).to(t.dtype)

    return sdpa_attention_forward(module, query, rounded(key), rounded(value), mask, **kw)


@pytest.fixture(scope="module")
def fp8_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path
) -> Callable[[str, str], Path]:
    root = tmp_path_factory.mktemp("spyre-fp8")
    built: dict[tuple[str, str], Path] = {}

    def make(arch: str, scheme: str) -> Path:
        if (arch, scheme) not in built:
            source = root / arch
            if not source.exists():
                build_checkpoint(ARCHITECTURES[arch], source, smollm2_path)
            per_channel, inputs = (SCHEMES | REFUSED_SCHEME)[scheme]
            target = root / f"{arch}-{scheme}"
            built[arch, scheme] = quantize(
                source, target, per_channel=per_channel, inputs=inputs, prompts=PROMPTS
            )
        return built[arch, scheme]

    return make


def spyre_engine(path: Path, **overrides: Any) -> Any:
    config = load_config(environ={}, overrides=ENGINE | overrides)
    loaded = load_model(
        path, torch.float32, fused_weights=False, fp8_scale_dtype=fp8_scale_dtype_for(config)
    )
    return build_engine(config, loaded)


def greedy(engine: Any) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    return LLM(engine).generate(PROMPTS, params)


@pytest.mark.parametrize(
    ("arch", "scheme", "backend"),
    [
        ("llama", "tensor-static", "eager"),
        ("llama", "channel-dynamic", "eager"),
        ("llama", "tensor-none", "eager"),
        ("granite", "tensor-static", "eager"),
        ("granite", "channel-dynamic", "eager"),
        ("llama", "channel-dynamic", "inductor"),
    ],
)
def test_fp8_programs_compute_hf_with_an_fp8_kv_cache(
    arch: str, scheme: str, backend: str, fp8_checkpoint: Callable[[str, str], Path]
) -> None:
    from fms_mo.aiu_addons.fp8.fp8_linear import FP8Linear
    from fms_mo.aiu_addons.fp8.fp8_utils import ScaledTensor
    from transformers import AttentionInterface

    path = fp8_checkpoint(arch, scheme)
    engine = spyre_engine(path, **{"model.compile_backend": backend})
    runner = engine.runner
    model = runner.model
    projections = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert projections and [m for m in model.modules() if isinstance(m, torch.nn.Linear)] == [
        model.head
    ]
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in projections)
    assert all(m.weight_scale.dtype == torch.float32 for m in projections)
    for key, value in runner.kv_caches:
        assert isinstance(key, ScaledTensor) and isinstance(value, ScaledTensor)
        assert key.dtype == value.dtype == torch.float8_e4m3fn
    outputs = greedy(engine)
    assert all(o.error is None for o in outputs)

    AttentionInterface.register("fp8_kv", fp8_kv_attention)
    hf_fp8_kv = oracle.load(path, torch.float32, _attn_implementation="fp8_kv")
    hf_plain = oracle.load(path, torch.float32)
    distance, control = [], []
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ours = [entry.logprob for entry in output.logprobs]
        scored = oracle.score(hf_fp8_kv, prompt, output.token_ids)
        plain = oracle.score(hf_plain, prompt, output.token_ids).chosen
        distance += [abs(a - b) for a, b in zip(ours, scored.chosen, strict=True)]
        control += [abs(a - b) for a, b in zip(ours, plain, strict=True)]
        gaps = [best - chosen for best, chosen in zip(scored.best, scored.chosen, strict=True)]
        assert max(gaps) <= BEST_TOL, (prompt[:4], gaps)
    mean, mean_control = statistics.mean(distance), statistics.mean(control)
    print(
        f"{arch} {scheme} {backend}: mean |ours - oracle| {mean:.2e}, without FP8 KV {mean_control:.2e}"
    )
    assert mean <= MEAN_TOL
    assert mean <= KV_SHARE * mean_control


def test_decode_batches_of_one_run_as_two_and_warmup_covers_every_batch(
    fp8_checkpoint: Callable[[str, str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="spyre_server"):
        engine = spyre_engine(fp8_checkpoint("llama", "tensor-static"))
    assert "KV cache: 48 blocks of 64 tokens (torch.float8_e4m3fn)" in caplog.text
    stats = engine.runner.program_stats()
    assert stats.warmed == {ProgramShape("prefill", "1x128")} | {
        ProgramShape("decode", f"{b}x1") for b in (2, 3, 4)
    }
    assert stats.graphs == {"prefill": 1, "decode": 1}
    outputs = greedy(engine)
    stats = engine.runner.program_stats()
    assert stats.num_steps[ProgramShape("decode", "3x1")] > 0  # a batch warm-up did not run
    assert stats.graphs_after_warmup == 0
    # One request alone: each of its decodes is a batch of 1, run as 2 (a 1x1 program would
    # fail the step: it is not among the warmed ones).
    before = stats.num_steps[ProgramShape("decode", "2x1")]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (alone,) = LLM(engine).generate([PROMPTS[0]], params)
    stats = engine.runner.program_stats()
    assert stats.num_steps[ProgramShape("decode", "2x1")] - before == MAX_TOKENS - 1
    assert stats.graphs_after_warmup == 0
    # ... and gets the tokens it got in a batch: the padded row changes nothing.
    assert alone.error is None and alone.token_ids == outputs[0].token_ids


def test_fp8_layer_pad_row_and_unit_scales() -> None:
    """The padded decode step repeats its one row; a longer batch and a prefill pass as they
    are. Unit scales are set per row of the step, marked applied."""
    from spyre_server.model.spyre.inputs import SpyreInputs

    one = SpyreInputs("decode", [[5]], [[70]], [[134]], [[2, 3]], [71], [0], 0)
    padded = fp8.padded_decode(one)
    assert padded.input_ids == [[5], [5]] and padded.slot_mapping == [[134], [134]]
    assert padded.block_table == [[2, 3], [2, 3]] and padded.current_tkv == [71, 71]
    assert padded.position_ids == [[70], [70]] and padded.left_padding == [0, 0]
    two = SpyreInputs(
        "decode", [[5], [6]], [[1], [2]], [[65], [130]], [[1], [2]], [2, 3], [0, 0], 0
    )
    assert fp8.padded_decode(two) is two
    blocks = torch.zeros(3, 64, 1, 8, dtype=torch.float8_e4m3fn)
    caches = fp8.scaled_kv_caches([(blocks, blocks)], 4)
    key, value = caches[0]
    assert fp8.cache_blocks(key) is blocks  # shared, not copied
    assert key._scale.tolist() == [1.0] * 4 and not key._scaled
    assert fp8.scaled_kv_caches([(blocks, blocks)], 1)[0][0]._scale.tolist() == [1.0, 1.0]
    fp8.set_unit_scales(caches, 2)
    assert key._scale.tolist() == value._scale.tolist() == [1.0, 1.0]
    assert key._scaled and value._scaled
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8.scaled_kv_caches([(torch.zeros(1, 64, 1, 8),) * 2], 2)


def test_scales_load_in_float32_for_the_card(fp8_checkpoint: Callable[[str, str], Path]) -> None:
    """The card's float16 would round small scales (a weight scale below 6e-5 is subnormal
    there); the spyre backend loads them in float32, exactly the checkpoint's values."""
    from safetensors.torch import load_file

    from spyre_server.model.fp8 import Fp8Linear

    path = fp8_checkpoint("llama", "channel-dynamic")
    spyre = load_config(environ={}, overrides={"model.backend": "spyre"})
    assert fp8_scale_dtype_for(spyre) == torch.float32
    assert fp8_scale_dtype_for(load_config(environ={}, overrides={})) is None
    loaded = load_model(path, torch.float16, fused_weights=False, fp8_scale_dtype=torch.float32)
    layer = loaded.model.base_model.layers[0].ff_sub_layer.w2
    assert isinstance(layer, Fp8Linear) and layer.weight_scale.dtype == torch.float32
    stored = load_file(path / "model.safetensors")["model.layers.0.mlp.down_proj.weight_scale"]
    assert torch.equal(layer.weight_scale, stored.float().reshape(-1))


@pytest.mark.parametrize(
    ("arch", "scheme", "overrides", "named"),
    [
        ("llama", "tensor-static", {"scheduler.max_num_seqs": 1}, "max_num_seqs of at least 2"),
        ("llama", "channel-static", {}, "per-channel weight scales and a static input scale"),
        ("mistral-swa", "tensor-static", {}, "sliding window"),
        ("llama", "tensor-static", {"model.tensor_parallel_size": 2}, "tensor_parallel_size"),
    ],
)
def test_what_the_reference_cannot_run_is_refused_at_start(
    arch: str,
    scheme: str,
    overrides: dict[str, Any],
    named: str,
    fp8_checkpoint: Callable[[str, str], Path],
) -> None:
    with pytest.raises(ModelLoadError, match=named):
        spyre_engine(fp8_checkpoint(arch, scheme), **overrides)


def test_without_the_addon_the_start_names_it(
    fp8_checkpoint: Callable[[str, str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in fp8.ADDON_MODULES:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ModelLoadError, match=re.escape(fp8.ADDON_REQUIREMENT)):
        spyre_engine(fp8_checkpoint("llama", "tensor-static"))
