// float32 linear layer y = x @ w^T for the cpu backend, with the weight packed once into panels.
//
// Panel layout: output columns in panels of 8; panel b holds w[8b .. 8b+7][0 .. K-1] transposed,
// K rows of 8 floats (32 bytes, one AVX register), contiguous. A last partial panel is padded
// with zero columns. The micro-kernel keeps a 4 x 24 block of y (4 rows, 3 panels) in 12
// registers and, for each k, loads 3 panel rows and broadcasts 4 x values: every weight byte is
// read once per 4 rows of x, in a sequential stream the hardware prefetcher follows.
//
// From 16 rows on (prefill), x's 4-row blocks are first packed k-major, so the 4 broadcasts of a
// k step read one stream instead of 4 rows K apart; the sums run in the same order either way. A
// decode step's 5-15 rows go over the panels in chunks of k, every row block per chunk
// (decode_rows).
//
// On CPUs with AVX512F, from 5 rows on, two panels share a 512-bit register (linear512): the
// same sums in the same order, so the same bits, at twice the width. Each call says whether it
// may (its avx512 argument: model.native_avx512).
//
// Threads: an OpenMP loop over blocks of 3 panels (6 on AVX512F), in the OpenMP runtime torch
// already loaded (libgomp.so.1 by soname), so this runs on torch's own thread pool and thread
// count.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "native_avx512.h"

#define UNROLL _Pragma("GCC unroll 16")

extern const bool spyre_cpu_avx512f = (__builtin_cpu_init(), __builtin_cpu_supports("avx512f"));

namespace {

constexpr int64_t kPanel = 8;     // output columns per panel
constexpr int kPanelsPerBlock = 3;
constexpr int kRowsPerBlock = 4;

// y[0..MB)[0..NB*8) = x[0..MB)[0..K) . panels[0..NB) (+ y's own values with kAdd: the sum
// rounded once more, the same bits as a separate add); the last panel stores only last_cols.
// x[i][k] at x + i * K + k (rows as given), or with kPackedX at x + k * 4 + i (a packed 4-row
// block; the stride a compile-time constant, faster than a runtime one). The sum runs over the
// first kc of the panels' K rows (kc = K: all of them); a sum over k in chunks carries partial
// sums [MB][NB * 8] from chunk to chunk: kResume starts from them instead of 0, kSuspend stores
// them instead of writing y; stored and loaded exactly, so the bits equal one pass.
template <int MB, int NB, bool kAdd, bool kPackedX = false, bool kResume = false,
          bool kSuspend = false>
inline void block(const float* __restrict x, int64_t K, int64_t kc,
                  const float* __restrict panels, float* __restrict y, int64_t ldy,
                  int64_t last_cols, float* __restrict partial = nullptr) {
    __m256 acc[MB][NB];
    UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < NB; j++)
        acc[i][j] = kResume ? _mm256_load_ps(partial + (i * NB + j) * kPanel) : _mm256_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        __m256 w[NB];
        UNROLL for (int j = 0; j < NB; j++) w[j] = _mm256_load_ps(panels + (j * K + k) * kPanel);
        UNROLL for (int i = 0; i < MB; i++) {
            const __m256 xv = _mm256_broadcast_ss(kPackedX ? x + k * kRowsPerBlock + i : x + i * K + k);
            UNROLL for (int j = 0; j < NB; j++) acc[i][j] = _mm256_fmadd_ps(xv, w[j], acc[i][j]);
        }
    }
    if (kSuspend) {
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < NB; j++)
            _mm256_store_ps(partial + (i * NB + j) * kPanel, acc[i][j]);
        return;
    }
    UNROLL for (int i = 0; i < MB; i++) {
        UNROLL for (int j = 0; j < NB - 1; j++) {
            float* out = y + i * ldy + j * kPanel;
            _mm256_storeu_ps(out, kAdd ? _mm256_add_ps(acc[i][j], _mm256_loadu_ps(out)) : acc[i][j]);
        }
        float* last = y + i * ldy + (NB - 1) * kPanel;
        if (last_cols == kPanel) {
            _mm256_storeu_ps(last, kAdd ? _mm256_add_ps(acc[i][NB - 1], _mm256_loadu_ps(last))
                                        : acc[i][NB - 1]);
        } else {
            alignas(32) float tmp[kPanel];
            _mm256_store_ps(tmp, acc[i][NB - 1]);
            for (int64_t c = 0; c < last_cols; c++) last[c] = kAdd ? tmp[c] + last[c] : tmp[c];
        }
    }
}

