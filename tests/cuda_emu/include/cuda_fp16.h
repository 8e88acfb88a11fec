// Host __half for the emulated kernels (cuda_runtime.h): the bits and the explicit conversions
// only. torch compiles CUDA code with __CUDA_NO_HALF_CONVERSIONS__ and
// __CUDA_NO_HALF_OPERATORS__, so kernels convert through these intrinsics and never do
// arithmetic on a __half; here neither is possible at all.
#pragma once

#include <math.h>
#include <stdint.h>

#include "cuda_runtime.h"

struct __half {
  unsigned short x;
};

inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }

inline float __half2float(__half h) {
  const uint32_t sign = (uint32_t)(h.x & 0x8000u) << 16, exp = (h.x >> 10) & 0x1fu,
                 mant = h.x & 0x3ffu;
  if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mant << 13));  // Inf, NaN
  if (exp == 0) {
    const float v = (float)mant * 0x1p-24f;  // zero or subnormal: exact in float
    return sign ? -v : v;
  }
  return __uint_as_float(sign | ((exp + 112) << 23) | (mant << 13));
}

// Round to nearest even. A NaN keeps its top payload bits, quieted (the kernels store NaNs
// as the canonical one, so the GPU's own NaN bits do not matter).
inline __half __float2half_rn(float f) {
  const uint32_t u = __float_as_uint(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return __half{(unsigned short)(sign | 0x7e00u | ((a >> 13) & 0x3ffu))};
  if (a >= 0x477ff000u) return __half{(unsigned short)(sign | 0x7c00u)};  // rounds to Inf
  if (a >= 0x38800000u) {                                                 // a normal half, >= 2^-14
    uint32_t r = a - (112u << 23);
    r += 0xfffu + ((r >> 13) & 1u);
    return __half{(unsigned short)(sign | (r >> 13))};
  }
  // A subnormal half or zero: units of 2^-24, rounded by the default mode (ties to even).
  const float units = nearbyintf(__uint_as_float(a) * 0x1p24f);
  return __half{(unsigned short)(sign | (uint32_t)units)};
}
