"""The cpu backend's RMS norm against fms's own (the oracle): the same bits."""

from __future__ import annotations

import copy

import pytest
import torch
from fms.modules.layernorm import LayerNormParameterized

from spyre_server.model.cpu.ops.fast_norm import FastRMSNorm, use_fast_rms_norm


def pair(dtype: torch.dtype, **options: bool) -> tuple[LayerNormParameterized, FastRMSNorm]:
    fms_norm = LayerNormParameterized(576, eps=1e-5, **options).to(dtype)
    with torch.no_grad():
        if fms_norm.elementwise_scale:
            fms_norm.weight.normal_(generator=torch.Generator().manual_seed(0))
        if fms_norm.elementwise_shift:
            fms_norm.bias.normal_(generator=torch.Generator().manual_seed(1))
    fast = copy.deepcopy(fms_norm)
    fast.__class__ = FastRMSNorm
    return fms_norm, fast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 1, 576), (1, 64, 576), (1, 256, 576), (3, 7, 576)])
def test_the_same_bits_as_fms(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """SmolLM2's configuration (scale, no mean, no shift, high-precision pow), inputs from 1e-3
    to 1e2 in magnitude."""
    fms_norm, fast = pair(dtype, use_high_precision_pow=True)
    generator = torch.Generator().manual_seed(len(shape) + shape[1])
    for scale in (1e-3, 1.0, 1e2):
        x = (torch.randn(shape, generator=generator) * scale).to(dtype)
        got = fast(x)
        assert got.dtype == dtype
        assert torch.equal(got, fms_norm(x))


@pytest.mark.parametrize(
    "options",
    [
        {"use_mean": True, "use_high_precision_pow": True},
        {"elementwise_shift": True, "use_high_precision_pow": True},
        {"elementwise_scale": False, "use_high_precision_pow": True},
        {"use_high_precision_pow": False},
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_configurations_are_fms(options: dict[str, bool], dtype: torch.dtype) -> None:
    fms_norm, fast = pair(dtype, **options)
    x = torch.randn(2, 5, 576, generator=torch.Generator().manual_seed(7)).to(dtype)
    assert torch.equal(fast(x), fms_norm(x))


def test_use_fast_rms_norm_switches_every_norm(tiny_llama_factory: object) -> None:
    model = tiny_llama_factory()  # type: ignore[operator]
    num_layers = len(model.base_model.layers)
    assert use_fast_rms_norm(model) == 2 * num_layers + 1  # two per layer and the final one
    assert type(model.base_model.layers[0].ln) is FastRMSNorm
    assert type(model.base_model.dec_norm) is FastRMSNorm
    assert use_fast_rms_norm(model) == 0
