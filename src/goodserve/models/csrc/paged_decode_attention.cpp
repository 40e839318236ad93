// Paged decode attention on the CPU: one query token per request, read straight from the block table.
//
// Called as the torch op goodserve::paged_decode_attention (torch_bindings.cpp); goodserve/models/native.py
// checks shapes, dtypes and layouts before the call.
//
// Layout (goodserve/models/attention.py): the cache of one layer is [num_blocks, block_size, num_kv_heads,
// head_dim]; token p of request i lives in block block_tables[i][p / block_size], row p % block_size.
// An int8 cache (goodserve/models/kv_quant.py) is [num_blocks, block_size, num_kv_heads, head_dim + 4]: each
// row is head_dim int8 codes then its float32 scale. It is read in place, codes converted to float32 in
// registers: q.k = scale_k * sum_d q_d * code_d, and V is accumulated as p * scale_v * code. Only the
// portable path (attend) takes int8 caches; the AVX-512 variants read float32 / bfloat16 caches.
// Grouped-query attention: the num_heads / num_kv_heads query heads that share a KV head are computed
// together, so each K and V row is read from memory once per KV head.
//
// The softmax is the online (streaming) one of flash attention (Dao et al. 2022, Alg. 1; Milakov and
// Gimelshein 2018), per block of the table. A request's context may be cut into splits that run in parallel
// and are merged at the end with their maxima and sums (flash-decoding, Dao et al. 2023), so a lone long
// request still uses every thread. Accumulation is in float32; inputs and output are bfloat16 or float32.
//
// Threads: an OpenMP parallel region whose work items are (request, KV head, split), handed out through an
// atomic counter. The library links the libgomp that torch has already loaded (same soname), so the kernel
// shares torch's thread pool instead of starting a second one.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "dtype.h"
#include "kernels.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using goodserve::load;
using goodserve::store;

constexpr int kLanes = 16;  // independent partial sums, so the compiler vectorises the dot products

// Dot product of a float32 query row with one cache row of head_dim elements.
template <typename T>
inline float dot(const float* q, const T* k, int head_dim) {
  float part[kLanes] = {0.f};
  int d = 0;
  for (; d + kLanes <= head_dim; d += kLanes)
    for (int j = 0; j < kLanes; ++j) part[j] += q[d + j] * load(k + d + j);
  float s = 0.f;
  for (; d < head_dim; ++d) s += q[d] * load(k + d);
  for (int j = 0; j < kLanes; ++j) s += part[j];
  return s;
}

// A cache row: head_dim elements of the activation dtype (no scale), or int8 codes followed by their float32
// scale (kExtra = 4 bytes past head_dim).
template <typename C>
struct Rows {
  static constexpr int64_t kExtra = 0;
  static float scale(const C*, int64_t) { return 1.f; }
};
template <>
struct Rows<int8_t> {
  static constexpr int64_t kExtra = 4;
  static float scale(const int8_t* row, int64_t head_dim) {
    float s;
    std::memcpy(&s, row + head_dim, sizeof s);
    return s;
  }
};

struct Shape {
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  int64_t q_stride;  // elements between two requests' query rows
  int64_t split_tokens, num_splits;
};

// Starts a work item: the group's queries, scaled, into qf; accumulators, maxima and sums emptied.
template <typename T>
void init_item(const Shape& s, const T* q, int64_t i, int64_t h, float scale, float* qf, float* acc, float* mx,
               float* sum) {
  const int64_t group = s.num_heads / s.num_kv_heads, D = s.head_dim;
  for (int64_t g = 0; g < group; ++g) {
    const T* qg = q + i * s.q_stride + (h * group + g) * D;
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = load(qg + d) * scale;
    mx[g] = -std::numeric_limits<float>::infinity();
    sum[g] = 0.f;
    for (int64_t d = 0; d < D; ++d) acc[g * D + d] = 0.f;
  }
}

