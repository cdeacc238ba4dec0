"""The native decoder (``native_decoder.py``): the cpu runner's steps without fms's modules.

Oracles: fms's forward over the same native modules (the same kernels in the same order: the
logits and the KV writes must be the same bits), and a plain full forward of the fms model
(float32 rounding of the native kernels: ``LOGIT_TOL``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from fms.models import get_model

from scheduler import ScheduledStep
from spyre_server.model.cpu.decoders.native import NativeDecoder, unsupported_reason
from spyre_server.model.cpu.kernels.library import default_kernel_dir, load_native_kernels
from spyre_server.model.cpu.ops.native_attention import NativePagedAttention
from spyre_server.model.cpu.paged_attention import (
    AttentionPlan,
    paged_attention_kwargs,
    plan_attention,
)
from spyre_server.model.cpu.prepare import cpu_decoder, cpu_inference_copy
from spyre_server.model.cpu.runner import CpuModelRunner, StepDecoder
from spyre_server.model.runner import KVCaches, ModelRunner
from tests.conftest import needs_native_kernels
from tests.spyre_server.model.test_model_correctness import (
    BS,
    LOGIT_TOL,
    Harness,
    StepCheck,
    full_forward_logits,
    max_abs,
    rand_tokens,
)

pytestmark = needs_native_kernels


@pytest.fixture(scope="module")
def model64() -> torch.nn.Module:
    """A micro llama with head_dim 64 (the suite's tiny llama has 48, which the native attention
    does not compute): 4 query heads over 2 KV heads, 5 layers."""
    torch.manual_seed(11)
    return get_model(
        "llama", "micro", data_type=torch.float32, nheads=4, kvheads=2, emb_dim=256
    ).eval()


@pytest.fixture(scope="module")
def native64(model64: torch.nn.Module) -> torch.nn.Module:
    return cpu_inference_copy(model64, linear_kernel="native", dtype=torch.float32)


@pytest.fixture
def attention() -> NativePagedAttention:
    return NativePagedAttention(load_native_kernels(default_kernel_dir()))


def two_families(h: Harness) -> None:
    """Five requests in two families sharing 256-token prompts: chunked prefills with cache hits,
    decode batches of both families."""
    prefixes = [rand_tokens(256, seed=900), rand_tokens(256, seed=901)]
    for i, suffix_len in enumerate((1, 30, 64, 100, 150)):
        h.add(f"r{i}", prefixes[i % 2] + rand_tokens(suffix_len, seed=950 + i), 12)


def replayed_on_fms(fms_runner: CpuModelRunner, kinds: set[tuple[str, int]]) -> StepCheck:
    """A step check: the step replayed on ``fms_runner`` (fms's forward) from the cache as it
    was before the step must give the same logits and leave the same cache, bit for bit; each
    step's kind and number of row groups go into ``kinds``."""

    def same_as_fms(
        step: ScheduledStep, before: KVCaches, logits: torch.Tensor | None, runner: ModelRunner
    ) -> None:
        fms_runner.kv_caches = [(k.clone(), v.clone()) for k, v in before]
        want = fms_runner.compute_logits(step)
        assert (logits is None) == (want is None)
        if logits is not None:
            assert logits.dtype == want.dtype and torch.equal(logits, want)
        for (k, v), (want_k, want_v) in zip(runner.kv_caches, fms_runner.kv_caches, strict=True):
            assert torch.equal(k, want_k) and torch.equal(v, want_v)
        kinds.add((type(step).__name__, len(_plan_of(step).groups)))

    return same_as_fms


def test_every_step_is_the_fms_forward_bit_for_bit(
    native64: torch.nn.Module, attention: NativePagedAttention
) -> None:
    """Each step of a run, replayed on fms's forward over the same native modules from the same
    cache: the same logits and the same cache afterwards, bit for bit."""
    fms_runner = CpuModelRunner(
        native64, num_blocks=64, block_size=BS, dtype=torch.float32, attention=attention
    )
    kinds: set[tuple[str, int]] = set()
    h = Harness(
        native64,
        chunk_size=128,
        max_num_seqs=5,
        check=replayed_on_fms(fms_runner, kinds),
        attention=attention,
        decoder=NativeDecoder(native64, attention),
    )
    two_families(h)
    with torch.inference_mode():
        h.run()
    assert max(h.decode_batch_sizes()) == 5
    assert ("DecodeBatch", 1) in kinds and ("PrefillChunk", 1) in kinds


def _plan_of(step: ScheduledStep) -> AttentionPlan:
    from scheduler import DecodeBatch

    if isinstance(step, DecodeBatch):
        return plan_attention(
            [e.block_table for e in step.entries], [[e.position] for e in step.entries], BS
        )
    return plan_attention([step.block_table], [step.positions], BS)


def test_the_steps_equal_full_forwards(
    model64: torch.nn.Module,
    native64: torch.nn.Module,
    attention: NativePagedAttention,
    one_thread: None,
) -> None:
    """Against the independent oracle: every logit row of every request equals a plain fms
    forward of the row's tokens on the unconverted model."""
    h = Harness(
        native64,
        chunk_size=128,
        max_num_seqs=5,
        attention=attention,
        decoder=NativeDecoder(native64, attention),
    )
    two_families(h)
    with torch.inference_mode():
        h.run()
        for trace in h.traces.values():
            for i, row in enumerate(trace.logits):
                want = full_forward_logits(model64, trace.prompt + trace.tokens[:i])
                assert max_abs(row, want) <= LOGIT_TOL


def test_every_position_of_a_chunk_as_fms_computes_it(
    native64: torch.nn.Module, attention: NativePagedAttention
) -> None:
    """``last_n_tokens`` over a whole 70-token chunk (the prompt-logits path), a single row, and
    none (a chunk that samples nothing: the KV only), against fms's forward with the
    paged-attention op, from the same empty cache."""
    decoder = NativeDecoder(native64, attention)
    positions = list(range(70))
    ids = torch.tensor([rand_tokens(70, seed=5)])
    slots = torch.arange(BS, BS + 70)  # blocks 1 and 2
    plan = plan_attention([[1, 2]], [positions], BS)
    runner = CpuModelRunner(native64, num_blocks=4, block_size=BS, dtype=torch.float32)
    with torch.inference_mode():
        for last_n in (70, 1, 0):
            caches = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in runner.kv_caches]
            got = decoder(ids, torch.tensor([positions]), slots, plan, caches, last_n)
            want_caches = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
            want, _ = native64(
                ids,
                position_ids=torch.tensor([positions]),
                past_key_value_states=want_caches,
                use_cache=True,
                last_n_tokens=max(last_n, 1),
                **paged_attention_kwargs(slots, plan, attention),
            )
            if last_n == 0:
                assert got is None
            else:
                assert got is not None
                assert got.shape == (1, last_n, native64.config.src_vocab_size)
                assert torch.equal(got, want)
            for (k, v), (want_k, want_v) in zip(caches, want_caches, strict=True):
                assert torch.equal(k, want_k) and torch.equal(v, want_v)


