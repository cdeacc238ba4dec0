"""The cpu decoders on the families other than fms's LLaMA (``decoders/base.py``'s ``FAMILIES``):
Granite (embedding, residual and attention multipliers, logits scaling), Mistral (with and
without a sliding window) and Qwen3 (unfused projections, per-head query and key norms).

Oracles: fms's forward over the same modules and attention kernel (the same ops in the same
order: the logits and the KV writes must be the same bits), on every decoder path that covers
the family, in float32 and bfloat16; and HF transformers' own float32 greedy tokens on a tiny
random Granite checkpoint.
"""

from __future__ import annotations

import copy
import logging
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from fms.models import get_model

from spyre_server.model.cpu.decoders.aten import AtenDecoder
from spyre_server.model.cpu.decoders.aten import unsupported_reason as aten_reason
from spyre_server.model.cpu.decoders.base import Scalars
from spyre_server.model.cpu.decoders.native import NativeDecoder
from spyre_server.model.cpu.decoders.native import unsupported_reason as native_reason
from spyre_server.model.cpu.decoders.native_bf16 import NativeBf16Decoder
from spyre_server.model.cpu.decoders.native_bf16 import unsupported_reason as bf16_reason
from spyre_server.model.cpu.prepare import cpu_attention_kernel, cpu_decoder, cpu_inference_copy
from spyre_server.model.cpu.runner import CpuModelRunner
from spyre_server.model.loading import load_model
from tests.conftest import needs_native_kernels
from tests.spyre_server.model.cpu.test_aten_decoder import bf16_linear_kernel
from tests.spyre_server.model.cpu.test_native_decoder import replayed_on_fms
from tests.spyre_server.model.test_model_correctness import BS, Harness, rand_tokens

pytestmark = needs_native_kernels

SHAPE: dict[str, Any] = {
    "emb_dim": 256,
    "nheads": 4,
    "kvheads": 2,
    "head_dim": 64,
    "nlayers": 3,
    "src_vocab_size": 256,
    "hidden_grow_factor": 2.0,
    "multiple_of": 64,
    "max_expected_seq_len": 1024,
}
"""Micro models of every family: head_dim 64 (the native attention's), GQA 4:2, 3 layers."""

FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (fms architecture, variant whose config the micro model keeps, overrides)
    "granite": ("granite", "8b", {}),  # granite-3.x-8b's multipliers and tied embeddings
    "mistral": ("mistral", "7b", {"sliding_window": None}),
    "mistral-window": ("mistral", "7b", {"sliding_window": 100}),  # shorter than the prompts
    "qwen3": ("qwen3", "0.6b", {}),  # unfused QKV and GLU, per-head q/k norms
}


def micro(family: str) -> torch.nn.Module:
    architecture, variant, overrides = FAMILIES[family]
    torch.manual_seed(21)
    return get_model(architecture, variant, data_type=torch.float32, **SHAPE, **overrides).eval()


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    """Each family's micro model, float32, built once."""
    return {family: micro(family) for family in FAMILIES}


def cpu_copy(model: torch.nn.Module, dtype: torch.dtype, linear_kernel: str) -> torch.nn.Module:
    source = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    return cpu_inference_copy(source, linear_kernel=linear_kernel, dtype=dtype)  # type: ignore[arg-type]


def two_families_short(h: Harness) -> None:
    """Four requests in two families sharing 130-token prompts: chunked prefills with cache hits
    (chunk 64), decode batches of both families."""
    prefixes = [rand_tokens(130, seed=700), rand_tokens(130, seed=701)]
    for i, suffix_len in enumerate((1, 40, 70, 100)):
        h.add(f"r{i}", prefixes[i % 2] + rand_tokens(suffix_len, seed=750 + i), 10)


PATHS = {
    "native": (NativeDecoder, torch.float32, "native", "native"),
    "native-bf16": (NativeBf16Decoder, torch.bfloat16, "native", "auto"),  # the defaults
    "native-bf16-onednn": (NativeBf16Decoder, torch.bfloat16, None, "auto"),
    "native-bf16-flash": (NativeBf16Decoder, torch.bfloat16, None, "flash"),
    "aten-onednn": (AtenDecoder, torch.float32, "onednn", "native"),
    "aten-native-linear-flash": (AtenDecoder, torch.float32, "native", "flash"),
    "aten-bf16-mixed": (AtenDecoder, torch.bfloat16, None, "mixed"),
    "aten-bf16": (AtenDecoder, torch.bfloat16, "native", "auto"),
}
"""Decoder paths: (decoder, dtype, linear kernel (None: oneDNN where it computes bfloat16 here),
attention kernel)."""
COVERS = {
    "granite": list(PATHS),
    "mistral": ["native", "native-bf16", "aten-onednn"],
    "mistral-window": ["native", "native-bf16-flash", "aten-onednn"],
    "qwen3": ["aten-onednn", "aten-native-linear-flash", "aten-bf16", "aten-bf16-mixed"],
}