// One work item: query heads [h * group, (h + 1) * group) of request i over context tokens [t0, t1).
// Writes the group's unnormalised accumulators, maxima and sums into acc / mx / sum. T: the query's dtype;
// C: the cache's (T, or int8 rows with their scales).
template <typename T, typename C>
void attend(const Shape& s, const T* q, const C* k_cache, const C* v_cache, const int32_t* block_tables,
            int64_t i, int64_t h, int64_t t0, int64_t t1, float scale, float* acc, float* mx, float* sum,
            std::vector<float>& qf, std::vector<float>& scores, std::vector<float>& row) {
  const int64_t group = s.num_heads / s.num_kv_heads, D = s.head_dim, bs = s.block_size;
  const int64_t W = D + Rows<C>::kExtra;  // elements of one cache row
  const int64_t token_stride = s.num_kv_heads * W;
  init_item(s, q, i, h, scale, qf.data(), acc, mx, sum);
  const int32_t* table = block_tables + i * s.max_blocks;
  for (int64_t start = t0; start < t1;) {
    const int64_t block = table[start / bs], first = start % bs;
    const int64_t n = std::min<int64_t>(bs - first, t1 - start);
    const int64_t base = (block * bs + first) * token_stride + h * W;
    const C* kb = k_cache + base;
    const C* vb = v_cache + base;
    for (int64_t t = 0; t < n; ++t) {
      const C* kr = kb + t * token_stride;
      for (int64_t g = 0; g < group; ++g) {
        if constexpr (Rows<C>::kExtra != 0)
          scores[g * bs + t] = dot(&qf[g * D], kr, (int)D) * Rows<C>::scale(kr, D);
        else
          scores[g * bs + t] = dot(&qf[g * D], kr, (int)D);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float m = mx[g];
      for (int64_t t = 0; t < n; ++t) m = std::max(m, scores[g * bs + t]);
      const float correction = std::exp(mx[g] - m);  // exp(-inf) = 0 on the first block
      sum[g] *= correction;
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= correction;
      for (int64_t t = 0; t < n; ++t) {
        const float p = std::exp(scores[g * bs + t] - m);
        scores[g * bs + t] = p;
        sum[g] += p;
      }
      mx[g] = m;
    }
    for (int64_t t = 0; t < n; ++t) {
      const C* vr = vb + t * token_stride;
      if constexpr (Rows<C>::kExtra != 0) {
        const float sv = Rows<C>::scale(vr, D);
        for (int64_t d = 0; d < D; ++d) row[d] = load(vr + d) * sv;
      } else {
        for (int64_t d = 0; d < D; ++d) row[d] = load(vr + d);
      }
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * bs + t];
        float* a = acc + g * D;
        for (int64_t d = 0; d < D; ++d) a[d] += p * row[d];
      }
    }
    start += n;
  }
}

#if defined(__AVX512F__)
// The same work item with AVX-512: 16 float32 lanes along head_dim for the dot products and the weighted
// sum of V, 16 tokens at a time for the softmax. Used when head_dim is a multiple of 16 (at most 256).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 Taylor polynomial in r (relative error
// under 2e-7 there), scaled by 2^n. Inputs below -87 give ~1e-38 instead of 0 (weights that small vanish
// in the sums anyway).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

constexpr int kMaxChunks = 16;  // head_dim <= 256

template <typename T>
void attend16(const Shape& s, const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
              int64_t i, int64_t h, int64_t t0, int64_t t1, float scale, float* acc, float* mx, float* sum,
              std::vector<float>& qf, std::vector<float>& scores) {
  const int64_t group = s.num_heads / s.num_kv_heads, D = s.head_dim, bs = s.block_size, C = D / 16;
  const int64_t token_stride = s.num_kv_heads * D;
  init_item(s, q, i, h, scale, qf.data(), acc, mx, sum);
  const int32_t* table = block_tables + i * s.max_blocks;
  __m512 kv[kMaxChunks];
  for (int64_t start = t0; start < t1;) {
    const int64_t block = table[start / bs], first = start % bs;
    const int64_t n = std::min<int64_t>({bs - first, t1 - start, int64_t{16}});
    const int64_t base = (block * bs + first) * token_stride + h * D;
    const T* kb = k_cache + base;
    const T* vb = v_cache + base;
    for (int64_t t = 0; t < n; ++t) {
      const T* kr = kb + t * token_stride;
      for (int64_t c = 0; c < C; ++c) kv[c] = load16(kr + 16 * c);
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = qf.data() + g * D;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
        for (int64_t c = 1; c < C; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kv[c], a);
        scores[g * 16 + t] = _mm512_reduce_add_ps(a);
      }
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 sc = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid,
                                             scores.data() + g * 16);
      const float m = std::max(mx[g], _mm512_reduce_max_ps(sc));
      const float correction = std::exp(mx[g] - m);  // exp(-inf) = 0 on the first block
      const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m))));
      _mm512_storeu_ps(scores.data() + g * 16, p);
      sum[g] = sum[g] * correction + _mm512_reduce_add_ps(p);
      mx[g] = m;
      if (correction != 1.f) {
        const __m512 cv = _mm512_set1_ps(correction);
        for (int64_t c = 0; c < C; ++c)
          _mm512_storeu_ps(acc + g * D + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * c), cv));
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      const T* vr = vb + t * token_stride;
      for (int64_t c = 0; c < C; ++c) kv[c] = load16(vr + 16 * c);
      for (int64_t g = 0; g < group; ++g) {
        const __m512 pb = _mm512_set1_ps(scores[g * 16 + t]);
        float* a = acc + g * D;
        for (int64_t c = 0; c < C; ++c)
          _mm512_storeu_ps(a + 16 * c, _mm512_fmadd_ps(pb, kv[c], _mm512_loadu_ps(a + 16 * c)));
      }
    }
    start += n;
  }
}

