"""The aten decoder (``aten_decoder.py``): the cpu runner's steps without fms's module machinery
wherever the native decoder does not run (bfloat16, the flash attention kernel).

Oracles: fms's forward over the same modules (the same ops in the same order: the logits and
the KV writes must be the same bits), and a plain full forward of the unconverted fms model in
float32 (for a bfloat16 run: ``BF16_LOGIT_TOL``, below).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from fms.models import get_model

from spyre_server.model.cpu.decoders.aten import AtenDecoder, unsupported_reason
from spyre_server.model.cpu.decoders.native import NativeDecoder
from spyre_server.model.cpu.decoders.native_bf16 import NativeBf16Decoder
from spyre_server.model.cpu.errors import LinearKernelError
from spyre_server.model.cpu.kernels.library import default_kernel_dir, load_native_kernels
from spyre_server.model.cpu.ops.native_attention import NativePagedAttention
from spyre_server.model.cpu.ops.native_elementwise import NativeRMSNorm
from spyre_server.model.cpu.ops.packed_linear import check_onednn
from spyre_server.model.cpu.prepare import cpu_attention_kernel, cpu_decoder, cpu_inference_copy
from spyre_server.model.cpu.runner import CpuModelRunner
from tests.conftest import needs_native_kernels
from tests.spyre_server.model.cpu.test_native_decoder import replayed_on_fms, two_families
from tests.spyre_server.model.test_model_correctness import (
    BS,
    LOGIT_TOL,
    Harness,
    full_forward_logits,
    max_abs,
)

BF16_LOGIT_TOL = 0.06
"""A bfloat16 run's logits against the float32 model's: bfloat16 keeps 8 significant bits, so
every weight, activation and KV value is off by up to 2**-9 relative, over 5 layers. Measured:
0.02-0.03 on this model's logits (|logit| < 2.5); a float32 run is within 1e-5."""


def bf16_linear_kernel() -> str:
    """oneDNN where it multiplies bfloat16 here (AMX, AVX512-BF16), else torch's F.linear."""
    try:
        check_onednn(torch.bfloat16)
    except LinearKernelError:
        return "aten"
    return "onednn"


@pytest.fixture(scope="module")
def model64() -> torch.nn.Module:
    """A micro llama with head_dim 64: 4 query heads over 2 KV heads, 5 layers."""
    torch.manual_seed(11)
    return get_model(
        "llama", "micro", data_type=torch.float32, nheads=4, kvheads=2, emb_dim=256
    ).eval()


def copy_of(model: torch.nn.Module, dtype: torch.dtype, linear_kernel: str) -> torch.nn.Module:
    """The cpu backend's copy of ``model`` in ``dtype`` (``model`` itself is left alone)."""
    source = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    return cpu_inference_copy(source, linear_kernel=linear_kernel, dtype=dtype)  # type: ignore[arg-type]


CASES = [
    # (dtype, linear_kernel, attention_kernel): the attention as model.attention_kernel gives it
    pytest.param(torch.bfloat16, bf16_linear_kernel(), "flash", id="bfloat16-flash"),
    pytest.param(torch.bfloat16, bf16_linear_kernel(), "mixed", id="bfloat16-mixed"),
    pytest.param(torch.float32, "onednn", "flash", id="float32-onednn-flash"),
    pytest.param(torch.float32, "onednn", "native", id="float32-onednn-native"),
    pytest.param(torch.float32, "native", "flash", id="float32-native-linear-flash"),
]


