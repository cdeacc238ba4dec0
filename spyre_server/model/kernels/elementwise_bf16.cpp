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
// - rotary embedding, as fast_rope.py: float(x) * cos + swap(float(x)) * signed_sin rounded once.
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
using spyre_bf16::round_bf16;
using spyre_bf16::store8;
using spyre_bf16::widen;

constexpr int64_t kParallelValues = 1 << 15;  // below this, one thread

// Rounds to bfloat16 and back: the value an intermediate bfloat16 tensor would hold.
inline __m256 through_bf16(__m256 v) {
    alignas(32) uint16_t tmp[8];
    store8(tmp, v);
    return load8(tmp);
}

inline float silu(float x) { return x / (1.0f + expf(-x)); }

}  // namespace

extern "C" {

// out[r] = bf16(bf16(x[r] / sqrt(mean(x[r]^2) + eps)) * w) for M rows of N values; x rows at
// stride ldx (values), out contiguous [M][N].
void spyre_rms_norm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, uint16_t* out,
                         int64_t M, int64_t N, float eps) {
    const int64_t full = N / 8 * 8;
    #pragma omp parallel for schedule(static) if (M * N >= kParallelValues)
    for (int64_t r = 0; r < M; r++) {
        const uint16_t* xr = x + r * ldx;
        uint16_t* o = out + r * N;
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
            const __m256 normed = through_bf16(_mm256_mul_ps(load8(xr + j), vs));
            store8(o + j, _mm256_mul_ps(normed, load8(w + j)));
        }
        for (int64_t j = full; j < N; j++)
            o[j] = round_bf16(widen(round_bf16(widen(xr[j]) * scale)) * widen(w[j]));
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
            const __m256 s = through_bf16(_mm256_div_ps(x, _mm256_add_ps(one, e)));
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
    for (int64_t t = 0; t < T; t++) {
        const float* c = cos + t * D;
        const float* s = signed_sin + t * D;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t* xh = x + t * ldx + h * D;
            uint16_t* o = out + (t * heads + h) * D;
            for (int64_t j = 0; j < D; j += 8) {
                const __m256 v = load8(xh + j);
                const __m256 swapped = _mm256_permute_ps(v, 0xB1);  // (odd, even) in every pair
                store8(o + j, _mm256_add_ps(_mm256_mul_ps(v, _mm256_loadu_ps(c + j)),
                                            _mm256_mul_ps(swapped, _mm256_loadu_ps(s + j))));
            }
        }
    }
}

}  // extern "C"