// attend16 with head_dim = 16 * C and G query heads per KV head known at compile time (SmolLM2: C = 4,
// G = 3; Llama-3-8B: C = 8, G = 4), for every KV head of request i at once: the context is walked block by
// block and each block's rows (all KV heads of a token are contiguous) are read once, in order, while the
// heads' queries and accumulators live in `st` between blocks.
template <int C, int G>
struct HeadState {
  __m512 q[G][C], acc[G][C];
  float mx[G], sum[G];
};

template <typename T, int C, int G>
void attend_fixed(const Shape& s, const T* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                  int64_t i, int64_t t0, int64_t t1, float scale, float* const* outs, HeadState<C, G>* st) {
  constexpr int D = 16 * C;
  const int64_t bs = s.block_size, H = s.num_kv_heads, token_stride = H * D;
  for (int64_t h = 0; h < H; ++h) {
    for (int g = 0; g < G; ++g) {
      const T* qg = q + i * s.q_stride + (h * G + g) * D;
      for (int c = 0; c < C; ++c) {
        st[h].q[g][c] = _mm512_mul_ps(load16(qg + 16 * c), _mm512_set1_ps(scale));
        st[h].acc[g][c] = _mm512_setzero_ps();
      }
      st[h].mx[g] = -std::numeric_limits<float>::infinity();
      st[h].sum[g] = 0.f;
    }
  }
  const int32_t* table = block_tables + i * s.max_blocks;
  alignas(64) float scores[G][16];
  for (int64_t start = t0; start < t1;) {
    const int64_t block = table[start / bs], first = start % bs;
    const int64_t n = std::min<int64_t>(std::min<int64_t>(bs - first, t1 - start), 16);
    const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
    for (int64_t h = 0; h < H; ++h) {
      HeadState<C, G>& hs = st[h];
      const int64_t base = (block * bs + first) * token_stride + h * D;
      const T* kb = k_cache + base;
      const T* vb = v_cache + base;
      for (int64_t t = 0; t < n; ++t) {
        __m512 kv[C];
        for (int c = 0; c < C; ++c) kv[c] = load16(kb + t * token_stride + 16 * c);
        for (int g = 0; g < G; ++g) {
          __m512 a = _mm512_mul_ps(hs.q[g][0], kv[0]);
          for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(hs.q[g][c], kv[c], a);
          scores[g][t] = _mm512_reduce_add_ps(a);
        }
      }
      for (int g = 0; g < G; ++g) {
        const __m512 sc = _mm512_mask_load_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid,
                                              scores[g]);
        const float m = std::max(hs.mx[g], _mm512_reduce_max_ps(sc));
        const float correction = std::exp(hs.mx[g] - m);  // exp(-inf) = 0 on the first block
        const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(m))));
        hs.sum[g] = hs.sum[g] * correction + _mm512_reduce_add_ps(p);
        hs.mx[g] = m;
        if (correction != 1.f)
          for (int c = 0; c < C; ++c) hs.acc[g][c] = _mm512_mul_ps(hs.acc[g][c], _mm512_set1_ps(correction));
        _mm512_store_ps(scores[g], p);
      }
      for (int64_t t = 0; t < n; ++t) {
        __m512 vv[C];
        for (int c = 0; c < C; ++c) vv[c] = load16(vb + t * token_stride + 16 * c);
        for (int g = 0; g < G; ++g) {
          const __m512 pb = _mm512_set1_ps(scores[g][t]);
          for (int c = 0; c < C; ++c) hs.acc[g][c] = _mm512_fmadd_ps(pb, vv[c], hs.acc[g][c]);
        }
      }
    }
    start += n;
  }
  for (int64_t h = 0; h < H; ++h) {
    float* out = outs[h];  // group * D accumulators, then group maxima, then group sums
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + g * D + 16 * c, st[h].acc[g][c]);
      out[G * D + g] = st[h].mx[g];
      out[G * D + G + g] = st[h].sum[g];
    }
  }
}

