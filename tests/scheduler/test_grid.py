"""ChunkGrid and the usable-hit rule (DESIGN §3, §4) against hand-computed cases, a brute-force
cross-check, and SchedulerConfig validation.

Notation in the comments: L prompt tokens, B = 64, C chunk size, k = C/B blocks per chunk,
padded = ceil(L/B)*B, chunks n = ceil(L/C), left_pad = n*C - padded (p = left_pad/B blocks),
usable(h) = max(0, min((p + h) // k, n - 1) * k - p).
"""

from __future__ import annotations

import pytest

from scheduler import ChunkGrid, SchedulerConfig

B = 64
CHUNK_SIZES = (64, 128, 192, 256, 512)


def grid(num_tokens: int, chunk_size: int) -> ChunkGrid:
    return ChunkGrid(num_tokens, B, chunk_size)


# ----------------------------------------------------------------------------- the chunk grid
@pytest.mark.parametrize(
    ("L", "C", "padded", "chunks", "left_pad", "spans"),
    [
        # 1 token: padded 64, 1 chunk, 1*64 - 64 = 0 padding
        (1, 64, 64, 1, 0, [(0, 1)]),
        # a whole block, C = B: no padding
        (64, 64, 64, 1, 0, [(0, 64)]),
        # 65 tokens, C = 64: padded 128, 2 chunks, 2*64 - 128 = 0
        (65, 64, 128, 2, 0, [(0, 64), (64, 65)]),
        # 70 tokens, C = 128: padded 128, 1 chunk, 128 - 128 = 0
        (70, 128, 128, 1, 0, [(0, 70)]),
        # scenario 1: 192 tokens, C = 128: padded 192, 2 chunks, 256 - 192 = 64 (1 block);
        # chunk 0 = [0*128 - 64, 128 - 64) = [-64, 64) clipped to [0, 64)
        (192, 128, 192, 2, 64, [(0, 64), (64, 192)]),
        # 384 tokens, C = 128: padded 384, 3 chunks, 384 - 384 = 0
        (384, 128, 384, 3, 0, [(0, 128), (128, 256), (256, 384)]),
        # scenario 10 (first prompt): 64 tokens, C = 192: 1 chunk, 192 - 64 = 128 (2 blocks)
        (64, 192, 64, 1, 128, [(0, 64)]),
        # scenario 10 (second prompt): 320 tokens, C = 192: 2 chunks, 384 - 320 = 64;
        # chunk 0 = [-64, 128) -> [0, 128), chunk 1 = [128, 320)
        (320, 192, 320, 2, 64, [(0, 128), (128, 320)]),
        # 256 tokens, C = 192: 2 chunks, 384 - 256 = 128 (2 blocks): chunk 0 = [-128, 64)
        (256, 192, 256, 2, 128, [(0, 64), (64, 256)]),
        # 100 tokens, C = 256: padded 128, 1 chunk, 256 - 128 = 128
        (100, 256, 128, 1, 128, [(0, 100)]),
        # 300 tokens, C = 256: padded 320, 2 chunks, 512 - 320 = 192 (3 blocks): chunk 0 = [-192, 64)
        (300, 256, 320, 2, 192, [(0, 64), (64, 300)]),
        # 513 tokens, C = 512: padded 576, 2 chunks, 1024 - 576 = 448 (7 blocks)
        (513, 512, 576, 2, 448, [(0, 64), (64, 513)]),
        # 1024 tokens, C = 512: padded 1024, 2 chunks, no padding
        (1024, 512, 1024, 2, 0, [(0, 512), (512, 1024)]),
        # 1100 tokens, C = 512: padded 1152, 3 chunks, 1536 - 1152 = 384 (6 blocks):
        # chunk 0 = [-384, 128), chunk 1 = [128, 640), chunk 2 = [640, 1100)
        (1100, 512, 1152, 3, 384, [(0, 128), (128, 640), (640, 1100)]),
    ],
)
def test_chunk_grid_hand_computed(
    L: int, C: int, padded: int, chunks: int, left_pad: int, spans: list[tuple[int, int]]
) -> None:
    g = grid(L, C)
    assert g.num_padded_tokens == padded
    assert g.num_chunks == chunks
    assert g.num_left_pad_tokens == left_pad
    assert [g.chunk_span(i) for i in range(chunks)] == spans
    for i, (start, end) in enumerate(spans):
        assert g.chunk_of(start) == i
        assert g.chunk_of(end - 1) == i


