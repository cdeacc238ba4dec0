// The blocks of a packed bfloat16 [N][K] weight, as both bfloat16 linear kernels pack them
// (linear_bf16.cpp states its layout; linear_amx.cpp reorders the bytes of every 16 pairs into
// tiles): output columns in blocks of 64 (the last padded with zero columns), each block the
// pairs of K in order, 256 bytes a pair (64 columns' (w[n][2p], w[n][2p + 1]), in four groups of
// 16 columns).
#pragma once

#include <stdint.h>
#include <stdlib.h>

namespace spyre_linear {

constexpr int64_t kBlockCols = 64;    // output columns per packed block
constexpr int64_t kGroupCols = 16;    // columns per group: one 512-bit register, one tile row
constexpr int64_t kPairValues = 128;  // bfloat16 values of one pair of a block (64 columns x 2)

inline int64_t pairs_of(int64_t K) { return (K + 1) / 2; }
inline int64_t blocks_of(int64_t N) { return (N + kBlockCols - 1) / kBlockCols; }

namespace {  // one set of buffers per file and thread

// The calling thread's buffer number Slot of at least `bytes` bytes (kept and grown, 64-byte
// aligned), or nullptr without memory. A caller takes one slot per use it holds at once.
template <int Slot>
inline void* thread_scratch(int64_t bytes) {
    thread_local void* buffer = nullptr;
    thread_local int64_t capacity = 0;
    if (bytes > capacity) {
        free(buffer);
        buffer = aligned_alloc(64, (bytes + 63) / 64 * 64);
        capacity = buffer == nullptr ? 0 : bytes;
    }
    return buffer;
}

// The calling thread's bfloat16 buffer for one block of P pairs: where an FP8 block is converted.
inline uint16_t* thread_block_scratch(int64_t P) {
    return static_cast<uint16_t*>(thread_scratch<0>(P * kPairValues * 2));
}

}  // namespace

}  // namespace spyre_linear

#if defined(__clang__) ? __clang_major__ >= 9 : defined(__GNUC__) && __GNUC__ >= 10
#include <immintrin.h>

namespace spyre_linear {
namespace {  // internal in each file: compiled for the target of the code that inlines it

// Group c0 / 16 of one output row: y[c] = bf16(v[c - c0] * scale[c] + bias[c]) for the columns
// c0 .. c0 + 15 below `cols` (the block's columns that exist), without a scale or a bias where
// they are null, in float32 under the caller's MXCSR, rounded as torch rounds (to nearest, ties
// to even, NaN to 0x7FC0).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) inline void store_group(
    __m512 v, const float* scale, const uint16_t* bias, int64_t c0, int64_t cols, uint16_t* y) {
    if (c0 >= cols) return;
    const __mmask16 valid = cols - c0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (cols - c0)) - 1);
    if (scale != nullptr) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale + c0));
    if (bias != nullptr) {
        const __m256i b = _mm256_maskz_loadu_epi16(valid, bias + c0);
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16(y + c0, valid, _mm512_cvtepi32_epi16(rounded));
}

}  // namespace
}  // namespace spyre_linear
#endif
