"""Typed wrappers over ``torch.ops.ddpcomm`` and one fake (meta) implementation per op.

Importing this module loads the native library. If it was not built, the import fails
with the reason: ddpcomm never falls back to ``reference.py`` behind the caller's back.
"""

from __future__ import annotations

import math

import torch

try:
    from ddpcomm import _C
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "ddpcomm's native library (ddpcomm._C) is not built or failed to load: "
        f"{exc}. Build it with `pip install --no-build-isolation -e .` (or `make`)."
    ) from exc

_ops = torch.ops.ddpcomm


def build_info() -> dict:
    """What the native library was built with: CUDA ops, OpenMP version, torch version."""
    info = dict(_C.build_info())
    info["torch"] = torch.__version__
    info["threads"] = torch.get_num_threads()
    return info


def payload_bytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of the packed payload for ``numel`` values (csrc/numerics.h layout)."""
    return math.ceil(numel / block_size) * (4 + block_size * bits // 8)


# --------------------------------------------------------------------------------------
# Quantizer family
# --------------------------------------------------------------------------------------


def quantize(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    bits: int,
    block_size: int,
    stochastic: bool = False,
    seed: int = 0,
    step: int = 0,
    rng_offset: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packs ``x`` (+ ``residual``, updated in place) into one uint8 payload.

    With ``out`` (uint8, at least ``payload_bytes`` long) the payload is written there and
    ``out`` is returned: reusing a buffer saves an allocation and its page faults per call.
    """
    if out is None:
        return _ops.quantize(x, residual, bits, block_size, stochastic, seed, step, rng_offset)
    _ops.quantize_into(x, residual, out, bits, block_size, stochastic, seed, step, rng_offset)
    return out


