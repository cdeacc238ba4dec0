"""The batched sampler (spyre_server/sample/sampler.py): validation, greedy, seeds, top-k / top-p,
distribution, logprobs."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from spyre_server.sample.sampler import MAX_LOGPROBS, SamplingParams, sample

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """These are many tiny ops: one thread is faster, and much faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def logits_of(probs: list[float]) -> torch.Tensor:
    """One row of logits whose softmax is ``probs``."""
    return torch.tensor([probs]).log()


def random_logits(rows: int, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def draw(logits_row: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    """``n`` draws of one row: a batch of ``n`` copies, each at its own position (seeded rows
    get independent randomness per position)."""
    batch = logits_row.reshape(1, -1).expand(n, -1)
    return sample(batch, [params] * n, list(range(n))).token_ids


def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs, strict=True))


# --- SamplingParams validation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", -0.5),
        ("top_p", math.nan),
        ("top_k", 0),
        ("top_k", -1),
        ("logprobs", -1),
        ("logprobs", MAX_LOGPROBS + 1),
    ],
)
def test_bad_field_raises_value_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=("end", ""))


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(max_tokens=0, top_k=0, logprobs=99)
    for field in ("max_tokens", "top_k", "logprobs"):
        assert field in str(info.value)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(top_p=1.0, top_k=1, logprobs=0),
        SamplingParams(logprobs=MAX_LOGPROBS, stop=("a", "bc"), max_tokens=1),
    ],
)
def test_valid_params_are_accepted(params: SamplingParams) -> None:
    assert params.is_greedy == (params.temperature == 0)


# --- greedy and seeds -----------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = random_logits(16)
    result = sample(logits, [GREEDY] * 16, list(range(16)))
    assert result.token_ids == logits.argmax(dim=-1).tolist()
    assert result.logprobs == [None] * 16


def test_greedy_ignores_the_seed_and_the_global_rng() -> None:
    logits = random_logits(4)
    params = [SamplingParams(temperature=0, seed=s) for s in range(4)]
    assert sample(logits, params, [3] * 4).token_ids == logits.argmax(dim=-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    logits = random_logits(6, seed=1)
    row = logits[2]
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [sample(row.unsqueeze(0), [seeded], [pos]).token_ids[0] for pos in range(12)]

    others = [
        SamplingParams(temperature=0.7),
        GREEDY,
        SamplingParams(temperature=1.3, seed=99, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.5),
    ]
    for pos in range(12):
        # the seeded row at different places among different neighbours, with other positions
        for index in (0, 2, 4):
            params = list(others)
            params.insert(index, seeded)
            positions = [pos + 17 * i + 1 for i in range(5)]
            positions[index] = pos
            rows = [logits[j] for j in (0, 1, 3, 4)]
            rows.insert(index, row)
            batch = torch.stack(rows)
            token = sample(batch, params, positions).token_ids[index]
            assert token == alone[pos], (pos, index)


def test_same_seed_repeats_and_positions_and_seeds_decorrelate() -> None:
    flat = torch.zeros(1, 256)  # uniform over 256 tokens
    by_seed = [sample(flat, [SamplingParams(seed=s)], [10]).token_ids[0] for s in range(100)]
    assert by_seed == [
        sample(flat, [SamplingParams(seed=s)], [10]).token_ids[0] for s in range(100)
    ]
    by_position = draw(flat[0], SamplingParams(seed=5), 100)
    # uniform over 256: 100 draws of independent streams give ~82 distinct values
    assert len(set(by_seed)) > 60
    assert len(set(by_position)) > 60
    other_seed = draw(flat[0], SamplingParams(seed=6), 100)
    assert sum(a == b for a, b in zip(by_position, other_seed, strict=True)) < 10


def test_top_k_1_is_greedy() -> None:
    logits = random_logits(32, seed=2)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(32)]
    assert sample(logits, params, list(range(32))).token_ids == logits.argmax(-1).tolist()


