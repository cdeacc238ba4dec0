// Probe for issue 33's prefill target: a bfloat16 linear on AMX tiles reading the packed layout
// of spyre_server/model/cpu/kernels/linear_bf16.cpp as it is (64-column blocks, 256 bytes per pair
// of K, 16 columns' pairs per 64-byte group: one tile row of B), measured three ways:
// - prefill: 256 rows x K 2048 x N 8192 (a 1B model's gate/up shape), 2x2 tiles of 16 rows x 16
//   columns, GFLOP/s;
// - row invariance: rows computed alone (1-row tiles, the decode code) against their row of the
//   256-row call, bit for bit (the prefix cache needs a row's result whatever the batch);
// - decode: 1 row over 2 GB of weights (from memory), GB/s (the bound: decode_bandwidth.py's
//   torch.sum streaming read on the same box).
// Not the server's kernel: K must be a multiple of 32, M of 32 (prefill), N of 64; fp32 out.
// Build and run (a CPU with AMX-BF16, Linux >= 5.16):
//   g++ -O2 -march=sapphirerapids -fopenmp -o /tmp/amx_linear_probe bench/amx_linear_probe.cpp
//   OMP_NUM_THREADS=2 /tmp/amx_linear_probe
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <chrono>
#include <vector>
struct __attribute__((packed)) TileCfg { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static void config(int arows) {
  TileCfg c; memset(&c, 0, sizeof c); c.palette = 1;
  for (int t = 0; t < 4; t++) { c.rows[t] = arows; c.colsb[t] = 64; }   // C tiles
  for (int t = 4; t < 6; t++) { c.rows[t] = arows; c.colsb[t] = 64; }   // A tiles
  for (int t = 6; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }      // B tiles
  _tile_loadconfig(&c);
}
// y[M][N] fp32 = x[M][K] bf16 . packed ; K multiple of 32, M multiple of 16 (prefill) or M<=16.
static void linear(const uint16_t* x, const uint16_t* packed, float* y, int M, int K, int N, bool decode) {
  const int P = K / 2, blocks = N / 64;
  #pragma omp parallel
  {
    const int T = omp_get_num_threads(), me = omp_get_thread_num();
    const int b0 = blocks * me / T, b1 = blocks * (me + 1) / T;
    int rows = M < 16 ? M : 16;
    config(rows);
    for (int b = b0; b < b1; b++) {
      const uint16_t* wb = packed + (int64_t)b * P * 128;
      if (decode) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int p = 0; p < P; p += 16) {
          const char* w = (const char*)(wb + (int64_t)p * 128);
          for (int l = 0; l < 64; l++) _mm_prefetch(w + 8192 + 64 * l, _MM_HINT_T0);
          _tile_loadd(4, x + 2 * p, K * 2);
          _tile_loadd(6, w, 256); _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, w + 64, 256); _tile_dpbf16ps(1, 4, 7);
          _tile_loadd(6, w + 128, 256); _tile_dpbf16ps(2, 4, 6);
          _tile_loadd(7, w + 192, 256); _tile_dpbf16ps(3, 4, 7);
        }
        _tile_stored(0, y + b * 64, N * 4); _tile_stored(1, y + b * 64 + 16, N * 4);
        _tile_stored(2, y + b * 64 + 32, N * 4); _tile_stored(3, y + b * 64 + 48, N * 4);
        continue;
      }
      for (int r = 0; r < M; r += 32) for (int g = 0; g < 4; g += 2) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int p = 0; p < P; p += 16) {
          const char* w = (const char*)(wb + (int64_t)p * 128) + 64 * g;
          _tile_loadd(4, x + (int64_t)r * K + 2 * p, K * 2);
          _tile_loadd(5, x + (int64_t)(r + 16) * K + 2 * p, K * 2);
          _tile_loadd(6, w, 256); _tile_loadd(7, w + 64, 256);
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
        float* yb = y + (int64_t)r * N + b * 64 + g * 16;
        _tile_stored(0, yb, N * 4); _tile_stored(1, yb + 16, N * 4);
        _tile_stored(2, yb + 16 * N, N * 4); _tile_stored(3, yb + 16 * N + 16, N * 4);
      }
    }
    _tile_release();
  }
}
static uint16_t rnd_bf16(uint64_t& s) {  // a random normal-ish bfloat16 in [-2, 2)
  s = s * 6364136223846793005ULL + 1442695040888963407ULL;
  float f = ((int32_t)(s >> 32) / 2147483648.0f) * 2.0f; uint32_t u; memcpy(&u, &f, 4); return u >> 16;
}
int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { puts("no AMX permission"); return 1; }
  #pragma omp parallel
  { syscall(SYS_arch_prctl, 0x1023, 18); }
  // prefill: M=256, K=2048, N=8192
  { int M = 256, K = 2048, N = 8192;
    std::vector<uint16_t> x((size_t)M * K, 0x3f80);
    uint16_t* w = (uint16_t*)aligned_alloc(64, (size_t)N * K * 2);
    for (size_t i = 0; i < (size_t)N * K; i++) w[i] = 0x3c00;
    std::vector<float> y((size_t)M * N);
    double best = 1e9;
    for (int it = 0; it < 10; it++) { auto t0 = std::chrono::steady_clock::now(); linear(x.data(), w, y.data(), M, K, N, false);
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); if (s < best) best = s; }
    printf("prefill M=%d K=%d N=%d: %.1f ms, %.0f GFLOP/s\n", M, K, N, best * 1e3, 2.0 * M * K * N / best / 1e9);
    // Row invariance: random values; each row computed alone (the decode code, 1-row tiles)
    // equals its row of the 256-row call (2x2 tiles of 16 rows), bit for bit.
    uint64_t seed = 42; for (auto& v : x) v = rnd_bf16(seed); for (size_t i = 0; i < (size_t)N * K; i++) w[i] = rnd_bf16(seed);
    linear(x.data(), w, y.data(), M, K, N, false);
    std::vector<float> one(N); long differ = 0;
    for (int r = 0; r < M; r += 37) { linear(x.data() + (size_t)r * K, w, one.data(), 1, K, N, true);
      differ += memcmp(one.data(), y.data() + (size_t)r * N, N * 4) != 0; }
    printf("rows computed alone that differ from the 256-row call: %ld of %d\n", differ, (M + 36) / 37);
    free(w); }
  // decode: M=1, 30 layers of K=2048 N=16384 (2 GB)
  { int K = 2048, N = 16384, L = 30; size_t per = (size_t)N * K;
    uint16_t* w = (uint16_t*)aligned_alloc(64, per * L * 2); for (size_t i = 0; i < per * L; i++) w[i] = 0x3c00;
    std::vector<uint16_t> x((size_t)16 * K, 0x3f80); std::vector<float> y((size_t)16 * N);
    double best = 1e9;
    for (int it = 0; it < 5; it++) { auto t0 = std::chrono::steady_clock::now();
      for (int l = 0; l < L; l++) linear(x.data(), w + per * l, y.data(), 1, K, N, true);
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); if (s < best) best = s; }
    printf("decode M=1 over %.2f GB: %.1f ms, %.1f GB/s\n", per * L * 2 / 1e9, best * 1e3,
           per * L * 2 / best / 1e9); }
}
