// bfloat16 linear layer y = x @ w^T (+ bias) for the cpu backend, with the weight packed once.
//
// The arithmetic, exactly: every output y[m][n] is
//     acc = +0 (float32)
//     for p = 0 .. ceil(K / 2) - 1 (x[m][K] = w[n][K] = 0 when K is odd):
//         acc = fma(x[m][2p + 1], w[n][2p + 1], acc)
//         acc = fma(x[m][2p], w[n][2p], acc)
//     y[m][n] = bf16(acc + bias[n])   (without a bias: bf16(acc))
// in float32 with denormals flushed to zero (inputs, each partial sum and the bias add), rounded
// to bfloat16 once at the end as torch rounds (to nearest, ties to even, NaN to 0x7FC0). A
// product of two bfloat16 values is exact in float32, so each step rounds once. This is what the
// AVX512-BF16 instruction vdpbf16ps computes per lane and pair (the odd element first, each add
// rounded to nearest even, denormals as zero); the AVX2 code computes the same FMAs in the same
// order under MXCSR's flush-to-zero and denormals-are-zero. So a row's result is the same bits
// whatever other rows a call computes, whatever the blocking, the threads and the path (the
// batch invariance the prefix cache relies on: DESIGN §4).
//
// Against the exact sum s (denormal terms aside): |y - s| <= 2^-8 |s| + (1 + 2^-8) e, with
// e = (K + 2) * 2^-24 * (sum_k |x_k w_k| + |bias|): the float32 accumulation, then half a
// bfloat16 step. F.linear in bfloat16 (float32 sums in another order, one rounding) is within
// the same bound, so the two are within twice it of each other.
//
// Packed layout: output columns in blocks of 64 (a last partial block padded with zero
// columns); block b holds, for each pair p, the 64 columns' (w[n][2p], w[n][2p + 1]) side by side:
// 256 bytes per pair, so a block is one sequential stream of ceil(K / 2) * 256 bytes. Within a
// pair's 256 bytes the columns go in four groups of 16 (one 512-bit register: 16 dwords, each a
// pair, the even element in its low half, as vdpbf16ps takes it).
//
// Work: tasks of (one column block, a chunk of rows), column-block-major, split into one
// contiguous range per thread, so a block's weights are read from memory once per call and stay
// in cache while the thread goes through the row chunks. A call of up to kDecodeRows rows (a
// decode step) is one row chunk: every weight byte is read once, in one stream per thread (the
// memory-bandwidth bound). Within a task the sums run over chunks of pairs, every row block per
// chunk (the chunk of weights stays in cache for the other row blocks); the partial sums are
// stored and reloaded exactly between chunks, so the bits equal one pass.
//
// A decode call reads its weights once, from memory: the first row block of each chunk asks for
// the weights kStreamAheadBytes ahead of the pair it computes (software prefetch), which keeps
// enough reads in flight for one thread's stream to run at the memory's speed where the
// hardware prefetcher alone does not (bench/decode_bandwidth.py measures both). A decode call of
// more rows than one AVX512-BF16 row block (6) splits them into row blocks of even sizes, in
// chunks of 64 pairs (16 KB of bfloat16 weights), and each row block asks for its share of the
// next chunk (NextChunk: contiguous shares, so the asks go in address order), so the memory
// stays busy while the later row blocks compute.
//
// FP8 weights (float8_e4m3fn with a float32 scale per output column, the compressed-tensors
// checkpoints' form): packed in the same layout with one byte a value (128 bytes a pair of a
// block), then a byte per pair saying whether one of its values has exponent 0 (a zero or a
// subnormal). Every float8_e4m3fn value is exactly a bfloat16 value, so the kernel converts the
// weights (no rounding) and runs the bfloat16 arithmetic on them: a task of up to kFp8FusedRows
// rows (a decode call) as it reads each pair, all rows in one row block and the block's column
// groups in one pass or two (every weight converted once); more rows a chunk of pairs at a time
// into the thread's scratch, which every row block then reads (and the block's further row
// chunks on the thread, without converting again: a prefill converts each block about once).
// A decode call of more rows than one row block fetches the next chunk's FP8 pairs ahead in
// every pass or row block, as the bfloat16 weights' (NextChunk). A pair without exponent-0
// values takes a shorter conversion (sign-extend, shift, mask, rebias). The AVX2 code converts
// through a table.
// The column's scale multiplies the float32 sum at the end:
//     y[m][n] = bf16(acc * scale[n] + bias[n])
// with acc the sum above over the FP8 values, each operation rounded to nearest in float32 with
// denormals flushed. HF transformers (compressed-tensors) instead rounds each weight times its
// scale to bfloat16 and sums those: the two are within the bound above of the exact sum of the
// dequantized weights, plus HF's 2^-9 relative rounding of each weight. A decode step reads one
// byte a weight instead of two.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "fp8_bf16.h"
#include "linear_bf16_layout.h"