# --- top-k / top-p support ------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 5, 17])
def test_top_k_restricts_support_to_the_k_best(k: int) -> None:
    row = random_logits(1, seed=k)[0]
    allowed = set(row.topk(k).indices.tolist())
    # temperature 3 flattens the distribution so that every allowed token shows up
    tokens = draw(row, SamplingParams(temperature=3.0, top_k=k, seed=11), 1500)
    assert set(tokens) == allowed


# Rule (sampling._top_k_top_p): sort by probability, keep a token iff the probability mass
# of the tokens ranked before it is < top_p (so the best token is always kept, and the kept set is
# the smallest prefix whose mass reaches top_p). Probabilities 0.5, 0.3, 0.15, 0.05 have preceding
# masses 0, 0.5, 0.8, 0.95.
TOP_P_PROBS = [0.15, 0.5, 0.05, 0.3]  # deliberately not sorted: ids by rank are 1, 3, 0, 2


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [
        (0.3, {1}),
        (0.45, {1}),
        (0.55, {1, 3}),
        (0.7, {1, 3}),
        (0.79, {1, 3}),
        (0.81, {1, 3, 0}),
        (0.94, {1, 3, 0}),
        (0.96, {1, 3, 0, 2}),
        (1.0, {1, 3, 0, 2}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, kept: set[int]) -> None:
    row = logits_of(TOP_P_PROBS)[0]
    tokens = draw(row, SamplingParams(top_p=top_p, seed=3), 2000)
    assert set(tokens) == kept
    # the kept tokens are renormalised, not reweighted
    mass = sum(TOP_P_PROBS[t] for t in kept)
    counts = [tokens.count(t) for t in sorted(kept)]
    if len(kept) > 1:
        assert chi_square(counts, [TOP_P_PROBS[t] / mass for t in sorted(kept)]) < 20


def test_top_k_applies_before_top_p() -> None:
    # top_k=2 renormalises 0.5, 0.3 to 0.625, 0.375; top_p=0.6 then keeps only the best, whereas
    # top_p=0.6 alone would keep two tokens.
    row = logits_of(TOP_P_PROBS)[0]
    assert set(draw(row, SamplingParams(top_p=0.6, top_k=2, seed=4), 500)) == {1}
    assert set(draw(row, SamplingParams(top_p=0.6, seed=4), 500)) == {1, 3}


def test_top_p_applies_to_the_temperature_scaled_distribution() -> None:
    # temperature 0.5 sharpens 0.5, 0.3, 0.15, 0.05 to (0.25, 0.09, 0.0225, 0.0025) / 0.365 =
    # 0.685, 0.247, 0.062, 0.007: top_p=0.6 then keeps only the best token (at temperature 1 the
    # second token's preceding mass is 0.5 < 0.6 and it is kept).
    row = logits_of(TOP_P_PROBS)[0]
    assert set(draw(row, SamplingParams(temperature=0.5, top_p=0.6, seed=4), 500)) == {1}
    assert set(draw(row, SamplingParams(temperature=1.0, top_p=0.6, seed=4), 500)) == {1, 3}


# --- the sampled distribution ---------------------------------------------------------------------

DIST = [0.4, 0.3, 0.2, 0.1]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
@pytest.mark.parametrize("seeded", [True, False])
def test_sample_frequencies_match_softmax_of_logits_over_t(
    temperature: float, seeded: bool
) -> None:
    torch.manual_seed(1)
    weights = [p ** (1 / temperature) for p in DIST]
    expected = [w / sum(weights) for w in weights]
    params = SamplingParams(temperature=temperature, seed=7 if seeded else None)
    tokens = draw(logits_of(DIST)[0], params, 4000)
    counts = [tokens.count(t) for t in range(4)]
    # 3 degrees of freedom: P(chi2 > 20) < 2e-4
    assert chi_square(counts, expected) < 20, (counts, expected)


def test_rows_of_a_batch_sample_from_their_own_distribution() -> None:
    torch.manual_seed(2)
    a, b = logits_of([0.9, 0.05, 0.05, 0.0]), logits_of([0.0, 0.1, 0.1, 0.8])
    n = 1000
    batch = torch.cat([a, b] * n)
    tokens = sample(batch, [SamplingParams()] * (2 * n), [0] * (2 * n)).token_ids
    assert chi_square([tokens[0::2].count(t) for t in range(3)], [0.9, 0.05, 0.05]) < 20
    assert chi_square([tokens[1::2].count(t) for t in range(1, 4)], [0.1, 0.1, 0.8]) < 20


# --- logprobs ------------------------------------------------------------------------------------


def test_logprobs_are_of_the_raw_logits_and_sorted() -> None:
    logits = random_logits(3, seed=5)
    params = [
        SamplingParams(temperature=0.5, seed=1, logprobs=5),
        SamplingParams(temperature=0, logprobs=MAX_LOGPROBS),
        SamplingParams(temperature=2.0, top_k=3, seed=2, logprobs=1),
    ]
    result = sample(logits, params, [0, 0, 0])
    reference = torch.log_softmax(logits.double(), dim=-1)
    for i, (p, lp) in enumerate(zip(params, result.logprobs, strict=True)):
        assert lp is not None
        assert lp.token_id == result.token_ids[i]
        assert lp.logprob == pytest.approx(float(reference[i, lp.token_id]), abs=1e-5)
        assert len(lp.top) == p.logprobs
        ids = [t for t, _ in lp.top]
        values = [v for _, v in lp.top]
        assert ids == reference[i].topk(len(ids)).indices.tolist()
        assert values == sorted(values, reverse=True)
        for token_id, value in lp.top:
            assert value == pytest.approx(float(reference[i, token_id]), abs=1e-5)
    assert result.logprobs[1] is not None
    assert result.logprobs[1].top[0][0] == result.token_ids[1]  # greedy picks the best


def test_logprobs_zero_gives_only_the_chosen_token_and_none_gives_nothing() -> None:
    logits = random_logits(3, seed=6)
    params = [SamplingParams(logprobs=0, seed=1), SamplingParams(seed=2), GREEDY]
    result = sample(logits, params, [4, 4, 4])
    first = result.logprobs[0]
    assert first is not None and first.top == ()
    expected = torch.log_softmax(logits[0], dim=-1)[result.token_ids[0]]
    assert first.logprob == pytest.approx(float(expected), abs=1e-5)
    assert result.logprobs[1:] == [None, None]


def test_mixed_batch_of_greedy_and_random_rows() -> None:
    logits = random_logits(8, seed=7)
    params = [
        GREEDY if i % 2 == 0 else SamplingParams(temperature=1.0, seed=100 + i) for i in range(8)
    ]
    positions = list(range(8))
    result = sample(logits, params, positions)
    argmax = logits.argmax(-1).tolist()
    for i in range(0, 8, 2):
        assert result.token_ids[i] == argmax[i]
    for i in range(1, 8, 2):  # the seeded random rows equal their solo samples
        solo = sample(logits[i : i + 1], [params[i]], [positions[i]]).token_ids[0]
        assert result.token_ids[i] == solo
    # and they do sample: over many positions a random row is not always the argmax
    row = logits[1] / 4  # flatter
    tokens = draw(row, SamplingParams(seed=1), 200)
    assert len(set(tokens)) > 5


# --- top-k / top-p on a real-sized vocabulary (the "best 256, widen when needed" path) -----------

REAL_VOCAB = 49_152  # SmolLM2's


def full_sort_top_k_top_p(scaled: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """The exact oracle: sort the whole vocabulary (float64), apply top-k, renormalise, then keep a
    token iff the mass ranked before it is < top_p; return dense renormalised weights."""
    probs = torch.softmax(scaled.double(), dim=-1)
    values, ids = probs.sort(descending=True)
    if top_k is not None:
        values[top_k:] = 0.0
    values /= values.sum()
    before = values.cumsum(0) - values
    values[before >= top_p] = 0.0
    values /= values.sum()
    return torch.zeros_like(probs).scatter_(0, ids, values)


def _rows_for_real_vocab() -> tuple[torch.Tensor, list[tuple[int | None, float]]]:
    g = torch.Generator().manual_seed(42)
    peaked = torch.randn(REAL_VOCAB, generator=g) * 4  # a few hundred tokens carry the mass
    flat = torch.randn(REAL_VOCAB, generator=g) * 0.05  # near-uniform: top_p needs ~all tokens
    medium = torch.randn(REAL_VOCAB, generator=g) * 1.5
    rows = torch.stack([peaked, flat, flat, medium, medium, peaked])
    settings: list[tuple[int | None, float]] = [
        (None, 0.9),  # fits in the first 256 candidates
        (None, 0.5),  # needs about half the vocabulary: widens several times
        (1000, 0.95),  # top-k beyond 256 candidates
        (40_000, 0.8),  # top-k cut and widening together
        (None, 0.999),
        (5, 1.0),  # top-k only
    ]
    return rows, settings


def test_top_k_top_p_at_real_vocab_size_match_a_full_sort_oracle() -> None:
    from spyre_server.sample.sampler import CANDIDATES, _top_k_top_p

    rows, settings = _rows_for_real_vocab()
    params = [SamplingParams(top_k=k, top_p=p) for k, p in settings]
    weights, ids = _top_k_top_p(rows.clone(), params)
    assert weights.shape[1] > CANDIDATES  # the flat rows made it widen
    dense = torch.zeros(rows.shape, dtype=torch.float64)
    dense.scatter_(1, ids, weights.double())
    dense /= dense.sum(dim=-1, keepdim=True)
    for i, (k, p) in enumerate(settings):
        expected = full_sort_top_k_top_p(rows[i], k, p)
        kept, expected_kept = dense[i] > 0, expected > 0
        if not torch.equal(kept, expected_kept):
            # only a token whose preceding mass is within float32 rounding of top_p may differ
            differing = (kept != expected_kept).nonzero().flatten()
            mass_before = _mass_before(rows[i], k)
            assert all(abs(float(mass_before[t]) - p) < 1e-5 for t in differing), (i, differing)
        assert int(expected_kept.sum()) > (CANDIDATES if i in (1, 2, 3) else 0)
        torch.testing.assert_close(dense[i], expected, atol=1e-6, rtol=1e-4)


def _mass_before(row: torch.Tensor, top_k: int | None) -> torch.Tensor:
    probs = torch.softmax(row.double(), dim=-1)
    values, ids = probs.sort(descending=True)
    if top_k is not None:
        values[top_k:] = 0.0
    values /= values.sum()
    return torch.zeros_like(probs).scatter_(0, ids, values.cumsum(0) - values)


def test_sampling_at_real_vocab_size_stays_in_the_oracle_set_and_reaches_beyond_256() -> None:
    rows, settings = _rows_for_real_vocab()
    n = 64
    for i in (1, 2, 5):
        k, p = settings[i]
        params = SamplingParams(top_k=k, top_p=p, seed=i)
        tokens = sample(rows[i].expand(n, -1), [params] * n, list(range(n))).token_ids
        allowed = full_sort_top_k_top_p(rows[i], k, p) > 0
        assert all(bool(allowed[t]) for t in tokens)
        ranks = rows[i].argsort(descending=True).argsort()
        if i in (1, 2):  # flat rows: the draws land far beyond the 256 best
            assert max(int(ranks[t]) for t in tokens) > 256
        else:
            assert set(tokens) <= set(rows[i].topk(5).indices.tolist())
