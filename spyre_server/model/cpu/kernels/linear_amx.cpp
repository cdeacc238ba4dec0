// bfloat16 linear layer y = x @ w^T (+ bias) on the AMX tile unit (TDPBF16PS).
//
// The weight is packed once (spyre_linear_bf16_amx_pack) in linear_bf16_layout.h's blocks of 64
// columns, each 256 bytes a pair of K, with the bytes of every 16 pairs (4 KB) reordered into
// four weight (B) tiles of 1 KB, one per group of 16 columns: row q of group g's tile is pair q's
// (w[n][2p], w[n][2p + 1]) for the group's 16 columns, 64 contiguous bytes. So a tile loads from
// contiguous memory and a block is still one sequential stream. 16 rows' next 32 values of x
// are one A tile (x read in place).
//
// The arithmetic: every output is
//     acc = +0 (float32)
//     for s = 0 .. K / 32 - 1:  acc = TDPBF16PS(acc, x[m][32s .. 32s + 31], w[n][32s .. 32s + 31])
//     y[m][n] = bf16(acc + bias[n])   (without a bias: bf16(acc)), rounded as torch rounds
// TDPBF16PS adds the 32 products (each exact in float32) to acc in float32 with denormal inputs
// and outputs flushed to zero; Intel does not fix the order or the rounding of its internal sums,
// and they are not vdpbf16ps's (linear_bf16.cpp), so on one CPU a layer takes this kernel for
// every call or never (the caller's choice, by K). What holds, and the tests check: one
// instruction's result for a row depends on that row of x, the weights and acc alone, never on
// the other rows of the tile or the call, and a partial sum stored and reloaded as float32 is
// exact, so a row's result is the same bits whatever the call's row count, blocking and threads
// (DESIGN §4); and each result is within linear_bf16.cpp's bound of the exact sum with float32's
// rounding error taken as a whole unit (2^-23) a step instead of half.
//
// FP8 weights (float8_e4m3fn, a float32 scale per column: linear_bf16.cpp's FP8 form) are packed
// in the same order, one byte a value (the values of each two tile rows interleaved, as
// fp8_bf16.h's Fp8PairedRowsToScaledBf16 reads them), then a byte per 16 pairs of a block saying
// whether one of their values has exponent 0. Every float8_e4m3fn value times 2^-8 is exactly a
// bfloat16 value, so the kernel converts them to that (no rounding; the scaling makes the
// exponent's rebias an OR, and steps with exponent-0 values take a table) and sums as above, then
// multiplies the float32 sum by 2^8 (exact) and by the column's scale before the bias:
// y[m][n] = bf16(acc * 2^8 * scale[n] + bias[n]). The same bits as summing the unscaled values,
// except that a product or partial sum below 2^-118 in magnitude (float32's smallest normal
// times 2^8) is flushed to zero as the tiles flush one below 2^-126. A decode
// call converts each 16 pairs into a ring of 4 KB steps in L1 that the tiles load from, two
// steps ahead of them (a step reads one byte a weight); more rows convert a task's chunk of
// weights (below) once, for all its rows.
//
// K must be a multiple of 32 (whole tiles; other layers stay on linear_bf16.cpp). Work: a call of
// up to kDecodeRows rows computes each column block in one pass over its weights, streamed from
// memory with software prefetch. More rows: x is first copied into A-tile order (pack_rows),
// then tasks of (a panel of up to kPanelBlocks column blocks, up to kMaxRowChunk rows), one
// contiguous range of them per thread (Plan), each summing over chunks of K whose weights for
// the panel fill kPanelChunkBytes: the chunk stays in L2 while every 32 rows pass over it, and
// those rows' values of x for the chunk stay in L1 for the panel's blocks, 32 rows x 32 columns
// at a time (2 x 2 tiles). So the weights are read from memory once per call (up to
// kMaxRowChunk rows) and x from beyond L2 once per panel.
//
// Only entered on CPUs with AMX-BF16 and AVX512F/BW/VL/DQ, in a process that Linux granted the
// AMX tile state (library.amx_unsupported_reason); compiled for them whatever the build machine.
#include <stdint.h>

