// Batch-invariant paged attention on AMX: every query row attends alone over positions [0, seq_len) of its
// request's context, in splits of split_tokens from position 0 and chunks of 32 positions, so a row's
// arithmetic depends on its own query, context and length only (models/invariant_attention.py).
//
// A work item is a run of consecutive rows of one request (a prefill chunk's tokens share a block table),
// one KV head and one split. Its query rows x the KV head's query heads (at most 16 query vectors) form the
// A tile, so the context's K and V tiles are built once for every row of the run; a lone decode row is a
// run of one. AMX computes each output row from its own A row alone, so a row gets the same bits in a run
// of one or of five.
//
// Per chunk of 32 positions (flash attention's online softmax, Dao et al. 2022, Alg. 1):
//   S = Q K^T (bfloat16 products, float32 sums: TDPBF16PS over head_dim in tiles of 32), scaled in float32;
//   positions past the row's length are masked; m, l and O are rescaled as the maximum grows;
//   P = exp(S - m) rounded to bfloat16, O += P V (TDPBF16PS over the chunk's positions).
// Splits are merged at the end in split order (flash-decoding, Dao et al. 2023), as the vector kernel
// (paged_decode_attention.cpp) merges its splits. bfloat16 activations and caches, head_dim a multiple of 32
// up to 256, 16 query heads per KV head at most.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include <omp.h>

#include "dtype.h"
#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define GOODSERVE_AMX_ATTENTION 1
#include <immintrin.h>
#endif


namespace {

#ifdef GOODSERVE_AMX_ATTENTION

constexpr int kChunk = 32, kMaxD = 256;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

// Tiles 0-3: C (rows = query vectors); 4: A (query vectors); 6, 7: B.
void configure(int rows) {
  TileConfig cfg;
  for (int t : {0, 1, 2, 3, 4}) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;
  for (int t : {6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  asm volatile("" : : "r"(&cfg) : "memory");  // GCC does not see ldtilecfg read its operand
  _tile_loadconfig(&cfg);
}

// 16 x 16 32-bit transpose: out[j] lane i = in[i] lane j.
inline void transpose16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows i, i + 4, i + 8, i + 12
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

struct Args {
  const uint16_t *q, *k, *v;
  const int32_t *tables, *lens, *runs;
  int64_t num_runs, num_heads, num_kv_heads, D, block_size, max_blocks, q_stride, split_tokens, num_splits;
  float scale;
};

// exp(x) for x <= 0 as the vector kernel computes it (paged_decode_attention.cpp).
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

// The B tiles of one chunk of 32 positions of one KV head: K (for S = Q K^T: per 32 of head_dim, per 16
// positions) then V (for P V: per 16 of head_dim, 16 position pairs), 512 bf16 each.
inline int64_t chunk_tiles(int64_t D) { return D / 32 * 2 + D / 16; }

struct Scratch {
  alignas(64) uint16_t qa[16 * kMaxD];  // A: query vectors x head_dim
  alignas(64) uint16_t kv[(kMaxD / 32 * 2 + kMaxD / 16) * 512];  // one chunk's tiles, built on the way
  alignas(64) uint16_t pa[16 * kChunk];             // A of P V
  alignas(64) float s[16 * kChunk];
  alignas(64) float pv[16 * 64];
  alignas(64) float o[16 * kMaxD];
  float m[16], l[16];
};

// The K and V tiles of positions [c0, c0 + 32) (past `end`, zeros) of KV head h.
void build_kv(const Args& a, const int32_t* table, int64_t h, int64_t c0, int64_t end, uint16_t* tiles) {
  const int64_t D = a.D, stride = a.num_kv_heads * D, bs = a.block_size;
  const uint16_t* krow[kChunk];
  const uint16_t* vrow[kChunk];
  for (int t = 0; t < kChunk; ++t) {
    const int64_t p = c0 + t;
    if (p >= end) {
      krow[t] = vrow[t] = nullptr;
      continue;
    }
    const int64_t off = (static_cast<int64_t>(table[p / bs]) * bs + p % bs) * stride + h * D;
    krow[t] = a.k + off;
    vrow[t] = a.v + off;
  }
  for (int64_t j = 0; j < D / 32; ++j)
    for (int half = 0; half < 2; ++half) {  // positions [16 half, 16 half + 16): dword d2 of each K row
      __m512i r[16];
      for (int t = 0; t < 16; ++t) {
        const uint16_t* kr = krow[16 * half + t];
        r[t] = kr == nullptr ? _mm512_setzero_si512() : _mm512_loadu_si512(kr + 32 * j);
      }
      transpose16(r);  // r[p] lane t = K[t][32 j + 2 p .. + 1]
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tiles + (2 * j + half) * 512 + 32 * p, r[p]);
    }
  for (int64_t jd = 0; jd < D / 16; ++jd)
    for (int p = 0; p < 16; ++p) {  // row p: (V[2p][d], V[2p + 1][d]) for 16 d
      const uint16_t *v0 = vrow[2 * p], *v1 = vrow[2 * p + 1];
      const __m512i lo = v0 == nullptr ? _mm512_setzero_si512()
                                       : _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v0 + 16 * jd)));
      const __m512i hi = v1 == nullptr ? _mm512_setzero_si512()
                                       : _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v1 + 16 * jd)));
      _mm512_storeu_si512(tiles + (D / 32 * 2 + jd) * 512 + 32 * p, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}

