// float8_e4m3fn values as bfloat16 (exact: 4 exponent and 3 mantissa bits fit), for the two
// linear kernels that take FP8 weights (linear_bf16.cpp, linear_amx.cpp): a table for any
// x86-64 code, and an AVX-512 conversion 32 values at a time.
#pragma once

#include <stdint.h>

namespace spyre_linear {
namespace {  // internal in each file: compiled for the target of the code that inlines it

// bfloat16 bits of a finite float8_e4m3fn value.
constexpr uint16_t fp8_bf16_bits(uint8_t b) {
    const uint16_t sign = static_cast<uint16_t>((b & 0x80u) << 8);
    const uint16_t magnitude = b & 0x7Fu;
    if (magnitude >= 8) return sign | static_cast<uint16_t>((magnitude << 4) + (120u << 7));
    // A subnormal m * 2^-9 is normal in bfloat16: m = 2^e' * 1.f with e' = floor(log2 m).
    if (magnitude == 0) return sign;
    const int top = magnitude >= 4 ? 2 : magnitude >= 2 ? 1 : 0;
    const uint16_t fraction = static_cast<uint16_t>(((magnitude << (7 - top)) & 0x7Fu));
    return sign | static_cast<uint16_t>(((127 - 9 + top) << 7) | fraction);
}

struct Fp8Table {
    uint16_t bits[256];
    constexpr Fp8Table() : bits() {
        for (int b = 0; b < 256; b++) bits[b] = fp8_bf16_bits(static_cast<uint8_t>(b));
    }
};
constexpr Fp8Table kFp8 {};

}  // namespace
}  // namespace spyre_linear

#if defined(__clang__) ? __clang_major__ >= 9 : defined(__GNUC__) && __GNUC__ >= 10
#include <immintrin.h>

#define SPYRE_FP8_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

namespace spyre_linear {
namespace {

// The conversion 32 values (32 bytes) at a time, the table's bits: each byte widened to a
// 16-bit lane, a normal value's exponent rebiased in place, a subnormal's (exponent 0) bits
// taken from the table, the sign put back.
struct Fp8ToBf16 {
    __m512i subnormals, magnitude_bits, rebias, exponent, sign, sign_and_magnitude;

    SPYRE_FP8_AVX512 Fp8ToBf16() {
        alignas(64) uint16_t small[32] = {};
        for (int m = 0; m < 8; m++) small[m] = kFp8.bits[m];
        subnormals = _mm512_load_si512(small);
        magnitude_bits = _mm512_set1_epi16(0x7F0);
        rebias = _mm512_set1_epi16(120 << 7);
        exponent = _mm512_set1_epi16(0x78);
        sign = _mm512_set1_epi16(static_cast<short>(0x8000));
        sign_and_magnitude = _mm512_set1_epi16(static_cast<short>(0x87F0));
    }

    // 32 values none of which has exponent 0: each byte sign-extended to a 16-bit lane, shifted
    // so that its sign is the lane's and its exponent and mantissa bfloat16's, the exponent
    // rebiased.
    SPYRE_FP8_AVX512 inline __m512i normal(const uint8_t* src) const {
        const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
        return _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(b, 4), sign_and_magnitude), rebias);
    }

    // 32 values, any.
    SPYRE_FP8_AVX512 inline __m512i operator()(const uint8_t* src) const {
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
        const __m512i normal = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(b, 4), magnitude_bits), rebias);
        // Exponent 0: the table's entry (permutexvar reads the low 5 bits: the mantissa here).
        const __m512i value = _mm512_mask_permutexvar_epi16(normal, _mm512_testn_epi16_mask(b, exponent), b, subnormals);
        // Bit by bit, sign ? b << 8 : value: the sign from the byte, the rest from value.
        return _mm512_ternarylogic_epi32(sign, _mm512_slli_epi16(b, 8), value, 0xCA);
    }
};

}  // namespace
}  // namespace spyre_linear
#endif
