// y = x W^T for a few rows of x (decode steps), with W in GGUF blocks as the file holds them, on AVX-512 VNNI
// (here) or AVX2 (block_gemv_avx2.h: the same layouts and integer products, 8 lanes wide).
//
// Weight block b of row n: 32 unsigned codes u and an fp16 scale d (and, for Q4_1, an fp16 minimum m); the
// weight is d * (u - offset) + m: Q4_0 offset 8, no m; Q4_1 offset 0; Q8_0 is stored as u = q + 128
// (offset 128), so every code is an unsigned byte.
//
// Activations are quantized to int16 per row and block of 32: dx = max|x| / 32767 and q = round(x / dx)
// (nearest even). Per block the integer dot product sum(u * q) is exact in int32 (vpmaddwd, vpdpwssd); it is
// scaled by d * dx in float32, and (m - offset * d) * dx * sum(q) is added (m: Q4_1's minimum, else 0), so
// the offset costs no instruction per block (Q6_K, with a scale per 16 weights, subtracts it from the codes).
// The activations' rounding is thus 2^-15 of a block's largest value, finer than bfloat16's own 2^-8
// relative step for most of the block.
// (llama.cpp rounds activations to int8 per block, Q8_1, with vpdpbusd: measured here, that doubled the
// default model's largest logit error against float32 over its 30 layers.)
//
// Layouts. Q4: row n's codes are the file's code bytes without the scales, [N, K / 2]: byte j of block b
// holds weight j in its low nibble and weight j + 16 in its high one. Q8: [N, K] uint8 codes. Scales and
// minimums: [N, K / 32] fp16.
//
// K-quants (ggml-common.h block_q4_K / block_q5_K / block_q6_K, super-blocks of 256 weights; dequantized as
// ggml-quants.c's dequantize_row_q*_K does). Codes: per pair of 32-blocks, the 32 nibble bytes of the Q4
// layout, then (Q5_K) one or (Q6_K) two little-endian uint64 bit planes of code bits 4 and 5, bit i of a
// plane for the pair's weights in the activations' pair order (block 2p's 0-15, block 2p + 1's 0-15, block
// 2p's 16-31, block 2p + 1's 16-31): [N, K / 2], [N, 5 K / 8], [N, 3 K / 4] bytes. Q4_K / Q5_K: d = [N,
// K / 256, 2] fp16 (d, dmin), mins = [N, K / 256, 16] uint8 (the 8 sub-block scales, then the 8 minimums,
// 6-bit), w = (d * sc) * u - (dmin * m), offset 0. Q6_K: d = [N, K / 256] fp16, mins = [N, K / 16] int8
// scales, one per 16 weights, w = (d * sc) * (u - 32), offset 32: lanes 0-7 and 8-15 of a dot product over
// the low nibbles (weights 0-15 of each block) and over the high ones (16-31) each get their own scale.
// Bytes per weight: 4.625, 5.625 and 6.5625 bits (the file: 4.5, 5.5, 6.5625).
//
// Q5_0 / Q5_1 (ggml-common.h block_q5_0 / block_q5_1, blocks of 32 with a fifth code bit per weight): the
// codes as Q5_K's (per pair of blocks the 32 nibble bytes, then one uint64 plane of bit 4), [N, 5 K / 8];
// scales and minimums as Q4's, [N, K / 32] fp16: Q5_0 w = d * (u - 16) (offset 16, no m), Q5_1 w = d * u + m
// (offset 0). 5.5 and 6 bits per weight, the file's.

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "dtype.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define GOODSERVE_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define GOODSERVE_BLOCK_AVX2 1  // block_gemv_avx2.h: the same kernel 8 lanes wide
#endif
#if defined(GOODSERVE_VNNI) || defined(GOODSERVE_BLOCK_AVX2)
#define GOODSERVE_BLOCKS 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxBlocks = 512;  // K <= 16384: the per-thread scale table below lives on the stack
constexpr int64_t kRowChunk = 16;    // output rows per work item
// Groups of R weight rows prefetched ahead. Without it a pass over a weight larger than the cache read DRAM at
// 6-16 GB/s (the hardware prefetchers lose R interleaved streams of a row's few lines each); 4: BENCHMARKS.md.
constexpr int64_t kAhead = 4;

