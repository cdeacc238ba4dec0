"""Our attention kernel over shared blocks (``model.attention_kernel: native``).

Oracles: softmax attention in float64 (the kernel alone and the paged-attention op), and a
plain full forward of fms (decode steps of a model run through it). Tolerances: float32
attention over at most a few hundred keys agrees with float64 to ~1e-6; 2e-5 leaves room for
the polynomial exp (relative error ~1e-7) summed over the keys.
"""

from __future__ import annotations

import math

import pytest
import torch
from fms.models import get_model

from spyre_server.model import cpu_model, native_kernels, paged_attention
from spyre_server.model.cpu_model import cpu_shared_attention, resolve_attention_kernel
from spyre_server.model.native_attention import NativeSharedAttention
from spyre_server.model.native_kernels import default_kernel_dir, load_native_kernels
from spyre_server.model.packed_linear import LinearKernelError
from spyre_server.model.paged_attention import plan_attention
from tests.conftest import needs_native_kernels
from tests.spyre_server.test_model_correctness import (
    BS,
    LOGIT_TOL,
    Harness,
    full_forward_logits,
    max_abs,
    rand_tokens,
)
from tests.spyre_server.test_paged_attention import naive_attention

pytestmark = needs_native_kernels
TOL = 2e-5


def kernels() -> native_kernels.NativeKernels:
    return load_native_kernels(default_kernel_dir())


def float64_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, H, R, D], keys/values [L, H, D] -> (out [1, H, R, D], lse [1, H, R]) in float64."""
    scores = q.double()[0] @ keys.double().permute(1, 2, 0) / math.sqrt(q.shape[-1])
    out = torch.softmax(scores, -1) @ values.double().transpose(0, 1)
    return out.unsqueeze(0), torch.logsumexp(scores, -1).unsqueeze(0)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kvheads", [1, 3])
@pytest.mark.parametrize("rows", [1, 3, 5, 24, 193])
@pytest.mark.parametrize("num_keys", [1, 7, 48, 50, 200])
def test_kernel_matches_float64_attention(
    head_dim: int, kvheads: int, rows: int, num_keys: int
) -> None:
    """Every row block (4/3/2/1 rows), partial key tiles (48 keys) and 8-key transposes, key
    ranges split 1, 2 and 5 ways (5 ranges of 200 keys leave some empty), and keys read through
    the cache's stride (two rows of padding around them)."""
    torch.manual_seed(rows * 7 + num_keys)
    lib = kernels()
    cache_k = torch.randn(num_keys + 4, kvheads, head_dim)
    cache_v = torch.randn(num_keys + 4, kvheads, head_dim)
    keys, values = cache_k[2 : 2 + num_keys], cache_v[2 : 2 + num_keys]
    q = torch.randn(1, kvheads, rows, head_dim)
    want_out, want_lse = float64_attention(q, keys, values)
    for splits in (1, 2, 5):
        scratch = torch.empty(lib.attention_scratch_numel(head_dim, kvheads, rows, splits))
        out = torch.empty(1, kvheads, rows, head_dim)
        lse = torch.empty(1, kvheads, rows)
        status = lib.attention(
            head_dim, q.data_ptr(), keys.data_ptr(), values.data_ptr(), kvheads, rows,
            num_keys, keys.stride(0), 1 / math.sqrt(head_dim), splits, scratch.data_ptr(),
            out.data_ptr(), lse.data_ptr(),
        )  # fmt: skip
        assert status == 0
        assert max_abs(out, want_out) < TOL, splits
        assert max_abs(lse, want_lse) < TOL, splits


def test_the_kernel_refuses_other_head_dims() -> None:
    lib = kernels()
    assert lib.attention_scratch_numel(48, 1, 1, 1) == -1
    null = 0
    assert lib.attention(48, null, null, null, 1, 1, 1, 48, 1.0, 1, null, null, null) == 1


def test_shared_attention_takes_the_cache_in_place_and_checks_its_input() -> None:
    attend = NativeSharedAttention(kernels())
    cache = torch.randn(10, BS, 3, 64)
    keys = cache[2:5].view(3 * BS, 3, 64)  # blocks 2..4 in place
    q = torch.randn(1, 3, 6, 64)
    out, lse = attend(q, keys, keys, 0.125)
    want_out, want_lse = float64_attention(q, keys, keys)
    assert max_abs(out, want_out) < TOL and max_abs(lse, want_lse) < TOL
    with pytest.raises(ValueError, match="float32 with head_dim 64 or 128"):
        attend(q.double(), keys, keys, 0.125)
    with pytest.raises(ValueError, match="contiguous heads"):
        attend(q, keys.transpose(1, 2).contiguous().transpose(1, 2), keys, 0.125)


