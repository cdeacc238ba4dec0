// float32 linear layer y = x @ w^T for the cpu backend, with the weight packed once into panels.
//
// Panel layout: output columns in panels of 8; panel b holds w[8b .. 8b+7][0 .. K-1] transposed,
// K rows of 8 floats (32 bytes, one AVX register), contiguous. A last partial panel is padded
// with zero columns. The micro-kernel keeps a 4 x 24 block of y (4 rows, 3 panels) in 12
// registers and, for each k, loads 3 panel rows and broadcasts 4 x values: every weight byte is
// read once per 4 rows of x, in a sequential stream the hardware prefetcher follows. At the few
// rows of a decode step that streams the weights from memory at 1.5-2x the rate of oneDNN's
// packed kernel, and at 64-256 rows it runs at or above oneDNN's GEMM rate (bench_kernels.py).
//
// Threads: an OpenMP loop over blocks of 3 panels, in the OpenMP runtime torch already loaded
// (libgomp.so.1 by soname), so this runs on torch's own thread pool and thread count.
#include <immintrin.h>
#include <stdint.h>

#define UNROLL _Pragma("GCC unroll 16")

namespace {

constexpr int64_t kPanel = 8;     // output columns per panel
constexpr int kPanelsPerBlock = 3;
constexpr int kRowsPerBlock = 4;

// y[0..MB)[0..NB*8) = x[0..MB)[0..K) . panels[0..NB); the last panel stores only last_cols.
template <int MB, int NB>
inline void block(const float* __restrict x, int64_t K, const float* __restrict panels,
                  float* __restrict y, int64_t ldy, int64_t last_cols) {
    __m256 acc[MB][NB];
    UNROLL for (int i = 0; i < MB; i++) UNROLL for (int j = 0; j < NB; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m256 w[NB];
        UNROLL for (int j = 0; j < NB; j++) w[j] = _mm256_load_ps(panels + (j * K + k) * kPanel);
        UNROLL for (int i = 0; i < MB; i++) {
            const __m256 xv = _mm256_broadcast_ss(x + i * K + k);
            UNROLL for (int j = 0; j < NB; j++) acc[i][j] = _mm256_fmadd_ps(xv, w[j], acc[i][j]);
        }
    }
    UNROLL for (int i = 0; i < MB; i++) {
        UNROLL for (int j = 0; j < NB - 1; j++) _mm256_storeu_ps(y + i * ldy + j * kPanel, acc[i][j]);
        float* last = y + i * ldy + (NB - 1) * kPanel;
        if (last_cols == kPanel) {
            _mm256_storeu_ps(last, acc[i][NB - 1]);
        } else {
            alignas(32) float tmp[kPanel];
            _mm256_store_ps(tmp, acc[i][NB - 1]);
            for (int64_t c = 0; c < last_cols; c++) last[c] = tmp[c];
        }
    }
}

template <int NB>
inline void column_block(const float* x, const float* panels, float* y, int64_t M, int64_t K,
                         int64_t N, int64_t last_cols) {
    int64_t m = 0;
    for (; m + kRowsPerBlock <= M; m += kRowsPerBlock)
        block<kRowsPerBlock, NB>(x + m * K, K, panels, y + m * N, N, last_cols);
    switch (M - m) {
        case 3: block<3, NB>(x + m * K, K, panels, y + m * N, N, last_cols); break;
        case 2: block<2, NB>(x + m * K, K, panels, y + m * N, N, last_cols); break;
        case 1: block<1, NB>(x + m * K, K, panels, y + m * N, N, last_cols); break;
        default: break;
    }
}

}  // namespace

extern "C" {

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

// x: [M][K] row-major; y: [M][N] row-major (written, not accumulated).
void spyre_linear_f32(const float* x, const float* panels, float* y, int64_t M, int64_t K,
                      int64_t N) {
    const int64_t num_panels = (N + kPanel - 1) / kPanel;
    const int64_t num_blocks = (num_panels + kPanelsPerBlock - 1) / kPanelsPerBlock;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < num_blocks; b++) {
        const int64_t first = b * kPanelsPerBlock;
        const int64_t count = num_panels - first < kPanelsPerBlock ? num_panels - first : kPanelsPerBlock;
        const int64_t last_cols = N - (first + count - 1) * kPanel < kPanel
                                      ? N - (first + count - 1) * kPanel : kPanel;
        const float* p = panels + first * K * kPanel;
        float* yb = y + first * kPanel;
        switch (count) {
            case 3: column_block<3>(x, p, yb, M, K, N, last_cols); break;
            case 2: column_block<2>(x, p, yb, M, K, N, last_cols); break;
            default: column_block<1>(x, p, yb, M, K, N, last_cols); break;
        }
    }
}

}  // extern "C"
