// The native kernels as torch ops (namespace goodserve): each op's schema is written here, once, and its CPU
// implementation hands the tensors' data to the kernel's C entry point (kernels.h). The Python wrappers in
// goodserve/models/native.py check shapes and layouts and give the errors users see; the checks here guard
// the memory the kernels touch. Fake (meta) implementations are registered in Python.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "kernels.h"

namespace {

int code(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "goodserve's native kernels run on the CPU, got a tensor on ", t.device());
  if (t.scalar_type() == at::kFloat) return 0;
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, "goodserve's native kernels take float32 or bfloat16, got ",
              t.scalar_type());
  return 1;
}

void check(int rc, const char* name) { TORCH_CHECK(rc == 0, "the native ", name, " kernel refused the call (code ", rc, ")"); }

int threads() { return at::get_num_threads(); }

template <typename T>
T* ptr(const at::Tensor& t) { return static_cast<T*>(t.data_ptr()); }

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t split_tokens,
                                  int64_t num_splits, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              block_tables.is_contiguous() && seq_lens.is_contiguous());
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
  if (k_cache.scalar_type() == at::kChar) {  // int8 rows with a float32 scale each: [..., head_dim + 4]
    TORCH_CHECK(v_cache.scalar_type() == at::kChar && k_cache.size(3) == q.size(2) + 4 &&
                v_cache.sizes() == k_cache.sizes(), "an int8 KV cache is [num_blocks, block_size, num_kv_heads, "
                "head_dim + 4], K and V alike");
    check(goodserve_paged_decode_attention_q8(code(q), q.data_ptr(), ptr<int8_t>(k_cache), ptr<int8_t>(v_cache),
                                              ptr<int32_t>(block_tables), ptr<int32_t>(seq_lens), out.data_ptr(),
                                              q.size(0), q.size(1), k_cache.size(2), q.size(2), k_cache.size(1),
                                              block_tables.size(1), q.stride(0), split_tokens, num_splits,
                                              static_cast<float>(scale), threads()),
          "paged attention (int8 cache)");
    return out;
  }
  if (q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16) {  // a bfloat16 cache, float32 q
    TORCH_CHECK(v_cache.scalar_type() == at::kBFloat16 && k_cache.size(3) == q.size(2) &&
                v_cache.sizes() == k_cache.sizes(), "a bfloat16 KV cache under a float32 query: K and V alike");
    check(goodserve_paged_decode_attention_bf16_cache(ptr<float>(q), ptr<uint16_t>(k_cache), ptr<uint16_t>(v_cache),
                                                      ptr<int32_t>(block_tables), ptr<int32_t>(seq_lens),
                                                      ptr<float>(out), q.size(0), q.size(1), k_cache.size(2),
                                                      q.size(2), k_cache.size(1), block_tables.size(1), q.stride(0),
                                                      split_tokens, num_splits, static_cast<float>(scale), threads()),
          "paged attention (bfloat16 cache)");
    return out;
  }
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "the KV caches must be int8, share q's dtype, or be bfloat16 under a float32 q");
  check(goodserve_paged_decode_attention(code(q), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                         ptr<int32_t>(block_tables), ptr<int32_t>(seq_lens), out.data_ptr(),
                                         q.size(0), q.size(1), k_cache.size(2), q.size(2), k_cache.size(1),
                                         block_tables.size(1), q.stride(0), split_tokens, num_splits,
                                         static_cast<float>(scale), threads()),
        "paged attention");
  return out;
}

at::Tensor paged_attention_rows(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& runs,
                                int64_t split_tokens, int64_t num_splits, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() && block_tables.is_contiguous() &&
              seq_lens.is_contiguous() && runs.is_contiguous() && code(q) == 1);
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
              "the AMX attention kernel reads bfloat16 caches (an int8 KV cache is not implemented there)");
  auto out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  check(goodserve_paged_attention_rows(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), ptr<int32_t>(block_tables),
                                       ptr<int32_t>(seq_lens), ptr<int32_t>(runs), out.data_ptr(), q.size(0),
                                       runs.size(0) - 1, q.size(1), k_cache.size(2), q.size(2), k_cache.size(1),
                                       block_tables.size(1), q.stride(0), split_tokens, num_splits,
                                       static_cast<float>(scale), threads()),
        "AMX attention");
  return out;
}

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps,
                                            const std::optional<at::Tensor>& residual) {
  // Without a residual the sum is x itself: h is returned empty (the caller uses x; an op's output must
  // not alias its input).
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  at::Tensor h = at::empty({residual.has_value() ? x.size(0) : 0, x.size(1)}, x.options());
  check(goodserve_rms_norm(code(x), x.data_ptr(), x.stride(0), residual ? residual->data_ptr() : nullptr,
                           residual ? residual->stride(0) : 0, residual ? h.data_ptr() : nullptr, weight.data_ptr(),
                           out.data_ptr(), x.size(0), x.size(1), static_cast<float>(eps), threads()),
        "rms_norm");
  return {out, h};
}