// One work item: rows [r0, r1) of a run, KV head h, split sp. partial: per query vector (row, g),
// D accumulators, the maximum and the sum. built: the run's context's tiles built before ([chunk][head]
// [chunk_tiles]), or null (built here, chunk by chunk).
void attend_item(const Args& a, int64_t r0, int64_t r1, int64_t h, int64_t sp, float* partial, Scratch& sc,
                 int& configured, const uint16_t* built) {
  const int64_t G = a.num_heads / a.num_kv_heads, D = a.D, per = D + 2;
  const int nq = static_cast<int>((r1 - r0) * G);
  const int64_t t0 = sp * a.split_tokens;
  const int64_t end = std::min<int64_t>(a.lens[r1 - 1], t0 + a.split_tokens);  // the run's longest row
  for (int i = 0; i < nq; ++i) {
    sc.m[i] = -std::numeric_limits<float>::infinity();
    sc.l[i] = 0.f;
    std::memset(sc.o + i * D, 0, D * sizeof(float));
  }
  if (end > t0) {
    if (configured != nq) {
      configure(nq);
      configured = nq;
    }
    for (int i = 0; i < nq; ++i)
      std::memcpy(sc.qa + i * D, a.q + (r0 + i / G) * a.q_stride + (h * G + i % G) * D, D * sizeof(uint16_t));
    const int32_t* table = a.tables + r0 * a.max_blocks;
    const __m512 scale = _mm512_set1_ps(a.scale), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const int64_t per_chunk = chunk_tiles(D) * 512;
    for (int64_t c0 = t0; c0 < end; c0 += kChunk) {
      const uint16_t* tiles = sc.kv;
      if (built != nullptr)
        tiles = built + ((c0 / kChunk) * a.num_kv_heads + h) * per_chunk;
      else
        build_kv(a, table, h, c0, end, sc.kv);
      const uint16_t* vtiles = tiles + D / 32 * 2 * 512;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t j = 0; j < D / 32; ++j) {
        _tile_loadd(4, sc.qa + 32 * j, D * 2);
        _tile_loadd(6, tiles + (2 * j) * 512, 64);
        _tile_loadd(7, tiles + (2 * j + 1) * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
      _tile_stored(0, sc.s, kChunk * 4);
      _tile_stored(1, sc.s + 16, kChunk * 4);
      // Per query vector: this chunk's scores (masked past the row's length) and the new maximum, then
      // the corrections exp(m_old - m_new) of all of them in one vector (exp(-87) for a row's first chunk,
      // whose sum and accumulators are still 0), then P.
      alignas(64) float corr[16], m_new[16];
      bool live[16];
      __m512 sv[16][2];
      __mmask16 km[16][2];
      for (int i = 0; i < 16; ++i) corr[i] = m_new[i] = 0.f;
      for (int i = 0; i < nq; ++i) {
        const int64_t valid = std::min<int64_t>(a.lens[r0 + i / G], end) - c0;  // this row's positions here
        live[i] = valid > 0;
        if (!live[i]) {
          std::memset(sc.pa + i * kChunk, 0, kChunk * sizeof(uint16_t));
          m_new[i] = sc.m[i];
          continue;
        }
        const __mmask16 k0 = valid >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1u);
        const __mmask16 k1 = valid >= 32 ? 0xFFFF : valid <= 16 ? 0 : static_cast<__mmask16>((1u << (valid - 16)) - 1u);
        km[i][0] = k0;
        km[i][1] = k1;
        sv[i][0] = _mm512_mask_mov_ps(ninf, k0, _mm512_mul_ps(_mm512_loadu_ps(sc.s + i * kChunk), scale));
        sv[i][1] = _mm512_mask_mov_ps(ninf, k1, _mm512_mul_ps(_mm512_loadu_ps(sc.s + i * kChunk + 16), scale));
        m_new[i] = std::max(sc.m[i], _mm512_reduce_max_ps(_mm512_max_ps(sv[i][0], sv[i][1])));
      }
      const __mmask16 rows_mask = static_cast<__mmask16>((1u << nq) - 1u);
      const __m512 mo = _mm512_maskz_loadu_ps(rows_mask, sc.m), mn = _mm512_maskz_loadu_ps(rows_mask, m_new);
      _mm512_store_ps(corr, exp16(_mm512_sub_ps(mo, mn)));
      for (int i = 0; i < nq; ++i) {
        if (!live[i]) continue;
        const __m512 mv = _mm512_set1_ps(m_new[i]);
        const __m512 p0 = _mm512_maskz_mov_ps(km[i][0], exp16(_mm512_sub_ps(sv[i][0], mv)));
        const __m512 p1 = _mm512_maskz_mov_ps(km[i][1], exp16(_mm512_sub_ps(sv[i][1], mv)));
        sc.l[i] = sc.l[i] * corr[i] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
        sc.m[i] = m_new[i];
        _mm512_storeu_si512(sc.pa + i * kChunk, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
      }
      for (int64_t jd0 = 0; jd0 < D / 16; jd0 += 4) {  // O += P V, 64 of head_dim at a time
        const int64_t n = std::min<int64_t>(4, D / 16 - jd0);
        _tile_loadd(4, sc.pa, kChunk * 2);
        _tile_zero(0);
        _tile_loadd(6, vtiles + (jd0) * 512, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_stored(0, sc.pv, 64 * 4);
        if (n > 1) {
          _tile_zero(1);
          _tile_loadd(7, vtiles + (jd0 + 1) * 512, 64);
          _tile_dpbf16ps(1, 4, 7);
          _tile_stored(1, sc.pv + 16, 64 * 4);
        }
        if (n > 2) {
          _tile_zero(2);
          _tile_loadd(6, vtiles + (jd0 + 2) * 512, 64);
          _tile_dpbf16ps(2, 4, 6);
          _tile_stored(2, sc.pv + 32, 64 * 4);
        }
        if (n > 3) {
          _tile_zero(3);
          _tile_loadd(7, vtiles + (jd0 + 3) * 512, 64);
          _tile_dpbf16ps(3, 4, 7);
          _tile_stored(3, sc.pv + 48, 64 * 4);
        }
        for (int i = 0; i < nq; ++i) {
          if (!live[i]) continue;
          const __m512 c = _mm512_set1_ps(corr[i]);
          for (int64_t jd = 0; jd < n; ++jd) {
            float* o = sc.o + i * D + 16 * (jd0 + jd);
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), c, _mm512_loadu_ps(sc.pv + i * 64 + 16 * jd)));
          }
        }
      }
    }
  }
  for (int i = 0; i < nq; ++i) {
    const int64_t row = r0 + i / G, head = h * G + i % G;
    float* p = partial + ((row * a.num_heads + head) * a.num_splits + sp) * per;
    std::memcpy(p, sc.o + i * D, D * sizeof(float));
    p[D] = sc.m[i];
    p[D + 1] = sc.l[i];
  }
}

