// float32 element-wise ops of a decoder layer for the cpu backend: RMS norm, SiLU-and-multiply
// and rotary position embedding, each one pass over its rows; and the scatter of a step's new
// keys and values into their cache slots.
//
// Each replaces several aten ops (torch's CPU rms_norm is a pow, a mean, an add, an rsqrt and two
// products; fms's GLU is a split, a silu and a product; RoPE is a flip and three products), and
// every aten op has a fixed cost whatever its size, a few times per layer and step. Rows are split
// over OpenMP threads (torch's pool, as in linear_f32.cpp) only when there are enough of them:
// a decode step's few rows are cheaper on the calling thread than waking a worker.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "avx2_math.h"

namespace {

using spyre_avx2::exp_clamped;
using spyre_avx2::hsum;

constexpr int64_t kParallelFloats = 1 << 15;  // below this, one thread

inline float silu(float x) { return x / (1.0f + expf(-x)); }

}  // namespace

extern "C" {

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for M rows of N floats; x rows at stride ldx,
// out contiguous [M][N]. The sum of squares runs in float32 in 8 lanes, then across them.
void spyre_rms_norm_f32(const float* x, int64_t ldx, const float* w, float* out, int64_t M,
                        int64_t N, float eps) {
    const int64_t full = N / 8 * 8;
    #pragma omp parallel for schedule(static) if (M * N >= kParallelFloats)
    for (int64_t r = 0; r < M; r++) {
        const float* xr = x + r * ldx;
        float* o = out + r * N;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < full; j += 8) {
            const __m256 v = _mm256_loadu_ps(xr + j);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float sum = hsum(acc);
        for (int64_t j = full; j < N; j++) sum += xr[j] * xr[j];
        const float scale = 1.0f / sqrtf(sum / static_cast<float>(N) + eps);
        const __m256 vs = _mm256_set1_ps(scale);
        for (int64_t j = 0; j < full; j += 8)
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + j), vs),
                                                  _mm256_loadu_ps(w + j)));
        for (int64_t j = full; j < N; j++) o[j] = xr[j] * scale * w[j];
    }
}

// out[r][j] = silu(gu[r][j]) * gu[r][H + j] for M rows of 2H floats (the gate, then the up
// projection, as fms's fused GLU weight lays them out); out contiguous [M][H].
void spyre_silu_mul_f32(const float* gu, float* out, int64_t M, int64_t H) {
    const int64_t full = H / 8 * 8;
    const __m256 one = _mm256_set1_ps(1.0f);
    #pragma omp parallel for schedule(static) if (M * H >= kParallelFloats)
    for (int64_t r = 0; r < M; r++) {
        const float* g = gu + r * 2 * H;
        const float* u = g + H;
        float* o = out + r * H;
        for (int64_t j = 0; j < full; j += 8) {
            const __m256 x = _mm256_loadu_ps(g + j);
            const __m256 e = exp_clamped(_mm256_sub_ps(_mm256_setzero_ps(), x));
            const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
        }
        for (int64_t j = full; j < H; j++) o[j] = silu(g[j]) * u[j];
    }
}

// Rotary embedding of T tokens x `heads` heads of D floats (D a multiple of 8): each (even, odd)
// pair becomes (cos * even - sin * odd, sin * even + cos * odd). x: token t, head h at
// x + t * ldx + h * D; cos and signed_sin: [T][D], pair i of token t holding (cos_i, cos_i) and
// (-sin_i, sin_i); out contiguous [T][heads][D].
void spyre_rope_f32(const float* x, int64_t ldx, const float* cos, const float* signed_sin,
                    float* out, int64_t T, int64_t heads, int64_t D) {
    #pragma omp parallel for schedule(static) if (T * heads * D >= kParallelFloats)
    for (int64_t t = 0; t < T; t++) {
        const float* c = cos + t * D;
        const float* s = signed_sin + t * D;
        for (int64_t h = 0; h < heads; h++) {
            const float* xh = x + t * ldx + h * D;
            float* o = out + (t * heads + h) * D;
            for (int64_t j = 0; j < D; j += 8) {
                const __m256 v = _mm256_loadu_ps(xh + j);
                const __m256 swapped = _mm256_permute_ps(v, 0xB1);  // (odd, even) in every pair
                _mm256_storeu_ps(o + j, _mm256_add_ps(_mm256_mul_ps(v, _mm256_loadu_ps(c + j)),
                                                      _mm256_mul_ps(swapped, _mm256_loadu_ps(s + j))));
            }
        }
    }
}

// dst[slots[t]] = src[t] for T rows of N floats: src rows at stride lds, dst contiguous rows of
// N (the KV cache as [num_slots][N]). A step's new keys or values, written into their cache slots.
void spyre_scatter_rows_f32(const float* src, int64_t lds, const int64_t* slots, float* dst,
                            int64_t T, int64_t N) {
    #pragma omp parallel for schedule(static) if (T * N >= kParallelFloats)
    for (int64_t t = 0; t < T; t++) memcpy(dst + slots[t] * N, src + t * lds, N * sizeof(float));
}

}  // extern "C"
