// This machine's arithmetic peak: N threads (argv[1], default 2), each with 12
// independent chains of FMAs (enough to cover the FMA latency on both pipes), no memory traffic.
// Built with -DWIDTH512 (and -mavx512f) the chains are 512 bits wide, else 256 (AVX2); with
// -DDPBF16 (and -mavx512f -mavx512bf16) they are vdpbf16ps, the bfloat16 dot product the
// AVX512-BF16 linear kernel runs (two products and two adds per float32 lane: 64 FLOPs an
// instruction). The number the kernels' GFLOP/s in bench_kernels.py and amx_linear.py (and in
// docs/notes/) are compared against; those benches build and run it themselves.
//   g++ -O2 -mavx2 -mfma -fopenmp bench/fma_peak.cpp -o /tmp/fma_peak && /tmp/fma_peak 2
//   g++ -O2 -mavx512f -fopenmp -DWIDTH512 bench/fma_peak.cpp -o /tmp/fma_peak512 && /tmp/fma_peak512 2
//   g++ -O2 -mavx512f -mavx512bf16 -fopenmp -DDPBF16 bench/fma_peak.cpp -o /tmp/dp && /tmp/dp 2
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#include <chrono>

#if defined(DPBF16)
typedef __m512 vec;
#define SET1 _mm512_set1_ps
#define ADD _mm512_add_ps
#define STOREU _mm512_storeu_ps
// acc += the products of x's and y's bfloat16 pairs: x and y are the bits of 1.0f's pairs, so
// the chains grow by 2 an instruction and stay finite.
#define FMADD(acc, x, y) _mm512_dpbf16_ps(acc, (__m512bh)_mm512_castps_si512(x), \
                                          (__m512bh)_mm512_castps_si512(y))
#define X_INIT _mm512_castsi512_ps(_mm512_set1_epi32(0x3F803F80))
#define Y_INIT X_INIT
constexpr int kFlopsPerLane = 4;
constexpr const char* kKind = "bits, vdpbf16ps";
#elif defined(WIDTH512)
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
#ifndef DPBF16
#define X_INIT SET1(1.0000001f)
#define Y_INIT SET1(0.9999999f)
constexpr int kFlopsPerLane = 2;
constexpr const char* kKind = "bits";
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
            const vec x = X_INIT, y = Y_INIT;
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
        double gf = 1.0 * kFlopsPerLane * iters * 12 * kLanes * threads / dt / 1e9;
        if (gf > best) best = gf;
        printf("%.1f GFLOP/s (sink %g)\n", gf, sink);
    }
    printf("peak %.1f GFLOP/s on %d threads, %d %s\n", best, threads, kLanes * 32, kKind);
}
