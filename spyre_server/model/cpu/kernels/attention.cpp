// Paged attention for the cpu backend: the queries of one row group of the paged-attention op
// (paged_attention.py) against their context, read in place from the KV cache through block
// tables, written straight into fms's output layout. Queries, caches and output are float32 or
// bfloat16 (a model in bfloat16); the compute is float32 either way (bfloat16 values are widened
// as they are loaded, the output rounded once at the end).
//
// The two parts (the shared blocks split across threads, each sequence's own blocks causal) and
// their merges are attention_common.h's. Here a tile is 48 keys: its key and value rows are first
// read in order (touch_rows); then per head the keys are transposed into [head_dim][48] (8 x 8
// AVX transposes), scores = q . k^T by the 4 x 24 register block of linear_f32.cpp, then the
// online softmax, then o += p . v with 3 rows x 32 dims in registers; a tile's rows that the
// causal mask (or a sliding window) hides it from are skipped. On CPUs with AVX512F the same steps run 512 bits wide
// where the call allows it, with the same bits (attend_tile512; model.native_avx512).
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "attention_common.h"
#include "avx2_math.h"
#include "bf16_avx2.h"
#include "native_avx512.h"

#define UNROLL _Pragma("GCC unroll 16")

namespace {

using namespace spyre_attention;
using spyre_avx2::hmax;
using spyre_avx2::hsum;

// The element types of queries, caches and output: float, or uint16_t holding bfloat16.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return spyre_bf16::load8(p); }
inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) { return spyre_bf16::widen(x); }

constexpr int64_t kTile = 48;  // keys per tile: two 24-key column blocks
constexpr int64_t kOwnRows = 48;  // rows per task of the own blocks' part

// dst[0..8)[0..8) (row stride ldd, 32-byte aligned) = the transpose of rows[0..8)[d..d+8).
template <typename T>
inline void transpose8(const T* const* rows, int64_t d, float* dst, int64_t ldd) {
    __m256 r[8], t[8], u[8];
    UNROLL for (int i = 0; i < 8; i++) r[i] = load8(rows[i] + d);
    UNROLL for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    UNROLL for (int i = 0; i < 2; i++) {
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    UNROLL for (int i = 0; i < 4; i++) {
        _mm256_store_ps(dst + i * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_store_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}

// s[MB][kTile] = q[MB][D] . kt[D][kTile]
template <int64_t D, int MB>
inline void scores(const float* __restrict q, const float* __restrict kt, float* __restrict s) {
    UNROLL for (int c = 0; c < kTile / 24; c++) {
        __m256 acc[MB][3];
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < 3; j++) acc[i][j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            const float* kr = kt + d * kTile + c * 24;
            const __m256 w0 = _mm256_load_ps(kr), w1 = _mm256_load_ps(kr + 8), w2 = _mm256_load_ps(kr + 16);
            UNROLL for (int i = 0; i < MB; i++) {
                const __m256 x = _mm256_broadcast_ss(q + i * D + d);
                acc[i][0] = _mm256_fmadd_ps(x, w0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(x, w1, acc[i][1]);
                acc[i][2] = _mm256_fmadd_ps(x, w2, acc[i][2]);
            }
        }
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < 3; j++)
            _mm256_store_ps(s + i * kTile + c * 24 + j * 8, acc[i][j]);
    }
}

// o[MB][D] += p[MB][0..nk) . v[0..nk)[D] (value k at vrows[k] + hoff)
template <int64_t D, int MB, typename T>
inline void weighted_values(const float* __restrict p, const T* const* vrows, int64_t hoff,
                            int64_t nk, float* __restrict o) {
    UNROLL for (int64_t h = 0; h < D / 32; h++) {
        __m256 acc[MB][4];
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < 4; j++)
            acc[i][j] = _mm256_load_ps(o + i * D + h * 32 + j * 8);
        for (int64_t k = 0; k < nk; k++) {
            // 12 accumulators + MB broadcasts + one value vector: 16 registers, none spilled.
            const T* vr = vrows[k] + hoff + h * 32;
            __m256 x[MB];
            UNROLL for (int i = 0; i < MB; i++) x[i] = _mm256_broadcast_ss(p + i * kTile + k);
            UNROLL for (int j = 0; j < 4; j++) {
                const __m256 w = load8(vr + j * 8);
                UNROLL for (int i = 0; i < MB; i++) acc[i][j] = _mm256_fmadd_ps(x[i], w, acc[i][j]);
            }
        }
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < 4; j++)
            _mm256_store_ps(o + i * D + h * 32 + j * 8, acc[i][j]);
    }
}

