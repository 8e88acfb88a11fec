// Picks, when the library loads, which compiled variant of the quantize, top-k and random-k
// CPU kernels the dispatcher runs (dispatch.h), and says which and why for
// ddpcomm.build_info().
//
// DDPCOMM_CPU_DISPATCH, read once at load: unset or "auto" takes x86-64-v3 where the CPU has
// it; "baseline" forces the x86-64 kernels (to test them on a new CPU: the op tests must give
// the same bits). Any other value is reported on stderr and treated as unset.

#include "dispatch.h"

#include <torch/library.h>
#include <torch/version.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ddpcomm {
namespace {

struct Choice {
  bool avx2;        // register ddpcomm::avx2's kernels
  const char* isa;  // what they were compiled for
  const char* why;
};

Choice choose() {
#if DDPCOMM_CPU_DISPATCH
  const char* env = std::getenv("DDPCOMM_CPU_DISPATCH");
  const bool forced = env != nullptr && std::strcmp(env, "baseline") == 0;
  if (env != nullptr && !forced && env[0] != '\0' && std::strcmp(env, "auto") != 0) {
    std::fprintf(stderr,
                 "ddpcomm: DDPCOMM_CPU_DISPATCH=%s is not one of auto, baseline; "
                 "using auto\n",
                 env);
  }
  if (forced) return {false, "x86-64", "DDPCOMM_CPU_DISPATCH=baseline"};
  // Needed before a static constructor's first __builtin_cpu_supports (gcc's manual).
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v3")) return {true, "x86-64-v3", "the CPU has AVX2"};
  return {false, "x86-64", "the CPU lacks x86-64-v3 (AVX2, FMA, BMI2)"};
#else
  return {false, "as built", "no runtime dispatch: one build, for DDPCOMM_CPU_ARCH or not x86-64"};
#endif
}

const Choice& choice() {
  static const Choice c = choose();
  return c;
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpcomm, CPU, m) {
#if DDPCOMM_CPU_DISPATCH
  if (choice().avx2) {
    avx2::register_quantize(m);
    avx2::register_topk(m);
    avx2::register_randk(m);
    return;
  }
#endif
  baseline::register_quantize(m);
  baseline::register_topk(m);
  baseline::register_randk(m);
}

}  // namespace ddpcomm

// For ddpcomm.build_info() (ddpcomm/ops.py reads them with ctypes).
extern "C" {
__attribute__((visibility("default"))) const char* ddpcomm_cpu_kernels() {
  return ddpcomm::choice().isa;
}
__attribute__((visibility("default"))) const char* ddpcomm_cpu_dispatch() {
  return ddpcomm::choice().why;
}
__attribute__((visibility("default"))) const char* ddpcomm_torch_built() { return TORCH_VERSION; }
}
