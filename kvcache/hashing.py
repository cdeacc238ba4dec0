"""Hash chain over full KV blocks (DESIGN.md §4).

``h_i = xxh3_128(h_{i-1} | len | token ids | extra keys)`` with an unambiguous byte encoding:
the parent hash has a fixed width (16 bytes), the token count is written before the token ids
(little-endian uint32 each), and every extra key is written as ``tag byte | uint32 length | UTF-8``
so that a value of one kind can never be read as another kind. Partial blocks are never hashed.
"""

from __future__ import annotations

import secrets
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

BlockHash = bytes
"""A 16-byte xxh3_128 digest."""

_MAX_TOKEN_ID = 2**32 - 1
_BIG_ENDIAN = sys.byteorder == "big"
_U32 = struct.Struct("<I")

# One tag per kind of extra key. Never reuse or renumber a tag: hashes are shared across replicas.
_TAG_CACHE_SALT = 1
_TAG_MODEL_NAME = 2
_TAG_ADAPTER = 3


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """Everything besides token ids that decides whether two blocks hold the same KV."""

    cache_salt: str | None = None
    model_name: str | None = None
    adapter: str | None = None
    encoded: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts: list[bytes] = []
        for tag, value in (
            (_TAG_CACHE_SALT, self.cache_salt),
            (_TAG_MODEL_NAME, self.model_name),
            (_TAG_ADAPTER, self.adapter),
        ):
            if value is not None:
                raw = value.encode("utf-8")
                parts.append(bytes([tag]) + _U32.pack(len(raw)) + raw)
        object.__setattr__(self, "encoded", b"".join(parts))


NO_EXTRA_KEYS = ExtraKeys()


def root_hash(seed: int | str | bytes | None = None) -> BlockHash:
    """The chain's ``h_{-1}``. ``None`` draws a random seed, so clients cannot predict hashes."""
    if seed is None:
        seed_bytes = secrets.token_bytes(16)
    elif isinstance(seed, bytes):
        seed_bytes = b"b" + seed
    elif isinstance(seed, int):
        seed_bytes = b"i" + str(seed).encode()
    else:
        seed_bytes = b"s" + seed.encode("utf-8")
    return xxhash.xxh3_128_digest(b"spyre-server/root/" + seed_bytes)


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """Little-endian uint32 encoding of token ids; raises ValueError for ids outside it."""
    try:
        encoded = array("I", token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must be in [0, {_MAX_TOKEN_ID}]: {exc}") from None
    if encoded.itemsize != 4:  # pragma: no cover - platforms where unsigned int is not 32 bits
        raise RuntimeError("array('I') is not 32 bits wide on this platform")
    if _BIG_ENDIAN:  # pragma: no cover - hashes are shared across replicas: one byte order
        encoded.byteswap()
    return encoded.tobytes()


def decode_token_ids(token_bytes: bytes) -> tuple[int, ...]:
    decoded = array("I", token_bytes)
    if _BIG_ENDIAN:  # pragma: no cover
        decoded.byteswap()
    return tuple(decoded)


def hash_block(parent: BlockHash, token_bytes: bytes, extra: ExtraKeys) -> BlockHash:
    num_tokens = len(token_bytes) // 4
    return xxhash.xxh3_128_digest(parent + _U32.pack(num_tokens) + token_bytes + extra.encoded)


class BlockHashChain:
    """The block hashes of one growing token sequence, computed incrementally.

    ``update(token_ids)`` takes the whole sequence so far and hashes only the blocks completed
    since the last call. ``hashes[i]`` and ``token_bytes[i]`` describe full block ``i``.
    """

    __slots__ = ("_root", "block_size", "extra", "hashes", "token_bytes")

    def __init__(self, block_size: int, root: BlockHash, extra: ExtraKeys = NO_EXTRA_KEYS) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._root = root
        self.extra = extra
        self.hashes: list[BlockHash] = []
        self.token_bytes: list[bytes] = []

    @property
    def num_blocks(self) -> int:
        return len(self.hashes)

    def update(self, token_ids: Sequence[int]) -> None:
        bs = self.block_size
        start = len(self.hashes)
        end = len(token_ids) // bs
        if end <= start:
            return
        encoded = encode_token_ids(token_ids[start * bs : end * bs])
        num_bytes = 4 * bs
        parent = self.hashes[-1] if self.hashes else self._root
        extra = self.extra
        hashes = self.hashes
        blocks = self.token_bytes
        for offset in range(0, len(encoded), num_bytes):
            chunk = encoded[offset : offset + num_bytes]
            parent = hash_block(parent, chunk, extra)
            hashes.append(parent)
            blocks.append(chunk)

    def parent_of(self, index: int) -> BlockHash:
        """The hash block ``index`` was chained onto (the root for block 0)."""
        return self.hashes[index - 1] if index > 0 else self._root