// On CPUs with AVX512F, where the call allows it (its avx512 argument), the products and the
// softmax run 512 bits wide (attend_tile512): the same sums in the same order per output, so the
// same bits as the AVX2 code; with 32 registers the products take 8 and 6 rows per block instead
// of 4 and 3.
#define AVX512 __attribute__((target("avx512f,avx2,fma")))

AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
AVX512 inline __m512 load16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// scores<D, MB> with a row's 48 scores in three 512-bit accumulators.
template <int64_t D, int MB>
AVX512 inline void scores512(const float* __restrict q, const float* __restrict kt, float* __restrict s) {
    static_assert(kTile == 48, "a tile is three 16-key vectors");
    __m512 acc[MB][3];
    UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < 3; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const float* kr = kt + d * kTile;
        const __m512 w0 = _mm512_loadu_ps(kr), w1 = _mm512_loadu_ps(kr + 16), w2 = _mm512_loadu_ps(kr + 32);
        UNROLL for (int i = 0; i < MB; i++) {
            const __m512 x = _mm512_set1_ps(q[i * D + d]);
            acc[i][0] = _mm512_fmadd_ps(x, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(x, w1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(x, w2, acc[i][2]);
        }
    }
    UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < 3; j++)
        _mm512_storeu_ps(s + i * kTile + j * 16, acc[i][j]);
}

// weighted_values<D, MB, T> with 64 of a row's output values in four 512-bit accumulators.
template <int64_t D, int MB, typename T>
AVX512 inline void weighted_values512(const float* __restrict p, const T* const* vrows, int64_t hoff,
                                      int64_t nk, float* __restrict o) {
    UNROLL for (int64_t h = 0; h < D / 64; h++) {
        __m512 acc[MB][4];
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < 4; j++)
            acc[i][j] = _mm512_loadu_ps(o + i * D + h * 64 + j * 16);
        for (int64_t k = 0; k < nk; k++) {
            const T* vr = vrows[k] + hoff + h * 64;
            __m512 x[MB];
            UNROLL for (int i = 0; i < MB; i++) x[i] = _mm512_set1_ps(p[i * kTile + k]);
            UNROLL for (int j = 0; j < 4; j++) {
                const __m512 w = load16(vr + j * 16);
                UNROLL for (int i = 0; i < MB; i++) acc[i][j] = _mm512_fmadd_ps(x[i], w, acc[i][j]);
            }
        }
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < 4; j++)
            _mm512_storeu_ps(o + i * D + h * 64 + j * 16, acc[i][j]);
    }
}

// 2^y for y in [-125, 0] (y clamped into it): Cephes' exp2f polynomial on [-1/2, 1/2], relative
// error under 1e-7; 2^-125 is 0 to float32 precision next to a row's max (1).
inline __m256 exp2_clamped(__m256 y) {
    y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-125.0f)), _mm256_setzero_ps());
    const __m256 n = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(y, n);
    __m256 p = _mm256_set1_ps(1.535336188319500e-4f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.339887440266574e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.618437357674640e-3f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.550332471162809e-2f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.402264791363012e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.931472028550421e-1f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Lanes j..j+7 of a tile that are among its first nk keys, as an all-ones mask per lane.
inline __m256 first_keys(int64_t nk, int64_t j) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nk - j)),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

// Lanes j..j+7 of a tile that are not among its first lo keys, as an all-ones mask per lane.
inline __m256 keys_from(int64_t lo, int64_t j) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                  _mm256_set1_epi32(static_cast<int>(lo - j - 1))));
}

