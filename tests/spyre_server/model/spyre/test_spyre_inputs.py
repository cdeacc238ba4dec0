"""The exact inputs of the Spyre programs (spyre_server/model/spyre/inputs.py), built from real
scheduler steps: windows with left and right padding, block-0 slots of recomputed cached blocks,
grid block tables, left-padded decode tables."""

from __future__ import annotations

import pytest

from scheduler import (
    ChunkGrid,
    DecodeBatch,
    DecodeEntry,
    ModelRunnerOutput,
    PrefillChunk,
    Scheduler,
    SchedulerConfig,
)
from spyre_server.model.runner import ProgramShape
from spyre_server.model.spyre.inputs import decode_inputs, prefill_inputs

BS = 64


def block0(offsets: range) -> list[int]:
    """Slots in block 0, the write sink."""
    return [o % BS for o in offsets]


def slots(block_id: int, num: int = BS, start: int = 0) -> list[int]:
    return list(range(block_id * BS + start, block_id * BS + start + num))


def prefill_steps(scheduler: Scheduler, request_id: str) -> list[PrefillChunk]:
    """Run ``request_id``'s prefill to its end (sampling token 7), returning its chunks."""
    chunks = []
    while True:
        step = scheduler.schedule()
        assert isinstance(step, PrefillChunk) and step.request_id == request_id
        chunks.append(step)
        sampled = {request_id: 7} if step.is_last_chunk else {}
        scheduler.update_from_output(step, ModelRunnerOutput(sampled))
        if step.is_last_chunk:
            return chunks


def test_prompt_with_left_padding_fills_the_grid_windows() -> None:
    # 192 tokens, chunk 128: padded 192, 2 chunks, one block of left padding.
    sched = Scheduler(SchedulerConfig(chunk_size=128, num_blocks=16))
    prompt = list(range(1, 193))
    sched.add_request("r", prompt, 4)
    first, last = prefill_steps(sched, "r")
    b0, b1, b2 = first.block_table

    a = prefill_inputs(first, 128, BS)
    assert a.input_ids == [[0] * 64 + prompt[:64]]
    assert a.position_ids == [[0] * 64 + list(range(64))]
    assert a.slot_mapping == [block0(range(64)) + slots(b0)]
    assert a.block_table == [[0, b0]]
    assert (a.current_tkv, a.left_padding, a.logits_index) == ([128], [64], None)
    assert a.program == ProgramShape("prefill", "1x128")

    b = prefill_inputs(last, 128, BS)
    assert b.input_ids == [prompt[64:]]
    assert b.position_ids == [list(range(64, 192))]
    assert b.slot_mapping == [slots(b1) + slots(b2)]
    assert b.block_table == [[0, b0, b1, b2]]
    assert (b.current_tkv, b.left_padding, b.logits_index) == ([256], [64], 63)


def test_right_padding_writes_to_block_zero_and_logits_come_from_the_last_real_token() -> None:
    # 70 tokens, chunk 128: one chunk, no left padding, 58 positions of right padding.
    sched = Scheduler(SchedulerConfig(chunk_size=128, num_blocks=16))
    prompt = list(range(100, 170))
    sched.add_request("r", prompt, 4)
    (only,) = prefill_steps(sched, "r")
    b0, b1 = only.block_table
    x = prefill_inputs(only, 128, BS)
    assert x.input_ids == [prompt + [0] * 58]
    assert x.position_ids == [list(range(70)) + [0] * 58]
    assert x.slot_mapping == [slots(b0) + slots(b1, 6) + block0(range(70, 128))]
    assert x.block_table == [[b0, b1]]
    assert (x.current_tkv, x.left_padding, x.logits_index) == ([128], [0], 5)


def test_recomputed_cached_blocks_write_to_block_zero_in_the_window() -> None:
    # DESIGN §7 scenario 8: two 384-token prompts sharing 254 tokens, chunk 128. The second
    # hits 3 blocks, 2 usable: chunk 1 is recomputed with its cached block written to block 0.
    sched = Scheduler(SchedulerConfig(chunk_size=128, num_blocks=32))
    a = list(range(1, 385))
    b = a[:254] + list(range(1000, 1130))
    sched.add_request("a", a, 1)
    prefill_steps(sched, "a")
    sched.add_request("b", b, 4)
    step = sched.schedule()
    assert isinstance(step, PrefillChunk) and step.request_id == "b" and step.chunk_index == 1
    table = step.block_table
    x = prefill_inputs(step, 128, BS)
    assert x.input_ids == [b[128:256]]
    assert x.slot_mapping == [block0(range(128, 192)) + slots(table[3])]
    assert x.block_table == [list(table[:4])]
    assert (x.current_tkv, x.left_padding, x.logits_index) == ([256], [0], None)


@pytest.mark.parametrize("chunk_size", [64, 128, 192, 256, 512])
def test_logits_index_matches_vllm_spyres_right_padding_rule(chunk_size: int) -> None:
    """vllm-spyre keeps logits[-n_pads_right - 1] of the last 64 with
    n_pads_right = B - ((request_tkv - 1) % B + 1), request_tkv = left_pad + prompt_len."""
    for num_tokens in range(1, 3 * chunk_size + 2):
        grid = ChunkGrid(num_tokens, BS, chunk_size)
        start, end = grid.chunk_span(grid.num_chunks - 1)
        window_start = (grid.num_chunks - 1) * chunk_size - grid.num_left_pad_tokens
        step = PrefillChunk(
            request_id="r",
            chunk_index=grid.num_chunks - 1,
            num_chunks=grid.num_chunks,
            num_left_pad_tokens=grid.num_left_pad_tokens,
            window_offset=start - window_start,
            token_ids=tuple([1] * (end - start)),
            positions=tuple(range(start, end)),
            slot_mapping=tuple(range(BS + start, BS + end)),
            block_table=tuple(range(1, -(-num_tokens // BS) + 1)),
            is_last_chunk=True,
            tkv=grid.num_chunks * chunk_size,
        )
        request_tkv = grid.num_left_pad_tokens + num_tokens
        n_pads_right = BS - ((request_tkv - 1) % BS + 1)
        assert prefill_inputs(step, chunk_size, BS).logits_index == BS - 1 - n_pads_right


def test_decode_tables_are_left_padded_to_the_longest_row() -> None:
    batch = DecodeBatch(
        (
            DecodeEntry("short", 11, 70, 5 * BS + 6, (4, 5)),
            DecodeEntry("long", 12, 200, 9 * BS + 8, (6, 7, 8, 9)),
            DecodeEntry("one", 13, 3, 3 * BS + 3, (3,)),
        ),
        tkv=201,
    )
    x = decode_inputs(batch, BS)
    assert x.input_ids == [[11], [12], [13]]
    assert x.position_ids == [[70], [200], [3]]
    assert x.slot_mapping == [[5 * BS + 6], [9 * BS + 8], [3 * BS + 3]]
    assert x.block_table == [[0, 0, 4, 5], [6, 7, 8, 9], [0, 0, 0, 3]]
    assert x.left_padding == [128, 0, 192]
    assert x.current_tkv == [128 + 71, 201, 192 + 4]
    assert x.program == ProgramShape("decode", "3x1")
