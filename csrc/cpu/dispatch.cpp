// Picks, when the library loads, which compiled variant of the quantize, top-k and random-k
// CPU kernels the dispatcher runs (dispatch.h), and says which and why for
// ddpcomm.build_info().
//
// DDPCOMM_CPU_DISPATCH, read once at load: unset or "auto" takes x86-64-v3 where the CPU has
// it; "baseline" forces the x86-64 kernels (to test them on a new CPU: the op tests must give
// the same bits); "slow-bmi2" takes x86-64-v3 as on a CPU whose pdep and pext are microcode
// (to test that path). Any other value is reported on stderr and treated as unset.

#include "dispatch.h"

#include <torch/library.h>
#include <torch/version.h>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace ddpcomm {
namespace {

struct Choice {
  bool avx2;        // register ddpcomm::avx2's kernels
  bool bmi2;        // and let them use pdep and pext (fast_bmi2)
  const char* isa;  // what they were compiled for
  const char* why;
};

#if defined(__x86_64__)
// Whether pdep and pext run as microcode: on AMD cores before family 19h (Zen 3), Hygon's
// included, up to hundreds of cycles an instruction, more with more mask bits set, against 3
// on Zen 3 and on Intel since Haswell (Agner Fog's instruction tables).
bool microcoded_bmi2() {
  unsigned a, b, c, d;
  if (__get_cpuid(0, &a, &b, &c, &d) == 0) return false;
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  if (std::strcmp(vendor, "AuthenticAMD") != 0 && std::strcmp(vendor, "HygonGenuine") != 0) {
    return false;
  }
  if (__get_cpuid(1, &a, &b, &c, &d) == 0) return true;
  unsigned family = (a >> 8) & 0xFu;
  if (family == 0xFu) family += (a >> 20) & 0xFFu;
  return family < 0x19u;
}
#else
bool microcoded_bmi2() { return false; }
#endif

Choice choose() {
#if DDPCOMM_CPU_DISPATCH
  const char* env = std::getenv("DDPCOMM_CPU_DISPATCH");
  const auto is = [&](const char* v) { return env != nullptr && std::strcmp(env, v) == 0; };
  if (env != nullptr && env[0] != '\0' && !is("auto") && !is("baseline") && !is("slow-bmi2")) {
    std::fprintf(stderr,
                 "ddpcomm: DDPCOMM_CPU_DISPATCH=%s is not one of auto, baseline, slow-bmi2; "
                 "using auto\n",
                 env);
  }
  if (is("baseline")) return {false, false, "x86-64", "DDPCOMM_CPU_DISPATCH=baseline"};
  // Needed before a static constructor's first __builtin_cpu_supports (gcc's manual).
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("x86-64-v3")) {
    return {false, false, "x86-64", "the CPU lacks x86-64-v3 (AVX2, FMA, BMI2)"};
  }
  if (is("slow-bmi2")) return {true, false, "x86-64-v3", "DDPCOMM_CPU_DISPATCH=slow-bmi2"};
  if (microcoded_bmi2()) {
    return {true, false, "x86-64-v3", "the CPU has AVX2; its pdep and pext are microcode"};
  }
  return {true, true, "x86-64-v3", "the CPU has AVX2"};
#else
  return {false, !microcoded_bmi2(), "as built",
          "no runtime dispatch: one build, for DDPCOMM_CPU_ARCH or not x86-64"};
#endif
}

const Choice& choice() {
  static const Choice c = choose();
  return c;
}

}  // namespace

bool fast_bmi2() { return choice().bmi2; }

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
