"""The native bfloat16 decoder (``native_bf16_decoder.py``): a bfloat16 model's steps with one
native call between projections.

Oracles: fms's forward over the same modules and attention kernel (the kernels round where fms's
ops round: the logits and the KV writes must be the same bits), and a plain full forward of the
unconverted float32 model (``BF16_LOGIT_TOL``).
"""

from __future__ import annotations

import pytest
import torch

from spyre_server.model.cpu.decoders.native_bf16 import NativeBf16Decoder, unsupported_reason
from spyre_server.model.cpu.prepare import cpu_attention_kernel, cpu_decoder
from spyre_server.model.cpu.runner import CpuModelRunner
from tests.conftest import needs_amx, needs_avx512_bf16, needs_native_kernels
from tests.spyre_server.model.cpu.test_aten_decoder import (
    BF16_LOGIT_TOL,
    bf16_linear_kernel,
    copy_of,
    model64,  # noqa: F401  (the fixture)
)
from tests.spyre_server.model.cpu.test_native_decoder import (
    assert_bad_slots_refused,
    replayed_on_fms,
    two_families,
)
from tests.spyre_server.model.test_model_correctness import (
    BS,
    LOGIT_TOL,
    Harness,
    full_forward_logits,
    max_abs,
)

pytestmark = needs_native_kernels


@pytest.fixture(scope="module")
def bf16_copy(model64: torch.nn.Module) -> torch.nn.Module:  # noqa: F811
    return copy_of(model64, torch.bfloat16, bf16_linear_kernel())


@pytest.mark.parametrize(
    "attention_kernel",
    [
        "auto",
        "native",
        "mixed",
        "flash",
        pytest.param("amx", marks=needs_amx),
        pytest.param("avx512_bf16", marks=needs_avx512_bf16),
    ],
)
def test_every_step_is_the_fms_forward_bit_for_bit(
    bf16_copy: torch.nn.Module, attention_kernel: str
) -> None:
    """Each step of a run (chunked prefills with cache hits, decode batches of both families),
    replayed on fms's forward over the same modules and attention kernel from the same cache:
    the same logits and the same cache afterwards, bit for bit."""
    attention = cpu_attention_kernel(attention_kernel, dtype=torch.bfloat16, head_dim=64)  # type: ignore[arg-type]
    fms_runner = CpuModelRunner(
        bf16_copy, num_blocks=64, block_size=BS, dtype=torch.bfloat16, attention=attention
    )
    kinds: set[tuple[str, int]] = set()
    h = Harness(
        bf16_copy,
        chunk_size=128,
        max_num_seqs=5,
        check=replayed_on_fms(fms_runner, kinds),
        attention=attention,
        decoder=NativeBf16Decoder(bf16_copy, attention),
        dtype=torch.bfloat16,
    )
    two_families(h)
    with torch.inference_mode():
        h.run()
    assert max(h.decode_batch_sizes()) == 5
    assert ("DecodeBatch", 1) in kinds and ("PrefillChunk", 1) in kinds


def test_the_steps_equal_full_forwards(
    model64: torch.nn.Module,  # noqa: F811
    bf16_copy: torch.nn.Module,
    one_thread: None,
) -> None:
    """Against the independent oracle: every logit row of every request is a plain fms forward
    of the row's tokens on the unconverted float32 model, to bfloat16's precision."""
    attention = cpu_attention_kernel("auto", dtype=torch.bfloat16, head_dim=64)
    h = Harness(
        bf16_copy,
        chunk_size=128,
        max_num_seqs=5,
        attention=attention,
        decoder=NativeBf16Decoder(bf16_copy, attention),
        dtype=torch.bfloat16,
    )
    two_families(h)
    worst = 0.0
    with torch.inference_mode():
        h.run()
        for trace in h.traces.values():
            for i, row in enumerate(trace.logits):
                want = full_forward_logits(model64, trace.prompt + trace.tokens[:i])
                worst = max(worst, max_abs(row, want))
    assert LOGIT_TOL < worst <= BF16_LOGIT_TOL


def test_slots_outside_the_cache_are_refused_before_any_write(
    bf16_copy: torch.nn.Module,
) -> None:
    """The KV store writes through raw pointers: a bad slot must be an error, not a write past
    the cache."""
    assert_bad_slots_refused(NativeBf16Decoder(bf16_copy), bf16_copy, torch.bfloat16)


def test_cpu_decoder_picks_it_for_bfloat16_only(
    model64: torch.nn.Module,  # noqa: F811
    bf16_copy: torch.nn.Module,
) -> None:
    attention = cpu_attention_kernel("auto", dtype=torch.bfloat16, head_dim=64)
    assert isinstance(cpu_decoder(bf16_copy, attention), NativeBf16Decoder)
    assert isinstance(cpu_decoder(bf16_copy, None), NativeBf16Decoder)
    f32 = copy_of(model64, torch.float32, "onednn")
    assert unsupported_reason(f32) is not None
    assert not isinstance(cpu_decoder(f32, None), NativeBf16Decoder)
