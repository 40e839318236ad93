// A decode step of a few rows through every layer of a Llama-family decoder in one call, for a model whose
// linear layers all run on the block kernel (block_gemv.cpp). At batch 1 the eager step spends as long
// in per-op dispatch (~15 ops of a few microseconds in each of 30 layers) as in its arithmetic; here the
// same kernels run back to back: the norms and RoPE of decoder_ops.cpp, the attention of
// paged_decode_attention.cpp, silu_mul.cpp and the block GEMVs (or the batch-invariant GEMM), so the result
// is the one the layer-by-layer path (models/llama.py with these kernels) computes, bit for bit.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtype.h"
#include "kernels.h"

namespace {

// A projection is up to kParts weights side by side along its outputs (q/k/v or gate/up held in different
// block types, e.g. llama.cpp's Q4_K_M: a Q6_K attn_v beside Q4_K attn_q / attn_k), each written into its
// columns of the projection's output.
constexpr int kParts = 3;
// Per layer, in this order: the input and post-attention norms' weights, then per projection (qkv, o,
// gate_up, down) kParts parts of (codes, scales, mins), unused parts zero; last the [num_heads +
// num_kv_heads, head_dim] weight of the q/k norms (Qwen3's, each head normed before RoPE), or zero; then,
// for a mixture-of-experts layer (its gate_up and down parts unused), the router's [num_experts, hidden]
// weight and moe_step.cpp's 3 x 6 part pointers (zeros for a dense layer).
constexpr int kMoePointers = 1 + 3 * 6;
constexpr int kLayerPointers = 2 + 4 * kParts * 3 + 1 + kMoePointers;
// Per layer, projection and part: (kind, offset, rows), rows the part's output features (0: no part; the
// parts' rows add up to the projection's). A kind of kInvariant + k is the batch-invariant GEMM's kind k
// (invariant_gemm.cpp; only the first pointer is used), else the block kernel's. Then moe_step.cpp's 3 x 3
// part ints and (num_experts, top_k, renormalise, float32_weighting, the scaling's float32 bits): num_experts
// 0 for a dense layer.
constexpr int kMoeInts = 3 * 3 + 5;
constexpr int kLayerInts = 4 * kParts * 3 + kMoeInts;
constexpr int kInvariant = 16;

template <typename T>
int run(int dtype, int64_t M, int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
        int64_t inter, int64_t num_layers, float eps, const int64_t* layer_ptrs, const int32_t* layer_ints,
        const int64_t* k_caches, const int64_t* v_caches, int64_t block_size, const int32_t* block_tables,
        int64_t max_blocks, const int32_t* seq_lens, const int64_t* slots, int64_t split_tokens,
        int64_t num_splits, const void* rope_table, int64_t rope_stride, const int64_t* positions,
        const void* final_norm, const T* embeddings, T* out, int amx_attention, const int32_t* run_starts,
        int64_t num_runs, int num_threads) {
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim, qkv_size = q_size + 2 * kv_size;
  thread_local std::vector<T> res, h, qkv, qkn, qk, attn, o, gu, act, x;
  thread_local std::vector<int32_t> own_runs;  // without run_starts: every row its own run (amx_attention)
  if (run_starts == nullptr) {
    own_runs.resize(M + 1);
    for (int64_t m = 0; m <= M; ++m) own_runs[m] = static_cast<int32_t>(m);
    run_starts = own_runs.data();
    num_runs = M;
  }
  res.assign(embeddings, embeddings + M * hidden);
  h.resize(M * hidden);
  qkv.resize(M * qkv_size);
  qk.resize(M * (q_size + kv_size));
  qkn.resize(M * (q_size + kv_size));
  attn.resize(M * q_size);
  o.resize(M * hidden);
  gu.resize(M * 2 * inter);
  act.resize(M * inter);
  x.resize(M * hidden);
  // As the layer-by-layer path computes it: in double, then rounded to float.
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  auto gemv = [&](const int64_t* p, const int32_t* ki, const T* in, int64_t K, int64_t N, T* y) {
    int64_t col = 0;  // the part's first output column
    for (int part = 0; part < kParts && ki[3 * part + 2] > 0; ++part) {
      const int64_t* w = p + 3 * part;
      const int32_t* k = ki + 3 * part;
      const int rc = k[0] >= kInvariant
          ? goodserve_bi_gemm(k[0] - kInvariant, dtype, in, K, M, K, reinterpret_cast<const void*>(w[0]), k[2],
                              nullptr, dtype, y + col, N, num_threads)
          : goodserve_block_gemv(k[0], dtype, in, K, M, K, reinterpret_cast<const uint8_t*>(w[0]),
                                 reinterpret_cast<const uint16_t*>(w[1]), reinterpret_cast<const uint16_t*>(w[2]),
                                 k[1], k[2], dtype, y + col, N, num_threads);
      if (rc != 0) return rc;
      col += k[2];
    }
    return col == N ? 0 : 1;
  };
  int rc = 0;
#define GOODSERVE_TRY(call) \
  if ((rc = (call)) != 0) return rc
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* p = layer_ptrs + l * kLayerPointers;
    const int32_t* ki = layer_ints + l * kLayerInts;
    const void* in_norm = reinterpret_cast<const void*>(p[0]);
    const void* post_norm = reinterpret_cast<const void*>(p[1]);
    // h = norm(x + residual); the first layer's residual is the embeddings themselves.
    GOODSERVE_TRY(l == 0 ? goodserve_rms_norm(dtype, res.data(), hidden, nullptr, 0, nullptr, in_norm, h.data(), M,
                                              hidden, eps, num_threads)
                         : goodserve_rms_norm(dtype, x.data(), hidden, res.data(), hidden, res.data(), in_norm,
                                              h.data(), M, hidden, eps, num_threads));
    GOODSERVE_TRY(gemv(p + 2, ki, h.data(), hidden, qkv_size, qkv.data()));
    const void* qk_norm = reinterpret_cast<const void*>(p[2 + 12 * kParts]);
    if (qk_norm != nullptr)
      GOODSERVE_TRY(goodserve_head_rms_norm(dtype, qkv.data(), qkv_size, qk_norm, qkn.data(), M,
                                            num_heads + num_kv_heads, head_dim, eps, num_threads));
    GOODSERVE_TRY(goodserve_rope(dtype, qk_norm != nullptr ? qkn.data() : qkv.data(),
                                 qk_norm != nullptr ? q_size + kv_size : qkv_size, rope_table, rope_stride, positions,
                                 qk.data(), M, num_heads + num_kv_heads, head_dim, num_threads));
    T* k_cache = reinterpret_cast<T*>(k_caches[l]);
    T* v_cache = reinterpret_cast<T*>(v_caches[l]);
    for (int64_t m = 0; m < M; ++m) {  // the new token's K and V into its slot
      std::memcpy(k_cache + slots[m] * kv_size, qk.data() + m * (q_size + kv_size) + q_size, kv_size * sizeof(T));
      std::memcpy(v_cache + slots[m] * kv_size, qkv.data() + m * qkv_size + q_size + kv_size, kv_size * sizeof(T));
    }
    if (amx_attention) {
      GOODSERVE_TRY(goodserve_paged_attention_rows(qk.data(), k_cache, v_cache, block_tables, seq_lens, run_starts,
                                                   attn.data(), M, num_runs, num_heads, num_kv_heads, head_dim,
                                                   block_size, max_blocks, q_size + kv_size, split_tokens, num_splits,
                                                   scale, num_threads));
    } else {
      GOODSERVE_TRY(goodserve_paged_decode_attention(dtype, qk.data(), k_cache, v_cache, block_tables, seq_lens,
                                                     attn.data(), M, num_heads, num_kv_heads, head_dim, block_size,
                                                     max_blocks, q_size + kv_size, split_tokens, num_splits, scale,
                                                     num_threads));
    }
    GOODSERVE_TRY(gemv(p + 2 + 3 * kParts, ki + 3 * kParts, attn.data(), q_size, hidden, o.data()));
    GOODSERVE_TRY(goodserve_rms_norm(dtype, o.data(), hidden, res.data(), hidden, res.data(), post_norm, h.data(), M,
                                     hidden, eps, num_threads));
    const int64_t* moe = p + 3 + 12 * kParts;
    const int32_t* moe_ints = ki + 12 * kParts;
    if (moe_ints[9] > 0) {
      float scaling;
      std::memcpy(&scaling, moe_ints + 13, sizeof scaling);
      const int64_t moe_inter = (moe_ints[2] + moe_ints[5]) / 2;
      GOODSERVE_TRY(goodserve_moe_block(dtype, h.data(), M, hidden, reinterpret_cast<const void*>(moe[0]), moe_ints[9],
                                        moe_ints[10], moe_ints[11], scaling, moe_ints[12], moe + 1, moe_ints,
                                        moe_inter, x.data(), num_threads));
      continue;
    }
    GOODSERVE_TRY(gemv(p + 2 + 6 * kParts, ki + 6 * kParts, h.data(), hidden, 2 * inter, gu.data()));
    GOODSERVE_TRY(goodserve_silu_mul(dtype, gu.data(), 2 * inter, M, inter, act.data(), num_threads));
    GOODSERVE_TRY(gemv(p + 2 + 9 * kParts, ki + 9 * kParts, act.data(), inter, hidden, x.data()));
  }
#undef GOODSERVE_TRY
  return goodserve_rms_norm(dtype, x.data(), hidden, res.data(), hidden, res.data(), final_norm, out, M, hidden, eps,
                            num_threads);
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16 (activations, norm weights, caches, rope table). M: decode rows (>= 1),
// one token per request. layer_ptrs: [num_layers, 58] addresses (see kLayerPointers; a null mins for
// Q4_0, Q5_0 and Q8_0); layer_ints: [num_layers, 50] (kLayerInts); k_caches, v_caches: [num_layers] addresses of caches
// [num_blocks, block_size, num_kv_heads, head_dim]; block_tables [M, max_blocks] int32, seq_lens [M] int32
// (new token included), slots [M] int64: as paged_decode_attention and the slot mapping; rope_table: cos
// rows then, rope_stride elements later, sin rows; positions [M] int64; embeddings, out: [M, hidden].
// amx_attention: attend on paged_attention_amx.cpp (bfloat16; the batch-invariant mode's kernel), else on
// paged_decode_attention.cpp; run_starts: [num_runs + 1] int32 runs of rows sharing their context's tiles, as
// paged_attention_rows takes them (null: every row its own run). Returns 0, or the first kernel's nonzero code
// (then the step stops there: out is not written, and the caches of the layers before may hold the step's K/V).
int goodserve_decode_layers(int dtype, int64_t M, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t inter, int64_t num_layers, float eps, const int64_t* layer_ptrs,
                            const int32_t* layer_ints, const int64_t* k_caches, const int64_t* v_caches,
                            int64_t block_size, const int32_t* block_tables, int64_t max_blocks,
                            const int32_t* seq_lens, const int64_t* slots, int64_t split_tokens, int64_t num_splits,
                            const void* rope_table, int64_t rope_stride, const int64_t* positions,
                            const void* final_norm, const void* embeddings, void* out, int amx_attention,
                            const int32_t* run_starts, int64_t num_runs, int num_threads) {
  if (dtype == 0)
    return run<float>(dtype, M, hidden, num_heads, num_kv_heads, head_dim, inter, num_layers, eps, layer_ptrs,
                      layer_ints, k_caches, v_caches, block_size, block_tables, max_blocks, seq_lens, slots,
                      split_tokens, num_splits, rope_table, rope_stride, positions, final_norm,
                      static_cast<const float*>(embeddings), static_cast<float*>(out), 0, nullptr, 0, num_threads);
  if (dtype == 1)
    return run<uint16_t>(dtype, M, hidden, num_heads, num_kv_heads, head_dim, inter, num_layers, eps, layer_ptrs,
                         layer_ints, k_caches, v_caches, block_size, block_tables, max_blocks, seq_lens, slots,
                         split_tokens, num_splits, rope_table, rope_stride, positions, final_norm,
                         static_cast<const uint16_t*>(embeddings), static_cast<uint16_t*>(out), amx_attention,
                         run_starts, num_runs, num_threads);
  return 1;
}

}  // extern "C"