#define UNROLL _Pragma("GCC unroll 16")

namespace {

using spyre_linear::blocks_of;
using spyre_linear::kFp8;
using spyre_linear::kBlockCols;
using spyre_linear::kPairValues;
using spyre_linear::pairs_of;
#if defined(__clang__) ? __clang_major__ >= 9 : defined(__GNUC__) && __GNUC__ >= 10
using spyre_linear::Fp8ToBf16;
#endif

constexpr int64_t kDecodeRows = 16;   // up to this many rows: one row chunk (weights read once)
constexpr int64_t kRowChunk = 48;     // rows per task above that (a multiple of both row blocks)
constexpr int64_t kDecodePairs = 128;   // pairs per chunk of the sums, decode: 32 KB of weights
constexpr int64_t kDecodeBlocksPairs = 64;  // ... a decode call of more than one row block: 16 KB
constexpr int64_t kPrefillPairs = 1024;  // ... and above kDecodeRows rows: 256 KB
constexpr int64_t kStreamAheadBytes = 2048;  // a decode call's prefetch distance in its stream
constexpr int kRowsDot = 6;  // AVX512-BF16 row blocks: 6 rows x 4 groups of 16 columns
constexpr int kFp8FusedRows = 12;  // FP8 decode calls converting as they read: 12 rows x 2 groups

// Asks for the 256 bytes `kStreamAheadBytes` after `wp` (a pair's start; an FP8 pair is 128
// bytes, so each line is asked for twice, which ran faster than once: a prefetch the full fill
// buffers drop is asked for again); past the packed weight's end it asks for nothing that faults
// (a prefetch never does).
inline void stream_ahead(const void* wp) {
    const char* ahead = static_cast<const char*>(wp) + kStreamAheadBytes;
    UNROLL for (int line = 0; line < 4; line++) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
}

constexpr unsigned kFlushDenormals = 0x8040;  // MXCSR: flush to zero, denormals are zero

// Where a task's sums go and come from.
struct Task {
    const uint16_t* x;   // its first row
    int64_t K;           // x's row stride and the sum's length
    const uint16_t* w;   // its block's pairs
    const uint16_t* bias;  // its block's first column's bias, or nullptr
    uint16_t* y;         // its first row's first column of the block
    int64_t N;           // y's row stride
    int64_t cols;        // columns of the block that exist (64, or fewer in the last block)
    const float* scale;  // FP8 weights: its block's 64 column scales (the sums times them); else nullptr
    const uint8_t* w8;   // FP8 weights: its block's FP8 pairs (w: their converted scratch); else nullptr
    const uint8_t* zero_exponent;  // FP8 weights: per pair of the block, whether a value has exponent 0
};

// A thread's bfloat16 copy of one block's FP8 weights (the pairs a task on the converting path
// reads): `ready` once it holds the whole block of the task at hand, so the block's other row
// chunks on this thread read it without converting again.
struct Fp8Scratch {
    uint16_t* pairs;  // the block's P pairs; a task's Task::w
    bool ready;
};

constexpr int64_t kFp8PairBytes = kPairValues;  // one byte a value

// Pairs [p0, p1) of the task's FP8 weights (t.w8) into its block's scratch (any x86-64 code).
inline void convert_fp8(const Task& t, uint16_t* scratch, int64_t p0, int64_t p1, bool stream) {
    for (int64_t p = p0; p < p1; p++) {
        const uint8_t* src = t.w8 + p * kFp8PairBytes;
        if (stream) stream_ahead(src);
        uint16_t* dst = scratch + p * kPairValues;
        for (int64_t v = 0; v < kPairValues; v++) dst[v] = kFp8.bits[src[v]];
    }
}

// ---------------------------------------------------------------- AVX2: bfloat16 widened to FMA

// Rows [0, MR) of x, widened to float32 (row stride ldxf), pairs [p0, p1) against the 16
// columns of group j, added into acc [MR][2] (two 8-column halves).
template <int MR>
inline void group_avx2(const float* xf, int64_t ldxf, const uint16_t* w, int64_t j, int64_t p0,
                       int64_t p1, bool stream, __m256 (&acc)[MR][2]) {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int64_t p = p0; p < p1; p++) {
        if (stream) stream_ahead(w + p * kPairValues);
        const uint16_t* wp = w + p * kPairValues + j * 32;
        const __m256i w0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp));
        const __m256i w1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(wp + 16));
        const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
        const __m256 odd0 = _mm256_castsi256_ps(_mm256_and_si256(w0, high));
        const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
        const __m256 odd1 = _mm256_castsi256_ps(_mm256_and_si256(w1, high));
        UNROLL for (int i = 0; i < MR; i++) {
            const __m256 xo = _mm256_broadcast_ss(xf + i * ldxf + 2 * p + 1);
            const __m256 xe = _mm256_broadcast_ss(xf + i * ldxf + 2 * p);
            acc[i][0] = _mm256_fmadd_ps(xe, even0, _mm256_fmadd_ps(xo, odd0, acc[i][0]));
            acc[i][1] = _mm256_fmadd_ps(xe, even1, _mm256_fmadd_ps(xo, odd1, acc[i][1]));
        }
    }
}