#include "dot_bf16_compiled.h"

#ifdef SPYRE_DOT_BF16
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512bf16,amx-tile,amx-bf16")
#include <immintrin.h>
#include <omp.h>

#include "fp8_bf16.h"
#include "linear_bf16_layout.h"

namespace {

using spyre_linear::blocks_of;
using spyre_linear::Fp8PairedRowsToScaledBf16;
using spyre_linear::kFp8ScaledBy;
using spyre_linear::kBlockCols;
using spyre_linear::kGroupCols;
using spyre_linear::kPairValues;

constexpr int64_t kTilePairs = 16;     // pairs of K per tile product (64 bytes of a row of x)
constexpr int64_t kTileRows = 16;      // rows of x per A tile
constexpr int64_t kDecodeRows = 16;    // up to this many rows: one row tile, one pass a block
constexpr int64_t kPanelBlocks = 4;    // above that, column blocks per task (a panel of 256 columns)
constexpr int64_t kPanelChunkBytes = 1 << 17;  // ... bytes of their bfloat16 weights per chunk of K
constexpr int64_t kMaxRowChunk = 512;  // ... and rows per task (their sums: 512 KB at most)
constexpr int64_t kAheadBytes = 8192;  // a decode call's prefetch distance in a block's stream
constexpr int64_t kFp8AheadBytes = 2048;  // ... FP8 weights' (one 16-pair step: measured best)
constexpr int64_t kFp8FarBytes = 32768;  // ... and FP8 weights' second, into the outer caches
constexpr int64_t kPairBytes = kPairValues * 2;
constexpr int64_t kTileRowBytes = 64;  // one pair of one group of 16 columns: a B tile's row
constexpr int64_t kTileBytes = kTilePairs * kTileRowBytes;  // one B tile, contiguous
constexpr int64_t kStepValues = kTilePairs * kPairValues;  // values of 16 pairs of a block: 4 tiles
constexpr int64_t kRingSteps = 4;     // FP8 decode: 16-pair steps converted, in a ring (16 KB)
constexpr int64_t kConvertAhead = 2;  // ... this many steps ahead of the tiles that read them
constexpr unsigned kFlushDenormals = 0x8040;  // MXCSR: flush to zero, denormals are zero
constexpr int kConvertedSlot = 0;  // spyre_linear::thread_scratch slots: FP8 weights converted,
constexpr int kSumsSlot = 1;       // a task's sums,
constexpr int kPackedRowsSlot = 2;  // x in A-tile order (the calling thread's, shared)

// Tiles: 0-3 sums (C), 4-5 rows of x (A), 6-7 weights (B).
using spyre_amx::TileConfig;

// The calling thread's tiles for row tiles of rows0 and rows1 rows (rows1 0: one row tile, its
// four column groups in sums 0-3; else two, sums 0-1 the first's two groups, 2-3 the second's).
// `current` holds the shape last configured by this thread in this call (skips a reload).
inline void configure(int rows0, int rows1, int& current) {
    const int shape = rows0 * 32 + rows1;
    if (shape == current) return;
    current = shape;
    alignas(64) TileConfig cfg = {};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64;
    for (int t = 0; t < 4; t++) cfg.rows[t] = static_cast<uint8_t>(rows1 == 0 || t < 2 ? rows0 : rows1);
    cfg.rows[4] = static_cast<uint8_t>(rows0);
    cfg.rows[5] = static_cast<uint8_t>(rows1 == 0 ? rows0 : rows1);
    cfg.rows[6] = cfg.rows[7] = kTilePairs;
    _tile_loadconfig(&cfg);
}

// What one call reads and writes.
struct Call {
    const uint16_t* x;       // [M][K]
    const uint16_t* packed;  // the packed bfloat16 weight, or nullptr for FP8 weights
    const uint8_t* fp8;      // the packed FP8 weight (then a byte per 16 pairs of a block), or nullptr
    const float* scale;      // FP8: the column scales (64 a block), else nullptr
    const uint16_t* bias;    // [N] or nullptr
    uint16_t* y;             // [M][N]
    int64_t M, K, N;
    uint16_t* xa = nullptr;  // above kDecodeRows rows: x in A-tile order (pack_rows)

