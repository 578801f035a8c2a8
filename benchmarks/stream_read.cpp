// A plain streaming read of a tensor's bytes: the memory bandwidth a read that does nothing else reaches, the
// yardstick of bench_engine_limit.py (next to torch's own reads, which compute as they read). torch's threads each
// take one contiguous share; every 64-byte line is loaded (two 32-byte loads, AVX2) and the line 4 KB ahead
// prefetched. -> the lines' XOR folded to one number (so that nothing is optimised away).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <atomic>

namespace {

int64_t stream_read(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && x.device().is_cpu(), "stream_read: a contiguous CPU tensor");
  const char* p = static_cast<const char*>(x.data_ptr());
  const int64_t lines = static_cast<int64_t>(x.nbytes()) / 64;
  TORCH_CHECK(reinterpret_cast<uintptr_t>(p) % 64 == 0, "stream_read: the tensor must start on a 64-byte line");
  std::atomic<int64_t> folded{0};
  at::parallel_for(0, lines, 1 << 14, [&](int64_t a, int64_t b) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t l = a; l < b; ++l) {
      _mm_prefetch(p + (l + 64) * 64, _MM_HINT_T0);  // 4 KB ahead (a prefetch past the end does not fault)
      acc = _mm256_xor_si256(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + l * 64)));
      acc = _mm256_xor_si256(acc, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + l * 64 + 32)));
    }
    folded ^= _mm256_extract_epi64(acc, 0) ^ _mm256_extract_epi64(acc, 1) ^ _mm256_extract_epi64(acc, 2) ^
              _mm256_extract_epi64(acc, 3);
  });
  return folded.load();
}

}  // namespace

TORCH_LIBRARY(paradraft_bench, m) { m.def("stream_read(Tensor x) -> int"); }
TORCH_LIBRARY_IMPL(paradraft_bench, CPU, m) { m.impl("stream_read", &stream_read); }
