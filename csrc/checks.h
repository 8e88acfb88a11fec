// Argument checks shared by the CPU and CUDA bindings of every op. Each message names the
// op, the argument and what is allowed, so a bad call fails the same way on any device.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <climits>
#include <optional>
#include <utility>

#include "numerics.h"

namespace ddpcomm {

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// True when a and b can share bytes of one storage, from metadata only (no data read, no device
// synchronization): the same storage and intersecting spans from each one's first to last byte
// (strides are never negative in torch; interleaved views count as overlapping).
inline bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.is_alias_of(b)) return false;
  auto span = [](const at::Tensor& t) {
    int64_t last = t.storage_offset();
    for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
    const int64_t size = (int64_t)t.element_size();
    return std::make_pair(t.storage_offset() * size, (last + 1) * size);
  };
  const auto sa = span(a), sb = span(b);
  return sa.first < sb.second && sb.first < sa.second;
}

// An op reading `b` while writing `a` (or writing both) needs them apart: the kernels run in
// parallel, so an overlap would give results that depend on thread timing.
inline void check_apart(const at::Tensor& a, const char* a_arg, const at::Tensor& b,
                        const char* b_arg, const char* op) {
  TORCH_CHECK_VALUE(!may_overlap(a, b), op, ": ", a_arg, " and ", b_arg,
                    " share memory; pass separate buffers");
}

inline void check_apart(const std::optional<at::Tensor>& a, const char* a_arg, const at::Tensor& b,
                        const char* b_arg, const char* op) {
  if (a) check_apart(*a, a_arg, b, b_arg, op);
}

// t: a contiguous float32 tensor of ref's size on ref's device, apart from it (a scale, an
// average: per-element state beside a bucket).
inline void check_float32_like(const at::Tensor& t, const char* arg, const at::Tensor& ref,
                               const char* ref_arg, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == ref.numel() &&
                  t.device() == ref.device(),
              op, ": ", arg, " must be a contiguous float32 tensor of ", ref_arg, "'s ",
              ref.numel(), " elements on ", ref.device(), ", got ", t.scalar_type(), " of ",
              t.numel(), " on ", t.device());
  check_apart(t, arg, ref, ref_arg, op);
}

inline void check_bits_block(int64_t bits, int64_t block_size, const char* op) {
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8 || bits == kSparseBits, op,
              ": bits must be one of 1, 2, 4, 8 or 3 (the 1.5-bit code), got ", bits);
  TORCH_CHECK(block_size >= 32 && block_size <= 65536 && (block_size & (block_size - 1)) == 0, op,
              ": block_size must be a power of two in [32, 65536], got ", block_size);
}

inline void check_rounding(int64_t bits, bool stochastic, const char* op) {
  TORCH_CHECK(!(stochastic && bits == kSparseBits), op,
              ": stochastic rounding is not defined for the 1.5-bit code (bits=3)");
}

inline void check_float_tensor(const at::Tensor& t, const char* arg, const char* op) {
  TORCH_CHECK(is_supported_float(t.scalar_type()), op, ": ", arg,
              " must be float32, float16 or bfloat16, got ", t.scalar_type());
}

inline void check_residual(const std::optional<at::Tensor>& residual, int64_t numel,
                           const at::Device& device, const char* op) {
  if (!residual) return;
  const at::Tensor& r = *residual;
  TORCH_CHECK(r.scalar_type() == at::kFloat, op, ": residual must be float32, got ",
              r.scalar_type());
  TORCH_CHECK(r.is_contiguous(), op, ": residual must be contiguous");
  TORCH_CHECK(r.numel() == numel, op, ": residual must have ", numel, " elements, got ", r.numel());
  TORCH_CHECK(r.device() == device, op, ": residual is on ", r.device(), " but the input is on ",
              device);
}

inline void check_quantize_args(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                int64_t bits, int64_t block_size, const char* op) {
  check_bits_block(bits, block_size, op);
  check_float_tensor(x, "x", op);
  check_residual(residual, x.numel(), x.device(), op);
}

// An output tensor given by the caller: exact dtype, device, contiguous, and at least
// `numel` elements (quantize writes the first payload_bytes of a larger buffer).
inline void check_out(const at::Tensor& out, at::ScalarType dtype, int64_t numel,
                      const at::Device& device, const char* op) {
  TORCH_CHECK(out.scalar_type() == dtype, op, ": out must be ", dtype, ", got ", out.scalar_type());
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  TORCH_CHECK(out.numel() >= numel, op, ": out must hold at least ", numel, " elements, got ",
              out.numel());
  TORCH_CHECK(out.device() == device, op, ": out is on ", out.device(), " but the input is on ",
              device);
}