    // The A tile of row tile t's step s (16 pairs) in xa: 16 rows of 64 bytes, contiguous; the
    // two row tiles of 32 rows interleaved a step at a time (one stream for the tile loop).
    uint16_t* a_tile(int64_t t, int64_t s) const {
        const int64_t tiles = (t / 2 * (K / 2 / kTilePairs) + s) * 2 + t % 2;
        return xa + tiles * kTileRows * 2 * kTilePairs;
    }

    // FP8: whether a value of the 16 pairs from p of block b has exponent 0.
    bool zero_exponent(int64_t b, int64_t p) const {
        const int64_t P = K / 2;
        return fp8[blocks_of(N) * P * kPairValues + (b * P + p) / kTilePairs] != 0;
    }
};

// FP8: the 16-pair steps [s0, s1) of block b (tile order kept) as bfloat16 times kFp8ScaledBy
// into dst (step s0 at dst), exact; the short conversion for steps without exponent-0 values.
inline void convert_steps(const Call& c, const Fp8PairedRowsToScaledBf16& convert, int64_t b,
                          int64_t s0, int64_t s1, uint16_t* dst) {
    const int64_t P = c.K / 2;
    for (int64_t s = s0; s < s1; s++) {
        const uint8_t* src = c.fp8 + (b * P + s * kTilePairs) * kPairValues;
        uint16_t* out = dst + (s - s0) * kStepValues;
        if (c.zero_exponent(b, s * kTilePairs)) {
            for (int64_t v = 0; v < kStepValues; v += 64) convert.any(src + v, out + v);
        } else {
            for (int64_t v = 0; v < kStepValues; v += 64) convert.normal(src + v, out + v);
        }
    }
}

// FP8: the byte of a packed step that holds the value at `at` in the step's tile order (each 64
// values, two tile rows, interleaved as Fp8PairedRowsToScaledBf16 reads them).
constexpr int64_t paired_rows_byte(int64_t at) {
    const int64_t i = at % 64;
    return at - i + (i < 32 ? 2 * i : 2 * (i - 32) + 1);
}

// Rows [r0, r0 + rows) of block b from the sums in `partial` (row stride kBlockCols).
inline void finish(const Call& c, int64_t b, int64_t r0, int64_t rows, const float* partial) {
    const int64_t c0 = b * kBlockCols;
    const int64_t cols = c.N - c0 < kBlockCols ? c.N - c0 : kBlockCols;
    const uint16_t* bias = c.bias == nullptr ? nullptr : c.bias + c0;
    const float* scale = c.scale == nullptr ? nullptr : c.scale + c0;
    // FP8: the sums of the scaled weights back to the weights' (exact: a power of two).
    const __m512 unscale = _mm512_set1_ps(scale == nullptr ? 1.0f : 1.0f / kFp8ScaledBy);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t g = 0; g < kBlockCols / kGroupCols; g++)
            spyre_linear::store_group(
                _mm512_mul_ps(_mm512_load_ps(partial + i * kBlockCols + g * kGroupCols), unscale),
                scale, bias, g * kGroupCols, cols, c.y + (r0 + i) * c.N + c0);
}

