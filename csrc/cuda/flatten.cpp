// CUDA implementations of the multi-tensor flatten ops: the torch side only. Checks are
// csrc/flatten.h's, as on CPU; the byte-copyable entries move in one launch of
// flatten_kernels.cu (apex-style tensor list in the kernel arguments), strided views by
// ATen's copy, all on the current stream of the flat buffer's device.

#include "../flatten.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <vector>

#include "binding.h"
#include "launchers.h"

namespace ddpcomm {
namespace {

// Copies every entry of `tensors` to (to_flat) or from its place in `flat`.
void copy_list(const at::Tensor& flat, at::TensorList tensors, bool to_flat) {
  const std::vector<int64_t> off = byte_offsets(tensors);
  std::vector<void*> ptrs(tensors.size(), nullptr);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel() > 0 && is_byte_copyable(tensors[i])) ptrs[i] = tensors[i].data_ptr();
  }
  if (off.back() > 0) {
    C10_CUDA_CHECK(cuda::launch_multi_tensor_copy(static_cast<uint8_t*>(flat.data_ptr()),
                                                  (int64_t)tensors.size(), ptrs.data(), off.data(),
                                                  to_flat, current_stream()));
  }
  // The rest (views with gaps, conjugate or negative views): one strided copy each, as the
  // CPU op does, queued after the kernel on the same stream.
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0 || ptrs[i] != nullptr) continue;
    const int64_t start = off[i] / static_cast<int64_t>(t.element_size());
    at::Tensor piece = flat.narrow(0, start, t.numel()).view(t.sizes());
    if (to_flat) {
      piece.copy_(t);
    } else {
      t.copy_(piece);
    }
  }
}

at::Tensor flatten_cuda(at::TensorList tensors) {
  TORCH_CHECK_VALUE(!tensors.empty(), "flatten: tensors must not be empty (the result takes its ",
                    "dtype and device from them); use flatten_into to fill a given buffer");
  check_flatten_list(tensors, tensors[0].scalar_type(), tensors[0].device(), "tensors[0]",
                     "flatten");
  const c10::cuda::CUDAGuard guard(tensors[0].device());
  at::Tensor out = at::empty({total_numel(tensors)}, tensors[0].options());
  copy_list(out, tensors, true);
  return out;
}

void flatten_into_cuda(at::TensorList tensors, const at::Tensor& out) {
  check_flatten_list(tensors, out.scalar_type(), out.device(), "out", "flatten_into");
  check_flat_buffer(out, total_numel(tensors), "out", "flatten_into");
  check_flat_disjoint(out, tensors, "out", "flatten_into");
  const c10::cuda::CUDAGuard guard(out.device());
  copy_list(out, tensors, true);
}

void unflatten_into_cuda(const at::Tensor& flat, at::TensorList tensors) {
  check_flatten_list(tensors, flat.scalar_type(), flat.device(), "flat", "unflatten_into");
  check_flat_buffer(flat, total_numel(tensors), "flat", "unflatten_into");
  check_flat_disjoint(flat, tensors, "flat", "unflatten_into");
  check_destinations(tensors, "unflatten_into");
  const c10::cuda::CUDAGuard guard(flat.device());
  copy_list(flat, tensors, false);
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpcomm, CUDA, m) {
  m.impl("flatten", &flatten_cuda);
  m.impl("flatten_into", &flatten_into_cuda);
  m.impl("unflatten_into", &unflatten_into_cuda);
}

}  // namespace ddpcomm