def dequantize(
    packed: torch.Tensor,
    numel: int,
    bits: int,
    block_size: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``numel`` values a payload encodes, in ``dtype`` (or written into ``out``)."""
    if out is None:
        return _ops.dequantize(packed, numel, bits, block_size, dtype)
    _check_out(out, numel, dtype, "dequantize")
    _ops.dequantize_into(packed, out, bits, block_size)
    return out


def dequantize_sum(
    payloads: torch.Tensor,
    numel: int,
    bits: int,
    block_size: int,
    divisor: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-order fp32 sum of the [N, P] payloads' values, divided by ``divisor``."""
    if out is None:
        return _ops.dequantize_sum(payloads, numel, bits, block_size, divisor, dtype)
    _check_out(out, numel, dtype, "dequantize_sum")
    _ops.dequantize_sum_into(payloads, out, bits, block_size, divisor)
    return out


def _check_out(out: torch.Tensor, numel: int, dtype: torch.dtype, op: str) -> None:
    if out.numel() != numel or out.dtype != dtype:
        raise ValueError(
            f"{op}: out must have {numel} elements of {dtype}, got {out.numel()} of {out.dtype}"
        )


def dequantize_sum_requantize(
    payloads: torch.Tensor,
    residual: torch.Tensor | None,
    numel: int,
    bits: int,
    block_size: int,
    divisor: int,
    stochastic: bool = False,
    seed: int = 0,
    step: int = 0,
    rng_offset: int = 0,
) -> torch.Tensor:
    """Owner step of the two-phase all-reduce: sum, divide, re-quantize, in one pass."""
    return _ops.dequantize_sum_requantize(
        payloads, residual, numel, bits, block_size, divisor, stochastic, seed, step, rng_offset
    )


@torch.library.register_fake("ddpcomm::quantize")
def _(x, residual, bits, block_size, stochastic=False, seed=0, step=0, rng_offset=0):
    return x.new_empty(payload_bytes(x.numel(), bits, block_size), dtype=torch.uint8)


@torch.library.register_fake("ddpcomm::dequantize")
def _(packed, numel, bits, block_size, dtype):
    return packed.new_empty(numel, dtype=dtype)


@torch.library.register_fake("ddpcomm::dequantize_sum")
def _(payloads, numel, bits, block_size, divisor, dtype):
    return payloads.new_empty(numel, dtype=dtype)


@torch.library.register_fake("ddpcomm::quantize_into")
def _(x, residual, out, bits, block_size, stochastic=False, seed=0, step=0, rng_offset=0):
    return None


@torch.library.register_fake("ddpcomm::dequantize_into")
def _(packed, out, bits, block_size):
    return None


@torch.library.register_fake("ddpcomm::dequantize_sum_into")
def _(payloads, out, bits, block_size, divisor):
    return None


@torch.library.register_fake("ddpcomm::dequantize_sum_requantize")
def _(
    payloads,
    residual,
    numel,
    bits,
    block_size,
    divisor,
    stochastic=False,
    seed=0,
    step=0,
    rng_offset=0,
):
    return payloads.new_empty(payload_bytes(numel, bits, block_size), dtype=torch.uint8)


# --------------------------------------------------------------------------------------
# Multi-tensor flatten family (csrc/flatten.h, csrc/cpu/flatten.cpp)
# --------------------------------------------------------------------------------------


def _tensor_list(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], op: str):
    # A Tensor is iterable (over its first dim), so it must be refused explicitly.
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(
            f"{op}: tensors must be a list or tuple of tensors, got {type(tensors).__name__}"
        )
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        i, t = next((i, t) for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor))
        raise TypeError(f"{op}: tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return tensors


def flatten(
    tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Concatenates every tensor's elements, in list order, into one contiguous 1-D buffer.

    The layout is ``torch._utils._flatten_dense_tensors``'s, made in one native call that
    copies in parallel over bytes. All tensors must share one dtype and device (unlike
    torch's, nothing is promoted). Non-contiguous tensors are read in logical order. With
    ``out`` (1-D, contiguous, same dtype and device, exactly the total number of elements,
    sharing no memory with the inputs) the result is written there and ``out`` is returned;
    without it, ``tensors`` must not be empty.

    Example:
        >>> import torch
        >>> from ddpcomm import ops
        >>> ops.flatten([torch.ones(2, 2), torch.arange(3.0)])
        tensor([1., 1., 1., 1., 0., 1., 2.])
        >>> buf = torch.empty(3, dtype=torch.float16)
        >>> ops.flatten([torch.zeros(1, dtype=torch.float16), torch.ones(2).half()], out=buf)
        tensor([0., 1., 1.], dtype=torch.float16)
    """
    tensors = _tensor_list(tensors, "flatten")
    if out is None:
        if not tensors:
            raise ValueError(
                "flatten: tensors must not be empty when out is not given (the result "
                "takes its dtype and device from them)"
            )
        return _ops.flatten(tensors)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"flatten: out must be a torch.Tensor or None, got {type(out).__name__}")
    _ops.flatten_into(tensors, out)
    return out


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]):
    """Writes ``flat`` back into ``tensors`` in place: the inverse of :func:`flatten`.

    ``flat`` is 1-D and contiguous, with the tensors' dtype and device and exactly their
    total number of elements. Destinations may be non-contiguous views; they must not share
    memory with ``flat``, with each other (dense ones are checked), or within themselves
    (expanded views are refused).

    Example:
        >>> import torch
        >>> from ddpcomm import ops
        >>> a, b = torch.zeros(2, 2), torch.zeros(3)
        >>> ops.unflatten_into(torch.arange(7.0), [a, b])
        >>> a, b
        (tensor([[0., 1.],
                [2., 3.]]), tensor([4., 5., 6.]))
    """
    tensors = _tensor_list(tensors, "unflatten_into")
    if not isinstance(flat, torch.Tensor):
        raise TypeError(f"unflatten_into: flat must be a torch.Tensor, got {type(flat).__name__}")
    _ops.unflatten_into(flat, tensors)


def _check_flatten_list(tensors, dtype, device, ref, op):
    """The fake-tensor twin of csrc/flatten.h check_flatten_list (same errors)."""
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            raise TypeError(f"{op}: tensors[{i}] must be a strided (dense) tensor, got {t.layout}")
        if t.dtype != dtype:
            raise TypeError(
                f"{op}: tensors[{i}] has dtype {t.dtype} but {ref} has {dtype}; one call "
                "handles one dtype (group the tensors by dtype)"
            )
        if t.device != device:
            raise ValueError(
                f"{op}: tensors[{i}] is on {t.device} but {ref} is on {device}; one call "
                "handles one device"
            )


def _check_flat_buffer(flat, total, arg, op):
    """The fake-tensor twin of csrc/flatten.h check_flat_buffer (same errors)."""
    if flat.layout != torch.strided:
        raise TypeError(f"{op}: {arg} must be a strided tensor, got {flat.layout}")
    if flat.dim() != 1:
        raise ValueError(f"{op}: {arg} must be 1-D, got {flat.dim()} dimensions")
    if not flat.is_contiguous():
        raise ValueError(f"{op}: {arg} must be contiguous")
    if flat.numel() != total:
        raise ValueError(
            f"{op}: {arg} must have {total} elements (the tensors' total), got {flat.numel()}"
        )


@torch.library.register_fake("ddpcomm::flatten")
def _(tensors):
    if not tensors:
        raise ValueError("flatten: tensors must not be empty")
    _check_flatten_list(tensors, tensors[0].dtype, tensors[0].device, "tensors[0]", "flatten")
    return tensors[0].new_empty(sum(t.numel() for t in tensors))


@torch.library.register_fake("ddpcomm::flatten_into")
def _(tensors, out):
    _check_flatten_list(tensors, out.dtype, out.device, "out", "flatten_into")
    _check_flat_buffer(out, sum(t.numel() for t in tensors), "out", "flatten_into")


@torch.library.register_fake("ddpcomm::unflatten_into")
def _(flat, tensors):
    _check_flatten_list(tensors, flat.dtype, flat.device, "flat", "unflatten_into")
    _check_flat_buffer(flat, sum(t.numel() for t in tensors), "flat", "unflatten_into")


# Sparsification family (top-k, random-k)
# --------------------------------------------------------------------------------------


def topk_payload_bytes(k: int, value_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of a packed top-k payload: k int32 indices, then k values in ``value_dtype``."""
    return k * (4 + torch.empty((), dtype=value_dtype).element_size())


def topk_compress(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    k: int,
    approximate: bool = False,
    seed: int = 0,
    step: int = 0,
    value_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Selects ``k`` entries of e = x (+ ``residual``) by magnitude and packs them.

    Returns one uint8 buffer: k int32 indices in ascending order, then their values in
    ``value_dtype`` (float32 when None). With a residual (error feedback), the residual
    becomes e at every unselected entry and what the value cast lost at the selected ones
    (0 for float32 values). Exact mode (default) picks the k largest |e|, ties to the lower
    index; approximate mode derives its threshold from a sample keyed by (seed, step).
    NaN and Inf rank above every finite magnitude. See reference.topk_compress. With
    ``out`` (uint8, exactly ``topk_payload_bytes(k, value_dtype)`` long) the payload is
    written there and ``out`` returned.

    >>> p = topk_compress(torch.tensor([0.5, -3.0, 1.0, 2.0]), None, 2)
    >>> p[:8].view(torch.int32).tolist(), p[8:].view(torch.float32).tolist()
    ([1, 3], [-3.0, 2.0])
    """
    if out is None:
        return _ops.topk_compress(x, residual, k, approximate, seed, step, value_dtype)
    _ops.topk_compress_into(x, residual, out, k, approximate, seed, step, value_dtype)
    return out


def sparse_accumulate(
    payloads: torch.Tensor,
    numel: int,
    k: int,
    divisor: int,
    value_dtype: torch.dtype,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense sum of N packed top-k payloads ([N, bytes] uint8) divided by ``divisor``.

    Rows are added in row (rank) order into an fp32 buffer of ``numel`` zeros, so an index
    present in several rows sums in rank order; the result is cast to ``dtype``. With
    ``out`` the result is written there (no allocation); a float16/bfloat16 ``out`` also
    needs ``scratch``, a float32 tensor of ``numel`` elements for the sum.
    """
    if out is None:
        return _ops.sparse_accumulate(payloads, numel, k, divisor, value_dtype, dtype)
    _check_out(out, numel, dtype, "sparse_accumulate")
    _ops.sparse_accumulate_into(payloads, out, scratch, k, divisor, value_dtype)
    return out


def randk_compress(
    x: torch.Tensor, residual: torch.Tensor | None, k: int, seed: int, step: int, bucket: int
) -> torch.Tensor:
    """The fp32 values of e = x (+ ``residual``) at k random-k indices (reference.randk_indices).

    The indices depend only on (numel, k, seed, step, bucket), so every rank draws the same
    ones and the values can be all-reduced directly. With a residual it becomes e, and 0 at
    the sent entries.
    """
    return _ops.randk_compress(x, residual, k, seed, step, bucket)


def randk_decompress(
    values: torch.Tensor,
    numel: int,
    seed: int,
    step: int,
    bucket: int,
    divisor: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dense ``numel`` tensor holding ``values / divisor`` at the random-k indices, else 0
    (written into ``out`` when given)."""
    if out is None:
        return _ops.randk_decompress(values, numel, seed, step, bucket, divisor, dtype)
    _check_out(out, numel, dtype, "randk_decompress")
    _ops.randk_decompress_into(values, out, seed, step, bucket, divisor)
    return out


@torch.library.register_fake("ddpcomm::topk_compress")
def _(x, residual, k, approximate=False, seed=0, step=0, value_dtype=None):
    vbytes = topk_payload_bytes(1, value_dtype or torch.float32) - 4
    return x.new_empty(k * (4 + vbytes), dtype=torch.uint8)


@torch.library.register_fake("ddpcomm::sparse_accumulate")
def _(payloads, numel, k, divisor, value_dtype, dtype):
    return payloads.new_empty(numel, dtype=dtype)


@torch.library.register_fake("ddpcomm::randk_compress")
def _(x, residual, k, seed, step, bucket):
    return x.new_empty(k, dtype=torch.float32)


@torch.library.register_fake("ddpcomm::randk_decompress")
def _(values, numel, seed, step, bucket, divisor, dtype):
    return values.new_empty(numel, dtype=dtype)


@torch.library.register_fake("ddpcomm::sparse_accumulate_into")
def _(payloads, out, scratch, k, divisor, value_dtype):
    return None


@torch.library.register_fake("ddpcomm::randk_decompress_into")
def _(values, out, seed, step, bucket, divisor):
    return None


@torch.library.register_fake("ddpcomm::topk_compress_into")
def _(x, residual, out, k, approximate=False, seed=0, step=0, value_dtype=None):
    return None
