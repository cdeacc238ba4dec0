// bfloat16 element-wise ops of a decoder layer for the cpu backend: the counterparts of
// elementwise_f32.cpp for a model in bfloat16 (the default on CPUs with AMX or AVX512-BF16, whose
// matrix products run in oneDNN). Each computes in float32 and rounds where the aten ops it
// replaces round (to nearest even, as torch's bfloat16), so results are those of the aten ops up
// to float32 rounding inside (the norm's sum of squares and the SiLU's exp run in another order
// and precision, and the compiler may fuse the rotation's product and sum): at most one
// bfloat16 step apart per rounding, where that float32 rounding crosses a rounding boundary.
// - RMS norm, as fms's with use_high_precision_pow: rms_norm(float(x)) rounded, times the weight
//   rounded (two roundings, as fms's two ops);
// - SiLU-and-multiply, as fms's GLU: silu(gate) rounded, times up rounded;
// - rotary embedding, as fast_rope.py: float(x) * cos + swap(float(x)) * signed_sin rounded once;
// - an FP8 layer's input rounded to FP8 steps of its static scale, as compressed-tensors' ops in
//   bfloat16 compute it (exactly: each step is one rounding of an exact float32 value).
// AVX2 code (bfloat16 is loaded and stored through integer ops), like the float32 files.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "avx2_math.h"
#include "bf16_avx2.h"

namespace {

using spyre_avx2::exp_clamped;
using spyre_avx2::hsum;
using spyre_bf16::load8;
using spyre_bf16::round8;
using spyre_bf16::round_bf16;
using spyre_bf16::store8;
using spyre_bf16::widen;

constexpr int64_t kParallelValues = 1 << 15;  // below this, one thread

inline float silu(float x) { return x / (1.0f + expf(-x)); }

// One row of spyre_rms_norm_bf16.
inline void norm_row(const uint16_t* xr, const uint16_t* w, uint16_t* o, int64_t N, float eps) {
    const int64_t full = N / 8 * 8;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < full; j += 8) {
        const __m256 v = load8(xr + j);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float sum = hsum(acc);
    for (int64_t j = full; j < N; j++) sum += widen(xr[j]) * widen(xr[j]);
    const float scale = 1.0f / sqrtf(sum / static_cast<float>(N) + eps);
    const __m256 vs = _mm256_set1_ps(scale);
    for (int64_t j = 0; j < full; j += 8) {
        const __m256 normed = round8(_mm256_mul_ps(load8(xr + j), vs));
        store8(o + j, _mm256_mul_ps(normed, load8(w + j)));
    }
    for (int64_t j = full; j < N; j++)
        o[j] = round_bf16(widen(round_bf16(widen(xr[j]) * scale)) * widen(w[j]));
}

// One head of spyre_rope_bf16: D values (a multiple of 8) rotated from x into o.
inline void rope_head(const uint16_t* x, const float* c, const float* s, uint16_t* o, int64_t D) {
    for (int64_t j = 0; j < D; j += 8) {
        const __m256 v = load8(x + j);
        const __m256 swapped = _mm256_permute_ps(v, 0xB1);  // (odd, even) in every pair
        store8(o + j, _mm256_add_ps(_mm256_mul_ps(v, _mm256_loadu_ps(c + j)),
                                    _mm256_mul_ps(swapped, _mm256_loadu_ps(s + j))));
    }
}

// v (|v| <= 448, or NaN) rounded to the nearest float8_e4m3fn value, ties to even, as torch's
// conversion rounds it: 3 mantissa bits from 2^-6 up, steps of 2^-9 below.
inline float round_to_fp8(float v) {
    const float a = fabsf(v);
    if (a != a) return v;
    if (a < 0x1p-6f) return copysignf(nearbyintf(a * 512.0f) * 0x1p-9f, v);
    uint32_t u;
    __builtin_memcpy(&u, &a, 4);
    u = (u + 0x7FFFFu + ((u >> 20) & 1u)) & ~0xFFFFFu;
    float r;
    __builtin_memcpy(&r, &u, 4);
    return copysignf(r, v);
}

// x rounded to FP8 steps of scale: bf16(fp8(clamp(bf16(x / scale), -448, 448)) * scale).
inline uint16_t fp8_step(uint16_t x, float scale) {
    float q = widen(round_bf16(widen(x) / scale));
    q = q > 448.0f ? 448.0f : (q < -448.0f ? -448.0f : q);
    return round_bf16(round_to_fp8(q) * scale);
}

// fp8_step of 8 values, lane for lane the same operations: the division, bfloat16 rounding,
// clamp (NaN kept: max and min return their second operand where one is NaN), round_to_fp8's
// two cases chosen per lane, the sign put back, the product rounded.
inline __m256 fp8_step8(__m256 x, __m256 scale) {
    const __m256 q = _mm256_min_ps(_mm256_set1_ps(448.0f),
                                   _mm256_max_ps(_mm256_set1_ps(-448.0f), round8(_mm256_div_ps(x, scale))));
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 a = _mm256_andnot_ps(sign, q);
    const __m256 small = _mm256_mul_ps(
        _mm256_round_ps(_mm256_mul_ps(a, _mm256_set1_ps(512.0f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
        _mm256_set1_ps(0x1p-9f));
    const __m256i u = _mm256_castps_si256(a);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 20), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFFF)), odd),
                                             _mm256_set1_epi32(static_cast<int>(~0xFFFFFu)));
    const __m256 r = _mm256_blendv_ps(_mm256_castsi256_ps(rounded), small,
                                      _mm256_cmp_ps(a, _mm256_set1_ps(0x1p-6f), _CMP_LT_OQ));
    return _mm256_mul_ps(_mm256_or_ps(r, _mm256_and_ps(sign, q)), scale);
}

