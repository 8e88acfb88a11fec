// CPU implementations of the multi-tensor flatten ops: flatten, flatten_into, unflatten_into.
//
// The work is split over bytes, not tensors: the flat buffer is cut into equal ranges (at
// cache-line granularity, so two threads never write the same line) and each worker copies
// the pieces of every tensor overlapping its range. One 64 MB tensor and a thousand 64 KB
// ones therefore keep every thread equally busy. Entries that are not one run of bytes
// (strided views, conjugate views) are copied afterwards by ATen's strided copy.

#include "../flatten.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace ddpcomm {
namespace {

constexpr int64_t kLine = 64;
// Below this many bytes a copy is faster than waking another thread.
constexpr int64_t kGrainBytes = 256 * 1024;

// Asks the kernel to back the 2 MiB-aligned interior of a freshly allocated, not yet
// touched buffer with transparent huge pages. A fresh 64 MB buffer otherwise costs 16k
// page faults, which take longer than the copy itself (measured 60 ms vs 16 ms to first-
// touch 64 MB); torch does the same for every allocation under THP_MEM_ALLOC_ENABLE=1.
// Purely a hint: where THP is off or unsupported madvise fails and nothing changes.
void advise_huge_pages(void* ptr, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t lo = (p + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (p + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (hi >= lo + 2 * kHuge) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)ptr;
  (void)bytes;
#endif
}

enum class Direction { ToFlat, FromFlat };

// Copies the byte-copyable entries between `flat` and the list, in parallel over bytes.
void copy_dense(uint8_t* flat, at::TensorList tensors, const std::vector<int64_t>& off,
                Direction dir) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  std::vector<uint8_t*> ptr(n, nullptr);
  for (int64_t i = 0; i < n; ++i) {
    if (tensors[i].numel() > 0 && is_byte_copyable(tensors[i])) {
      ptr[i] = static_cast<uint8_t*>(tensors[i].data_ptr());
    }
  }
  const int64_t total = off[n];
  const int64_t lines = (total + kLine - 1) / kLine;
  at::parallel_for(0, lines, kGrainBytes / kLine, [&](int64_t l0, int64_t l1) {
    const int64_t b0 = l0 * kLine, b1 = std::min(total, l1 * kLine);
    // The last entry starting at or before b0; empty entries before it are skipped.
    int64_t i = std::upper_bound(off.begin(), off.end(), b0) - off.begin() - 1;
    for (; i < n && off[i] < b1; ++i) {
      const int64_t lo = std::max(b0, off[i]), hi = std::min(b1, off[i + 1]);
      if (ptr[i] == nullptr || hi <= lo) continue;
      uint8_t* t = ptr[i] + (lo - off[i]);
      if (dir == Direction::ToFlat) {
        std::memcpy(flat + lo, t, hi - lo);
      } else {
        std::memcpy(t, flat + lo, hi - lo);
      }
    }
  });
}

// The entries copy_dense skipped, one strided ATen copy each, in list order.
void copy_strided(const at::Tensor& flat, at::TensorList tensors, const std::vector<int64_t>& off,
                  Direction dir) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0 || is_byte_copyable(t)) continue;
    const int64_t start = off[i] / static_cast<int64_t>(t.element_size());
    at::Tensor piece = flat.narrow(0, start, t.numel()).view(t.sizes());
    if (dir == Direction::ToFlat) {
      piece.copy_(t);
    } else {
      t.copy_(piece);
    }
  }
}

void flatten_into_impl(at::TensorList tensors, const at::Tensor& out) {
  const std::vector<int64_t> off = byte_offsets(tensors);
  copy_dense(static_cast<uint8_t*>(out.data_ptr()), tensors, off, Direction::ToFlat);
  copy_strided(out, tensors, off, Direction::ToFlat);
}

at::Tensor flatten_cpu(at::TensorList tensors) {
  TORCH_CHECK_VALUE(!tensors.empty(), "flatten: tensors must not be empty (the result takes its ",
                    "dtype and device from them); use flatten_into to fill a given buffer");
  check_flatten_list(tensors, tensors[0].scalar_type(), tensors[0].device(), "tensors[0]",
                     "flatten");
  at::Tensor out = at::empty({total_numel(tensors)}, tensors[0].options());
  advise_huge_pages(out.data_ptr(), out.nbytes());
  flatten_into_impl(tensors, out);
  return out;
}

void flatten_into_cpu(at::TensorList tensors, const at::Tensor& out) {
  check_flatten_list(tensors, out.scalar_type(), out.device(), "out", "flatten_into");
  check_flat_buffer(out, total_numel(tensors), "out", "flatten_into");
  check_flat_disjoint(out, tensors, "out", "flatten_into");
  flatten_into_impl(tensors, out);
}

void unflatten_into_cpu(const at::Tensor& flat, at::TensorList tensors) {
  check_flatten_list(tensors, flat.scalar_type(), flat.device(), "flat", "unflatten_into");
  check_flat_buffer(flat, total_numel(tensors), "flat", "unflatten_into");
  check_flat_disjoint(flat, tensors, "flat", "unflatten_into");
  check_destinations(tensors, "unflatten_into");
  const std::vector<int64_t> off = byte_offsets(tensors);
  copy_dense(static_cast<uint8_t*>(flat.data_ptr()), tensors, off, Direction::FromFlat);
  copy_strided(flat, tensors, off, Direction::FromFlat);
}

}  // namespace

TORCH_LIBRARY_IMPL(ddpcomm, CPU, m) {
  m.impl("flatten", &flatten_cpu);
  m.impl("flatten_into", &flatten_into_cpu);
  m.impl("unflatten_into", &unflatten_into_cpu);
}

}  // namespace ddpcomm