// One 16-pair step of one row tile against a block's four groups: the rows' 32 values at xp (row
// stride ldx bytes) into A, each group's weight tile (wp: the step's four contiguous tiles)
// into B, added into sums 0-3.
inline void four_groups(const uint16_t* xp, int64_t ldx, const char* wp) {
    _tile_loadd(4, xp, ldx);
    _tile_loadd(6, wp, kTileRowBytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, wp + kTileBytes, kTileRowBytes);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, wp + 2 * kTileBytes, kTileRowBytes);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, wp + 3 * kTileBytes, kTileRowBytes);
    _tile_dpbf16ps(3, 4, 7);
}

// Bytes of one 16-pair step of a block's packed weights (FP8: one a value).
constexpr int64_t decode_step_bytes(bool fp8) { return fp8 ? kStepValues : 2 * kStepValues; }

// A decode call's software prefetch for the weights of one 16-pair step at wp:
// bfloat16 weights into L1 kAheadBytes ahead; FP8 ones (converted before the tiles read them,
// which leaves the stream less time) kFp8AheadBytes ahead into L1 and kFp8FarBytes ahead into
// the outer caches (the T2 hint). A prefetch past the weights' end faults nothing.
template <bool FP8>
inline void stream_ahead(const char* wp) {
    for (int64_t line = 0; line < decode_step_bytes(FP8); line += 64) {
        _mm_prefetch(wp + (FP8 ? kFp8AheadBytes : kAheadBytes) + line, _MM_HINT_T0);
        if (FP8) _mm_prefetch(wp + kFp8FarBytes + line, _MM_HINT_T2);
    }
}

// A call of up to kDecodeRows rows, block b: its four groups' sums in one pass over its pairs,
// streamed ahead, into `partial`. FP8: each 16 pairs converted into the `ring` (kRingSteps steps
// of 4 KB, in L1) kConvertAhead steps before the tiles load them from there.
inline void decode_block(const Call& c, int64_t b, float* partial,
                         const Fp8PairedRowsToScaledBf16& convert, uint16_t* ring) {
    const int64_t P = c.K / 2;
    const bool fp8 = c.fp8 != nullptr;
    const char* w = fp8 ? reinterpret_cast<const char*>(c.fp8 + b * P * kPairValues)
                        : reinterpret_cast<const char*>(c.packed + b * P * kPairValues);
    const int64_t step_bytes = decode_step_bytes(fp8);
    const int64_t S = P / kTilePairs;
    for (int64_t s = 0; fp8 && s < kConvertAhead && s < S; s++)
        convert_steps(c, convert, b, s, s + 1, ring + s % kRingSteps * kStepValues);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t p = 0; p < P; p += kTilePairs) {
        const int64_t s = p / kTilePairs;
        const char* wp = w + s * step_bytes;
        if (!fp8) {
            stream_ahead<false>(wp);
            four_groups(c.x + 2 * p, c.K * 2, wp);
            continue;
        }
        stream_ahead<true>(wp);
        // The tiles load step s before the conversion stores step s + kConvertAhead: in the other
        // order the tile loads wait behind those stores (and their loads from memory).
        four_groups(c.x + 2 * p, c.K * 2, reinterpret_cast<const char*>(ring + s % kRingSteps * kStepValues));
        const int64_t next = s + kConvertAhead;
        if (next < S) convert_steps(c, convert, b, next, next + 1, ring + next % kRingSteps * kStepValues);
    }
    const int64_t stride = kBlockCols * 4;
    _tile_stored(0, partial, stride);
    _tile_stored(1, partial + 16, stride);
    _tile_stored(2, partial + 32, stride);
    _tile_stored(3, partial + 48, stride);
}