// Folds a row's tile of scores s (those of keys [lo, nk)) into its running max m and sum l, in
// log2 units (scale2: the attention scale times log2(e)), and rescales its o; s becomes the
// tile's probabilities 2^(scale2 * s - m) (0 outside [lo, nk); all 0 and the state untouched for
// nk <= lo, a row the causal mask or its window hides the whole tile from).
template <int64_t D>
inline void softmax_tile(float* s, int64_t lo, int64_t nk, float scale2, float* m, float* l, float* o) {
    if (nk <= lo) {
        for (int64_t j = 0; j < kTile; j++) s[j] = 0.0f;
        return;
    }
    const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
    __m256 vmax = minus_inf;
    for (int64_t j = 0; j < kTile; j += 8) {
        __m256 x = _mm256_load_ps(s + j);
        if (lo > j) x = _mm256_blendv_ps(minus_inf, x, keys_from(lo, j));
        vmax = _mm256_max_ps(vmax, j + 8 > nk ? _mm256_blendv_ps(minus_inf, x, first_keys(nk, j)) : x);
    }
    const float tile_max = hmax(vmax) * scale2;  // scale2 > 0: the scaled scores' max
    const float new_max = tile_max > *m ? tile_max : *m;
    // 0 on the first tile (m = -inf); exactly 1 (exp2f(0)) while the max holds
    const float rescale = new_max == *m ? 1.0f : exp2f(*m - new_max);
    const __m256 vscale = _mm256_set1_ps(scale2), vnew = _mm256_set1_ps(new_max);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t j = 0; j < kTile; j += 8) {
        const __m256 e = exp2_clamped(_mm256_fmsub_ps(_mm256_load_ps(s + j), vscale, vnew));
        __m256 kept = j + 8 > nk ? _mm256_and_ps(e, first_keys(nk, j)) : e;
        if (lo > j) kept = _mm256_and_ps(kept, keys_from(lo, j));
        _mm256_store_ps(s + j, kept);
        vsum = _mm256_add_ps(vsum, kept);
    }
    *l = *l * rescale + hsum(vsum);
    *m = new_max;
    if (rescale != 1.0f) {
        const __m256 vr = _mm256_set1_ps(rescale);
        for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(o + d, _mm256_mul_ps(_mm256_load_ps(o + d), vr));
    }
}

template <int64_t D, typename T>
struct Work {
    // A task's tile buffers: kt [D][kTile], s [rows][kTile], key/value row pointers.
    static int64_t numel(int64_t rows) { return D * kTile + rows * kTile + 4 * kTile; }
    float* kt;
    float* s;
    const T** krows;
    const T** vrows;
    Work(float* base, int64_t rows)
        : kt(base), s(base + D * kTile), krows(reinterpret_cast<const T**>(base + D * kTile + rows * kTile)),
          vrows(krows + kTile) {}
};

// Points w's key and value rows at the context's keys [t0, t0 + nk) of head 0.
template <int64_t D, typename T>
inline void locate_tile(const Context<T>& ctx, int64_t t0, int64_t nk, Work<D, T>& w) {
    ctx.keys(t0, nk, [&](int64_t j, int64_t off) {
        w.krows[j] = ctx.k + off;
        w.vrows[j] = ctx.v + off;
    });
}

// w.kt [D][kTile] = the tile's keys of head h (zeros past nk).
template <int64_t D, typename T>
inline void transpose_keys(int64_t h, int64_t nk, Work<D, T>& w) {
    const int64_t hoff = h * D;
    const int64_t full = nk / 8 * 8;
    for (int64_t j = 0; j < full; j += 8)
        for (int64_t d = 0; d < D; d += 8) transpose8(w.krows + j, hoff + d, w.kt + d * kTile + j, kTile);
    for (int64_t j = full; j < kTile; j++)
        for (int64_t d = 0; d < D; d++) w.kt[d * kTile + j] = j < nk ? to_float(w.krows[j][hoff + d]) : 0.0f;
}

// exp2_clamped on 16 lanes: the same operations, so the same bits per lane.
AVX512 inline __m512 exp2_clamped512(__m512 y) {
    y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-125.0f)), _mm512_setzero_ps());
    const __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// softmax_tile on 16 lanes, the same bits: the sum of the probabilities is taken 8 lanes wide