constexpr int64_t kPackRows = 16;  // from this many rows on, x's row blocks are packed
constexpr int64_t kDecodeChunk = 64;  // k values per pass over a decode step's row blocks

// MB rows' chunk [k0, k0 + kc) of the sums (rows as given).
template <int MB, int NB, bool kAdd>
inline void chunk(const float* x, int64_t K, const float* panels, float* y, int64_t N,
                  int64_t last_cols, int64_t k0, int64_t kc, float* partial) {
    const bool resume = k0 > 0, suspend = k0 + kc < K;
    x += k0;
    panels += k0 * kPanel;
    if (!resume && suspend)
        block<MB, NB, kAdd, false, false, true>(x, K, kc, panels, y, N, last_cols, partial);
    else if (resume && suspend)
        block<MB, NB, kAdd, false, true, true>(x, K, kc, panels, y, N, last_cols, partial);
    else if (resume)
        block<MB, NB, kAdd, false, true, false>(x, K, kc, panels, y, N, last_cols, partial);
    else
        block<MB, NB, kAdd>(x, K, kc, panels, y, N, last_cols);
}

// A decode step's rows (5 to kPackRows - 1): all row blocks' sums over one chunk of k before the
// next chunk, so the panels are read from memory once, in order, and the other row blocks find
// each chunk in L1 (a pass per row block over all of K would read them again from L2, with the
// prefetcher idle meanwhile).
template <int NB, bool kAdd>
inline void decode_rows(const float* x, const float* panels, float* y, int64_t M, int64_t K,
                        int64_t N, int64_t last_cols) {
    alignas(32) float partial[kPackRows / kRowsPerBlock][kRowsPerBlock * NB * kPanel];
    for (int64_t k0 = 0; k0 < K; k0 += kDecodeChunk) {
        const int64_t kc = K - k0 < kDecodeChunk ? K - k0 : kDecodeChunk;
        int64_t m = 0;
        for (; m + kRowsPerBlock <= M; m += kRowsPerBlock)
            chunk<kRowsPerBlock, NB, kAdd>(x + m * K, K, panels, y + m * N, N, last_cols, k0, kc,
                                           partial[m / kRowsPerBlock]);
        float* rest = partial[m / kRowsPerBlock];
        switch (M - m) {
            case 3: chunk<3, NB, kAdd>(x + m * K, K, panels, y + m * N, N, last_cols, k0, kc, rest); break;
            case 2: chunk<2, NB, kAdd>(x + m * K, K, panels, y + m * N, N, last_cols, k0, kc, rest); break;
            case 1: chunk<1, NB, kAdd>(x + m * K, K, panels, y + m * N, N, last_cols, k0, kc, rest); break;
            default: break;
        }
    }
}

// xp: nullptr, or x's full 4-row blocks packed k-major ([M / 4][K][4]).
template <int NB, bool kAdd>
inline void column_block(const float* x, const float* xp, const float* panels, float* y,
                         int64_t M, int64_t K, int64_t N, int64_t last_cols) {
    if (xp == nullptr && M > kRowsPerBlock)
        return decode_rows<NB, kAdd>(x, panels, y, M, K, N, last_cols);
    int64_t m = 0;
    for (; m + kRowsPerBlock <= M; m += kRowsPerBlock) {
        if (xp != nullptr)
            block<kRowsPerBlock, NB, kAdd, true>(xp + m * K, K, K, panels, y + m * N, N, last_cols);
        else
            block<kRowsPerBlock, NB, kAdd>(x + m * K, K, K, panels, y + m * N, N, last_cols);
    }
    switch (M - m) {
        case 3: block<3, NB, kAdd>(x + m * K, K, K, panels, y + m * N, N, last_cols); break;
        case 2: block<2, NB, kAdd>(x + m * K, K, K, panels, y + m * N, N, last_cols); break;
        case 1: block<1, NB, kAdd>(x + m * K, K, K, panels, y + m * N, N, last_cols); break;
        default: break;
    }
}

// x's full 4-row blocks, k-major ([M / 4][K][4]), in the calling thread's buffer (kept and
// grown; a decode step's few rows are not packed).
inline const float* pack_rows(const float* x, int64_t M, int64_t K) {
    thread_local float* buffer = nullptr;
    thread_local int64_t capacity = 0;
    const int64_t blocks = M / kRowsPerBlock, need = blocks * kRowsPerBlock * K;
    if (need > capacity) {
        free(buffer);
        buffer = static_cast<float*>(aligned_alloc(64, (need * 4 + 63) / 64 * 64));
        capacity = buffer == nullptr ? 0 : need;
        if (buffer == nullptr) return nullptr;  // no memory: the rows are read as given
    }
    float* out = buffer;  // (thread_local: the workers below must not read their own)
    #pragma omp parallel for schedule(static) if (need >= (1 << 16))
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t i = 0; i < kRowsPerBlock; i++)
                out[(b * K + k) * kRowsPerBlock + i] = x[(b * kRowsPerBlock + i) * K + k];
    return out;
}