// y = bf16(acc + bias) for 8 columns from c0 (of which `cols - c0` exist, capped at 8).
inline void finish8(__m256 acc, const float* scale, const uint16_t* bias, int64_t c0, int64_t cols,
                    uint16_t* y) {
    if (scale != nullptr) acc = _mm256_mul_ps(acc, _mm256_loadu_ps(scale + c0));
    if (bias != nullptr) {
        alignas(32) uint16_t b[8] = {};
        for (int64_t c = 0; c < 8 && c0 + c < cols; c++) b[c] = bias[c0 + c];
        const __m128i h = _mm_load_si128(reinterpret_cast<const __m128i*>(b));
        acc = _mm256_add_ps(acc, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
    const __m256i u = _mm256_castps_si256(acc);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(acc, acc, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    if (c0 + 8 <= cols) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(y + c0), packed);
    } else {
        alignas(16) uint16_t tmp[8];
        _mm_store_si128(reinterpret_cast<__m128i*>(tmp), packed);
        for (int64_t c = c0; c < cols; c++) y[c] = tmp[c - c0];
    }
}

// MR rows (from row r of the task) x the block's 64 columns, pairs [p0, p1).
template <int MR>
inline void rows_avx2(const Task& t, const float* xf, int64_t ldxf, int64_t r, int64_t p0,
                      int64_t p1, bool resume, bool finish, bool stream, float* partial) {
    for (int64_t j = 0; j < kBlockCols / 16; j++) {
        __m256 acc[MR][2];
        UNROLL for (int i = 0; i < MR; i++) UNROLL for (int h = 0; h < 2; h++)
            acc[i][h] = resume ? _mm256_load_ps(partial + (r + i) * kBlockCols + j * 16 + h * 8)
                               : _mm256_setzero_ps();
        group_avx2<MR>(xf + r * ldxf, ldxf, t.w, j, p0, p1, stream && j == 0, acc);
        UNROLL for (int i = 0; i < MR; i++) UNROLL for (int h = 0; h < 2; h++) {
            if (finish)
                finish8(acc[i][h], t.scale, t.bias, j * 16 + h * 8, t.cols, t.y + (r + i) * t.N);
            else
                _mm256_store_ps(partial + (r + i) * kBlockCols + j * 16 + h * 8, acc[i][h]);
        }
    }
}

// x widened to float32, [M][2 * pairs] (a zero after an odd K's last value), in the calling
// thread's buffer (kept and grown); nullptr without memory.
inline float* widen_rows(const uint16_t* x, int64_t M, int64_t K) {
    thread_local float* buffer = nullptr;
    thread_local int64_t capacity = 0;
    const int64_t ld = 2 * pairs_of(K), need = M * ld;
    if (need > capacity) {
        free(buffer);
        buffer = static_cast<float*>(aligned_alloc(64, (need * 4 + 63) / 64 * 64));
        capacity = buffer == nullptr ? 0 : need;
        if (buffer == nullptr) return nullptr;
    }
    float* out = buffer;  // (thread_local: the workers below must not read their own)
    #pragma omp parallel for schedule(static) if (need >= (1 << 16))
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = 0; k < K; k++) {
            const uint32_t u = static_cast<uint32_t>(x[m * K + k]) << 16;
            __builtin_memcpy(out + m * ld + k, &u, 4);
        }
        if (K % 2) out[m * ld + K] = 0.0f;
    }
    return out;
}

constexpr int kRowsAvx2 = 4;

