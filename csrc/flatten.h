// Host-side planning shared by the CPU and CUDA bindings of the multi-tensor flatten ops
// (flatten, flatten_into, unflatten_into): argument checks and the byte-offset table.
//
// Semantics (ddpcomm/reference.py states them in torch): the flat buffer is the
// concatenation, in list order, of every tensor's elements in row-major (logical) order,
// exactly as torch._utils._flatten_dense_tensors lays it out. One call handles one dtype
// and one device. Any strided tensor is accepted: contiguous ones take the fast byte-copy
// path, the others (views with gaps, expanded, transposed, conjugate) a strided copy.
//
// Errors follow Python's conventions so the fake implementations can match them: a wrong
// type (dtype, layout) raises TypeError, a wrong value (size, device, overlap) ValueError.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <utility>
#include <vector>

namespace ddpcomm {

// A tensor the kernels may treat as one run of numel * itemsize bytes at data_ptr().
// Conjugate / negative views are contiguous but their bytes are not their values. (Called
// through the dispatcher, torch's conjugate and negative fallbacks already resolve such
// inputs and refuse such destinations; direct C++ callers get the strided path.)
inline bool is_byte_copyable(const at::Tensor& t) {
  return t.is_contiguous() && !t.is_conj() && !t.is_neg();
}

// Checks every list entry against the reference dtype and device (those of tensors[0] for
// flatten, of out / flat otherwise); `ref` names where they come from in messages.
inline void check_flatten_list(at::TensorList tensors, at::ScalarType dtype,
                               const at::Device& device, const char* ref, const char* op) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_TYPE(t.layout() == at::kStrided, op, ": tensors[", i,
                     "] must be a strided (dense) tensor, got layout ", t.layout());
    TORCH_CHECK_TYPE(t.scalar_type() == dtype, op, ": tensors[", i, "] has dtype ", t.scalar_type(),
                     " but ", ref, " has ", dtype,
                     "; one call handles one dtype (group the tensors by dtype)");
    TORCH_CHECK_VALUE(t.device() == device, op, ": tensors[", i, "] is on ", t.device(), " but ",
                      ref, " is on ", device, "; one call handles one device");
  }
}

// The flat buffer (`out` of flatten_into, `flat` of unflatten_into): 1-D, contiguous, and
// exactly as long as the list.
inline void check_flat_buffer(const at::Tensor& flat, int64_t total, const char* arg,
                              const char* op) {
  TORCH_CHECK_TYPE(flat.layout() == at::kStrided, op, ": ", arg,
                   " must be a strided tensor, got layout ", flat.layout());
  TORCH_CHECK_VALUE(flat.dim() == 1, op, ": ", arg, " must be 1-D, got ", flat.dim(),
                    " dimensions");
  TORCH_CHECK_VALUE(flat.is_contiguous(), op, ": ", arg, " must be contiguous");
  TORCH_CHECK_VALUE(flat.numel() == total, op, ": ", arg, " must have ", total,
                    " elements (the tensors' total), got ", flat.numel());
}

// Bytes [lo, hi) that t's elements can occupy (strides are never negative in torch).
inline std::pair<uintptr_t, uintptr_t> byte_span(const at::Tensor& t) {
  const auto lo = reinterpret_cast<uintptr_t>(t.data_ptr());
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
  return {lo, lo + static_cast<uintptr_t>((last + 1) * t.element_size())};
}

// The flat buffer must not share memory with any list entry: the kernels copy in parallel,
// so an overlap would make the result depend on thread timing.
inline void check_flat_disjoint(const at::Tensor& flat, at::TensorList tensors, const char* arg,
                                const char* op) {
  if (flat.numel() == 0) return;
  const auto f = byte_span(flat);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel() == 0) continue;
    const auto s = byte_span(tensors[i]);
    TORCH_CHECK_VALUE(s.second <= f.first || f.second <= s.first, op, ": tensors[", i,
                      "] shares memory with ", arg);
  }
}

// Destinations of unflatten_into must be writable element by element: no entry may map two
// elements to one address (expanded views), and no two dense entries may overlap. Strided
// entries with gaps are not cross-checked against each other (interleaved views such as the
// columns of one matrix are legitimate and deciding exact overlap is costly); writing the
// same element through two such entries leaves either value, unspecified which.
inline void check_destinations(at::TensorList tensors, const char* op) {
  std::vector<std::pair<std::pair<uintptr_t, uintptr_t>, size_t>> dense;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    TORCH_CHECK_VALUE(at::has_internal_overlap(t) != at::MemOverlap::Yes, op, ": tensors[", i,
                      "] has elements that share memory (an expanded view?); it cannot be "
                      "written in place");
    if (t.is_non_overlapping_and_dense()) dense.push_back({byte_span(t), i});
  }
  std::sort(dense.begin(), dense.end());
  for (size_t k = 1; k < dense.size(); ++k) {
    // Sorted by start: a dense entry overlaps an earlier one iff it starts before the
    // previous end (dense spans hold no foreign bytes, so span overlap is real overlap).
    TORCH_CHECK_VALUE(dense[k].first.first >= dense[k - 1].first.second, op, ": tensors[",
                      dense[k - 1].second, "] and tensors[", dense[k].second,
                      "] share memory; the destinations must be disjoint");
  }
}

inline int64_t total_numel(at::TensorList tensors) {
  int64_t total = 0;
  for (const at::Tensor& t : tensors) total += t.numel();
  return total;
}

// Byte offset of every entry in the flat buffer, plus the total as the last element.
inline std::vector<int64_t> byte_offsets(at::TensorList tensors) {
  std::vector<int64_t> off(tensors.size() + 1, 0);
  for (size_t i = 0; i < tensors.size(); ++i) {
    off[i + 1] = off[i] + tensors[i].numel() * static_cast<int64_t>(tensors[i].element_size());
  }
  return off;
}

}  // namespace ddpcomm