// Steps [s0, s0 + steps) (16 pairs each) of rows [16 t0, 16 t0 + rows) (rows <= 2 row tiles) of
// one block, its weights for step s0 at w, added to their sums (row stride kBlockCols, zero first
// where `resume` is false).
inline void rows_chunk(const Call& c, int64_t t0, const char* w, int64_t s0, int64_t steps,
                       int64_t rows, bool resume, float* sums, int& shape) {
    const int64_t stride = kBlockCols * 4, ldx = kTileRowBytes, step_bytes = kTilePairs * kPairBytes;
    float* s1 = sums + kTileRows * kBlockCols;
    if (rows <= kTileRows) {  // one row tile: the four groups at once
        configure(static_cast<int>(rows), 0, shape);
        if (resume) {
            _tile_loadd(0, sums, stride);
            _tile_loadd(1, sums + 16, stride);
            _tile_loadd(2, sums + 32, stride);
            _tile_loadd(3, sums + 48, stride);
        } else {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t s = 0; s < steps; s++) four_groups(c.a_tile(t0, s0 + s), ldx, w + s * step_bytes);
        _tile_stored(0, sums, stride);
        _tile_stored(1, sums + 16, stride);
        _tile_stored(2, sums + 32, stride);
        _tile_stored(3, sums + 48, stride);
        return;
    }
    // Two row tiles (16 and rows - 16 rows) x two groups, twice.
    configure(kTileRows, static_cast<int>(rows - kTileRows), shape);
    for (int64_t g = 0; g < 4; g += 2) {
        const int64_t col = g * kGroupCols;
        if (resume) {
            _tile_loadd(0, sums + col, stride);
            _tile_loadd(1, sums + col + 16, stride);
            _tile_loadd(2, s1 + col, stride);
            _tile_loadd(3, s1 + col + 16, stride);
        } else {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t s = 0; s < steps; s++) {
            const char* wp = w + s * step_bytes + kTileBytes * g;
            _tile_loadd(4, c.a_tile(t0, s0 + s), ldx);
            _tile_loadd(5, c.a_tile(t0 + 1, s0 + s), ldx);
            _tile_loadd(6, wp, kTileRowBytes);
            _tile_loadd(7, wp + kTileBytes, kTileRowBytes);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, sums + col, stride);
        _tile_stored(1, sums + col + 16, stride);
        _tile_stored(2, s1 + col, stride);
        _tile_stored(3, s1 + col + 16, stride);
    }
}

// How a call of more than kDecodeRows rows is cut: tasks of (a panel of up to kPanelBlocks
// column blocks, a chunk of up to kMaxRowChunk rows, a multiple of 32), panel-major; panels
// narrower, and rows cut, where there are too few panels for the threads. Each task sums over
// chunks of chunk_pairs pairs (kPanelChunkBytes of the panel's bfloat16 weights).
struct Plan {
    int64_t panel_blocks, panels, row_chunk, row_chunks, chunk_pairs;

    Plan(const Call& c, int64_t threads) {
        const int64_t blocks = blocks_of(c.N), P = c.K / 2;
        const int64_t share = blocks / threads;
        panel_blocks = share < 1 ? 1 : share > kPanelBlocks ? kPanelBlocks : share;
        panels = (blocks + panel_blocks - 1) / panel_blocks;
        const int64_t parts = panels >= threads ? 1 : (threads + panels - 1) / panels;
        const int64_t two_tiles = 2 * kTileRows;
        row_chunk = ((c.M + parts - 1) / parts + two_tiles - 1) / two_tiles * two_tiles;
        if (row_chunk > kMaxRowChunk) row_chunk = kMaxRowChunk;
        row_chunks = (c.M + row_chunk - 1) / row_chunk;
        const int64_t fit = kPanelChunkBytes / (panel_blocks * kPairBytes) / kTilePairs * kTilePairs;
        chunk_pairs = fit < kTilePairs ? kTilePairs : fit > P ? P : fit;
    }
    int64_t tasks() const { return panels * row_chunks; }
};

// What task t of a plan covers: rows [r0, r0 + rows) of column blocks [b0, b1).
struct TaskSpan {
    int64_t b0, b1, r0, rows;