// A task's rows [0, rows) on AVX2: xf is the task's first row, widened. `stream`: a decode
// call's (its first row block streams the weights ahead). FP8 (`fp8`: the thread's scratch,
// t.w): the block converted a chunk of pairs at a time unless the scratch holds it already.
inline void task_avx2(const Task& t, const float* xf, int64_t ldxf, int64_t rows, int64_t chunk,
                      bool stream, float* partial, Fp8Scratch* fp8) {
    const int64_t P = pairs_of(t.K);
    const bool converts = fp8 != nullptr && !fp8->ready;
    for (int64_t p0 = 0; p0 < P; p0 += chunk) {
        const int64_t p1 = P - p0 < chunk ? P : p0 + chunk;
        const bool resume = p0 > 0, finish = p1 == P;
        if (converts) convert_fp8(t, fp8->pairs, p0, p1, stream);
        int64_t r = 0;
        const bool streams = stream && fp8 == nullptr;  // (a conversion streams its source)
        for (; r + kRowsAvx2 <= rows; r += kRowsAvx2)
            rows_avx2<kRowsAvx2>(t, xf, ldxf, r, p0, p1, resume, finish, streams && r == 0, partial);
        const bool first = streams && r == 0;
        switch (rows - r) {
            case 3: rows_avx2<3>(t, xf, ldxf, r, p0, p1, resume, finish, first, partial); break;
            case 2: rows_avx2<2>(t, xf, ldxf, r, p0, p1, resume, finish, first, partial); break;
            case 1: rows_avx2<1>(t, xf, ldxf, r, p0, p1, resume, finish, first, partial); break;
            default: break;
        }
    }
    if (converts) fp8->ready = true;
}

// ------------------------------------------------------------ AVX512-BF16: vdpbf16ps per pair

#if defined(__clang__) ? __clang_major__ >= 9 : defined(__GNUC__) && __GNUC__ >= 10
#define SPYRE_LINEAR_BF16_DOT 1
#define DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))

// Groups [g0, g0 + G) of pair p of a block's FP8 weights as bfloat16: the fast conversion unless
// a value of the pair has exponent 0 (rare in a trained model's weights; padding is zero).
template <int G = 4>
DOT inline void fp8_pair(const Fp8ToBf16& convert, const uint8_t* w8, const uint8_t* zero_exponent,
                         int64_t p, int g0, __m512i (&w)[G]) {
    const uint8_t* src = w8 + p * kFp8PairBytes + 32 * g0;
    if (__builtin_expect(zero_exponent[p] != 0, 0)) {
        UNROLL for (int j = 0; j < G; j++) w[j] = convert(src + 32 * j);
    } else {
        UNROLL for (int j = 0; j < G; j++) w[j] = convert.normal(src + 32 * j);
    }
}

// Pairs [p0, p1) of the task's FP8 weights into its block's scratch (convert_fp8, vectorized).
DOT void convert_fp8_dot(const Task& t, uint16_t* scratch, int64_t p0, int64_t p1, bool stream) {
    const Fp8ToBf16 convert;
    for (int64_t p = p0; p < p1; p++) {
        if (stream) stream_ahead(t.w8 + p * kFp8PairBytes);
        __m512i w[4];
        fp8_pair(convert, t.w8, t.zero_exponent, p, 0, w);
        uint16_t* dst = scratch + p * kPairValues;
        UNROLL for (int j = 0; j < 4; j++) _mm512_store_si512(dst + 32 * j, w[j]);
    }
}

// Groups [g0, g0 + G) of the block's pair p: from the bfloat16 weights, or converted from the
// FP8 ones (FP8: t.w8 read; the weights serve every row of the call, so are never stored).
template <bool FP8, int G>
DOT inline void pair_weights(const Task& t, int64_t p, int g0, bool stream,
                             const Fp8ToBf16& convert, __m512bh (&w)[G]) {
    if (FP8) {
        if (stream) stream_ahead(t.w8 + p * kFp8PairBytes);
        __m512i converted[G];
        fp8_pair<G>(convert, t.w8, t.zero_exponent, p, g0, converted);
        UNROLL for (int j = 0; j < G; j++) w[j] = (__m512bh)converted[j];
        return;
    }
    const uint16_t* wp = t.w + p * kPairValues + 32 * g0;
    if (stream) stream_ahead(wp);
    UNROLL for (int j = 0; j < G; j++) w[j] = (__m512bh)_mm512_load_si512(wp + j * 32);
}

