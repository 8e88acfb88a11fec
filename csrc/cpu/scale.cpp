// CPU implementation of scale_into: a bucket divided by its per-element scale, with the
// local average of its squares updated on the way, in one pass over the elements
// (ddpcomm/normalize.py; as three torch ops it took three passes, ~18 ms a 64 MB bucket on
// one thread). The arithmetic is reference.scale_into's, rounding for rounding: the average
// is fma((1 - beta) * x, x, average * beta), as torch's addcmul_ forms it on CPUs with FMA,
// then x / scale.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>

#include "../checks.h"
#include "dispatch.h"

// Everything below, not the headers above, is compiled for x86-64-v3 in the AVX2 variant
// (avx2/scale.cpp; see dispatch.h): there std::fma is one instruction and the loop
// vectorizes; the baseline calls libm's fma, with the same bits.
#if defined(DDPCOMM_ISA_AVX2)
#pragma GCC target("arch=x86-64-v3")
#endif

namespace ddpcomm::DDPCOMM_ISA {
namespace {

void scale_into_cpu(const at::Tensor& x, const std::optional<at::Tensor>& average,
                    const at::Tensor& scale, double beta) {
  check_scale_into(x, average, scale, beta);
  if (x.scalar_type() != at::kFloat) return scale_into_aten(x, average, scale, beta);
  float* xp = x.data_ptr<float>();
  float* ap = average ? average->data_ptr<float>() : nullptr;
  const float* sp = scale.data_ptr<float>();
  const float keep = (float)beta, take = (float)(1.0 - beta);
  at::parallel_for(0, x.numel(), 1 << 16, [&](int64_t i0, int64_t i1) {
    if (ap != nullptr) {
      for (int64_t i = i0; i < i1; ++i) {
        const float v = xp[i];
        ap[i] = std::fma(take * v, v, ap[i] * keep);
        xp[i] = v / sp[i];
      }
    } else {
      for (int64_t i = i0; i < i1; ++i) xp[i] = xp[i] / sp[i];
    }
  });
}

}  // namespace

void register_scale(torch::Library& m) { m.impl("scale_into", &scale_into_cpu); }

}  // namespace ddpcomm::DDPCOMM_ISA