def test_chunk_of_hand_computed() -> None:
    # L = 192, C = 128, left_pad 64: chunk_of(t) = (t + 64) // 128
    g = grid(192, 128)
    assert [g.chunk_of(t) for t in (0, 63, 64, 191)] == [0, 0, 1, 1]
    # L = 1100, C = 512, left_pad 384: (127 + 384) // 512 = 0, (128 + 384) // 512 = 1,
    # (639 + 384) // 512 = 1, (640 + 384) // 512 = 2
    g = grid(1100, 512)
    assert [g.chunk_of(t) for t in (0, 127, 128, 639, 640, 1099)] == [0, 0, 1, 1, 2, 2]


def test_chunk_grid_brute_force() -> None:
    """Spans tile [0, L) in order, every non-last chunk ends on a block boundary, the padding is
    whole blocks and less than one chunk, and chunk_of agrees with the spans."""
    for C in CHUNK_SIZES:
        for L in range(1, 1101):
            g = grid(L, C)
            pad = g.num_left_pad_tokens
            assert pad % B == 0 and 0 <= pad < C
            assert g.num_padded_tokens + pad == g.num_chunks * C
            position = 0
            for i in range(g.num_chunks):
                start, end = g.chunk_span(i)
                assert start == position < end
                assert g.chunk_of(start) == i == g.chunk_of(end - 1)
                if i < g.num_chunks - 1:
                    assert end % B == 0
                position = end
            assert position == L


# ------------------------------------------------------------------------- usable hit blocks
@pytest.mark.parametrize(
    ("L", "C", "hits", "expected"),
    [
        # C = 64 (k = 1, p = 0): usable = min(h, n - 1)
        # L = 64: n = 1, the only (last) chunk is always computed: the full block hits, never usable
        (64, 64, [0, 1], [0, 0]),
        # L = 128 (a multiple of 64): n = 2 -> min(h, 1): the last full block is not usable
        (128, 64, [0, 1, 2], [0, 1, 1]),
        # L = 100: n = 2 (1 full block) -> min(h, 1)
        (100, 64, [0, 1], [0, 1]),
        # L = 160: n = 3 -> min(h, 2) (scenario 3)
        (160, 64, [0, 1, 2], [0, 1, 2]),
        # C = 128 (k = 2)
        # L = 70: n = 1 -> always 0 (scenario 2)
        (70, 128, [0, 1], [0, 0]),
        # L = 192: p = 1, n = 2: h=0 -> 0*2-1 < 0 -> 0; h=1 -> (1+1)//2 = 1 -> 2-1 = 1;
        # h=2 -> 3//2 = 1 -> 1; h=3 -> 4//2 = 2, capped at n-1 = 1 -> 1 (scenario 1)
        (192, 128, [0, 1, 2, 3], [0, 1, 1, 1]),
        # L = 384: p = 0, n = 3: (h//2 capped at 2) * 2 -> h=3: 2 (scenario 8),
        # h=4: 4 (scenario 9), h=6: 6//2 = 3 capped at 2 -> 4 (scenario 7)
        (384, 128, [0, 1, 2, 3, 4, 5, 6], [0, 0, 2, 2, 4, 4, 4]),
        # L = 640: p = 0, n = 5: h=10 -> 5 capped at 4 -> 8; h=9 -> 4 -> 8; h=7 -> 3 -> 6
        (640, 128, [7, 9, 10], [6, 8, 8]),
        # C = 192 (k = 3)
        # L = 320: p = 1, n = 2: h=1 -> 2//3 = 0 -> 0 (scenario 10); h=2 -> 3//3 = 1 -> 3-1 = 2;
        # h=4 -> 5//3 = 1 -> 2; h=5 -> 6//3 = 2 capped at 1 -> 2
        (320, 192, [0, 1, 2, 4, 5], [0, 0, 2, 2, 2]),
        # L = 256 (a multiple of 64): p = 2, n = 2: h=0 -> 2//3 = 0 -> 0; h=1 -> 3//3 = 1 -> 3-2 = 1;
        # h=4 -> 6//3 = 2 capped at 1 -> 1
        (256, 192, [0, 1, 4], [0, 1, 1]),
        # L = 64: p = 2, n = 1 -> always 0
        (64, 192, [0, 1], [0, 0]),
        # C = 256 (k = 4)
        # L = 300: p = 3, n = 2: h=0 -> 3//4 = 0 -> 0; h=1 -> 4//4 = 1 -> 4-3 = 1; h=4 -> 7//4 = 1 -> 1
        (300, 256, [0, 1, 4], [0, 1, 1]),
        # L = 512 (a multiple of 64): p = 0, n = 2: h=8 -> 2 capped at 1 -> 4; h=3 -> 0; h=4 -> 4
        (512, 256, [3, 4, 8], [0, 4, 4]),
        # L = 1000: padded 1024, n = 4, p = 0: h=15 -> 15//4 = 3 -> 12; h=11 -> 2 -> 8
        (1000, 256, [11, 15], [8, 12]),
        # C = 512 (k = 8)
        # L = 513: p = 7, n = 2: h=0 -> 7//8 = 0 -> 0; h=1 -> 8//8 = 1 -> 8-7 = 1; h=8 -> 15//8 = 1 -> 1
        (513, 512, [0, 1, 8], [0, 1, 1]),
        # L = 1024: p = 0, n = 2: h=7 -> 0; h=8 -> 8; h=16 -> 2 capped at 1 -> 8
        (1024, 512, [7, 8, 16], [0, 8, 8]),
        # L = 1100: p = 6, n = 3: h=1 -> 7//8 = 0 -> 0; h=2 -> 8//8 = 1 -> 8-6 = 2;
        # h=9 -> 15//8 = 1 -> 2; h=10 -> 16//8 = 2 -> 16-6 = 10; h=17 -> 23//8 = 2 -> 10
        (1100, 512, [1, 2, 9, 10, 17], [0, 2, 2, 10, 10]),
    ],
)
def test_usable_hit_blocks_hand_computed(
    L: int, C: int, hits: list[int], expected: list[int]
) -> None:
    g = grid(L, C)
    assert [g.usable_hit_blocks(h) for h in hits] == expected


