// CUDA implementations of the sparsification ops (topk_compress_into, sparse_accumulate_into,
// randk_compress_into, randk_decompress_into): the torch side only. Checks are the CPU ops'
// (csrc/checks.h); workspaces come from torch's caching allocator; the kernels
// (sparse_kernels.cu) run on the current stream of the input's device.
//
// Only sparse_accumulate with check=True synchronizes with the host: it reads the index
// validation verdict so a bad payload raises, like on CPU, before anything is scattered.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <optional>

#include "../checks.h"
#include "../numerics.h"
#include "binding.h"
#include "launchers.h"

namespace ddpcomm {
namespace {

at::Tensor bytes(int64_t n, const at::Tensor& like) {
  return at::empty({n}, like.options().dtype(at::kByte));
}

// The payload's int32 indices and values are stored as words, so the kernels write into a
// 4-byte aligned buffer: `out` itself, or (for a byte slice at an odd offset) a fresh one
// copied into it afterwards on the same stream. Same bytes either way. Nothing is read back:
// which path the selection takes is decided on the device (sparse_kernels.cu).
void topk_compress_into_cuda(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                             const at::Tensor& packed, int64_t k, bool approximate, int64_t seed,
                             int64_t step, std::optional<at::ScalarType> value_dtype) {
  const at::ScalarType vtype = check_topk_compress(x, residual, packed, k, value_dtype);
  check_on_cuda(x, "x", "topk_compress");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t n = x.numel();
  const at::Tensor xc = x.contiguous();
  const bool aligned = reinterpret_cast<uintptr_t>(packed.data_ptr()) % 4 == 0;
  at::Tensor dst = aligned ? packed : bytes(packed.numel(), x);
  const int64_t samples = topk_sample_count(n);
  const int64_t rank =
      approximate ? topk_approx_rank(k, n, samples) : topk_exact_rank(k, n, samples);
  const cuda::TopkArgs a{xc.data_ptr(),
                         float_type(x.scalar_type()),
                         residual ? residual->data_ptr<float>() : nullptr,
                         n,
                         k,
                         approximate,
                         rng_key((uint64_t)seed, (uint64_t)step),
                         samples,
                         rank,
                         cuda::topk_candidate_capacity(n, samples, rank),
                         float_type(vtype),
                         dst.data_ptr<uint8_t>()};
  at::Tensor ws = bytes(cuda::topk_workspace_bytes(n, a.capacity), x);
  C10_CUDA_CHECK(cuda::launch_topk_compress(a, ws.data_ptr(), current_stream()));
  if (!aligned) packed.copy_(dst);
}

// With `check`, validates every row's indices on the device and raises like the CPU op for
// the first bad row before anything is scattered: reading the verdict back is a host
// synchronization. Without it (the collectives' own payloads, made by topk_compress) nothing
// is read back. Then sums the rows in rank order into `out` (in fp32, in shared memory).
void sparse_accumulate_into_cuda(const at::Tensor& payloads, const at::Tensor& out, int64_t k,
                                 int64_t divisor, at::ScalarType value_dtype, bool check) {
  const char* op = "sparse_accumulate";
  check_sparse_accumulate(payloads, out, k, divisor, value_dtype);
  check_on_cuda(payloads, "payloads", op);
  const int64_t numel = out.numel();
  const c10::cuda::CUDAGuard guard(payloads.device());
  const cudaStream_t stream = current_stream();
  const at::Tensor pc = payloads.contiguous();
  const int64_t rows = pc.size(0);
  const cuda::SparsePayloads p{pc.data_ptr<uint8_t>(), rows, pc.size(1), k, numel,
                               float_type(value_dtype)};
  const int64_t tiles = cuda::sparse_tiles(numel);
  at::Tensor start = at::empty({rows * (tiles + 1)}, pc.options().dtype(at::kInt));
  at::Tensor bad;
  if (check) bad = at::full({std::max<int64_t>(rows, 1)}, INT_MAX, pc.options().dtype(at::kInt));
  C10_CUDA_CHECK(cuda::launch_sparse_index(p, check ? bad.data_ptr<int32_t>() : nullptr,
                                           start.data_ptr<int32_t>(), stream));
  if (check) {
    const at::Tensor bad_host = bad.cpu();  // synchronizes: a bad row raises before scattering
    const int32_t* bh = bad_host.data_ptr<int32_t>();
    for (int64_t r = 0; r < rows; ++r) {
      if (bh[r] == INT_MAX) continue;
      const int64_t j = bh[r];
      const int32_t idx = pc[r].narrow(0, 4 * j, 4).cpu().view(at::kInt).item<int32_t>();
      TORCH_CHECK(false, op, ": payloads row ", r, " holds index ", idx, " at position ", j,
                  ": indices must be strictly increasing and in [0, numel=", numel, ")");
    }
  }
  C10_CUDA_CHECK(cuda::launch_sparse_accumulate(p, start.data_ptr<int32_t>(), divisor,
                                                out.data_ptr(), float_type(out.scalar_type()),
                                                stream));
}

void randk_compress_into_cuda(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                              const at::Tensor& values, int64_t seed, int64_t step, int64_t bucket,
                              int64_t start, int64_t end) {
  end = check_randk_compress(x, residual, values, start, end);
  check_on_cuda(x, "x", "randk_compress");
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous();
  at::Tensor flag = at::empty({1}, x.options().dtype(at::kInt));
  C10_CUDA_CHECK(cuda::launch_randk_compress(
      xc.data_ptr(), float_type(x.scalar_type()), residual ? residual->data_ptr<float>() : nullptr,
      x.numel(), values.numel(), start, end,
      randk_key((uint64_t)seed, (uint64_t)step, (uint64_t)bucket), values.data_ptr<float>(),
      flag.data_ptr<int32_t>(), current_stream()));
}

void randk_decompress_into_cuda(const at::Tensor& values, const at::Tensor& out, int64_t seed,
                                int64_t step, int64_t bucket, int64_t divisor, int64_t start,
                                int64_t end) {
  end = check_randk_decompress(values, out, divisor, start, end);
  check_on_cuda(values, "values", "randk_decompress");
  const int64_t k = values.numel(), numel = out.numel();
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor vf = values.to(at::kFloat).contiguous();
  C10_CUDA_CHECK(cuda::launch_randk_decompress(
      vf.data_ptr<float>(), numel, k, start, end,
      randk_key((uint64_t)seed, (uint64_t)step, (uint64_t)bucket), divisor, out.data_ptr(),
      float_type(out.scalar_type()), current_stream()));
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpcomm, CUDA, m) {
  m.impl("topk_compress_into", &topk_compress_into_cuda);
  m.impl("sparse_accumulate_into", &sparse_accumulate_into_cuda);
  m.impl("randk_compress_into", &randk_compress_into_cuda);
  m.impl("randk_decompress_into", &randk_decompress_into_cuda);
}

}  // namespace ddpcomm