    TaskSpan(const Call& c, const Plan& plan, int64_t t) {
        const int64_t blocks = blocks_of(c.N);
        b0 = t / plan.row_chunks * plan.panel_blocks;
        b1 = b0 + plan.panel_blocks < blocks ? b0 + plan.panel_blocks : blocks;
        r0 = t % plan.row_chunks * plan.row_chunk;
        rows = c.M - r0 < plan.row_chunk ? c.M - r0 : plan.row_chunk;
    }
};

// Task t of the plan, its sums in `sums` (block j's rows at sums + j * rows * kBlockCols), each
// 32 rows' output written after their last chunk; FP8 weights converted a chunk at a time into
// `converted` (the panel's blocks one after another, chunk_pairs pairs each).
inline void panel_task(const Call& c, const Plan& plan, int64_t t, float* sums,
                       uint16_t* converted, const Fp8PairedRowsToScaledBf16& convert, int& shape) {
    const int64_t P = c.K / 2, chunk = plan.chunk_pairs;
    const TaskSpan task(c, plan, t);
    for (int64_t p0 = 0; p0 < P; p0 += chunk) {
        const int64_t p1 = P - p0 < chunk ? P : p0 + chunk;
        const int64_t s0 = p0 / kTilePairs, steps = (p1 - p0) / kTilePairs;
        for (int64_t b = task.b0; c.fp8 != nullptr && b < task.b1; b++)
            convert_steps(c, convert, b, s0, s0 + steps, converted + (b - task.b0) * chunk * kPairValues);
        for (int64_t r = 0; r < task.rows; r += 2 * kTileRows) {
            const int64_t n = task.rows - r < 2 * kTileRows ? task.rows - r : 2 * kTileRows;
            for (int64_t b = task.b0; b < task.b1; b++) {
                const uint16_t* w = c.fp8 != nullptr ? converted + (b - task.b0) * chunk * kPairValues
                                                     : c.packed + (b * P + p0) * kPairValues;
                float* block_sums = sums + ((b - task.b0) * task.rows + r) * kBlockCols;
                rows_chunk(c, (task.r0 + r) / kTileRows, reinterpret_cast<const char*>(w), s0,
                           steps, n, p0 > 0, block_sums, shape);
                if (p1 == P) finish(c, b, task.r0 + r, n, block_sums);
            }
        }
    }
}

// Above kDecodeRows rows: the rows of row tile t into c.xa in A-tile order (each 16-pair step's
// 16 rows contiguous: a tile loads 1 KB in sequence, and a row tile's steps follow each other).
// Rows past M are not written (the tiles configured for the last row tile read only the rows
// that exist).
inline void pack_rows(const Call& c, int64_t t) {
    const int64_t S = c.K / 2 / kTilePairs;
    const int64_t rows = c.M - t * kTileRows < kTileRows ? c.M - t * kTileRows : kTileRows;
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t* src = c.x + (t * kTileRows + i) * c.K;
        for (int64_t s = 0; s < S; s++)
            _mm512_store_si512(c.a_tile(t, s) + i * 2 * kTilePairs,
                               _mm512_loadu_si512(src + s * 2 * kTilePairs));
    }
}

