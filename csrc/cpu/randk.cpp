// CPU implementations of the random-k ops: randk_compress_into, randk_decompress_into.
// Indices come from csrc/numerics.h (randk_key / randk_index: one index per stratum, so
// they are distinct, ascending and the same on every rank); ddpcomm/reference.py states
// the semantics. The strata are contiguous ranges of the bucket, so a parallel task owns a
// contiguous slice and the error-feedback add fuses with the gather in one pass, and a call
// over strata [start, end) touches only their slice of the bucket: the collectives compress
// piece i + 1 while piece i is on the wire and piece i - 1 is decoded.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>

#include "../checks.h"
#include "../numerics.h"
#include "dispatch.h"

// Everything below, not the headers above, is compiled for x86-64-v3 in the AVX2 variant
// (avx2/randk.cpp; see dispatch.h).
#if defined(DDPCOMM_ISA_AVX2)
#pragma GCC target("arch=x86-64-v3")
#endif

namespace ddpcomm::DDPCOMM_ISA {
namespace {

// About 64K elements of bucket (256 KB of fp32, in L2) per chunk of strata.
constexpr int64_t kChunkElements = 1 << 16;

// Strata per chunk.
int64_t strata_grain(int64_t n, int64_t k) { return std::max<int64_t>(1, k * kChunkElements / n); }

// fn(c0, c1) over [j0, j1) in chunks of at most `grain` strata, in order. at::parallel_for
// hands each thread its whole share in one call (a 64 MiB bucket at once on one thread), and
// a chunk's picks must find the elements its pass has just read still in cache: a pass over
// the whole share first left them in memory. randk_compress at 64 MiB, 1%, builds in turn:
// one thread 6.8-9.5 ms -> 5.3-5.9 with error feedback, 4.1-6.0 -> 2.7-3.2 without (reading
// the bucket once takes 2.2-2.8); two threads 4.6-5.2 -> 3.4-3.7 and 2.4-2.8 -> 1.7-1.8.
template <class Fn>
void in_chunks(int64_t j0, int64_t j1, int64_t grain, Fn&& fn) {
  for (int64_t c = j0; c < j1; c += grain) fn(c, std::min(j1, c + grain));
}

void randk_compress_into_cpu(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                             const at::Tensor& values, int64_t seed, int64_t step, int64_t bucket,
                             int64_t start, int64_t end) {
  end = check_randk_compress(x, residual, values, start, end);
  const int64_t n = x.numel(), k = values.numel();
  const at::Tensor xc = x.contiguous();
  float* res = residual ? residual->data_ptr<float>() : nullptr;
  float* vp = values.data_ptr<float>();
  const uint64_t key = randk_key((uint64_t)seed, (uint64_t)step, (uint64_t)bucket);
  // A non-finite entry is usually not among the k sent, so it is looked for over the whole
  // range (in the same pass as the EF add): the range's values then all become NaN, which
  // makes the reduced result non-finite on every rank (GradScaler skips the step).
  std::atomic<bool> all_finite{true};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "randk_compress", [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    const int64_t grain = strata_grain(n, k);
    at::parallel_for(start, end, grain, [&](int64_t j0, int64_t j1) {
      uint32_t bad = 0;  // non-zero once an entry is Inf or NaN
      in_chunks(j0, j1, grain, [&](int64_t c0, int64_t c1) {
        // A chunk's strata are one contiguous range of the bucket: the EF add and the
        // finiteness test run over it as one flat loop (which vectorizes; per stratum, ~100
        // elements with bounds computed per stratum, it did not), then the picks.
        const int64_t lo = c0 * n / k, hi = c1 * n / k;
        if (res == nullptr) {
          for (int64_t t = lo; t < hi; ++t) bad |= non_finite(static_cast<float>(xp[t]));
          for (int64_t j = c0; j < c1; ++j) {
            vp[j] = static_cast<float>(xp[randk_index(key, j, n, k)]);
          }
          return;
        }
        // Error feedback: e = x + r everywhere; the chosen entry is sent (r = 0 there),
        // every other entry keeps e for the next step.
        for (int64_t t = lo; t < hi; ++t) {
          const float e = canonical(static_cast<float>(xp[t]) + res[t]);
          res[t] = e;
          bad |= non_finite(e);
        }
        for (int64_t j = c0; j < c1; ++j) {
          const int64_t i = randk_index(key, j, n, k);
          vp[j] = res[i];
          res[i] = 0.0f;
        }
      });
      if (bad) all_finite.store(false, std::memory_order_relaxed);
    });
  });
  if (!all_finite.load()) values.narrow(0, start, end - start).fill_(canonical_nan());
}

void randk_decompress_into_cpu(const at::Tensor& values, const at::Tensor& out, int64_t seed,
                               int64_t step, int64_t bucket, int64_t divisor, int64_t start,
                               int64_t end) {
  end = check_randk_decompress(values, out, divisor, start, end);
  const int64_t k = values.numel(), numel = out.numel();
  // Only the range's values are read (converted, for 16-bit values, once per range).
  const at::Tensor vf = values.narrow(0, start, end - start).to(at::kFloat).contiguous();
  const float* vp = vf.data_ptr<float>();  // vp[j - start] is value j
  const float div = (float)divisor;
  const uint64_t key = randk_key((uint64_t)seed, (uint64_t)step, (uint64_t)bucket);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, out.scalar_type(), "randk_decompress", [&] {
        scalar_t* o = out.data_ptr<scalar_t>();
        // A thread's strata are one contiguous range of `out`: zeroed in one fill (a memset),
        // then the picks. Not in chunks as randk_compress is: at 64 MiB, 1%, one thread, a
        // fill per stratum of ~100 elements took 2.6-3.0 ms, one per 256 KB chunk 2.9-3.1,
        // one per thread 2.1-2.2 (on two threads 1.1-1.5 all); likely because glibc's
        // memset writes a fill this large past the caches, reading no line it writes.
        at::parallel_for(start, end, strata_grain(numel, k), [&](int64_t j0, int64_t j1) {
          std::fill(o + j0 * numel / k, o + j1 * numel / k, static_cast<scalar_t>(0.0f));
          for (int64_t j = j0; j < j1; ++j) {
            o[randk_index(key, j, numel, k)] =
                static_cast<scalar_t>(canonical(vp[j - start] / div));
          }
        });
      });
}

}  // namespace

void register_randk(torch::Library& m) {
  m.impl("randk_compress_into", &randk_compress_into_cpu);
  m.impl("randk_decompress_into", &randk_decompress_into_cpu);
}

}  // namespace ddpcomm::DDPCOMM_ISA
