// paradraft's CPU kernels for a decoding or verification step: its projections (y = x @ W^T for a few rows of x)
// and its attention (a few queries per row against the KV cache).
//
// A decoding step multiplies 1 row (per sequence) by every weight matrix, a verification step K+1 rows: the time is
// the time to read the weights once from memory. On the 2-core AVX-512 host of BENCHMARKS.md ("The engine at the
// machine's limit") torch's bf16 path read them at ~10 GB/s and its float32 path at ~13 GB/s for 4 rows, against
// ~23 GB/s that the memory delivers. This kernel streams each weight row once (prefetching the next rows), and keeps
// up to 4 x-rows x 4 weight rows of float32 accumulators in registers: bf16 pairs by VDPBF16PS, or bf16 converted
// to float32 in registers where the CPU lacks it (a bf16 x bf16 product is exact in float32), float32 by FMA; AMX
// tiles for 5..16 bf16 rows.
//
// Ops (registered in the `paradraft` namespace, CPU):
//   small_linear(x [M, K], weights [N_i, K] ...) -> y [M, sum N_i], 1 <= M <= 64: the weights' outputs side by side
//   (q|k|v or gate|up in one call, no concatenated copy of the weights). x and every weight share one dtype
//   (bfloat16 or float32); accumulation in float32; y is rounded to x's dtype once, as torch's own linear does.
//   tile_linear(x [M, K] bf16, tiles [N_i/16, K/32, 16, 32] ...) -> y [M, sum N_i], M >= 1, AMX hosts: the
//   same product on weights packed once in the AMX tile layout (a verification step's rows read them as fast as
//   one row reads the weights in place). tiles_ready() -> whether tile_linear runs on this host.
//   decode_attention(q [B', n, H, D], kc, vc [B, KVH, S_max, D], rows [B'], pos [B', n], window, scale, sinks [H])
//   -> [B', n, H, D]: softmax attention of 1..16 queries per row over each row's visible cached keys, float32 inside.
// Work is split over torch's intra-op threads (at::parallel_for), so the kernels share torch's thread pool.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

namespace {

#ifdef __AVX512F__
constexpr int NB = 4;  // weight rows per block
constexpr int MB = 4;  // x rows per block

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // 16 bf16 -> 16 float32 (bf16 is the top half of a float32)
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load_tail(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_tail(const c10::BFloat16* p, __mmask16 m) {
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m256 half_sum(__m512 a) {  // 16 -> 8 lanes: low half + high half
  return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

// out[0..N_) = the lane sums of acc[0..N_): four at once by a tree of adds (19 instructions for 4 sums, against ~8
// for each one alone)
template <int N_>
inline void lane_sums(const __m512* acc, float* out) {
  if constexpr (N_ == 4) {
    __m256 ab = _mm256_hadd_ps(half_sum(acc[0]), half_sum(acc[1]));  // [a01 a23 b01 b23 | a45 a67 b45 b67]
    __m256 cd = _mm256_hadd_ps(half_sum(acc[2]), half_sum(acc[3]));
    __m256 abcd = _mm256_hadd_ps(ab, cd);  // [a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7]
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  } else {
    for (int j = 0; j < N_; ++j) out[j] = _mm512_reduce_add_ps(acc[j]);
  }
}

// acc[m][j] = sum_k xf[m][k] * w[j][k] for `mb` x rows (float32, [mb, K]) and `nb` weight rows.
template <typename W, int M_, int N_>
inline void block(const float* xf, int64_t K, const W* const* w, float* out, int64_t ldo) {
  __m512 acc[M_][N_];
  _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m)
    _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    // the next block's rows (contiguous after these): the hardware prefetcher alone left the kernel at ~13 GB/s
    _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) _mm_prefetch((const char*)(w[j] + N_ * K + k), _MM_HINT_T0);
    __m512 wv[N_];
    _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) wv[j] = load16(w[j] + k);
    _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m) {
      __m512 xv = _mm512_loadu_ps(xf + m * K + k);
      _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  if (k < K) {
    __mmask16 tail = (__mmask16)((1u << (K - k)) - 1);
    __m512 wv[N_];
    _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) wv[j] = load_tail(w[j] + k, tail);
    _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m) {
      __m512 xv = _mm512_maskz_loadu_ps(tail, xf + m * K + k);
      _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m)
    lane_sums<N_>(acc[m], out + m * ldo);
}

#ifdef __AVX512BF16__
// bf16 x bf16 pairs with VDPBF16PS: 32 weights per instruction, x read as bf16 (no conversion).
template <int M_, int N_>
inline void block_bf16(const c10::BFloat16* x, int64_t K, const c10::BFloat16* const* w, float* out, int64_t ldo) {
  __m512 acc[M_][N_];
  _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m)
    _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) _mm_prefetch((const char*)(w[j] + N_ * K + k), _MM_HINT_T0);
    __m512bh wv[N_];
    _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w[j] + k);
    _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m) {
      __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * K + k);
      _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  if (k < K) {
    __mmask32 tail = (__mmask32)((1ull << (K - k)) - 1);
    __m512bh wv[N_];
    _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) wv[j] = (__m512bh)_mm512_maskz_loadu_epi16(tail, w[j] + k);
    _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m) {
      __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * K + k);
      _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m)
    lane_sums<N_>(acc[m], out + m * ldo);
}
template <typename W, int M_, int N_>
inline void block(const c10::BFloat16* x, int64_t K, const c10::BFloat16* const* w, float* out, int64_t ldo) {
  block_bf16<M_, N_>(x, K, w, out, ldo);
}
#endif  // __AVX512BF16__
#else  // AVX2 and FMA only (no AVX-512): small_linear with 8-lane float32 registers (no tiles)

constexpr int NB = 4;  // weight rows per block
constexpr int MB = 4;  // x rows per block; `block` keeps at most 8 accumulators in the 16 ymm registers (with the
                       // weight vectors and x), so 3-4 x rows take a block's weight rows two at a time

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // 8 bf16 -> 8 float32 (bf16 is the top half of a float32)
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum8(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// out[0..N_) = the lane sums of acc[0..N_) (four at once by a tree of horizontal adds)
template <int N_>
inline void lane_sums(const __m256* acc, float* out) {
  if constexpr (N_ == 4) {
    __m256 ab = _mm256_hadd_ps(acc[0], acc[1]);  // [a01 a23 b01 b23 | a45 a67 b45 b67]
    __m256 cd = _mm256_hadd_ps(acc[2], acc[3]);
    __m256 abcd = _mm256_hadd_ps(ab, cd);  // [a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7]
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
  } else {
    for (int j = 0; j < N_; ++j) out[j] = hsum8(acc[j]);
  }
}

// acc[m][j] = sum_k xf[m][k] * w[j][k] for `mb` x rows (float32, [mb, K]) and `nb` weight rows: 16 k per step (one
// 64-byte line of float32 weights, half of one of bf16), the tail of K % 8 by scalars.
template <typename W, int M_, int N_>
inline void block_regs(const float* xf, int64_t K, const W* const* w, float* out, int64_t ldo) {
  __m256 acc[M_][N_];
  _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m)
    _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) acc[m][j] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    // the next block's rows (contiguous after these), as in the AVX-512 build
    _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) _mm_prefetch((const char*)(w[j] + N_ * K + k), _MM_HINT_T0);
    _Pragma("GCC unroll 2") for (int h = 0; h < 16; h += 8) {
      __m256 wv[N_];
      _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) wv[j] = load8(w[j] + k + h);
      _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m) {
        __m256 xv = _mm256_loadu_ps(xf + m * K + k + h);
        _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) acc[m][j] = _mm256_fmadd_ps(xv, wv[j], acc[m][j]);
      }
    }
  }
  for (; k + 8 <= K; k += 8) {
    __m256 wv[N_];
    _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) wv[j] = load8(w[j] + k);
    _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m) {
      __m256 xv = _mm256_loadu_ps(xf + m * K + k);
      _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) acc[m][j] = _mm256_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m) {
    lane_sums<N_>(acc[m], out + m * ldo);
    for (int j = 0; j < N_; ++j)
      for (int64_t t = k; t < K; ++t) out[m * ldo + j] += xf[m * K + t] * static_cast<float>(w[j][t]);
  }
}

// M_ x rows against N_ weight rows: in one pass while the accumulators fit (M_ * N_ <= 8), else the weight rows two
// at a time (each weight row still read once for all M_ x rows: converting it, not reading x, is the cost)
template <typename W, int M_, int N_>
inline void block(const float* xf, int64_t K, const W* const* w, float* out, int64_t ldo) {
  if constexpr (M_ * N_ <= 8 || N_ % 2 != 0) {
    block_regs<W, M_, N_>(xf, K, w, out, ldo);
  } else {
    _Pragma("GCC unroll 4") for (int j = 0; j < N_; j += 2) block_regs<W, M_, 2>(xf, K, w + j, out + j, ldo);
  }
}