// A decode call of more rows than one row block goes through each chunk of pairs once per row
// block, and only the first pass would read from memory: the other passes compute from cache
// while the memory idles. So every row block asks instead for its share of the next chunk's
// pairs: the `phase`-th of `period` (the number of row blocks) contiguous parts, one pair every
// `period` pairs it computes. Each pair is asked for once, a chunk ahead; reads stay in flight
// while any row block computes, and the asks of the row blocks in turn go through the next
// chunk in address order: a stream the hardware prefetcher follows, which asks for every
// period-th pair are not (docs/notes/2026-12-04-granite-table-zen5.md).
struct NextChunk {
    const char* pairs;   // the next chunk's first pair (past a block's end: the next block's)
    int64_t pair_bytes;  // 256 (bfloat16 weights) or 128 (FP8: the source a conversion reads)
    int64_t period, phase;
};

// The chunk from pair p1 of the task's weights as memory holds them (`fp8`: its FP8 source,
// t.w8; else its bfloat16 pairs, t.w), the `phase`-th of `period` row blocks' share to ask for.
inline NextChunk next_chunk(const Task& t, bool fp8, int64_t p1, int64_t period, int64_t phase) {
    if (fp8)
        return {reinterpret_cast<const char*>(t.w8 + p1 * kFp8PairBytes), kFp8PairBytes, period, phase};
    return {reinterpret_cast<const char*>(t.w + p1 * kPairValues), 2 * kPairValues, period, phase};
}

// MR rows from row r of the task x the block's column groups [g0, g0 + G) (16 columns each),
// pairs [p0, p1): the x pair of row i broadcast to every lane, one vdpbf16ps per group. An odd
// K's last pair takes x's last value alone (zero in the odd half), as the zero-padded weight
// does. FP8: the weights converted from t.w8 as they are read. `stream`: the row block streams
// its own pairs ahead (a decode call's); `next`: it asks for its share of the next chunk's.
template <int MR, int G = 4, bool FP8 = false>
DOT inline void rows_dot(const Task& t, int64_t r, int g0, int64_t p0, int64_t p1, bool resume,
                         bool finish, bool stream, float* partial,
                         const NextChunk* next = nullptr) {
    const int64_t full = t.K / 2;  // pairs with both values in x
    const uint16_t* x = t.x + r * t.K;
    const Fp8ToBf16 convert;
    float* sums = partial + g0 * 16;  // group g0's 16 columns of row 0
    __m512 acc[MR][G];
    UNROLL for (int i = 0; i < MR; i++) UNROLL for (int j = 0; j < G; j++)
        acc[i][j] = resume ? _mm512_load_ps(sums + (r + i) * kBlockCols + j * 16) : _mm512_setzero_ps();
    const int64_t end = p1 < full ? p1 : full;
    // `next`: the next pair of its share to ask for, in `ask_in` pairs (never without `next`)
    const char* ask = nullptr;
    int64_t ask_in = -1;
    if (next != nullptr) {
        const int64_t share = (p1 - p0 + next->period - 1) / next->period;
        ask = next->pairs + next->phase * share * next->pair_bytes;
        ask_in = 0;
    }
    for (int64_t p = p0; p < end; p++) {
        __m512bh w[G];
        pair_weights<FP8, G>(t, p, g0, stream, convert, w);
        if (ask_in-- == 0) {
            ask_in = next->period - 1;
            for (int64_t line = 0; line < next->pair_bytes; line += 64)
                _mm_prefetch(ask + line, _MM_HINT_T0);
            ask += next->pair_bytes;
        }
        UNROLL for (int i = 0; i < MR; i++) {
            int32_t pair;
            __builtin_memcpy(&pair, x + i * t.K + 2 * p, 4);
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
            UNROLL for (int j = 0; j < G; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, w[j]);
        }
    }
    if (p1 > full && full >= p0) {  // an odd K's last pair, in this chunk
        __m512bh w[G];
        pair_weights<FP8, G>(t, full, g0, false, convert, w);
        UNROLL for (int i = 0; i < MR; i++) {
            const __m512bh xv = (__m512bh)_mm512_set1_epi32(x[i * t.K + 2 * full]);
            UNROLL for (int j = 0; j < G; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, w[j]);
        }
    }
    UNROLL for (int i = 0; i < MR; i++) UNROLL for (int j = 0; j < G; j++) {
        if (!finish) {
            _mm512_store_ps(sums + (r + i) * kBlockCols + j * 16, acc[i][j]);
            continue;
        }
        spyre_linear::store_group(acc[i][j], t.scale, t.bias, (g0 + j) * 16, t.cols, t.y + (r + i) * t.N);
    }
}