#ifdef GOODSERVE_BLOCKS
// Kinds (goodserve_block_gemv's kind argument).
constexpr int kQ4 = 0, kQ8 = 1, kQ4K = 2, kQ5K = 3, kQ6K = 4, kQ5 = 5;
// Bits of each code above its low nibble, stored as bit planes (Q5_K, Q5_0 / Q5_1: 1, Q6_K: 2).
constexpr int high_bits(int kind) { return kind == kQ5K || kind == kQ5 ? 1 : kind == kQ6K ? 2 : 0; }
// Whether the kind's scales are a K-quant's super-block scales (else one fp16 d, and m, per block of 32).
constexpr bool super_blocks(int kind) { return kind == kQ4K || kind == kQ5K || kind == kQ6K; }

// The sum of 8 float32 lanes.
inline float hsum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

// Q4_K / Q5_K's per-row scale table (ksuper_scales' other kinds; 8 lanes on either ISA): s = (d * sc) * dx per
// block of 32 and the minimums' term -sum_b (dmin * m_b) * sx_b.
template <int M>
void kmin_scales(const uint16_t* dr, const uint8_t* sub, const float* dx, const float* sx, int64_t nb,
                 float (*s)[2 * kMaxBlocks], float* mterm) {
  const int64_t nsb = nb / 8;
  __m256 mt[M];
  for (int m = 0; m < M; ++m) mt[m] = _mm256_setzero_ps();
  for (int64_t j = 0; j < nsb; ++j) {
    const __m256 dsc = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(dr[2 * j])),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(sub + 16 * j)))));
    const __m256 dm = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(dr[2 * j + 1])),
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(sub + 16 * j + 8)))));
    for (int m = 0; m < M; ++m) {
      _mm256_store_ps(s[m] + 8 * j, _mm256_mul_ps(dsc, _mm256_loadu_ps(dx + m * nb + 8 * j)));
      mt[m] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(sx + m * nb + 8 * j), mt[m]);
    }
  }
  for (int m = 0; m < M; ++m) mterm[m] = -hsum8(mt[m]);
}
#endif

#ifdef GOODSERVE_VNNI

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bfloat16 -> float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// One activation row to int16 blocks: per block of 32, dx = max|x| / 32767, q = round(x / dx) (nearest even).
// pairs (the Q4 order): each pair of blocks (2p, 2p + 1) is laid out as block 2p's values 0-15, block
// 2p + 1's 0-15, block 2p's 16-31, block 2p + 1's 16-31, the order in which the pair's 32 code bytes
// widen to their low and high nibbles; otherwise the natural order.
template <typename T>
void quantize_row(const T* x, int64_t nb, bool pairs, int16_t* xq, float* dx, float* sx) {
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 lo = load16(x + 32 * b), hi = load16(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 32767.f, id = d > 0.f ? 1.f / d : 0.f;
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
    // max drops NaN: a block holding one gets a NaN scale, so every output it feeds is NaN, as in torch.
    const bool nan = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q);
    dx[b] = nan ? std::numeric_limits<float>::quiet_NaN() : d;
    sx[b] = dx[b] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi)));  // for Q4_1's m
    int16_t* out_lo = pairs ? xq + 64 * (b / 2) + 16 * (b % 2) : xq + 32 * b;
    int16_t* out_hi = pairs ? out_lo + 32 : out_lo + 16;
    _mm256_storeu_si256((__m256i*)out_lo, _mm512_cvtsepi32_epi16(qlo));
    _mm256_storeu_si256((__m256i*)out_hi, _mm512_cvtsepi32_epi16(qhi));
  }
}

// The per-row scale table of a K-quant weight (2 and 3: Q4_K / Q5_K, 4: Q6_K), as the ggml-quants.c
// dequantizers compute the scales: s = (d * sc) * dx per block of 32 (Q6_K: per 16, s[2b + h] for half h
// of block b), d * sc exact in float32 (11 + 6 or 8 significant bits); the minimums' term
// -sum_b (dmin * m_b) * sx_b (dmin * m exact) for Q4_K / Q5_K, 0 for Q6_K.
template <int Kind, int M>
void ksuper_scales(const uint16_t* dr, const uint8_t* sub, const float* dx, const float* sx, int64_t nb,
                   float (*s)[2 * kMaxBlocks], float* mterm) {
  const int64_t nsb = nb / 8;
  if (Kind == kQ6K) {
    const __m512i pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    for (int64_t j = 0; j < nsb; ++j) {
      const __m512 dsc = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(dr[j])),
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(sub + 16 * j)))));
      for (int m = 0; m < M; ++m) {
        const __m512 dx16 = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_loadu_ps(dx + m * nb + 8 * j)));
        _mm512_store_ps(s[m] + 16 * j, _mm512_mul_ps(dsc, dx16));
      }
    }
    for (int m = 0; m < M; ++m) mterm[m] = 0.f;
    return;
  }
  kmin_scales<M>(dr, sub, dx, sx, nb, s, mterm);
}

