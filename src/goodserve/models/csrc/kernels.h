// The native kernels' C entry points, declared once: each .cpp here defines its own, decode_step.cpp calls
// them one after the other, and torch_bindings.cpp exposes them as torch ops (the ops' schemas are there).
// dtype codes: 0 = float32, 1 = bfloat16. Every function returns 0 on success, else a code its definition
// states; num_threads is the OpenMP team size (torch's thread count).
#pragma once

#include <cstdint>

extern "C" {

int goodserve_paged_decode_attention(int dtype, const void* q, const void* k_cache, const void* v_cache,
                                     const int32_t* block_tables, const int32_t* seq_lens, void* out,
                                     int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                     int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                     int64_t q_stride, int64_t split_tokens, int64_t num_splits, float scale,
                                     int num_threads);
int goodserve_paged_decode_attention_q8(int dtype, const void* q, const int8_t* k_cache, const int8_t* v_cache,
                                        const int32_t* block_tables, const int32_t* seq_lens, void* out,
                                        int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                        int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                        int64_t q_stride, int64_t split_tokens, int64_t num_splits, float scale,
                                        int num_threads);
int goodserve_paged_decode_attention_bf16_cache(const float* q, const uint16_t* k_cache, const uint16_t* v_cache,
                                                const int32_t* block_tables, const int32_t* seq_lens, float* out,
                                                int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                                                int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                                int64_t q_stride, int64_t split_tokens, int64_t num_splits,
                                                float scale, int num_threads);
int goodserve_paged_attention_rows_supported();
int goodserve_paged_attention_rows(const void* q, const void* k_cache, const void* v_cache,
                                   const int32_t* block_tables, const int32_t* seq_lens, const int32_t* runs,
                                   void* out, int64_t num_rows, int64_t num_runs, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                   int64_t q_stride, int64_t split_tokens, int64_t num_splits, float scale,
                                   int num_threads);
int goodserve_rms_norm(int dtype, const void* x, int64_t x_stride, const void* residual, int64_t residual_stride,
                       void* sum_out, const void* weight, void* out, int64_t rows, int64_t cols, float eps,
                       int num_threads);
int goodserve_head_rms_norm(int dtype, const void* x, int64_t x_stride, const void* weight, void* out, int64_t rows,
                            int64_t heads, int64_t head_dim, float eps, int num_threads);
int goodserve_rope(int dtype, const void* x, int64_t x_stride, const void* table, int64_t table_stride,
                   const int64_t* positions, void* out, int64_t rows, int64_t heads, int64_t head_dim,
                   int num_threads);
int goodserve_silu_mul(int dtype, const void* gate_up, int64_t stride, int64_t rows, int64_t inter, void* out,
                       int num_threads);
int goodserve_argmax(int dtype, const void* x, int64_t stride, int64_t rows, int64_t cols, int64_t* out,
                     int num_threads);
int goodserve_block_gemv_supported();
int goodserve_block_gemv(int kind, int x_dtype, const void* x, int64_t x_stride, int64_t M, int64_t K,
                         const uint8_t* codes, const uint16_t* d, const uint16_t* mins, int offset, int64_t N,
                         int y_dtype, void* y, int64_t y_stride, int num_threads);
int goodserve_block_gemv_grouped(int kind, int x_dtype, const void* x, int64_t x_stride, int64_t M, int64_t K,
                                 const uint8_t* codes, int64_t codes_stride, const uint8_t* d, int64_t d_stride,
                                 const uint8_t* mins, int64_t mins_stride, int offset, int64_t N,
                                 const int64_t* groups, int64_t num_groups, int y_dtype, void* y, int64_t y_stride,
                                 int num_threads);
int goodserve_moe_block(int dtype, const void* x, int64_t M, int64_t hidden, const void* router, int64_t num_experts,
                        int64_t top_k, int renormalise, float scaling, int float32_weighting, const int64_t* part_ptrs,
                        const int32_t* part_ints, int64_t inter, void* out, int num_threads);
int goodserve_bi_gemm_init(int force);
int goodserve_bi_gemm(int kind, int x_dtype, const void* x, int64_t x_stride, int64_t M, int64_t K,
                      const void* packed, int64_t N, const float* bias, int y_dtype, void* y, int64_t y_stride,
                      int num_threads);
int goodserve_bi_pack(const uint16_t* w, const uint8_t* q, int q_signed, const float* scales, const float* mins,
                      float offset, int64_t N, int64_t K, uint16_t* out, int num_threads);
int goodserve_decode_layers(int dtype, int64_t M, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t inter, int64_t num_layers, float eps, const int64_t* layer_ptrs,
                            const int32_t* layer_ints, const int64_t* k_caches, const int64_t* v_caches,
                            int64_t block_size, const int32_t* block_tables, int64_t max_blocks,
                            const int32_t* seq_lens, const int64_t* slots, int64_t split_tokens, int64_t num_splits,
                            const void* rope_table, int64_t rope_stride, const int64_t* positions,
                            const void* final_norm, const void* embeddings, void* out, int amx_attention,
                            const int32_t* run_starts, int64_t num_runs, int num_threads);

}  // extern "C"
