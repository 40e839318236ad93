// Float32 / bfloat16 element access shared by the kernels (and int8 KV-cache codes, read only): values are
// computed in float32 and rounded to the activation dtype on store (round to nearest even, as PyTorch rounds).
#pragma once

#include <cstdint>
#include <cstring>

namespace goodserve {

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) {  // bfloat16 -> float32: the high half of the float's bits
  uint32_t u = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline float load(const int8_t* p) { return static_cast<float>(*p); }  // an int8 KV cache's code
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) {  // float32 -> bfloat16, round to nearest even
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN stays NaN
    *p = static_cast<uint16_t>((u >> 16) | 0x40u);
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = static_cast<uint16_t>(u >> 16);
}
// v rounded to the dtype T points to (an intermediate PyTorch would store in the activation dtype), as float32.
inline float round_to(float v, const float*) { return v; }
inline float round_to(float v, const uint16_t*) {
  uint16_t b;
  store(&b, v);
  return load(&b);
}

}  // namespace goodserve