// On CPUs with AVX512F more than 4 rows run 512 bits wide: each vector holds two panels' 8
// columns at one k (the low and the high half), against 8 rows (two packed 4-row blocks, or a
// decode step's rows as given, per chunk of k) x NZ panel pairs of accumulators (24 of the 32
// registers at NZ 3). Every output is the same k-ordered FMA chain as block()'s, so the bits
// equal the AVX2 path's, and a row's bits do not depend on the batch.
#define AVX512 __attribute__((target("avx512f,avx2,fma")))

AVX512 inline __m512 panel_pair(const float* lo, const float* hi) {
    const __m512d low = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_load_ps(lo)));
    return _mm512_castpd_ps(_mm512_insertf64x4(low, _mm256_castps_pd(_mm256_load_ps(hi)), 1));
}

// y[0..MB)[0..NZ*16) over full panels, block()'s contract 512 bits wide: x rows as given
// (x + i * K + k), or with kPackedX MB / 4 packed 4-row blocks K * 4 floats apart; the sum over
// the first kc of K, resumed from / suspended to partial sums [MB][NZ][16].
template <int MB, int NZ, bool kAdd, bool kPackedX = false, bool kResume = false,
          bool kSuspend = false>
AVX512 inline void block512(const float* __restrict x, int64_t K, int64_t kc,
                            const float* __restrict panels, float* __restrict y, int64_t ldy,
                            float* __restrict partial = nullptr) {
    __m512 acc[MB][NZ];
    UNROLL for (int i = 0; i < MB; i++) UNROLL for (int z = 0; z < NZ; z++)
        acc[i][z] = kResume ? _mm512_load_ps(partial + (i * NZ + z) * 2 * kPanel) : _mm512_setzero_ps();
    for (int64_t k = 0; k < kc; k++) {
        __m512 w[NZ];
        UNROLL for (int z = 0; z < NZ; z++)
            w[z] = panel_pair(panels + (2 * z * K + k) * kPanel, panels + ((2 * z + 1) * K + k) * kPanel);
        UNROLL for (int i = 0; i < MB; i++) {
            const float* xi = kPackedX ? x + (i / kRowsPerBlock) * K * kRowsPerBlock + k * kRowsPerBlock + i % kRowsPerBlock
                                       : x + i * K + k;
            const __m512 xv = _mm512_set1_ps(*xi);
            UNROLL for (int z = 0; z < NZ; z++) acc[i][z] = _mm512_fmadd_ps(xv, w[z], acc[i][z]);
        }
    }
    UNROLL for (int i = 0; i < MB; i++) UNROLL for (int z = 0; z < NZ; z++) {
        if (kSuspend) {
            _mm512_store_ps(partial + (i * NZ + z) * 2 * kPanel, acc[i][z]);
            continue;
        }
        float* out = y + i * ldy + 2 * z * kPanel;
        _mm512_storeu_ps(out, kAdd ? _mm512_add_ps(acc[i][z], _mm512_loadu_ps(out)) : acc[i][z]);
    }
}

// MB rows' chunk [k0, k0 + kc) of the sums (rows as given), as chunk() for block512.
template <int MB, int NZ, bool kAdd>
AVX512 inline void chunk512(const float* x, int64_t K, const float* panels, float* y, int64_t N,
                            int64_t k0, int64_t kc, float* partial) {
    const bool resume = k0 > 0, suspend = k0 + kc < K;
    x += k0;
    panels += k0 * kPanel;
    if (!resume && suspend)
        block512<MB, NZ, kAdd, false, false, true>(x, K, kc, panels, y, N, partial);
    else if (resume && suspend)
        block512<MB, NZ, kAdd, false, true, true>(x, K, kc, panels, y, N, partial);
    else if (resume)
        block512<MB, NZ, kAdd, false, true, false>(x, K, kc, panels, y, N, partial);
    else
        block512<MB, NZ, kAdd>(x, K, kc, panels, y, N);
}