// Rows [n0, n1) of y, R weight rows at a time (R x M independent accumulator chains).
template <int Kind, int M, int R, typename Y>
void gemv_rows(const int16_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* codes,
               const uint16_t* d, const uint16_t* mins, int offset, int64_t n0, int64_t n1, Y* y, int64_t y_stride) {
  constexpr bool kq = super_blocks(Kind), q4 = Kind != kQ8, per16 = Kind == kQ6K;
  constexpr int hb = high_bits(Kind);
  const int64_t nb = K / 32;
  // Bytes per row and per pair of blocks: the nibbles (Q4, K-quants) and the high bit planes.
  const int64_t pair_bytes = 32 + 8 * hb, row_bytes = q4 ? nb / 2 * pair_bytes : K;
  const __m512i nibble = _mm512_set1_epi16(0x0F);
  const __m512i off = _mm512_set1_epi16(static_cast<int16_t>(offset));
  const __m512i b4 = _mm512_set1_epi16(16), b5 = _mm512_set1_epi16(32);
  alignas(64) float s[R][M][2 * kMaxBlocks];  // d * dx per weight row, activation row and block (Q6_K: half)
  for (int64_t n = n0; n < n1; n += R) {
    float mterm[R][M];  // Q4_1, Q5_1, Q4_K, Q5_K: sum over blocks of the minimum * dx * sum(q)
    for (int r = 0; r < R; ++r) {
      if constexpr (kq) {
        const int64_t sb = nb / 8;  // super-blocks of 256 per row
        const uint8_t* sub = reinterpret_cast<const uint8_t*>(mins) + (n + r) * sb * 16;
        ksuper_scales<Kind, M>(d + (n + r) * sb * (per16 ? 1 : 2), sub, dx, sx, nb, s[r], mterm[r]);
        continue;
      }
      const uint16_t* dr = d + (n + r) * nb;
      const uint16_t* mr = mins == nullptr ? nullptr : mins + (n + r) * nb;
      __m512 mt[M];
      for (int m = 0; m < M; ++m) mt[m] = _mm512_setzero_ps();
      for (int64_t b = 0; b < nb; b += 16) {
        const __mmask16 k = nb - b >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - b)) - 1u);
        const __m512 dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, dr + b));
        // The offset rides with the minimum: d * sum((u - offset) * q) = d * sum(u * q) - offset * d * sum(q).
        const __m512 mw = _mm512_fnmadd_ps(_mm512_set1_ps(static_cast<float>(offset)), dw,
            mr == nullptr ? _mm512_setzero_ps() : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, mr + b)));
        for (int m = 0; m < M; ++m) {
          _mm512_store_ps(s[r][m] + b, _mm512_mul_ps(dw, _mm512_maskz_loadu_ps(k, dx + m * nb + b)));
          mt[m] = _mm512_fmadd_ps(mw, _mm512_maskz_loadu_ps(k, sx + m * nb + b), mt[m]);
        }
      }
      for (int m = 0; m < M; ++m) mterm[r][m] = _mm512_reduce_add_ps(mt[m]);
    }
    __m512 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    // The weight rows kAhead groups ahead, fetched while this group runs, at the rate this one is read (past
    // the weight's end too: a prefetch never faults).
    const uint8_t* ahead = codes + (n + kAhead * R) * row_bytes;
    if (q4) {  // a pair of blocks at a time: 32 code bytes widen to the low and the high nibbles (+ bit planes)
      for (int64_t p = 0; p < nb / 2; ++p) {
        for (int64_t o = p * R * pair_bytes; o < (p + 1) * R * pair_bytes; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T0);
        __m512i xa[M], xb[M];
        for (int m = 0; m < M; ++m) {
          xa[m] = _mm512_loadu_si512((const void*)(xq + m * K + 64 * p));
          xb[m] = _mm512_loadu_si512((const void*)(xq + m * K + 64 * p + 32));
        }
        for (int r = 0; r < R; ++r) {
          const uint8_t* c = codes + (n + r) * row_bytes + pair_bytes * p;
          const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)c));
          __m512i lo = _mm512_and_si512(w, nibble), hi = _mm512_srli_epi16(w, 4);
          if (hb >= 1) {  // bit plane 4: one bit per lane of lo (bits 0-31) and of hi (bits 32-63)
            uint64_t plane;
            std::memcpy(&plane, c + 32, 8);
            lo = _mm512_mask_add_epi16(lo, (__mmask32)plane, lo, b4);
            hi = _mm512_mask_add_epi16(hi, (__mmask32)(plane >> 32), hi, b4);
          }
          if (hb >= 2) {  // bit plane 5
            uint64_t plane;
            std::memcpy(&plane, c + 40, 8);
            lo = _mm512_mask_add_epi16(lo, (__mmask32)plane, lo, b5);
            hi = _mm512_mask_add_epi16(hi, (__mmask32)(plane >> 32), hi, b5);
          }
          if (per16) {  // Q6_K's offset cannot ride with a minimum: its scales are per 16 weights
            lo = _mm512_sub_epi16(lo, off);
            hi = _mm512_sub_epi16(hi, off);
          }
          for (int m = 0; m < M; ++m) {
            if (per16) {  // lo: lanes 0-7 block 2p's weights 0-15, 8-15 block 2p + 1's; hi: their weights 16-31
              const float* sp = s[r][m] + 4 * p;
              const __m512i dl = _mm512_madd_epi16(lo, xa[m]);
              const __m512i dh = _mm512_madd_epi16(hi, xb[m]);
              acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dl),
                  _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sp[0]), _mm512_set1_ps(sp[2])), acc[r][m]);
              acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dh),
                  _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(sp[1]), _mm512_set1_ps(sp[3])), acc[r][m]);
            } else {  // lanes 0-7: block 2p's exact integer dot product, 8-15: block 2p + 1's
              const __m512i dot = _mm512_dpwssd_epi32(_mm512_madd_epi16(lo, xa[m]), hi, xb[m]);
              const __m512 sc =
                  _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s[r][m][2 * p]), _mm512_set1_ps(s[r][m][2 * p + 1]));
              acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[r][m]);
            }
          }
        }
      }
    } else {  // one block of 32 code bytes at a time
      for (int64_t b = 0; b < nb; ++b) {
        for (int64_t o = b * R * 32; o < (b + 1) * R * 32; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T0);
        __m512i xv[M];
        for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_si512((const void*)(xq + m * K + 32 * b));
        for (int r = 0; r < R; ++r) {
          const __m512i w =
              _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(codes + (n + r) * row_bytes + 32 * b)));
          for (int m = 0; m < M; ++m) {
            const __m512i dot = _mm512_madd_epi16(w, xv[m]);
            acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(s[r][m][b]), acc[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m)
        goodserve::store(y + m * y_stride + n + r, _mm512_reduce_add_ps(acc[r][m]) + mterm[r][m]);
  }
}

