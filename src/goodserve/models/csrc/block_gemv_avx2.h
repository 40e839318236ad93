// The block kernel's per-ISA pieces on AVX2 (+ FMA, F16C), for CPUs without AVX-512 VNNI: the same layouts,
// the same int16 activations and the same exact int32 dot products per block as block_gemv.cpp's AVX-512 code,
// 8 lanes wide. Included by block_gemv.cpp inside its anonymous namespace, after the kind constants, where
// GOODSERVE_BLOCK_AVX2 is defined (it uses hsum8 and kmin_scales from there); it defines what the shared drivers
// there call: quantize_row, ksuper_scales and gemv_rows.
#pragma once

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // bfloat16 -> float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

inline int32_t hsum8i(__m256i v) {
  const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i q = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32(q, 0xB1)));
}

// 16 int32 (a: values 0-7, b: 8-15) to 16 int16 in order, saturating as _mm512_cvtsepi32_epi16 does.
inline __m256i pack16(__m256i a, __m256i b) {
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // packs interleaves 128-bit halves
}

// block_gemv.cpp's quantize_row (same rounding, same pair order), 8 lanes at a time.
template <typename T>
void quantize_row(const T* x, int64_t nb, bool pairs, int16_t* xq, float* dx, float* sx) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < nb; ++b) {
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = load8(x + 32 * b + 8 * i);
    const __m256 a = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
    const float d = amax / 32767.f, id = d > 0.f ? 1.f / d : 0.f;
    __m256i q[4];
    int nan = 0;
    for (int i = 0; i < 4; ++i) {
      q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
      nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    // max drops NaN: a block holding one gets a NaN scale, so every output it feeds is NaN, as in torch.
    dx[b] = nan ? std::numeric_limits<float>::quiet_NaN() : d;
    const __m256i qs = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    sx[b] = dx[b] * static_cast<float>(hsum8i(qs));  // for Q4_1's m
    int16_t* out_lo = pairs ? xq + 64 * (b / 2) + 16 * (b % 2) : xq + 32 * b;
    int16_t* out_hi = pairs ? out_lo + 32 : out_lo + 16;
    _mm256_storeu_si256((__m256i*)out_lo, pack16(q[0], q[1]));
    _mm256_storeu_si256((__m256i*)out_hi, pack16(q[2], q[3]));
  }
}

// block_gemv.cpp's ksuper_scales (the same products and sums, in the same order per lane); Q4_K / Q5_K share
// its kmin_scales.
template <int Kind, int M>
void ksuper_scales(const uint16_t* dr, const uint8_t* sub, const float* dx, const float* sx, int64_t nb,
                   float (*s)[2 * kMaxBlocks], float* mterm) {
  const int64_t nsb = nb / 8;
  if (Kind == kQ6K) {
    const __m256i lo_pairs = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);
    const __m256i hi_pairs = _mm256_set_epi32(7, 7, 6, 6, 5, 5, 4, 4);
    auto scales8 = [](const uint8_t* p) {  // 8 int8 sub-block scales as float32
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
    };
    for (int64_t j = 0; j < nsb; ++j) {
      const __m256 d = _mm256_set1_ps(_cvtsh_ss(dr[j]));
      const __m256 dsc_lo = _mm256_mul_ps(d, scales8(sub + 16 * j));
      const __m256 dsc_hi = _mm256_mul_ps(d, scales8(sub + 16 * j + 8));
      for (int m = 0; m < M; ++m) {
        const __m256 dx8 = _mm256_loadu_ps(dx + m * nb + 8 * j);
        _mm256_store_ps(s[m] + 16 * j, _mm256_mul_ps(dsc_lo, _mm256_permutevar8x32_ps(dx8, lo_pairs)));
        _mm256_store_ps(s[m] + 16 * j + 8, _mm256_mul_ps(dsc_hi, _mm256_permutevar8x32_ps(dx8, hi_pairs)));
      }
    }
    for (int m = 0; m < M; ++m) mterm[m] = 0.f;
    return;
  }
  kmin_scales<M>(dr, sub, dx, sx, nb, s, mterm);
}

