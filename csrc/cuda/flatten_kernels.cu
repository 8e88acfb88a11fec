// CUDA kernel of the multi-tensor flatten family (flatten, flatten_into, unflatten_into):
// one launch copies a whole list of tensors to or from their flat buffer.
//
// Launch geometry and why
// -----------------------
// The tensor list travels in the kernel's arguments, apex-style: the flat byte offset and
// the address of every entry (MultiCopyArgs, up to kMaxEntries entries per launch; CUDA
// 12.1+ allows 32 KB of kernel parameters on sm_70+, older toolkits 4 KB). The work is cut
// by bytes of the flat buffer, not by tensors: CTA c copies flat bytes [c, c + 1) * 32 KB,
// i.e. the pieces of every entry overlapping that range, so one 256 MB tensor and a
// thousand 4 KB ones keep every SM equally busy and no CTA idles on a tiny tensor. A CTA
// finds its first entry by a binary search over the offsets; every thread of the CTA reads
// the same argument words (uniform constant-bank loads). Each piece is copied by the whole
// CTA in the widest word both addresses allow (16, 8, 4, 2 or 1 bytes), with byte-wise
// head and tail, so fp16 tensors of odd length (2-byte aligned pieces) still move in wide
// words when their flat and tensor addresses agree modulo 16.
//
// Entries whose bytes are not one run (strided views) are passed with a null address and
// skipped here; the binding copies them with ATen's strided copy.

#include <cuda_runtime.h>
#include <stdint.h>

#include "launchers.h"

namespace ddpcomm {
namespace cuda {
namespace {

constexpr int kCopyThreads = 256;
constexpr int64_t kCtaBytes = 32 * 1024;

#if CUDART_VERSION >= 12010
constexpr int kMaxEntries = 1800;  // 28.8 KB of arguments, under the 32764-byte limit
#else
constexpr int kMaxEntries = 240;  // 3.9 KB, under the classic 4 KB limit
#endif

struct MultiCopyArgs {
  uint8_t* flat;
  int64_t begin;  // flat bytes [begin, end) this launch covers
  int64_t end;
  int count;                         // entries in this launch
  int64_t offsets[kMaxEntries + 1];  // flat byte offset of entry i; offsets[count] == end
  uint8_t* ptrs[kMaxEntries];        // entry i's bytes, or nullptr to skip it
};

// The whole CTA copies len bytes; dst and src are congruent modulo sizeof(W).
template <typename W>
__device__ __forceinline__ void cta_copy_words(uint8_t* dst, const uint8_t* src, int64_t len) {
  constexpr int64_t kW = sizeof(W);
  const int64_t mis = (int64_t)(reinterpret_cast<uintptr_t>(dst) % kW);
  const int64_t head = mis == 0 ? 0 : (kW - mis < len ? kW - mis : len);
  for (int64_t t = threadIdx.x; t < head; t += kCopyThreads) dst[t] = src[t];
  const int64_t words = (len - head) / kW;
  W* dw = reinterpret_cast<W*>(dst + head);
  const W* sw = reinterpret_cast<const W*>(src + head);
#pragma unroll 4
  for (int64_t t = threadIdx.x; t < words; t += kCopyThreads) dw[t] = sw[t];
  for (int64_t t = head + words * kW + threadIdx.x; t < len; t += kCopyThreads) dst[t] = src[t];
}

__device__ __forceinline__ void cta_copy(uint8_t* dst, const uint8_t* src, int64_t len) {
  const uintptr_t x = reinterpret_cast<uintptr_t>(dst) ^ reinterpret_cast<uintptr_t>(src);
  if ((x & 15) == 0) {
    cta_copy_words<uint4>(dst, src, len);
  } else if ((x & 7) == 0) {
    cta_copy_words<uint2>(dst, src, len);
  } else if ((x & 3) == 0) {
    cta_copy_words<uint32_t>(dst, src, len);
  } else if ((x & 1) == 0) {
    cta_copy_words<uint16_t>(dst, src, len);
  } else {
    cta_copy_words<uint8_t>(dst, src, len);
  }
}

template <bool kToFlat>
__global__ void __launch_bounds__(kCopyThreads) multi_copy_kernel(const MultiCopyArgs a) {
  const int64_t b0 = a.begin + (int64_t)blockIdx.x * kCtaBytes;
  const int64_t b1 = b0 + kCtaBytes < a.end ? b0 + kCtaBytes : a.end;
  // The last entry starting at or before b0 (offsets[0] == begin <= b0).
  int lo = 0, hi = a.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (a.offsets[mid] <= b0) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  for (int i = lo; i < a.count && a.offsets[i] < b1; ++i) {
    uint8_t* p = a.ptrs[i];
    const int64_t off = a.offsets[i];
    const int64_t s = b0 > off ? b0 : off;
    const int64_t e = b1 < a.offsets[i + 1] ? b1 : a.offsets[i + 1];
    if (p == nullptr || e <= s) continue;
    if (kToFlat) {
      cta_copy(a.flat + s, p + (s - off), e - s);
    } else {
      cta_copy(p + (s - off), a.flat + s, e - s);
    }
  }
}

}  // namespace

cudaError_t launch_multi_tensor_copy(uint8_t* flat, int64_t count, void* const* ptrs,
                                     const int64_t* offsets, bool to_flat, cudaStream_t stream) {
  if (count < 0) return cudaErrorInvalidValue;
  for (int64_t i = 0; i < count; ++i) {
    if (offsets[i + 1] < offsets[i]) return cudaErrorInvalidValue;
  }
  // One launch per kMaxEntries entries: a single launch for any realistic DDP bucket.
  for (int64_t first = 0; first < count; first += kMaxEntries) {
    const int c = (int)(count - first < kMaxEntries ? count - first : kMaxEntries);
    MultiCopyArgs a;
    a.flat = flat;
    a.begin = offsets[first];
    a.end = offsets[first + c];
    a.count = c;
    for (int i = 0; i <= c; ++i) a.offsets[i] = offsets[first + i];
    for (int i = 0; i < c; ++i) a.ptrs[i] = static_cast<uint8_t*>(ptrs[first + i]);
    if (a.end == a.begin) continue;
    const int64_t ctas = (a.end - a.begin + kCtaBytes - 1) / kCtaBytes;
    if (ctas > 0x7fffffffLL) return cudaErrorInvalidValue;
    if (to_flat) {
      multi_copy_kernel<true><<<(unsigned)ctas, kCopyThreads, 0, stream>>>(a);
    } else {
      multi_copy_kernel<false><<<(unsigned)ctas, kCopyThreads, 0, stream>>>(a);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace ddpcomm
