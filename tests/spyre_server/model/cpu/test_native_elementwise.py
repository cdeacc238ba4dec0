"""Our float32 RMS norm, SiLU-and-multiply and rotary embedding kernels (with
``model.linear_kernel: native``).

Oracles: the same formulas in float64, and fms's own modules (the norm, the GLU, the rotary
embedding) and a whole fms forward. Tolerances: each output is a handful of float32 operations
on its inputs (the norm's sum over up to 1,536 squares), so it agrees with float64 to a few
float32 ulps relative, 1e-6 on values of order 1; the whole model's logits within the suite's
LOGIT_TOL.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
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
from spyre_server.model.cpu.prepare import cpu_inference_copy
from tests.conftest import needs_native_kernels
from tests.spyre_server.model.test_model_correctness import LOGIT_TOL, max_abs, rand_tokens

pytestmark = needs_native_kernels
TOL = 1e-6


def kernels() -> NativeKernels:
    return load_native_kernels(default_kernel_dir())


def native_norm(width: int, eps: float = 1e-5) -> NativeRMSNorm:
    norm = LayerNormParameterized(width, eps=eps, use_mean=False, use_high_precision_pow=True)
    norm.reset_parameters()
    with torch.no_grad():
        norm.weight.normal_()
    use_fast_rms_norm(norm)
    use_native_elementwise(norm, kernels())
    assert type(norm) is NativeRMSNorm
    return norm


@pytest.mark.parametrize("width", [576, 64, 13])
@pytest.mark.parametrize("rows", [1, 3, 300])
def test_rms_norm_matches_float64(rows: int, width: int) -> None:
    """Row tails past the 8-float lanes (13), one thread (few rows) and the threaded path (300
    rows of 576), and rows read through a stride (a view into a wider tensor)."""
    torch.manual_seed(rows + width)
    norm = native_norm(width)
    wide = torch.randn(rows, width + 5) * 3
    x = wide[:, 2 : 2 + width]
    with torch.inference_mode():
        got = norm(x)
    x64 = x.double()
    with torch.no_grad():
        want = (
            x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
        )
    assert got.shape == x.shape and got.is_contiguous()
    assert max_abs(got, want) < TOL * want.abs().max()


def test_rms_norm_keeps_fms_semantics_outside_float32() -> None:
    norm = native_norm(64)
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    reference = copy.deepcopy(norm)
    reference.__class__ = FastRMSNorm
    with torch.inference_mode():
        assert torch.equal(norm(x), reference(x))


def test_glu_matches_float64_and_fms() -> None:
    """Large gate values on both sides (the exp clamps, never inf), 13-wide tails."""
    torch.manual_seed(5)
    glu = GatedLinearUnit(
        16, hidden_grow_factor=13 / 16, activation_fn=torch.nn.SiLU(), p_dropout=0.0
    )
    glu.reset_parameters()
    glu.eval()
    reference = copy.deepcopy(glu)
    use_native_elementwise(glu, kernels())
    assert type(glu) is NativeGatedLinearUnit
    x = torch.randn(300, 1, 16) * 30
    with torch.inference_mode():
        got = glu(x)
        gate_up = glu.wg1_fused(x).double()
        gate, up = gate_up.split(13, dim=-1)
        want = glu.w2(
            (gate * torch.sigmoid(gate) * up).float()
        ).double()  # the kernel's hidden values against float64, through the same w2
        assert max_abs(got, want) < TOL * want.abs().max()
        assert max_abs(got, reference(x)) < TOL * want.abs().max()


def test_glu_with_another_activation_is_fms_own() -> None:
    glu = GatedLinearUnit(16, hidden_grow_factor=2, activation_fn=torch.nn.GELU(), p_dropout=0.0)
    glu.reset_parameters()
    reference = copy.deepcopy(glu)
    use_native_elementwise(glu, kernels())
    x = torch.randn(4, 2, 16)
    with torch.inference_mode():
        assert torch.equal(glu(x), reference(x))


@pytest.mark.parametrize("head_dim", [64, 48, 8])
def test_rope_matches_fms_on_fused_qkv_views(head_dim: int) -> None:
    """q and k as fms's fused QKV projection hands them over (views with the token stride of
    the whole projection), two sequences at scattered positions."""
    torch.manual_seed(head_dim)
    fms_rope = RotaryEmbedding(dim=head_dim, max_seq_len=4096)
    rope = copy.deepcopy(fms_rope)
    rope.__class__ = FastRotaryEmbedding
    holder = torch.nn.Module()
    holder.rope = rope
    use_native_elementwise(holder, kernels())
    assert type(rope) is NativeRotaryEmbedding
    nheads, kvheads, seq = 9, 3, 37
    qkv = torch.randn(2, seq, (nheads + 2 * kvheads) * head_dim)
    q_out, k_out, _ = qkv.split([nheads * head_dim, kvheads * head_dim, kvheads * head_dim], -1)
    q = q_out.view(2, seq, nheads, head_dim)
    k = k_out.view(2, seq, kvheads, head_dim)
    positions = torch.stack([torch.arange(100, 100 + seq), torch.randperm(4000)[:seq]])
    got_q, got_k = rope.adjusted_qk(q, k, positions)
    want_q, want_k = fms_rope.adjusted_qk(q, k, positions)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    assert max_abs(got_q, want_q) < TOL * 4 and max_abs(got_k, want_k) < TOL * 4


def test_use_native_elementwise_switches_every_norm_glu_and_rope(
    tiny_llama: torch.nn.Module,
) -> None:
    clone = cpu_inference_copy(tiny_llama, linear_kernel="native", dtype=torch.float32)
    norms = [m for m in clone.modules() if isinstance(m, LayerNormParameterized)]
    glus = [m for m in clone.modules() if isinstance(m, GatedLinearUnit)]
    ropes = {
        id(v): v
        for m in clone.modules()
        for v in vars(m).values()
        if isinstance(v, RotaryEmbedding)
    }
    assert norms and glus and ropes
    assert all(type(m) is NativeRMSNorm for m in norms)
    assert all(type(m) is NativeGatedLinearUnit for m in glus)
    assert all(type(v) is NativeRotaryEmbedding for v in ropes.values())
    # The loaded model is left as it was.
    assert not any(
        isinstance(m, (FastRMSNorm, NativeGatedLinearUnit)) for m in tiny_llama.modules()
    )


def test_the_native_copy_computes_the_fms_forward(tiny_llama: torch.nn.Module) -> None:
    """The whole tiny llama, native linears and element-wise kernels, against fms's own forward
    in float32 over a 70-token prompt (every position's logits)."""
    clone = cpu_inference_copy(tiny_llama, linear_kernel="native", dtype=torch.float32)
    ids = torch.tensor([rand_tokens(70, seed=42)])
    with torch.inference_mode():
        want = tiny_llama(ids)
        got = clone(ids)
    assert max_abs(got, want) <= LOGIT_TOL
    assert not torch.equal(got, want)  # other kernels did run (a mutation check)


def test_silu_of_the_kernel_is_silu() -> None:
    """The kernel alone against F.silu on extreme inputs: -inf-ward gates give -0, large ones x."""
    lib = kernels()
    gate = torch.tensor([[-200.0, -88.0, -20.0, -1.0, 0.0, 1.0, 20.0, 88.0, 200.0, 3.0]])
    up = torch.ones_like(gate)
    gate_up = torch.cat([gate, up], dim=1).contiguous()
    out = torch.empty_like(gate)
    lib.silu_mul(gate_up.data_ptr(), out.data_ptr(), 1, gate.shape[1])
    want = F.silu(gate.double())
    assert torch.isfinite(out).all()
    assert max_abs(out, want) < TOL * 200


@pytest.mark.parametrize("rows", [1, 3, 200])  # 200 x 192 floats: split over the threads
def test_scatter_writes_each_row_to_its_slot_and_nothing_else(rows: int) -> None:
    """The native decoder's KV store: strided source rows (values inside the fused QKV output)
    into their slots of a cache viewed as [num_slots][N]."""
    lib = kernels()
    torch.manual_seed(rows)
    width, num_slots = 192, 512
    source = torch.randn(rows, 3 * width)[:, width : 2 * width]  # row stride 3 * width
    slots = torch.randperm(num_slots)[:rows]
    cache = torch.full((num_slots, width), float("nan"))
    lib.scatter_rows(
        source.data_ptr(), source.stride(0), slots.data_ptr(), cache.data_ptr(), rows, width
    )
    assert torch.equal(cache[slots], source)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert cache[untouched].isnan().all()