def test_only_the_prompts_last_chunk_runs_the_lm_head(
    native64: torch.nn.Module, attention: NativePagedAttention, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the decoder, a 150-token prompt in 64-token chunks: the two chunks that sample nothing
    write their KV without the LM head, the last chunk and each decode step run it once; the
    logits are the oracle's. (fms's forward, without a decoder, always runs it.)"""
    head_rows: list[int] = []
    head_forward = native64.head.forward

    def counted(x: torch.Tensor) -> torch.Tensor:
        head_rows.append(x.shape[-2])
        return head_forward(x)

    prompt = rand_tokens(150, seed=9)
    decoder = NativeDecoder(native64, attention)
    h = Harness(native64, chunk_size=64, attention=attention, decoder=decoder)
    h.add("r", prompt, max_tokens=3)
    monkeypatch.setattr(native64.head, "forward", counted)
    with torch.inference_mode():
        h.run()
    assert head_rows == [1, 1, 1]  # the last chunk, then two decode steps
    trace = h.traces["r"]
    for i, row in enumerate(trace.logits):  # the oracle's forwards run the head too: after
        want = full_forward_logits(native64, trace.prompt + trace.tokens[:i])
        assert max_abs(row, want) <= LOGIT_TOL


def test_models_it_does_not_cover_get_a_reason(
    tiny_llama: torch.nn.Module,
    model64: torch.nn.Module,
    native64: torch.nn.Module,
    attention: NativePagedAttention,
) -> None:
    assert unsupported_reason(native64) is None
    tiny = cpu_inference_copy(tiny_llama, linear_kernel="native", dtype=torch.float32)
    assert unsupported_reason(tiny) == "head_dim 48 (the native attention computes 64 and 128)"
    onednn = cpu_inference_copy(model64, linear_kernel="onednn", dtype=torch.float32)
    assert "not the native RMS norm" in str(unsupported_reason(onednn))
    assert "not fms's LLaMA" in str(unsupported_reason(native64.base_model))
    uneven = cpu_inference_copy(model64, linear_kernel="native", dtype=torch.float32)
    uneven.base_model.layers[1].attn.scale_factor = 0.5  # the decoder reads the first layer's
    assert (
        unsupported_reason(uneven) == "the layers differ in heads, sizes, scale or rotary embedding"
    )
    with pytest.raises(ValueError, match="head_dim 48"):
        NativeDecoder(tiny, attention)


def test_cpu_decoder_says_why_it_is_not_used(
    tiny_llama: torch.nn.Module,
    native64: torch.nn.Module,
    attention: NativePagedAttention,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="spyre_server.model.cpu.prepare")
    assert isinstance(cpu_decoder(native64, attention), NativeDecoder)
    assert not isinstance(cpu_decoder(native64, None), NativeDecoder)
    assert "(not native: the attention kernel is flash;" in caplog.text
    tiny = cpu_inference_copy(tiny_llama, linear_kernel="native", dtype=torch.float32)
    assert not isinstance(cpu_decoder(tiny, attention), NativeDecoder)
    assert "head_dim 48" in caplog.text


@pytest.mark.parametrize(("attention_kernel", "uses_decoder"), [("auto", True), ("flash", False)])
def test_the_engine_runs_on_the_decoder_where_it_can(
    model64: torch.nn.Module, attention_kernel: str, uses_decoder: bool
) -> None:
    """With the native kernels (auto on this CPU) the engine's runner has the decoder."""
    from spyre_server.config import load_config
    from spyre_server.engine.factory import build_engine
    from spyre_server.model.loading import LoadedModel
    from tests.spyre_server.conftest import ENGINE_DEFAULTS, VOCAB_SIZE, ByteTokenizer

    overrides = ENGINE_DEFAULTS | {"model.attention_kernel": attention_kernel}
    loaded = LoadedModel(
        path=Path("micro64"),
        name="micro64",
        model=model64,
        tokenizer=ByteTokenizer(),
        dtype=torch.float32,
        eos_token_id=None,
        vocab_size=VOCAB_SIZE,
    )
    engine = build_engine(load_config(environ={}, overrides=overrides), loaded)
    assert isinstance(engine.runner, CpuModelRunner)
    assert isinstance(engine.runner.decoder, NativeDecoder) is uses_decoder


