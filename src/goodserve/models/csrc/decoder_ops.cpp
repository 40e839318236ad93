// Small fused ops of a decoder layer on the CPU: RMSNorm (with the residual add before it) and rotary
// embeddings. At decode sizes each is a handful of eager PyTorch ops of a few microseconds of dispatch each,
// more than their arithmetic; here each is one call.
//
// Rounding follows the PyTorch ops they replace, step by step: values are widened to float32, every
// intermediate that PyTorch stores in the activation dtype is rounded to it (round to nearest even), so
// bfloat16 results match the eager ops' except where a float32 sum of squares differs in its last bit by
// summation order (then an output may differ by one bfloat16 step).

#include <cmath>
#include <cstdint>
#include <cstring>

#include <omp.h>

#include "dtype.h"
#include "kernels.h"

namespace {

using goodserve::load;
using goodserve::round_to;
using goodserve::store;

constexpr int64_t kParallelElements = 1 << 16;  // below this, one thread (a parallel region costs more)

// One row: o = weight * round(x * rsqrt(mean(x^2) + eps)); with a residual row rr, x is first h = x + rr
// (rounded as torch's add), which is also written to so (the new residual).
template <typename T>
inline void norm_row(const T* xr, const T* rr, T* so, const T* weight, T* o, int64_t cols, float eps) {
  float ss = 0.f;
  if (rr != nullptr) {
    for (int64_t c = 0; c < cols; ++c) {
      const float h = round_to(load(xr + c) + load(rr + c), xr);
      store(so + c, h);
      ss += h * h;
    }
    xr = so;
  } else {
    for (int64_t c = 0; c < cols; ++c) {
      const float h = load(xr + c);
      ss += h * h;
    }
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(cols) + eps);
  for (int64_t c = 0; c < cols; ++c) {
    // x * rsqrt(mean(x^2) + eps) in float32, cast to the dtype, then times the weight in the dtype.
    const float normed = round_to(load(xr + c) * inv, xr);
    store(o + c, normed * load(weight + c));
  }
}

template <typename T>
void rms_norm(const T* x, int64_t x_stride, const T* residual, int64_t residual_stride, T* sum_out, const T* weight,
              T* out, int64_t rows, int64_t cols, float eps, int num_threads) {
  const int threads = rows * cols >= kParallelElements ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    norm_row(x + r * x_stride, residual == nullptr ? nullptr : residual + r * residual_stride,
             sum_out == nullptr ? nullptr : sum_out + r * cols, weight, out + r * cols, cols, eps);
}

// Each head of each row normed on its own, head h times weight row h (Qwen3's q/k norms).
template <typename T>
void head_rms_norm(const T* x, int64_t x_stride, const T* weight, T* out, int64_t rows, int64_t heads,
                   int64_t head_dim, float eps, int num_threads) {
  const int threads = rows * heads * head_dim >= kParallelElements ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h)
      norm_row(x + r * x_stride + h * head_dim, static_cast<const T*>(nullptr), static_cast<T*>(nullptr),
               weight + h * head_dim, out + (r * heads + h) * head_dim, head_dim, eps);
}

template <typename T>
void rope(const T* x, int64_t x_stride, const T* table, int64_t table_stride, const int64_t* positions, T* out,
          int64_t rows, int64_t heads, int64_t head_dim, int num_threads) {
  const int64_t half = head_dim / 2;
  const int threads = rows * heads * head_dim >= kParallelElements ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    const T* cos = table + positions[r] * head_dim;
    const T* sin = table + table_stride + positions[r] * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      const T* xh = x + r * x_stride + h * head_dim;
      T* oh = out + (r * heads + h) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) {
        // x * cos + rotate_half(x) * sin, each product rounded to the dtype, then the sum.
        const float rotated = d < half ? -load(xh + d + half) : load(xh + d - half);
        const float a = round_to(load(xh + d) * load(cos + d), xh);
        const float b = round_to(rotated * load(sin + d), xh);
        store(oh + d, a + b);
      }
    }
  }
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16. x: [rows, cols] with row stride x_stride; residual: nullptr, or
// [rows, cols] with row stride residual_stride, and then sum_out [rows, cols] receives x + residual (the
// normed input); weight: [cols]; out: [rows, cols]. Returns 0, or 1 for an unknown dtype.
int goodserve_rms_norm(int dtype, const void* x, int64_t x_stride, const void* residual, int64_t residual_stride,
                       void* sum_out, const void* weight, void* out, int64_t rows, int64_t cols, float eps,
                       int num_threads) {
  if (dtype == 0) {
    rms_norm(static_cast<const float*>(x), x_stride, static_cast<const float*>(residual), residual_stride,
             static_cast<float*>(sum_out), static_cast<const float*>(weight), static_cast<float*>(out), rows,
             cols, eps, num_threads);
  } else if (dtype == 1) {
    rms_norm(static_cast<const uint16_t*>(x), x_stride, static_cast<const uint16_t*>(residual), residual_stride,
             static_cast<uint16_t*>(sum_out), static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out),
             rows, cols, eps, num_threads);
  } else {
    return 1;
  }
  return 0;
}

// x: [rows, heads, head_dim], heads contiguous, row stride x_stride; weight: [heads, head_dim], head h's
// row for head h of every row; out: [rows, heads, head_dim]. Returns 0, or 1 for an unknown dtype.
int goodserve_head_rms_norm(int dtype, const void* x, int64_t x_stride, const void* weight, void* out, int64_t rows,
                            int64_t heads, int64_t head_dim, float eps, int num_threads) {
  if (dtype == 0) {
    head_rms_norm(static_cast<const float*>(x), x_stride, static_cast<const float*>(weight), static_cast<float*>(out),
                  rows, heads, head_dim, eps, num_threads);
  } else if (dtype == 1) {
    head_rms_norm(static_cast<const uint16_t*>(x), x_stride, static_cast<const uint16_t*>(weight),
                  static_cast<uint16_t*>(out), rows, heads, head_dim, eps, num_threads);
  } else {
    return 1;
  }
  return 0;
}

// x: [rows, heads, head_dim], heads contiguous, row stride x_stride; table: cos rows [max_pos, head_dim]
// then, table_stride elements later, sin rows; positions: [rows] int64; out: [rows, heads, head_dim].
int goodserve_rope(int dtype, const void* x, int64_t x_stride, const void* table, int64_t table_stride,
                   const int64_t* positions, void* out, int64_t rows, int64_t heads, int64_t head_dim,
                   int num_threads) {
  if (dtype == 0) {
    rope(static_cast<const float*>(x), x_stride, static_cast<const float*>(table), table_stride, positions,
         static_cast<float*>(out), rows, heads, head_dim, num_threads);
  } else if (dtype == 1) {
    rope(static_cast<const uint16_t*>(x), x_stride, static_cast<const uint16_t*>(table), table_stride, positions,
         static_cast<uint16_t*>(out), rows, heads, head_dim, num_threads);
  } else {
    return 1;
  }
  return 0;
}

}  // extern "C"
