// Torch-side helpers shared by the CUDA bindings (csrc/cuda/<family>.cpp): the kernels'
// view of a dtype, the device check, and the stream every kernel is launched on.
//
// The stream comes from c10/cuda/CUDAStream.h (at::cuda::getCurrentCUDAStream is the same
// function re-exported): ATen/cuda/CUDAContext.h would also pull in cuBLAS and cuSPARSE
// headers, which the bindings do not need and a bare CUDA toolkit does not ship.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include "launchers.h"

namespace ddpcomm {

// The kernels' element type of a float dtype (callers have checked is_supported_float).
inline cuda::FloatType float_type(at::ScalarType t) {
  if (t == at::kHalf) return cuda::FloatType::kFloat16;
  if (t == at::kBFloat16) return cuda::FloatType::kBFloat16;
  return cuda::FloatType::kFloat32;
}

inline void check_on_cuda(const at::Tensor& t, const char* arg, const char* op) {
  TORCH_CHECK(t.is_cuda(), op, ": ", arg, " must be a CUDA tensor, got one on ", t.device());
}

// The current stream of the current device (set by the caller's CUDAGuard): NCCL and the
// caller's own kernels order themselves against it.
inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

}  // namespace ddpcomm