@pytest.mark.parametrize(
    ("family", "path"),
    [pytest.param(f, p, id=f"{f}-{p}") for f, paths in COVERS.items() for p in paths],
)
def test_every_step_is_the_fms_forward_bit_for_bit(
    models: dict[str, torch.nn.Module], family: str, path: str
) -> None:
    """Each step of a run (chunked prefills with cache hits, decode batches of both families),
    replayed on fms's forward over the same modules and attention kernel from the same cache:
    the same logits and the same cache afterwards, bit for bit."""
    decoder_type, dtype, linear_kernel, attention_kernel = PATHS[path]
    model = cpu_copy(models[family], dtype, linear_kernel or bf16_linear_kernel())
    attention = cpu_attention_kernel(attention_kernel, dtype=dtype, head_dim=64)  # type: ignore[arg-type]
    decoder = decoder_type(model, attention)
    window = getattr(model.config, "sliding_window", None)  # every step's plan carries it
    fms_runner = CpuModelRunner(
        model,
        num_blocks=64,
        block_size=BS,
        dtype=dtype,
        attention=attention,
        sliding_window=window,
    )
    kinds: set[tuple[str, int]] = set()
    h = Harness(
        model,
        chunk_size=64,
        max_num_seqs=4,
        check=replayed_on_fms(fms_runner, kinds),
        attention=attention,
        decoder=decoder,
        dtype=dtype,
        sliding_window=window,
    )
    two_families_short(h)
    with torch.inference_mode():
        h.run()
    assert max(h.decode_batch_sizes()) == 4
    assert ("DecodeBatch", 1) in kinds and ("PrefillChunk", 1) in kinds


def test_granite_scalars_are_read_from_the_model(models: dict[str, torch.nn.Module]) -> None:
    """The decoders apply Granite's scalars (the micro model keeps granite-8b's) and no other
    family's: a mutation check that the multipliers are not 1 (which would hide a missing op)."""
    assert Scalars.of(models["granite"]) == Scalars(12.0, 0.22, 16.0)
    assert models["granite"].base_model.layers[0].attn.scale_factor == 0.0078125
    for family in ("mistral", "qwen3"):
        assert Scalars.of(models[family]) == Scalars()


def test_cpu_decoder_picks_the_fast_paths_for_each_family(
    models: dict[str, torch.nn.Module], caplog: pytest.LogCaptureFixture
) -> None:
    """Granite and Mistral get the native decoders like fms's LLaMA; Qwen3 (unfused projections,
    per-head norms) the aten decoder, and the log says why not the native ones."""
    caplog.set_level(logging.INFO, logger="spyre_server.model.cpu.prepare")
    f32_attention = cpu_attention_kernel("native", dtype=torch.float32, head_dim=64)
    bf16_attention = cpu_attention_kernel("auto", dtype=torch.bfloat16, head_dim=64)
    for family in ("granite", "mistral", "mistral-window"):
        native = cpu_copy(models[family], torch.float32, "native")
        assert isinstance(cpu_decoder(native, f32_attention), NativeDecoder)
        assert isinstance(cpu_decoder(native, None), AtenDecoder)
        for linear_kernel in ("native", bf16_linear_kernel()):
            bf16 = cpu_copy(models[family], torch.bfloat16, linear_kernel)
            assert isinstance(cpu_decoder(bf16, bf16_attention), NativeBf16Decoder)
    qwen3 = cpu_copy(models["qwen3"], torch.float32, "native")
    assert isinstance(cpu_decoder(qwen3, f32_attention), AtenDecoder)
    assert "not one fused projection without per-head norms" in caplog.text
    qwen3_bf16 = cpu_copy(models["qwen3"], torch.bfloat16, "native")
    assert isinstance(cpu_decoder(qwen3_bf16, bf16_attention), AtenDecoder)


def test_what_the_decoders_do_not_cover_gets_a_reason(models: dict[str, torch.nn.Module]) -> None:
    """Refused, each with its reason, so that fms's forward runs the model: another model class
    (GPT-BigCode), dropout, a granite whose QKV is unfused (the native decoders fuse nothing),
    and a model that is not a cpu copy."""
    torch.manual_seed(0)
    bigcode = get_model("gpt_bigcode", "micro", data_type=torch.float32)
    bigcode_copy = cpu_copy(bigcode, torch.float32, "native")
    for reason in (aten_reason, native_reason, bf16_reason):
        assert "GPTBigCode is not fms's LLaMA, Granite, Mistral or Qwen3" in str(
            reason(bigcode_copy)
        )
    assert cpu_decoder(bigcode_copy, None) is None
    dropout = cpu_copy(micro("granite"), torch.float32, "native")
    dropout.config.p_dropout = 0.1
    assert aten_reason(dropout) == "the model has dropout"
    assert "not the fast RMS norm" in str(aten_reason(models["granite"]))
    unfused = copy.deepcopy(models["granite"])
    for layer in unfused.base_model.layers:
        layer.attn.in_proj = layer.attn.in_proj.unfuse_weights()
    unfused_copy = cpu_copy(unfused, torch.float32, "native")
    assert aten_reason(unfused_copy) is None
    assert native_reason(unfused_copy) == (
        "an attention's QKV is not one fused projection without per-head norms"
    )


