// float8_e4m3fn values as bfloat16 (exact: 4 exponent and 3 mantissa bits fit), for the two
// linear kernels that take FP8 weights (linear_bf16.cpp, linear_amx.cpp): a table for any
// x86-64 code, an AVX-512 conversion 32 values at a time (linear_bf16.cpp), and one 64 values at
// a time of the values times 2^-8 (linear_amx.cpp).
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
#define SPYRE_FP8_VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi")))

namespace spyre_linear {
namespace {

// The scaled conversion's factor: 2^-8, so that rebiasing a normal value's exponent is an OR.
constexpr float kFp8ScaledBy = 1.0f / 256.0f;

// 64 values stored as two rows of 32 interleaved (byte 2i: the first row's value i, byte 2i + 1:
// the second's), converted to bfloat16 times kFp8ScaledBy (exact: every float8_e4m3fn value
// times 2^-8 is a normal bfloat16 value) into 64 contiguous bfloat16 values, the first row's
// then the second's.
// - `normal`, for 64 values none of which has exponent 0: each byte moved to the top of a 16-bit
//   lane and shifted right 4 (arithmetically: the sign stays on top), so that its exponent and
//   mantissa sit in bfloat16's; the exponent rebiased by 112 (120 less 8): an OR, as 112 has no
//   bit in the 4 exponent bits' places.
// - `any`: each value's bits from two 128-entry byte tables (the low and high bytes of the
//   scaled magnitude's bits, indexed by the byte's low 7 bits), the sign put back.
struct Fp8PairedRowsToScaledBf16 {
    __m512i even_to_high, keep, rebias, low_bytes[2], high_bytes[2], sign;

    SPYRE_FP8_VBMI Fp8PairedRowsToScaledBf16() {
        alignas(64) uint8_t control[64];
        for (int i = 0; i < 64; i += 2) {
            control[i] = 0x80;  // zero
            control[i + 1] = static_cast<uint8_t>(i % 16);  // the lane's even byte, on top
        }
        even_to_high = _mm512_load_si512(control);
        keep = _mm512_set1_epi16(static_cast<short>(0x87F0));  // sign, exponent's low 4, mantissa
        rebias = _mm512_set1_epi16(112 << 7);
        alignas(64) uint8_t low[128], high[128];
        for (int m = 0; m < 128; m++) {
            const uint16_t bits = m == 0 || m == 0x7F ? 0 : static_cast<uint16_t>(kFp8.bits[m] - (8 << 7));
            low[m] = static_cast<uint8_t>(bits & 0xFF);
            high[m] = static_cast<uint8_t>(bits >> 8);
        }
        low_bytes[0] = _mm512_load_si512(low);
        low_bytes[1] = _mm512_load_si512(low + 64);
        high_bytes[0] = _mm512_load_si512(high);
        high_bytes[1] = _mm512_load_si512(high + 64);
        sign = _mm512_set1_epi8(static_cast<char>(0x80));
    }

    SPYRE_FP8_VBMI inline void normal(const uint8_t* src, uint16_t* dst) const {
        const __m512i b = _mm512_load_si512(src);
        const __m512i first = _mm512_srai_epi16(_mm512_shuffle_epi8(b, even_to_high), 4);
        const __m512i second = _mm512_srai_epi16(b, 4);
        // (lane & keep) | rebias
        _mm512_store_si512(dst, _mm512_ternarylogic_epi32(first, keep, rebias, 0xEA));
        _mm512_store_si512(dst + 32, _mm512_ternarylogic_epi32(second, keep, rebias, 0xEA));
    }

    SPYRE_FP8_VBMI inline void any(const uint8_t* src, uint16_t* dst) const {
        const __m512i b = _mm512_load_si512(src);
        const __m512i low = _mm512_permutex2var_epi8(low_bytes[0], b, low_bytes[1]);
        const __m512i magnitude = _mm512_permutex2var_epi8(high_bytes[0], b, high_bytes[1]);
        const __m512i high = _mm512_ternarylogic_epi32(b, sign, magnitude, 0xEA);  // (b & sign) | magnitude
        const __mmask64 odd = 0xAAAAAAAAAAAAAAAAull;
        _mm512_store_si512(dst, _mm512_mask_blend_epi8(odd, low, _mm512_slli_epi16(high, 8)));
        _mm512_store_si512(dst + 32, _mm512_mask_blend_epi8(odd, _mm512_srli_epi16(low, 8), high));
    }
};

}  // namespace
}  // namespace spyre_linear
#endif
