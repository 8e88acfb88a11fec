// The ddpcomm operator library: every op schema, and the tiny Python module that loads it.
// Device implementations live in csrc/cpu/ and csrc/cuda/; fake (meta) implementations in
// ddpcomm/ops.py; semantics in ddpcomm/reference.py.

#include <Python.h>
#include <torch/library.h>

#include <string>

#include "checks.h"

// One native form per operation: every op writes into caller-owned buffers, and
// ddpcomm/ops.py allocates them (reusing a buffer saves an allocation and its first-touch
// page faults on every call). `flatten` alone also returns a new tensor: see below.
// Error messages name the ops.py function the caller used, not the schema.
TORCH_LIBRARY(ddpcomm, m) {
  // Quantizer family. Payload layout: csrc/numerics.h. dequantize_sum_into takes numel and
  // dtype from `out` (ops.dequantize is its one-row, divisor-1 case); the _into ops that
  // write a payload need `out` to hold at least payload_bytes(numel, ...) bytes.
  m.def(
      "quantize_into(Tensor x, Tensor(a!)? residual, Tensor(b!) out, int bits, int block_size, "
      "bool stochastic=False, int seed=0, int step=0, int rng_offset=0) -> ()");
  // scale: out's values multiplied by it elementwise after the division (a quantizer's
  // normalize, ddpcomm/normalize.py): out.mul_(scale)'s numbers, with canonical NaNs.
  m.def(
      "dequantize_sum_into(Tensor payloads, Tensor(a!) out, int bits, int block_size, "
      "int divisor, Tensor? scale=None) -> ()");
  m.def(
      "dequantize_sum_requantize_into(Tensor payloads, Tensor(a!)? residual, Tensor(b!) out, "
      "int numel, int bits, int block_size, int divisor, bool stochastic=False, int seed=0, "
      "int step=0, int rng_offset=0) -> ()");

  // Multi-tensor flatten family. Semantics and checks: csrc/flatten.h. `flatten` allocates
  // natively because only a buffer it has just allocated, never touched, can take the huge
  // page advice that halves its first-touch cost on CPU (cpu/flatten.cpp). flatten_into is a
  // separate op rather than an optional `out` of flatten: an op whose return may alias a
  // mutated input cannot be functionalized (torch.compile) or pass opcheck.
  m.def("flatten(Tensor[] tensors) -> Tensor");
  m.def("flatten_into(Tensor[] tensors, Tensor(a!) out) -> ()");
  m.def("unflatten_into(Tensor flat, Tensor(a!)[] tensors) -> ()");

  // Sparsification family (top-k, random-k). Payload layout and selection order:
  // csrc/numerics.h, "Sparsification". numel and dtype come from `out` (sparse_accumulate_into
  // sums in fp32 whatever out's dtype); randk_compress_into sends k = out.numel() values.
  // The random-k ops cover strata [start, end) of k (end=-1: k), one contiguous range of the
  // bucket, so a bucket can be compressed, sent and decoded in pieces (collectives._randk).
  m.def(
      "topk_compress_into(Tensor x, Tensor(a!)? residual, Tensor(b!) out, int k, "
      "bool approximate=False, int seed=0, int step=0, ScalarType? value_dtype=None) -> ()");
  // check=False trusts the rows' indices (made by topk_compress): no validation pass, and on
  // CUDA no host synchronization to raise on a bad row.
  m.def(
      "sparse_accumulate_into(Tensor payloads, Tensor(a!) out, int k, "
      "int divisor, ScalarType value_dtype, bool check=True) -> ()");
  m.def(
      "randk_compress_into(Tensor x, Tensor(a!)? residual, Tensor(b!) out, int seed, int step, "
      "int bucket, int start=0, int end=-1) -> ()");
  m.def(
      "randk_decompress_into(Tensor values, Tensor(a!) out, int seed, int step, int bucket, "
      "int divisor, int start=0, int end=-1) -> ()");

  // A quantizer's normalize (ddpcomm/normalize.py): quantize_into of y = x / scale (rounded to
  // x's dtype) instead of x, after average = beta * average + (1 - beta) * x^2 where an
  // average is given; x itself is left as it is. One native pass for float32 on the CPU
  // (the division happens as each block is staged); elsewhere torch's ops with the same
  // arithmetic (reference.scale_down), then quantize_into.
  m.def(
      "scale_quantize_into(Tensor x, Tensor(a!)? average, Tensor scale, float beta, "
      "Tensor(b!)? residual, Tensor(c!) out, int bits, int block_size, bool stochastic=False, "
      "int seed=0, int step=0, int rng_offset=0) -> ()");
}

// scale_quantize_into where no device has its own kernel (CUDA: the division is one more
// memory-bound pass there, next to the quantize kernel's).
TORCH_LIBRARY_IMPL(ddpcomm, CompositeExplicitAutograd, m) {
  m.impl("scale_quantize_into",
         [](const at::Tensor& x, const std::optional<at::Tensor>& average, const at::Tensor& scale,
            double beta, const std::optional<at::Tensor>& residual, const at::Tensor& out,
            int64_t bits, int64_t block_size, bool stochastic, int64_t seed, int64_t step,
            int64_t rng_offset) {
           ddpcomm::check_scale_quantize(x, average, scale, beta, residual, out, bits, block_size);
           ddpcomm::scale_quantize_aten(x, average, scale, beta, residual, out, bits, block_size,
                                        stochastic, seed, step, rng_offset);
         });
}

namespace {

// What this binary was built with, for ddpcomm.build_info().
PyObject* build_info(PyObject*, PyObject*) {
#ifdef _OPENMP
  const long openmp = _OPENMP;
#else
  const long openmp = 0;
#endif
#ifdef DDPCOMM_WITH_CUDA
  const bool cuda = true;
#else
  const bool cuda = false;
#endif
  return Py_BuildValue("{s:O,s:l}", "cuda", cuda ? Py_True : Py_False, "openmp", openmp);
}

PyMethodDef methods[] = {
    {"build_info", build_info, METH_NOARGS, "What the native library was built with."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "ddpcomm native ops", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&module); }