#endif  // GOODSERVE_AMX_ATTENTION

}  // namespace

extern "C" {

// Whether this build and process run the kernel (AMX granted by the OS, see goodserve_bi_gemm_init).
int goodserve_paged_attention_rows_supported() {
#ifdef GOODSERVE_AMX_ATTENTION
  return goodserve_bi_gemm_init(-1) == 2 ? 1 : 0;
#else
  return 0;
#endif
}

// q: [num_rows, num_heads, head_dim] bfloat16 with row stride q_stride; caches: [num_blocks, block_size,
// num_kv_heads, head_dim] bfloat16; block_tables: [num_rows, max_blocks] int32 (a run's rows share their
// first row's table); seq_lens: [num_rows] int32 (>= 1, non-decreasing within a run); runs: [num_runs + 1]
// int32, run r = rows [runs[r], runs[r + 1]), at most 16 / (num_heads / num_kv_heads) rows each; out:
// [num_rows, num_heads, head_dim] bfloat16. Returns 0; 1 for arguments outside the kernel's range; 2 when
// the kernel does not run here.
int goodserve_paged_attention_rows(const void* q, const void* k_cache, const void* v_cache,
                                   const int32_t* block_tables, const int32_t* seq_lens, const int32_t* runs,
                                   void* out, int64_t num_rows, int64_t num_runs, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                   int64_t q_stride, int64_t split_tokens, int64_t num_splits, float scale,
                                   int num_threads) {
#ifdef GOODSERVE_AMX_ATTENTION
  if (goodserve_paged_attention_rows_supported() != 1) return 2;
  const int64_t G = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
  if (G < 1 || G > 16 || num_heads % num_kv_heads || head_dim % 32 || head_dim > kMaxD || split_tokens % kChunk ||
      split_tokens < kChunk || num_splits < 1)
    return 1;
  for (int64_t r = 0; r < num_runs; ++r)
    if (runs[r + 1] <= runs[r] || (runs[r + 1] - runs[r]) * G > 16) return 1;
  Args a{static_cast<const uint16_t*>(q), static_cast<const uint16_t*>(k_cache), static_cast<const uint16_t*>(v_cache),
         block_tables, seq_lens, runs, num_runs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, q_stride,
         split_tokens, num_splits, scale};
  const int64_t per = head_dim + 2;
  std::vector<float> partial(static_cast<size_t>(num_rows * num_heads * num_splits * per));
  // Runs of one prefill chunk (same table, consecutive positions) share their context's tiles: built once
  // here, for every chunk of 32 positions and every KV head, instead of once per run.
  std::vector<int64_t> run_ctx(num_runs), ctx_first, ctx_end, ctx_offset;
  for (int64_t r = 0; r < num_runs; ++r) {
    const int64_t first = runs[r];
    const bool joins = r > 0 && seq_lens[first] == seq_lens[first - 1] + 1 &&
                       std::memcmp(block_tables + first * max_blocks, block_tables + runs[r - 1] * max_blocks,
                                   max_blocks * sizeof(int32_t)) == 0;
    if (!joins) {
      ctx_first.push_back(first);
      ctx_end.push_back(0);
    }
    run_ctx[r] = static_cast<int64_t>(ctx_first.size()) - 1;
    ctx_end.back() = seq_lens[runs[r + 1] - 1];
  }
  const int64_t per_chunk = chunk_tiles(head_dim) * 512, num_ctx = static_cast<int64_t>(ctx_first.size());
  std::vector<int64_t> ctx_runs(num_ctx, 0);
  for (int64_t r = 0; r < num_runs; ++r) ++ctx_runs[run_ctx[r]];
  int64_t total = 0;
  std::vector<std::pair<int64_t, int64_t>> build;  // (context, chunk) to build
  ctx_offset.assign(num_ctx, -1);
  for (int64_t c = 0; c < num_ctx; ++c) {
    if (ctx_runs[c] < 2) continue;
    ctx_offset[c] = total;
    const int64_t chunks = (ctx_end[c] + kChunk - 1) / kChunk;
    for (int64_t k = 0; k < chunks; ++k) build.emplace_back(c, k);
    total += chunks * num_kv_heads * per_chunk;
  }
  std::vector<uint16_t> built(static_cast<size_t>(total));
  const int64_t builds = static_cast<int64_t>(build.size()) * num_kv_heads;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t b = 0; b < builds; ++b) {
    const auto [c, k] = build[b / num_kv_heads];
    const int64_t h = b % num_kv_heads;
    build_kv(a, block_tables + ctx_first[c] * max_blocks, h, k * kChunk, ctx_end[c],
             built.data() + ctx_offset[c] + (k * num_kv_heads + h) * per_chunk);
  }
  const int64_t items = num_runs * num_kv_heads * num_splits;
  std::atomic<int64_t> next(0);
#pragma omp parallel num_threads(num_threads)
  {
    thread_local Scratch sc;
    int configured = -1;
    for (int64_t item = next.fetch_add(1); item < items; item = next.fetch_add(1)) {
      const int64_t sp = item % num_splits, rh = item / num_splits, h = rh % num_kv_heads, r = rh / num_kv_heads;
      const int64_t c = run_ctx[r];
      attend_item(a, runs[r], runs[r + 1], h, sp, partial.data(), sc, configured,
                  ctx_offset[c] < 0 ? nullptr : built.data() + ctx_offset[c]);
    }
    if (configured >= 0) _tile_release();
  }
  // Merge each (row, head)'s splits in order and normalise, as paged_decode_attention.cpp does.
  uint16_t* dst = static_cast<uint16_t*>(out);
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t rh = 0; rh < num_rows * num_heads; ++rh) {
    const float* base = partial.data() + rh * num_splits * per;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t sp = 0; sp < num_splits; ++sp) m = std::max(m, base[sp * per + head_dim]);
    float total = 0.f, o[kMaxD];
    for (int64_t d = 0; d < head_dim; ++d) o[d] = 0.f;
    for (int64_t sp = 0; sp < num_splits; ++sp) {
      const float* p = base + sp * per;
      if (p[head_dim + 1] == 0.f) continue;  // an empty split (past the row's length)
      const float w = std::exp(p[head_dim] - m);
      total += p[head_dim + 1] * w;
      for (int64_t d = 0; d < head_dim; ++d) o[d] += p[d] * w;
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t d = 0; d < head_dim; ++d) goodserve::store(dst + rh * head_dim + d, o[d] * inv);
  }
  return 0;
#else
  (void)q; (void)k_cache; (void)v_cache; (void)block_tables; (void)seq_lens; (void)runs; (void)out; (void)num_rows;
  (void)num_runs; (void)num_heads; (void)num_kv_heads; (void)head_dim; (void)block_size; (void)max_blocks;
  (void)q_stride; (void)split_tokens; (void)num_splits; (void)scale; (void)num_threads;
  return 2;
#endif
}

}  // extern "C"
