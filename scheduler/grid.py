"""The Spyre chunk grid of a prompt and the usable part of a prefix-cache hit (DESIGN §3, §4).

A prompt of L tokens is padded on the left with whole blocks so that it ends on a chunk boundary:
``padded = ceil(L/B)*B``, ``num_chunks = ceil(L/C)``, ``left_pad = num_chunks*C - padded``.
Chunk i covers prompt tokens ``[i*C - left_pad, (i+1)*C - left_pad)`` clipped to ``[0, L)``.
"""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class ChunkGrid:
    num_tokens: int
    block_size: int
    chunk_size: int

    @property
    def num_padded_tokens(self) -> int:
        return cdiv(self.num_tokens, self.block_size) * self.block_size

    @property
    def num_chunks(self) -> int:
        return cdiv(self.num_tokens, self.chunk_size)

    @property
    def num_left_pad_tokens(self) -> int:
        return self.num_chunks * self.chunk_size - self.num_padded_tokens

    def chunk_of(self, token_index: int) -> int:
        """The chunk that computes prompt token ``token_index``."""
        return (token_index + self.num_left_pad_tokens) // self.chunk_size

    def chunk_span(self, chunk_index: int) -> tuple[int, int]:
        """The prompt tokens ``[start, end)`` of a chunk."""
        start = chunk_index * self.chunk_size - self.num_left_pad_tokens
        return max(0, start), min(self.num_tokens, start + self.chunk_size)

    def usable_hit_blocks(self, num_hit_blocks: int) -> int:
        """How many of the leading hit blocks can be skipped: whole chunks only (the left padding
        counts as present), never the last chunk."""
        blocks_per_chunk = self.chunk_size // self.block_size
        pad_blocks = self.num_left_pad_tokens // self.block_size
        whole_chunks = min((pad_blocks + num_hit_blocks) // blocks_per_chunk, self.num_chunks - 1)
        return max(0, whole_chunks * blocks_per_chunk - pad_blocks)