at::Tensor head_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && weight.is_contiguous() &&
              weight.dim() == 2 && weight.size(0) == x.size(1) && weight.size(1) == x.size(2) &&
              weight.scalar_type() == x.scalar_type(), "head_rms_norm: x [rows, heads, head_dim] (heads contiguous), "
              "weight [heads, head_dim] contiguous in x's dtype");
  auto out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  check(goodserve_head_rms_norm(code(x), x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), x.size(0),
                                x.size(1), x.size(2), static_cast<float>(eps), threads()),
        "head_rms_norm");
  return out;
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& table, const at::Tensor& positions) {
  auto out = at::empty({x.size(0), x.size(1), x.size(2)}, x.options());
  check(goodserve_rope(code(x), x.data_ptr(), x.stride(0), table.data_ptr(), table.stride(0), ptr<int64_t>(positions),
                       out.data_ptr(), x.size(0), x.size(1), x.size(2), threads()),
        "rope");
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  const int64_t inter = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), inter}, gate_up.options());
  check(goodserve_silu_mul(code(gate_up), gate_up.data_ptr(), gate_up.stride(0), gate_up.size(0), inter,
                           out.data_ptr(), threads()),
        "silu_mul");
  return out;
}

at::Tensor argmax(const at::Tensor& x) {
  auto out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  check(goodserve_argmax(code(x), x.data_ptr(), x.stride(0), x.size(0), x.size(1), ptr<int64_t>(out), threads()),
        "argmax");
  return out;
}

bool block_gemv_supported() { return goodserve_block_gemv_supported() == 1; }

at::Tensor block_gemv(const at::Tensor& x, int64_t kind, const at::Tensor& codes, const at::Tensor& scales,
                      const std::optional<at::Tensor>& mins, int64_t offset, at::ScalarType out_dtype) {
  const int64_t n = scales.size(0);
  auto out = at::empty({x.size(0), n}, x.options().dtype(out_dtype));
  if (x.size(0) == 0) return out;
  check(goodserve_block_gemv(static_cast<int>(kind), code(x), x.data_ptr(), x.stride(0), x.size(0), x.size(1),
                             ptr<uint8_t>(codes), static_cast<const uint16_t*>(scales.data_ptr()),
                             mins ? static_cast<const uint16_t*>(mins->data_ptr()) : nullptr, static_cast<int>(offset), n,
                             code(out), out.data_ptr(), n, threads()),
        "block_gemv");
  return out;
}

at::Tensor block_gemv_grouped(const at::Tensor& x, int64_t kind, const at::Tensor& codes, const at::Tensor& scales,
                              const std::optional<at::Tensor>& mins, int64_t offset, const at::Tensor& groups,
                              at::ScalarType out_dtype) {
  TORCH_CHECK(codes.dim() == 3 && scales.dim() == 3 && codes.is_contiguous() && scales.is_contiguous() &&
              (!mins || (mins->dim() == 3 && mins->is_contiguous() && mins->size(0) == codes.size(0))) &&
              scales.size(0) == codes.size(0) && groups.scalar_type() == at::kLong && groups.is_contiguous() &&
              groups.dim() == 2 && groups.size(1) == 3, "block_gemv_grouped: stacked [E, N, ...] operands and "
              "[groups, 3] int64 (expert, first row, rows)");
  const int64_t n = scales.size(1), experts = codes.size(0);
  const int64_t* g = ptr<int64_t>(groups);
  int64_t covered = 0;
  for (int64_t i = 0; i < groups.size(0); ++i) {
    TORCH_CHECK(g[3 * i] >= 0 && g[3 * i] < experts, "block_gemv_grouped: expert ", g[3 * i], " of ", experts);
    covered += g[3 * i + 2];
  }
  auto out = at::empty({x.size(0), n}, x.options().dtype(out_dtype));
  if (covered < x.size(0)) out.zero_();
  if (groups.size(0) == 0) return out;
  check(goodserve_block_gemv_grouped(static_cast<int>(kind), code(x), x.data_ptr(), x.stride(0), x.size(0), x.size(1),
                                     ptr<uint8_t>(codes), codes.stride(0) * codes.element_size(),
                                     static_cast<const uint8_t*>(scales.data_ptr()), scales.stride(0) * 2,
                                     mins ? static_cast<const uint8_t*>(mins->data_ptr()) : nullptr,
                                     mins ? mins->stride(0) * mins->element_size() : 0, static_cast<int>(offset), n, g,
                                     groups.size(0), code(out), out.data_ptr(), n, threads()),
        "block_gemv_grouped");
  return out;
}