#elif defined(GOODSERVE_BLOCK_AVX2)
#include "block_gemv_avx2.h"
#endif

#ifdef GOODSERVE_BLOCKS

template <int Kind, int M, typename Y>
void gemv(const int16_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* codes, const uint16_t* d,
          const uint16_t* mins, int offset, int64_t N, Y* y, int64_t y_stride, int num_threads) {
  constexpr int R = M <= 2 ? 4 : 2;
  const int64_t chunks = N / kRowChunk;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t c = 0; c < chunks; ++c)
    gemv_rows<Kind, M, R>(xq, dx, sx, K, codes, d, mins, offset, c * kRowChunk, (c + 1) * kRowChunk, y, y_stride);
}

template <int Kind, typename Y>
void dispatch_rows(int64_t M, const int16_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* codes,
                   const uint16_t* d, const uint16_t* mins, int offset, int64_t N, Y* y, int64_t y_stride,
                   int num_threads) {
  switch (M) {
    case 1: gemv<Kind, 1>(xq, dx, sx, K, codes, d, mins, offset, N, y, y_stride, num_threads); break;
    case 2: gemv<Kind, 2>(xq, dx, sx, K, codes, d, mins, offset, N, y, y_stride, num_threads); break;
    case 3: gemv<Kind, 3>(xq, dx, sx, K, codes, d, mins, offset, N, y, y_stride, num_threads); break;
    default: gemv<Kind, 4>(xq, dx, sx, K, codes, d, mins, offset, N, y, y_stride, num_threads); break;
  }
}

