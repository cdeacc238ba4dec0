"""Our bfloat16 RMS norm, SiLU-and-multiply and rotary embedding kernels (the cpu backend's
element-wise ops for a bfloat16 model, ``kernels/elementwise_bf16.cpp``).

Oracles: the aten code they replace (fms's norm and GLU through ``FastRMSNorm`` and fms's
``GatedLinearUnit``, ``FastRotaryEmbedding``'s rotation), and float64. The kernels compute in
float32 and round to bfloat16 where those ops round, so they differ only where the float32
rounding inside (the norm's sum of squares, the SiLU's exp, the rotation's fused multiply-add)
moves a value across a bfloat16 rounding boundary: at most 1 ulp apart per rounding, and almost
every value equal;
- against float64: each rounding adds at most half an ulp, 2**-8 relative (bfloat16 keeps 8
  significant bits).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from fms.modules.feedforward import GatedLinearUnit
from fms.modules.layernorm import LayerNormParameterized
from fms.modules.positions import RotaryEmbedding

from spyre_server.model.cpu.kernels.library import (
    NativeKernels,
    default_kernel_dir,
    load_native_kernels,
)
from spyre_server.model.cpu.ops.fast_norm import FastRMSNorm, use_fast_rms_norm
from spyre_server.model.cpu.ops.fast_rope import FastRotaryEmbedding
from spyre_server.model.cpu.ops.native_elementwise import (
    NativeGatedLinearUnit,
    NativeRMSNorm,
    NativeRotaryEmbedding,
    use_native_elementwise,
)
from tests.conftest import needs_native_kernels

pytestmark = needs_native_kernels
HALF_ULP = 2.0**-8
"""bfloat16's unit roundoff: one rounding to nearest moves a value by at most this, relative."""
TWO_ROUNDINGS = 2 * HALF_ULP + HALF_ULP**2 + 1e-6
"""Two roundings in a row, plus float32's own rounding inside."""


