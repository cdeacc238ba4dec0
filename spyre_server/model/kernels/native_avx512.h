// Whether the native float32-compute kernels (linear_f32.cpp, attention.cpp) run 512 bits wide:
// true on CPUs with AVX512F, switched by spyre_native_avx512() in linear_f32.cpp, which defines
// it. The same bits either way.
#pragma once

extern bool spyre_native_avx512_enabled;
