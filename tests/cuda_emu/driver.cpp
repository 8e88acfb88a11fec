// C entry points (for ctypes) over the quantizer launchers of csrc/cuda/launchers.h, called
// as the torch bindings in csrc/cuda/quantize.cpp call them, on host buffers. Arguments are
// pointers and int64s; each returns the launch status, and emu_failure() says what an
// emulator check found. A workspace is exactly as large as the launcher asks and filled with
// 0xFF bytes (NaN floats): device memory starts as garbage.

#include <cuda_runtime.h>

#include <vector>

#include "cuda/launchers.h"
#include "numerics.h"

#define EMU_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using ddpcomm::cuda::FloatType;
using ddpcomm::cuda::PayloadRows;

std::vector<unsigned char> workspace(int64_t numel, int64_t bits, int64_t block_size,
                                     bool stochastic) {
  const int64_t bytes =
      ddpcomm::cuda::encode_workspace_bytes(numel, (int)bits, block_size, stochastic);
  return std::vector<unsigned char>((size_t)bytes, 0xFF);
}

void* data_or_null(std::vector<unsigned char>& v) { return v.empty() ? nullptr : v.data(); }

uint64_t rng_key(int64_t seed, int64_t step) {
  return ddpcomm::rng_key((uint64_t)seed, (uint64_t)step);
}

}  // namespace

EMU_EXPORT void emu_reset(uint64_t schedule_seed) { emu::reset(schedule_seed); }

EMU_EXPORT const char* emu_failure() { return emu::failure_message(); }

EMU_EXPORT int emu_quantize(const void* x, int64_t x_type, float* residual, int64_t numel,
                            int64_t bits, int64_t block_size, int64_t stochastic, int64_t seed,
                            int64_t step, int64_t rng_offset, uint8_t* out) {
  const ddpcomm::cuda::QuantizeArgs args{x,
                                         (FloatType)x_type,
                                         residual,
                                         numel,
                                         (int)bits,
                                         block_size,
                                         stochastic != 0,
                                         rng_key(seed, step),
                                         rng_offset,
                                         out};
  std::vector<unsigned char> ws = workspace(numel, bits, block_size, stochastic != 0);
  return ddpcomm::cuda::launch_quantize(args, data_or_null(ws), nullptr);
}

EMU_EXPORT int emu_dequantize_sum(const uint8_t* payloads, int64_t rows, int64_t row_bytes,
                                  int64_t numel, int64_t bits, int64_t block_size, int64_t divisor,
                                  const float* scale, void* out, int64_t out_type) {
  const PayloadRows p{payloads, rows, row_bytes, numel, (int)bits, block_size};
  return ddpcomm::cuda::launch_dequantize_sum(p, divisor, scale, out, (FloatType)out_type, nullptr);
}

EMU_EXPORT int emu_dequantize_sum_requantize(const uint8_t* payloads, int64_t rows,
                                             int64_t row_bytes, float* residual, int64_t numel,
                                             int64_t bits, int64_t block_size, int64_t divisor,
                                             int64_t stochastic, int64_t seed, int64_t step,
                                             int64_t rng_offset, uint8_t* out) {
  const PayloadRows p{payloads, rows, row_bytes, numel, (int)bits, block_size};
  std::vector<unsigned char> ws = workspace(numel, bits, block_size, stochastic != 0);
  return ddpcomm::cuda::launch_dequantize_sum_requantize(p, residual, divisor, stochastic != 0,
                                                         rng_key(seed, step), rng_offset, out,
                                                         data_or_null(ws), nullptr);
}