// FP8, the rows [0, rows) of a task of up to MR rows (a decode call's), in one row block:
// the block's groups in passes of G, as many as 24 accumulators hold (4 groups up to 6 rows, 2 up
// to 12), each pass converting its groups' weights from t.w8 as it reads them, so every weight
// is converted once (the second pass reads the chunk's bytes from cache: both passes fetch
// their share of the next chunk, as row blocks do).
template <int MR>
DOT inline void fp8_rows(const Task& t, int64_t rows, int64_t p0, int64_t p1, bool resume,
                         bool finish, bool stream, float* partial) {
    if constexpr (MR > 1) {
        if (rows < MR) return fp8_rows<MR - 1>(t, rows, p0, p1, resume, finish, stream, partial);
    }
    static_assert(MR <= 2 * kRowsDot, "24 accumulators: at most 12 rows in passes of 2 groups");
    constexpr int G = MR <= kRowsDot ? 4 : 2;
    if constexpr (G == 4) {
        rows_dot<MR, G, true>(t, 0, 0, p0, p1, resume, finish, stream, partial);
    } else {
        for (int g0 = 0; g0 < 4; g0 += G) {
            const NextChunk next = next_chunk(t, true, p1, 4 / G, g0 / G);
            rows_dot<MR, G, true>(t, 0, g0, p0, p1, resume, finish, stream && g0 == 0 && p0 == 0,
                                  partial, stream ? &next : nullptr);
        }
    }
}

// rows_dot over all four groups for n rows (1 <= n <= kRowsDot) from row r.
DOT void rows_dot_n(int64_t n, const Task& t, int64_t r, int64_t p0, int64_t p1, bool resume,
                    bool finish, bool stream, float* partial, const NextChunk* next = nullptr) {
    switch (n) {
        case 6: return rows_dot<6>(t, r, 0, p0, p1, resume, finish, stream, partial, next);
        case 5: return rows_dot<5>(t, r, 0, p0, p1, resume, finish, stream, partial, next);
        case 4: return rows_dot<4>(t, r, 0, p0, p1, resume, finish, stream, partial, next);
        case 3: return rows_dot<3>(t, r, 0, p0, p1, resume, finish, stream, partial, next);
        case 2: return rows_dot<2>(t, r, 0, p0, p1, resume, finish, stream, partial, next);
        case 1: return rows_dot<1>(t, r, 0, p0, p1, resume, finish, stream, partial, next);
        default: return;
    }
}
static_assert(kRowsDot == 6, "rows_dot_n dispatches up to kRowsDot rows");

// A task's rows [0, rows) with vdpbf16ps. FP8 (`fp8`: the thread's scratch, t.w): up to
// kFp8FusedRows rows convert from t.w8 as they read (fp8_rows) unless the scratch holds the
// block already; more read the scratch, converted first a chunk of pairs at a time if it does
// not.
DOT void task_dot(const Task& t, int64_t rows, int64_t chunk, bool stream, float* partial,
                  Fp8Scratch* fp8) {
    const int64_t P = pairs_of(t.K);
    const bool fused = fp8 != nullptr && rows <= kFp8FusedRows && !fp8->ready;
    const bool converts = fp8 != nullptr && !fused && !fp8->ready;
    for (int64_t p0 = 0; p0 < P; p0 += chunk) {
        const int64_t p1 = P - p0 < chunk ? P : p0 + chunk;
        const bool resume = p0 > 0, finish = p1 == P;
        if (fused) {
            fp8_rows<kFp8FusedRows>(t, rows, p0, p1, resume, finish, stream, partial);
            continue;
        }
        if (converts) convert_fp8_dot(t, fp8->pairs, p0, p1, stream && p0 == 0);
        const bool streams = stream && fp8 == nullptr;  // (a conversion streams its source)
        if (stream && rows > kRowsDot) {  // row blocks of even sizes, each fetching ahead
            const int64_t blocks = (rows + kRowsDot - 1) / kRowsDot;
            for (int64_t j = 0; j < blocks; j++) {
                const int64_t r = rows * j / blocks, n = rows * (j + 1) / blocks - r;
                const NextChunk next = next_chunk(t, fp8 != nullptr, p1, blocks, j);
                rows_dot_n(n, t, r, p0, p1, resume, finish, streams && j == 0 && p0 == 0, partial,
                           &next);
            }
            continue;
        }
        int64_t r = 0;
        for (; r + kRowsDot <= rows; r += kRowsDot)
            rows_dot<kRowsDot>(t, r, 0, p0, p1, resume, finish, streams && r == 0, partial);
        if (r < rows) rows_dot_n(rows - r, t, r, p0, p1, resume, finish, streams && r == 0, partial);
    }
    if (converts) fp8->ready = true;
}
#endif