// `payloads` is one packed payload (dims 1) or N >= 1 of them stacked as [N, bytes] (dims 2).
// A payload carries no header: its size, exactly payload_bytes(numel, bits, block_size), is
// what tells a payload of other settings apart (README, "Wire format", says what it cannot).
inline void check_payloads(const at::Tensor& payloads, int64_t dims, int64_t numel, int64_t bits,
                           int64_t block_size, at::ScalarType dtype, const char* op) {
  check_bits_block(bits, block_size, op);
  TORCH_CHECK(payloads.scalar_type() == at::kByte, op, ": payloads must be uint8, got ",
              payloads.scalar_type());
  TORCH_CHECK(payloads.dim() == dims, op, ": payloads must have ", dims, " dimension(s), got ",
              payloads.dim());
  TORCH_CHECK(dims == 1 || payloads.size(0) >= 1, op,
              ": payloads must hold at least one row, got 0");
  TORCH_CHECK(payloads.is_contiguous(), op, ": payloads must be contiguous");
  TORCH_CHECK(numel >= 0, op, ": numel must be >= 0, got ", numel);
  const int64_t need = payload_bytes(numel, block_size, (int)bits);
  const int64_t have = payloads.size(dims - 1);
  TORCH_CHECK(have == need, op, ": a payload of ", numel, " elements at bits=", bits,
              ", block_size=", block_size, " needs ", need, " bytes, got ", have,
              dims == 2 ? " per row" : "", " (made with other settings?)");
  TORCH_CHECK(is_supported_float(dtype), op, ": dtype must be float32, float16 or bfloat16, got ",
              dtype);
}

// The argument checks of each quantizer op, in the order both devices apply them (and the
// fake implementations in ddpcomm/ops.py mirror). Messages name the Python op the caller
// used (ops.py), not the native schema.

// quantize_into: `out` holds at least the payload of x.
inline void check_quantize(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                           const at::Tensor& out, int64_t bits, int64_t block_size) {
  const char* op = "quantize";
  check_quantize_args(x, residual, bits, block_size, op);
  check_out(out, at::kByte, payload_bytes(x.numel(), block_size, (int)bits), x.device(), op);
  check_apart(out, "out", x, "x", op);
  check_apart(residual, "residual", x, "x", op);
  check_apart(residual, "residual", out, "out", op);
}

// dequantize_sum_into: `out`'s numel and dtype say what to decode (ops.dequantize is one row
// and divisor 1, checked as "dequantize" in Python first).
inline void check_dequantize_sum(const at::Tensor& payloads, const at::Tensor& out, int64_t bits,
                                 int64_t block_size, int64_t divisor,
                                 const std::optional<at::Tensor>& scale) {
  const char* op = "dequantize_sum";
  check_payloads(payloads, 2, out.numel(), bits, block_size, out.scalar_type(), op);
  check_out(out, out.scalar_type(), out.numel(), payloads.device(), op);
  TORCH_CHECK(divisor >= 1, op, ": divisor must be >= 1, got ", divisor);
  check_apart(out, "out", payloads, "payloads", op);
  if (scale) check_float32_like(*scale, "scale", out, "out", op);
}

// dequantize_sum_requantize_into: `out` holds at least the payload of numel elements.
inline void check_dequantize_sum_requantize(const at::Tensor& payloads,
                                            const std::optional<at::Tensor>& residual,
                                            const at::Tensor& out, int64_t numel, int64_t bits,
                                            int64_t block_size, int64_t divisor) {
  const char* op = "dequantize_sum_requantize";
  check_payloads(payloads, 2, numel, bits, block_size, at::kFloat, op);
  check_residual(residual, numel, payloads.device(), op);
  TORCH_CHECK(divisor >= 1, op, ": divisor must be >= 1, got ", divisor);
  check_out(out, at::kByte, payload_bytes(numel, block_size, (int)bits), payloads.device(), op);
  check_apart(out, "out", payloads, "payloads", op);
  check_apart(residual, "residual", payloads, "payloads", op);
  check_apart(residual, "residual", out, "out", op);
}