template <typename X, typename Y>
void run(int kind, int64_t M, const X* x, int64_t x_stride, int64_t K, const uint8_t* codes, const uint16_t* d,
         const uint16_t* mins, int offset, int64_t N, Y* y, int64_t y_stride, int num_threads) {
  const int64_t nb = K / 32;
  thread_local std::vector<int16_t> xq;
  thread_local std::vector<float> dx, sx;
  const int64_t group = M < 4 ? M : 4;  // activation rows per pass over the weight
  const bool pairs = kind != kQ8;
  xq.resize(group * K);
  dx.resize(group * nb + 16);  // + 16: the masked vector loads stay inside
  sx.resize(group * nb + 16);
  for (int64_t m0 = 0; m0 < M; m0 += group) {
    const int64_t rows = M - m0 < group ? M - m0 : group;
    for (int64_t m = 0; m < rows; ++m)
      quantize_row(x + (m0 + m) * x_stride, nb, pairs, xq.data() + m * K, dx.data() + m * nb, sx.data() + m * nb);
    Y* out = y + m0 * y_stride;
    auto go = [&](auto k) {  // k: std::integral_constant of the kind
      dispatch_rows<decltype(k)::value>(rows, xq.data(), dx.data(), sx.data(), K, codes, d, mins, offset, N, out,
                                        y_stride, num_threads);
    };
    switch (kind) {
      case kQ4: go(std::integral_constant<int, kQ4>()); break;
      case kQ8: go(std::integral_constant<int, kQ8>()); break;
      case kQ4K: go(std::integral_constant<int, kQ4K>()); break;
      case kQ5K: go(std::integral_constant<int, kQ5K>()); break;
      case kQ6K: go(std::integral_constant<int, kQ6K>()); break;
      default: go(std::integral_constant<int, kQ5>()); break;
    }
  }
}

// One work item of the grouped product: rows [m0, m0 + rows) (rows <= 4) of the quantized activations against
// output rows [c * kRowChunk, (c + 1) * kRowChunk) of one expert's weight.
template <int Kind, typename Y>
void grouped_item(int64_t rows, const int16_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* codes,
                  const uint16_t* d, const uint16_t* mins, int offset, int64_t c, Y* y, int64_t y_stride) {
  const int64_t n0 = c * kRowChunk, n1 = n0 + kRowChunk;
  switch (rows) {
    case 1: gemv_rows<Kind, 1, 4>(xq, dx, sx, K, codes, d, mins, offset, n0, n1, y, y_stride); break;
    case 2: gemv_rows<Kind, 2, 4>(xq, dx, sx, K, codes, d, mins, offset, n0, n1, y, y_stride); break;
    case 3: gemv_rows<Kind, 3, 2>(xq, dx, sx, K, codes, d, mins, offset, n0, n1, y, y_stride); break;
    default: gemv_rows<Kind, 4, 2>(xq, dx, sx, K, codes, d, mins, offset, n0, n1, y, y_stride); break;
  }
}