// Runs attend_fixed for request i over [t0, t1), every KV head; outs[h] receives head h's partial result.
using FixedFn = void (*)(const Shape&, const void*, const void*, const void*, const int32_t*, int64_t, int64_t,
                         int64_t, float, float* const*);

template <typename T, int C, int G>
void fixed_entry(const Shape& s, const void* q, const void* k, const void* v, const int32_t* bt, int64_t i,
                 int64_t t0, int64_t t1, float scale, float* const* outs) {
  thread_local std::vector<HeadState<C, G>> st;
  if (st.size() < static_cast<size_t>(s.num_kv_heads)) st.resize(s.num_kv_heads);
  attend_fixed<T, C, G>(s, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), bt, i,
                        t0, t1, scale, outs, st.data());
}

// The compile-time variant for this shape, or nullptr.
template <typename T>
FixedFn pick_fixed(int64_t head_dim, int64_t group) {
#define GOODSERVE_FIXED(C, G) \
  if (head_dim == 16 * (C) && group == (G)) return &fixed_entry<T, C, G>;
  GOODSERVE_FIXED(4, 1) GOODSERVE_FIXED(4, 2) GOODSERVE_FIXED(4, 3) GOODSERVE_FIXED(4, 4)
  GOODSERVE_FIXED(8, 1) GOODSERVE_FIXED(8, 2) GOODSERVE_FIXED(8, 4) GOODSERVE_FIXED(8, 8)
#undef GOODSERVE_FIXED
  return nullptr;
}
#endif

template <typename T, typename C>
void run(const Shape& s, const T* q, const C* k_cache, const C* v_cache, const int32_t* block_tables,
         const int32_t* seq_lens, float scale, T* out, int num_threads) {
  constexpr bool kSame = std::is_same<T, C>::value;  // the AVX-512 variants read caches of q's dtype only
  const int64_t group = s.num_heads / s.num_kv_heads, D = s.head_dim;
  // Per (request, KV head, split): group * D accumulators, then group maxima and group sums.
  const int64_t per_item = group * (D + 2);
  std::vector<float> partial(static_cast<size_t>(s.num_seqs * s.num_kv_heads * s.num_splits * per_item));
#if defined(__AVX512F__)
  const FixedFn fixed = kSame ? pick_fixed<T>(D, group) : nullptr;
  const bool wide = kSame && D % 16 == 0 && D <= 16 * kMaxChunks;
#else
  const bool fixed = false;
#endif
  // A work item is (request, split) with every KV head on the compile-time path, else (request, KV head,
  // split).
  const int64_t heads_per_item = fixed ? s.num_kv_heads : 1;
  const int64_t items = s.num_seqs * (s.num_kv_heads / heads_per_item) * s.num_splits;
  std::atomic<int64_t> next(0);
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> qf(group * D), scores(group * std::max<int64_t>(s.block_size, 16)), row(D);
    std::vector<float*> outs(s.num_kv_heads);
    for (int64_t item = next.fetch_add(1); item < items; item = next.fetch_add(1)) {
      const int64_t split = item % s.num_splits, ih = item / s.num_splits;
      const int64_t i = ih * heads_per_item / s.num_kv_heads, h = ih * heads_per_item % s.num_kv_heads;
      const int64_t len = seq_lens[i];
      const int64_t t0 = std::min(len, split * s.split_tokens), t1 = std::min(len, t0 + s.split_tokens);
      float* p = partial.data() + ((i * s.num_kv_heads + h) * s.num_splits + split) * per_item;
#if defined(__AVX512F__)
      if (fixed != nullptr) {
        for (int64_t hh = 0; hh < s.num_kv_heads; ++hh)
          outs[hh] = partial.data() + ((i * s.num_kv_heads + hh) * s.num_splits + split) * per_item;
        fixed(s, q, k_cache, v_cache, block_tables, i, t0, t1, scale, outs.data());
        continue;
      }
      if constexpr (kSame) {
        if (wide) {
          attend16(s, q, k_cache, v_cache, block_tables, i, h, t0, t1, scale, p, p + group * D,
                   p + group * (D + 1), qf, scores);
          continue;
        }
      }
#endif
      attend(s, q, k_cache, v_cache, block_tables, i, h, t0, t1, scale, p, p + group * D, p + group * (D + 1),
             qf, scores, row);
    }
  }
  // Merge the splits of each (request, query head) and normalise (cheap: splits x head_dim per head).
  for (int64_t ih = 0; ih < s.num_seqs * s.num_kv_heads; ++ih) {
    const int64_t i = ih / s.num_kv_heads, h = ih % s.num_kv_heads;
    for (int64_t g = 0; g < group; ++g) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t sp = 0; sp < s.num_splits; ++sp)
        m = std::max(m, partial[(ih * s.num_splits + sp) * per_item + group * D + g]);
      float total = 0.f, o[1024];
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      for (int64_t sp = 0; sp < s.num_splits; ++sp) {
        const float* p = partial.data() + (ih * s.num_splits + sp) * per_item;
        const float sp_sum = p[group * (D + 1) + g];
        if (sp_sum == 0.f) continue;  // an empty split (past the request's length)
        const float w = std::exp(p[group * D + g] - m);
        total += sp_sum * w;
        for (int64_t d = 0; d < D; ++d) o[d] += p[g * D + d] * w;
      }
      T* dst = out + (i * s.num_heads + h * group + g) * D;
      const float inv = total > 0.f ? 1.f / total : 0.f;
      for (int64_t d = 0; d < D; ++d) store(dst + d, o[d] * inv);
    }
  }
}

}  // namespace

