// Host stand-in for the CUDA runtime and the device builtins that csrc/cuda's kernel files use,
// so that tests can run those kernels on a CPU (tests/cuda_emu/__init__.py builds them).
//
// The model: a launch runs its CTAs one after another. A CTA's threads are cooperative fibers
// (emu.cpp) in one OS thread, so a `__shared__` variable, made a function-local static, is
// shared by the CTA's threads; it is filled with random bytes before every CTA, as shared
// memory starts as garbage. A thread runs until it reaches a barrier: __syncthreads, or the
// warp-wide one inside each warp intrinsic. Between two barriers the threads run one at a
// time, in an order drawn anew, from a seeded generator, for every such segment.
//
// What it checks: the kernels' logic and arithmetic (the host's IEEE float arithmetic with
// contraction off, which is CUDA's with --fmad=false and its default precise division and
// square root); barrier discipline (all threads of the CTA reach the same __syncthreads, none
// exits while others wait, no deadlock); that every lane takes part in a warp intrinsic, with
// a full mask; launch dimensions; each kernel's static shared memory (48 KB at most); and, at
// compile time, its parameters (32764 bytes at most: CUDART_VERSION below is a 12.1+
// toolkit's, whose limit that is, so kernel files take the paths such a toolkit builds).
//
// What it cannot check: the hardware memory model (no caches, no reordering, every write seen
// at once); races other than those that the order of whole segments exposes (threads never
// interleave inside a segment, CTAs never overlap); timing; register and occupancy limits;
// out-of-bounds and misaligned accesses; math functions that are not exact on both sides
// (host libm is called). A builtin that is not defined here fails to compile: add it here,
// with its exact CUDA semantics.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

#define CUDART_VERSION 12080  // CUDA 12.8

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
using uint3 = dim3;

struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

using cudaStream_t = struct CUstream_st*;
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};

// The scheduler's side (emu.cpp).
namespace emu {
extern uint3 thread_idx, block_idx;
extern dim3 block_dim, grid_dim;
// Records `what` and fails the launch: it reports cudaErrorLaunchFailure, and no later launch
// runs until reset(). Called by a kernel's thread, it also ends that thread's CTA there.
void fail(const char* what);
void cta_barrier(const void* site);
void warp_barrier();
extern uint64_t warp_lanes[32][32];  // [warp][lane]: values a warp intrinsic exchanges
// Every thread calls this at each __shared__ declaration (the rewritten kernel source does).
void shared_declared(void* p, size_t bytes);
// False where the launch must not run (its error is then pending).
bool begin_launch(const void* kernel, dim3 grid, dim3 block, size_t dynamic_shared);
void run_grid(const std::function<void()>& cta);
cudaError_t take_error();
// The driver's side: before each call, a fresh error state and the schedule's seed; after it,
// what failed (empty if nothing did).
void reset(uint64_t seed);
const char* failure_message();
}  // namespace emu

#define threadIdx (::emu::thread_idx)
#define blockIdx (::emu::block_idx)
#define blockDim (::emu::block_dim)
#define gridDim (::emu::grid_dim)

inline cudaError_t cudaGetLastError() { return emu::take_error(); }

// The return address tells one __syncthreads call site from another.
__attribute__((noinline)) inline void __syncthreads() {
  emu::cta_barrier(__builtin_return_address(0));
}

// ---- bit casts and integer intrinsics ---------------------------------------------------
inline float __uint_as_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
inline float __int_as_float(int32_t i) { return __uint_as_float((uint32_t)i); }
inline int __popc(uint32_t v) { return __builtin_popcount(v); }
inline int __clz(uint32_t v) { return v ? __builtin_clz(v) : 32; }
inline uint32_t __brev(uint32_t v) {
  v = ((v >> 1) & 0x55555555u) | ((v & 0x55555555u) << 1);
  v = ((v >> 2) & 0x33333333u) | ((v & 0x33333333u) << 2);
  v = ((v >> 4) & 0x0F0F0F0Fu) | ((v & 0x0F0F0F0Fu) << 4);
  v = ((v >> 8) & 0x00FF00FFu) | ((v & 0x00FF00FFu) << 8);
  return (v >> 16) | (v << 16);
}