// value (16 for code bit 4, 32 for bit 5) added to each int16 code of v, lane i, whose bit i of plane16 is set.
inline __m256i add_plane(__m256i v, uint32_t plane16, __m256i value) {
  const __m256i sel = _mm256_set_epi16(-32768, 16384, 8192, 4096, 2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1);
  const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(static_cast<int16_t>(plane16)), sel), sel);
  return _mm256_add_epi16(v, _mm256_and_si256(set, value));
}

// Rows [n0, n1) of y, R weight rows at a time: block_gemv.cpp's gemv_rows, a block's exact int32 dot product
// in 8 lanes (two vpmaddwd of 16 codes each) scaled once per block.
template <int Kind, int M, int R, typename Y>
void gemv_rows(const int16_t* xq, const float* dx, const float* sx, int64_t K, const uint8_t* codes,
               const uint16_t* d, const uint16_t* mins, int offset, int64_t n0, int64_t n1, Y* y, int64_t y_stride) {
  constexpr bool kq = super_blocks(Kind), q4 = Kind != kQ8, per16 = Kind == kQ6K;
  constexpr int hb = high_bits(Kind);
  const int64_t nb = K / 32;
  const int64_t pair_bytes = 32 + 8 * hb, row_bytes = q4 ? nb / 2 * pair_bytes : K;
  const __m256i nibble = _mm256_set1_epi16(0x0F);
  const __m256i off = _mm256_set1_epi16(static_cast<int16_t>(offset));
  const __m256i b4 = _mm256_set1_epi16(16), b5 = _mm256_set1_epi16(32);
  alignas(64) float s[R][M][2 * kMaxBlocks];  // d * dx per weight row, activation row and block (Q6_K: half)
  for (int64_t n = n0; n < n1; n += R) {
    float mterm[R][M];  // Q4_1, Q5_1, Q4_K, Q5_K: sum over blocks of the minimum * dx * sum(q)
    for (int r = 0; r < R; ++r) {
      if constexpr (kq) {
        const int64_t sb = nb / 8;
        const uint8_t* sub = reinterpret_cast<const uint8_t*>(mins) + (n + r) * sb * 16;
        ksuper_scales<Kind, M>(d + (n + r) * sb * (per16 ? 1 : 2), sub, dx, sx, nb, s[r], mterm[r]);
        continue;
      }
      const uint16_t* dr = d + (n + r) * nb;
      const uint16_t* mr = mins == nullptr ? nullptr : mins + (n + r) * nb;
      // The offset rides with the minimum: d * sum((u - offset) * q) = d * sum(u * q) - offset * d * sum(q).
      __m256 mt[M];
      for (int m = 0; m < M; ++m) mt[m] = _mm256_setzero_ps();
      int64_t b = 0;
      for (; b + 8 <= nb; b += 8) {
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(dr + b)));
        const __m256 mw = _mm256_fnmadd_ps(_mm256_set1_ps(static_cast<float>(offset)), dw,
            mr == nullptr ? _mm256_setzero_ps() : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(mr + b))));
        for (int m = 0; m < M; ++m) {
          _mm256_store_ps(s[r][m] + b, _mm256_mul_ps(dw, _mm256_loadu_ps(dx + m * nb + b)));
          mt[m] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(sx + m * nb + b), mt[m]);
        }
      }
      for (int m = 0; m < M; ++m) mterm[r][m] = hsum8(mt[m]);
      for (; b < nb; ++b) {  // the last nb % 8 blocks
        const float dw = _cvtsh_ss(dr[b]), mw = (mr == nullptr ? 0.f : _cvtsh_ss(mr[b])) - offset * dw;
        for (int m = 0; m < M; ++m) {
          s[r][m][b] = dw * dx[m * nb + b];
          mterm[r][m] += mw * sx[m * nb + b];
        }
      }
    }
    __m256 acc[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
    const uint8_t* ahead = codes + (n + kAhead * R) * row_bytes;  // as block_gemv.cpp's: see kAhead
    if (q4) {  // a pair of blocks: 16 code bytes each widen to the block's weights 0-15 and 16-31
      for (int64_t p = 0; p < nb / 2; ++p) {
        for (int64_t o = p * R * pair_bytes; o < (p + 1) * R * pair_bytes; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T0);
        // x[m][0 | 1]: block 2p's | 2p + 1's values 0-15, x[m][2 | 3]: their values 16-31 (the pair order)
        __m256i xv[M][4];
        for (int m = 0; m < M; ++m)
          for (int i = 0; i < 4; ++i) xv[m][i] = _mm256_loadu_si256((const __m256i*)(xq + m * K + 64 * p + 16 * i));
        for (int r = 0; r < R; ++r) {
          const uint8_t* c = codes + (n + r) * row_bytes + pair_bytes * p;
          __m256i w[4];  // block 2p's weights 0-15, 2p + 1's 0-15, 2p's 16-31, 2p + 1's 16-31
          for (int h = 0; h < 2; ++h) {
            const __m256i wb = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(c + 16 * h)));
            w[h] = _mm256_and_si256(wb, nibble);
            w[2 + h] = _mm256_srli_epi16(wb, 4);
          }
          if (hb >= 1) {  // bit plane 4, bit i for lane i of w[0], w[1], w[2], w[3] in turn
            uint64_t plane;
            std::memcpy(&plane, c + 32, 8);
            for (int i = 0; i < 4; ++i) w[i] = add_plane(w[i], static_cast<uint32_t>(plane >> (16 * i)) & 0xFFFF, b4);
          }
          if (hb >= 2) {  // bit plane 5
            uint64_t plane;
            std::memcpy(&plane, c + 40, 8);
            for (int i = 0; i < 4; ++i) w[i] = add_plane(w[i], static_cast<uint32_t>(plane >> (16 * i)) & 0xFFFF, b5);
          }
          if (per16)  // Q6_K's offset cannot ride with a minimum: its scales are per 16 weights
            for (int i = 0; i < 4; ++i) w[i] = _mm256_sub_epi16(w[i], off);
          for (int m = 0; m < M; ++m) {
            if (per16) {  // one scale per 16 weights: s[4p + 2 * (block - 2p) + half]
              const float* sp = s[r][m] + 4 * p;
              constexpr int slot[4] = {0, 2, 1, 3};
              for (int i = 0; i < 4; ++i)
                acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(w[i], xv[m][i])),
                                            _mm256_set1_ps(sp[slot[i]]), acc[r][m]);
            } else {  // each block's exact integer dot product, scaled once
              const __m256i d0 = _mm256_add_epi32(_mm256_madd_epi16(w[0], xv[m][0]), _mm256_madd_epi16(w[2], xv[m][2]));
              const __m256i d1 = _mm256_add_epi32(_mm256_madd_epi16(w[1], xv[m][1]), _mm256_madd_epi16(w[3], xv[m][3]));
              acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d0), _mm256_set1_ps(s[r][m][2 * p]), acc[r][m]);
              acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d1), _mm256_set1_ps(s[r][m][2 * p + 1]), acc[r][m]);
            }
          }
        }
      }
    } else {  // one block of 32 code bytes at a time
      for (int64_t b = 0; b < nb; ++b) {
        for (int64_t o = b * R * 32; o < (b + 1) * R * 32; o += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T0);
        __m256i xv[M][2];
        for (int m = 0; m < M; ++m)
          for (int i = 0; i < 2; ++i) xv[m][i] = _mm256_loadu_si256((const __m256i*)(xq + m * K + 32 * b + 16 * i));
        for (int r = 0; r < R; ++r) {
          const uint8_t* c = codes + (n + r) * row_bytes + 32 * b;
          const __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)c));
          const __m256i w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(c + 16)));
          for (int m = 0; m < M; ++m) {
            const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(w0, xv[m][0]), _mm256_madd_epi16(w1, xv[m][1]));
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s[r][m][b]), acc[r][m]);
          }
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) goodserve::store(y + m * y_stride + n + r, hsum8(acc[r][m]) + mterm[r][m]);
  }
}