def usable_from_spans(L: int, C: int, num_hit: int) -> int:
    """Independent: the leading chunks (never the last) whose real tokens all lie in hit blocks."""
    num_chunks = -(-L // C)
    left_pad = num_chunks * C - -(-L // B) * B
    usable_tokens = 0
    for i in range(num_chunks - 1):
        end = (i + 1) * C - left_pad  # a non-last chunk ends inside the prompt
        if end > num_hit * B:
            break
        usable_tokens = end
    assert usable_tokens % B == 0
    return usable_tokens // B


def usable_capped(L: int, C: int, num_hit: int) -> int:
    """DESIGN §4's equivalent: cap n_hit at floor((L-1)/B), then round down to whole chunks."""
    k = C // B
    pad_blocks = (-(-L // C) * C - -(-L // B) * B) // B
    capped = min(num_hit, (L - 1) // B)
    return max(0, (pad_blocks + capped) // k * k - pad_blocks)


def test_usable_hit_blocks_brute_force() -> None:
    for C in CHUNK_SIZES:
        for L in range(1, 1101):
            g = grid(L, C)
            for num_hit in range(L // B + 1):
                usable = g.usable_hit_blocks(num_hit)
                assert usable == usable_from_spans(L, C, num_hit), (L, C, num_hit)
                assert usable == usable_capped(L, C, num_hit), (L, C, num_hit)
                # whatever is skipped starts a chunk; the prompt's last token is never skipped
                assert usable * B < L
                assert g.chunk_span(g.chunk_of(usable * B))[0] == usable * B


# -------------------------------------------------------------------------- SchedulerConfig
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"chunk_size": 100}, "chunk_size"),  # not a multiple of 64
        ({"chunk_size": 96}, "chunk_size"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": -64}, "chunk_size"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": -64}, "block_size"),
        ({"block_size": True}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_seqs": -1}, "max_num_seqs"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"max_model_len": -2048}, "max_model_len"),
        ({"num_blocks": 1}, "num_blocks"),  # block 0 alone leaves nothing to hand out
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_blocks": -5}, "num_blocks"),
        ({"max_batch_tkv_limit": 0}, "max_batch_tkv_limit"),
        ({"max_batch_tkv_limit": -1}, "max_batch_tkv_limit"),
    ],
)
def test_config_rejects(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


def test_config_chunk_multiple_message_names_both_sizes() -> None:
    with pytest.raises(ValueError, match=r"chunk_size \(100\).*multiple.*block_size \(64\)"):
        SchedulerConfig(chunk_size=100)


def test_config_accepts_edge_values() -> None:
    cfg = SchedulerConfig(chunk_size=64, num_blocks=2, max_num_seqs=1, max_model_len=1)
    assert (cfg.chunk_size, cfg.num_blocks) == (64, 2)


def test_batch_tkv_limit_default() -> None:
    assert SchedulerConfig().batch_tkv_limit == 2048 * 8  # max_model_len * max_num_seqs
    # 1000 tokens need 16 blocks: a full batch of them pads to 16 * 64 = 1024 each
    assert SchedulerConfig(max_model_len=1000, max_num_seqs=3).batch_tkv_limit == 3 * 1024
    assert SchedulerConfig(max_batch_tkv_limit=500).batch_tkv_limit == 500