// Every task of a call. Up to kDecodeRows rows: a task per column block (decode_block). More:
// x packed into A-tile order first (the threads share it), then the Plan's tasks, one
// contiguous range per thread. Returns false, y partly written or not at all, where a thread
// found no memory for its buffers.
bool linear(Call c) {
    const bool decode = c.M <= kDecodeRows;
    const int64_t row_tiles = (c.M + kTileRows - 1) / kTileRows;
    if (!decode) {
        const int64_t rows = (row_tiles + 1) / 2 * 2 * kTileRows;  // whole pairs of row tiles
        c.xa = static_cast<uint16_t*>(spyre_linear::thread_scratch<kPackedRowsSlot>(rows * c.K * 2));
        if (c.xa == nullptr) return false;
    }
    bool no_memory = false;
    #pragma omp parallel reduction(|| : no_memory)
    {
        const unsigned csr = _mm_getcsr();
        _mm_setcsr(csr | kFlushDenormals);
        const Fp8PairedRowsToScaledBf16 convert;
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        int shape = -1;
        if (decode) {
            alignas(64) float partial[kDecodeRows * kBlockCols];
            alignas(64) uint16_t ring[kRingSteps * kStepValues];  // FP8: converted steps
            const int64_t blocks = blocks_of(c.N);
            const int64_t first = blocks * me / threads, last = blocks * (me + 1) / threads;
            if (first < last) configure(static_cast<int>(c.M), 0, shape);
            for (int64_t b = first; b < last; b++) {
                decode_block(c, b, partial, convert, ring);
                finish(c, b, 0, c.M, partial);
            }
        } else {
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < row_tiles; t++) pack_rows(c, t);
            const Plan plan(c, threads);
            const int64_t first = plan.tasks() * me / threads;
            const int64_t last = plan.tasks() * (me + 1) / threads;
            float* sums = nullptr;
            uint16_t* converted = nullptr;
            if (first < last) {
                sums = static_cast<float*>(spyre_linear::thread_scratch<kSumsSlot>(
                    plan.row_chunk * plan.panel_blocks * kBlockCols * 4));
                if (c.fp8 != nullptr)
                    converted = static_cast<uint16_t*>(spyre_linear::thread_scratch<kConvertedSlot>(
                        plan.panel_blocks * plan.chunk_pairs * kPairBytes));
                no_memory = sums == nullptr || (c.fp8 != nullptr && converted == nullptr);
            }
            for (int64_t t = first; t < last && !no_memory; t++)
                panel_task(c, plan, t, sums, converted, convert, shape);
        }
        if (shape != -1) _tile_release();
        _mm_setcsr(csr);
    }
    return !no_memory;
}

}  // namespace
#endif  // SPYRE_DOT_BF16

extern "C" {

// w: [N][K] row-major bfloat16 with K a multiple of 32; packed:
// spyre_linear_bf16_packed_numel(N, K) values, 64-byte aligned. Returns 1, or 0 (nothing
// written) for another K or where the kernel was not compiled.
int spyre_linear_bf16_amx_pack(const uint16_t* w, uint16_t* packed, int64_t N, int64_t K) {
#ifdef SPYRE_DOT_BF16
    if (K % (2 * kTilePairs) != 0) return 0;
    const int64_t P = K / 2, blocks = blocks_of(N);
    constexpr int64_t kTileValues = kTileBytes / 2, kRowValues = kTileRowBytes / 2;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t p = 0; p < P; p++) {
            uint16_t* step = packed + (b * P + p / kTilePairs * kTilePairs) * kPairValues;
            for (int64_t c = 0; c < kBlockCols; c++)
                for (int64_t e = 0; e < 2; e++) {
                    const int64_t n = b * kBlockCols + c, k = 2 * p + e;
                    step[c / kGroupCols * kTileValues + p % kTilePairs * kRowValues +
                         c % kGroupCols * 2 + e] = n < N ? w[n * K + k] : 0;
                }
        }
    return 1;
#else
    (void)w, (void)packed, (void)N, (void)K;
    return 0;
#endif
}

// y [M][N] = x [M][K] @ w^T (+ bias [N] where bias is not null), all bfloat16, contiguous, on AMX
// tiles as the arithmetic above says; packed: spyre_linear_bf16_amx_pack's form of w. Returns 2
// where it ran; 0, y unwritten, where it cannot: K not a multiple of 32, or built without AMX
// intrinsics (spyre_dot_bf16_compiled() 0). The caller checks the CPU and the process's AMX
// permission first.
int spyre_linear_bf16_amx(const uint16_t* x, const uint16_t* packed, const uint16_t* bias,
                          uint16_t* y, int64_t M, int64_t K, int64_t N) {
#ifdef SPYRE_DOT_BF16
    if (K % (2 * kTilePairs) != 0) return 0;
    if (M == 0 || N == 0) return 2;
    return linear(Call{x, packed, nullptr, nullptr, bias, y, M, K, N}) ? 2 : -1;
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)K, (void)N;
    return 0;