def test_slots_outside_the_cache_are_refused_before_any_write(
    native64: torch.nn.Module, attention: NativePagedAttention
) -> None:
    """The KV scatter writes through raw pointers: a bad slot must be an error, not a write past
    the cache."""
    assert_bad_slots_refused(NativeDecoder(native64, attention), native64, torch.float32)


def assert_bad_slots_refused(
    decoder: StepDecoder, model: torch.nn.Module, dtype: torch.dtype
) -> None:
    """Slots past the cache, negative, or one too few: refused before any write."""
    runner = CpuModelRunner(model, num_blocks=4, block_size=BS, dtype=dtype)
    ids = torch.tensor([[1, 2]])
    plan = plan_attention([[1]], [[0, 1]], BS)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for slots in ([BS, 4 * BS], [-1, BS], [BS]):
        with pytest.raises(ValueError, match=r"slot_mapping must hold 2 slots in 0\.\.255"):
            decoder(ids, torch.tensor([[0, 1]]), torch.tensor(slots), plan, runner.kv_caches, 1)
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_caches_the_scatter_cannot_write_are_refused(
    native64: torch.nn.Module, attention: NativePagedAttention
) -> None:
    """One layer's caches of another shape, or not float32: an error before any write."""
    decoder = NativeDecoder(native64, attention)
    runner = CpuModelRunner(native64, num_blocks=4, block_size=BS, dtype=torch.float32)
    ids, positions, slots = torch.tensor([[1]]), torch.tensor([[0]]), torch.tensor([BS])
    plan = plan_attention([[1]], [[0]], BS)
    key_cache, value_cache = runner.kv_caches[2]
    for bad, match in (
        ((key_cache[:2], value_cache[:2]), "of one shape with 2 heads"),
        ((key_cache.double(), value_cache.double()), "contiguous float32"),
    ):
        caches = list(runner.kv_caches)
        caches[2] = bad
        before = [(k.clone(), v.clone()) for k, v in caches]
        with pytest.raises(ValueError, match=match):
            decoder(ids, positions, slots, plan, caches, 1)
        for (k, v), (k0, v0) in zip(caches, before, strict=True):
            assert torch.equal(k, k0) and torch.equal(v, v0)
