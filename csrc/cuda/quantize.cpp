// CUDA implementations of the quantizer ops (and their _into out-variants): the torch side
// only. Arguments are checked exactly as on CPU (csrc/checks.h), outputs allocated here,
// and the kernels in quantize_kernels.cu launched on the current stream of the input's
// device (csrc/cuda/binding.h).

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

cuda::PayloadRows payload_rows(const at::Tensor& payloads, int64_t numel, int64_t bits,
                               int64_t block_size) {
  const bool one = payloads.dim() == 1;
  return cuda::PayloadRows{payloads.data_ptr<uint8_t>(),
                           one ? 1 : payloads.size(0),
                           one ? payloads.size(0) : payloads.size(1),
                           numel,
                           (int)bits,
                           block_size};
}

void quantize_into_cuda(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                        const at::Tensor& packed, int64_t bits, int64_t block_size, bool stochastic,
                        int64_t seed, int64_t step, int64_t rng_offset) {
  check_quantize_args(x, residual, bits, block_size, "quantize");
  const int64_t n = x.numel();
  check_out(packed, at::kByte, payload_bytes(n, block_size, (int)bits), x.device(), "quantize");
  check_on_cuda(x, "x", "quantize");
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
  C10_CUDA_CHECK(cuda::launch_quantize(args, current_stream()));
}

at::Tensor quantize_cuda(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                         int64_t bits, int64_t block_size, bool stochastic, int64_t seed,
                         int64_t step, int64_t rng_offset) {
  check_bits_block(bits, block_size, "quantize");
  auto packed =
      at::empty({payload_bytes(x.numel(), block_size, (int)bits)}, x.options().dtype(at::kByte));
  quantize_into_cuda(x, residual, packed, bits, block_size, stochastic, seed, step, rng_offset);
  return packed;
}

// dequantize (one row, divisor 1) and dequantize_sum into `result`, whose numel and dtype
// say what to decode.
void decode_into(const at::Tensor& payloads, const at::Tensor& result, int64_t bits,
                 int64_t block_size, int64_t divisor) {
  const int64_t numel = result.numel();
  if (numel == 0) return;
  const c10::cuda::CUDAGuard guard(payloads.device());
  C10_CUDA_CHECK(cuda::launch_dequantize_sum(payload_rows(payloads, numel, bits, block_size),
                                             divisor, result.data_ptr(),
                                             float_type(result.scalar_type()), current_stream()));
}

void dequantize_into_cuda(const at::Tensor& packed, const at::Tensor& result, int64_t bits,
                          int64_t block_size) {
  const int64_t numel = result.numel();
  const at::ScalarType dtype = result.scalar_type();
  check_payloads(packed, 1, numel, bits, block_size, dtype, "dequantize");
  check_out(result, dtype, numel, packed.device(), "dequantize");
  check_on_cuda(packed, "packed", "dequantize");
  decode_into(packed, result, bits, block_size, 1);
}

at::Tensor dequantize_cuda(const at::Tensor& packed, int64_t numel, int64_t bits,
                           int64_t block_size, at::ScalarType dtype) {
  check_payloads(packed, 1, numel, bits, block_size, dtype, "dequantize");
  auto result = at::empty({numel}, packed.options().dtype(dtype));
  dequantize_into_cuda(packed, result, bits, block_size);
  return result;
}

void dequantize_sum_into_cuda(const at::Tensor& payloads, const at::Tensor& result, int64_t bits,
                              int64_t block_size, int64_t divisor) {
  const int64_t numel = result.numel();
  const at::ScalarType dtype = result.scalar_type();
  check_payloads(payloads, 2, numel, bits, block_size, dtype, "dequantize_sum");
  check_out(result, dtype, numel, payloads.device(), "dequantize_sum");
  TORCH_CHECK(divisor >= 1, "dequantize_sum: divisor must be >= 1, got ", divisor);
  check_on_cuda(payloads, "payloads", "dequantize_sum");
  decode_into(payloads, result, bits, block_size, divisor);
}

at::Tensor dequantize_sum_cuda(const at::Tensor& payloads, int64_t numel, int64_t bits,
                               int64_t block_size, int64_t divisor, at::ScalarType dtype) {
  check_payloads(payloads, 2, numel, bits, block_size, dtype, "dequantize_sum");
  auto result = at::empty({numel}, payloads.options().dtype(dtype));
  dequantize_sum_into_cuda(payloads, result, bits, block_size, divisor);
  return result;
}

at::Tensor dequantize_sum_requantize_cuda(const at::Tensor& payloads,
                                          const std::optional<at::Tensor>& residual, int64_t numel,
                                          int64_t bits, int64_t block_size, int64_t divisor,
                                          bool stochastic, int64_t seed, int64_t step,
                                          int64_t rng_offset) {
  const char* op = "dequantize_sum_requantize";
  check_payloads(payloads, 2, numel, bits, block_size, at::kFloat, op);
  check_residual(residual, numel, payloads.device(), op);
  TORCH_CHECK(divisor >= 1, op, ": divisor must be >= 1, got ", divisor);
  check_on_cuda(payloads, "payloads", op);
  const c10::cuda::CUDAGuard guard(payloads.device());
  auto packed = at::empty({payload_bytes(numel, block_size, (int)bits)}, payloads.options());
  if (numel == 0) return packed;
  C10_CUDA_CHECK(cuda::launch_dequantize_sum_requantize(
      payload_rows(payloads, numel, bits, block_size),
      residual ? residual->data_ptr<float>() : nullptr, divisor, stochastic,
      rng_key((uint64_t)seed, (uint64_t)step), rng_offset, packed.data_ptr<uint8_t>(),
      current_stream()));
  return packed;
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpcomm, CUDA, m) {
  m.impl("quantize", &quantize_cuda);
  m.impl("dequantize", &dequantize_cuda);
  m.impl("dequantize_sum", &dequantize_sum_cuda);
  m.impl("dequantize_sum_requantize", &dequantize_sum_requantize_cuda);
  m.impl("quantize_into", &quantize_into_cuda);
  m.impl("dequantize_into", &dequantize_into_cuda);
  m.impl("dequantize_sum_into", &dequantize_sum_into_cuda);
}

}  // namespace ddpcomm