// A decoding step (1 row; 1-4 in float32) is bound by reading the weights, not by arithmetic. `block` reads a
// block's 4 weight rows side by side, 4 streams that each end after one row (1,152 bytes in bf16), and the
// hardware prefetcher streamed them at ~21 GB/s on the 2-core AMD EPYC (Zen 3) of BENCHMARKS.md ("The
// projections on AVX2"). `block_stream` reads the block's rows one after the other, each front to back: one
// stream, prefetched 1 KB ahead: 26-31 GB/s for 1 row in bf16 there. From 8 rows on (bf16: 3) the arithmetic is
// the bound and `block`'s register blocking is faster (5-8% at 8 rows), so `rows_block` takes this path for 1-4
// float32 rows and 1-2 bf16 rows.
constexpr int64_t STREAM_AHEAD = 1024;  // bytes (measured on that host: 512 < 1024 ~ 1536 > 2048, 4096, 8192)

// red[m] = 8 partial sums of xf[m] . w (float32, [M_, K], the K % 8 tail left to the caller), w read front to
// back, 32 k per step in C chains per x row (FMA latency)
template <typename W, int M_>
inline void stream_row(const float* xf, int64_t K, const W* w, __m256* red) {
  constexpr int C = M_ == 1 ? 4 : 2;
  __m256 acc[M_][C];
  _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m)
    _Pragma("GCC unroll 4") for (int c = 0; c < C; ++c) acc[m][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    _Pragma("GCC unroll 2") for (int b = 0; b < 32 * static_cast<int>(sizeof(W)); b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(w + k) + b + STREAM_AHEAD, _MM_HINT_T0);
    _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q) {
      const __m256 wv = load8(w + k + 8 * q);
      _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m)
        acc[m][q % C] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + m * K + k + 8 * q), wv, acc[m][q % C]);
    }
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 wv = load8(w + k);
    _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m)
      acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + m * K + k), wv, acc[m][0]);
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m) {
    red[m] = acc[m][0];
    _Pragma("GCC unroll 4") for (int c = 1; c < C; ++c) red[m] = _mm256_add_ps(red[m], acc[m][c]);
  }
}

// out[m][j] = xf[m] . w[j] for M_ x rows and N_ weight rows, each weight row read once, front to back
template <typename W, int M_, int N_>
inline void block_stream(const float* xf, int64_t K, const W* const* w, float* out, int64_t ldo) {
  __m256 red[N_][M_];  // [weight row][x row]
  _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) stream_row<W, M_>(xf, K, w[j], red[j]);
  const int64_t k8 = K - K % 8;
  _Pragma("GCC unroll 8") for (int m = 0; m < M_; ++m) {
    __m256 col[N_];
    _Pragma("GCC unroll 8") for (int j = 0; j < N_; ++j) col[j] = red[j][m];
    lane_sums<N_>(col, out + m * ldo);
    for (int j = 0; j < N_; ++j)
      for (int64_t t = k8; t < K; ++t) out[m * ldo + j] += xf[m * K + t] * static_cast<float>(w[j][t]);
  }
}
#endif  // __AVX512F__


#ifdef __AMX_BF16__
// AMX (bf16 tiles) for 2..16 x rows: y^T = W x^T with W as the tiles' A operand, read in place (16 weight rows x 32
// k per tile load, its row stride the weight's), and x packed once per call in the B layout [K/2, M, 2]. Every tile
// multiply covers all M rows, so 4 or 16 rows cost what 1 costs: the weights' read.
#include <sys/syscall.h>
#include <unistd.h>

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool amx_permitted() {  // Linux asks a process to request the AMX tile state once
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

// tiles 0-3: C (16 outputs x M float32), 4-5: A (16 weight rows x 32 bf16), 6: B (16 k pairs x M x 2 bf16)
void configure(int64_t M) {
  TileConfig cfg;
  for (int t = 0; t < 4; ++t) cfg.rows[t] = 16, cfg.colsb[t] = M * 4;
  for (int t = 4; t < 6; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  cfg.rows[6] = 16, cfg.colsb[6] = M * 4;
  _tile_loadconfig(&cfg);
}

// one block of 16 rows of w [*, K] against packed x -> out[m * N + col0 + i]. The block is 16 * K contiguous bf16,
// the tile loads walk it in 64-byte columns; the next block is prefetched linearly, 16 lines per step, alongside.
inline void amx_block(const c10::BFloat16* w, int64_t K, const c10::BFloat16* xpack, int64_t M,
                      c10::BFloat16* out, int64_t N, int64_t col0) {
  const int64_t lda = K * 2;  // bytes between weight rows
  const char* next = reinterpret_cast<const char*>(w + 16 * K);
  _tile_zero(0);
  for (int64_t k = 0, t = 0; k < K; k += 32, ++t) {
    for (int l = 0; l < 16; ++l) _mm_prefetch(next + (t * 16 + l) * 64, _MM_HINT_T0);
    _tile_loadd(6, xpack + (k / 2) * M * 2, M * 4);
    _tile_loadd(4, w + k, lda);
    _tile_dpbf16ps(0, 4, 6);
  }
  alignas(64) float c[16 * 16];
  _tile_stored(0, c, M * 4);
  for (int i = 0; i < 16; ++i)
    for (int64_t m = 0; m < M; ++m) out[m * N + col0 + i] = c10::BFloat16(c[i * M + m]);  // rounded once
}

// every weight's rows (a multiple of 16) in units of 16; K a multiple of 32; 2 <= M <= 16
void run_amx(const c10::BFloat16* x, int64_t M, int64_t K, const std::vector<at::Tensor>& ws, c10::BFloat16* y,
             int64_t N) {
  std::vector<c10::BFloat16> xpack(K * M);  // [K/2, M, 2]: x[m, 2p + e] at (p * M + m) * 2 + e
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xpack[((k / 2) * M + m) * 2 + (k & 1)] = x[m * K + k];
  std::vector<const c10::BFloat16*> base;
  std::vector<int64_t> unit0, col0;  // first unit and first output column of each weight
  int64_t units = 0, col = 0;
  for (const auto& w : ws) {
    base.push_back(w.data_ptr<c10::BFloat16>());
    unit0.push_back(units);
    col0.push_back(col);
    units += w.size(0) / 16;
    col += w.size(0);
  }
  unit0.push_back(units);
  at::parallel_for(0, units, 4, [&](int64_t u0, int64_t u1) {
    configure(M);
    for (int64_t u = u0; u < u1; ++u) {
      size_t i = 0;
      while (unit0[i + 1] <= u) ++i;
      const int64_t r = u - unit0[i];  // block within weight i
      amx_block(base[i] + r * 16 * K, K, xpack.data(), M, y, N, col0[i] + r * 16);
    }
    _tile_release();
  });
}

// ---- tile-packed weights: tile_linear
// A weight [N, K] packed once (pack_tiles in kernels/__init__.py) as [N/16, K/32, 16, 32]: for each 16 outputs and
// 32 k, one AMX B tile in its pair layout (row p: outputs i = 0..15 of k 2p, 2p+1 side by side), 1 KB of
// contiguous memory read as one stream. x is the A operand, read in place (M rows of 32 k); C is [M, 16 outputs],
// so each row's 16 outputs are rounded and stored as one vector. Tiles alternate with the parity of the k slice,
// so the loads of the next slice are in flight while the products of this one run: reading weights in place as A
// (amx_block) stalled on its strided tile loads, and one accumulator chained every product after the last. On the
// host of BENCHMARKS.md a 4-row verification step's projections then cost what a 1-row step's cost.
constexpr int64_t TILE_PREFETCH = 4 * 1024;  // bytes ahead of the slices being read (measured: 4 KB > 0, 8, 16 KB)

// C tile -> rows [m0, m0 + rows) of out, columns col0..col0+15, rounded once
inline void store_rows(int tile_is_1, int64_t rows, c10::BFloat16* out, int64_t N, int64_t m0, int64_t col0) {
  alignas(64) float c[16 * 16];
  if (tile_is_1) _tile_stored(1, c, 64); else _tile_stored(0, c, 64);
  for (int64_t m = 0; m < rows; ++m)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (m0 + m) * N + col0),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + m * 16)));
}

