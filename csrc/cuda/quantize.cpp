// CUDA implementations of the quantizer ops (quantize_into, dequantize_sum_into,
// dequantize_sum_requantize_into): the torch side only. Arguments are checked exactly as on
// CPU (csrc/checks.h), and the kernels in quantize_kernels.cu launched on the current stream
// of the input's device (csrc/cuda/binding.h).

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>

#include "../checks.h"
#include "../numerics.h"
#include "binding.h"
#include "launchers.h"

namespace ddpcomm {
namespace {

// Scratch of an encode launch (large blocks only), from torch's caching allocator.
at::Tensor encode_workspace(int64_t numel, int64_t bits, int64_t block_size, bool stochastic,
                            const at::Tensor& like) {
  const int64_t bytes = cuda::encode_workspace_bytes(numel, (int)bits, block_size, stochastic);
  return bytes > 0 ? at::empty({bytes}, like.options().dtype(at::kByte)) : at::Tensor();
}

void* data_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// `payloads` is [N, bytes]: N payloads of `numel` elements each.
cuda::PayloadRows payload_rows(const at::Tensor& payloads, int64_t numel, int64_t bits,
                               int64_t block_size) {
  return cuda::PayloadRows{payloads.data_ptr<uint8_t>(),
                           payloads.size(0),
                           payloads.size(1),
                           numel,
                           (int)bits,
                           block_size};
}

void quantize_into_cuda(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                        const at::Tensor& packed, int64_t bits, int64_t block_size, bool stochastic,
                        int64_t seed, int64_t step, int64_t rng_offset) {
  check_quantize(x, residual, packed, bits, block_size);
  check_on_cuda(x, "x", "quantize");
  check_rounding(bits, stochastic, "quantize");
  const int64_t n = x.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  const cuda::QuantizeArgs args{xc.data_ptr(),
                                float_type(x.scalar_type()),
                                residual ? residual->data_ptr<float>() : nullptr,
                                n,
                                (int)bits,
                                block_size,
                                stochastic,
                                rng_key((uint64_t)seed, (uint64_t)step),
                                rng_offset,
                                packed.data_ptr<uint8_t>()};
  const at::Tensor ws = encode_workspace(n, bits, block_size, stochastic, x);
  C10_CUDA_CHECK(cuda::launch_quantize(args, data_or_null(ws), current_stream()));
}

// Also ops.dequantize: one row, divisor 1 (x / 1 == x, so the same bits).
void dequantize_sum_into_cuda(const at::Tensor& payloads, const at::Tensor& result, int64_t bits,
                              int64_t block_size, int64_t divisor,
                              const std::optional<at::Tensor>& scale) {
  check_dequantize_sum(payloads, result, bits, block_size, divisor, scale);
  check_on_cuda(payloads, "payloads", "dequantize_sum");
  const int64_t numel = result.numel();
  if (numel == 0) return;
  const c10::cuda::CUDAGuard guard(payloads.device());
  C10_CUDA_CHECK(cuda::launch_dequantize_sum(payload_rows(payloads, numel, bits, block_size),
                                             divisor, scale ? scale->data_ptr<float>() : nullptr,
                                             result.data_ptr(), float_type(result.scalar_type()),
                                             current_stream()));
}

void dequantize_sum_requantize_into_cuda(const at::Tensor& payloads,
                                         const std::optional<at::Tensor>& residual,
                                         const at::Tensor& packed, int64_t numel, int64_t bits,
                                         int64_t block_size, int64_t divisor, bool stochastic,
                                         int64_t seed, int64_t step, int64_t rng_offset) {
  check_dequantize_sum_requantize(payloads, residual, packed, numel, bits, block_size, divisor);
  check_on_cuda(payloads, "payloads", "dequantize_sum_requantize");
  check_rounding(bits, stochastic, "dequantize_sum_requantize");
  if (numel == 0) return;
  const c10::cuda::CUDAGuard guard(payloads.device());
  const at::Tensor ws = encode_workspace(numel, bits, block_size, stochastic, payloads);
  C10_CUDA_CHECK(cuda::launch_dequantize_sum_requantize(
      payload_rows(payloads, numel, bits, block_size),
      residual ? residual->data_ptr<float>() : nullptr, divisor, stochastic,
      rng_key((uint64_t)seed, (uint64_t)step), rng_offset, packed.data_ptr<uint8_t>(),
      data_or_null(ws), current_stream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpcomm, CUDA, m) {
  m.impl("quantize_into", &quantize_into_cuda);
  m.impl("dequantize_sum_into", &dequantize_sum_into_cuda);
  m.impl("dequantize_sum_requantize_into", &dequantize_sum_requantize_into_cuda);
}

}  // namespace ddpcomm