#endif
}

// FP8 weights: w [N][K] row-major float8_e4m3fn (K a multiple of 32), scale N float32 values
// or 1 (one for every column), packed in spyre_linear_bf16_amx_pack's order with one byte a
// value, then a byte per 16 pairs of a block (whether a value has exponent 0):
// spyre_linear_fp8_packed_numel(N, K) bytes, 64-byte aligned; packed_scale: blocks_of(N) * 64
// floats (zero past N). Returns how many values of w are NaN (0x7F, 0xFF; the packing is
// unusable unless 0), or -1, nothing written, for another K or where the kernel was not compiled.
int64_t spyre_linear_fp8_amx_pack(const uint8_t* w, const float* scale, int64_t num_scales,
                                  uint8_t* packed, float* packed_scale, int64_t N, int64_t K) {
#ifdef SPYRE_DOT_BF16
    if (K % (2 * kTilePairs) != 0) return -1;
    const int64_t P = K / 2, blocks = blocks_of(N);
    constexpr int64_t kTileValues = kTileBytes / 2, kRowValues = kTileRowBytes / 2;
    int64_t nan = 0;
    #pragma omp parallel for schedule(static) reduction(+ : nan)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t c = 0; c < kBlockCols; c++) {
            const int64_t n = b * kBlockCols + c;
            packed_scale[n] = n < N ? scale[num_scales == 1 ? 0 : n] : 0.0f;
        }
        for (int64_t s = 0; s < P / kTilePairs; s++) {
            uint8_t* step = packed + (b * P + s * kTilePairs) * kPairValues;
            uint8_t zero_exponent = 0;
            for (int64_t q = 0; q < kTilePairs; q++)
                for (int64_t c = 0; c < kBlockCols; c++)
                    for (int64_t e = 0; e < 2; e++) {
                        const int64_t n = b * kBlockCols + c, k = 2 * (s * kTilePairs + q) + e;
                        const uint8_t v = n < N ? w[n * K + k] : 0;
                        nan += (v & 0x7F) == 0x7F;
                        zero_exponent |= (v & 0x78) == 0;
                        step[paired_rows_byte(c / kGroupCols * kTileValues + q * kRowValues +
                                              c % kGroupCols * 2 + e)] = v;
                    }
            packed[blocks * P * kPairValues + (b * P) / kTilePairs + s] = zero_exponent;
        }
    }
    return nan;
#else
    (void)w, (void)scale, (void)num_scales, (void)packed, (void)packed_scale, (void)N, (void)K;
    return -1;
#endif
}

// spyre_linear_bf16_amx with FP8 weights (packed by spyre_linear_fp8_amx_pack), each converted
// to bfloat16 (exact) before the tiles sum them, and the sums times the column scales before the
// bias: y = bf16(acc * scale[n] + bias[n]). Returns 2 where it ran, 0 where it cannot (as the
// packing), -1 where a thread found no memory for its converted block (y partly written).
int spyre_linear_fp8_amx(const uint16_t* x, const uint8_t* packed, const float* scale,
                         const uint16_t* bias, uint16_t* y, int64_t M, int64_t K, int64_t N) {
#ifdef SPYRE_DOT_BF16
    if (K % (2 * kTilePairs) != 0) return 0;
    if (M == 0 || N == 0) return 2;
    return linear(Call{x, nullptr, packed, scale, bias, y, M, K, N}) ? 2 : -1;
#else
    (void)x, (void)packed, (void)scale, (void)bias, (void)y, (void)M, (void)K, (void)N;
    return 0;
#endif
}

}  // extern "C"