// up to 16 x rows: blocks `nblk` (1 or 2, each 16 outputs) of packed weight p. Tiles: C 0-1 (per block), A 2-3
// (x, by k parity), B 4-7 (block a even/odd, block b even/odd)
inline void tile_blocks(const c10::BFloat16* p, int nblk, int64_t K, const c10::BFloat16* x, int64_t M,
                        c10::BFloat16* out, int64_t N, int64_t col0) {
  const c10::BFloat16* pb = p + 16 * K;
  const char* ahead = reinterpret_cast<const char*>(p) + TILE_PREFETCH;
  const int64_t T = K / 32, blk_bytes = 16 * K * 2, lda = K * 2;
  _tile_zero(0);
  _tile_zero(1);
  int64_t t = 0;
  for (; t + 2 <= T; t += 2) {
    for (int l = 0; l < 32; ++l) {  // the next 2 KB of each block
      // block a's stream, past its end, would prefetch block b's first KBs, which b read at the unit's start: it
      // prefetches the next unit's block b instead (2 blocks further), which no stream reaches before it is read
      const int64_t off = TILE_PREFETCH + t * 1024 + l * 64;
      _mm_prefetch(reinterpret_cast<const char*>(p) + (off < blk_bytes ? off : off + 2 * blk_bytes), _MM_HINT_T0);
      if (nblk == 2) _mm_prefetch(ahead + blk_bytes + t * 1024 + l * 64, _MM_HINT_T0);
    }
    _tile_loadd(2, x + t * 32, lda);
    _tile_loadd(3, x + (t + 1) * 32, lda);
    _tile_loadd(4, p + t * 512, 64);
    _tile_loadd(5, p + (t + 1) * 512, 64);
    _tile_dpbf16ps(0, 2, 4);
    if (nblk == 2) {
      _tile_loadd(6, pb + t * 512, 64);
      _tile_loadd(7, pb + (t + 1) * 512, 64);
      _tile_dpbf16ps(1, 2, 6);
      _tile_dpbf16ps(1, 3, 7);
    }
    _tile_dpbf16ps(0, 3, 5);
  }
  for (; t < T; ++t) {
    _tile_loadd(2, x + t * 32, lda);
    _tile_loadd(4, p + t * 512, 64);
    _tile_dpbf16ps(0, 2, 4);
    if (nblk == 2) {
      _tile_loadd(6, pb + t * 512, 64);
      _tile_dpbf16ps(1, 2, 6);
    }
  }
  for (int b = 0; b < nblk; ++b) store_rows(b, M, out, N, 0, col0 + 16 * b);
}

// 17..32 x rows: one block against two groups of x rows (16 and M - 16). Tiles: C 0-1 (per group), A 2-3 (groups,
// even k) and 5-6 (odd k), B 4 (even) and 7 (odd)
inline void tile_block_wide(const c10::BFloat16* p, int64_t K, const c10::BFloat16* x, int64_t M,
                            c10::BFloat16* out, int64_t N, int64_t col0, int64_t valid) {  // valid: rows stored
  const char* ahead = reinterpret_cast<const char*>(p) + TILE_PREFETCH;
  const c10::BFloat16* x1 = x + 16 * K;
  const int64_t T = K / 32, lda = K * 2;
  _tile_zero(0);
  _tile_zero(1);
  int64_t t = 0;
  for (; t + 2 <= T; t += 2) {
    for (int l = 0; l < 32; ++l) _mm_prefetch(ahead + t * 1024 + l * 64, _MM_HINT_T0);
    _tile_loadd(4, p + t * 512, 64);
    _tile_loadd(2, x + t * 32, lda);
    _tile_loadd(3, x1 + t * 32, lda);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 3, 4);
    _tile_loadd(7, p + (t + 1) * 512, 64);
    _tile_loadd(5, x + (t + 1) * 32, lda);
    _tile_loadd(6, x1 + (t + 1) * 32, lda);
    _tile_dpbf16ps(0, 5, 7);
    _tile_dpbf16ps(1, 6, 7);
  }
  for (; t < T; ++t) {
    _tile_loadd(4, p + t * 512, 64);
    _tile_loadd(2, x + t * 32, lda);
    _tile_loadd(3, x1 + t * 32, lda);
    _tile_dpbf16ps(0, 2, 4);
    _tile_dpbf16ps(1, 3, 4);
  }
  store_rows(0, std::min<int64_t>(16, valid), out, N, 0, col0);
  if (valid > 16) store_rows(1, valid - 16, out, N, 16, col0);
}

at::Tensor tile_linear(const at::Tensor& x, at::TensorList tiles) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu() && x.scalar_type() == at::kBFloat16,
              "tile_linear: x must be a contiguous bfloat16 CPU [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && K % 32 == 0, "tile_linear: at least 1 row and K a multiple of 32");
  TORCH_CHECK(amx_permitted(), "tile_linear: the OS did not grant the AMX tile state");
  const bool wide = M > 16;
  // beyond 32 rows (a prefill): x zero-padded to groups of 32 rows, each weight block read from memory once and
  // applied to every group while it is in the cache
  const int64_t groups = M > 32 ? (M + 31) / 32 : 1, Mp = M > 32 ? groups * 32 : M;
  std::vector<const c10::BFloat16*> base;
  std::vector<int64_t> unit0, col0, nblocks;  // per weight: first unit, first output column, blocks of 16 outputs
  int64_t units = 0, N = 0;
  for (const auto& p : tiles) {
    TORCH_CHECK(p.dim() == 4 && p.size(1) * 32 == K && p.size(2) == 16 && p.size(3) == 32 && p.is_contiguous() &&
                p.scalar_type() == at::kBFloat16, "tile_linear: every weight must be packed [N/16, K/32, 16, 32]");
    base.push_back(p.data_ptr<c10::BFloat16>());
    unit0.push_back(units);
    col0.push_back(N);
    nblocks.push_back(p.size(0));
    units += wide ? p.size(0) : (p.size(0) + 1) / 2;  // a unit: 2 blocks (the last of an odd count: 1); 1 when wide
    N += p.size(0) * 16;
  }
  unit0.push_back(units);
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor xpad = x;
  if (Mp != M) xpad = at::cat({x, at::zeros({Mp - M, K}, x.options())});
  const c10::BFloat16* xp = xpad.data_ptr<c10::BFloat16>();
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  const int64_t gm = M > 32 ? 32 : M;  // rows per group
  at::parallel_for(0, units, 2, [&](int64_t u0, int64_t u1) {
    TileConfig cfg;
    const int a_rows = wide ? 16 : (int)M;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;  // B: 16 k pairs x 16 outputs x 2
    cfg.rows[0] = cfg.rows[2] = a_rows;                                 // C and A of the first (or only) x rows
    cfg.rows[1] = cfg.rows[3] = wide ? (int)(gm - 16) : a_rows;         // C of the second block, or of rows 16..
    if (wide) cfg.rows[5] = 16, cfg.rows[6] = (int)(gm - 16);
    else cfg.rows[3] = a_rows;
    _tile_loadconfig(&cfg);
    size_t i = 0;
    for (int64_t u = u0; u < u1; ++u) {
      while (unit0[i + 1] <= u) ++i;
      if (wide) {
        const int64_t b = u - unit0[i];
        for (int64_t g = 0; g < groups; ++g)
          tile_block_wide(base[i] + b * 16 * K, K, xp + g * 32 * K, gm, yp + g * 32 * N, N, col0[i] + b * 16,
                          std::min<int64_t>(gm, M - g * 32));
      } else {
        const int64_t b = 2 * (u - unit0[i]);  // first block of this unit in weight i
        tile_blocks(base[i] + b * 16 * K, b + 1 < nblocks[i] ? 2 : 1, K, xp, M, yp, N, col0[i] + b * 16);
      }
    }
    _tile_release();
  });
  return y;
}

bool amx_fits(int64_t M, int64_t K, const std::vector<at::Tensor>& ws) {
  if (M < 5 || M > 16 || K % 32 != 0 || !amx_permitted()) return false;  // 1..4 rows: VDPBF16PS, measured faster
  for (const auto& w : ws)
    if (w.size(0) % 16 != 0) return false;
  return true;
}
#endif