// decode_rows() 512 bits wide: a decode step's 5-15 rows in blocks of 8 (and the rest), every
// block per chunk of k.
template <int NZ, bool kAdd>
AVX512 inline void decode_rows512(const float* x, const float* panels, float* y, int64_t M,
                                  int64_t K, int64_t N) {
    alignas(64) float partial[2][8 * NZ * 2 * kPanel];
    for (int64_t k0 = 0; k0 < K; k0 += kDecodeChunk) {
        const int64_t kc = K - k0 < kDecodeChunk ? K - k0 : kDecodeChunk;
        for (int64_t m = 0; m < M; m += 8) {
            const float* xm = x + m * K;
            float* ym = y + m * N;
            float* pm = partial[m / 8];
            switch (M - m < 8 ? M - m : 8) {
                case 8: chunk512<8, NZ, kAdd>(xm, K, panels, ym, N, k0, kc, pm); break;
                case 7: chunk512<7, NZ, kAdd>(xm, K, panels, ym, N, k0, kc, pm); break;
                case 6: chunk512<6, NZ, kAdd>(xm, K, panels, ym, N, k0, kc, pm); break;
                case 5: chunk512<5, NZ, kAdd>(xm, K, panels, ym, N, k0, kc, pm); break;
                case 4: chunk512<4, NZ, kAdd>(xm, K, panels, ym, N, k0, kc, pm); break;
                case 3: chunk512<3, NZ, kAdd>(xm, K, panels, ym, N, k0, kc, pm); break;
                case 2: chunk512<2, NZ, kAdd>(xm, K, panels, ym, N, k0, kc, pm); break;
                default: chunk512<1, NZ, kAdd>(xm, K, panels, ym, N, k0, kc, pm); break;
            }
        }
    }
}

// All M rows against NZ full panel pairs: the packed 4-row blocks two at a time, then the odd
// block; the last M % 4 rows (not packed) on the AVX2 block.
template <int NZ, bool kAdd>
AVX512 inline void pair_block(const float* x, const float* xp, const float* panels, float* y,
                              int64_t M, int64_t K, int64_t N) {
    if (xp == nullptr) return decode_rows512<NZ, kAdd>(x, panels, y, M, K, N);
    const int64_t packed = M / kRowsPerBlock * kRowsPerBlock;
    int64_t m = 0;
    for (; m + 2 * kRowsPerBlock <= packed; m += 2 * kRowsPerBlock)
        block512<2 * kRowsPerBlock, NZ, kAdd, true>(xp + m * K, K, K, panels, y + m * N, N);
    if (m < packed) {
        block512<kRowsPerBlock, NZ, kAdd, true>(xp + m * K, K, K, panels, y + m * N, N);
        m += kRowsPerBlock;
    }
    switch (M - m) {
        case 3: block<3, 2 * NZ, kAdd>(x + m * K, K, K, panels, y + m * N, N, kPanel); break;
        case 2: block<2, 2 * NZ, kAdd>(x + m * K, K, K, panels, y + m * N, N, kPanel); break;
        case 1: block<1, 2 * NZ, kAdd>(x + m * K, K, K, panels, y + m * N, N, kPanel); break;
        default: break;
    }
}

constexpr int64_t kPanelsPerBlock512 = 6;  // 3 pairs

// linear() on AVX512F for more than 4 rows (xp: the packed rows from kPackRows on, else
// nullptr: a decode step's rows): blocks of 6 panels; in each, the full pairs of full panels
// 512 bits wide, the rest (an odd panel, a partial last one) on AVX2.
template <bool kAdd>
AVX512 void linear512(const float* x, const float* xp, const float* panels, float* y, int64_t M,
                      int64_t K, int64_t N) {
    const int64_t num_panels = (N + kPanel - 1) / kPanel;
    const int64_t num_blocks = (num_panels + kPanelsPerBlock512 - 1) / kPanelsPerBlock512;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t first = b * kPanelsPerBlock512;
        const int64_t count = num_panels - first < kPanelsPerBlock512 ? num_panels - first : kPanelsPerBlock512;
        const bool partial_last = first + count == num_panels && N % kPanel != 0;
        const int64_t pairs = (count - (partial_last ? 1 : 0)) / 2;
        const float* p = panels + first * K * kPanel;
        float* yb = y + first * kPanel;
        switch (pairs) {
            case 3: pair_block<3, kAdd>(x, xp, p, yb, M, K, N); break;
            case 2: pair_block<2, kAdd>(x, xp, p, yb, M, K, N); break;
            case 1: pair_block<1, kAdd>(x, xp, p, yb, M, K, N); break;
            default: break;
        }
        const int64_t rest = count - 2 * pairs;  // 0, 1 or 2 panels
        if (rest == 0) continue;
        const int64_t rest_first = first + 2 * pairs;
        const int64_t last_cols = N - (num_panels - 1) * kPanel;
        const int64_t rest_last_cols = rest_first + rest == num_panels ? last_cols : kPanel;
        const float* rp = panels + rest_first * K * kPanel;
        float* ry = y + rest_first * kPanel;
        if (rest == 2)
            column_block<2, kAdd>(x, xp, rp, ry, M, K, N, rest_last_cols);
        else
            column_block<1, kAdd>(x, xp, rp, ry, M, K, N, rest_last_cols);
    }
}

