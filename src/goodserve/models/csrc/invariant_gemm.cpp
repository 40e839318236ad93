// Batch-invariant GEMM: y[M, N] = x[M, K] W^T (+ bias), every output reduced over K in one fixed order,
// whatever M is and wherever its row sits in the batch ("Defeating Nondeterminism in LLM Inference",
// Thinking Machines Lab, 2025: a kernel is batch-invariant when no reduction is split or reordered by the
// batch's shape). BLAS libraries pick their blocking, their split of K across threads and their small-M
// paths from M, so a row's result there depends on how many rows share the call; here only the N
// dimension is split between threads and M is only ever tiled, never part of any reduction.
//
// The order of one output y[m, n]: K is walked in tiles of 32, first to last; within a tile the 32
// products are summed as the instruction in use sums them (AMX TDPBF16PS, or AVX512-BF16 VDPBF16PS as
// 16 pairs in order), into one float32 accumulator per output; the bias is added in float32 and the sum
// rounded once to the output dtype (round to nearest even). The float32 path (AVX-512 FMA) sums the K
// products one after the other.
//
// Weights are packed once, at load time, into B tiles of 32 k x 16 n (the VNNI layout the instructions
// read: for each pair of k, 16 n, the pair's two values side by side):
//   kind 0, bfloat16: [N/16][K/32][16 pairs][16 n][2] bf16 (a GGUF's blocks are dequantized into it);
//   kind 1, float32 (float32 activations): [N/16][K][16] float32.
// Activations x: [M, K] rows with stride x_stride (elements), bfloat16 for kind 0, float32 for kind 1.

#include <cstdint>
#include <cstring>
#include <initializer_list>

#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "dtype.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define GOODSERVE_BF16 1
#include <immintrin.h>
#endif
#if defined(GOODSERVE_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define GOODSERVE_AMX 1
#endif

namespace {

constexpr int64_t kTileN = 16, kTileK = 32, kTileElems = kTileN * kTileK;  // one B tile: 1 KiB of bf16

enum Kind { kDenseBf16 = 0, kDenseF32 = 1 };

// 0: no kernel; 1: AVX512-BF16; 2: AMX. Set once by goodserve_bi_gemm_init (the OS must grant AMX's tile
// state to the process first).
int g_mode = -1;

struct Weight {
  int kind;
  int64_t N, K;
  const void* packed;  // see the layouts above
};

#ifdef GOODSERVE_BF16

// Rows [0, rows) of the block's float32 results acc ([rows][32], row stride 32) plus bias, into y.
template <typename Y>
void store_block(const float* acc, int64_t rows, int nb, const float* bias, Y* y, int64_t y_stride) {
  for (int64_t r = 0; r < rows; ++r)
    for (int j = 0; j < nb; ++j) {
      __m512 v = _mm512_loadu_ps(acc + r * 32 + 16 * j);
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + 16 * j));
      if constexpr (sizeof(Y) == 4) {
        _mm512_storeu_ps(y + r * y_stride + 16 * j, v);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * y_stride + 16 * j), (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
}

// AVX512-BF16: rows [m0, m0 + R) x n-tiles of the block, K in order, 16 pairs a tile.
template <int R>
void bf16_rows(const uint16_t* x, int64_t x_stride, int64_t kts, const uint16_t* b, int nb, float* acc) {
  __m512 c[R][2];
  for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  for (int64_t kt = 0; kt < kts; ++kt) {
    const uint16_t* b0 = b + kt * kTileElems;
    const uint16_t* b1 = b0 + kts * kTileElems;
    for (int p = 0; p < 16; ++p) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + 32 * p);
      const __m512bh w1 = nb > 1 ? (__m512bh)_mm512_loadu_si512(b1 + 32 * p) : w0;
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * x_stride + kt * kTileK + 2 * p, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        c[r][0] = _mm512_dpbf16_ps(c[r][0], a, w0);
        if (nb > 1) c[r][1] = _mm512_dpbf16_ps(c[r][1], a, w1);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * 32, c[r][0]);
    _mm512_storeu_ps(acc + r * 32 + 16, c[r][1]);
  }
}

#endif  // GOODSERVE_BF16

#ifdef GOODSERVE_AMX

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