// every x row against N_ weight rows, in blocks of MB x rows
template <typename W, typename X, int N_>
inline void rows_block(const X* xs, int64_t M, int64_t K, const W* const* w, float* out, int64_t ldo) {
#ifndef __AVX512F__
  // a decoding or verification step: the weights' rows read one after the other (block_stream); bf16 from 3 rows
  // on in `block`, whose register blocks share each x load between 2 weight rows: 4 bf16 rows are bound by the
  // arithmetic on AVX2, and `block` took 1-6% less time than block_stream in 5 of 7 interleaved runs
  if (M <= (std::is_same_v<W, float> ? 4 : 2)) {
    switch (M) {
      case 4: return block_stream<W, 4, N_>(xs, K, w, out, ldo);
      case 3: return block_stream<W, 3, N_>(xs, K, w, out, ldo);
      case 2: return block_stream<W, 2, N_>(xs, K, w, out, ldo);
      default: return block_stream<W, 1, N_>(xs, K, w, out, ldo);
    }
  }
#endif
  int64_t m = 0;
  for (; m + MB <= M; m += MB) block<W, MB, N_>(xs + m * K, K, w, out + m * ldo, ldo);
  switch (M - m) {
    case 3: block<W, 3, N_>(xs + m * K, K, w, out + m * ldo, ldo); break;
    case 2: block<W, 2, N_>(xs + m * K, K, w, out + m * ldo, ldo); break;
    case 1: block<W, 1, N_>(xs + m * K, K, w, out + m * ldo, ldo); break;
    default: break;
  }
}

// y [M, N] in W's dtype (float32 accumulators rounded once)
template <typename W, typename X>
void run(const X* xp, int64_t M, int64_t K, const std::vector<at::Tensor>& ws, W* yp, int64_t N) {
  std::vector<const W*> base;
  std::vector<int64_t> first;  // first output column of each weight
  int64_t col = 0;
  for (const auto& w : ws) {
    base.push_back(w.data_ptr<W>());
    first.push_back(col);
    col += w.size(0);
  }
  const int64_t nblocks = (N + NB - 1) / NB;
  at::parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    float tmp[64 * NB];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB, nb = std::min<int64_t>(NB, N - n0);
      const W* rows[NB];
      for (int64_t j = 0; j < nb; ++j) {  // global output column -> (weight, row)
        const int64_t n = n0 + j;
        size_t i = 0;
        while (i + 1 < first.size() && first[i + 1] <= n) ++i;
        rows[j] = base[i] + (n - first[i]) * K;
      }
      if (nb == NB) {
        rows_block<W, X, NB>(xp, M, K, rows, tmp, NB);
      } else {
        for (int64_t j = 0; j < nb; ++j) rows_block<W, X, 1>(xp, M, K, rows + j, tmp + j, NB);
      }
      for (int64_t m = 0; m < M; ++m)
        for (int64_t j = 0; j < nb; ++j) yp[m * N + n0 + j] = W(tmp[m * NB + j]);
    }
  });
}

at::Tensor small_linear(const at::Tensor& x, at::TensorList weights) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), "small_linear: x must be a contiguous CPU [M, K]");
  TORCH_CHECK(!weights.empty(), "small_linear: no weights");
  const int64_t K = x.size(1);
  int64_t N = 0;
  std::vector<at::Tensor> ws;
  for (const auto& w : weights) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
                "small_linear: every weight must be a contiguous [N, K] of x's dtype");
    ws.push_back(w);
    N += w.size(0);
  }
  TORCH_CHECK(x.size(0) <= 64, "small_linear: at most 64 rows");
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
#ifdef __AMX_BF16__
    if (amx_fits(M, K, ws)) {
      run_amx(x.data_ptr<c10::BFloat16>(), M, K, ws, yp, N);
      return y;
    }
#endif
#ifdef __AVX512BF16__
    run<c10::BFloat16, c10::BFloat16>(x.data_ptr<c10::BFloat16>(), M, K, ws, yp, N);
#else
    std::vector<float> xf(M * K);  // x in float32 once (not x.to(kFloat): ~6 us of dispatch per call, ~120 calls
    const c10::BFloat16* xb = x.data_ptr<c10::BFloat16>();  // per step of the embedded verifier)
    for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xb[i]);
    run<c10::BFloat16, float>(xf.data(), M, K, ws, yp, N);
#endif
    return y;
  }
  TORCH_CHECK(x.scalar_type() == at::kFloat, "small_linear: bfloat16 or float32 only");
  run<float, float>(x.data_ptr<float>(), M, K, ws, y.data_ptr<float>(), N);
  return y;
}

// ---- the attention's weighted sum of values, shared by the AVX-512 and the AVX2 build (V: the build's `Lanes`)
// of [RB, D] (row stride D) += the weights pr [RB] (row stride W) of cn values vf [cn, D], 4 vectors of the output
// (64 lanes in AVX-512, 32 in AVX2) at a time: RB x 4 accumulators, each value vector read once for the RB rows.
// Full blocks of 4 vectors have their accumulators fixed at compile time, so that they stay in registers (with the
// count of a block's vectors known only at run time they went to the stack and back for every value); a last block
// of 1-3 vectors (D = 48 in AVX2, 80 or 112 in AVX-512) takes the general loop.
template <typename V, int RB>
inline void weighted_values(const float* pr, int64_t W, const float* vf, int64_t cn, int64_t D, float* of) {
  using vec = typename V::vec;
  constexpr int64_t L = V::N;
  int64_t d0 = 0;
  for (; d0 + 4 * L <= D; d0 += 4 * L) {
    vec acc[RB][4];
    _Pragma("GCC unroll 4") for (int r = 0; r < RB; ++r)
      _Pragma("GCC unroll 4") for (int cc = 0; cc < 4; ++cc) acc[r][cc] = V::load(of + r * D + d0 + cc * L);
    for (int64_t t = 0; t < cn; ++t) {
      vec pv[RB];
      _Pragma("GCC unroll 4") for (int r = 0; r < RB; ++r) pv[r] = V::set1(pr[r * W + t]);
      _Pragma("GCC unroll 4") for (int cc = 0; cc < 4; ++cc) {
        const vec vv = V::load(vf + t * D + d0 + cc * L);
        _Pragma("GCC unroll 4") for (int r = 0; r < RB; ++r) acc[r][cc] = V::fma(pv[r], vv, acc[r][cc]);
      }
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < RB; ++r)
      _Pragma("GCC unroll 4") for (int cc = 0; cc < 4; ++cc) V::store(of + r * D + d0 + cc * L, acc[r][cc]);
  }
  for (; d0 < D; d0 += 4 * L) {
    const int64_t dn = std::min<int64_t>(4 * L, D - d0) / L;
    vec acc[RB][4];
    for (int r = 0; r < RB; ++r)
      for (int64_t cc = 0; cc < dn; ++cc) acc[r][cc] = V::load(of + r * D + d0 + cc * L);
    for (int64_t t = 0; t < cn; ++t) {
      vec pv[RB];
      for (int r = 0; r < RB; ++r) pv[r] = V::set1(pr[r * W + t]);
      for (int64_t cc = 0; cc < dn; ++cc) {
        const vec vv = V::load(vf + t * D + d0 + cc * L);
        for (int r = 0; r < RB; ++r) acc[r][cc] = V::fma(pv[r], vv, acc[r][cc]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int64_t cc = 0; cc < dn; ++cc) V::store(of + r * D + d0 + cc * L, acc[r][cc]);
  }
}

#ifdef __AVX512F__
// ---- decode_attention: the attention of a decoding or verification step
// Few queries per row (1..16) against a row's cached keys: scores, softmax and the weighted sum of values in one
// pass per (row, head), in float32, on the cache as it is (no gather of a subset of rows, no [rows, heads, n, S]
// intermediate). Inductor's fused loops for the same took ~1.6 ms of a batch-1 bf16 step of the embedded verifier at
// ~300 keys, and ~4.7 ms of a 4-token verification step.

// e^x for x <= 0 (scores minus their maximum): x = k ln2 + r, |r| <= ln2 / 2, e^r by its Taylor polynomial of degree
// 7 (relative error < 1e-8 there, below float32's rounding), times 2^k; -> 0 below -87 (e^-87 < float32's
// smallest normal)
inline __m512 exp_neg(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);  // ln2 in two parts: r exact
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, k));
}