extern "C" {

// Returns 0 on success, 1 for an unsupported dtype code, 2 for a head_dim over 1024.
// dtype: 0 = float32, 1 = bfloat16. q: [num_seqs, num_heads, head_dim] with row stride q_stride (elements);
// caches: [num_blocks, block_size, num_kv_heads, head_dim], contiguous; block_tables: [num_seqs,
// max_blocks] int32; seq_lens: [num_seqs] int32, every one >= 1; out: [num_seqs, num_heads, head_dim].
int goodserve_paged_decode_attention(int dtype, const void* q, const void* k_cache, const void* v_cache,
                                     const int32_t* block_tables, const int32_t* seq_lens, void* out,
                                     int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                     int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                     int64_t q_stride, int64_t split_tokens, int64_t num_splits, float scale,
                                     int num_threads) {
  if (head_dim > 1024) return 2;
  Shape s{num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, q_stride, split_tokens, num_splits};
  if (dtype == 0) {
    run(s, static_cast<const float*>(q), static_cast<const float*>(k_cache), static_cast<const float*>(v_cache),
        block_tables, seq_lens, scale, static_cast<float*>(out), num_threads);
  } else if (dtype == 1) {
    run(s, static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k_cache),
        static_cast<const uint16_t*>(v_cache), block_tables, seq_lens, scale, static_cast<uint16_t*>(out),
        num_threads);
  } else {
    return 1;
  }
  return 0;
}

// A float32 query over a bfloat16 cache (``--dtype float32 --kv-cache-dtype bfloat16``): the portable path,
// each cache element widened in registers. Same arguments and return codes, without the dtype code.
int goodserve_paged_decode_attention_bf16_cache(const float* q, const uint16_t* k_cache, const uint16_t* v_cache,
                                                const int32_t* block_tables, const int32_t* seq_lens, float* out,
                                                int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                                int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                                int64_t q_stride, int64_t split_tokens, int64_t num_splits,
                                                float scale, int num_threads) {
  if (head_dim > 1024) return 2;
  Shape s{num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, q_stride, split_tokens, num_splits};
  run(s, q, k_cache, v_cache, block_tables, seq_lens, scale, out, num_threads);
  return 0;
}

// The same over an int8 cache: [num_blocks, block_size, num_kv_heads, head_dim + 4] int8, each row head_dim
// codes then its float32 scale (goodserve/models/kv_quant.py); q and out in dtype. Same return codes.
int goodserve_paged_decode_attention_q8(int dtype, const void* q, const int8_t* k_cache, const int8_t* v_cache,
                                        const int32_t* block_tables, const int32_t* seq_lens, void* out,
                                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                        int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                        int64_t q_stride, int64_t split_tokens, int64_t num_splits, float scale,
                                        int num_threads) {
  if (head_dim > 1024) return 2;
  Shape s{num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, q_stride, split_tokens, num_splits};
  if (dtype == 0) {
    run(s, static_cast<const float*>(q), k_cache, v_cache, block_tables, seq_lens, scale, static_cast<float*>(out),
        num_threads);
  } else if (dtype == 1) {
    run(s, static_cast<const uint16_t*>(q), k_cache, v_cache, block_tables, seq_lens, scale,
        static_cast<uint16_t*>(out), num_threads);
  } else {
    return 1;
  }
  return 0;
}

}  // extern "C"