// Tiles: 0, 1: C of A rows [0, 16) (n-tiles 0, 1); 2, 3: C of rows [16, 32); 4, 5: A; 6, 7: B.
void configure(int r0, int r1) {
  TileConfig cfg;
  for (int t : {0, 1, 4}) cfg.rows[t] = static_cast<uint8_t>(r0), cfg.colsb[t] = 64;
  if (r1 > 0)
    for (int t : {2, 3, 5}) cfg.rows[t] = static_cast<uint8_t>(r1), cfg.colsb[t] = 64;
  for (int t : {6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  // GCC does not see ldtilecfg read its operand and drops the stores above without this barrier.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// One block of up to 32 rows (r0 + r1) x nb n-tiles, K in order: acc [32][32] float32. b: the block's
// B tiles, [nb][K/32][512].
void amx_block(const uint16_t* x, int64_t x_stride, int64_t kts, const uint16_t* b, int nb, bool two, float* acc) {
  const uint16_t* b1 = b + kts * kTileElems;
  const int64_t lda = x_stride * 2;
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kt = 0; kt < kts; ++kt) {
    _tile_loadd(4, x + kt * kTileK, lda);
    _tile_loadd(6, b + kt * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two) {
      _tile_loadd(5, x + 16 * x_stride + kt * kTileK, lda);
      _tile_dpbf16ps(2, 5, 6);
    }
    if (nb > 1) {
      _tile_loadd(7, b1 + kt * kTileElems, 64);
      _tile_dpbf16ps(1, 4, 7);
      if (two) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, 128);
  if (nb > 1) _tile_stored(1, acc + 16, 128);
  if (two) {
    _tile_stored(2, acc + 16 * 32, 128);
    if (nb > 1) _tile_stored(3, acc + 16 * 32 + 16, 128);
  }
}

#endif  // GOODSERVE_AMX

#ifdef GOODSERVE_BF16

template <typename Y>
void gemm_bf16(const Weight& w, const uint16_t* x, int64_t x_stride, int64_t M, const float* bias, Y* y,
               int64_t y_stride, int num_threads) {
  const int64_t nts = w.N / kTileN, kts = w.K / kTileK, blocks = (nts + 1) / 2;
  const bool amx = g_mode == 2;
#pragma omp parallel num_threads(num_threads)
  {
    alignas(64) float acc[32 * 32];
    int configured = -1;  // r0 * 17 + r1 of the tile configuration loaded on this thread
#pragma omp for schedule(static)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t nt = 2 * blk;
      const int nb = nt + 1 < nts ? 2 : 1;
      const uint16_t* b = static_cast<const uint16_t*>(w.packed) + nt * kts * kTileElems;
      const float* bb = bias == nullptr ? nullptr : bias + nt * kTileN;
      for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int64_t rows = M - m0 < 32 ? M - m0 : 32;
        const uint16_t* xm = x + m0 * x_stride;
        if (amx) {
#ifdef GOODSERVE_AMX
          const int r0 = rows < 16 ? static_cast<int>(rows) : 16, r1 = static_cast<int>(rows) - r0;
          if (configured != r0 * 17 + r1) {
            configure(r0, r1);
            configured = r0 * 17 + r1;
          }
          amx_block(xm, x_stride, kts, b, nb, r1 > 0, acc);
#endif
        } else {
          for (int64_t r = 0; r < rows; r += 4) {
            const int64_t n = rows - r < 4 ? rows - r : 4;
            float* a = acc + r * 32;
            const uint16_t* xr = xm + r * x_stride;
            if (n == 4) bf16_rows<4>(xr, x_stride, kts, b, nb, a);
            else if (n == 3) bf16_rows<3>(xr, x_stride, kts, b, nb, a);
            else if (n == 2) bf16_rows<2>(xr, x_stride, kts, b, nb, a);
            else bf16_rows<1>(xr, x_stride, kts, b, nb, a);
          }
        }
        store_block(acc, rows, nb, bb, y + m0 * y_stride + nt * kTileN, y_stride);
      }
    }
#ifdef GOODSERVE_AMX
    if (amx && configured >= 0) _tile_release();
#endif
  }
}

// float32: rows [0, R) x two n-tiles, the K products summed in order (one fused multiply-add each).
template <int R>
void f32_rows(const float* x, int64_t x_stride, int64_t K, const float* b, int nb, float* acc) {
  __m512 c[R][2];
  for (int r = 0; r < R; ++r) c[r][0] = c[r][1] = _mm512_setzero_ps();
  const float* b1 = b + K * kTileN;
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(b + k * kTileN);
    const __m512 w1 = nb > 1 ? _mm512_loadu_ps(b1 + k * kTileN) : w0;
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * x_stride + k]);
      c[r][0] = _mm512_fmadd_ps(a, w0, c[r][0]);
      if (nb > 1) c[r][1] = _mm512_fmadd_ps(a, w1, c[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc + r * 32, c[r][0]);
    _mm512_storeu_ps(acc + r * 32 + 16, c[r][1]);
  }
}

void gemm_f32(const Weight& w, const float* x, int64_t x_stride, int64_t M, const float* bias, float* y,
              int64_t y_stride, int num_threads) {
  const int64_t nts = w.N / kTileN, blocks = (nts + 1) / 2;
  const float* packed = static_cast<const float*>(w.packed);
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t nt = 2 * blk;
    const int nb = nt + 1 < nts ? 2 : 1;
    const float* b = packed + nt * w.K * kTileN;
    const float* bb = bias == nullptr ? nullptr : bias + nt * kTileN;
    alignas(64) float acc[4 * 32];
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t n = M - m0 < 4 ? M - m0 : 4;
      const float* xr = x + m0 * x_stride;
      if (n == 4) f32_rows<4>(xr, x_stride, w.K, b, nb, acc);
      else if (n == 3) f32_rows<3>(xr, x_stride, w.K, b, nb, acc);
      else if (n == 2) f32_rows<2>(xr, x_stride, w.K, b, nb, acc);
      else f32_rows<1>(xr, x_stride, w.K, b, nb, acc);
      store_block(acc, n, nb, bb, y + m0 * y_stride + nt * kTileN, y_stride);
    }
  }
}