// fp8_step of n values (8 at a time, the rest one by one).
inline void fp8_steps(const uint16_t* x, float scale, uint16_t* out, int64_t n) {
    const int64_t full = n / 8 * 8;
    const __m256 vs = _mm256_set1_ps(scale);
    for (int64_t i = 0; i < full; i += 8) store8(out + i, fp8_step8(load8(x + i), vs));
    for (int64_t i = full; i < n; i++) out[i] = fp8_step(x[i], scale);
}

}  // namespace

extern "C" {

// out[i] = bf16(fp8(clamp(bf16(x[i] / scale), -448, 448)) * scale) for n bfloat16 values, scale
// a bfloat16 value (as a float): compressed-tensors' quantize-dequantize of a static per-tensor
// FP8 input scale, op for op as torch computes it in bfloat16.
void spyre_fake_quantize_fp8_bf16(const uint16_t* x, float scale, uint16_t* out, int64_t n) {
    constexpr int64_t kChunk = 4096;  // values a task
    #pragma omp parallel for schedule(static) if (n >= kParallelValues)
    for (int64_t i = 0; i < n; i += kChunk) fp8_steps(x + i, scale, out + i, n - i < kChunk ? n - i : kChunk);
}

// spyre_fake_quantize_fp8_bf16 for M rows of N values, each row with its own scale computed
// from it: bf16(max |x[r][j]| / 448), or 2^-7 (bfloat16's epsilon) where that is 0. This is
// compressed-tensors' dynamic per-token FP8 input scale, op for op as torch computes it in
// bfloat16 (a NaN row's scale is NaN there and here: its values come out NaN).
void spyre_fake_quantize_fp8_rows_bf16(const uint16_t* x, uint16_t* out, int64_t M, int64_t N) {
    #pragma omp parallel for schedule(static) if (M * N >= kParallelValues)
    for (int64_t r = 0; r < M; r++) {
        const uint16_t* xr = x + r * N;
        float amax = 0.0f;
        bool nan = false;
        for (int64_t j = 0; j < N; j++) {
            const float a = fabsf(widen(xr[j]));
            nan |= a != a;
            amax = a > amax ? a : amax;
        }
        float scale = widen(round_bf16(amax / 448.0f));
        if (nan) scale = widen(0x7FC0);
        if (scale == 0.0f) scale = 0x1p-7f;
        fp8_steps(xr, scale, out + r * N, N);
    }
}

// out[r] = bf16(bf16(x[r] / sqrt(mean(x[r]^2) + eps)) * w) for M rows of N values; x rows at
// stride ldx (values), out contiguous [M][N].
void spyre_rms_norm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* out,
                         int64_t M, int64_t N, float eps) {
    #pragma omp parallel for schedule(static) if (M * N >= kParallelValues)
    for (int64_t r = 0; r < M; r++) norm_row(x + r * ldx, w, out + r * N, N, eps);
}