at::Tensor moe_block(const at::Tensor& x, const at::Tensor& router, int64_t top_k, bool renormalise, double scaling,
                     bool float32_weighting, const at::Tensor& part_ptrs, const at::Tensor& part_ints, int64_t inter) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && router.is_contiguous() && router.dim() == 2 &&
              router.size(1) == x.size(1) && router.scalar_type() == x.scalar_type() &&
              part_ptrs.scalar_type() == at::kLong && part_ptrs.numel() == 18 && part_ptrs.is_contiguous() &&
              part_ints.scalar_type() == at::kInt && part_ints.numel() == 9 && part_ints.is_contiguous(),
              "moe_block: x [rows, hidden] contiguous, router [experts, hidden] in x's dtype, 18 int64 part "
              "pointers and 9 int32 part ints");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.size(0) == 0) return out;
  check(goodserve_moe_block(code(x), x.data_ptr(), x.size(0), x.size(1), router.data_ptr(), router.size(0), top_k,
                            renormalise ? 1 : 0, static_cast<float>(scaling), float32_weighting ? 1 : 0,
                            ptr<int64_t>(part_ptrs), ptr<int32_t>(part_ints), inter, out.data_ptr(), threads()),
        "moe_block");
  return out;
}

int64_t bi_gemm_mode(int64_t force) { return goodserve_bi_gemm_init(static_cast<int>(force)); }

bool paged_attention_rows_supported() { return goodserve_paged_attention_rows_supported() == 1; }

at::Tensor bi_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.is_contiguous() && x.stride(1) == 1 && (!bias || bias->scalar_type() == at::kFloat));
  auto out = at::empty({x.size(0), n}, x.options());
  if (x.size(0) == 0) return out;
  const int kind = code(packed) == 1 ? 0 : 1;  // the kernel's kinds: 0 = bfloat16 weight, 1 = float32
  check(goodserve_bi_gemm(kind, code(x), x.data_ptr(), x.stride(0), x.size(0), x.size(1), packed.data_ptr(),
                          n, bias ? ptr<float>(*bias) : nullptr, code(out), out.data_ptr(), out.stride(0), threads()),
        "batch-invariant GEMM");
  return out;
}

at::Tensor bi_pack(const std::optional<at::Tensor>& w, const std::optional<at::Tensor>& q,
                   const std::optional<at::Tensor>& scales, const std::optional<at::Tensor>& mins, double offset,
                   int64_t n, int64_t k) {
  for (const auto* t : {&w, &q, &scales, &mins}) TORCH_CHECK(!t->has_value() || (*t)->is_contiguous());
  TORCH_CHECK(w.has_value() != q.has_value() && (!q || scales.has_value()));
  TORCH_CHECK(!w || (w->scalar_type() == at::kBFloat16 && w->numel() == n * k));
  TORCH_CHECK(!q || (q->element_size() == 1 && q->numel() == n * k && scales->scalar_type() == at::kFloat));
  auto out = at::empty({n / 16, k / 32, 16, 16, 2}, at::TensorOptions().dtype(at::kBFloat16));
  check(goodserve_bi_pack(w ? static_cast<const uint16_t*>(w->data_ptr()) : nullptr,
                          q ? static_cast<const uint8_t*>(q->data_ptr()) : nullptr,
                          q && q->scalar_type() == at::kChar ? 1 : 0, scales ? ptr<float>(*scales) : nullptr,
                          mins ? ptr<float>(*mins) : nullptr, static_cast<float>(offset), n, k,
                          static_cast<uint16_t*>(out.data_ptr()), threads()),
        "batch-invariant pack");
  return out;
}