// Groups g of rows [start_g, start_g + count_g) of x, each against its expert's weight (groups[3 g ..] =
// expert, start, count): every row quantized once, then one parallel loop over every group's passes of up
// to 4 rows and every chunk of output rows, so the experts of a step share one team of threads.
template <typename X, typename Y>
void run_grouped(int kind, const X* x, int64_t x_stride, int64_t K, const uint8_t* codes, int64_t codes_stride,
                 const uint8_t* d, int64_t d_stride, const uint8_t* mins, int64_t mins_stride, int offset, int64_t N,
                 const int64_t* groups, int64_t num_groups, Y* y, int64_t y_stride, int num_threads) {
  const int64_t nb = K / 32, chunks = N / kRowChunk;
  std::vector<int64_t> pass_row, pass_group;  // each pass: its first row of x and its group
  for (int64_t g = 0; g < num_groups; ++g)
    for (int64_t m = groups[3 * g + 1]; m < groups[3 * g + 1] + groups[3 * g + 2]; m += 4) {
      pass_row.push_back(m);
      pass_group.push_back(g);
    }
  const int64_t rows_total = static_cast<int64_t>(pass_row.size()) * 4;  // quantized rows, by pass
  std::vector<int16_t> xq(rows_total * K);
  std::vector<float> dx(rows_total * nb + 16), sx(rows_total * nb + 16);
  const bool pairs = kind != kQ8;
  const int64_t passes = static_cast<int64_t>(pass_row.size());
  auto pass_rows = [&](int64_t p) {
    const int64_t g = pass_group[p], end = groups[3 * g + 1] + groups[3 * g + 2];
    return end - pass_row[p] < 4 ? end - pass_row[p] : int64_t{4};
  };
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (int64_t p = 0; p < passes; ++p)
      for (int64_t m = 0; m < pass_rows(p); ++m)
        quantize_row(x + (pass_row[p] + m) * x_stride, nb, pairs, xq.data() + (4 * p + m) * K,
                     dx.data() + (4 * p + m) * nb, sx.data() + (4 * p + m) * nb);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < passes * chunks; ++i) {
      const int64_t p = i / chunks, c = i % chunks, e = groups[3 * pass_group[p]];
      const int16_t* q = xq.data() + 4 * p * K;
      const float *dp = dx.data() + 4 * p * nb, *sp = sx.data() + 4 * p * nb;
      const uint8_t* ce = codes + e * codes_stride;
      const uint16_t* de = reinterpret_cast<const uint16_t*>(d + e * d_stride);
      const uint16_t* me = mins == nullptr ? nullptr : reinterpret_cast<const uint16_t*>(mins + e * mins_stride);
      Y* out = y + pass_row[p] * y_stride;
      const int64_t rows = pass_rows(p);
      switch (kind) {
        case kQ4: grouped_item<kQ4>(rows, q, dp, sp, K, ce, de, me, offset, c, out, y_stride); break;
        case kQ8: grouped_item<kQ8>(rows, q, dp, sp, K, ce, de, me, offset, c, out, y_stride); break;
        case kQ4K: grouped_item<kQ4K>(rows, q, dp, sp, K, ce, de, me, offset, c, out, y_stride); break;
        case kQ5K: grouped_item<kQ5K>(rows, q, dp, sp, K, ce, de, me, offset, c, out, y_stride); break;
        case kQ6K: grouped_item<kQ6K>(rows, q, dp, sp, K, ce, de, me, offset, c, out, y_stride); break;
        default: grouped_item<kQ5>(rows, q, dp, sp, K, ce, de, me, offset, c, out, y_stride); break;
      }
    }
  }
}

#endif  // GOODSERVE_BLOCKS

}  // namespace