const bool kCpuDot = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16"));

inline bool dot_path(int avx512) {
#ifdef SPYRE_LINEAR_BF16_DOT
    return avx512 != 0 && kCpuDot;
#else
    (void)avx512;
    return false;
#endif
}

// The weights a call reads: bfloat16 pairs, or FP8 pairs and their column scales.
struct Weights {
    const uint16_t* bf16;  // nullptr for FP8
    const uint8_t* fp8;
    const float* scale;
};

// Every task of a call: one contiguous range of the column-block-major tasks per thread.
// Returns 1 (AVX512-BF16) or 0 (AVX2), or -1 where it found no memory for one row (AVX2) or for
// one block's converted FP8 weights.
int linear(bool dot, const uint16_t* x, const Weights& weights, const uint16_t* bias, uint16_t* y,
           int64_t M, int64_t K, int64_t N) {
    const float* xf = nullptr;
    const int64_t ldxf = 2 * pairs_of(K);
    if (!dot) {
        xf = widen_rows(x, M, K);
        if (xf == nullptr) {  // no memory for the widened rows: the same sums a row at a time
            if (M == 1) return -1;
            for (int64_t m = 0; m < M; m++)
                if (linear(false, x + m * K, weights, bias, y + m * N, 1, K, N) < 0) return -1;
            return 0;
        }
    }
    const bool decode = M <= kDecodeRows;
    const int64_t row_chunk = decode ? M : kRowChunk;
    const bool row_blocks = dot && M > kRowsDot;
    const int64_t chunk = !decode ? kPrefillPairs : row_blocks ? kDecodeBlocksPairs : kDecodePairs;
    const int64_t num_chunks = (M + row_chunk - 1) / row_chunk, blocks = blocks_of(N);
    const int64_t tasks = blocks * num_chunks, P = pairs_of(K);
    bool no_memory = false;
    #pragma omp parallel reduction(|| : no_memory)
    {
        const unsigned csr = _mm_getcsr();
        _mm_setcsr(csr | kFlushDenormals);
        alignas(64) float partial[kRowChunk * kBlockCols];
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t first = tasks * me / threads, last = tasks * (me + 1) / threads;
        Fp8Scratch scratch{weights.fp8 != nullptr && first < last ? spyre_linear::thread_block_scratch(P) : nullptr, false};
        no_memory = weights.fp8 != nullptr && first < last && scratch.pairs == nullptr;
        Fp8Scratch* fp8 = weights.fp8 != nullptr ? &scratch : nullptr;
        for (int64_t task = first; task < last && !no_memory; task++) {
            const int64_t b = task / num_chunks, r0 = task % num_chunks * row_chunk;
            const int64_t rows = M - r0 < row_chunk ? M - r0 : row_chunk;
            const int64_t c0 = b * kBlockCols;
            if (r0 == 0) scratch.ready = false;  // a new block (tasks go block by block)
            const bool is_fp8 = fp8 != nullptr;
            const Task t{x + r0 * K, K, is_fp8 ? scratch.pairs : weights.bf16 + b * P * kPairValues,
                         bias == nullptr ? nullptr : bias + c0, y + r0 * N + c0, N,
                         N - c0 < kBlockCols ? N - c0 : kBlockCols,
                         is_fp8 ? weights.scale + c0 : nullptr,
                         is_fp8 ? weights.fp8 + b * P * kFp8PairBytes : nullptr,
                         is_fp8 ? weights.fp8 + blocks * P * kFp8PairBytes + b * P : nullptr};
#ifdef SPYRE_LINEAR_BF16_DOT
            if (dot) {
                task_dot(t, rows, chunk, decode, partial, fp8);
                continue;
            }
#endif
            task_avx2(t, xf + r0 * ldxf, ldxf, rows, chunk, decode, partial, fp8);
        }
        _mm_setcsr(csr);
    }
    if (no_memory) return -1;
    return dot ? 1 : 0;
}

}  // namespace

