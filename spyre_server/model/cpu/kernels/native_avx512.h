// Whether the native float32-compute kernels (linear_f32.cpp, attention.cpp) run 512 bits wide:
// each call says whether it may (its avx512 argument: model.native_avx512), and they do where it
// is nonzero and the CPU has AVX512F. The same bits either way.
#pragma once

extern const bool spyre_cpu_avx512f;  // defined in linear_f32.cpp

inline bool spyre_avx512_wide(int avx512) { return avx512 != 0 && spyre_cpu_avx512f; }
