"""Packed linear layers of the cpu backend (``model.linear_kernel``: ``onednn``, ``native``).

Oracle: ``F.linear`` / the unpacked model. A different kernel sums in a different order, so
results agree to float32 rounding (relative 1e-5), not bit for bit; greedy tokens must agree.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from spyre_server.model.cpu.errors import LinearKernelError
from spyre_server.model.cpu.ops import packed_linear
from spyre_server.model.cpu.ops.fast_norm import FastRMSNorm
from spyre_server.model.cpu.ops.fast_rope import FastRotaryEmbedding
from spyre_server.model.cpu.ops.native_elementwise import NativeRMSNorm, NativeRotaryEmbedding
from spyre_server.model.cpu.ops.native_linear import NativeLinear
from spyre_server.model.cpu.ops.packed_linear import (
    PackedLinear,
    check_onednn,
    pack_linears,
)
from spyre_server.model.cpu.prepare import cpu_inference_copy

REL_TOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 64, 257])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 160, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(2, rows, 96)
    with torch.inference_mode():
        assert rel_err(packed(x), F.linear(x, linear.weight, linear.bias)) < REL_TOL
        strided = torch.randn(rows, 192)[:, ::2]  # a non-contiguous view
        assert rel_err(packed(strided), F.linear(strided, linear.weight, linear.bias)) < REL_TOL
    assert packed(x).shape == (2, rows, 160)


PACKED_TYPES = {"onednn": PackedLinear, "native": NativeLinear}


@pytest.mark.parametrize("kernel", ["onednn", "native"])
def test_the_cpu_copy_shares_every_tensor_and_leaves_the_model_alone(
    tiny_llama_factory: Any, kernel: str
) -> None:
    model = tiny_llama_factory()
    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    modules_before = [(n, type(m)) for n, m in model.named_modules()]
    params_before = dict(model.named_parameters())
    clone = cpu_inference_copy(model, linear_kernel=kernel, dtype=torch.float32)  # type: ignore[arg-type]

    assert len(linears) == 5 * 4 + 1  # qkv, dense, wg1_fused, w2 per layer + the head
    # The original is untouched: same module types, same parameter objects.
    assert [(n, type(m)) for n, m in model.named_modules()] == modules_before
    assert dict(model.named_parameters()) == params_before
    # The copy: every linear packed, rotary switched, every other tensor the original's object.
    assert not any(isinstance(m, torch.nn.Linear) for m in clone.modules())
    assert sum(type(m) is PACKED_TYPES[kernel] for m in clone.modules()) == len(linears)
    # With the native kernels, the element-wise ops are on native kernels too.
    rope_type, norm_type = (
        (NativeRotaryEmbedding, NativeRMSNorm)
        if kernel == "native"
        else (FastRotaryEmbedding, FastRMSNorm)
    )
    assert all(type(x.attn.position_encoder) is rope_type for x in clone.base_model.layers)
    assert not any(
        type(x.attn.position_encoder) is FastRotaryEmbedding for x in model.base_model.layers
    )
    assert all(type(x.ln) is norm_type for x in clone.base_model.layers)
    assert not any(isinstance(m, FastRMSNorm) for m in model.modules())
    unpacked = {
        n: p for n, p in params_before.items() if not any(n.startswith(f"{x}.") for x in linears)
    }
    cloned = dict(clone.named_parameters())
    assert unpacked and all(cloned[n] is p for n, p in unpacked.items())
    assert pack_linears(clone) == 0  # nothing left to pack

    aten = cpu_inference_copy(model, linear_kernel="aten", dtype=torch.float32)
    # aten keeps every linear as it was (the head is fms's nn.Linear subclass)
    assert [type(m) for m in aten.modules() if isinstance(m, torch.nn.Linear)] == [
        type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)
    ]
    assert not any(isinstance(m, PackedLinear | NativeLinear) for m in aten.modules())


@pytest.mark.parametrize("kernel", ["onednn", "native"])
def test_packed_model_agrees_with_the_plain_one(tiny_llama: Any, kernel: str) -> None:
    clone = cpu_inference_copy(tiny_llama, linear_kernel=kernel, dtype=torch.float32)  # type: ignore[arg-type]
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        plain = tiny_llama(ids)
        packed = clone(ids)
    plain, packed = (x[0] if isinstance(x, tuple) else x for x in (plain, packed))
    assert rel_err(packed, plain) < REL_TOL


def test_engines_with_either_kernel_generate_the_same_tokens(make_engine: Any) -> None:
    from scheduler import FinishReason
    from spyre_server.sample.sampler import SamplingParams

    outputs = {}
    for kernel in ("native", "onednn", "aten"):
        engine = make_engine(model__linear_kernel=kernel)
        kinds = {type(m) for m in engine.runner.model.modules()}
        assert (PackedLinear in kinds) == (kernel == "onednn")
        assert (NativeLinear in kinds) == (kernel == "native")
        prompts = {f"r{i}": [(7 * i + j) % 256 for j in range(30 + 50 * i)] for i in range(3)}
        for rid, prompt in prompts.items():
            engine.add_request(
                rid, prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            )
        tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
        while engine.has_unfinished_requests:
            for delta in engine.step():
                tokens[delta.request_id] += delta.token_ids
                assert delta.finish_reason in (None, FinishReason.LENGTH)
        outputs[kernel] = tokens
    assert all(len(t) == 12 for t in outputs["aten"].values())
    assert outputs["onednn"] == outputs["aten"]
    assert outputs["native"] == outputs["aten"]


def test_missing_onednn_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed_linear.torch.backends.mkldnn, "is_available", lambda: False)
    with pytest.raises(LinearKernelError, match=r"model\.linear_kernel: aten"):
        check_onednn(torch.float32)


def test_an_unsupported_dtype_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("bf16 path needs the cpu support avx_ne_convert")

    monkeypatch.setattr(packed_linear, "_reorder", refuse)
    with pytest.raises(LinearKernelError, match=r"bfloat16.*avx_ne_convert.*linear_kernel: aten"):
        check_onednn(torch.bfloat16)