// CUDA's global min and max: integer ones of one type, float ones as fminf and fmaxf.
template <class T, class = std::enable_if_t<std::is_integral_v<T>>>
inline T max(T a, T b) {
  return a > b ? a : b;
}
template <class T, class = std::enable_if_t<std::is_integral_v<T>>>
inline T min(T a, T b) {
  return a < b ? a : b;
}
inline float max(float a, float b) { return fmaxf(a, b); }
inline float min(float a, float b) { return fminf(a, b); }

// ---- atomics: CTAs run one after another and a CTA's threads one at a time, so a plain
// read-modify-write is atomic, in shared and in global memory -----------------------------
template <class T>
inline T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}
template <class T>
inline T atomicOr(T* p, T v) {
  const T old = *p;
  *p = old | v;
  return old;
}
template <class T, class = std::enable_if_t<std::is_integral_v<T>>>
inline T atomicMin(T* p, T v) {
  const T old = *p;
  *p = v < old ? v : old;
  return old;
}

// Device memory is host memory here; the stream's order is the call order.
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t = nullptr) {
  memset(p, value, bytes);
  return cudaSuccess;
}

// ---- warp intrinsics: every lane of the warp takes part, with a full mask ---------------
namespace emu {
// Publishes the calling lane's `bits` to its warp, waits for all 32 lanes, and returns the
// warp's row of warp_lanes; the caller reads it, then calls warp_done().
inline const uint64_t* warp_exchange(unsigned mask, uint64_t bits, const char* what) {
  if (mask != 0xffffffffu) fail(what);
  if (block_dim.x % 32 != 0) fail("warp intrinsic in a CTA of a partial warp");
  const unsigned warp = thread_idx.x >> 5;
  warp_lanes[warp][thread_idx.x & 31] = bits;
  warp_barrier();
  return warp_lanes[warp];
}
// Every lane has read the exchange: the row may be written again.
inline void warp_done() { warp_barrier(); }

// Lane `src` of the calling warp's `v`, or the caller's own where src is out of [0, 32).
template <class T>
inline T shuffle(unsigned mask, T v, int src, int width) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "32- and 64-bit shuffles only");
  if (width != 32) fail("warp shuffle with a width other than 32");
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  const uint64_t* lanes = warp_exchange(mask, bits, "warp shuffle with a partial mask");
  const uint64_t got = src >= 0 && src < 32 ? lanes[src] : bits;
  warp_done();
  T r;
  memcpy(&r, &got, sizeof(T));
  return r;
}
}  // namespace emu

template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return emu::shuffle(mask, v, (int)(threadIdx.x & 31) - (int)delta, width);
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return emu::shuffle(mask, v, (int)(threadIdx.x & 31) ^ lane_mask, width);
}
// Bit l set where lane l's predicate is non-zero.
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  const uint64_t* lanes = emu::warp_exchange(mask, predicate != 0, "warp vote with a partial mask");
  unsigned r = 0;
  for (int l = 0; l < 32; ++l) r |= (unsigned)lanes[l] << l;
  emu::warp_done();
  return r;
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }

// ---- launches: the kernel source's `k<<<grid, block, smem, stream>>>(args)` is rewritten
// to `::emu::launch(k, grid, block, smem, stream)(args)` ----------------------------------
namespace emu {
constexpr size_t kMaxParamBytes = 32764;

// Bytes of a kernel's parameter buffer: each parameter at its alignment, in order.
template <class... P>
constexpr size_t param_bytes() {
  size_t n = 0;
  ((n = (n + alignof(P) - 1) / alignof(P) * alignof(P) + sizeof(P)), ...);
  return n;
}

template <class... P>
struct Launch {
  void (*kernel)(P...);
  dim3 grid, block;
  size_t dynamic_shared;
  template <class... A>
  void operator()(A&&... args) const {
    static_assert(param_bytes<std::decay_t<P>...>() <= kMaxParamBytes,
                  "the kernel's parameters exceed 32764 bytes (nvcc refuses them)");
    if (!begin_launch((const void*)kernel, grid, block, dynamic_shared)) return;
    // Each thread's call copies the parameters, as each CUDA thread has its own.
    const std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
    run_grid([&] { std::apply(kernel, params); });
  }
};
template <class... P>
Launch<P...> launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t dynamic_shared = 0,
                    cudaStream_t = nullptr) {
  return Launch<P...>{kernel, grid, block, dynamic_shared};
}
}  // namespace emu
