// SPYRE_DOT_BF16: defined where the compiler has the AMX intrinsics (GCC 11 or later, clang 12 or
// later) and SPYRE_NO_DOT_BF16 is not defined. The AMX and AVX512-BF16 kernels
// (attention_dot_bf16.cpp, linear_amx.cpp) are built only then; elsewhere their entry points are
// stubs that refuse every call, and spyre_dot_bf16_compiled() says 0. Also the tile
// configuration both AMX kernels load.
#pragma once

#include <stdint.h>

#if !defined(SPYRE_NO_DOT_BF16) && \
    (defined(__clang__) ? __clang_major__ >= 12 : defined(__GNUC__) && __GNUC__ >= 11)
#define SPYRE_DOT_BF16 1
#endif

namespace spyre_amx {

// The operand of ldtilecfg (palette 1): each tile's rows and bytes per row.
struct TileConfig {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

}  // namespace spyre_amx