// in softmax_tile's order (key blocks of 8 in turn, then hsum).
template <int64_t D>
AVX512 inline void softmax_tile512(float* s, int64_t lo, int64_t nk, float scale2, float* m, float* l,
                                   float* o) {
    if (nk <= lo) {
        for (int64_t j = 0; j < kTile; j++) s[j] = 0.0f;
        return;
    }
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    __m512 x[3];
    __mmask16 valid[3];
    __m512 vmax = minus_inf;
    UNROLL for (int j = 0; j < 3; j++) {
        const int64_t left = nk - 16 * j, skipped = lo - 16 * j;
        valid[j] = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
        if (skipped > 0) valid[j] &= skipped >= 16 ? __mmask16(0) : __mmask16(~((1u << skipped) - 1));
        x[j] = _mm512_mask_mov_ps(minus_inf, valid[j], _mm512_loadu_ps(s + 16 * j));
        vmax = _mm512_max_ps(vmax, x[j]);
    }
    const float tile_max = _mm512_reduce_max_ps(vmax) * scale2;  // scale2 > 0
    const float new_max = tile_max > *m ? tile_max : *m;
    // 0 on the first tile (m = -inf); exactly 1 (exp2f(0)) while the max holds
    const float rescale = new_max == *m ? 1.0f : exp2f(*m - new_max);
    const __m512 vscale = _mm512_set1_ps(scale2), vnew = _mm512_set1_ps(new_max);
    __m256 vsum = _mm256_setzero_ps();
    UNROLL for (int j = 0; j < 3; j++) {
        const __m512 y = _mm512_fmsub_ps(x[j], vscale, vnew);
        const __m512 e = _mm512_maskz_mov_ps(valid[j], exp2_clamped512(y));
        _mm512_storeu_ps(s + 16 * j, e);
        vsum = _mm256_add_ps(vsum, _mm512_castps512_ps256(e));
        vsum = _mm256_add_ps(vsum, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    *l = *l * rescale + hsum(vsum);
    *m = new_max;
    if (rescale != 1.0f) {
        const __m512 vr = _mm512_set1_ps(rescale);
        for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), vr));
    }
}

// attend_tile 512 bits wide (see scores512).
template <int64_t D, typename T>
AVX512 void attend_tile512(const float* q, int64_t R, int64_t h, int64_t t0, int64_t nk,
                           const int64_t* firsts, const int64_t* limits, float scale2, float* o,
                           float* m, float* l, Work<D, T>& w) {
    transpose_keys<D, T>(h, nk, w);
    int64_t r = 0;
    for (; r + 8 <= R; r += 8) scores512<D, 8>(q + r * D, w.kt, w.s + r * kTile);
    if (r + 4 <= R) { scores512<D, 4>(q + r * D, w.kt, w.s + r * kTile); r += 4; }
    switch (R - r) {
        case 3: scores512<D, 3>(q + r * D, w.kt, w.s + r * kTile); break;
        case 2: scores512<D, 2>(q + r * D, w.kt, w.s + r * kTile); break;
        case 1: scores512<D, 1>(q + r * D, w.kt, w.s + r * kTile); break;
        default: break;
    }
    for (int64_t i = 0; i < R; i++) {
        const int64_t row_nk = limits == nullptr ? nk : (limits[i] - t0 < nk ? limits[i] - t0 : nk);
        const int64_t row_lo = firsts == nullptr || firsts[i] < t0 ? 0 : firsts[i] - t0;
        softmax_tile512<D>(w.s + i * kTile, row_lo, row_nk, scale2, m + i, l + i, o + i * D);
    }
    const int64_t hoff = h * D;
    r = 0;
    for (; r + 6 <= R; r += 6) weighted_values512<D, 6, T>(w.s + r * kTile, w.vrows, hoff, nk, o + r * D);
    if (r + 3 <= R) { weighted_values512<D, 3, T>(w.s + r * kTile, w.vrows, hoff, nk, o + r * D); r += 3; }
    switch (R - r) {
        case 2: weighted_values512<D, 2, T>(w.s + r * kTile, w.vrows, hoff, nk, o + r * D); break;
        case 1: weighted_values512<D, 1, T>(w.s + r * kTile, w.vrows, hoff, nk, o + r * D); break;
        default: break;
    }
}