// the softmax of one query's scores sr over its visible keys [a, b) (scaled by `scale`; a sink's logit, if any, in
// the denominator): sr[a, b) becomes exp(scale * s - max), and the normalizer 1 / sum is returned
inline float softmax_exp(float* sr, int64_t a, int64_t b, float scale, const float* sink) {
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 mv = _mm512_set1_ps(-INFINITY);
  for (int64_t t = a; t < b; t += 16) {
    __mmask16 m = (__mmask16)(b - t >= 16 ? 0xFFFF : (1u << (b - t)) - 1);
    mv = _mm512_mask_max_ps(mv, m, mv, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sr + t), sc));
  }
  float mx = _mm512_reduce_max_ps(mv);
  if (sink) mx = std::max(mx, *sink);
  __m512 sum = _mm512_setzero_ps(), mxv = _mm512_set1_ps(mx);
  for (int64_t t = a; t < b; t += 16) {
    __mmask16 m = (__mmask16)(b - t >= 16 ? 0xFFFF : (1u << (b - t)) - 1);
    __m512 e = _mm512_maskz_mov_ps(m, exp_neg(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, sr + t), sc, mxv)));
    _mm512_mask_storeu_ps(sr + t, m, e);
    sum = _mm512_add_ps(sum, e);
  }
  return 1.0f / (_mm512_reduce_add_ps(sum) + (sink ? std::exp(*sink - mx) : 0.0f));
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t D) {  // D a multiple of 16
  for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, load16(src + d));
}

// the float32 vectors of this build for weighted_values: 16 lanes
struct Lanes {
  using vec = __m512;
  static constexpr int64_t N = 16;
  static vec load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, vec a) { _mm512_storeu_ps(p, a); }
  static vec set1(float x) { return _mm512_set1_ps(x); }
  static vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
};

// one (row, kv head): R query rows qf [R, D] (float32: the group's heads x the step's queries) against the kv
// head's keys and values k, v [S_max, D] (row stride D), query r seeing keys [lo[r], hi[r]] and writing out[r]
// (D values in T), sink[r] its head's sink logit (or none). Keys and values are read once for every query of the
// group (bf16 ones converted to float32 once, float32 ones read where they are in the cache).
template <typename T>
void attend_group(const float* qf, int64_t R, int64_t D, const T* k, const T* v, const int64_t* lo,
                  const int64_t* hi, float scale, const float* sink, T* const* out, std::vector<float>& buf) {
  int64_t j0 = lo[0], S = hi[0] + 1;
  for (int64_t r = 1; r < R; ++r) j0 = std::min(j0, lo[r]), S = std::max(S, hi[r] + 1);
  const int64_t W = S - j0;  // keys any query sees
  constexpr int64_t CH = 64;  // keys per chunk of converted values
  buf.resize(R * W + 4 * D + CH * D + R * D);
  float* s = buf.data();       // [R, W] scores, then probabilities
  float* kf = s + R * W;       // [4, D] a block of keys in float32
  float* vf = kf + 4 * D;      // [CH, D] a chunk of values in float32
  float* of = vf + CH * D;     // [R, D] outputs in float32
  // scores: 4 keys at a time against every query (their lane sums by a tree of adds)
  int64_t j = j0;
  const int64_t row_bytes = D * sizeof(T);
  for (; j + 4 <= S; j += 4) {
    // the keys 16 ahead, and these keys' values (read after the softmax): the hardware prefetcher alone left a
    // batch of 32 rows reading the cache at ~9 GB/s
    for (int64_t x = 0; x < 4 * row_bytes; x += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(k + (j + 16) * D) + x, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v + j * D) + x, _MM_HINT_T1);
    }
    const float* kb = kf;  // the 4 keys in float32: float32 keys read where they are, bf16 converted
    if constexpr (std::is_same_v<T, float>) {
      kb = k + j * D;
    } else {
      for (int jj = 0; jj < 4; ++jj) to_float(k + (j + jj) * D, kf + jj * D, D);
    }
    for (int64_t r = 0; r < R; ++r) {
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int64_t d = 0; d < D; d += 16) {
        __m512 qv = _mm512_loadu_ps(qf + r * D + d);
        for (int jj = 0; jj < 4; ++jj) acc[jj] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kb + jj * D + d), acc[jj]);
      }
      lane_sums<4>(acc, s + r * W + (j - j0));
    }
  }
  for (; j < S; ++j) {
    const float* kb = kf;
    if constexpr (std::is_same_v<T, float>) {
      kb = k + j * D;
    } else {
      to_float(k + j * D, kf, D);
    }
    for (int64_t r = 0; r < R; ++r) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + r * D + d), _mm512_loadu_ps(kb + d), acc);
      s[r * W + (j - j0)] = _mm512_reduce_add_ps(acc);
    }
  }
  // softmax of each query over its visible keys (and its sink's logit in the denominator); 0 elsewhere
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * W;
    const int64_t a = lo[r] - j0, b = hi[r] + 1 - j0;  // [a, b) visible
    const __m512 inv = _mm512_set1_ps(softmax_exp(sr, a, b, scale, sink ? sink + r : nullptr));
    for (int64_t t = a; t < b; t += 16) {
      __mmask16 m = (__mmask16)(b - t >= 16 ? 0xFFFF : (1u << (b - t)) - 1);
      _mm512_mask_storeu_ps(sr + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sr + t), inv));
    }
    for (int64_t t = 0; t < a; ++t) sr[t] = 0.0f;
    for (int64_t t = b; t < W; ++t) sr[t] = 0.0f;
  }
  // out = p @ v: a chunk of CH values at a time, every query's weighted sum over it (weighted_values)
  for (int64_t x = 0; x < R * D; ++x) of[x] = 0.0f;
  for (int64_t c0 = 0; c0 < W; c0 += CH) {
    const int64_t cn = std::min(CH, W - c0);
    const float* vb = vf;  // float32 values read where they are, bf16 ones converted a chunk at a time
    if constexpr (std::is_same_v<T, float>) {
      vb = v + (j0 + c0) * D;
    } else {
      for (int64_t t = 0; t < cn; ++t) to_float(v + (j0 + c0 + t) * D, vf + t * D, D);
    }
    int64_t r = 0;  // 2 rows at once: each value vector read once for both
    for (; r + 2 <= R; r += 2) weighted_values<Lanes, 2>(s + r * W + c0, W, vb, cn, D, of + r * D);
    if (r < R) weighted_values<Lanes, 1>(s + r * W + c0, W, vb, cn, D, of + r * D);
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < D; ++d) out[r][d] = T(of[r * D + d]);  // rounded once
}

#else  // AVX2 build: the same steps with 8-lane registers

// e^x for x <= 0, as the AVX-512 exp_neg: x = k ln2 + r, e^r by its Taylor polynomial of degree 7, times 2^k (built
// in the exponent bits: k >= -126 above -87, a normal float); -> 0 below -87
inline __m256 exp_neg(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693145751953125f), x);  // ln2 in two parts: r exact
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256 two_k = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, two_k));
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t D) {  // D a multiple of 16
  for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, load8(src + d));
}

inline float hmax8(__m256 a) {  // the largest of 8 lanes
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// RB query rows (qf, row stride D) against 4 keys in float32 (kf [4, D]) -> their scores (row stride W): RB x 4
// accumulators, so that the FMAs' latency is hidden (one row's 4 chains of D / 8 dependent FMAs were its cost)
template <int RB>
inline void scores_4keys(const float* qf, const float* kf, int64_t D, float* s, int64_t W) {
  __m256 acc[RB][4];
  for (int r = 0; r < RB; ++r)
    for (int jj = 0; jj < 4; ++jj) acc[r][jj] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 qv[RB];
    for (int r = 0; r < RB; ++r) qv[r] = _mm256_loadu_ps(qf + r * D + d);
    for (int jj = 0; jj < 4; ++jj) {
      const __m256 kv = _mm256_loadu_ps(kf + jj * D + d);
      for (int r = 0; r < RB; ++r) acc[r][jj] = _mm256_fmadd_ps(qv[r], kv, acc[r][jj]);
    }
  }
  for (int r = 0; r < RB; ++r) lane_sums<4>(acc[r], s + r * W);
}

// the float32 vectors of this build for weighted_values: 8 lanes
struct Lanes {
  using vec = __m256;
  static constexpr int64_t N = 8;
  static vec load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, vec a) { _mm256_storeu_ps(p, a); }
  static vec set1(float x) { return _mm256_set1_ps(x); }
  static vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
};

