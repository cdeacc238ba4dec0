"""Hash chain properties (DESIGN.md §4): full blocks only, incremental == whole, typed extra keys."""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator, Sequence

import pytest
import xxhash

import kvcache.hashing
from kvcache.hashing import (
    NO_EXTRA_KEYS,
    BlockHashChain,
    ExtraKeys,
    decode_token_ids,
    encode_token_ids,
    hash_block,
    root_hash,
)

BS = 64
ROOT = root_hash(1234)


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 50_000) for _ in range(n)]


def chain_of(
    token_ids: list[int],
    extra: ExtraKeys = NO_EXTRA_KEYS,
    block_size: int = BS,
    root: bytes = ROOT,
) -> BlockHashChain:
    chain = BlockHashChain(block_size, root, extra)
    chain.update(token_ids)
    return chain


# ------------------------------------------------------------------------- full blocks only
@pytest.mark.parametrize(
    ("num_tokens", "num_hashes"),
    [(0, 0), (1, 0), (63, 0), (64, 1), (65, 1), (127, 1), (128, 2), (130, 2), (192, 3)],
)
def test_only_full_blocks_are_hashed(num_tokens: int, num_hashes: int) -> None:
    chain = chain_of(tokens(num_tokens))
    assert chain.num_blocks == num_hashes
    assert len(chain.hashes) == num_hashes
    assert len(chain.token_bytes) == num_hashes
    assert all(len(h) == 16 for h in chain.hashes)
    assert all(len(b) == 4 * BS for b in chain.token_bytes)


def test_partial_block_is_hashed_once_it_completes() -> None:
    seq = tokens(130)
    chain = BlockHashChain(BS, ROOT)
    chain.update(seq[:63])
    assert chain.hashes == []
    chain.update(seq[:64])
    assert chain.num_blocks == 1
    chain.update(seq[:127])
    assert chain.num_blocks == 1
    chain.update(seq)
    assert chain.num_blocks == 2
    assert chain.hashes == chain_of(seq).hashes


def test_token_bytes_hold_each_blocks_token_ids() -> None:
    seq = tokens(200)
    chain = chain_of(seq)
    for i in range(chain.num_blocks):
        assert decode_token_ids(chain.token_bytes[i]) == tuple(seq[i * BS : (i + 1) * BS])


def test_parent_of() -> None:
    chain = chain_of(tokens(3 * BS))
    assert chain.parent_of(0) == ROOT
    assert chain.parent_of(1) == chain.hashes[0]
    assert chain.parent_of(2) == chain.hashes[1]