// Returns 1 where (some of) the rows ran 512 bits wide, else 0.
template <bool kAdd>
int linear(bool wide, const float* x, const float* panels, float* y, int64_t M, int64_t K, int64_t N) {
    const int64_t num_panels = (N + kPanel - 1) / kPanel;
    const int64_t num_blocks = (num_panels + kPanelsPerBlock - 1) / kPanelsPerBlock;
    const float* xp = M >= kPackRows ? pack_rows(x, M, K) : nullptr;
    if (M >= kPackRows && xp == nullptr) {
        // No memory for the packed rows: slices of a decode step's size (whose partial sums
        // have room for kPackRows - 1 rows), the same bits.
        int ran512 = 0;
        for (int64_t m = 0; m < M; m += kPackRows - 1)
            ran512 |= linear<kAdd>(wide, x + m * K, panels, y + m * N,
                                   M - m < kPackRows - 1 ? M - m : kPackRows - 1, K, N);
        return ran512;
    }
    if (M > kRowsPerBlock && wide) {
        linear512<kAdd>(x, xp, panels, y, M, K, N);
        return 1;
    }
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t first = b * kPanelsPerBlock;
        const int64_t count = num_panels - first < kPanelsPerBlock ? num_panels - first : kPanelsPerBlock;
        const int64_t last_cols = N - (first + count - 1) * kPanel < kPanel
                                      ? N - (first + count - 1) * kPanel : kPanel;
        const float* p = panels + first * K * kPanel;
        float* yb = y + first * kPanel;
        switch (count) {
            case 3: column_block<3, kAdd>(x, xp, p, yb, M, K, N, last_cols); break;
            case 2: column_block<2, kAdd>(x, xp, p, yb, M, K, N, last_cols); break;
            default: column_block<1, kAdd>(x, xp, p, yb, M, K, N, last_cols); break;
        }
    }
    return 0;
}

}  // namespace

extern "C" {

// 1 where the kernels taking an avx512 argument run 512 bits wide when it is nonzero (the CPU
// has AVX512F), else 0.
int spyre_native_avx512_supported() { return spyre_avx512_wide(1) ? 1 : 0; }

int64_t spyre_linear_f32_packed_numel(int64_t N, int64_t K) {
    return (N + kPanel - 1) / kPanel * kPanel * K;
}

// w: [N][K] row-major; panels: spyre_linear_f32_packed_numel(N, K) floats, 32-byte aligned.
void spyre_linear_f32_pack(const float* w, float* panels, int64_t N, int64_t K) {
    const int64_t num_panels = (N + kPanel - 1) / kPanel;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < num_panels; b++)
        for (int64_t k = 0; k < K; k++)
            for (int64_t c = 0; c < kPanel; c++) {
                const int64_t n = b * kPanel + c;
                panels[(b * K + k) * kPanel + c] = n < N ? w[n * K + k] : 0.0f;
            }
}

// x: [M][K] row-major; y: [M][N] row-major (written, not accumulated). avx512 nonzero: more
// than 4 rows run 512 bits wide where the CPU has AVX512F (the same bits); returns 1 where they
// did, else 0.
int spyre_linear_f32(int avx512, const float* x, const float* panels, float* y, int64_t M,
                     int64_t K, int64_t N) {
    return linear<false>(spyre_avx512_wide(avx512), x, panels, y, M, K, N);
}

// y [M][N] += x [M][K] @ w^T: each sum as spyre_linear_f32 computes it, then added to y's value
// (a residual connection in place, bit for bit as the separate add).
int spyre_linear_add_f32(int avx512, const float* x, const float* panels, float* y, int64_t M,
                         int64_t K, int64_t N) {
    return linear<true>(spyre_avx512_wide(avx512), x, panels, y, M, K, N);
}

}  // extern "C"