// Rows [0, R) of head h (q: [R][D]) against the tile of nk keys (nk <= kTile) locate_tile put
// in w; row i sees only the keys of the tile from firsts[i] - t0 and before limits[i] - t0
// (firsts nullptr: from the first; limits nullptr: up to the last). The rows' online-softmax
// states are o [R][D], m [R], l [R]. wide: 512 bits wide.
template <int64_t D, typename T>
void attend_tile(bool wide, const float* q, int64_t R, int64_t h, int64_t t0, int64_t nk,
                 const int64_t* firsts, const int64_t* limits, float scale2, float* o, float* m,
                 float* l, Work<D, T>& w) {
    if (wide) return attend_tile512<D, T>(q, R, h, t0, nk, firsts, limits, scale2, o, m, l, w);
    transpose_keys<D, T>(h, nk, w);
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) scores<D, 4>(q + r * D, w.kt, w.s + r * kTile);
    switch (R - r) {
        case 3: scores<D, 3>(q + r * D, w.kt, w.s + r * kTile); break;
        case 2: scores<D, 2>(q + r * D, w.kt, w.s + r * kTile); break;
        case 1: scores<D, 1>(q + r * D, w.kt, w.s + r * kTile); break;
        default: break;
    }
    for (int64_t i = 0; i < R; i++) {
        const int64_t row_nk = limits == nullptr ? nk : (limits[i] - t0 < nk ? limits[i] - t0 : nk);
        const int64_t row_lo = firsts == nullptr || firsts[i] < t0 ? 0 : firsts[i] - t0;
        softmax_tile<D>(w.s + i * kTile, row_lo, row_nk, scale2, m + i, l + i, o + i * D);
    }
    const int64_t hoff = h * D;
    r = 0;
    for (; r + 3 <= R; r += 3) weighted_values<D, 3, T>(w.s + r * kTile, w.vrows, hoff, nk, o + r * D);
    switch (R - r) {
        case 2: weighted_values<D, 2, T>(w.s + r * kTile, w.vrows, hoff, nk, o + r * D); break;
        case 1: weighted_values<D, 1, T>(w.s + r * kTile, w.vrows, hoff, nk, o + r * D); break;
        default: break;
    }
}

template <int64_t D>
struct Layout {
    // Floats of scratch, in order: own_part's task plan (OwnTasks); qs [H][R][D]; shared out
    // [H][Rp][D] and lse [H][Rp]; per (head, split) the shared part's results (States of Rp
    // rows); per thread: a shared Work of R rows, or an own task's Work and results of kOwnRows
    // rows for each of up to kOwnHeads heads.
    int64_t H, R, threads;
    int64_t Rp() const { return round16(R); }
    static int64_t own_offset() { return Work<D, float>::numel(kOwnRows); }
    int64_t thread_work() const {
        const int64_t own_heads = H < kOwnHeads ? H : kOwnHeads;
        const int64_t own = own_offset() + own_heads * States<D, 1>::numel(kOwnRows);
        const int64_t shared = Work<D, float>::numel(R);
        return own > shared ? own : shared;
    }
    int64_t numel() const {
        return OwnTasks::numel(R) + H * R * D + H * Rp() * D + H * Rp() +
               H * threads * States<D, 1>::numel(Rp()) + threads * thread_work();
    }
};

template <int64_t D, typename T>
void paged_attention(bool wide, const Args<T>& a) {
    const Layout<D> lay{a.H, a.R(), a.threads};
    const int64_t R = lay.R, Rp = lay.Rp(), H = a.H, splits = a.threads;
    const float scale2 = a.scale2();
    float* qs = a.scratch + OwnTasks::numel(R);
    float* shared_out = qs + H * R * D;
    float* shared_lse = shared_out + H * Rp * D;
    float* states = shared_lse + H * Rp;
    float* works = states + H * splits * States<D, 1>::numel(Rp);
    gather_queries<D>(a, qs, R, [](T x) { return to_float(x); });
    const auto sum = [](const float* l) { return *l; };
    if (a.num_shared > 0) {
        const Context<T> ctx{a.k_cache, a.v_cache, a.shared_blocks, a.bs, H * D};
        const States<D, 1> st{states, Rp};
        const auto tile = [&](int64_t sp, int64_t t0, int64_t nk) {
            Work<D, T> w(works + sp * lay.thread_work(), R);
            locate_tile<D, T>(ctx, t0, nk, w);
            touch_rows(ctx, t0, nk, 0, ctx.ldk);  // every head's: the rows are contiguous
            for (int64_t h = 0; h < H; h++) {
                const int64_t slot = h * splits + sp;
                attend_tile<D, T>(wide, qs + h * R * D, R, h, t0, nk, nullptr, nullptr, scale2,
                                  st.o(slot), st.m(slot), st.l(slot), w);
            }
        };
        split_merge<NoUnit, kTile>(H, R, a.shared_len(), splits, st, tile, sum, shared_out,
                                   shared_lse);
    }
    const auto own_tile = [&](const OwnTask<D, 1, T>& t, int64_t t0, int64_t nk) {
        int64_t first = 0;  // rows the causal mask hides the whole tile from come first,
        while (t.limits[first] <= t0) first++;
        int64_t end = t.rows;  // those whose window starts after it last
        while (end > first && t.firsts[end - 1] >= t0 + nk) end--;
        Work<D, T> w(t.scratch, kOwnRows);
        locate_tile<D, T>(t.ctx, t0, nk, w);
        const float* q = qs + (t.h * R + t.b * a.Rb() + t.r0 + first) * D;
        attend_tile<D, T>(wide, q, end - first, t.h, t0, nk, t.firsts + first, t.limits + first,
                          scale2, t.st.o(0) + first * D, t.st.m(0) + first, t.st.l(0) + first, w);
    };
    own_part<NoUnit, kTile, kOwnRows, D, 1>(a, works, lay.thread_work(), lay.own_offset(),
                                           shared_out, shared_lse, Rp, own_tile, sum);
}

