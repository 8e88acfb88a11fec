// Runtime CPU dispatch for the vector-heavy op families: quantize, top-k, random-k.
//
// A portable build (setup.py's default on x86-64) compiles each of those files twice: as
// itself for the baseline (x86-64: SSE2) into namespace ddpcomm::baseline, and through
// csrc/cpu/avx2/<family>.cpp for x86-64-v3 (AVX2, FMA, BMI2, F16C) into ddpcomm::avx2.
// dispatch.cpp registers one of the two sets with the dispatcher when the library loads: avx2
// where the CPU has x86-64-v3, baseline on an older CPU or with DDPCOMM_CPU_DISPATCH=baseline
// (and fast_bmi2() below for the one place pdep and pext pay).
// Both give the same bits: no -ffast-math, no FMA contraction (-ffp-contract=off), and gcc
// keeps the order of float reductions without -ffast-math, whatever the vector width.
//
// The x86-64-v3 code comes from a `#pragma GCC target` placed after every #include, not
// from -march on the command line: code from headers (ATen, the standard library) stays
// baseline, so where both objects emit an inline function the linker can keep only a
// baseline copy, never an AVX2 one that baseline code would then call (an illegal
// instruction on an older CPU). Header code inlined into the kernels is compiled for
// x86-64-v3 with them. Nothing in a variant may run at load (a constructor of a global):
// only the kernels dispatch.cpp registers run there. A build with DDPCOMM_CPU_ARCH set
// compiles each file once, with that -march, as ddpcomm::baseline, and dispatches nothing.

#pragma once

#include <torch/library.h>

// The namespace of the variant being compiled (csrc/cpu/avx2/*.cpp define DDPCOMM_ISA_AVX2).
#if defined(DDPCOMM_ISA_AVX2)
#define DDPCOMM_ISA avx2
#else
#define DDPCOMM_ISA baseline
#endif

// Whether the code being compiled may use AVX2 intrinsics (topk.cpp's compaction). In C++,
// gcc does not define __AVX2__ under `#pragma GCC target`, hence the second name.
#if defined(DDPCOMM_ISA_AVX2) || defined(__AVX2__)
#define DDPCOMM_HAVE_AVX2 1
#else
#define DDPCOMM_HAVE_AVX2 0
#endif

namespace ddpcomm {

// Whether the x86-64-v3 kernels may use BMI2's pdep and pext: false where the CPU runs them
// as microcode (AMD before Zen 3) or DDPCOMM_CPU_DISPATCH=slow-bmi2 says so. Fixed at load.
bool fast_bmi2();

// Each family's m.impl calls, in each compiled variant.
namespace baseline {
void register_quantize(torch::Library& m);
void register_topk(torch::Library& m);
void register_randk(torch::Library& m);
}  // namespace baseline
namespace avx2 {
void register_quantize(torch::Library& m);
void register_topk(torch::Library& m);
void register_randk(torch::Library& m);
}  // namespace avx2

}  // namespace ddpcomm