#endif  // GOODSERVE_BF16

}  // namespace

extern "C" {

// Which kernel this process runs: 2 = AMX (the OS granted the tile state), 1 = AVX512-BF16, 0 = none in
// this build. The first call asks the OS for AMX; later calls return the same answer. force >= 0 caps the
// mode (tests compare the AVX512-BF16 path with AMX on one machine).
int goodserve_bi_gemm_init(int force) {
  if (g_mode < 0) {
#if defined(GOODSERVE_AMX)
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    g_mode = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0 ? 2 : 1;
#elif defined(GOODSERVE_BF16)
    g_mode = 1;
#else
    g_mode = 0;
#endif
  }
  static int available = g_mode;
  if (force >= 0) g_mode = force < available ? force : available;
  return g_mode;
}

// y[M, N] = x[M, K] W^T + bias. kind: 0 = bfloat16 weight (bfloat16 x; y float32 or bfloat16), 1 = float32
// weight (float32 x and y); x_dtype / y_dtype: 0 = float32, 1 = bfloat16. packed: the weight (layouts at the
// top). bias: [N] float32 or null. Returns 0; 1 for arguments outside the kernel's range (M < 1, K not a
// multiple of 32, N not a multiple of 16, a dtype the kind does not take); 2 when this build has no kernel.
int goodserve_bi_gemm(int kind, int x_dtype, const void* x, int64_t x_stride, int64_t M, int64_t K,
                      const void* packed, int64_t N, const float* bias, int y_dtype, void* y, int64_t y_stride,
                      int num_threads) {
#ifdef GOODSERVE_BF16
  if (g_mode < 0) goodserve_bi_gemm_init(-1);
  if (g_mode < 1) return 2;
  if (M < 1 || K % kTileK || N % kTileN || kind < 0 || kind > 1 || y_dtype < 0 || y_dtype > 1) return 1;
  const Weight w{kind, N, K, packed};
  if (kind == kDenseF32) {
    if (x_dtype != 0 || y_dtype != 0) return 1;
    gemm_f32(w, static_cast<const float*>(x), x_stride, M, bias, static_cast<float*>(y), y_stride, num_threads);
    return 0;
  }
  if (x_dtype != 1) return 1;
  if (y_dtype == 1)
    gemm_bf16(w, static_cast<const uint16_t*>(x), x_stride, M, bias, static_cast<uint16_t*>(y), y_stride,
              num_threads);
  else
    gemm_bf16(w, static_cast<const uint16_t*>(x), x_stride, M, bias, static_cast<float*>(y), y_stride,
              num_threads);
  return 0;
#else
  (void)kind; (void)x_dtype; (void)x; (void)x_stride; (void)M; (void)K; (void)packed; (void)N; (void)bias;
  (void)y_dtype; (void)y; (void)y_stride; (void)num_threads;
  return 2;
#endif
}

// Packing, at load time, into kind 0's layout: w [N, K] bfloat16 rows (kernels reading packed B tiles); or a
// GGUF block weight, q [N, K] codes (uint8 0..15 for Q4, int8 for Q8), scales and mins [N, K / 32] float32
// (mins null but for Q4_1), dequantized as (q - offset) * d (+ m) in float32 and rounded to bfloat16: the values
// of models/quant.py's dequantize, in one pass. out: [N/16][K/32][16][16][2] bfloat16.
int goodserve_bi_pack(const uint16_t* w, const uint8_t* q, int q_signed, const float* scales, const float* mins,
                      float offset, int64_t N, int64_t K, uint16_t* out, int num_threads) {
  if (N % kTileN || K % kTileK) return 1;
  const int64_t kts = K / kTileK;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t nt = 0; nt < N / kTileN; ++nt)
    for (int64_t kt = 0; kt < kts; ++kt) {
      uint16_t* tile = out + (nt * kts + kt) * kTileElems;
      for (int64_t n = 0; n < kTileN; ++n) {
        const int64_t row = nt * kTileN + n;
        for (int64_t k = 0; k < kTileK; ++k) {
          const int64_t col = kt * kTileK + k;
          uint16_t v;
          if (w != nullptr) {
            v = w[row * K + col];
          } else {
            const uint8_t c = q[row * K + col];
            const float code = q_signed ? static_cast<float>(static_cast<int8_t>(c)) : static_cast<float>(c);
            float x = (code - offset) * scales[row * kts + kt];
            if (mins != nullptr) x = x + mins[row * kts + kt];
            goodserve::store(&v, x);
          }
          tile[(k / 2) * 32 + n * 2 + (k % 2)] = v;
        }
      }
    }
  return 0;
}

}  // extern "C"