// the attention of R query rows (qf [R, D] float32: the group's heads x the step's queries) over the keys [c0, c1)
// of one kv head, k, v [S_max, D] (row stride D): query r sees the keys [lo[r], hi[r]] of it. Not normalized, so
// that the chunks of one kv head's keys can run on different threads (combine_chunks): mx[r] the row's largest
// scaled score there (-inf where it sees none), sm[r] the sum of exp(scale * s - mx[r]) over the keys it sees, and
// of [R, D] the sum of those exponentials times the values, in float32. Keys and values are read and converted once
// for every query of the group; scores 4 keys x 2 rows at a time, then the weighted sum a chunk of CH converted
// values at a time, 2 rows at once.
template <typename T>
void attend_chunk(const float* qf, int64_t R, int64_t D, const T* k, const T* v, const int64_t* lo,
                  const int64_t* hi, int64_t c0, int64_t c1, float scale, float* mx, float* sm, float* of,
                  std::vector<float>& buf) {
  int64_t j0 = lo[0], S = hi[0] + 1;
  for (int64_t r = 1; r < R; ++r) j0 = std::min(j0, lo[r]), S = std::max(S, hi[r] + 1);
  j0 = std::max(j0, c0), S = std::min(S, c1);
  for (int64_t x = 0; x < R * D; ++x) of[x] = 0.0f;
  for (int64_t r = 0; r < R; ++r) mx[r] = -INFINITY, sm[r] = 0.0f;
  if (S <= j0) return;  // no query sees a key of this chunk
  const int64_t W = S - j0;
  constexpr int64_t CH = 64;
  buf.resize(R * W + 4 * D + CH * D);
  float* s = buf.data();       // [R, W] scores, then exponentials
  float* kf = s + R * W;       // [4, D] a block of keys in float32
  float* vf = kf + 4 * D;      // [CH, D] a chunk of values in float32
  int64_t j = j0;
  const int64_t row_bytes = D * sizeof(T);
  for (; j + 4 <= S; j += 4) {
    for (int64_t x = 0; x < 4 * row_bytes; x += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(k + (j + 16) * D) + x, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v + j * D) + x, _MM_HINT_T1);
    }
    const float* kb = kf;  // the 4 keys in float32: float32 keys read where they are, bf16 converted
    if constexpr (std::is_same_v<T, float>) {
      kb = k + j * D;
    } else {
      for (int jj = 0; jj < 4; ++jj) to_float(k + (j + jj) * D, kf + jj * D, D);
    }
    int64_t r = 0;
    for (; r + 2 <= R; r += 2) scores_4keys<2>(qf + r * D, kb, D, s + r * W + (j - j0), W);
    if (r < R) scores_4keys<1>(qf + r * D, kb, D, s + r * W + (j - j0), W);
  }
  for (; j < S; ++j) {
    const float* kb = kf;
    if constexpr (std::is_same_v<T, float>) {
      kb = k + j * D;
    } else {
      to_float(k + j * D, kf, D);
    }
    for (int64_t r = 0; r < R; ++r) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * D + d), _mm256_loadu_ps(kb + d), acc);
      s[r * W + (j - j0)] = hsum8(acc);
    }
  }
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t r = 0; r < R; ++r) {  // each row's exponentials over the keys it sees, zero elsewhere
    float* sr = s + r * W;
    const int64_t a = std::min(std::max(lo[r], j0), S) - j0;  // [a, b) visible, within [0, W]
    const int64_t b = std::max(std::min(hi[r] + 1, S), j0) - j0;
    __m256 m8 = _mm256_set1_ps(-INFINITY);  // the largest scaled score, 8 lanes at a time (a max is exact)
    int64_t t0 = a;
    for (; t0 + 8 <= b; t0 += 8) m8 = _mm256_max_ps(m8, _mm256_mul_ps(_mm256_loadu_ps(sr + t0), sc));
    float m = hmax8(m8);
    for (; t0 < b; ++t0) m = std::max(m, sr[t0] * scale);
    for (int64_t t = 0; t < a; ++t) sr[t] = 0.0f;
    for (int64_t t = std::max(a, b); t < W; ++t) sr[t] = 0.0f;
    if (b <= a) continue;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    float tail[8];
    for (int64_t t = a; t < b; t += 8) {
      const int64_t nt = std::min<int64_t>(8, b - t);
      if (nt == 8) {
        const __m256 e = exp_neg(_mm256_fmsub_ps(_mm256_loadu_ps(sr + t), sc, mv));
        _mm256_storeu_ps(sr + t, e);
        sum = _mm256_add_ps(sum, e);
      } else {  // the last keys: through a padded copy whose padding (-inf -> 0) takes no part
        for (int64_t i = 0; i < 8; ++i) tail[i] = i < nt ? sr[t + i] * scale - m : -INFINITY;
        _mm256_storeu_ps(tail, exp_neg(_mm256_loadu_ps(tail)));
        for (int64_t i = 0; i < nt; ++i) sr[t + i] = tail[i];
        sum = _mm256_add_ps(sum, _mm256_loadu_ps(tail));
      }
    }
    mx[r] = m, sm[r] = hsum8(sum);
  }
  for (int64_t c = 0; c < W; c += CH) {
    const int64_t cn = std::min(CH, W - c);
    const float* vb = vf;  // the chunk's values in float32: float32 values read where they are, bf16 converted
    if constexpr (std::is_same_v<T, float>) {
      vb = v + (j0 + c) * D;
    } else {
      for (int64_t t = 0; t < cn; ++t) to_float(v + (j0 + c + t) * D, vf + t * D, D);
    }
    int64_t r = 0;
    for (; r + 2 <= R; r += 2) weighted_values<Lanes, 2>(s + r * W + c, W, vb, cn, D, of + r * D);
    if (r < R) weighted_values<Lanes, 1>(s + r * W + c, W, vb, cn, D, of + r * D);
  }
}

// one query row's output from its C chunks' (mx, sm, of) (strides: P floats between chunks): softmax over every key
// it saw, a sink's logit (if any) in the denominator; D values in T, rounded once
template <typename T>
inline void combine_chunks(const float* mx, const float* sm, const float* of, int64_t C, int64_t P, int64_t D,
                           const float* sink, T* out) {
  float m = sink ? *sink : -INFINITY;
  for (int64_t c = 0; c < C; ++c) m = std::max(m, mx[c * P]);
  float den = sink ? std::exp(*sink - m) : 0.0f, w[64];
  for (int64_t c = 0; c < C; ++c) {
    w[c] = sm[c * P] > 0.0f ? std::exp(mx[c * P] - m) : 0.0f;
    den += w[c] * sm[c * P];
  }
  const float inv = 1.0f / den;
  const __m256 iv = _mm256_set1_ps(inv);
  alignas(32) float o8[8];
  for (int64_t d = 0; d < D; d += 8) {  // 8 lanes at a time (D a multiple of 16), each lane's sum in chunk order
    __m256 o = _mm256_setzero_ps();
    for (int64_t c = 0; c < C; ++c) o = _mm256_fmadd_ps(_mm256_set1_ps(w[c]), _mm256_loadu_ps(of + c * P + d), o);
    _mm256_store_ps(o8, _mm256_mul_ps(o, iv));
    for (int i = 0; i < 8; ++i) out[d + i] = T(o8[i]);  // rounded once
  }
}
#endif  // __AVX512F__
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
// attend_group for bfloat16 on AMX, 1..16 query rows, D a multiple of 64: the products of scores and of the weighted
// sum on tiles, so that their cost no longer grows with the queries (measured at ~300 keys: a verification step's 4
// rows per head in 23 us per layer against 51 in the float32 loops of attend_group). Same steps and float32
// softmax; the probabilities enter the weighted sum rounded to bfloat16 (a tile multiply's operands are bf16), as
// flash attention's do.
// Tiles: 0-3 the output [R, 16 d] x 4 (float32), 4 P [R, 32 keys] (bf16), 5 a block of keys [16, 32 d] or of value
// pairs [16, 16 d x 2], 6 scores^T [16 keys, R] (float32), 7 queries^T [16 d pairs, R x 2].
inline void configure_attention(int64_t R) {
  TileConfig cfg;
  for (int t = 0; t < 5; ++t) cfg.rows[t] = (uint8_t)R, cfg.colsb[t] = 64;
  cfg.rows[5] = 16, cfg.colsb[5] = 64;
  cfg.rows[6] = cfg.rows[7] = 16, cfg.colsb[6] = cfg.colsb[7] = (uint16_t)(R * 4);
  _tile_loadconfig(&cfg);
}

