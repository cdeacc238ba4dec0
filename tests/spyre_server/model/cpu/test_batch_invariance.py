"""Batch invariance of the cpu backend in bfloat16: a row's result is the same bits whatever else
the step computes (DESIGN §4: caching on gives the same tokens as caching off).

A prefix-cache hit replaces KV the prompt's own prefill would have computed with KV computed
earlier, in a step of another shape: a cached prompt computes fewer rows than an uncached one,
its chunks start elsewhere (the chunk grid's left padding depends on the prompt's length), and a
decode step computes one row per request where a prefill computes a chunk. So each op on the
step's path must give a row the same bits in steps of 1, 5, 17, 64 or 256 rows; and end to end,
a prompt's KV and logits must be the same bits cold and after a cache hit.

Every comparison here is exact. The native attention kernels are row-invariant with the
server's plans (paged_attention.py: every key a row's own, on one tile grid); SDPA's flash kernel
is not (``FLASH_SPLIT``: a strict expected failure).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fms.models import get_model
from fms.modules.layernorm import LayerNormParameterized

from scheduler import PrefillChunk
from spyre_server.model.cpu.kernels.library import (
    NativeKernels,
    amx_unsupported_reason,
    avx512_bf16_unsupported_reason,
    default_kernel_dir,
    load_native_kernels,
)
from spyre_server.model.cpu.ops.fast_norm import FastRMSNorm, use_fast_rms_norm
from spyre_server.model.cpu.ops.fast_rope import FastRotaryEmbedding
from spyre_server.model.cpu.ops.native_attention import NativePagedAttention
from spyre_server.model.cpu.ops.native_elementwise import (
    NativeRotaryEmbedding,
    use_native_elementwise,
)
from spyre_server.model.cpu.ops.native_linear import NativeBf16Linear
from spyre_server.model.cpu.paged_attention import flash_attention, plan_attention
from spyre_server.model.cpu.prepare import cpu_attention_kernel, cpu_decoder, cpu_inference_copy
from tests.conftest import needs_avx512_bf16, needs_native_kernels
from tests.spyre_server.model.test_model_correctness import (
    BS,
    TURN_FOLLOW_UP_ID,
    TURN_ID,
    Harness,
    rand_tokens,
    smollm2_corpus,
)

pytestmark = needs_native_kernels

STEP_ROWS = (1, 5, 17, 64, 256)
"""Step sizes: a decode step of one request, small decode batches, prefill chunks."""
ALL_ROWS = 300

FLASH_SPLIT = (
    "SDPA's flash kernel (attention_kernel: flash) splits a row's keys into blocks by the length "
    "of the step's padded context and sums each block's probabilities with another running max, "
    "so a query's output depends on the other rows and on where its step starts; it is not "
    "ours to change (the native kernels are row-invariant)"
)


def kernels() -> NativeKernels:
    return load_native_kernels(default_kernel_dir())


def assert_row_invariant(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> None:
    """``op`` maps rows to rows: every row, computed in steps of each of STEP_ROWS rows (first,
    inside and last in the step), gives the bits it has in one step of all rows."""
    with torch.inference_mode():
        full = op(x)
        for rows in STEP_ROWS:
            for start in sorted({0, 3, x.shape[0] - rows}):
                part = op(x[start : start + rows].contiguous())
                want = full[start : start + rows]
                assert torch.equal(part.view(torch.int16), want.view(torch.int16)), (rows, start)


def bf16(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).bfloat16()


def native_norm(width: int) -> LayerNormParameterized:
    """fms's RMS norm in bfloat16 with a random weight, on our kernel (as ``prepare`` makes it)."""
    norm = LayerNormParameterized(width, eps=1e-5, use_mean=False, use_high_precision_pow=True)
    norm.reset_parameters()
    with torch.no_grad():
        norm.weight.normal_()
    norm = norm.to(torch.bfloat16)
    use_fast_rms_norm(norm)
    use_native_elementwise(norm, kernels())
    return norm