@pytest.mark.parametrize("block_size", [0, -1])
def test_block_size_must_be_positive(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size must be positive"):
        BlockHashChain(block_size, ROOT)


# ------------------------------------------------------------------------------ incremental
def test_incremental_update_equals_hashing_the_whole_sequence() -> None:
    seq = tokens(10 * BS + 17, seed=1)
    whole = chain_of(seq)
    rng = random.Random(2)
    incremental = BlockHashChain(BS, ROOT)
    end = 0
    while end < len(seq):
        end = min(len(seq), end + rng.randrange(1, 3 * BS))
        incremental.update(seq[:end])
    assert incremental.hashes == whole.hashes
    assert incremental.token_bytes == whole.token_bytes


def test_token_by_token_update_equals_hashing_the_whole_sequence() -> None:
    seq = tokens(5 * BS + 3, seed=3)
    extra = ExtraKeys(cache_salt="s", model_name="m")
    whole = chain_of(seq, extra)
    incremental = BlockHashChain(BS, ROOT, extra)
    for end in range(len(seq) + 1):
        incremental.update(seq[:end])
        assert incremental.num_blocks == end // BS
        assert incremental.hashes == whole.hashes[: end // BS]
    assert incremental.hashes == whole.hashes
    assert incremental.token_bytes == whole.token_bytes


def test_update_with_a_shorter_or_equal_sequence_changes_nothing() -> None:
    seq = tokens(3 * BS)
    chain = chain_of(seq)
    before = list(chain.hashes)
    chain.update(seq)
    chain.update(seq[:BS])
    chain.update([])
    assert chain.hashes == before


def test_hashing_is_deterministic_for_the_same_root() -> None:
    seq = tokens(4 * BS)
    assert chain_of(seq).hashes == chain_of(list(seq)).hashes
    assert chain_of(seq, root=root_hash(1234)).hashes == chain_of(seq).hashes


# -------------------------------------------------------------------------- chain property
@pytest.mark.parametrize("block", [0, 1, 2, 3])
@pytest.mark.parametrize("offset", [0, 1, 31, 63])
def test_a_changed_token_in_block_i_changes_hashes_from_i_on_only(block: int, offset: int) -> None:
    seq = tokens(4 * BS + 10, seed=4)
    changed = list(seq)
    changed[block * BS + offset] += 1
    a, b = chain_of(seq), chain_of(changed)
    assert a.hashes[:block] == b.hashes[:block]
    for i in range(block, a.num_blocks):
        assert a.hashes[i] != b.hashes[i], f"block {i} hash did not change"


def test_a_change_in_the_partial_tail_changes_no_hash() -> None:
    seq = tokens(2 * BS + 10)
    changed = list(seq)
    changed[-1] += 1
    assert chain_of(seq).hashes == chain_of(changed).hashes


def test_same_tokens_at_another_position_hash_differently() -> None:
    block = tokens(BS, seed=5)
    chain = chain_of(block * 3)
    assert len(set(chain.hashes)) == 3


def test_different_roots_change_every_hash() -> None:
    seq = tokens(4 * BS)
    a = chain_of(seq, root=root_hash(1))
    b = chain_of(seq, root=root_hash(2))
    assert all(x != y for x, y in zip(a.hashes, b.hashes, strict=True))


# ------------------------------------------------------------------------------ extra keys
EXTRAS = [
    NO_EXTRA_KEYS,
    ExtraKeys(cache_salt="salt-1"),
    ExtraKeys(cache_salt="salt-2"),
    ExtraKeys(model_name="model-a"),
    ExtraKeys(model_name="model-b"),
    ExtraKeys(adapter="lora-1"),
    ExtraKeys(adapter="lora-2"),
    ExtraKeys(cache_salt="salt-1", model_name="model-a"),
    ExtraKeys(cache_salt="salt-1", model_name="model-a", adapter="lora-1"),
]


def test_every_kind_of_extra_key_changes_every_hash() -> None:
    seq = tokens(4 * BS + 5)
    chains = [chain_of(seq, extra) for extra in EXTRAS]
    for i in range(4):
        column = [chain.hashes[i] for chain in chains]
        assert len(set(column)) == len(EXTRAS), f"block {i}: two extra keys share a hash"
    # and no hash of one chain shows up anywhere in another
    all_hashes = [h for chain in chains for h in chain.hashes]
    assert len(set(all_hashes)) == len(all_hashes)


def test_equal_extra_keys_give_equal_hashes() -> None:
    seq = tokens(2 * BS)
    a = chain_of(seq, ExtraKeys(cache_salt="x", model_name="m", adapter="a"))
    b = chain_of(seq, ExtraKeys(cache_salt="x", model_name="m", adapter="a"))
    assert a.hashes == b.hashes


def test_extra_keys_are_tagged_by_kind() -> None:
    seq = tokens(2 * BS)
    kinds = [ExtraKeys(cache_salt="x"), ExtraKeys(model_name="x"), ExtraKeys(adapter="x")]
    assert len({k.encoded for k in kinds}) == 3
    hashes = [chain_of(seq, k).hashes for k in kinds]
    for i in range(2):
        assert len({h[i] for h in hashes}) == 3


# Pairs that an encoding without tags or lengths would confuse.
AMBIGUOUS = [
    ExtraKeys(cache_salt="ab"),
    ExtraKeys(cache_salt="a", model_name="b"),
    ExtraKeys(cache_salt="a", adapter="b"),
    ExtraKeys(model_name="ab"),
    ExtraKeys(model_name="a", adapter="b"),
    ExtraKeys(cache_salt="a", model_name=""),
    ExtraKeys(cache_salt="a"),
    ExtraKeys(cache_salt=""),
    ExtraKeys(model_name=""),
    ExtraKeys(adapter=""),
    NO_EXTRA_KEYS,
    # a salt that contains the encoding of "salt 'a' + model 'b'"
    ExtraKeys(cache_salt="a\x02\x01\x00\x00\x00b"),
    ExtraKeys(cache_salt="a\x02\x01\x00\x00\x00b", model_name=""),
    ExtraKeys(cache_salt="\x01"),
    ExtraKeys(cache_salt="é"),
    ExtraKeys(cache_salt="Ã©"),  # the UTF-8 bytes of "é" read as Latin-1
]


def test_extra_key_encoding_is_unambiguous() -> None:
    assert len({e.encoded for e in AMBIGUOUS}) == len(AMBIGUOUS)
    seq = tokens(BS)
    hashes = [chain_of(seq, e).hashes[0] for e in AMBIGUOUS]
    assert len(set(hashes)) == len(AMBIGUOUS)


def test_token_count_prefix_separates_tokens_from_extra_keys() -> None:
    # Without the token count, tokens [1] + model "abc" and tokens [1, 770, 0x63626100] with no
    # extra keys would be the same bytes: 01000000 | 02 03000000 | 616263.
    t1, e1 = [1], ExtraKeys(model_name="abc")
    t2, e2 = [1, 770, 0x63626100], NO_EXTRA_KEYS
    assert encode_token_ids(t1) + e1.encoded == encode_token_ids(t2) + e2.encoded
    assert hash_block(ROOT, encode_token_ids(t1), e1) != hash_block(ROOT, encode_token_ids(t2), e2)


def test_extra_keys_compare_by_value() -> None:
    assert ExtraKeys(cache_salt="x") == ExtraKeys(cache_salt="x")
    assert ExtraKeys(cache_salt="x") != ExtraKeys(model_name="x")
    assert hash(ExtraKeys(cache_salt="x")) == hash(ExtraKeys(cache_salt="x"))


# --------------------------------------------------------------------------- byte encoding
def reference_hash(parent: bytes, token_ids: list[int], extra: ExtraKeys) -> bytes:
    """Independent implementation of the documented encoding (explicitly little-endian)."""
    data = parent + struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids)
    for tag, value in ((1, extra.cache_salt), (2, extra.model_name), (3, extra.adapter)):
        if value is not None:
            raw = value.encode("utf-8")
            data += bytes([tag]) + struct.pack("<I", len(raw)) + raw
    return xxhash.xxh3_128_digest(data)


def test_token_encoding_is_little_endian_uint32() -> None:
    # Hashes are shared across replicas, so the encoding must not depend on the host's byte order.
    assert encode_token_ids([1, 2**32 - 1, 0x01020304]) == (
        b"\x01\x00\x00\x00" + b"\xff\xff\xff\xff" + b"\x04\x03\x02\x01"
    )
    assert decode_token_ids(b"\x04\x03\x02\x01") == (0x01020304,)


def test_chain_matches_an_independent_implementation_of_the_encoding() -> None:
    seq = tokens(3 * BS + 7, seed=6)
    extra = ExtraKeys(cache_salt="salt", model_name="SmolLM2", adapter="é")
    chain = chain_of(seq, extra)
    parent = ROOT
    for i in range(3):
        expected = reference_hash(parent, seq[i * BS : (i + 1) * BS], extra)
        assert chain.hashes[i] == expected
        parent = expected


class BigEndianArray:
    """``array('I')`` as it behaves on a big-endian host: native byte order is big-endian."""

    itemsize = 4

    def __init__(self, typecode: str, data: bytes | Sequence[int]) -> None:
        assert typecode == "I"
        if isinstance(data, bytes):
            self.values = [int.from_bytes(data[i : i + 4], "big") for i in range(0, len(data), 4)]
        else:
            self.values = list(data)
            if any(not 0 <= v <= 2**32 - 1 for v in self.values):
                raise OverflowError("unsigned int is greater than maximum")

    def byteswap(self) -> None:
        self.values = [int.from_bytes(v.to_bytes(4, "big"), "little") for v in self.values]

    def tobytes(self) -> bytes:
        return b"".join(v.to_bytes(4, "big") for v in self.values)

    def __iter__(self) -> Iterator[int]:
        return iter(self.values)


def test_a_big_endian_host_encodes_little_endian_too(monkeypatch: pytest.MonkeyPatch) -> None:
    seq = tokens(2 * BS + 3, seed=9)
    expected = chain_of(seq, ExtraKeys(cache_salt="s")).hashes
    monkeypatch.setattr(kvcache.hashing, "array", BigEndianArray)
    # the simulated host without the swap would write big-endian bytes ...
    monkeypatch.setattr(kvcache.hashing, "_BIG_ENDIAN", False)
    assert encode_token_ids([0x01020304]) == b"\x01\x02\x03\x04"
    # ... with it, the bytes (and so the hashes shared across replicas) are the same everywhere
    monkeypatch.setattr(kvcache.hashing, "_BIG_ENDIAN", True)
    assert encode_token_ids([1, 2**32 - 1, 0x01020304]) == (
        b"\x01\x00\x00\x00" + b"\xff\xff\xff\xff" + b"\x04\x03\x02\x01"
    )
    assert decode_token_ids(b"\x04\x03\x02\x01") == (0x01020304,)
    assert decode_token_ids(encode_token_ids(seq)) == tuple(seq)
    assert chain_of(seq, ExtraKeys(cache_salt="s")).hashes == expected
    with pytest.raises(ValueError):
        encode_token_ids([2**32])


def test_root_hash_matches_its_documented_derivation() -> None:
    assert root_hash(42) == xxhash.xxh3_128_digest(b"spyre-server/root/i42")
    assert root_hash("42") == xxhash.xxh3_128_digest(b"spyre-server/root/s42")
    assert root_hash(b"42") == xxhash.xxh3_128_digest(b"spyre-server/root/b42")


# ------------------------------------------------------------------------------- root hash
def test_root_hash_is_deterministic_for_a_seed() -> None:
    for seed in (0, 1, 2**70, -5, "seed", b"seed", ""):
        assert root_hash(seed) == root_hash(seed)
        assert len(root_hash(seed)) == 16


def test_root_hash_differs_across_seeds() -> None:
    roots = [root_hash(s) for s in (0, 1, 2, -1, "a", "b", b"a", b"b", "", b"")]
    assert len(set(roots)) == len(roots)


def test_root_hash_seed_types_are_distinguished() -> None:
    assert root_hash(1) != root_hash("1")
    assert root_hash(1) != root_hash(b"1")
    assert root_hash("1") != root_hash(b"1")


def test_root_hash_without_seed_is_random() -> None:
    roots = {root_hash(None) for _ in range(20)}
    assert len(roots) == 20
    assert root_hash() != root_hash()
    assert all(len(r) == 16 for r in roots)


# ---------------------------------------------------------------------------- token range
@pytest.mark.parametrize("bad", [-1, -(2**40), 2**32, 2**32 + 5, 2**64, 2**100])
@pytest.mark.parametrize("block", [0, 1])
def test_token_ids_outside_uint32_raise_value_error(bad: int, block: int) -> None:
    seq = tokens(2 * BS)
    seq[block * BS + 7] = bad
    chain = BlockHashChain(BS, ROOT)
    with pytest.raises(ValueError, match="token ids must be in"):
        chain.update(seq)
    assert chain.hashes == []  # nothing half-appended
    assert chain.token_bytes == []


def test_a_bad_token_id_raises_in_an_incremental_update_and_keeps_earlier_blocks() -> None:
    seq = tokens(2 * BS)
    chain = BlockHashChain(BS, ROOT)
    chain.update(seq[:BS])
    first = list(chain.hashes)
    seq[BS + 3] = 2**32
    with pytest.raises(ValueError):
        chain.update(seq)
    assert chain.hashes == first


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_encode_token_ids_rejects_out_of_range(bad: int) -> None:
    with pytest.raises(ValueError):
        encode_token_ids([0, bad])


def test_token_ids_at_the_range_limits_are_accepted() -> None:
    seq = [0] * (BS - 1) + [2**32 - 1]
    chain = chain_of(seq)
    assert chain.num_blocks == 1
    assert decode_token_ids(chain.token_bytes[0])[-1] == 2**32 - 1