at::Tensor decode_layers(const at::Tensor& layer_ptrs, const at::Tensor& layer_ints, const at::Tensor& k_caches,
                         const at::Tensor& v_caches, const at::Tensor& embeddings, const at::Tensor& positions,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& rope_table, const at::Tensor& final_norm, at::IntArrayRef shape, double eps,
                         int64_t block_size, int64_t split_tokens, int64_t num_splits, bool amx_attention,
                         const std::optional<at::Tensor>& runs) {
  TORCH_CHECK(shape.size() == 5, "shape is (hidden, num_heads, num_kv_heads, head_dim, intermediate)");
  auto out = at::empty({embeddings.size(0), shape[0]}, embeddings.options());
  check(goodserve_decode_layers(code(embeddings), embeddings.size(0), shape[0], shape[1], shape[2], shape[3], shape[4],
                                layer_ptrs.size(0), static_cast<float>(eps), ptr<int64_t>(layer_ptrs),
                                ptr<int32_t>(layer_ints), ptr<int64_t>(k_caches), ptr<int64_t>(v_caches), block_size,
                                ptr<int32_t>(block_tables), block_tables.size(1), ptr<int32_t>(seq_lens),
                                ptr<int64_t>(slot_mapping), split_tokens, num_splits, rope_table.data_ptr(),
                                rope_table.stride(0), ptr<int64_t>(positions), final_norm.data_ptr(),
                                embeddings.data_ptr(), out.data_ptr(), amx_attention ? 1 : 0,
                                runs ? ptr<int32_t>(*runs) : nullptr, runs ? runs->size(0) - 1 : 0, threads()),
        "decode_layers");
  return out;
}

}  // namespace

TORCH_LIBRARY(goodserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "int split_tokens, int num_splits, float scale) -> Tensor");
  m.def("paged_attention_rows(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor runs, int split_tokens, int num_splits, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  m.def("head_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope(Tensor x, Tensor table, Tensor positions) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("block_gemv(Tensor x, int kind, Tensor codes, Tensor scales, Tensor? mins, int offset, ScalarType out_dtype) "
        "-> Tensor");
  m.def("block_gemv_grouped(Tensor x, int kind, Tensor codes, Tensor scales, Tensor? mins, int offset, Tensor groups, "
        "ScalarType out_dtype) -> Tensor");
  m.def("moe_block(Tensor x, Tensor router, int top_k, bool renormalise, float scaling, bool float32_weighting, "
        "Tensor part_ptrs, Tensor part_ints, int inter) -> Tensor");
  m.def("bi_gemm(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("bi_pack(Tensor? w, Tensor? q, Tensor? scales, Tensor? mins, float offset, int n, int k) -> Tensor");
  m.def("decode_layers(Tensor layer_ptrs, Tensor layer_ints, Tensor k_caches, Tensor v_caches, Tensor embeddings, "
        "Tensor positions, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor rope_table, "
        "Tensor final_norm, int[] shape, float eps, int block_size, int split_tokens, int num_splits, "
        "bool amx_attention, Tensor? runs) -> Tensor");
  // Capabilities of this build on this machine (CPU features, and whether the OS grants AMX's tile state).
  m.def("block_gemv_supported() -> bool", &block_gemv_supported);
  m.def("bi_gemm_mode(int force) -> int", &bi_gemm_mode);
  m.def("paged_attention_rows_supported() -> bool", &paged_attention_rows_supported);
}

TORCH_LIBRARY_IMPL(goodserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_attention_rows", &paged_attention_rows);
  m.impl("rms_norm", &rms_norm);
  m.impl("head_rms_norm", &head_rms_norm);
  m.impl("rope", &rope);
  m.impl("silu_mul", &silu_mul);
  m.impl("argmax", &argmax);
  m.impl("block_gemv", &block_gemv);
  m.impl("block_gemv_grouped", &block_gemv_grouped);
  m.impl("moe_block", &moe_block);
  m.impl("bi_gemm", &bi_gemm);
  m.impl("decode_layers", &decode_layers);
  m.impl("bi_pack", &bi_pack);
}