extern "C" {

// Whether this build has the kernel (AVX-512 with VNNI, or AVX2 with FMA and F16C, at compile time: -march=native).
int goodserve_block_gemv_supported() {
#ifdef GOODSERVE_BLOCKS
  return 1;
#else
  return 0;
#endif
}

// kind: 0 = 4-bit codes (Q4_0 / Q4_1), 1 = 8-bit codes (Q8_0 as q + 128), 2 = Q4_K, 3 = Q5_K, 4 = Q6_K (the
// K-quant layouts above; d and mins then point to the fp16 super-block scales and the 8-bit sub-block
// scales), 5 = 5-bit codes (Q5_0 / Q5_1, the layout above). x_dtype, y_dtype: 0 = float32,
// 1 = bfloat16. x: [M, K] with row stride x_stride; codes, d, mins (nullable): see the layouts above;
// y: [M, N] with row stride y_stride (M >= 1; each group of 4 rows is one pass over the weight). Returns 0;
// 1 for arguments outside the kernel's range (M < 1, K not a multiple of 64 up to 16384 (of 256 for the
// K-quants), N not a multiple of 16); 2 when the build has no kernel.
int goodserve_block_gemv(int kind, int x_dtype, const void* x, int64_t x_stride, int64_t M, int64_t K,
                         const uint8_t* codes, const uint16_t* d, const uint16_t* mins, int offset, int64_t N,
                         int y_dtype, void* y, int64_t y_stride, int num_threads) {
#ifdef GOODSERVE_BLOCKS
  if (M < 1 || K % 64 || K / 32 > kMaxBlocks || N % kRowChunk || kind < kQ4 || kind > kQ5 ||
      (super_blocks(kind) && (K % 256 || mins == nullptr)) || ((kind == kQ4K || kind == kQ5K) && offset != 0) ||
      x_dtype < 0 || x_dtype > 1 || y_dtype < 0 || y_dtype > 1)
    return 1;
  if (x_dtype == 0 && y_dtype == 0)
    run(kind, M, static_cast<const float*>(x), x_stride, K, codes, d, mins, offset, N, static_cast<float*>(y), y_stride, num_threads);
  else if (x_dtype == 0)
    run(kind, M, static_cast<const float*>(x), x_stride, K, codes, d, mins, offset, N, static_cast<uint16_t*>(y), y_stride, num_threads);
  else if (y_dtype == 0)
    run(kind, M, static_cast<const uint16_t*>(x), x_stride, K, codes, d, mins, offset, N, static_cast<float*>(y), y_stride, num_threads);
  else
    run(kind, M, static_cast<const uint16_t*>(x), x_stride, K, codes, d, mins, offset, N, static_cast<uint16_t*>(y), y_stride, num_threads);
  return 0;
#else
  (void)kind; (void)x_dtype; (void)x; (void)x_stride; (void)M; (void)K; (void)codes; (void)d; (void)mins;
  (void)offset; (void)N; (void)y_dtype; (void)y; (void)y_stride; (void)num_threads;
  return 2;
#endif
}

}  // extern "C"

extern "C" {

// Stacked experts' weights (expert e's codes, d and mins at byte offsets e * codes_stride, e * d_stride,
// e * mins_stride; each as goodserve_block_gemv's) against groups of rows of x: groups is [num_groups, 3]
// int64 (expert, first row, rows), and y's rows of group g are x's same rows times expert g's weight
// (rows in no group are not written). Returns goodserve_block_gemv's codes, and 1 also for a group's rows
// outside [0, M) or a negative expert (the caller checks experts against its stack).
int goodserve_block_gemv_grouped(int kind, int x_dtype, const void* x, int64_t x_stride, int64_t M, int64_t K,
                                 const uint8_t* codes, int64_t codes_stride, const uint8_t* d, int64_t d_stride,
                                 const uint8_t* mins, int64_t mins_stride, int offset, int64_t N,
                                 const int64_t* groups, int64_t num_groups, int y_dtype, void* y, int64_t y_stride,
                                 int num_threads) {
#ifdef GOODSERVE_BLOCKS
  if (K % 64 || K / 32 > kMaxBlocks || N % kRowChunk || kind < kQ4 || kind > kQ5 ||
      (super_blocks(kind) && (K % 256 || mins == nullptr)) || ((kind == kQ4K || kind == kQ5K) && offset != 0) ||
      x_dtype < 0 || x_dtype > 1 || y_dtype < 0 || y_dtype > 1)
    return 1;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t* group = groups + 3 * g;
    if (group[0] < 0 || group[1] < 0 || group[2] < 0 || group[1] + group[2] > M) return 1;
  }
  auto go = [&](auto* xp, auto* yp) {
    run_grouped(kind, xp, x_stride, K, codes, codes_stride, d, d_stride, mins, mins_stride, offset, N, groups,
                num_groups, yp, y_stride, num_threads);
  };
  if (x_dtype == 0 && y_dtype == 0) go(static_cast<const float*>(x), static_cast<float*>(y));
  else if (x_dtype == 0) go(static_cast<const float*>(x), static_cast<uint16_t*>(y));
  else if (y_dtype == 0) go(static_cast<const uint16_t*>(x), static_cast<float*>(y));
  else go(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(y));
  return 0;
#else
  (void)kind; (void)x_dtype; (void)x; (void)x_stride; (void)M; (void)K; (void)codes; (void)codes_stride; (void)d;
  (void)d_stride; (void)mins; (void)mins_stride; (void)offset; (void)N; (void)groups; (void)num_groups;
  (void)y_dtype; (void)y; (void)y_stride; (void)num_threads;
  return 2;
#endif
}

}  // extern "C"