void attend_group_amx(const c10::BFloat16* const* q, int64_t R, int64_t D, const c10::BFloat16* k,
                      const c10::BFloat16* v, int64_t S_max, const int64_t* lo, const int64_t* hi, float scale,
                      const float* sink, c10::BFloat16* const* out, std::vector<float>& buf) {
  int64_t j0 = lo[0], S = hi[0] + 1;
  for (int64_t r = 1; r < R; ++r) j0 = std::min(j0, lo[r]), S = std::max(S, hi[r] + 1);
  const int64_t W = S - j0, Wp = (W + 31) / 32 * 32;  // keys any query sees; padded to whole tiles of P
  // float32 slots: scores [R, W], a tile of scores^T [16, 16], queries^T [D/32][16][16] (bf16 pairs), P [R, Wp]
  // (bf16), value pairs [4][16][32] (bf16), a zero-padded block of keys [16, D] (bf16), outputs [R, D]
  const int64_t n_s = R * W, n_t = 256, n_q = D / 32 * 256, n_p = R * Wp / 2, n_v = 1024, n_k = 8 * D;
  buf.resize(n_s + n_t + n_q + n_p + n_v + n_k + R * D);
  float* s = buf.data();
  float* tmp = s + n_s;
  uint32_t* qt = reinterpret_cast<uint32_t*>(tmp + n_t);
  c10::BFloat16* pb = reinterpret_cast<c10::BFloat16*>(tmp + n_t + n_q);
  c10::BFloat16* vb = reinterpret_cast<c10::BFloat16*>(tmp + n_t + n_q + n_p);
  c10::BFloat16* kp = reinterpret_cast<c10::BFloat16*>(tmp + n_t + n_q + n_p + n_v);
  float* of = tmp + n_t + n_q + n_p + n_v + n_k;
  configure_attention(R);
  // queries^T: chunk c of 32 d, row i, column r = the bf16 pair (q[r][32c + 2i], q[r][32c + 2i + 1])
  std::fill(qt, qt + n_q, 0u);
  for (int64_t r = 0; r < R; ++r) {
    const uint32_t* qw = reinterpret_cast<const uint32_t*>(q[r]);
    for (int64_t w = 0; w < D / 2; ++w) qt[(w / 16) * 256 + (w % 16) * 16 + r] = qw[w];
  }
  // scores: 16 keys at a time, scores^T = keys (A, in place) x queries^T, transposed into s by a gather per query
  const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(16));
  for (int64_t j = j0; j < S; j += 16) {
    const int64_t nk = std::min<int64_t>(16, S - j);
    const c10::BFloat16* kb = k + j * D;
    if (j + 16 > S_max) {  // the last keys of the cache: a zero-padded copy, no read past it
      std::fill(kp, kp + 16 * D, c10::BFloat16(0.0f));
      std::copy(kb, kb + nk * D, kp);
      kb = kp;
    }
    if (j + 16 + 16 <= S_max)
      for (int64_t x = 0; x < 16 * D * 2; x += 64) _mm_prefetch(reinterpret_cast<const char*>(kb + 16 * D) + x, _MM_HINT_T0);
    _tile_zero(6);
    for (int64_t c = 0; c < D / 32; ++c) {
      _tile_loadd(5, kb + 32 * c, D * 2);
      _tile_loadd(7, qt + c * 256, 64);
      _tile_dpbf16ps(6, 5, 7);
    }
    _tile_stored(6, tmp, 64);
    const __mmask16 m = (__mmask16)(nk == 16 ? 0xFFFF : (1u << nk) - 1);
    for (int64_t r = 0; r < R; ++r)
      _mm512_mask_storeu_ps(s + r * W + (j - j0), m, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, col, tmp + r, 4));
  }
  // softmax of each query over its visible keys (and its sink's logit in the denominator); 0 elsewhere; P in bf16
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * W;
    const int64_t a = lo[r] - j0, b = hi[r] + 1 - j0;  // [a, b) visible
    const __m512 inv = _mm512_set1_ps(softmax_exp(sr, a, b, scale, sink ? sink + r : nullptr));
    c10::BFloat16* pr = pb + r * Wp;
    for (int64_t t = 0; t < Wp; t += 16) {
      // [a, b) scaled, everything else 0 (the padding to Wp included)
      const int64_t lo_t = std::max<int64_t>(a - t, 0), hi_t = std::min<int64_t>(b - t, 16);
      __mmask16 m = lo_t >= hi_t ? 0 : (__mmask16)((hi_t >= 16 ? 0xFFFF : (1u << hi_t) - 1) & ~((1u << lo_t) - 1));
      __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, sr + t), inv);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + t), (__m256i)_mm512_cvtneps_pbh(p));
    }
  }
  // out = P x values: per 32 keys, value rows paired into the B layout [16 pairs, 16 d x 2] of each 16 d
  const __m512i lo16 = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                        37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi16 = _mm512_add_epi16(lo16, _mm512_set1_epi16(16));
  for (int64_t dg = 0; dg < D; dg += 64) {  // 64 d (4 output tiles) at a time
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t jb = 0; jb < Wp; jb += 32) {
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t ja = j0 + jb + 2 * i, jn = ja + 1;
        const __m512i z = _mm512_setzero_si512();
        const __m512i a0 = ja < S ? _mm512_loadu_si512(v + ja * D + dg) : z;
        const __m512i a1 = ja < S ? _mm512_loadu_si512(v + ja * D + dg + 32) : z;
        const __m512i b0 = jn < S ? _mm512_loadu_si512(v + jn * D + dg) : z;
        const __m512i b1 = jn < S ? _mm512_loadu_si512(v + jn * D + dg + 32) : z;
        _mm512_storeu_si512(vb + (0 * 16 + i) * 32, _mm512_permutex2var_epi16(a0, lo16, b0));
        _mm512_storeu_si512(vb + (1 * 16 + i) * 32, _mm512_permutex2var_epi16(a0, hi16, b0));
        _mm512_storeu_si512(vb + (2 * 16 + i) * 32, _mm512_permutex2var_epi16(a1, lo16, b1));
        _mm512_storeu_si512(vb + (3 * 16 + i) * 32, _mm512_permutex2var_epi16(a1, hi16, b1));
      }
      _tile_loadd(4, pb + jb, Wp * 2);
      _tile_loadd(5, vb, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(5, vb + 512, 64);
      _tile_dpbf16ps(1, 4, 5);
      _tile_loadd(5, vb + 1024, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(5, vb + 1536, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, of + dg, D * 4);
    _tile_stored(1, of + dg + 16, D * 4);
    _tile_stored(2, of + dg + 32, D * 4);
    _tile_stored(3, of + dg + 48, D * 4);
  }
  _tile_release();
  for (int64_t r = 0; r < R; ++r)
    for (int64_t d = 0; d < D; ++d) out[r][d] = c10::BFloat16(of[r * D + d]);  // rounded once
}
#endif

#ifndef __AVX512F__
// run_attention's contract on AVX2 builds: one unit is (query row, kv head, chunk of keys) with every head of the
// group, reading and converting that chunk's keys and values once for all of them (G * n query rows). With fewer
// (row, kv head) pairs than 2 per thread (a batch of 1: the embedded verifier's 3 kv heads on 2 threads), each kv
// head's keys are split into chunks so that every thread gets as many units; the chunks' partial softmaxes are
// combined afterwards (combine_chunks). Before, a batch of 1 ran a unit per head (9 units: each kv head's keys
// converted 3 times, 5 units on one thread and 4 on the other).
template <typename T>
void run_attention_chunks(const T* q, const T* kc, const T* vc, T* out, const int64_t* rows, const int64_t* pos,
                          const float* sinks, int64_t Bq, int64_t n, int64_t H, int64_t D, int64_t KVH,
                          int64_t S_max, int64_t G, int64_t window, float scale) {
  const int64_t threads = at::get_num_threads(), pairs = Bq * KVH, R = G * n;
  int64_t keys = 0;
  for (int64_t x = 0; x < Bq * n; ++x) keys = std::max(keys, pos[x] + 1);
  // chunks per kv head: pairs * C a multiple of the threads where there are not 2 pairs per thread already, each
  // chunk at least 64 keys, at most 64 chunks
  int64_t C = pairs >= 2 * threads ? 1 : threads / std::gcd(pairs, threads);
  C = std::max<int64_t>(1, std::min({C, keys / 64, int64_t(64)}));
  const int64_t span = (keys + C - 1) / C;  // keys per chunk
  const int64_t P = R * (D + 2);  // one unit's partial: mx [R], sm [R], of [R, D]
  std::vector<float> part(C > 1 ? pairs * C * P : 0);
  // a (row, kv head)'s outputs, every head of the group, from its nc chunks' partials p (P floats apart)
  auto combine = [&](int64_t b, int64_t kvh, const float* p, int64_t nc) {
    for (int64_t g = 0; g < G; ++g)
      for (int64_t i = 0; i < n; ++i) {
        const int64_t r = g * n + i, h = kvh * G + g;
        combine_chunks(p + r, p + R + r, p + 2 * R + r * D, nc, P, D, sinks ? sinks + h : nullptr,
                       out + ((b * n + i) * H + h) * D);
      }
  };
  at::parallel_for(0, pairs * C, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> buf, qf(R * D), own(C > 1 ? 0 : P);
    std::vector<int64_t> lo(R), hi(R);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / (KVH * C), kvh = (u / C) % KVH, c = u % C;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < n; ++i) {
          const int64_t r = g * n + i, h = kvh * G + g;
          hi[r] = pos[b * n + i];
          lo[r] = window > 0 ? std::max<int64_t>(0, hi[r] - window + 1) : 0;
          to_float(q + ((b * n + i) * H + h) * D, qf.data() + r * D, D);
        }
      float* p = C > 1 ? part.data() + u * P : own.data();
      const int64_t off = (rows[b] * KVH + kvh) * S_max * D;
      attend_chunk<T>(qf.data(), R, D, kc + off, vc + off, lo.data(), hi.data(), c * span, (c + 1) * span, scale,
                      p, p + R, p + 2 * R, buf);
      if (C == 1) combine(b, kvh, p, 1);  // unsplit: normalised by the thread that computed it
    }
  });
  if (C == 1) return;
  for (int64_t pr = 0; pr < pairs; ++pr)  // each (row, kv head)'s chunks, on this thread (R x D x C floats)
    combine(pr / KVH, pr % KVH, part.data() + pr * C * P, C);
}
#endif

