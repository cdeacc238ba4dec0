// This machine's float32 arithmetic peak: N threads (argv[1], default 2), each with 12
// independent chains of FMAs (enough to cover the FMA latency on both pipes), no memory traffic.
// Built with -DWIDTH512 (and -mavx512f) the chains are 512 bits wide, else 256 (AVX2). The
// number the kernels' GFLOP/s in bench_kernels.py (and in docs/notes/) are compared against;
// bench_kernels.py builds and runs it itself.
//   g++ -O2 -mavx2 -mfma -fopenmp bench/fma_peak.cpp -o /tmp/fma_peak && /tmp/fma_peak 2
//   g++ -O2 -mavx512f -fopenmp -DWIDTH512 bench/fma_peak.cpp -o /tmp/fma_peak512 && /tmp/fma_peak512 2
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#include <chrono>

#ifdef WIDTH512
typedef __m512 vec;
#define SET1 _mm512_set1_ps
#define FMADD _mm512_fmadd_ps
#define ADD _mm512_add_ps
#define STOREU _mm512_storeu_ps
#else
typedef __m256 vec;
#define SET1 _mm256_set1_ps
#define FMADD _mm256_fmadd_ps
#define ADD _mm256_add_ps
#define STOREU _mm256_storeu_ps
#endif
constexpr int kLanes = sizeof(vec) / sizeof(float);

int main(int argc, char** argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 2;
    const long iters = 20000000;
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        auto t0 = std::chrono::steady_clock::now();
        float sink = 0;
        #pragma omp parallel num_threads(threads) reduction(+:sink)
        {
            vec a[12];
            const vec x = SET1(1.0000001f), y = SET1(0.9999999f);
            for (int i = 0; i < 12; i++) a[i] = SET1(i);
            for (long it = 0; it < iters; it++) {
                #pragma GCC unroll 12
                for (int i = 0; i < 12; i++) a[i] = FMADD(a[i], x, y);
            }
            vec s = a[0];
            for (int i = 1; i < 12; i++) s = ADD(s, a[i]);
            float f[kLanes];
            STOREU(f, s);
            sink += f[0];
        }
        double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        double gf = 2.0 * iters * 12 * kLanes * threads / dt / 1e9;
        if (gf > best) best = gf;
        printf("%.1f GFLOP/s (sink %g)\n", gf, sink);
    }
    printf("peak %.1f GFLOP/s on %d threads, %d bits\n", best, threads, kLanes * 32);
}