def rope_tables(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rope = FastRotaryEmbedding(dim=64, ratio=10_000.0)
    return rope._tables(torch.device("cpu"), positions.view(1, -1))


def elementwise_ops() -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]]:
    """(op, its input rows) for every element-wise op of the bfloat16 step paths."""
    torch.manual_seed(5)
    k = kernels()
    hidden, mlp, heads, kvheads, head_dim = 576, 1536, 9, 3, 64
    norm = native_norm(hidden)
    fast = copy.deepcopy(norm)
    fast.__class__ = FastRMSNorm  # the aten path (CPUs without AVX2)
    layer_norm = torch.nn.LayerNorm(hidden).to(torch.bfloat16)  # GPT-BigCode's
    positions = torch.arange(ALL_ROWS) * 7 % 256  # any position per row (exact in bfloat16)
    embedding = torch.nn.Embedding(49152, hidden).to(torch.bfloat16)

    def add_norm(rows: torch.Tensor) -> torch.Tensor:
        x, d = rows[:, :hidden].clone(), rows[:, hidden:].contiguous()  # x: updated in place
        out = torch.empty_like(x)
        k.add_rms_norm_bf16(
            x.data_ptr(), d.data_ptr(), norm.weight.data_ptr(), out.data_ptr(), len(x), hidden, 1e-5
        )
        return torch.cat([x, out], dim=1)

    def silu_mul(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(len(rows), mlp, dtype=torch.bfloat16)
        k.silu_mul_bf16(rows.data_ptr(), out.data_ptr(), len(rows), mlp)
        return out

    def rope(rows: torch.Tensor, native: bool) -> torch.Tensor:
        x, pos = rows[:, :-1].contiguous(), rows[:, -1].float().long()
        cos, sin = rope_tables(pos)
        x = x.view(1, len(rows), heads, head_dim)
        rope = FastRotaryEmbedding(dim=head_dim, ratio=10_000.0)
        if native:
            rope.__class__ = NativeRotaryEmbedding
            rope.native_kernels = k  # type: ignore[attr-defined]
        return rope._rotate(x, cos, sin).view(len(rows), -1)

    def rope_store(rows: torch.Tensor) -> torch.Tensor:
        qkv, pos = rows[:, :-1].contiguous(), rows[:, -1].float().long()
        cos, sin = rope_tables(pos)
        n = len(rows)
        queries = torch.empty(n, heads, head_dim, dtype=torch.bfloat16)
        keys = torch.empty(n, kvheads, head_dim, dtype=torch.bfloat16)
        values = torch.empty_like(keys)
        slots = torch.arange(n)
        k.rope_store_bf16(
            qkv.data_ptr(), qkv.shape[1], cos.data_ptr(), sin.data_ptr(), queries.data_ptr(),
            keys.data_ptr(), values.data_ptr(), slots.data_ptr(), n, heads, kvheads, head_dim,
        )  # fmt: skip
        return torch.cat([queries.view(n, -1), keys.view(n, -1), values.view(n, -1)], dim=1)

    with_positions = torch.cat(
        [bf16(ALL_ROWS, heads * head_dim), positions.bfloat16().view(-1, 1)], dim=1
    )
    qkv = torch.cat(
        [bf16(ALL_ROWS, (heads + 2 * kvheads) * head_dim), with_positions[:, -1:]], dim=1
    )
    ids = torch.randint(0, 49152, (ALL_ROWS,))
    return {
        "rms norm (native)": (norm, bf16(ALL_ROWS, hidden, scale=3.0)),
        "rms norm (aten)": (fast, bf16(ALL_ROWS, hidden, scale=3.0)),
        "layer norm (torch)": (layer_norm, bf16(ALL_ROWS, hidden, scale=3.0)),
        "residual add + rms norm (native)": (add_norm, bf16(ALL_ROWS, 2 * hidden)),
        "silu * up (native)": (silu_mul, bf16(ALL_ROWS, 2 * mlp, scale=2.0)),
        "rope (native)": (lambda r: rope(r, native=True), with_positions),
        "rope (aten)": (lambda r: rope(r, native=False), with_positions),
        "rope + kv store (native)": (rope_store, qkv),
        "embedding": (lambda r: embedding(r.view(-1).long()), ids.view(-1, 1)),
    }


ELEMENTWISE = (
    "rms norm (native)",
    "rms norm (aten)",
    "layer norm (torch)",
    "residual add + rms norm (native)",
    "silu * up (native)",
    "rope (native)",
    "rope (aten)",
    "rope + kv store (native)",
    "embedding",
)


@pytest.mark.parametrize("op", ELEMENTWISE)
def test_each_elementwise_op_gives_a_row_the_same_bits_in_any_step(op: str) -> None:
    ops = elementwise_ops()
    assert set(ops) == set(ELEMENTWISE)
    fn, x = ops[op]
    assert_row_invariant(fn, x)


@pytest.mark.parametrize(
    ("avx512", "amx"), [(True, True), (True, False), (False, False)], ids=["amx", "avx512", "avx2"]
)
@pytest.mark.parametrize(
    ("out_features", "in_features"),
    [(960, 576), (576, 576), (3072, 576), (576, 1536), (3072, 2048), (2048, 8192)],
    ids=["qkv", "dense", "gate_up", "down", "2048-wide", "8192-wide"],
)
def test_our_linear_gives_a_row_the_same_bits_in_any_step(
    out_features: int, in_features: int, avx512: bool, amx: bool
) -> None:
    """SmolLM2's projections and a 1B model's widths: where ``F.linear`` (oneDNN) computes a
    step of one row in another order than a step of several (from K 1536 on here), ours sums
    every output the same way; on every code path (AMX tiles where the process can use them,
    AVX512-BF16, AVX2)."""
    if amx and (reason := amx_unsupported_reason()) is not None:
        pytest.skip(f"the AMX linear cannot run: {reason}")
    lib = load_native_kernels(default_kernel_dir(), avx512=avx512, amx=amx)
    assert lib.linear_bf16_on_amx == amx
    torch.manual_seed(out_features + in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.normal_(0.0, in_features**-0.5)
    assert_row_invariant(NativeBf16Linear(linear, lib), bf16(ALL_ROWS, in_features))


# ================================================================================ attention
ATTENTION_KERNELS = [
    pytest.param("native", torch.float32, id="native"),
    pytest.param("avx512_bf16", torch.bfloat16, marks=needs_avx512_bf16, id="avx512_bf16"),
    pytest.param(
        "flash",
        torch.bfloat16,
        id="flash",
        # Not strict: whether the split changes a bit depends on the CPU's code for it (without
        # a window it does not on an AMX Xeon).
        marks=pytest.mark.xfail(strict=False, reason=FLASH_SPLIT),
    ),
]
"""The native kernel computes in float32 for either dtype and rounds its output once: its
float32 output must be invariant for its bfloat16 output to be (a bfloat16 output hides most
float32 differences, not all)."""


@pytest.mark.parametrize(("kernel", "dtype"), ATTENTION_KERNELS)
@pytest.mark.parametrize("window", [None, 300], ids=["no-window", "window-300"])
def test_attention_gives_a_query_the_same_bits_in_any_step(
    kernel: str, dtype: torch.dtype, window: int | None
) -> None:
    """A query at position p over keys 0..p of one sequence (or its window's): alone (a decode
    step), in prefill chunks that start at each block before it, and in a decode batch with
    rows that share its first block and rows that do not."""
    torch.manual_seed(9)
    heads, kvheads, head_dim, length = 9, 3, 64, 640
    num_blocks = 3 * length // BS + 1
    key_cache = torch.randn(num_blocks, BS, kvheads, head_dim).to(dtype)
    value_cache = torch.randn(num_blocks, BS, kvheads, head_dim).to(dtype)
    table = list(range(1, length // BS + 1))
    other = list(range(length // BS + 1, 2 * length // BS + 1))  # another sequence
    sharing = table[:3] + list(range(2 * length // BS + 1, num_blocks))  # shares 3 blocks
    queries = torch.randn(length, heads, head_dim).to(dtype)
    attention: Any
    if kernel == "flash":
        attention = flash_attention
    else:
        bf16_dot = "avx512_bf16" if kernel == "avx512_bf16" else None
        attention = NativePagedAttention(kernels(), bf16_dot=bf16_dot)  # type: ignore[arg-type]

    def attend(tables: list[list[int]], positions: list[list[int]], q: torch.Tensor) -> Any:
        plan = plan_attention(tables, positions, BS, window)
        with torch.inference_mode():
            return attention(q.contiguous(), key_cache, value_cache, plan, head_dim**-0.5)

    for p in (100, 200, 383, 639):
        alone = attend([table], [[p]], queries[p : p + 1].unsqueeze(0))[0, 0]
        for start in range(0, p + 1, BS):
            end = min(length, (p // BS + 1) * BS)  # through the block holding p
            chunk = attend([table], [list(range(start, end))], queries[start:end].unsqueeze(0))
            assert torch.equal(chunk[0, p - start], alone), (p, start)
        batch_q = torch.stack([queries[p : p + 1], queries[p : p + 1], queries[p : p + 1]])
        batch = attend([table, other, sharing], [[p], [p], [min(p, 300)]], batch_q)
        assert torch.equal(batch[0, 0], alone), p


# ============================================================================== end to end
def wide_llama() -> torch.nn.Module:
    """A small random llama whose MLP is 2048 wide (its down projection sums 2048 products,
    where oneDNN's one-row steps already differ): head_dim 64, 8 query and 4 KV heads, 2
    layers, float32."""
    torch.manual_seed(21)
    return get_model(
        "llama",
        "micro",
        data_type=torch.float32,
        emb_dim=512,
        nheads=8,
        kvheads=4,
        nlayers=2,
        hidden_grow_factor=4.0,
        multiple_of=256,
    ).eval()


@pytest.fixture(scope="module")
def wide_bf16() -> tuple[torch.nn.Module, Any, Any]:
    """(the bfloat16 cpu copy as the server builds it by default, its attention, its decoder)."""
    model = cpu_inference_copy(
        wide_llama().to(torch.bfloat16), linear_kernel="auto", dtype=torch.bfloat16
    )
    assert any(isinstance(m, NativeBf16Linear) for m in model.modules())
    attention = cpu_attention_kernel("auto", dtype=torch.bfloat16, head_dim=64)
    return model, attention, cpu_decoder(model, attention)


class Alone(Harness):
    """Runs requests one after the other, each alone in its steps, and keeps each one's prompt
    KV (``kv[request id]``: every layer's keys and values of its full prompt blocks, in order)
    as it was when the request finished."""

    kv: dict[str, list[torch.Tensor]]

    def send(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.add(rid, prompt, max_tokens)
        with torch.inference_mode():
            self.run()
        prefill = [s for s in self.steps if isinstance(s, PrefillChunk) and s.request_id == rid]
        table = list(prefill[-1].block_table)[: len(prompt) // BS]
        caches = self.runner.kv_caches
        self.kv[rid] = [cache[table].clone() for layer in caches for cache in layer]


def alone(
    parts: tuple[torch.nn.Module, Any, Any],
    chunk_size: int,
    requests: list[tuple[str, list[int], int]],
    *,
    caching: bool,
) -> Alone:
    model, attention, decoder = parts
    h = Alone(
        model,
        chunk_size=chunk_size,
        num_blocks=64,
        enable_prefix_caching=caching,
        attention=attention,
        decoder=decoder,
        dtype=torch.bfloat16,
    )
    h.kv = {}
    for request in requests:
        h.send(*request)
    return h


def assert_same_bits(cached: Harness, cold: Harness, rid: str) -> None:
    a, b = cached.traces[rid], cold.traces[rid]
    assert a.tokens == b.tokens, rid
    for x, y in zip(a.logits, b.logits, strict=True):
        assert torch.equal(x, y), rid


@pytest.mark.parametrize("chunk_size", [64, 128])
def test_a_prompt_is_the_same_bits_cold_and_after_a_cache_hit(
    wide_bf16: tuple[torch.nn.Module, Any, Any], chunk_size: int
) -> None:
    """One request at a time, bfloat16 on the default kernels. Cached: a 256-token document,
    then the same document again (all of it hits: only its last position runs, a one-row step),
    then a 100-token prompt decoding 40 tokens alone (one row per step, writing the KV of
    positions 100-139) and its follow-up turn (hitting the block those decode steps filled).
    Cold: each of them on a cache of its own. The logits of every step, the tokens and the
    prompts' KV must be the same bits.

    With chunks of one block (64) a hit skips exactly the steps the cold run computes: what
    differs is the number of rows, which our linear kernel does not see. With chunks of 128 a
    hit also moves where a chunk starts, which the attention plan does not let a row see."""
    doc = rand_tokens(256, seed=31)
    turn = rand_tokens(100, seed=32)
    first = [("doc", doc, 2), ("doc-again", doc, 2), (TURN_ID, turn, 40)]
    cached = alone(wide_bf16, chunk_size, first, caching=True)
    follow_up = turn + cached.traces[TURN_ID].tokens + rand_tokens(30, seed=33)
    cached.send(TURN_FOLLOW_UP_ID, follow_up, 2)
    assert cached.traces["doc-again"].num_cached_tokens
    assert cached.traces[TURN_FOLLOW_UP_ID].num_cached_tokens
    for rid, prompt, max_tokens in [*first, (TURN_FOLLOW_UP_ID, follow_up, 2)]:
        cold = alone(wide_bf16, chunk_size, [(rid, prompt, max_tokens)], caching=False)
        assert_same_bits(cached, cold, rid)
        for x, y in zip(cached.kv[rid], cold.kv[rid], strict=True):
            assert torch.equal(x, y), rid


def smollm2_prompts(tokenizer: Any) -> list[tuple[str, list[int], int]]:
    """The caching corpus of test_model_correctness (system prompts, documents, questions
    sharing prefixes in every way the chunk grid cares about), and each of its prompts again
    with another question: 42 prompts."""
    corpus = smollm2_corpus(tokenizer)
    more = [
        (f"{rid}-b", prompt[: max(1, len(prompt) - 9)] + rand_tokens(12, seed=i, vocab=20000), 3)
        for i, (rid, prompt, _) in enumerate(corpus)
    ]
    return corpus + more


@pytest.mark.slow
def test_smollm2_generates_the_same_bits_with_caching_on_and_off(
    smollm2_path: Any, one_thread: None
) -> None:
    """SmolLM2 in bfloat16 on the default kernels, 42 prompts that hit the cache in every way
    the chunk grid allows (one-row last steps, blocks filled by decode steps), each generating 3
    to 5 tokens: the same tokens and the same logits, bit for bit, with caching on and off.
    Chunks of one block and one request at a time: a hit then changes only how many rows a step
    computes."""
    from spyre_server.model.loading import load_model

    loaded = load_model(smollm2_path, torch.bfloat16)
    corpus = smollm2_prompts(loaded.tokenizer)
    runs = {caching: run_smollm2(loaded, corpus, 64, 1, caching) for caching in (True, False)}
    hits = sum(t.num_cached_tokens or 0 for t in runs[True].traces.values())
    assert hits > 2000
    for rid in runs[False].traces:
        assert_same_bits(runs[True], runs[False], rid)


@pytest.mark.slow
def test_smollm2_generates_the_same_bits_with_caching_on_and_off_as_served(
    smollm2_path: Any, one_thread: None
) -> None:
    """The same with the server's chunks (128) and decode batches that mix requests (DESIGN
    §4)."""
    from spyre_server.model.loading import load_model

    loaded = load_model(smollm2_path, torch.bfloat16)
    corpus = smollm2_prompts(loaded.tokenizer)
    runs = {caching: run_smollm2(loaded, corpus, 128, 4, caching) for caching in (True, False)}
    for rid in runs[False].traces:
        assert_same_bits(runs[True], runs[False], rid)


def run_smollm2(
    loaded: Any,
    corpus: list[tuple[str, list[int], int]],
    chunk_size: int,
    max_num_seqs: int,
    caching: bool,
) -> Harness:
    model = cpu_inference_copy(loaded.model, linear_kernel="auto", dtype=torch.bfloat16)
    attention = cpu_attention_kernel("auto", dtype=torch.bfloat16, head_dim=64)
    h = Harness(
        model,
        chunk_size=chunk_size,
        num_blocks=96,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=caching,
        attention=attention,
        decoder=cpu_decoder(model, attention),
        dtype=torch.bfloat16,
    )
    with torch.inference_mode():
        for rid, prompt, max_tokens in corpus:
            h.add(rid, prompt, max_tokens)
        h.run()
    return h


def test_the_bfloat16_default_is_our_linear_kernel() -> None:
    """What the tests above rely on: ``auto`` runs bfloat16 linears on our kernel."""
    assert avx512_bf16_unsupported_reason() is not None or kernels().linear_bf16_dot
    model = cpu_inference_copy(wide_llama().to(torch.bfloat16), linear_kernel="auto",
                               dtype=torch.bfloat16)  # fmt: skip
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
