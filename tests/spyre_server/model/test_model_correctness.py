"""Model correctness of the runner + scheduler against independent oracles (DESIGN §3, §4, §5).

Oracles:
- a plain full forward of fms (default sdpa attention, no cache): ``model(ids)[0, -1]``;
- the same request run alone (for decode batches);
- fms's own ``spyre_paged_attn`` op (copies the cache on every call, fine for a test);
- HF transformers on the same checkpoint (SmolLM2, slow).

Every exact comparison runs in float32. The tiny model is fms's "micro" llama with GQA (4 query
heads, 2 KV heads, 5 layers, vocabulary 256), random weights seeded in tests/conftest.py.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from scheduler import (
    ChunkGrid,
    DecodeBatch,
    ModelRunnerOutput,
    PrefillChunk,
    ScheduledStep,
    Scheduler,
    SchedulerConfig,
)
from spyre_server.model.cpu.paged_attention import PagedAttentionKernel
from spyre_server.model.cpu.runner import CpuModelRunner, StepDecoder
from spyre_server.model.runner import ModelRunner

BS = 64
TINY_VOCAB = 256
LOGIT_TOL = 1e-5
LOGPROB_TOL = 1e-4

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
StepCheck = Callable[[ScheduledStep, KVCaches, "torch.Tensor | None", ModelRunner], None]
"""Called after every step with the step, a copy of the KV cache from before it, the logits the
runner returned and the runner (whose cache now holds the step's writes)."""


# ============================================================================== helpers
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rand_tokens(n: int, seed: int, vocab: int = TINY_VOCAB) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


@torch.inference_mode()
def full_forward_logits(model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """The oracle: one plain forward over the whole sequence (no cache), last position's logits."""
    memo = _ORACLE_MEMO.setdefault(model, {})
    key = tuple(token_ids)
    if key not in memo:
        if len(memo) >= 64:
            memo.clear()
        memo[key] = model(torch.tensor([list(key)]))[0, -1].float()
    return memo[key]


_ORACLE_MEMO: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[int, ...], torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)
"""Oracle results per model, so a prompt run twice is not forwarded twice."""


def rows_of(step: ScheduledStep) -> list[str]:
    """The request ids of the logits rows a step must produce, in order."""
    if isinstance(step, PrefillChunk):
        return [step.request_id] if step.is_last_chunk else []
    return [e.request_id for e in step.entries]


@dataclass
class Trace:
    """What happened to one request."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    """One row per sampled token: [0] from the last prefill chunk, then one per decode step."""
    chunks: list[int] = field(default_factory=list)
    """Indices of the prefill chunks that ran, in order."""
    num_cached_tokens: int | None = None
    finished: bool = False


class Harness:
    """Drives a scheduler and a ModelRunner step by step, greedy, recording per-request traces."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        chunk_size: int,
        num_blocks: int = 64,
        max_num_seqs: int = 8,
        max_model_len: int = 1024,
        enable_prefix_caching: bool = True,
        check: StepCheck | None = None,
        attention: PagedAttentionKernel | None = None,
        decoder: StepDecoder | None = None,
        dtype: torch.dtype = torch.float32,
        sliding_window: int | None = None,
    ) -> None:
        self.sched = Scheduler(
            SchedulerConfig(
                chunk_size=chunk_size,
                num_blocks=num_blocks,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                enable_prefix_caching=enable_prefix_caching,
            ),
            hash_seed=0,
        )
        self.runner = CpuModelRunner(
            model,
            num_blocks=num_blocks,
            block_size=BS,
            dtype=dtype,
            attention=attention,
            decoder=decoder,
            sliding_window=sliding_window,
        )
        self.check = check
        self.traces: dict[str, Trace] = {}
        self.steps: list[ScheduledStep] = []

    def add(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> None:
        self.sched.add_request(request_id, prompt, max_tokens)
        self.traces[request_id] = Trace(list(prompt))

    def step(self) -> bool:
        step = self.sched.schedule()
        if step is None:
            return False
        self.steps.append(step)
        before = None
        if self.check is not None:
            before = [(k.clone(), v.clone()) for k, v in self.runner.kv_caches]
        logits = self.runner.compute_logits(step)
        if self.check is not None:
            assert before is not None
            self.check(step, before, logits, self.runner)
        rids = rows_of(step)
        if isinstance(step, PrefillChunk):
            self.traces[step.request_id].chunks.append(step.chunk_index)
        sampled = {}
        if rids:
            assert logits is not None and logits.shape[0] == len(rids), "one row per sampler"
            for rid, row in zip(rids, logits, strict=True):
                self.traces[rid].logits.append(row.float().clone())
                sampled[rid] = int(row.argmax())
        else:
            assert logits is None, "a non-last prefill chunk samples nothing"
        for out in self.sched.update_from_output(step, ModelRunnerOutput(sampled)):
            trace = self.traces[out.request_id]
            trace.tokens.extend(out.new_token_ids)
            trace.num_cached_tokens = out.num_cached_tokens
            trace.finished = out.finish_reason is not None
        return True

    def run(self) -> None:
        while self.step():
            pass
        assert not self.sched.has_unfinished_requests

    def run_until_first_token(self, request_id: str) -> None:
        while not self.traces[request_id].tokens:
            assert self.step(), f"{request_id} never produced a token"

    def decode_batch_sizes(self) -> list[int]:
        return [len(s.entries) for s in self.steps if isinstance(s, DecodeBatch)]


def expected_prefill(
    prompt_len: int, chunk_size: int, num_hit_blocks: int
) -> tuple[int, list[int]]:
    """(cached tokens, chunk indices that must run) by the DESIGN §4 formula."""
    grid = ChunkGrid(prompt_len, BS, chunk_size)
    usable = grid.usable_hit_blocks(num_hit_blocks)
    first = (usable * BS + grid.num_left_pad_tokens) // chunk_size
    return usable * BS, list(range(first, grid.num_chunks))


def log_softmax_rows(rows: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.log_softmax(row.double(), dim=-1) for row in rows]


# ================================================= 1. paged chunked prefill == full forward
CHUNK_SIZES = (64, 128, 192, 256, 512)
PROMPT_LENS = (64, 100, 256, 300, 511)
SUFFIX_LEN = 40


def prefill_cases(prompt_len: int) -> list[tuple[str, list[int], int]]:
    """(request id, prompt, blocks the prefix cache must hit), run one after the other.

    "cold" has nothing to hit; "partial" shares the cold prompt up to 10 tokens before its end
    (the block holding the divergence is not a hit); "identical" is the cold prompt again (every
    full block hits, the last chunk is recomputed); "extended" is the cold prompt plus a suffix
    (a multi-turn follow-up).
    """
    cold = rand_tokens(prompt_len, seed=prompt_len)
    shared = prompt_len - 10
    return [
        ("cold", cold, 0),
        (
            "partial",
            cold[:shared] + rand_tokens(SUFFIX_LEN, seed=10_000 + prompt_len),
            shared // BS,
        ),
        ("identical", cold, prompt_len // BS),
        ("extended", cold + rand_tokens(SUFFIX_LEN, seed=20_000 + prompt_len), prompt_len // BS),
    ]


def test_the_prefill_cases_cover_left_padding_and_usable_hits() -> None:
    pad_blocks: set[int] = set()
    hit_pad_blocks: set[int] = set()
    partial_skips = 0
    for chunk_size in CHUNK_SIZES:
        for prompt_len in PROMPT_LENS:
            for _, prompt, hit_blocks in prefill_cases(prompt_len):
                grid = ChunkGrid(len(prompt), BS, chunk_size)
                pad_blocks.add(grid.num_left_pad_tokens // BS)
                cached, chunks = expected_prefill(len(prompt), chunk_size, hit_blocks)
                if cached:
                    hit_pad_blocks.add(grid.num_left_pad_tokens // BS)
                    partial_skips += chunks[0] > 0
    assert {0, 1} <= pad_blocks and max(pad_blocks) >= 3, pad_blocks
    assert {0, 1} <= hit_pad_blocks and max(hit_pad_blocks) >= 3, hit_pad_blocks
    assert partial_skips >= 20


@pytest.mark.parametrize("prompt_len", PROMPT_LENS)
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_paged_chunked_prefill_equals_one_full_forward(
    tiny_llama: torch.nn.Module, one_thread: None, chunk_size: int, prompt_len: int
) -> None:
    h = Harness(tiny_llama, chunk_size=chunk_size)
    worst = 0.0
    for rid, prompt, hit_blocks in prefill_cases(prompt_len):
        steps_before = len(h.steps)
        h.add(rid, prompt, max_tokens=1)
        h.run()
        trace = h.traces[rid]
        cached, chunks = expected_prefill(len(prompt), chunk_size, hit_blocks)
        assert trace.num_cached_tokens == cached, rid
        if hit_blocks and ChunkGrid(len(prompt), BS, chunk_size).usable_hit_blocks(hit_blocks):
            assert cached > 0
        # The skipped chunks never ran: exactly the expected chunks, one step each.
        assert trace.chunks == chunks, rid
        assert len(h.steps) - steps_before == len(chunks), rid
        diff = max_abs(trace.logits[0], full_forward_logits(tiny_llama, prompt))
        worst = max(worst, diff)
        assert diff <= LOGIT_TOL, (rid, diff)
        h.sched.check_integrity()
    print(f"\nprefill C={chunk_size} L={prompt_len}: max |logit diff| vs full forward {worst:.2e}")


# ======================================================== 2. prefix caching on == off
def tiny_corpus() -> list[tuple[str, list[int], int]]:
    """>= 20 prompts sharing prefixes in every way the chunk grid cares about."""
    doc = rand_tokens(600, seed=1)
    other = rand_tokens(300, seed=2)
    q = iter(range(100, 1000))

    def fresh(n: int) -> list[int]:
        return rand_tokens(n, seed=next(q))

    prompts = [
        doc[:100],
        doc[:100],  # identical, one full block
        doc[:256],  # a multiple of 64 and of 128
        doc[:256],  # identical multiple of 64: every block hits, the last chunk is recomputed
        doc[:256] + fresh(30),  # extends past a chunk boundary
        doc[:200] + fresh(100),  # diverges mid-block
        doc[:128] + fresh(70),  # diverges on a chunk boundary
        doc[:64],  # exactly one block
        doc[:63] + fresh(20),  # diverges one token before a block boundary
        doc[:65] + fresh(20),  # diverges one token after
        doc[:384],
        doc[:384] + fresh(128),  # 512
        doc[:511],
        doc[:512],
        other,  # another document
        other + fresh(5),
        doc[:192] + other[:100],
        other[:64] + doc[:200],  # doc's tokens, but not as a prefix: no hit
        fresh(1),
        doc[:10],
        doc[:320] + fresh(64),  # 384
        doc[:100] + fresh(100),
    ]
    corpus = [(f"p{i:02d}", p, 12 if i % 4 == 0 else 3) for i, p in enumerate(prompts)]
    # Its follow-up turn hits a block whose last 8 positions were written by decode steps.
    corpus.append((TURN_ID, doc[:120], 12))
    return corpus


TURN_ID = "turn"
TURN_FOLLOW_UP_ID = "turn-next"


def run_corpus(
    model: torch.nn.Module,
    corpus: list[tuple[str, list[int], int]],
    *,
    chunk_size: int,
    enable_prefix_caching: bool,
    num_blocks: int,
    max_num_seqs: int = 4,
    vocab: int = TINY_VOCAB,
) -> Harness:
    """All prompts at once (decode batches mix), then one multi-turn follow-up: the TURN_ID
    request's prompt + output + a new turn."""
    h = Harness(
        model,
        chunk_size=chunk_size,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=enable_prefix_caching,
        max_model_len=1024,
    )
    for rid, prompt, max_tokens in corpus:
        h.add(rid, prompt, max_tokens)
    h.run()
    turn = h.traces[TURN_ID]
    h.add(TURN_FOLLOW_UP_ID, turn.prompt + turn.tokens + rand_tokens(20, 5000, vocab), 4)
    h.run()
    return h


def compare_runs(cached: Harness, uncached: Harness) -> float:
    """Identical greedy tokens; returns max |logprob difference| over all generated positions."""
    worst = 0.0
    assert cached.traces.keys() == uncached.traces.keys()
    for rid, trace in cached.traces.items():
        ref = uncached.traces[rid]
        assert trace.tokens == ref.tokens, rid
        assert len(trace.logits) == len(ref.logits) == len(trace.tokens)
        for a, b in zip(log_softmax_rows(trace.logits), log_softmax_rows(ref.logits), strict=True):
            worst = max(worst, max_abs(a, b))
    return worst


@pytest.mark.parametrize(
    ("chunk_size", "num_blocks"),
    [(64, 96), (256, 24)],  # 24: far fewer blocks than the corpus fills, so cached blocks are
    # evicted and their ids reused while the run goes on
)
def test_prefix_caching_on_and_off_generate_the_same(
    tiny_llama: torch.nn.Module, one_thread: None, chunk_size: int, num_blocks: int
) -> None:
    corpus = tiny_corpus()
    assert len(corpus) >= 20
    runs = {
        caching: run_corpus(
            tiny_llama,
            corpus,
            chunk_size=chunk_size,
            enable_prefix_caching=caching,
            num_blocks=num_blocks,
        )
        for caching in (True, False)
    }
    on, off = runs[True], runs[False]
    worst = compare_runs(on, off)
    hits = sum(t.num_cached_tokens or 0 for t in on.traces.values())
    print(
        f"\ncaching on/off C={chunk_size}: max |logprob diff| {worst:.2e}, cached tokens {hits}, "
        f"prefill steps {sum(isinstance(s, PrefillChunk) for s in on.steps)} vs "
        f"{sum(isinstance(s, PrefillChunk) for s in off.steps)}"
    )
    assert worst <= LOGPROB_TOL
    assert hits > 0, "the cached run never hit"
    assert sum(t.num_cached_tokens or 0 for t in off.traces.values()) == 0
    assert sum(isinstance(s, PrefillChunk) for s in on.steps) < sum(
        isinstance(s, PrefillChunk) for s in off.steps
    )
    assert max(on.decode_batch_sizes()) >= 3, "decode batches must mix requests"
    # The follow-up turn hits the block whose positions 120..127 were written by decode steps.
    follow_up = on.traces[TURN_FOLLOW_UP_ID]
    turn = on.traces[TURN_ID]
    assert len(turn.prompt) == 120 and len(turn.tokens) == 12
    cached, _ = expected_prefill(len(follow_up.prompt), chunk_size, 2)
    assert follow_up.num_cached_tokens == cached
    assert cached > 0 or chunk_size > 128


# ====================================================== 3. decode in a batch == alone
BATCH_PROMPTS = {
    "a": (rand_tokens(70, seed=71), 12),
    "b": (rand_tokens(130, seed=72), 20),
    "c": (rand_tokens(200, seed=73), 6),
    "d": (rand_tokens(300, seed=74), 15),
    "e": (rand_tokens(64, seed=75), 25),
    "f": (rand_tokens(257, seed=76), 9),
    "a2": (rand_tokens(70, seed=71), 10),  # a's prompt again: shares its full block
}


def test_decode_in_a_batch_equals_decode_alone(
    tiny_llama: torch.nn.Module, one_thread: None
) -> None:
    batch = Harness(tiny_llama, chunk_size=128, max_num_seqs=4)
    for rid, (prompt, max_tokens) in BATCH_PROMPTS.items():
        batch.add(rid, prompt, max_tokens)
    batch.run()
    sizes = batch.decode_batch_sizes()
    assert max(sizes) == 4 and len(set(sizes)) >= 3, sizes
    worst = 0.0
    for rid, (prompt, max_tokens) in BATCH_PROMPTS.items():
        alone = Harness(tiny_llama, chunk_size=128, max_num_seqs=1)
        alone.add(rid, prompt, max_tokens)
        alone.run()
        assert set(alone.decode_batch_sizes()) == {1}
        got, ref = batch.traces[rid], alone.traces[rid]
        assert got.tokens == ref.tokens, rid
        assert len(got.logits) == len(ref.logits) == max_tokens
        for i, (a, b) in enumerate(zip(got.logits, ref.logits, strict=True)):
            diff = max_abs(a, b)
            worst = max(worst, diff)
            assert diff <= LOGIT_TOL, (rid, i, diff)
    print(
        f"\ndecode batch vs alone: max |logit diff| {worst:.2e} (batch sizes {sorted(set(sizes))})"
    )


def test_decode_logits_equal_a_full_forward(tiny_llama: torch.nn.Module, one_thread: None) -> None:
    """Every decode step of a mixed batch against the plain full-forward oracle."""
    h = Harness(tiny_llama, chunk_size=128, max_num_seqs=4)
    for rid, (prompt, max_tokens) in list(BATCH_PROMPTS.items())[:4]:
        h.add(rid, prompt, min(max_tokens, 5))
    h.run()
    worst = 0.0
    for rid, trace in h.traces.items():
        for i, row in enumerate(trace.logits):
            ref = full_forward_logits(tiny_llama, trace.prompt + trace.tokens[:i])
            diff = max_abs(row, ref)
            worst = max(worst, diff)
            assert diff <= LOGIT_TOL, (rid, i, diff)
    print(f"\ndecode vs full forward: max |logit diff| {worst:.2e}")


# ============================================= 5. fms's own spyre_paged_attn as a 2nd oracle
@torch.inference_mode()
def fms_paged_forward(
    model: torch.nn.Module, step: ScheduledStep, kv_caches: KVCaches
) -> tuple[torch.Tensor, KVCaches]:
    """Run ``step`` through fms's ``spyre_paged_attn`` on a copy of ``kv_caches``.

    Its store op writes every query position at its slot (block 0 included); with a block table
    its compute op attends, per row, keys ``left_padded_prompt_mask .. current_tkv_mask - 1`` read
    through the block table, causally aligned to the end of that range. A prefill chunk is fed
    in full (its recomputed cached positions too). Returns the last position's logits per row and
    the updated caches.
    """
    import fms.utils.spyre.paged  # noqa: F401  (registers "spyre_paged_attn")

    caches = [(k.clone(), v.clone()) for k, v in kv_caches]
    if isinstance(step, PrefillChunk):
        num_blocks = cdiv(step.num_context_tokens, BS)
        input_ids = torch.tensor([step.token_ids])
        position_ids = torch.tensor([step.positions])
        slot_mapping = torch.tensor([step.slot_mapping])
        block_table = torch.tensor([step.block_table[:num_blocks]])
        tkv = torch.tensor([step.num_context_tokens])
    else:
        width = max(len(e.block_table) for e in step.entries)
        input_ids = torch.tensor([[e.token_id] for e in step.entries])
        position_ids = torch.tensor([[e.position] for e in step.entries])
        slot_mapping = torch.tensor([[e.slot] for e in step.entries])
        block_table = torch.tensor(
            [list(e.block_table) + [0] * (width - len(e.block_table)) for e in step.entries]
        )
        tkv = torch.tensor([e.position + 1 for e in step.entries])
    logits, new_caches = model(
        input_ids,
        position_ids=position_ids,
        past_key_value_states=caches,
        use_cache=True,
        attn_name="spyre_paged_attn",
        slot_mapping=slot_mapping,
        block_table=block_table,
        current_tkv_mask=tkv,
        left_padded_prompt_mask=torch.zeros_like(tkv),
    )
    return logits[:, -1].float(), [(k, v) for k, v in new_caches]


class FmsPagedOracle:
    """A Harness check: every step's logits and KV writes against fms's spyre_paged_attn."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.worst_logits = 0.0
        self.worst_kv = 0.0
        self.num_logit_rows = 0
        self.num_steps = 0

    def __call__(
        self,
        step: ScheduledStep,
        before: KVCaches,
        logits: torch.Tensor | None,
        runner: ModelRunner,
    ) -> None:
        ref_logits, ref_caches = fms_paged_forward(self.model, step, before)
        self.num_steps += 1
        if logits is not None:
            diff = max_abs(logits, ref_logits)
            self.worst_logits = max(self.worst_logits, diff)
            self.num_logit_rows += logits.shape[0]
            assert diff <= LOGIT_TOL, (step, diff)
        # Block 0 is the write sink: what lands there is never read.
        for (k, v), (ref_k, ref_v) in zip(runner.kv_caches, ref_caches, strict=True):
            diff = max(max_abs(k[1:], ref_k[1:]), max_abs(v[1:], ref_v[1:]))
            self.worst_kv = max(self.worst_kv, diff)
            assert diff <= LOGIT_TOL, (step, diff)


@pytest.mark.parametrize("chunk_size", [64, 192])
def test_steps_match_fms_spyre_paged_attention(
    tiny_llama: torch.nn.Module, one_thread: None, chunk_size: int
) -> None:
    oracle = FmsPagedOracle(tiny_llama)
    h = Harness(tiny_llama, chunk_size=chunk_size, max_num_seqs=4, check=oracle)
    a = rand_tokens(300, seed=300)
    h.add("a", a, 8)
    h.run_until_first_token("a")  # a's prompt blocks are cached now, a keeps decoding
    h.add("identical", a, 3)  # every full block hits; boundary chunk written to block 0
    h.add("partial", a[:260] + rand_tokens(40, seed=301), 6)
    h.add("multiple-of-64", a[:256], 4)  # the last chunk may be all cached: only its logits run
    h.add("short", rand_tokens(70, seed=302), 5)
    h.run()
    assert sum(t.num_cached_tokens or 0 for t in h.traces.values()) > 0
    assert max(h.decode_batch_sizes()) >= 3
    print(
        f"\nfms spyre_paged_attn C={chunk_size}: {oracle.num_steps} steps, "
        f"{oracle.num_logit_rows} logit rows, max |logit diff| {oracle.worst_logits:.2e}, "
        f"max |KV diff| {oracle.worst_kv:.2e}"
    )


# ================================================================ SmolLM2 (slow)
SYSTEM_TEXT = (
    "You are a careful assistant for a small public library. Answer questions about opening "
    "hours, borrowing rules, events and the catalogue. Be brief and friendly. If you do not know "
    "an answer, say so and suggest asking a librarian at the front desk. Never invent book "
    "titles, dates or prices. Members may borrow up to ten items at once for three weeks; "
    "renewals are possible twice unless another member has reserved the item."
)
DOCUMENT_TEXT = (
    "The library opens at nine in the morning from Monday to Friday and at ten on Saturdays. It "
    "is closed on Sundays and public holidays. The reading room on the first floor is a quiet "
    "zone; group study rooms can be booked online up to a week ahead. Children's story time "
    "takes place every Wednesday at four in the afternoon in the garden room. The monthly book "
    "club meets on the last Thursday of each month; this season it reads classic novels, "
    "starting with Pride and Prejudice. Printing costs ten cents per page in black and white "
    "and fifty cents in colour. Lost cards can be replaced at the front desk for two euros. "
    "Overdue items cost twenty cents per day, capped at five euros per item. The library also "
    "lends laptops, e-readers and board games to members over sixteen. Wi-Fi is free for "
    "everyone; the network name is printed on the back of every library card. Donations of "
    "recent books in good condition are welcome on the first Monday of each month. Members can "
    "suggest new titles through the website; the acquisitions team reviews suggestions every "
    "two weeks and orders the most requested ones. The local history collection in the "
    "basement holds maps, newspapers and photographs going back two centuries and can be "
    "visited by appointment on Tuesday and Thursday afternoons."
)
OTHER_TEXT = (
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light "
    "energy into chemical energy. In the chloroplasts, chlorophyll absorbs mostly blue and red "
    "light. Water molecules are split, releasing oxygen, while carbon dioxide from the air is "
    "fixed into sugars in the Calvin cycle. The overall reaction uses six molecules of carbon "
    "dioxide and six of water to make one molecule of glucose and six of oxygen."
)
QUESTIONS = (
    " Question: When does the library open on Saturdays? Answer:",
    " Question: How much does colour printing cost? Answer:",
    " Question: Can I borrow a laptop? Answer:",
    " Question: What does the book club read? Answer:",
    " Question: What gas do plants release? Answer:",
)


def smollm2_corpus(tokenizer: object) -> list[tuple[str, list[int], int]]:
    """Text prompts as token ids, sharing prefixes the ways tiny_corpus does."""

    def enc(text: str) -> list[int]:
        return list(tokenizer.encode(text))  # type: ignore[attr-defined]

    system, doc, other = enc(SYSTEM_TEXT), enc(" " + DOCUMENT_TEXT), enc(" " + OTHER_TEXT)
    q = [enc(text) for text in QUESTIONS]
    both = system + doc
    assert len(both) > 320, len(both)
    prompts = [
        system + q[0],
        system + q[1],
        system + q[0],  # identical
        both[:256] + q[0],
        both[:256] + q[1],  # shares 4 blocks, 2 chunks
        system + doc[:40] + q[2],  # diverges inside the document
        doc[:150] + q[0],  # the document without the system prompt: no hit
        system,
        both[:128],  # multiples of 64
        both[:256],
        both[:192],
        both[:200] + q[3],
        q[0],
        other,
        other + q[4],
        system + other[:40] + q[4],
        both[:320],
        both[:300] + q[2],
        both[:256] + q[0],  # identical to the 4th
        system + q[2],
    ]
    corpus = [(f"p{i:02d}", p, 3 + i % 3) for i, p in enumerate(prompts)]
    corpus.append((TURN_ID, both[:120], 12))  # 8 of block 1's positions written by decode
    return corpus


@pytest.mark.slow
def test_smollm2_prefix_caching_on_and_off_generate_the_same(
    smollm2_fp32: object, one_thread: None
) -> None:
    loaded = smollm2_fp32
    corpus = smollm2_corpus(loaded.tokenizer)  # type: ignore[attr-defined]
    assert len(corpus) >= 20
    runs = {
        caching: run_corpus(
            loaded.model,  # type: ignore[attr-defined]
            corpus,
            chunk_size=128,
            enable_prefix_caching=caching,
            num_blocks=48,
            vocab=loaded.vocab_size,  # type: ignore[attr-defined]
        )
        for caching in (True, False)
    }
    on, off = runs[True], runs[False]
    worst = compare_runs(on, off)
    hits = sum(t.num_cached_tokens or 0 for t in on.traces.values())
    print(f"\nSmolLM2 caching on/off: max |logprob diff| {worst:.2e}, cached tokens {hits}")
    assert hits > 0
    assert worst <= 1e-3
    follow_up = on.traces[TURN_FOLLOW_UP_ID]
    assert follow_up.num_cached_tokens == expected_prefill(len(follow_up.prompt), 128, 2)[0] > 0


def hf_last_logits(path: Path, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [hf(torch.tensor([list(p)])).logits[0, -1].float() for p in prompts]


@pytest.mark.slow
def test_smollm2_runner_matches_hf_transformers(
    smollm2_path: Path, smollm2_fp32: object, one_thread: None
) -> None:
    loaded = smollm2_fp32
    tok = loaded.tokenizer  # type: ignore[attr-defined]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompts = [
        list(tok.encode("The capital of France is")),
        list(tok.encode(chat)),
        list(tok.encode(SYSTEM_TEXT + " " + DOCUMENT_TEXT + QUESTIONS[0])),
    ]
    assert len(prompts[2]) > 256
    h = Harness(loaded.model, chunk_size=128, num_blocks=24)  # type: ignore[attr-defined]
    for i, prompt in enumerate(prompts):
        h.add(f"r{i}", prompt, 1)
    h.run()
    assert len(h.traces["r2"].chunks) >= 3
    refs = hf_last_logits(smollm2_path, prompts)
    diffs = [max_abs(h.traces[f"r{i}"].logits[0], ref) for i, ref in enumerate(refs)]
    print(f"\nSmolLM2 runner vs HF transformers: max |logit diff| per prompt {diffs}")
    for i, ref in enumerate(refs):
        assert int(ref.argmax()) == h.traces[f"r{i}"].tokens[0]
    assert max(diffs) <= 1e-3


@pytest.mark.slow
def test_smollm2_says_paris(smollm2_path: Path, smollm2_fp32: object, one_thread: None) -> None:
    from spyre_server.config import load_config
    from spyre_server.engine.factory import build_engine
    from spyre_server.entrypoints.llm import LLM
    from spyre_server.sample.sampler import SamplingParams

    config = load_config(
        environ={},
        overrides={
            "model.path": str(smollm2_path),
            "model.dtype": "float32",
            "cache.num_blocks": 64,
        },
    )
    llm = LLM(build_engine(config, smollm2_fp32))  # type: ignore[arg-type]
    [out] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
    print(f"\nSmolLM2: 'The capital of France is' -> {out.text!r}")
    assert out.error is None
    assert out.text.startswith(" Paris"), out.text
