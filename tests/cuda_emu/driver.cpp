// C entry points (for ctypes) over the launchers of csrc/cuda/launchers.h, called as the torch
// bindings in csrc/cuda/quantize.cpp, sparse.cpp and flatten.cpp call them, on host buffers.
// Arguments are pointers and int64s; each returns the launch status, and emu_failure() says
// what an emulator check found. A workspace is exactly as large as the launcher asks and
// filled with 0xFF bytes (NaN floats, -1 ints): device memory starts as garbage.

#include <cuda_runtime.h>

#include <climits>
#include <cstdlib>
#include <memory>

#include "cuda/launchers.h"
#include "numerics.h"

#define EMU_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

using ddpcomm::cuda::FloatType;
using ddpcomm::cuda::PayloadRows;
using ddpcomm::cuda::SparsePayloads;

// Device scratch of `bytes` garbage bytes, 256-byte aligned as cudaMalloc's.
struct Scratch {
  int64_t bytes;
  std::unique_ptr<unsigned char, decltype(&free)> p{nullptr, &free};
  explicit Scratch(int64_t n) : bytes(n) {
    const size_t size = ((size_t)n + 255) / 256 * 256;
    p.reset(static_cast<unsigned char*>(aligned_alloc(256, size > 0 ? size : 256)));
    memset(p.get(), 0xFF, size > 0 ? size : 256);
  }
  template <class T>
  T* as() const {
    return reinterpret_cast<T*>(p.get());
  }
  // The pointer, or null for an empty workspace, as the quantizer's binding passes it.
  void* or_null() const { return bytes > 0 ? p.get() : nullptr; }
};

// An encode's workspace (launchers.h encode_workspace_bytes).
Scratch encode_workspace(int64_t numel, int64_t bits, int64_t block_size, int64_t stochastic) {
  return Scratch(
      ddpcomm::cuda::encode_workspace_bytes(numel, (int)bits, block_size, stochastic != 0));
}

uint64_t rng_key(int64_t seed, int64_t step) {
  return ddpcomm::rng_key((uint64_t)seed, (uint64_t)step);
}

uint64_t randk_key(int64_t seed, int64_t step, int64_t bucket) {
  return ddpcomm::randk_key((uint64_t)seed, (uint64_t)step, (uint64_t)bucket);
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
  const Scratch ws = encode_workspace(numel, bits, block_size, stochastic);
  return ddpcomm::cuda::launch_quantize(args, ws.or_null(), nullptr);
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
  const Scratch ws = encode_workspace(numel, bits, block_size, stochastic);
  return ddpcomm::cuda::launch_dequantize_sum_requantize(p, residual, divisor, stochastic != 0,
                                                         rng_key(seed, step), rng_offset, out,
                                                         ws.or_null(), nullptr);
}

EMU_EXPORT int emu_topk_compress(const void* x, int64_t x_type, float* residual, int64_t n,
                                 int64_t k, int64_t approximate, int64_t seed, int64_t step,
                                 int64_t value_type, uint8_t* out) {
  const int64_t samples = ddpcomm::topk_sample_count(n);
  const int64_t rank = approximate ? ddpcomm::topk_approx_rank(k, n, samples)
                                   : ddpcomm::topk_exact_rank(k, n, samples);
  const ddpcomm::cuda::TopkArgs a{x,
                                  (FloatType)x_type,
                                  residual,
                                  n,
                                  k,
                                  approximate != 0,
                                  rng_key(seed, step),
                                  samples,
                                  rank,
                                  ddpcomm::cuda::topk_candidate_capacity(n, samples, rank),
                                  (FloatType)value_type,
                                  out};
  const Scratch ws(ddpcomm::cuda::topk_workspace_bytes(n, a.capacity));
  return ddpcomm::cuda::launch_topk_compress(a, ws.as<void>(), nullptr);
}

// bad: nullptr (check=False), or max(rows, 1) int32 that the caller set to INT32_MAX. With
// it, as the binding does, a row left with a position there stops the call before
// launch_sparse_accumulate: `out` is not written and the caller raises.
EMU_EXPORT int emu_sparse_accumulate(const uint8_t* payloads, int64_t rows, int64_t row_bytes,
                                     int64_t k, int64_t numel, int64_t value_type, int64_t divisor,
                                     void* out, int64_t out_type, int32_t* bad) {
  const SparsePayloads p{payloads, rows, row_bytes, k, numel, (FloatType)value_type};
  const Scratch start(4 * rows * (ddpcomm::cuda::sparse_tiles(numel) + 1));
  const int status = ddpcomm::cuda::launch_sparse_index(p, bad, start.as<int32_t>(), nullptr);
  if (status != 0) return status;
  for (int64_t r = 0; bad != nullptr && r < rows; ++r) {
    if (bad[r] != INT_MAX) return 0;
  }
  return ddpcomm::cuda::launch_sparse_accumulate(p, start.as<int32_t>(), divisor, out,
                                                 (FloatType)out_type, nullptr);
}

EMU_EXPORT int emu_randk_compress(const void* x, int64_t x_type, float* residual, int64_t n,
                                  int64_t k, int64_t start, int64_t end, int64_t seed, int64_t step,
                                  int64_t bucket, float* values) {
  const Scratch flag(sizeof(int));
  return ddpcomm::cuda::launch_randk_compress(x, (FloatType)x_type, residual, n, k, start, end,
                                              randk_key(seed, step, bucket), values, flag.as<int>(),
                                              nullptr);
}

EMU_EXPORT int emu_randk_decompress(const float* values, int64_t numel, int64_t k, int64_t start,
                                    int64_t end, int64_t seed, int64_t step, int64_t bucket,
                                    int64_t divisor, void* out, int64_t out_type) {
  return ddpcomm::cuda::launch_randk_decompress(values, numel, k, start, end,
                                                randk_key(seed, step, bucket), divisor, out,
                                                (FloatType)out_type, nullptr);
}

// flatten.cpp's copy_list: ptrs[i] is nullptr for an entry it copies another way (empty, or
// not one run of bytes); offsets are its byte_offsets, count + 1 of them.
EMU_EXPORT int emu_multi_tensor_copy(uint8_t* flat, int64_t count, void* const* ptrs,
                                     const int64_t* offsets, int64_t to_flat) {
  return ddpcomm::cuda::launch_multi_tensor_copy(flat, count, ptrs, offsets, to_flat != 0, nullptr);
}