// The residual add and the next norm of a decoder layer in one pass: x[r] = bf16(x[r] + d[r])
// in place (as fms's `x = out + residual`), then out[r] = spyre_rms_norm_bf16 of the new x[r].
// x, d and out contiguous [M][N].
void spyre_add_rms_norm_bf16(uint16_t* x, const uint16_t* d, const uint16_t* w, uint16_t* out,
                             int64_t M, int64_t N, float eps) {
    const int64_t full = N / 8 * 8;
    #pragma omp parallel for schedule(static) if (M * N >= kParallelValues)
    for (int64_t r = 0; r < M; r++) {
        uint16_t* xr = x + r * N;
        const uint16_t* dr = d + r * N;
        for (int64_t j = 0; j < full; j += 8) store8(xr + j, _mm256_add_ps(load8(dr + j), load8(xr + j)));
        for (int64_t j = full; j < N; j++) xr[j] = round_bf16(widen(dr[j]) + widen(xr[j]));
        norm_row(xr, w, out + r * N, N, eps);
    }
}

// out[r][j] = bf16(bf16(silu(gu[r][j])) * gu[r][H + j]) for M rows of 2H values (the gate, then
// the up projection, as fms's fused GLU weight lays them out); out contiguous [M][H].
void spyre_silu_mul_bf16(const uint16_t* gu, uint16_t* out, int64_t M, int64_t H) {
    const int64_t full = H / 8 * 8;
    const __m256 one = _mm256_set1_ps(1.0f);
    #pragma omp parallel for schedule(static) if (M * H >= kParallelValues)
    for (int64_t r = 0; r < M; r++) {
        const uint16_t* g = gu + r * 2 * H;
        const uint16_t* u = g + H;
        uint16_t* o = out + r * H;
        for (int64_t j = 0; j < full; j += 8) {
            const __m256 x = load8(g + j);
            const __m256 e = exp_clamped(_mm256_sub_ps(_mm256_setzero_ps(), x));
            const __m256 s = round8(_mm256_div_ps(x, _mm256_add_ps(one, e)));
            store8(o + j, _mm256_mul_ps(s, load8(u + j)));
        }
        for (int64_t j = full; j < H; j++)
            o[j] = round_bf16(widen(round_bf16(silu(widen(g[j])))) * widen(u[j]));
    }
}

// Rotary embedding of T tokens x `heads` heads of D values (D a multiple of 8), as
// spyre_rope_f32 with bfloat16 in and out: x token t, head h at x + t * ldx + h * D; cos and
// signed_sin float32 [T][D]; out contiguous [T][heads][D].
void spyre_rope_bf16(const uint16_t* x, int64_t ldx, const float* cos, const float* signed_sin,
                     uint16_t* out, int64_t T, int64_t heads, int64_t D) {
    #pragma omp parallel for schedule(static) if (T * heads * D >= kParallelValues)
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < heads; h++)
            rope_head(x + t * ldx + h * D, cos + t * D, signed_sin + t * D, out + (t * heads + h) * D, D);
}

// A layer's rotary embedding and KV store in one pass over its fused QKV output: qkv [T][ldq]
// holds each token's H query heads, then KVH key heads, then KVH value heads, of D values (a
// multiple of 8). The queries go rotated to q_out [T][H][D]; the keys rotated and the values as
// they are to row slots[t] of k_cache and v_cache ([num_slots][KVH][D]), as spyre_rope_bf16
// then fms's store compute them.
void spyre_rope_store_bf16(const uint16_t* qkv, int64_t ldq, const float* cos,
                           const float* signed_sin, uint16_t* q_out, uint16_t* k_cache,
                           uint16_t* v_cache, const int64_t* slots, int64_t T, int64_t H,
                           int64_t KVH, int64_t D) {
    #pragma omp parallel for schedule(static) if (T * (H + KVH) * D >= kParallelValues)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t* row = qkv + t * ldq;
        const float* c = cos + t * D;
        const float* s = signed_sin + t * D;
        for (int64_t h = 0; h < H; h++) rope_head(row + h * D, c, s, q_out + (t * H + h) * D, D);
        uint16_t* k = k_cache + slots[t] * KVH * D;
        for (int64_t h = 0; h < KVH; h++) rope_head(row + (H + h) * D, c, s, k + h * D, D);
        __builtin_memcpy(v_cache + slots[t] * KVH * D, row + (H + KVH) * D, KVH * D * sizeof(uint16_t));
    }
}

}  // extern "C"
