"""The exact inputs of the Spyre programs for a scheduled step (DESIGN §3), as vllm-spyre's
chunked-prefill model runner builds them. Plain lists, so tests can check them exactly.

Prefill: one ``[1, chunk_size]`` window on the chunk grid. Left padding (whole blocks, chunk 0
only) and right padding (the rest of the prompt's last block) carry token 0 at position 0 and
write to block 0; real tokens keep position t. The block table is the grid's: the padding
blocks (block 0) followed by the request's blocks, up to the end of the window. The window
attends over ``left_padding .. tkv`` of that table, causally aligned to the end.

Decode: ``[batch, 1]``. Each row's block table is left-padded with block 0 to the longest table
of the batch, and the row attends over ``left_padding .. left_padding + position + 1``.

In both, the key at ``left_padding + j`` of a row's table is the key at position j, so a sliding
window needs no other input: the programs' attention masks the keys outside each query's window
(runner.py), and the block table still names every block of the context.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler import DecodeBatch, PrefillChunk
from spyre_server.model.runner import ProgramShape


@dataclass(frozen=True, slots=True)
class SpyreInputs:
    kind: str
    """``prefill`` or ``decode``."""
    input_ids: list[list[int]]
    position_ids: list[list[int]]
    slot_mapping: list[list[int]]
    block_table: list[list[int]]
    current_tkv: list[int]
    """Per row, the end of its context on the padded grid (exclusive)."""
    left_padding: list[int]
    """Per row, the padding tokens at the start of its block table (whole blocks)."""
    logits_index: int | None
    """Prefill: the last real token's index within the window's last block, whose logits are
    kept (``last_n_tokens`` = block size); ``None`` when the chunk samples nothing. Decode: 0."""

    @property
    def program(self) -> ProgramShape:
        return ProgramShape(self.kind, f"{len(self.input_ids)}x{len(self.input_ids[0])}")


def prefill_inputs(step: PrefillChunk, chunk_size: int, block_size: int) -> SpyreInputs:
    bs = block_size
    window_start = step.chunk_index * chunk_size - step.num_left_pad_tokens
    first = step.window_offset
    num_real = len(step.token_ids)
    input_ids = [0] * chunk_size
    positions = [0] * chunk_size
    slots = [w % bs for w in range(chunk_size)]  # padding writes to block 0
    input_ids[first : first + num_real] = step.token_ids
    positions[first : first + num_real] = step.positions
    slots[first : first + num_real] = step.slot_mapping
    num_table_blocks = (step.chunk_index + 1) * chunk_size // bs
    table = ([0] * (step.num_left_pad_tokens // bs) + list(step.block_table))[:num_table_blocks]
    if len(table) != num_table_blocks:
        raise ValueError(f"the block table does not cover chunk {step.chunk_index}")
    logits_index = None
    if step.is_last_chunk:
        last = first + num_real - 1  # the last real token's window index
        logits_index = last - (chunk_size - bs)
        assert 0 <= logits_index < bs, "the prompt ends in the window's last block"
    assert window_start + first == step.positions[0]
    return SpyreInputs(
        kind="prefill",
        input_ids=[input_ids],
        position_ids=[positions],
        slot_mapping=[slots],
        block_table=[table],
        current_tkv=[step.tkv],
        left_padding=[step.num_left_pad_tokens],
        logits_index=logits_index,
    )


def decode_inputs(step: DecodeBatch, block_size: int) -> SpyreInputs:
    width = max(len(e.block_table) for e in step.entries)
    tables, left_padding, tkv = [], [], []
    for e in step.entries:
        pad_blocks = width - len(e.block_table)
        tables.append([0] * pad_blocks + list(e.block_table))
        left_padding.append(pad_blocks * block_size)
        tkv.append(pad_blocks * block_size + e.position + 1)
    return SpyreInputs(
        kind="decode",
        input_ids=[[e.token_id] for e in step.entries],
        position_ids=[[e.position] for e in step.entries],
        slot_mapping=[[e.slot] for e in step.entries],
        block_table=tables,
        current_tkv=tkv,
        left_padding=left_padding,
        logits_index=0,
    )