template <typename T>
int dispatch(int avx512, int64_t head_dim, const Args<T>& a) {
    return with_head_dim(head_dim, 1, [&](auto d) {
        paged_attention<decltype(d)::value, T>(spyre_avx512_wide(avx512), a);
        return 0;
    });
}

}  // namespace

extern "C" {

// Floats of scratch spyre_paged_attention_f32 needs (any alignment of torch's allocator: 64).
int64_t spyre_paged_attention_f32_scratch_numel(int64_t head_dim, int64_t H, int64_t rows,
                                                int64_t threads) {
    return with_head_dim(head_dim, int64_t{-1}, [&](auto d) {
        return Layout<decltype(d)::value>{H, rows, threads}.numel();
    });
}

// Attention of one row group of the paged-attention op, reading the cache in place.
// q, out: [n][nq][H * G][head_dim] (n sequences of nq queries; G query heads per KV head);
// k_cache, v_cache: [num_blocks][bs][H][head_dim]; positions: [n][nq], ascending per sequence;
// window: 0, or a sliding window of that many keys (a query at position p sees the keys at
// p - window + 1 .. p; without one, 0 .. p). shared_blocks: [num_shared] blocks wholly before
// and inside the window of every query, attended fully (without a window the keys 0 ..
// num_shared * bs). own_blocks: [n][num_own] each sequence's other blocks in position order,
// from the block of the first key its first query sees (without a window, block 0) to the
// block of its last query, the shared ones left out, seen under the mask (padding blocks
// beyond are never read). `threads` OpenMP threads (the shared keys split in that many
// ranges); rows = n * nq * G for the scratch. avx512 nonzero: the products and the softmax run
// 512 bits wide where the CPU has AVX512F (the same bits). head_dim 64 or 128 (else returns 1
// and writes nothing); returns 0.
int spyre_paged_attention_f32(int avx512, int64_t head_dim, const float* q, const float* k_cache,
                              const float* v_cache, int64_t bs, int64_t H, int64_t G, int64_t n,
                              int64_t nq, const int64_t* shared_blocks, int64_t num_shared,
                              const int64_t* own_blocks, int64_t num_own, const int64_t* positions,
                              int64_t window, float scale, int64_t threads, float* scratch,
                              float* out) {
    const Args<float> a{q, k_cache, v_cache, bs, H, G, n, nq, shared_blocks, num_shared,
                        own_blocks, num_own, positions, window, scale, threads, scratch, out};
    return dispatch(avx512, head_dim, a);
}

// spyre_paged_attention_f32 with bfloat16 queries, caches and output (the same scratch).
int spyre_paged_attention_bf16(int avx512, int64_t head_dim, const uint16_t* q,
                               const uint16_t* k_cache, const uint16_t* v_cache, int64_t bs,
                               int64_t H, int64_t G, int64_t n, int64_t nq,
                               const int64_t* shared_blocks, int64_t num_shared,
                               const int64_t* own_blocks, int64_t num_own, const int64_t* positions,
                               int64_t window, float scale, int64_t threads, float* scratch,
                               uint16_t* out) {
    const Args<uint16_t> a{q, k_cache, v_cache, bs, H, G, n, nq, shared_blocks, num_shared,
                           own_blocks, num_own, positions, window, scale, threads, scratch, out};
    return dispatch(avx512, head_dim, a);
}

}  // extern "C"