// ---------------------------------------------------------------------------------------
// Sparsification
// ---------------------------------------------------------------------------------------

// Top-k indices travel as int32, so a bucket may hold at most 2^31 - 1 elements.
inline void check_sparse_numel_k(int64_t numel, int64_t k, const char* op) {
  TORCH_CHECK(numel >= 1 && numel <= INT32_MAX, op, ": numel must be in [1, 2^31 - 1], got ",
              numel);
  TORCH_CHECK(k >= 1 && k <= numel, op, ": k must be in [1, numel=", numel, "], got ", k);
}

inline void check_sparse_input(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                               int64_t k, const char* op) {
  check_float_tensor(x, "x", op);
  check_sparse_numel_k(x.numel(), k, op);
  check_residual(residual, x.numel(), x.device(), op);
}

inline void check_value_dtype(at::ScalarType t, const char* op) {
  TORCH_CHECK(is_supported_float(t), op, ": value_dtype must be float32, float16 or bfloat16, got ",
              t);
}

inline void check_divisor_dtype(int64_t divisor, at::ScalarType dtype, const char* op) {
  TORCH_CHECK(divisor >= 1, op, ": divisor must be >= 1, got ", divisor);
  TORCH_CHECK(is_supported_float(dtype), op, ": dtype must be float32, float16 or bfloat16, got ",
              dtype);
}

// The output buffer of topk_compress_into: exactly one payload of k entries.
inline void check_topk_out(const at::Tensor& packed, int64_t k, at::ScalarType value_dtype,
                           const char* op) {
  const int64_t need = topk_payload_bytes(k, at::elementSize(value_dtype));
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() == need,
              op, ": out must be a contiguous 1-D uint8 tensor of k * (4 + value bytes) = ", need,
              " bytes, got ", packed.scalar_type(), " of ", packed.numel());
}

// `payloads` is [N, k * (4 + value bytes)] uint8: N packed top-k payloads, one per rank.
inline void check_sparse_payloads(const at::Tensor& payloads, int64_t numel, int64_t k,
                                  at::ScalarType value_dtype, const char* op) {
  check_sparse_numel_k(numel, k, op);
  check_value_dtype(value_dtype, op);
  TORCH_CHECK(payloads.scalar_type() == at::kByte, op, ": payloads must be uint8, got ",
              payloads.scalar_type());
  TORCH_CHECK(payloads.dim() == 2, op, ": payloads must be [N, bytes] (2 dimensions), got ",
              payloads.dim(), " dimension(s)");
  TORCH_CHECK(payloads.size(0) >= 1, op, ": payloads must hold at least one row, got 0");
  const int64_t need = topk_payload_bytes(k, at::elementSize(value_dtype));
  TORCH_CHECK(payloads.size(1) == need, op, ": a payload of k=", k, " entries with value_dtype ",
              value_dtype, " is ", need, " bytes, but payloads rows are ", payloads.size(1));
}

// The argument checks of each sparsification op, as above. Returns the value dtype.
inline at::ScalarType check_topk_compress(const at::Tensor& x,
                                          const std::optional<at::Tensor>& residual,
                                          const at::Tensor& out, int64_t k,
                                          std::optional<at::ScalarType> value_dtype) {
  const char* op = "topk_compress";
  check_sparse_input(x, residual, k, op);
  const at::ScalarType vtype = value_dtype.value_or(at::kFloat);
  check_value_dtype(vtype, op);
  check_topk_out(out, k, vtype, op);
  TORCH_CHECK(out.device() == x.device(), op, ": out is on ", out.device(), " but x is on ",
              x.device());
  check_apart(out, "out", x, "x", op);
  check_apart(residual, "residual", x, "x", op);
  check_apart(residual, "residual", out, "out", op);
  return vtype;
}

// sparse_accumulate_into: both devices sum in fp32 of their own (CPU: an L2-sized slice per
// task; CUDA: shared memory) and cast once into `out`, whatever its dtype.
inline void check_sparse_accumulate(const at::Tensor& payloads, const at::Tensor& out, int64_t k,
                                    int64_t divisor, at::ScalarType value_dtype) {
  const char* op = "sparse_accumulate";
  check_sparse_payloads(payloads, out.numel(), k, value_dtype, op);
  check_divisor_dtype(divisor, out.scalar_type(), op);
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  TORCH_CHECK(out.device() == payloads.device(), op, ": out is on ", out.device(),
              " but payloads are on ", payloads.device());
  check_apart(out, "out", payloads, "payloads", op);
}

