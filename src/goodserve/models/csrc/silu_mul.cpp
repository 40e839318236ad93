// SwiGLU's activation, silu(gate) * up (Shazeer 2020), for rows of [gate | up] as the fused gate_up
// projection writes them. One function serves the layer-by-layer path and the one-call decode step
// (decode_step.cpp), so a token's activations are the same bits on both.
//
// Rounding follows the eager ops: silu(g) = g / (1 + exp(-g)) in float32, rounded to the activation dtype,
// then the product with up, rounded again. exp is computed here (AVX-512: range reduction to
// 2^n * exp(r), |r| <= ln 2 / 2, and a degree-6 polynomial, within 2 ulp of float32 exp) and the tail of a row
// runs the same vector code under a mask, so an element's value never depends on where it sits in the row.

#include <cmath>
#include <cstdint>

#include <omp.h>

#include "dtype.h"
#include "kernels.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)

inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln2, ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16(const uint16_t* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}
// float32 -> the dtype and back, rounded to nearest even (NaN kept): the value a store would hold.
inline __m512 round16(__m512 v, const float*) { return v; }
inline __m512 round16(__m512 v, const uint16_t*) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(_mm512_srli_epi32(u, 16),
                                                                                     _mm512_set1_epi32(1)));
  __m512i r = _mm512_and_si512(_mm512_add_epi32(u, bias), _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_or_epi32(r, nan, _mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xffff0000u))),
                           _mm512_set1_epi32(0x00400000));
  return _mm512_castsi512_ps(r);
}
inline void store16(float* p, __m512 v, __mmask16 k) { _mm512_mask_storeu_ps(p, k, v); }
inline void store16(uint16_t* p, __m512 v, __mmask16 k) {
  _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round16(v, p)), 16)));
}

template <typename T>
void row(const T* g, const T* u, int64_t inter, T* o) {
  for (int64_t i = 0; i < inter; i += 16) {
    const __mmask16 k = inter - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (inter - i)) - 1u);
    const __m512 x = load16(g + i, k);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    const __m512 s = round16(_mm512_div_ps(x, _mm512_add_ps(e, _mm512_set1_ps(1.f))), o);
    store16(o + i, _mm512_mul_ps(s, load16(u + i, k)), k);
  }
}

#else

template <typename T>
void row(const T* g, const T* u, int64_t inter, T* o) {
  for (int64_t i = 0; i < inter; ++i) {
    const float x = goodserve::load(g + i);
    T s;
    goodserve::store(&s, x / (1.f + std::exp(-x)));
    goodserve::store(o + i, goodserve::load(&s) * goodserve::load(u + i));
  }
}

#endif

template <typename T>
void run(const T* gate_up, int64_t stride, int64_t rows, int64_t inter, T* out, int num_threads) {
  const int threads = rows * inter >= (1 << 15) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) row(gate_up + r * stride, gate_up + r * stride + inter, inter, out + r * inter);
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16. gate_up: [rows, 2 * inter] with row stride `stride` (gate then up);
// out: [rows, inter], contiguous. Returns 0, or 1 for an unknown dtype.
int goodserve_silu_mul(int dtype, const void* gate_up, int64_t stride, int64_t rows, int64_t inter, void* out,
                       int num_threads) {
  if (dtype == 0)
    run(static_cast<const float*>(gate_up), stride, rows, inter, static_cast<float*>(out), num_threads);
  else if (dtype == 1)
    run(static_cast<const uint16_t*>(gate_up), stride, rows, inter, static_cast<uint16_t*>(out), num_threads);
  else
    return 1;
  return 0;
}

}  // extern "C"
