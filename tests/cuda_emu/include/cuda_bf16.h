// Host __nv_bfloat16 for the emulated kernels: the bits and the explicit conversions only
// (see cuda_fp16.h).
#pragma once

#include <stdint.h>

#include "cuda_runtime.h"

struct __nv_bfloat16 {
  unsigned short x;
};

inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16{u}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }

// bfloat16 is the top half of a float: widening is exact.
inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float((uint32_t)h.x << 16); }

// Round to nearest even; a NaN keeps its top payload bits, quieted.
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{(unsigned short)((u >> 16) | 0x40u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16{(unsigned short)(u >> 16)};
}