extern "C" {

// 1 where spyre_linear_bf16 computes with vdpbf16ps when its avx512 argument is nonzero (the
// CPU has AVX512-BF16 and the compiler could build that code), else 0 (AVX2 then, the same bits).
int spyre_linear_bf16_dot_supported() { return dot_path(1) ? 1 : 0; }

// bfloat16 values of the packed form of an [N][K] weight.
int64_t spyre_linear_bf16_packed_numel(int64_t N, int64_t K) {
    return blocks_of(N) * pairs_of(K) * kPairValues;
}

// w: [N][K] row-major bfloat16; packed: spyre_linear_bf16_packed_numel(N, K) values, 64-byte
// aligned.
void spyre_linear_bf16_pack(const uint16_t* w, uint16_t* packed, int64_t N, int64_t K) {
    const int64_t P = pairs_of(K), blocks = blocks_of(N);
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t p = 0; p < P; p++)
            for (int64_t c = 0; c < kBlockCols; c++)
                for (int64_t e = 0; e < 2; e++) {
                    const int64_t n = b * kBlockCols + c, k = 2 * p + e;
                    packed[(b * P + p) * kPairValues + 2 * c + e] = n < N && k < K ? w[n * K + k] : 0;
                }
}

// y [M][N] = x [M][K] @ w^T (+ bias [N] where bias is not null), all bfloat16, contiguous, as
// the arithmetic above says. avx512 nonzero: vdpbf16ps where the CPU has AVX512-BF16 (returns
// 1), else AVX2 and FMA (returns 0): the same bits. Returns -1, y unwritten, where the AVX2
// code cannot allocate its float32 copy of one row of x.
int spyre_linear_bf16(int avx512, const uint16_t* x, const uint16_t* packed, const uint16_t* bias,
                      uint16_t* y, int64_t M, int64_t K, int64_t N) {
    return linear(dot_path(avx512), x, Weights{packed, nullptr, nullptr}, bias, y, M, K, N);
}

// Bytes of the packed form of an [N][K] FP8 weight (its pairs, then a byte per pair: whether a
// value has exponent 0); its scales take blocks_of(N) * 64 floats.
int64_t spyre_linear_fp8_packed_numel(int64_t N, int64_t K) {
    return blocks_of(N) * pairs_of(K) * (kFp8PairBytes + 1);
}

// w: [N][K] row-major float8_e4m3fn; scale: N float32 values, or 1 (one for every column);
// packed: spyre_linear_fp8_packed_numel(N, K) bytes, 64-byte aligned; packed_scale:
// blocks_of(N) * 64 floats (zero past N). Returns how many values of w are NaN (0x7F, 0xFF),
// which the kernel cannot compute (the packed weight is unusable unless 0).
int64_t spyre_linear_fp8_pack(const uint8_t* w, const float* scale, int64_t num_scales,
                              uint8_t* packed, float* packed_scale, int64_t N, int64_t K) {
    const int64_t P = pairs_of(K), blocks = blocks_of(N);
    int64_t nan = 0;
    #pragma omp parallel for schedule(static) reduction(+ : nan)
    for (int64_t b = 0; b < blocks; b++) {
        for (int64_t c = 0; c < kBlockCols; c++) {
            const int64_t n = b * kBlockCols + c;
            packed_scale[n] = n < N ? scale[num_scales == 1 ? 0 : n] : 0.0f;
        }
        for (int64_t p = 0; p < P; p++) {
            uint8_t zero_exponent = 0;
            for (int64_t c = 0; c < kBlockCols; c++)
                for (int64_t e = 0; e < 2; e++) {
                    const int64_t n = b * kBlockCols + c, k = 2 * p + e;
                    const uint8_t v = n < N && k < K ? w[n * K + k] : 0;
                    nan += (v & 0x7F) == 0x7F;
                    zero_exponent |= (v & 0x78) == 0;
                    packed[(b * P + p) * kFp8PairBytes + 2 * c + e] = v;
                }
            packed[blocks * P * kFp8PairBytes + b * P + p] = zero_exponent;
        }
    }
    return nan;
}

// spyre_linear_bf16 with FP8 weights (packed by spyre_linear_fp8_pack) and the sums times the
// column scales before the bias: y = bf16(acc * scale[n] + bias[n]), acc as spyre_linear_bf16
// sums the FP8 values (exact in bfloat16). Returns 1, 0, or -1 (no memory for a thread's
// converted block or the AVX2 code's row).
int spyre_linear_fp8(int avx512, const uint16_t* x, const uint8_t* packed, const float* scale,
                     const uint16_t* bias, uint16_t* y, int64_t M, int64_t K, int64_t N) {
    return linear(dot_path(avx512), x, Weights{nullptr, packed, scale}, bias, y, M, K, N);
}

}  // extern "C"
