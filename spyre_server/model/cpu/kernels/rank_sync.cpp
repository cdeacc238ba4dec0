// Signals between the tensor-parallel ranks of one host, through flags in shared memory
// (spyre_server/model/parallel/shared_sum.py): a rank publishes that its partial result is in
// the shared buffer, and waits until every rank has published.
//
// Each rank writes only its own flag (one per cache line), a sequence number that grows by one
// per sum, so no read-modify-write is needed. The full fence before a flag is published makes
// every earlier store of this process visible first, streaming (non-temporal) stores that a
// large copy may use included; the fence after the wait keeps the buffer's reads after it.
#include <stdint.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

extern "C" {

// flag = value, after every earlier store of the calling thread is visible to other cores.
void spyre_rank_publish(int64_t* flag, int64_t value) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  __atomic_store_n(flag, value, __ATOMIC_RELEASE);
}

// 1 once each of the count flags (at flags[0], flags[stride], ...) is at least value, 0 when
// that has not happened within max_spins rounds (the caller asks again).
int spyre_rank_wait(const int64_t* flags, int64_t stride, int64_t count, int64_t value,
                    int64_t max_spins) {
  for (int64_t spin = 0; spin < max_spins; ++spin) {
    int64_t ready = 0;
    for (int64_t i = 0; i < count; ++i) {
      ready += __atomic_load_n(flags + i * stride, __ATOMIC_ACQUIRE) >= value;
    }
    if (ready == count) {
      __atomic_thread_fence(__ATOMIC_SEQ_CST);
      return 1;
    }
#if defined(__x86_64__)
    _mm_pause();
#endif
  }
  return 0;
}

}  // extern "C"