@needs_native_kernels
@pytest.mark.parametrize(("dtype", "linear_kernel", "attention_kernel"), CASES)
def test_every_step_is_the_fms_forward_bit_for_bit(
    model64: torch.nn.Module, dtype: torch.dtype, linear_kernel: str, attention_kernel: str
) -> None:
    """Each step of a run (chunked prefills with cache hits, decode batches of both families),
    replayed on fms's forward over the same modules and attention kernel from the same cache:
    the same logits and the same cache afterwards, bit for bit."""
    cpu_copy = copy_of(model64, dtype, linear_kernel)
    if dtype == torch.bfloat16:
        assert type(cpu_copy.base_model.dec_norm) is NativeRMSNorm  # the bfloat16 kernels run
    attention = cpu_attention_kernel(attention_kernel, dtype=dtype, head_dim=64)  # type: ignore[arg-type]
    assert (attention is None) == (attention_kernel == "flash")
    fms_runner = CpuModelRunner(
        cpu_copy, num_blocks=64, block_size=BS, dtype=dtype, attention=attention
    )
    kinds: set[tuple[str, int]] = set()
    h = Harness(
        cpu_copy,
        chunk_size=128,
        max_num_seqs=5,
        check=replayed_on_fms(fms_runner, kinds),
        attention=attention,
        decoder=AtenDecoder(cpu_copy, attention),
        dtype=dtype,
    )
    two_families(h)
    with torch.inference_mode():
        h.run()
    assert max(h.decode_batch_sizes()) == 5
    assert ("DecodeBatch", 1) in kinds and ("PrefillChunk", 1) in kinds


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float32, LOGIT_TOL), (torch.bfloat16, BF16_LOGIT_TOL)]
)
def test_the_steps_equal_full_forwards(
    model64: torch.nn.Module, dtype: torch.dtype, tolerance: float, one_thread: None
) -> None:
    """Against the independent oracle: every logit row of every request is a plain fms forward
    of the row's tokens on the unconverted float32 model. In bfloat16 the greedy tokens may part
    ways with float32's, so each row is compared with the forward of the tokens the run took."""
    linear_kernel = bf16_linear_kernel() if dtype == torch.bfloat16 else "onednn"
    cpu_copy = copy_of(model64, dtype, linear_kernel)
    h = Harness(
        cpu_copy, chunk_size=128, max_num_seqs=5, decoder=AtenDecoder(cpu_copy), dtype=dtype
    )
    two_families(h)
    worst = 0.0
    with torch.inference_mode():
        h.run()
        for trace in h.traces.values():
            for i, row in enumerate(trace.logits):
                want = full_forward_logits(model64, trace.prompt + trace.tokens[:i])
                worst = max(worst, max_abs(row, want))
    assert worst <= tolerance
    if dtype == torch.bfloat16:
        assert worst > LOGIT_TOL  # it did run in bfloat16 (a mutation check)


@needs_native_kernels
def test_cpu_decoder_picks_native_then_aten_and_says_why(
    model64: torch.nn.Module, tiny_llama: torch.nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="spyre_server.model.cpu.prepare")
    attention = NativePagedAttention(load_native_kernels(default_kernel_dir()))
    native = copy_of(model64, torch.float32, "native")
    assert isinstance(cpu_decoder(native, attention), NativeDecoder)
    assert isinstance(cpu_decoder(native, None), AtenDecoder)
    assert "steps on the aten decoder (not native: the attention kernel is flash;" in caplog.text
    bf16 = copy_of(model64, torch.bfloat16, bf16_linear_kernel())
    assert isinstance(cpu_decoder(bf16, None), NativeBf16Decoder)
    tiny = cpu_inference_copy(tiny_llama, linear_kernel="native", dtype=torch.float32)
    assert isinstance(cpu_decoder(tiny, attention), AtenDecoder)
    assert "head_dim 48" in caplog.text


def test_what_it_does_not_cover_runs_on_fms_forward(
    model64: torch.nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    """A model whose norms fms computes itself (not a cpu copy): no decoder, and the log says
    why neither runs."""
    caplog.set_level(logging.INFO, logger="spyre_server.model.cpu.prepare")
    assert unsupported_reason(model64) == "a norm is LayerNormParameterized, not the fast RMS norm"
    with pytest.raises(ValueError, match="AtenDecoder cannot run this model: a norm is"):
        AtenDecoder(model64)
    assert cpu_decoder(model64, None) is None
    assert (
        "steps through fms's forward (not native: the attention kernel is flash; not aten: a norm is"
        in caplog.text
    )
