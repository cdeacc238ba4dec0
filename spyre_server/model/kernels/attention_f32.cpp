// float32 attention of R query rows per KV head over L keys read in place from the KV cache, with
// no mask (the paged-attention op's shared blocks: keys wholly before every query), returning
// each row's output and log-sum-exp like SDPA's flash kernel.
//
// Work split: the keys in `splits` contiguous ranges, one task per range covering every KV head
// (the cache interleaves the heads, so a task reads its range's memory once, in order); each
// task keeps an online softmax (running max m, sum l, unnormalized output o) per row and head;
// the ranges are merged at the end. Per tile of 48 keys and head: the keys are transposed into
// [head_dim][48] (8 x 8 AVX transposes), scores = q . k^T by the 4 x 24 register block of
// linear_f32.cpp, then exp, then o += p . v with 3 rows x 32 dims in registers.
//
// SDPA's flash kernel splits the work by query blocks and heads only: a decode step with 3 KV
// heads is 3 tasks for 2 threads, with the keys read per head.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define UNROLL _Pragma("GCC unroll 16")

namespace {

constexpr int64_t kTile = 48;  // keys per tile: two 24-key column blocks

inline int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

// exp(x) for x <= 0 (Cephes' expf polynomial on the reduced argument; below -87 it is 0 to
// float32 precision). Relative error ~1e-7.
inline __m256 exp_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float hmax(__m256 v) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_max_ss(a, _mm_shuffle_ps(a, a, 1)));
}

inline float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
}

// dst[0..8)[0..8) (row stride ldd, 32-byte aligned) = the transpose of src's 8 x 8 (stride lds).
inline void transpose8(const float* src, int64_t lds, float* dst, int64_t ldd) {
    __m256 r[8], t[8], u[8];
    UNROLL for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
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

// o[MB][D] += p[MB][0..nk) . v[0..nk)[D] (v rows at stride ldv)
template <int64_t D, int MB>
inline void weighted_values(const float* __restrict p, const float* __restrict v, int64_t ldv,
                            int64_t nk, float* __restrict o) {
    UNROLL for (int64_t h = 0; h < D / 32; h++) {
        __m256 acc[MB][4];
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < 4; j++)
            acc[i][j] = _mm256_load_ps(o + i * D + h * 32 + j * 8);
        for (int64_t k = 0; k < nk; k++) {
            const float* vr = v + k * ldv + h * 32;
            const __m256 w0 = _mm256_loadu_ps(vr), w1 = _mm256_loadu_ps(vr + 8);
            const __m256 w2 = _mm256_loadu_ps(vr + 16), w3 = _mm256_loadu_ps(vr + 24);
            UNROLL for (int i = 0; i < MB; i++) {
                const __m256 x = _mm256_broadcast_ss(p + i * kTile + k);
                acc[i][0] = _mm256_fmadd_ps(x, w0, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(x, w1, acc[i][1]);
                acc[i][2] = _mm256_fmadd_ps(x, w2, acc[i][2]);
                acc[i][3] = _mm256_fmadd_ps(x, w3, acc[i][3]);
            }
        }
        UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < 4; j++)
            _mm256_store_ps(o + i * D + h * 32 + j * 8, acc[i][j]);
    }
}

// Scales row r's scores, folds the tile into its running (m, l) and rescales its o; s becomes
// the tile's probabilities (0 past nk).
template <int64_t D>
inline void softmax_tile(float* s, int64_t nk, float scale, float* m, float* l, float* o) {
    const __m256 vscale = _mm256_set1_ps(scale);
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < kTile; j += 8) {
        __m256 x = _mm256_mul_ps(_mm256_load_ps(s + j), vscale);
        if (j + 8 > nk) {
            alignas(32) float tmp[8];
            _mm256_store_ps(tmp, x);
            for (int64_t c = 0; c < 8; c++) if (j + c >= nk) tmp[c] = -INFINITY;
            x = _mm256_load_ps(tmp);
        }
        _mm256_store_ps(s + j, x);
        vmax = _mm256_max_ps(vmax, x);
    }
    const float tile_max = hmax(vmax);
    const float new_max = tile_max > *m ? tile_max : *m;
    const float rescale = expf(*m - new_max);  // 0 on the first tile (m = -inf)
    const __m256 vnew = _mm256_set1_ps(new_max);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t j = 0; j < kTile; j += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_load_ps(s + j), vnew));
        const __m256 kept = j + 8 > nk ? _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                                             _mm256_set1_epi32(static_cast<int>(nk - j)),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))))
                                       : e;
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

template <int64_t D>
struct Scratch {
    // Per (head, range): o [R][D], m [R], l [R]; per range: kt [D][kTile], s [R][kTile].
    static int64_t state_numel(int64_t R) { return R * D + 2 * round16(R); }
    static int64_t work_numel(int64_t R) { return D * kTile + R * kTile; }
};