def kernels() -> NativeKernels:
    return load_native_kernels(default_kernel_dir())


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps separate each pair of values (finite, same sign or zero)."""
    assert a.dtype == b.dtype == torch.bfloat16
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def bf16_norm(width: int) -> tuple[LayerNormParameterized, LayerNormParameterized]:
    """A native bfloat16 RMS norm with a random weight, and the aten one it replaces."""
    norm = LayerNormParameterized(width, eps=1e-5, use_mean=False, use_high_precision_pow=True)
    norm.reset_parameters()
    with torch.no_grad():
        norm.weight.normal_()
    norm = norm.to(torch.bfloat16)
    use_fast_rms_norm(norm)
    reference = copy.deepcopy(norm)
    use_native_elementwise(norm, kernels())
    assert type(norm) is NativeRMSNorm and type(reference) is FastRMSNorm
    return norm, reference


@pytest.mark.parametrize("width", [576, 13])
@pytest.mark.parametrize("rows", [1, 300])
def test_rms_norm_rounds_as_fms(rows: int, width: int) -> None:
    """Rows read through a stride, 13-wide tails past the 8 lanes, and the threaded path (300
    rows of 576)."""
    torch.manual_seed(rows + width)
    norm, reference = bf16_norm(width)
    x = (torch.randn(rows, width + 5) * 3).to(torch.bfloat16)[:, 2 : 2 + width]
    with torch.inference_mode():
        got, want = norm(x), reference(x)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape and got.is_contiguous()
    apart = ulps_apart(got, want)
    assert apart.max() <= 2  # two roundings, each at most 1 ulp off fms's
    assert (apart == 0).float().mean() >= 0.98
    x64 = x.double()
    exact = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
    assert ((got.double() - exact).abs() <= TWO_ROUNDINGS * exact.abs() + 1e-30).all()


def test_rms_norm_with_a_float32_weight_is_fms_own() -> None:
    """A bfloat16 input to a float32 norm: fms promotes the product to float32, which the kernel
    does not compute."""
    norm = LayerNormParameterized(64, eps=1e-5, use_mean=False, use_high_precision_pow=True)
    norm.reset_parameters()
    use_fast_rms_norm(norm)
    reference = copy.deepcopy(norm)
    use_native_elementwise(norm, kernels())
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = norm(x)
        assert got.dtype == torch.float32 and torch.equal(got, reference(x))


def test_glu_rounds_as_fms() -> None:
    """Large gate values on both sides (the exp clamps, never inf), 13-wide tails, and the
    threaded path (300 rows)."""
    torch.manual_seed(5)
    glu = GatedLinearUnit(
        16, hidden_grow_factor=13 / 16, activation_fn=torch.nn.SiLU(), p_dropout=0.0
    )
    glu.reset_parameters()
    glu = glu.to(torch.bfloat16).eval()
    use_native_elementwise(glu, kernels())
    assert type(glu) is NativeGatedLinearUnit
    x = (torch.randn(300, 1, 16) * 30).to(torch.bfloat16)
    lib = kernels()
    with torch.inference_mode():
        gate_up = glu.wg1_fused(x).reshape(300, 26).contiguous()
        got = torch.empty(300, 13, dtype=torch.bfloat16)
        lib.silu_mul_bf16(gate_up.data_ptr(), got.data_ptr(), 300, 13)
        gate, up = gate_up.split(13, dim=-1)
        want = torch.nn.functional.silu(gate) * up  # what fms's GLU computes before w2
        assert glu(x).shape == (300, 1, 16)
    apart = ulps_apart(got, want)
    assert apart.max() <= 2
    assert (apart == 0).float().mean() >= 0.98
    g64, u64 = gate.double(), up.double()
    exact = g64 * torch.sigmoid(g64) * u64
    assert ((got.double() - exact).abs() <= TWO_ROUNDINGS * exact.abs() + 1e-30).all()


def test_glu_runs_the_kernel() -> None:
    """The module hands its gate and up projections to the bfloat16 kernel once per call and
    passes what it returns through w2 (fms's own code would never call it)."""
    torch.manual_seed(6)
    glu = GatedLinearUnit(64, hidden_grow_factor=2, activation_fn=torch.nn.SiLU(), p_dropout=0.0)
    glu.reset_parameters()
    glu = glu.to(torch.bfloat16).eval()
    lib = kernels()
    calls: list[int] = []

    def counted(gate_up: int, out: int, rows: int, hidden: int) -> None:
        calls.append(rows)
        lib.silu_mul_bf16(gate_up, out, rows, hidden)

    use_native_elementwise(glu, dataclasses.replace(lib, silu_mul_bf16=counted))
    x = torch.randn(7, 3, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = glu(x)
        gate_up = glu.wg1_fused(x).reshape(21, 256).contiguous()
        hidden = torch.empty(21, 128, dtype=torch.bfloat16)
        lib.silu_mul_bf16(gate_up.data_ptr(), hidden.data_ptr(), 21, 128)
        assert torch.equal(got, glu.w2(hidden.view(7, 3, 128)))
    assert calls == [21]


@pytest.mark.parametrize("head_dim", [64, 8])
def test_rope_rounds_as_the_fast_rotation(head_dim: int) -> None:
    """q and k as fms's fused QKV projection hands them over (views with the token stride of
    the whole projection), two sequences at scattered positions: one float32 rotation rounded
    once, as ``fast_rope`` computes it."""
    torch.manual_seed(head_dim)
    fast = RotaryEmbedding(dim=head_dim, max_seq_len=4096)
    fast.__class__ = FastRotaryEmbedding
    rope = copy.deepcopy(fast)
    holder = torch.nn.Module()
    holder.rope = rope
    use_native_elementwise(holder, kernels())
    assert type(rope) is NativeRotaryEmbedding
    nheads, kvheads, seq = 9, 3, 37
    qkv = torch.randn(2, seq, (nheads + 2 * kvheads) * head_dim).to(torch.bfloat16)
    q_out, k_out, _ = qkv.split([nheads * head_dim, kvheads * head_dim, kvheads * head_dim], -1)
    q = q_out.view(2, seq, nheads, head_dim)
    k = k_out.view(2, seq, kvheads, head_dim)
    positions = torch.stack([torch.arange(100, 100 + seq), torch.randperm(4000)[:seq]])
    got_q, got_k = rope.adjusted_qk(q, k, positions)
    want_q, want_k = fast.adjusted_qk(q, k, positions)
    assert got_q.dtype == torch.bfloat16 and got_q.shape == q.shape
    for got, want in ((got_q, want_q), (got_k, want_k)):
        apart = ulps_apart(got, want)
        assert apart.max() <= 1 and (apart == 0).float().mean() >= 0.999


def test_rounding_ties_go_to_even_and_nan_stays_nan() -> None:
    """The kernels' float32 -> bfloat16 rounding against torch's, through the rotation of ones
    with cos = the value and sin 0: bfloat16 values of both parities plus 0, just under, exactly
    and just over half a step (ties go to the even neighbour), infinities and NaN."""
    lib = kernels()
    bases = torch.tensor([1.0, 1.0078125, -3.0, -3.015625, 65280.0, 2.0**-100])
    steps = 2.0 ** (torch.floor(torch.log2(bases.abs())) - 7)  # one bfloat16 step at each base
    fractions = torch.tensor([0.0, 0.5 - 2**-10, 0.5, 0.5 + 2**-10])
    values = (bases[:, None] + fractions[None, :] * steps[:, None]).flatten()
    specials = [float("inf"), float("-inf"), float("nan"), 0.0, -1.5, 0.25, 7.0, 100.0]
    values = torch.cat([values, torch.tensor(specials)])
    assert values.numel() % 8 == 0
    n = values.numel()
    ones = torch.ones(1, n, dtype=torch.bfloat16)
    cos = values[None, :].contiguous()
    sin = torch.zeros_like(cos)
    out = torch.empty_like(ones)
    lib.rope_bf16(ones.data_ptr(), n, cos.data_ptr(), sin.data_ptr(), out.data_ptr(), 1, 1, n)
    got, want = out[0], values.to(torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])
    assert got[2].item() == 1.0 and got[6].item() == 1.015625  # ties: to even, both ways


@pytest.mark.parametrize("rows", [1, 300])  # 300 x 576: the threaded path
def test_add_rms_norm_is_the_add_then_the_norm(rows: int) -> None:
    """The native bfloat16 decoder's residual add and next norm in one pass: x becomes x + d
    rounded as torch's bfloat16 add rounds it, and out the norm kernel's result on it."""
    torch.manual_seed(rows)
    norm, _ = bf16_norm(576)
    lib = kernels()
    x = (torch.randn(rows, 576) * 3).bfloat16()
    d = torch.randn(rows, 576).bfloat16()
    want_x = d + x
    with torch.inference_mode():
        want = norm(want_x)
    out = torch.empty_like(x)
    lib.add_rms_norm_bf16(
        x.data_ptr(), d.data_ptr(), norm.weight.data_ptr(), out.data_ptr(), rows, 576, norm.eps
    )
    assert torch.equal(x, want_x) and torch.equal(out, want)


def test_rope_store_rotates_into_the_slots_and_nowhere_else() -> None:
    """A layer's RoPE and KV store from its fused QKV output: the queries rotated as the rope
    kernel rotates them, the keys rotated and the values as they are in their cache slots,
    every other slot untouched."""
    torch.manual_seed(9)
    lib = kernels()
    fast = RotaryEmbedding(dim=64, max_seq_len=4096)
    fast.__class__ = FastRotaryEmbedding
    holder = torch.nn.Module()
    holder.rope = fast
    use_native_elementwise(holder, lib)
    tokens, heads, kvheads, head_dim, num_slots = 5, 9, 3, 64, 40
    qkv = torch.randn(tokens, (heads + 2 * kvheads) * head_dim).bfloat16()
    positions = torch.tensor([[3, 17, 100, 101, 2000]])
    cos, signed_sin = fast._tables(qkv.device, positions)
    slots = torch.tensor([7, 0, 39, 12, 8])
    k_cache = torch.full((num_slots, kvheads, head_dim), float("nan")).bfloat16()
    v_cache = k_cache.clone()
    queries = torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16)
    lib.rope_store_bf16(
        qkv.data_ptr(), qkv.shape[1], cos.data_ptr(), signed_sin.data_ptr(), queries.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), tokens, heads, kvheads, head_dim,
    )  # fmt: skip
    q, k, v = qkv.view(1, tokens, -1).split(
        [heads * head_dim, kvheads * head_dim, kvheads * head_dim], -1
    )
    want_q, want_k = fast.adjusted_qk(
        q.view(1, tokens, heads, head_dim), k.view(1, tokens, kvheads, head_dim), positions
    )
    assert torch.equal(queries, want_q[0])
    assert torch.equal(k_cache[slots], want_k[0])
    assert torch.equal(v_cache[slots], v.reshape(tokens, kvheads, head_dim))
    others = torch.ones(num_slots, dtype=torch.bool)
    others[slots] = False
    assert k_cache[others].isnan().all() and v_cache[others].isnan().all()
