// This machine's float32 arithmetic peak: 2 threads, each with 12 independent chains of AVX2
// FMAs (enough to cover the FMA latency on both pipes), no memory traffic. The number the
// kernels' GFLOP/s in bench_kernels.py and RESULTS.md are compared against.
//   g++ -O2 -mavx2 -mfma -fopenmp bench/fma_peak.cpp -o /tmp/fma_peak && /tmp/fma_peak
#include <immintrin.h>
#include <stdio.h>
#include <omp.h>
#include <chrono>
int main() {
    const long iters = 200000000;
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        auto t0 = std::chrono::steady_clock::now();
        float sink = 0;
        #pragma omp parallel num_threads(2) reduction(+:sink)
        {
            __m256 a[12]; __m256 x = _mm256_set1_ps(1.0000001f), y = _mm256_set1_ps(0.9999999f);
            for (int i = 0; i < 12; i++) a[i] = _mm256_set1_ps(i);
            for (long it = 0; it < iters / 10; it++) {
                #pragma GCC unroll 12
                for (int i = 0; i < 12; i++) a[i] = _mm256_fmadd_ps(a[i], x, y);
            }
            __m256 s = a[0]; for (int i = 1; i < 12; i++) s = _mm256_add_ps(s, a[i]);
            float f[8]; _mm256_storeu_ps(f, s); sink += f[0];
        }
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        double gf = 2.0 * (iters / 10) * 12 * 8 * 2 / dt / 1e9;
        if (gf > best) best = gf;
        printf("%.1f GFLOP/s (sink %g)\n", gf, sink);
    }
    printf("peak %.1f GFLOP/s on 2 threads\n", best);
}