// Rows of one head against the keys [t0, t0 + nk) of one tile.
template <int64_t D>
void attend_tile(const float* q, int64_t R, const float* k, const float* v, int64_t ldk,
                 int64_t t0, int64_t nk, float scale, float* o, float* m, float* l, float* kt,
                 float* s) {
    const int64_t full = nk / 8 * 8;
    for (int64_t j = 0; j < full; j += 8)
        for (int64_t d = 0; d < D; d += 8) transpose8(k + (t0 + j) * ldk + d, ldk, kt + d * kTile + j, kTile);
    for (int64_t j = full; j < kTile; j++)
        for (int64_t d = 0; d < D; d++) kt[d * kTile + j] = j < nk ? k[(t0 + j) * ldk + d] : 0.0f;
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) scores<D, 4>(q + r * D, kt, s + r * kTile);
    switch (R - r) {
        case 3: scores<D, 3>(q + r * D, kt, s + r * kTile); break;
        case 2: scores<D, 2>(q + r * D, kt, s + r * kTile); break;
        case 1: scores<D, 1>(q + r * D, kt, s + r * kTile); break;
        default: break;
    }
    for (int64_t i = 0; i < R; i++) softmax_tile<D>(s + i * kTile, nk, scale, m + i, l + i, o + i * D);
    const float* vt = v + t0 * ldk;
    r = 0;
    for (; r + 3 <= R; r += 3) weighted_values<D, 3>(s + r * kTile, vt, ldk, nk, o + r * D);
    switch (R - r) {
        case 2: weighted_values<D, 2>(s + r * kTile, vt, ldk, nk, o + r * D); break;
        case 1: weighted_values<D, 1>(s + r * kTile, vt, ldk, nk, o + r * D); break;
        default: break;
    }
}

template <int64_t D>
void attention(const float* q, const float* k, const float* v, int64_t H, int64_t R, int64_t L,
               int64_t ldk, float scale, int64_t splits, float* scratch, float* out, float* lse) {
    const int64_t state = Scratch<D>::state_numel(R), work = Scratch<D>::work_numel(R);
    float* states = scratch;                 // [H][splits] states
    float* works = scratch + H * splits * state;  // [splits] work areas
    const int64_t range = ((L + splits - 1) / splits + kTile - 1) / kTile * kTile;
    #pragma omp parallel for schedule(static)
    for (int64_t sp = 0; sp < splits; sp++) {
        const int64_t k0 = sp * range, k1 = (sp + 1) * range < L ? (sp + 1) * range : L;
        float* kt = works + sp * work;
        float* s = kt + D * kTile;
        for (int64_t h = 0; h < H; h++) {
            float* o = states + (h * splits + sp) * state;
            for (int64_t i = 0; i < R * D; i++) o[i] = 0.0f;
            for (int64_t i = 0; i < R; i++) { o[R * D + i] = -INFINITY; o[R * D + round16(R) + i] = 0.0f; }
        }
        for (int64_t t0 = k0; t0 < k1; t0 += kTile) {
            const int64_t nk = k1 - t0 < kTile ? k1 - t0 : kTile;
            for (int64_t h = 0; h < H; h++) {
                float* o = states + (h * splits + sp) * state;
                attend_tile<D>(q + h * R * D, R, k + h * D, v + h * D, ldk, t0, nk, scale, o,
                               o + R * D, o + R * D + round16(R), kt, s);
            }
        }
    }
    #pragma omp parallel for schedule(static)
    for (int64_t hr = 0; hr < H * R; hr++) {
        const int64_t h = hr / R, r = hr % R;
        float max = -INFINITY;
        for (int64_t sp = 0; sp < splits; sp++) {
            const float mm = states[(h * splits + sp) * state + R * D + r];
            max = mm > max ? mm : max;
        }
        float total = 0.0f;
        alignas(32) float acc[D] = {};
        for (int64_t sp = 0; sp < splits; sp++) {
            const float* st = states + (h * splits + sp) * state;
            const float l = st[R * D + round16(R) + r];
            if (l == 0.0f) continue;  // an empty range
            const float f = expf(st[R * D + r] - max);
            total += l * f;
            for (int64_t d = 0; d < D; d++) acc[d] += st[r * D + d] * f;
        }
        for (int64_t d = 0; d < D; d++) out[hr * D + d] = acc[d] / total;
        lse[hr] = max + logf(total);
    }
}

}  // namespace

extern "C" {

// Floats of scratch for spyre_attention_f32 (32-byte aligned).
int64_t spyre_attention_f32_scratch_numel(int64_t head_dim, int64_t H, int64_t R, int64_t splits) {
    if (head_dim == 64) return H * splits * Scratch<64>::state_numel(R) + splits * Scratch<64>::work_numel(R);
    if (head_dim == 128) return H * splits * Scratch<128>::state_numel(R) + splits * Scratch<128>::work_numel(R);
    return -1;
}

// q: [H][R][head_dim] contiguous; key j of head h at k + j * ldk + h * head_dim (v alike), L >= 1
// keys; out: [H][R][head_dim]; lse: [H][R] (natural log of the scaled scores' exp sum).
// head_dim 64 or 128 (else returns 1 and writes nothing); returns 0.
int spyre_attention_f32(int64_t head_dim, const float* q, const float* k, const float* v, int64_t H,
                        int64_t R, int64_t L, int64_t ldk, float scale, int64_t splits,
                        float* scratch, float* out, float* lse) {
    if (head_dim == 64) attention<64>(q, k, v, H, R, L, ldk, scale, splits, scratch, out, lse);
    else if (head_dim == 128) attention<128>(q, k, v, H, R, L, ldk, scale, splits, scratch, out, lse);
    else return 1;
    return 0;
}

}  // extern "C"