// The strata [start, end) of k a random-k op covers (end = -1: k). Returns end resolved.
inline int64_t check_strata(int64_t start, int64_t end, int64_t k, const char* op) {
  const int64_t last = end == -1 ? k : end;
  TORCH_CHECK(0 <= start && start <= last && last <= k, op,
              ": start and end must satisfy 0 <= start <= end <= k=", k,
              " (end=-1: k), got start=", start, ", end=", end);
  return last;
}

// randk_compress_into: k = out.numel() values, of which strata [start, end) are written.
// Returns end resolved.
inline int64_t check_randk_compress(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                    const at::Tensor& out, int64_t start, int64_t end) {
  const char* op = "randk_compress";
  check_sparse_input(x, residual, out.numel(), op);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(), op,
              ": out must be a contiguous float32 tensor of k elements, got ", out.scalar_type());
  TORCH_CHECK(out.device() == x.device(), op, ": out is on ", out.device(), " but x is on ",
              x.device());
  check_apart(out, "out", x, "x", op);
  check_apart(residual, "residual", x, "x", op);
  check_apart(residual, "residual", out, "out", op);
  return check_strata(start, end, out.numel(), op);
}

// randk_decompress_into: numel = out.numel(), k = values.numel(), strata [start, end).
// Returns end resolved.
inline int64_t check_randk_decompress(const at::Tensor& values, const at::Tensor& out,
                                      int64_t divisor, int64_t start, int64_t end) {
  const char* op = "randk_decompress";
  check_float_tensor(values, "values", op);
  TORCH_CHECK(values.dim() == 1, op, ": values must be 1-D, got ", values.dim(), " dimensions");
  TORCH_CHECK(out.is_contiguous(), op, ": out must be contiguous");
  check_sparse_numel_k(out.numel(), values.numel(), op);
  check_divisor_dtype(divisor, out.scalar_type(), op);
  TORCH_CHECK(out.device() == values.device(), op, ": out is on ", out.device(),
              " but values are on ", values.device());
  check_apart(out, "out", values, "values", op);
  return check_strata(start, end, values.numel(), op);
}

// scale_quantize_into: quantize_into's checks (named "quantize", the ops.py function that
// takes a scale); scale and the optional average contiguous float32 tensors of x's numel on
// x's device, apart from x, the residual, out and each other; beta in [0, 1).
inline void check_scale_quantize(const at::Tensor& x, const std::optional<at::Tensor>& average,
                                 const at::Tensor& scale, double beta,
                                 const std::optional<at::Tensor>& residual, const at::Tensor& out,
                                 int64_t bits, int64_t block_size) {
  const char* op = "quantize";
  check_quantize(x, residual, out, bits, block_size);
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous when a scale is given");
  TORCH_CHECK(beta >= 0.0 && beta < 1.0, op, ": beta must be a float in [0, 1), got ", beta);
  check_float32_like(scale, "scale", x, "x", op);
  check_apart(residual, "residual", scale, "scale", op);
  check_apart(out, "out", scale, "scale", op);
  if (average) {
    check_float32_like(*average, "average", x, "x", op);
    check_apart(*average, "average", scale, "scale", op);
    check_apart(residual, "residual", *average, "average", op);
    check_apart(out, "out", *average, "average", op);
  }
}

// scale_quantize_into as torch ops (reference.scale_down's arithmetic), then quantize_into:
// for every device and dtype without a native pass. The caller has checked the arguments.
inline void scale_quantize_aten(const at::Tensor& x, const std::optional<at::Tensor>& average,
                                const at::Tensor& scale, double beta,
                                const std::optional<at::Tensor>& residual, const at::Tensor& out,
                                int64_t bits, int64_t block_size, bool stochastic, int64_t seed,
                                int64_t step, int64_t rng_offset) {
  if (average) average->mul_(beta).addcmul_(x, x, 1.0 - beta);
  const at::Tensor y = at::div(x, scale).to(x.scalar_type());
  static const auto quantize =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("ddpcomm::quantize_into", "")
          .typed<void(const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                      int64_t, int64_t, bool, int64_t, int64_t, int64_t)>();
  quantize.call(y, residual, out, bits, block_size, stochastic, seed, step, rng_offset);
}

}  // namespace ddpcomm
