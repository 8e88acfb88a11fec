// Element access shared by every CUDA kernel file: conversions between float and the stored
// types (float32, float16, bfloat16), and the FloatType dispatch of the launchers.
//
// torch builds CUDA code with __CUDA_NO_HALF_CONVERSIONS__ and friends, so every conversion
// is an explicit intrinsic; float -> half/bf16 rounds to nearest even, as torch's casts do.
// Every store goes through from_float, which writes a NaN as its dtype's canonical NaN
// (numerics.h): the GPU's own NaN results (0x7FFFFFFF, and 0x7FFF from its conversions) are
// not the CPU's. Like launchers.h, this header needs only the CUDA toolkit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../numerics.h"
#include "launchers.h"

namespace ddpcomm {
namespace cuda {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ float half_bits_to_float(uint32_t h) {
  return __half2float(__ushort_as_half((unsigned short)h));
}
// bf16 is the top half of an fp32: widening is a shift, exact.
__device__ __forceinline__ float bf16_bits_to_float(uint32_t h) { return __uint_as_float(h << 16); }

// v as stored in a T: rounded to nearest even, a NaN as T's canonical NaN.
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return canonical(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return is_nan(v) ? __ushort_as_half(kCanonicalNanF16) : __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return is_nan(v) ? __ushort_as_bfloat16(kCanonicalNanBF16) : __float2bfloat16_rn(v);
}

template <typename T>
__device__ __forceinline__ uint32_t to_bits16(T v);
template <>
__device__ __forceinline__ uint32_t to_bits16<__half>(__half v) {
  return __half_as_ushort(v);
}
template <>
__device__ __forceinline__ uint32_t to_bits16<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat16_as_ushort(v);
}

// Element i of a tensor of type t, as float.
__device__ __forceinline__ float load_elem(const void* p, FloatType t, int64_t i) {
  switch (t) {
    case FloatType::kFloat16:
      return to_float(static_cast<const __half*>(p)[i]);
    case FloatType::kBFloat16:
      return to_float(static_cast<const __nv_bfloat16*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// Stores v cast to t (from_float) at element i; returns the stored value widened to float.
__device__ __forceinline__ float store_elem(void* p, FloatType t, int64_t i, float v) {
  switch (t) {
    case FloatType::kFloat16: {
      const __half h = from_float<__half>(v);
      static_cast<__half*>(p)[i] = h;
      return to_float(h);
    }
    case FloatType::kBFloat16: {
      const __nv_bfloat16 h = from_float<__nv_bfloat16>(v);
      static_cast<__nv_bfloat16*>(p)[i] = h;
      return to_float(h);
    }
    default: {
      const float f = from_float<float>(v);
      static_cast<float*>(p)[i] = f;
      return f;
    }
  }
}

inline int elem_bytes(FloatType t) { return t == FloatType::kFloat32 ? 4 : 2; }

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) with the element type T of t: the one switch from a FloatType to the
// template argument of a kernel. Host code only.
template <class F>
decltype(auto) with_float_type(FloatType t, F&& f) {
  switch (t) {
    case FloatType::kFloat16:
      return f(TypeTag<__half>{});
    case FloatType::kBFloat16:
      return f(TypeTag<__nv_bfloat16>{});
    default:
      return f(TypeTag<float>{});
  }
}

}  // namespace cuda
}  // namespace ddpcomm
