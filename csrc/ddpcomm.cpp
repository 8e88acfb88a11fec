// The ddpcomm operator library: every op schema, and the tiny Python module that loads it.
// Device implementations live in csrc/cpu/ and csrc/cuda/; fake (meta) implementations in
// ddpcomm/ops.py; semantics in ddpcomm/reference.py.

#include <Python.h>
#include <torch/library.h>

#include <string>

TORCH_LIBRARY(ddpcomm, m) {
  // Quantizer family. Payload layout: csrc/numerics.h.
  m.def(
      "quantize(Tensor x, Tensor(a!)? residual, int bits, int block_size, bool stochastic=False, "
      "int seed=0, int step=0, int rng_offset=0) -> Tensor");
  m.def(
      "dequantize(Tensor packed, int numel, int bits, int block_size, ScalarType dtype) -> Tensor");
  m.def(
      "dequantize_sum(Tensor payloads, int numel, int bits, int block_size, int divisor, "
      "ScalarType dtype) -> Tensor");
  m.def(
      "dequantize_sum_requantize(Tensor payloads, Tensor(a!)? residual, int numel, int bits, "
      "int block_size, int divisor, bool stochastic=False, int seed=0, int step=0, "
      "int rng_offset=0) -> Tensor");
  // Out-variants: write into caller-owned buffers (no allocation, no first-touch page
  // faults on every call). dequantize_* take numel and dtype from `out`.
  m.def(
      "quantize_into(Tensor x, Tensor(a!)? residual, Tensor(b!) out, int bits, int block_size, "
      "bool stochastic=False, int seed=0, int step=0, int rng_offset=0) -> ()");
  m.def("dequantize_into(Tensor packed, Tensor(a!) out, int bits, int block_size) -> ()");
  m.def(
      "dequantize_sum_into(Tensor payloads, Tensor(a!) out, int bits, int block_size, "
      "int divisor) -> ()");

  // Multi-tensor flatten family. Semantics and checks: csrc/flatten.h. flatten_into is a
  // separate op rather than an optional `out` of flatten: an op whose return may alias a
  // mutated input cannot be functionalized (torch.compile) or pass opcheck.
  m.def("flatten(Tensor[] tensors) -> Tensor");
  m.def("flatten_into(Tensor[] tensors, Tensor(a!) out) -> ()");
  m.def("unflatten_into(Tensor flat, Tensor(a!)[] tensors) -> ()");

  // Sparsification family (top-k, random-k). Payload layout and selection order:
  // csrc/numerics.h, "Sparsification".
  m.def(
      "topk_compress(Tensor x, Tensor(a!)? residual, int k, bool approximate=False, int seed=0, "
      "int step=0, ScalarType? value_dtype=None) -> Tensor");
  m.def(
      "sparse_accumulate(Tensor payloads, int numel, int k, int divisor, ScalarType value_dtype, "
      "ScalarType dtype) -> Tensor");
  m.def(
      "randk_compress(Tensor x, Tensor(a!)? residual, int k, int seed, int step, int bucket) "
      "-> Tensor");
  m.def(
      "randk_decompress(Tensor values, int numel, int seed, int step, int bucket, int divisor, "
      "ScalarType dtype) -> Tensor");
  // Out-variants: numel and dtype come from `out` (for a 16-bit out, the fp32 sum goes
  // through `scratch`).
  m.def(
      "topk_compress_into(Tensor x, Tensor(a!)? residual, Tensor(b!) out, int k, "
      "bool approximate=False, int seed=0, int step=0, ScalarType? value_dtype=None) -> ()");
  m.def(
      "sparse_accumulate_into(Tensor payloads, Tensor(a!) out, Tensor(b!)? scratch, int k, "
      "int divisor, ScalarType value_dtype) -> ()");
  m.def(
      "randk_decompress_into(Tensor values, Tensor(a!) out, int seed, int step, int bucket, "
      "int divisor) -> ()");
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
