// bfloat16 <-> float32 with AVX2 (integer ops; no AVX512-BF16 needed), header-only. Rounding is
// torch's: to nearest, ties to even, NaN to 0x7FC0.
#pragma once
#include <immintrin.h>
#include <stdint.h>

namespace spyre_bf16 {

// 8 bfloat16 values widened to float32 (exact).
inline __m256 load8(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 float32 values rounded to the nearest bfloat16 values, still as float32 (the low 16 bits
// zero): what an intermediate bfloat16 tensor would hold.
inline __m256 round8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i biased = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd);
    __m256i r = _mm256_and_si256(biased, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), nan);
    return _mm256_castsi256_ps(r);
}

// 8 float32 values rounded to bfloat16.
inline void store8(uint16_t* p, __m256 v) {
    const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round8(v)), 16);
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

inline float widen(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

inline uint16_t round_bf16(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if (f != f) return 0x7FC0;
    return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

}  // namespace spyre_bf16