@pytest.mark.parametrize(
    ("tables", "positions"),
    [
        ([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]], [[250], [200], [130]]),  # shared + own
        (  # two families and a loner
            [[1, 2, 3, 4], [5, 6, 7], [1, 2, 8], [9, 10], [5, 6, 11]],
            [[250], [190], [140], [100], [150]],
        ),
        ([[7, 8, 9]], [list(range(130, 160))]),  # prefill: 2 shared blocks, causal own block
        ([[9, 3, 7, 4]], [list(range(200, 230))]),  # prefill over scattered blocks (gathered)
        ([[1, 2]], [[100]]),  # one row: its whole past is shared
    ],
)
def test_the_op_with_our_kernel_equals_naive_attention(
    tables: list[list[int]], positions: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The paged-attention op's shared part through our kernel (the own part stays flash)."""
    torch.manual_seed(0)
    nheads, kvheads, head_dim = 6, 2, 64
    key_cache = torch.randn(12, BS, kvheads, head_dim)
    value_cache = torch.randn(12, BS, kvheads, head_dim)
    query = torch.randn(len(tables), len(positions[0]), nheads, head_dim)
    native = NativeSharedAttention(kernels())
    calls = []

    def counted(*args: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return native(*args)  # type: ignore[arg-type]

    flash_calls = []
    flash = paged_attention._flash_attention

    def counted_flash(*args: object, **kwargs: object) -> object:
        flash_calls.append(1)
        return flash(*args, **kwargs)

    monkeypatch.setattr(paged_attention, "_flash_attention", counted_flash)
    plan = plan_attention(tables, positions, BS)
    got = paged_attention._compute(
        query, key_cache, value_cache, nheads, kvheads, 0.0, None, plan=plan,
        shared_attention=counted,
    )  # fmt: skip
    want = naive_attention(query, key_cache, value_cache, tables, positions)
    assert max_abs(got, want) < TOL
    num_shared_groups = sum(g.shared_blocks.numel() > 0 for g in plan.groups)
    assert len(calls) == num_shared_groups > 0
    assert len(flash_calls) == len(plan.groups)  # the own parts only


def test_decode_with_our_kernel_equals_full_forwards(one_thread: None) -> None:
    """A model with head_dim 64 (the suite's tiny llama has 48): five requests in two families
    sharing 256-token prompts; every step's logits equal a full forward of the row's tokens."""
    torch.manual_seed(3)
    model = get_model("llama", "micro", data_type=torch.float32, nheads=4, kvheads=2, emb_dim=256)
    model.eval()
    prefixes = [rand_tokens(256, seed=700), rand_tokens(256, seed=701)]
    native = NativeSharedAttention(kernels())
    num_keys_read = []

    def counted(
        q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_keys_read.append(keys.shape[0])
        return native(q, keys, values, scale)

    h = Harness(model, chunk_size=128, max_num_seqs=5, shared_attention=counted)
    for i, suffix_len in enumerate((1, 30, 64, 100, 150)):
        h.add(f"r{i}", prefixes[i % 2] + rand_tokens(suffix_len, seed=800 + i), 12)
    with torch.inference_mode():
        h.run()
        assert max(h.decode_batch_sizes()) == 5
        assert max(num_keys_read) >= 256  # a family's prompt, read once per step
        for trace in h.traces.values():
            for i, row in enumerate(trace.logits):
                want = full_forward_logits(model, trace.prompt + trace.tokens[:i])
                assert max_abs(row, want) <= LOGIT_TOL


def test_auto_picks_native_where_it_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_attention_kernel("auto", torch.float32, 64) == "native"
    assert resolve_attention_kernel("auto", torch.float32, 128) == "native"
    assert resolve_attention_kernel("auto", torch.float32, 48) == "flash"
    assert resolve_attention_kernel("auto", torch.bfloat16, 64) == "flash"
    assert resolve_attention_kernel("flash", torch.float32, 64) == "flash"
    with pytest.raises(LinearKernelError, match=r"attention_kernel 'native'.*head_dim 48"):
        resolve_attention_kernel("native", torch.float32, 48)
    with pytest.raises(LinearKernelError, match=r"attention_kernel 'native'.*bfloat16"):
        resolve_attention_kernel("native", torch.bfloat16, 64)
    monkeypatch.setattr(cpu_model, "unsupported_cpu_reason", lambda: "this CPU lacks avx2")
    assert resolve_attention_kernel("auto", torch.float32, 64) == "flash"


def test_the_runner_gets_our_kernel_or_none() -> None:
    native = cpu_shared_attention("auto", dtype=torch.float32, head_dim=64)
    assert isinstance(native, NativeSharedAttention)
    assert cpu_shared_attention("auto", dtype=torch.float32, head_dim=48) is None
    assert cpu_shared_attention("flash", dtype=torch.float32, head_dim=64) is None


def test_native_attention_on_a_head_dim_it_cannot_compute_fails_at_start(
    make_engine: object,
) -> None:
    """The micro model has head_dim 48."""
    with pytest.raises(LinearKernelError, match=r"attention_kernel 'native'.*head_dim 48"):
        make_engine(model__attention_kernel="native")  # type: ignore[operator]