# ------------------------------------------------------------------ against HF transformers
GRANITE_HF = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "rope_theta": 10000000.0,
    # granite-3.3-8b-instruct's (attention_multiplier 1/128 there, with head_dim 128)
    "embedding_multiplier": 12.0,
    "residual_multiplier": 0.22,
    "attention_multiplier": 0.0078125,
    "logits_scaling": 16.0,
}
EMBEDDING_STD = 0.002
"""Tied random embeddings favour repeating the input token; with embedding_multiplier 12 they
are small, and the final norm's gain makes the logits' spread."""
LOGIT_STD = 3.0
QK_GAIN = 6.0
"""The queries and keys are this many times what fan-in scaling gives: attention_multiplier is
1/128, not 1/sqrt(64), and the attention must depend on positions for RoPE to be tested."""
MIN_MARGIN = 1e-3
"""Every greedy step of the HF oracle has its top two logits at least this far apart, so exact
token equality is a fair demand of float32 arithmetic in another order."""


def granite_checkpoint(directory: Path) -> Any:
    """A random-weight HF Granite saved into ``directory``; returns HF's model (float32)."""
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    model = GraniteForCausalLM(GraniteConfig(**GRANITE_HF)).eval()
    hidden = GRANITE_HF["hidden_size"]
    head_std = LOGIT_STD * GRANITE_HF["logits_scaling"] / math.sqrt(hidden)
    generator = torch.Generator().manual_seed(30)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if param is model.get_input_embeddings().weight:
                value = noise * EMBEDDING_STD
            elif param.ndim == 1:  # norm weights around 1, the final one sets the logits' spread
                gain = head_std / EMBEDDING_STD if name == "model.norm.weight" else 1.0
                value = gain * (1.0 + 0.1 * noise)
            else:
                value = noise / math.sqrt(param.shape[-1])
                if "q_proj" in name or "k_proj" in name:
                    value = value * QK_GAIN
            param.copy_(value)
    model.save_pretrained(directory, safe_serialization=True)
    return model


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """HF's greedy tokens (a full forward per token, no cache) and the smallest top-2 margin."""
    ids, margin = list(prompt), math.inf
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1]
        top = torch.topk(logits, 2)
        margin = min(margin, float(top.values[0] - top.values[1]))
        ids.append(int(top.indices[0]))
    return ids[len(prompt) :], margin


@pytest.mark.parametrize("path", ["native", "aten-onednn"])
def test_granite_greedy_tokens_are_hf_transformers(
    tmp_path: Path, smollm2_path: Path, path: str, one_thread: None
) -> None:
    """A tiny random Granite checkpoint loaded as the server loads it and served on the decoder
    (chunked prefills with prefix-cache hits, decode batches): HF's float32 greedy tokens."""
    hf = granite_checkpoint(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # load_model loads one
        shutil.copy(smollm2_path / name, tmp_path / name)
    loaded = load_model(tmp_path, torch.float32)
    decoder_type, _, linear_kernel, attention_kernel = PATHS[path]
    model = cpu_copy(loaded.model, torch.float32, str(linear_kernel))
    attention = cpu_attention_kernel(attention_kernel, dtype=torch.float32, head_dim=64)  # type: ignore[arg-type]
    decoder = decoder_type(model, attention)
    h = Harness(model, chunk_size=64, max_num_seqs=4, attention=attention, decoder=decoder)
    vocab = GRANITE_HF["vocab_size"]
    shared = rand_tokens(100, seed=40, vocab=vocab)
    prompts = [
        rand_tokens(9, seed=41, vocab=vocab),
        shared + rand_tokens(60, seed=42, vocab=vocab),
        shared + rand_tokens(5, seed=43, vocab=vocab),
        rand_tokens(200, seed=44, vocab=vocab),
    ]
    for i, prompt in enumerate(prompts):
        h.add(f"r{i}", prompt, 8)
    with torch.inference_mode():
        h.run()
    for i, prompt in enumerate(prompts):
        want, margin = hf_greedy(hf, prompt, 8)
        assert margin >= MIN_MARGIN
        assert h.traces[f"r{i}"].tokens == want, f"prompt {i}"
    assert any(t.num_cached_tokens for t in h.traces.values())  # a prefix-cache hit ran
