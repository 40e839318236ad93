// A mixture of experts' MLP over a few rows (a decode step) with the experts on GGUF blocks, in one call: the
// router, top-k routing, every active expert's SwiGLU on block_gemv_grouped (block_gemv.cpp) and the
// weighted sum of each row's k outputs. One function serves the layer-by-layer path (models/moe.py, steps of
// up to 8 rows) and the one-call decode step (decode_step.cpp), so a token's MLP output is the same bits on
// both.
//
// Routing as models/moe.py's route() states it (Shazeer et al. 2017 §2.1; Qwen3-MoE, Mixtral): logits =
// x R^T rounded to the activation dtype (float32 dot products, summed in 16 lanes then in lane order);
// a float32 softmax over all experts; the top k, most probable first (ties: the lower expert); renormalised
// over the k when asked; times the scaling. Each row's k outputs are scaled in the weighting dtype (the
// activation dtype, or float32 for Mixtral's float32 weighting), each product rounded to it, summed in slot
// order in float32 and rounded to the activation dtype.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dtype.h"
#include "kernels.h"

namespace {

using goodserve::load;
using goodserve::round_to;
using goodserve::store;

// One expert weight (a part of gate/up, or down) as the grouped block kernel takes it.
struct Part {
  const uint8_t* codes;
  const uint8_t* scales;
  const uint8_t* mins;
  int64_t codes_stride, scales_stride, mins_stride;  // bytes from one expert's operands to the next's
  int kind, offset;
  int64_t rows;  // output features (0: no part)
};

template <typename T>
int run(int dtype, const T* x, int64_t M, int64_t hidden, const T* router, int64_t num_experts, int64_t top_k,
        bool renormalise, float scaling, bool float32_weighting, const Part* parts, int64_t inter, T* out,
        int num_threads) {
  const int64_t A = M * top_k;  // assignments (row, slot)
  thread_local std::vector<float> probs, weights;
  thread_local std::vector<int64_t> experts, order, place, groups, counts;
  thread_local std::vector<char> taken;
  thread_local std::vector<T> xs, gu, act, ys;
  probs.resize(num_experts);
  taken.resize(num_experts);
  weights.resize(A);
  experts.resize(A);
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x + m * hidden;
    float top = -INFINITY;
    for (int64_t e = 0; e < num_experts; ++e) {
      const T* w = router + e * hidden;
      float lanes[16] = {0.f};
      for (int64_t k = 0; k < hidden; k += 16)
        for (int l = 0; l < 16; ++l) lanes[l] += load(xr + k + l) * load(w + k + l);
      float logit = 0.f;
      for (int l = 0; l < 16; ++l) logit += lanes[l];
      probs[e] = round_to(logit, xr);
      top = probs[e] > top ? probs[e] : top;
    }
    float sum = 0.f;
    for (int64_t e = 0; e < num_experts; ++e) sum += (probs[e] = std::exp(probs[e] - top));
    for (int64_t e = 0; e < num_experts; ++e) probs[e] /= sum;
    float chosen = 0.f;
    std::fill(taken.begin(), taken.end(), 0);
    for (int64_t j = 0; j < top_k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < num_experts; ++e)
        if (!taken[e] && (best < 0 || probs[e] > probs[best])) best = e;
      taken[best] = 1;
      experts[m * top_k + j] = best;
      weights[m * top_k + j] = probs[best];
      chosen += probs[best];
    }
    for (int64_t j = 0; j < top_k; ++j) {
      float w = weights[m * top_k + j];
      if (renormalise) w /= chosen;
      w *= scaling;
      weights[m * top_k + j] = float32_weighting ? w : round_to(w, xr);
    }
  }
  // Assignments sorted by expert (stable: row order within an expert), each expert's run one group.
  counts.assign(num_experts + 1, 0);
  for (int64_t a = 0; a < A; ++a) ++counts[experts[a] + 1];
  for (int64_t e = 0; e < num_experts; ++e) counts[e + 1] += counts[e];
  order.resize(A);
  groups.clear();
  for (int64_t e = 0; e < num_experts; ++e)
    if (counts[e + 1] > counts[e]) groups.insert(groups.end(), {e, counts[e], counts[e + 1] - counts[e]});
  for (int64_t a = 0; a < A; ++a) order[counts[experts[a]]++] = a;  // counts[e] ends at expert e's end
  xs.resize(A * hidden);
  for (int64_t i = 0; i < A; ++i)
    for (int64_t c = 0; c < hidden; ++c) xs[i * hidden + c] = x[(order[i] / top_k) * hidden + c];
  const int64_t num_groups = static_cast<int64_t>(groups.size()) / 3;
  gu.resize(A * 2 * inter);
  act.resize(A * inter);
  ys.resize(A * hidden);
  int64_t col = 0;
  for (int p = 0; p < 2 && parts[p].rows > 0; ++p) {  // gate/up: one or two parts side by side
    const Part& w = parts[p];
    const int rc = goodserve_block_gemv_grouped(w.kind, dtype, xs.data(), hidden, A, hidden, w.codes, w.codes_stride,
                                                w.scales, w.scales_stride, w.mins, w.mins_stride, w.offset, w.rows,
                                                groups.data(), num_groups, dtype, gu.data() + col, 2 * inter,
                                                num_threads);
    if (rc != 0) return rc;
    col += w.rows;
  }
  if (col != 2 * inter) return 1;
  int rc = goodserve_silu_mul(dtype, gu.data(), 2 * inter, A, inter, act.data(), num_threads);
  if (rc != 0) return rc;
  const Part& d = parts[2];
  rc = goodserve_block_gemv_grouped(d.kind, dtype, act.data(), inter, A, inter, d.codes, d.codes_stride, d.scales,
                                    d.scales_stride, d.mins, d.mins_stride, d.offset, hidden, groups.data(),
                                    num_groups, dtype, ys.data(), hidden, num_threads);
  if (rc != 0) return rc;
  place.resize(A);  // assignment -> its row in the sorted order
  for (int64_t i = 0; i < A; ++i) place[order[i]] = i;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < hidden; ++c) {
      float acc = 0.f;
      for (int64_t j = 0; j < top_k; ++j) {
        const float y = load(&ys[place[m * top_k + j] * hidden + c]);
        const float w = weights[m * top_k + j];
        acc += float32_weighting ? y * w : round_to(y * w, x);
      }
      store(out + m * hidden + c, acc);
    }
  return 0;
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16 (x, router, out). x: [M, hidden] contiguous; router: [num_experts, hidden]
// in dtype; parts: 3 x 6 int64 (codes, scales, mins addresses; their byte strides per expert) for gate/up
// part 0, gate/up part 1 (zeros when gate and up are one part) and down, and 3 x 3 int32 (kind, offset, rows)
// for the same parts (block_gemv's kinds; rows 0: no part; the gate/up parts' rows add up to 2 inter, gate
// rows first). out: [M, hidden]. hidden % 16 == 0. Returns 0, 1 for arguments outside the kernels' range, or
// the block kernel's code.
int goodserve_moe_block(int dtype, const void* x, int64_t M, int64_t hidden, const void* router, int64_t num_experts,
                        int64_t top_k, int renormalise, float scaling, int float32_weighting, const int64_t* part_ptrs,
                        const int32_t* part_ints, int64_t inter, void* out, int num_threads) {
  if (M < 1 || hidden % 16 || top_k < 1 || top_k > num_experts || part_ints[2 * 3 + 2] != hidden) return 1;
  Part parts[3];
  for (int p = 0; p < 3; ++p) {
    const int64_t* q = part_ptrs + 6 * p;
    parts[p] = Part{reinterpret_cast<const uint8_t*>(q[0]), reinterpret_cast<const uint8_t*>(q[1]),
                    reinterpret_cast<const uint8_t*>(q[2]), q[3], q[4], q[5], part_ints[3 * p], part_ints[3 * p + 1],
                    part_ints[3 * p + 2]};
  }
  if (dtype == 0)
    return run(dtype, static_cast<const float*>(x), M, hidden, static_cast<const float*>(router), num_experts, top_k,
               renormalise != 0, scaling, float32_weighting != 0, parts, inter, static_cast<float*>(out), num_threads);
  if (dtype == 1)
    return run(dtype, static_cast<const uint16_t*>(x), M, hidden, static_cast<const uint16_t*>(router), num_experts,
               top_k, renormalise != 0, scaling, float32_weighting != 0, parts, inter, static_cast<uint16_t*>(out),
               num_threads);
  return 1;
}

}  // extern "C"
