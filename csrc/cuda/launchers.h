// Host-side entry points of ddpcomm's CUDA kernels.
//
// This header and the *_kernels.cu files that implement it need only the CUDA toolkit: raw
// pointers, sizes and a cudaStream_t in, a cudaError_t out. No torch header is included, so
// `nvcc -c csrc/cuda/*_kernels.cu` compile-checks every kernel on a machine with neither a
// GPU nor a CUDA build of torch (see the Makefile's nvcc-check). The torch bindings
// (csrc/cuda/<family>.cpp) validate arguments, allocate the workspaces these ask for (from
// torch's caching allocator, sized on the host alone) and call them.
//
// Every launcher enqueues its kernels on `stream` and returns the launch status
// (cudaGetLastError), or cudaErrorInvalidValue for arguments it cannot honour; it never
// synchronizes.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace ddpcomm {
namespace cuda {

// Element type of a float tensor as the kernels see it.
enum class FloatType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// ---------------------------------------------------------------------------------------
// Quantizer family (payload layout: csrc/numerics.h). bits in {1, 2, 4, 8, 3}; block_size a
// power of two in [32, 65536]. Inputs and outputs may have any alignment (aligned ones take
// the vector paths).
// ---------------------------------------------------------------------------------------

struct QuantizeArgs {
  const void* x;       // numel elements of x_type, contiguous
  FloatType x_type;    //
  float* residual;     // numel floats read and rewritten (error feedback), or nullptr
  int64_t numel;       //
  int bits;            //
  int64_t block_size;  //
  bool stochastic;     //
  uint64_t rng_key;    // numerics.h rng_key(seed, step)
  int64_t rng_offset;  // element i draws counter rng_offset + i
  uint8_t* out;        // payload_bytes(numel, block_size, bits) bytes
};

// Device scratch that an encode (quantize, dequantize_sum_requantize) of numel elements needs,
// in bytes, 4-byte aligned: 0 up to block_size 8192; larger blocks are split over several CTAs
// that combine partial reductions through it.
int64_t encode_workspace_bytes(int64_t numel, int bits, int64_t block_size, bool stochastic);

// quantize: out = payload of x (+ residual); residual = e - dequantized(e) when given.
// workspace: encode_workspace_bytes(...) bytes (may be nullptr when that is 0).
cudaError_t launch_quantize(const QuantizeArgs& a, void* workspace, cudaStream_t stream);

// `rows` payloads of `row_bytes` bytes each, back to back (row r starts at r * row_bytes).
struct PayloadRows {
  const uint8_t* data;
  int64_t rows;
  int64_t row_bytes;
  int64_t numel;  // elements each payload encodes
  int bits;
  int64_t block_size;
};

// dequantize (rows == 1, divisor == 1) and dequantize_sum: out[i] = (sum over rows, in row
// order, of each row's value i, accumulated in fp32 from 0) / divisor, cast to out_type;
// with a scale (numel floats, or nullptr), that value times scale[i] in fp32, cast again.
cudaError_t launch_dequantize_sum(const PayloadRows& p, int64_t divisor, const float* scale,
                                  void* out, FloatType out_type, cudaStream_t stream);

// dequantize_sum_requantize: S = row-order sum (+ residual); out = payload of S / divisor;
// residual = S - divisor * dequantized (when residual is not nullptr).
cudaError_t launch_dequantize_sum_requantize(const PayloadRows& p, float* residual, int64_t divisor,
                                             bool stochastic, uint64_t rng_key, int64_t rng_offset,
                                             uint8_t* out, void* workspace, cudaStream_t stream);

// q1.5's code (bits = kSparseBits; ternary_kernels.cu), which the launchers above hand their
// calls to: deterministic rounding only; its encode workspace holds the staged values.
int64_t sparse_workspace_bytes(int64_t numel, int64_t block_size);
cudaError_t launch_sparse_quantize(const QuantizeArgs& a, void* workspace, cudaStream_t stream);
cudaError_t launch_sparse_dequantize_sum(const PayloadRows& p, int64_t divisor, const float* scale,
                                         void* out, FloatType out_type, cudaStream_t stream);
cudaError_t launch_sparse_requantize(const PayloadRows& p, float* residual, int64_t divisor,
                                     uint8_t* out, void* workspace, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// Multi-tensor flatten family (csrc/flatten.h). Entry i of `count` occupies flat bytes
// [offsets[i], offsets[i + 1]) and lives at ptrs[i] as one run of bytes; a nullptr entry
// is skipped (the caller copies it another way). to_flat: entries -> flat, else flat ->
// entries. `offsets` holds count + 1 non-decreasing values. Entries may have any alignment.
// One kernel launch per 1800 entries (CUDA 12.1+; 240 with older toolkits).
// ---------------------------------------------------------------------------------------

cudaError_t launch_multi_tensor_copy(uint8_t* flat, int64_t count, void* const* ptrs,
                                     const int64_t* offsets, bool to_flat, cudaStream_t stream);

// ---------------------------------------------------------------------------------------
// Sparsification family (csrc/numerics.h "Sparsification"). 1 <= k <= n <= 2^31 - 1.
// ---------------------------------------------------------------------------------------

// topk_compress, without any host synchronization: the candidate count that picks the path
// stays on the device, and the binding sizes every buffer up front from n and the capacity.
struct TopkArgs {
  const void* x;
  FloatType x_type;
  float* residual;  // nullptr: no error feedback
  int64_t n;
  int64_t k;
  bool approximate;
  uint64_t rng_key;     // numerics.h rng_key(seed, step)
  int64_t samples;      // topk_sample_count(n)
  int64_t sample_rank;  // topk_approx_rank or topk_exact_rank
  int64_t capacity;     // topk_candidate_capacity(n, samples, sample_rank)
  FloatType value_type;
  uint8_t* out;  // topk_payload_bytes(k, value bytes), 4-byte aligned
};

// Candidates the compacted path has room for; more (or, in exact mode, fewer than k) take the
// dense path, which selects over every entry. Both give the same payload.
int64_t topk_candidate_capacity(int64_t n, int64_t samples, int64_t sample_rank);
int64_t topk_workspace_bytes(int64_t n, int64_t capacity);
// workspace: topk_workspace_bytes(n, capacity) bytes, 256-byte aligned.
cudaError_t launch_topk_compress(const TopkArgs& a, void* workspace, cudaStream_t stream);

// sparse_accumulate: rows of [k int32 indices][k values], row r at data + r * row_bytes.
struct SparsePayloads {
  const uint8_t* data;
  int64_t rows;
  int64_t row_bytes;
  int64_t k;
  int64_t numel;
  FloatType value_type;
};

int64_t sparse_tiles(int64_t numel);
// bad: rows int32 preset to INT32_MAX, left there for a valid row, else the first bad
// position (nullptr: no validation); start: rows * (sparse_tiles(numel) + 1) int32 (the
// tile boundary table).
cudaError_t launch_sparse_index(const SparsePayloads& p, int32_t* bad, int32_t* start,
                                cudaStream_t stream);
// After launch_sparse_index. Rows it would have refused give unspecified sums, but no write
// lands outside `out`.
cudaError_t launch_sparse_accumulate(const SparsePayloads& p, const int32_t* start, int64_t divisor,
                                     void* out, FloatType out_type, cudaStream_t stream);

// randk, over strata [j0, j1) of k (0 <= j0 <= j1 <= k) and their elements [j0*n/k, j1*n/k):
// values[j0, j1) of e = x (+ residual; residual becomes e, 0 at the sent entries), all NaN
// when any e of those elements is non-finite. flag: one int of device scratch.
cudaError_t launch_randk_compress(const void* x, FloatType x_type, float* residual, int64_t n,
                                  int64_t k, int64_t j0, int64_t j1, uint64_t key, float* values,
                                  int* flag, cudaStream_t stream);
// out (numel elements of out_type) over those elements = 0, values[j] / divisor at the
// random-k indices of strata [j0, j1); the rest of out is not touched.
cudaError_t launch_randk_decompress(const float* values, int64_t numel, int64_t k, int64_t j0,
                                    int64_t j1, uint64_t key, int64_t divisor, void* out,
                                    FloatType out_type, cudaStream_t stream);

}  // namespace cuda
}  // namespace ddpcomm