template <typename T>
void run_attention(const T* q, const T* kc, const T* vc, T* out, const int64_t* rows, const int64_t* pos,
                   const float* sinks, int64_t Bq, int64_t n, int64_t H, int64_t D, int64_t KVH, int64_t S_max,
                   int64_t G, int64_t window, float scale) {
#ifndef __AVX512F__
  run_attention_chunks(q, kc, vc, out, rows, pos, sinks, Bq, n, H, D, KVH, S_max, G, window, scale);
#else
  // one unit: (query row, kv head) with every head of the group, reading the keys and values once. On AMX (bf16, D a
  // multiple of 64: attend_group_amx) as many heads of the group as fit 16 query rows: a tile multiply costs the
  // same for 1 row and 16 (at ~300 keys a bf16 step of the embedded verifier took 11 us per layer on 3 units of 3
  // heads, against 17 on 9 units of 1 head and 26 in the float32 loops). In the float32 loops, with fewer such
  // units than 4 per thread (a batch of 1), a unit per head, so that the threads share the work evenly.
  bool tiles = false;
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
  // $PARADRAFT_ATTENTION_TILES=off keeps bf16 in the float32 loops (benchmarks/bench_decode_attention.py compares)
  static const bool tiles_off = [] {
    const char* e = std::getenv("PARADRAFT_ATTENTION_TILES");
    return e != nullptr && std::string(e) == "off";
  }();
  tiles = std::is_same<T, c10::BFloat16>::value && D % 64 == 0 && !tiles_off && amx_permitted();
#endif
  int64_t Gu = Bq * KVH >= 4 * at::get_num_threads() ? G : 1;  // heads per unit
  if (tiles)
    for (Gu = G; Gu > 1 && (G % Gu != 0 || Gu * n > 16); --Gu) {
    }
  const int64_t sub = G / Gu, R = Gu * n;  // units per group; query rows (g, i) of a unit
  at::parallel_for(0, Bq * KVH * sub, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> buf, qf(R * D), sk(R);
    std::vector<int64_t> lo(R), hi(R);
    std::vector<T*> outs(R);
    std::vector<const T*> qs(R);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / (KVH * sub), kvh = (u / sub) % KVH, g0 = (u % sub) * Gu;
      for (int64_t g = 0; g < Gu; ++g)
        for (int64_t i = 0; i < n; ++i) {
          const int64_t r = g * n + i, h = kvh * G + g0 + g;
          hi[r] = pos[b * n + i];
          lo[r] = window > 0 ? std::max<int64_t>(0, hi[r] - window + 1) : 0;
          qs[r] = q + ((b * n + i) * H + h) * D;
          if (!tiles) to_float(qs[r], qf.data() + r * D, D);
          outs[r] = out + ((b * n + i) * H + h) * D;
          if (sinks) sk[r] = sinks[h];
        }
      const int64_t off = (rows[b] * KVH + kvh) * S_max * D;
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
      if constexpr (std::is_same<T, c10::BFloat16>::value) {
        if (tiles) {
          attend_group_amx(qs.data(), R, D, kc + off, vc + off, S_max, lo.data(), hi.data(), scale,
                           sinks ? sk.data() : nullptr, outs.data(), buf);
          continue;
        }
      }
#endif
      attend_group<T>(qf.data(), R, D, kc + off, vc + off, lo.data(), hi.data(), scale, sinks ? sk.data() : nullptr,
                      outs.data(), buf);
    }
  });
#endif  // __AVX512F__
}

// q [B', n, H, D] (after the rotary embedding), caches kc / vc [B, KVH, S_max, D] (this step's keys and values
// already written), rows [B'] (each query row's cache row), pos [B', n] (each query's position: key j is visible
// when j <= pos and, with a window w > 0, j > pos - w), scale, sinks [H] float32 or empty -> [B', n, H, D] in q's
// dtype
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& rows,
                            const at::Tensor& pos, int64_t window, double scale, const at::Tensor& sinks) {
  TORCH_CHECK(q.dim() == 4 && kc.dim() == 4 && vc.sizes() == kc.sizes() && q.is_contiguous() && kc.is_contiguous() &&
              vc.is_contiguous() && q.scalar_type() == kc.scalar_type() && vc.scalar_type() == kc.scalar_type(),
              "decode_attention: q [B', n, H, D] and caches [B, KVH, S_max, D] contiguous, of one dtype");
  const int64_t Bq = q.size(0), n = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t KVH = kc.size(1), S_max = kc.size(2);
  TORCH_CHECK(kc.size(3) == D && D % 16 == 0 && H % KVH == 0 && n >= 1 && n <= 16,
              "decode_attention: 1..16 queries per row, head size a multiple of 16, heads a multiple of kv heads");
  at::Tensor r = rows.to(at::kLong).contiguous(), ps = pos.to(at::kLong).contiguous();
  TORCH_CHECK(r.numel() == Bq && ps.size(0) == Bq && ps.size(1) == n, "decode_attention: rows [B'] and pos [B', n]");
  const int64_t* rp = r.data_ptr<int64_t>();
  const int64_t* pp = ps.data_ptr<int64_t>();
  for (int64_t b = 0; b < Bq * n; ++b) TORCH_CHECK(pp[b] >= 0 && pp[b] < S_max, "decode_attention: a position past the cache");
  for (int64_t b = 0; b < Bq; ++b) TORCH_CHECK(rp[b] >= 0 && rp[b] < kc.size(0), "decode_attention: a row past the cache");
  at::Tensor sk;
  if (sinks.defined() && sinks.numel() > 0) {
    sk = sinks.to(at::kFloat).contiguous();
    TORCH_CHECK(sk.numel() == H, "decode_attention: one sink per head");
  }
  const float* skp = sk.defined() ? sk.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty_like(q);
  const int64_t G = H / KVH;
  AT_DISPATCH_SWITCH(q.scalar_type(), "decode_attention",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      using T = float;
      run_attention<T>(q.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(), out.data_ptr<T>(), rp, pp, skp, Bq, n, H,
                       D, KVH, S_max, G, window, (float)scale);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using T = c10::BFloat16;
      run_attention<T>(q.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(), out.data_ptr<T>(), rp, pp, skp, Bq, n, H,
                       D, KVH, S_max, G, window, (float)scale);
    }));
  return out;
}

// whether tile_linear runs here: built with AMX and granted the tile state by the OS
bool tiles_ready() {
#ifdef __AMX_BF16__
  return amx_permitted();
#else
  return false;
#endif
}

#ifndef __AMX_BF16__
at::Tensor tile_linear(const at::Tensor& x, at::TensorList tiles) {
  TORCH_CHECK(false, "tile_linear: this kernel was built without AMX");
}
#endif

}  // namespace

TORCH_LIBRARY(paradraft, m) {
  m.def("small_linear(Tensor x, Tensor[] weights) -> Tensor");
  m.def("tile_linear(Tensor x, Tensor[] tiles) -> Tensor");
  m.def("tiles_ready() -> bool");
  m.def("decode_attention(Tensor q, Tensor kc, Tensor vc, Tensor rows, Tensor pos, int window, float scale, "
        "Tensor sinks) -> Tensor");
}
TORCH_LIBRARY_IMPL(paradraft, CPU, m) {
  m.impl("small_linear", &small_linear);
  m.impl("tile_linear", &tile_linear);
  m.impl("decode_attention", &decode_attention);
}
TORCH_LIBRARY_IMPL(paradraft, CompositeExplicitAutograd, m) { m.impl("tiles_ready", &tiles_ready); }
