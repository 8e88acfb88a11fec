"""Typed wrappers over ``torch.ops.ddpcomm`` and one fake (meta) implementation per op.

Every native op has one form: it writes into caller-owned buffers (csrc/ddpcomm.cpp), and
the wrappers here allocate whatever the caller did not pass. The argument checks of
csrc/checks.h are restated in Python, in the same order and with the same messages, so a
fake implementation raises exactly what the native op raises, and a wrapper can validate
what it needs before it allocates.

Importing this module loads the native library. If it was not built, the import fails
with the reason: ddpcomm never falls back to ``reference.py`` behind the caller's back.
"""

from __future__ import annotations

import operator

import torch

try:
    from numpy import bool_ as numpy_bool
except ImportError:  # numpy is optional for torch
    numpy_bool = bool

try:
    from ddpcomm import _C
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "ddpcomm's native library (ddpcomm._C) is not built or failed to load: "
        f"{exc}. Build it with `pip install --no-build-isolation -e .` (or `make`)."
    ) from exc

_ops = torch.ops.ddpcomm


def build_info() -> dict:
    """What the native library was built with and runs: CUDA ops, OpenMP version, the
    torch it was built against (``torch_built``) and the one loaded (``torch``), the CPU
    kernels the ops run (``cpu_kernels``: ``x86-64-v3`` or ``x86-64`` in a portable build,
    picked at load; ``as built`` in a ``DDPCOMM_CPU_ARCH`` build) and why
    (``cpu_dispatch``, which also says where pdep and pext are microcode;
    ``DDPCOMM_CPU_DISPATCH=baseline`` forces the x86-64 ones, ``slow-bmi2`` the x86-64-v3
    ones without pdep and pext)."""
    import ctypes

    info = dict(_C.build_info())
    lib = ctypes.CDLL(_C.__file__)  # already loaded: the same handle
    for name in ("torch_built", "cpu_kernels", "cpu_dispatch"):
        fn = getattr(lib, f"ddpcomm_{name}")
        fn.restype = ctypes.c_char_p
        info[name] = fn().decode()
    info["torch"] = torch.__version__
    info["threads"] = torch.get_num_threads()
    return info


# The ``bits`` the quantizer ops take for q1.5's code (numerics.h kSparseBits): its records
# hold 3/16 of a byte per element and a bfloat16 magnitude. No 3-bit code exists.
SPARSE_BITS = 3


def payload_bytes(numel: int, bits: int, block_size: int) -> int:
    """Bytes of the packed payload for ``numel`` values (csrc/numerics.h layout)."""
    if bits == SPARSE_BITS:
        record = 2 + block_size * 3 // 16
    else:
        record = 4 + block_size * bits // 8
    return (numel + block_size - 1) // block_size * record


def magnitude_dtype(bits: int) -> torch.dtype:
    """How a record stores its block magnitude: float32, or bfloat16 for q1.5."""
    return torch.bfloat16 if bits == SPARSE_BITS else torch.float32


def magnitudes(records: torch.Tensor, record_bytes: int, bits: int) -> torch.Tensor:
    """The block magnitudes at the head of each record of ``records`` (uint8, whole
    records), as a view."""
    dtype = magnitude_dtype(bits)
    return records.view(-1, record_bytes)[:, : dtype.itemsize].view(dtype)


def divisor(n: int, like: torch.Tensor):
    """``n`` for dividing ``like`` by it with the correctly rounded quotient on every device,
    as the kernels (and the CPU) divide: torch's CUDA division by a Python number
    multiplies by its reciprocal instead, whose product can differ from the quotient in
    the last bit (n = 3, say), so off the CPU ``n`` comes as a 0-dim float32 tensor on
    ``like``'s device (which keeps ``like``'s dtype in the division)."""
    if like.device.type == "cpu":
        return n
    return torch.full((), float(n), dtype=torch.float32, device=like.device)


def check_int(value, arg: str, lo: int, hi: int | None = None) -> int:
    """``value`` as an int: Python and numpy integers pass, bools and floats (even 8.0)
    raise TypeError, values outside [lo, hi] ValueError."""
    if isinstance(value, (bool, numpy_bool)):
        raise TypeError(f"{arg} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{arg} must be an int, got {value!r}") from None
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{arg} must be {bound}, got {value}")
    return value


def _check_ints(op: str, **args) -> None:
    """The integer arguments of an op: the dispatcher takes ``True`` for 1, so a bool is
    refused here, by name, before it becomes one."""
    for arg, value in args.items():
        check_int(value, f"{op}: {arg}", -(2**63))


# --------------------------------------------------------------------------------------
# Argument checks: csrc/checks.h restated (same order, same messages; RuntimeError is what
# TORCH_CHECK raises). Dtypes print as c10 names ("Float", "Half"), as the native ops print.
# --------------------------------------------------------------------------------------

_C10_NAMES = {
    torch.float32: "Float",
    torch.float16: "Half",
    torch.bfloat16: "BFloat16",
    torch.float64: "Double",
    torch.uint8: "Byte",
    torch.int8: "Char",
    torch.int16: "Short",
    torch.int32: "Int",
    torch.int64: "Long",
    torch.bool: "Bool",
    torch.complex32: "ComplexHalf",
    torch.complex64: "ComplexFloat",
    torch.complex128: "ComplexDouble",
}
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _name(dtype: torch.dtype) -> str:
    return _C10_NAMES.get(dtype, str(dtype))


def _check(ok, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _may_overlap(a, b) -> bool:
    """checks.h may_overlap: one storage and intersecting first-to-last byte spans (metadata
    only, so it works on fake and meta tensors too)."""
    if a.numel() == 0 or b.numel() == 0 or not torch._C._is_alias_of(a, b):
        return False

    def span(t):
        last = t.storage_offset() + sum(
            (n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True)
        )
        return t.storage_offset() * t.element_size(), (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _check_apart(a, a_arg, b, b_arg, op) -> None:
    """checks.h check_apart (ValueError, as TORCH_CHECK_VALUE raises)."""
    if a is not None and _may_overlap(a, b):
        raise ValueError(f"{op}: {a_arg} and {b_arg} share memory; pass separate buffers")


def _check_bits_block(bits, block_size, op):
    _check(
        bits in (1, 2, 4, 8, SPARSE_BITS),
        f"{op}: bits must be one of 1, 2, 4, 8 or 3 (the 1.5-bit code), got {bits}",
    )
    _check(
        32 <= block_size <= 65536 and block_size & (block_size - 1) == 0,
        f"{op}: block_size must be a power of two in [32, 65536], got {block_size}",
    )


def _check_rounding(bits, stochastic, op):
    """checks.h check_rounding."""
    _check(
        not (stochastic and bits == SPARSE_BITS),
        f"{op}: stochastic rounding is not defined for the 1.5-bit code (bits=3)",
    )


def _check_float_tensor(t, arg, op):
    _check(
        t.dtype in _FLOATS,
        f"{op}: {arg} must be float32, float16 or bfloat16, got {_name(t.dtype)}",
    )


def _check_residual(residual, numel, device, op):
    if residual is None:
        return
    r = residual
    _check(r.dtype == torch.float32, f"{op}: residual must be float32, got {_name(r.dtype)}")
    _check(r.is_contiguous(), f"{op}: residual must be contiguous")
    _check(r.numel() == numel, f"{op}: residual must have {numel} elements, got {r.numel()}")
    _check(r.device == device, f"{op}: residual is on {r.device} but the input is on {device}")


def _check_out_buffer(out, dtype, numel, device, op):
    """checks.h check_out: exact dtype, contiguous, at least ``numel`` elements, device."""
    _check(out.dtype == dtype, f"{op}: out must be {_name(dtype)}, got {_name(out.dtype)}")
    _check(out.is_contiguous(), f"{op}: out must be contiguous")
    _check(
        out.numel() >= numel,
        f"{op}: out must hold at least {numel} elements, got {out.numel()}",
    )
    _check(out.device == device, f"{op}: out is on {out.device} but the input is on {device}")


def _check_payloads(payloads, dims, numel, bits, block_size, dtype, op):
    _check_bits_block(bits, block_size, op)
    _check(
        payloads.dtype == torch.uint8,
        f"{op}: payloads must be uint8, got {_name(payloads.dtype)}",
    )
    _check(
        payloads.dim() == dims,
        f"{op}: payloads must have {dims} dimension(s), got {payloads.dim()}",
    )
    _check(dims == 1 or payloads.shape[0] >= 1, f"{op}: payloads must hold at least one row, got 0")
    _check(payloads.is_contiguous(), f"{op}: payloads must be contiguous")
    _check(numel >= 0, f"{op}: numel must be >= 0, got {numel}")
    need, have = payload_bytes(numel, bits, block_size), payloads.shape[dims - 1]
    _check(
        have == need,
        f"{op}: a payload of {numel} elements at bits={bits}, block_size={block_size} "
        f"needs {need} bytes, got {have}{' per row' if dims == 2 else ''} (made with other "
        "settings?)",
    )
    _check(
        dtype in _FLOATS,
        f"{op}: dtype must be float32, float16 or bfloat16, got {_name(dtype)}",
    )


def _check_sparse_numel_k(numel, k, op):
    _check(1 <= numel <= 2**31 - 1, f"{op}: numel must be in [1, 2^31 - 1], got {numel}")
    _check(1 <= k <= numel, f"{op}: k must be in [1, numel={numel}], got {k}")


def _check_sparse_input(x, residual, k, op):
    _check_float_tensor(x, "x", op)
    _check_sparse_numel_k(x.numel(), k, op)
    _check_residual(residual, x.numel(), x.device, op)


def _check_value_dtype(value_dtype, op):
    _check(
        value_dtype in _FLOATS,
        f"{op}: value_dtype must be float32, float16 or bfloat16, got {_name(value_dtype)}",
    )


def _check_divisor_dtype(divisor, dtype, op):
    _check(divisor >= 1, f"{op}: divisor must be >= 1, got {divisor}")
    _check(
        dtype in _FLOATS,
        f"{op}: dtype must be float32, float16 or bfloat16, got {_name(dtype)}",
    )


def _check_topk_out(out, k, value_dtype, op):
    need = topk_payload_bytes(k, value_dtype)
    _check(
        out.dtype == torch.uint8 and out.dim() == 1 and out.is_contiguous() and out.numel() == need,
        f"{op}: out must be a contiguous 1-D uint8 tensor of k * (4 + value bytes) = {need} "
        f"bytes, got {_name(out.dtype)} of {out.numel()}",
    )


def _check_sparse_payloads(payloads, numel, k, value_dtype, op):
    _check_sparse_numel_k(numel, k, op)
    _check_value_dtype(value_dtype, op)
    _check(
        payloads.dtype == torch.uint8,
        f"{op}: payloads must be uint8, got {_name(payloads.dtype)}",
    )
    _check(
        payloads.dim() == 2,
        f"{op}: payloads must be [N, bytes] (2 dimensions), got {payloads.dim()} dimension(s)",
    )
    _check(payloads.shape[0] >= 1, f"{op}: payloads must hold at least one row, got 0")
    need = topk_payload_bytes(k, value_dtype)
    _check(
        payloads.shape[1] == need,
        f"{op}: a payload of k={k} entries with value_dtype {_name(value_dtype)} is {need} "
        f"bytes, but payloads rows are {payloads.shape[1]}",
    )


def _check_out(out: torch.Tensor, numel: int, dtype: torch.dtype, op: str) -> None:
    """A caller's ``out`` for an op that returns ``numel`` elements of ``dtype``."""
    if out.numel() != numel or out.dtype != dtype:
        raise ValueError(
            f"{op}: out must have {numel} elements of {dtype}, got {out.numel()} of {out.dtype}"
        )


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
    scale: torch.Tensor | None = None,
    average: torch.Tensor | None = None,
    beta: float = 0.0,
) -> torch.Tensor:
    """Packs ``x`` (+ ``residual``, updated in place) into one uint8 payload.

    With ``out`` (uint8, at least ``payload_bytes`` long) the payload is written there and
    ``out`` is returned: reusing a buffer saves an allocation and its page faults per call.

    With ``scale`` (a contiguous float32 tensor of x's size) the payload is that of
    ``x / scale``, rounded to x's dtype, and ``average`` (likewise, where given) first
    becomes ``beta * average + (1 - beta) * x * x``: a quantizer's normalize
    (reference.scale_down's arithmetic). ``x`` is left as it is: on the CPU the division
    happens as each block is read, in one pass over a float32 bucket.

    >>> p = quantize(torch.tensor([1.0, -0.5, 0.25, 0.0]), None, 8, 32)
    >>> p.numel(), p[:4].view(torch.float32).item(), p[4:8].tolist()
    (36, 1.0, [254, 63, 159, 127])
    """
    _check_ints(
        "quantize", bits=bits, block_size=block_size, seed=seed, step=step, rng_offset=rng_offset
    )
    _check_rounding(bits, stochastic, "quantize")
    if out is None:
        _check_bits_block(bits, block_size, "quantize")
        out = x.new_empty(payload_bytes(x.numel(), bits, block_size), dtype=torch.uint8)
    if scale is None:
        _check(
            average is None and beta == 0.0, "quantize: average and beta are for a scale: give one"
        )
        _ops.quantize_into(x, residual, out, bits, block_size, stochastic, seed, step, rng_offset)
        return out
    _check_scale_quantize(x, average, scale, beta, residual, out, bits, block_size)
    _ops.scale_quantize_into(
        x, average, scale, beta, residual, out, bits, block_size, stochastic, seed, step, rng_offset
    )
    return out


def dequantize(
    packed: torch.Tensor,
    numel: int,
    bits: int,
    block_size: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``numel`` values a payload encodes, in ``dtype`` (or written into ``out``), times
    ``scale`` elementwise where given (as :func:`dequantize_sum`).

    The native op is ``dequantize_sum`` of one row with divisor 1: the same bits, since the
    sum of one payload starts from 0 and x / 1 == x.
    """
    op = "dequantize"
    _check_ints(op, numel=numel, bits=bits, block_size=block_size)
    _check_payloads(packed, 1, numel, bits, block_size, dtype, op)
    if out is None:
        out = packed.new_empty(numel, dtype=dtype)
    else:
        _check_out(out, numel, dtype, op)
        _check_out_buffer(out, dtype, numel, packed.device, op)
        _check_apart(out, "out", packed, "packed", op)
    _check_float32_like(scale, "scale", out, "out", "dequantize_sum")
    _ops.dequantize_sum_into(packed.view(1, -1), out, bits, block_size, 1, scale)
    return out


def dequantize_sum(
    payloads: torch.Tensor,
    numel: int,
    bits: int,
    block_size: int,
    divisor: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-order fp32 sum of the [N, P] payloads' values, divided by ``divisor``, then
    (where given) multiplied by ``scale``, a contiguous float32 tensor of ``numel``
    elements, in one pass: ``out.mul_(scale)``'s numbers, with canonical NaNs.

    N >= 1, and P is exactly ``payload_bytes(numel, bits, block_size)``: a payload of other
    settings (another bit width, say) has another size and raises instead of decoding.
    """
    _check_ints("dequantize_sum", numel=numel, bits=bits, block_size=block_size, divisor=divisor)
    if out is None:
        _check_payloads(payloads, 2, numel, bits, block_size, dtype, "dequantize_sum")
        out = payloads.new_empty(numel, dtype=dtype)
    else:
        _check_out(out, numel, dtype, "dequantize_sum")
    _check_float32_like(scale, "scale", out, "out", "dequantize_sum")
    _ops.dequantize_sum_into(payloads, out, bits, block_size, divisor, scale)
    return out


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
    op = "dequantize_sum_requantize"
    _check_ints(
        op,
        numel=numel,
        bits=bits,
        block_size=block_size,
        divisor=divisor,
        seed=seed,
        step=step,
        rng_offset=rng_offset,
    )
    _check_payloads(payloads, 2, numel, bits, block_size, torch.float32, op)
    _check_rounding(bits, stochastic, op)
    out = payloads.new_empty(payload_bytes(numel, bits, block_size), dtype=torch.uint8)
    _ops.dequantize_sum_requantize_into(
        payloads,
        residual,
        out,
        numel,
        bits,
        block_size,
        divisor,
        stochastic,
        seed,
        step,
        rng_offset,
    )
    return out


def _check_quantize(x, residual, out, bits, block_size):
    op = "quantize"
    _check_bits_block(bits, block_size, op)
    _check_float_tensor(x, "x", op)
    _check_residual(residual, x.numel(), x.device, op)
    _check_out_buffer(out, torch.uint8, payload_bytes(x.numel(), bits, block_size), x.device, op)
    _check_apart(out, "out", x, "x", op)
    _check_apart(residual, "residual", x, "x", op)
    _check_apart(residual, "residual", out, "out", op)


@torch.library.register_fake("ddpcomm::quantize_into")
def _(x, residual, out, bits, block_size, stochastic=False, seed=0, step=0, rng_offset=0):
    _check_quantize(x, residual, out, bits, block_size)
    _check_rounding(bits, stochastic, "quantize")


def _check_scale_quantize(x, average, scale, beta, residual, out, bits, block_size):
    """checks.h check_scale_quantize."""
    op = "quantize"
    _check_quantize(x, residual, out, bits, block_size)
    _check(x.is_contiguous(), f"{op}: x must be contiguous when a scale is given")
    _check(
        isinstance(beta, float) and 0.0 <= beta < 1.0,
        f"{op}: beta must be a float in [0, 1), got {beta!r}",
    )
    _check_float32_like(scale, "scale", x, "x", op)
    _check_apart(residual, "residual", scale, "scale", op)
    _check_apart(out, "out", scale, "scale", op)
    if average is not None:
        _check_float32_like(average, "average", x, "x", op)
        _check_apart(average, "average", scale, "scale", op)
        _check_apart(residual, "residual", average, "average", op)
        _check_apart(out, "out", average, "average", op)


@torch.library.register_fake("ddpcomm::scale_quantize_into")
def _(x, average, scale, beta, residual, out, bits, block_size, stochastic=False, *args):
    _check_scale_quantize(x, average, scale, beta, residual, out, bits, block_size)
    _check_rounding(bits, stochastic, "quantize")


def _check_float32_like(t, arg, ref, ref_arg, op):
    """checks.h check_float32_like: ``t`` (if given) a contiguous float32 tensor of
    ``ref``'s size on its device, apart from it."""
    if t is None:
        return
    _check(
        t.dtype == torch.float32
        and t.is_contiguous()
        and t.numel() == ref.numel()
        and t.device == ref.device,
        f"{op}: {arg} must be a contiguous float32 tensor of {ref_arg}'s {ref.numel()} elements "
        f"on {ref.device}, got {_name(t.dtype)} of {t.numel()} on {t.device}",
    )
    _check_apart(t, arg, ref, ref_arg, op)


@torch.library.register_fake("ddpcomm::dequantize_sum_into")
def _(payloads, out, bits, block_size, divisor, scale=None):
    op = "dequantize_sum"
    _check_payloads(payloads, 2, out.numel(), bits, block_size, out.dtype, op)
    _check_out_buffer(out, out.dtype, out.numel(), payloads.device, op)
    _check(divisor >= 1, f"{op}: divisor must be >= 1, got {divisor}")
    _check_apart(out, "out", payloads, "payloads", op)
    _check_float32_like(scale, "scale", out, "out", op)


@torch.library.register_fake("ddpcomm::dequantize_sum_requantize_into")
def _(
    payloads,
    residual,
    out,
    numel,
    bits,
    block_size,
    divisor,
    stochastic=False,
    seed=0,
    step=0,
    rng_offset=0,
):
    op = "dequantize_sum_requantize"
    _check_payloads(payloads, 2, numel, bits, block_size, torch.float32, op)
    _check_rounding(bits, stochastic, op)
    _check_residual(residual, numel, payloads.device, op)
    _check(divisor >= 1, f"{op}: divisor must be >= 1, got {divisor}")
    need = payload_bytes(numel, bits, block_size)
    _check_out_buffer(out, torch.uint8, need, payloads.device, op)
    _check_apart(out, "out", payloads, "payloads", op)
    _check_apart(residual, "residual", payloads, "payloads", op)
    _check_apart(residual, "residual", out, "out", op)


# --------------------------------------------------------------------------------------
# Multi-tensor flatten family (csrc/flatten.h, csrc/cpu/flatten.cpp)
# --------------------------------------------------------------------------------------


def _tensor_list(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], op: str):
    # A Tensor is iterable (over its first dim), so it must be refused explicitly.
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(
            f"{op}: tensors must be a list or tuple of tensors, got {type(tensors).__name__}"
        )
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        # A sparse tensor would reach the dispatcher, which has no sparse kernel to name.
        _check_strided(t, f"tensors[{i}]", op)
    return tensors


def _check_strided(t: torch.Tensor, arg: str, op: str) -> None:
    if t.layout != torch.strided:
        raise TypeError(
            f"{op}: {arg} must be a strided (dense) tensor, got layout {_layout(t.layout)}"
        )


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
    _check_strided(out, "out", "flatten_into")
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
    _check_strided(flat, "flat", "unflatten_into")
    _ops.unflatten_into(flat, tensors)


_LAYOUT_NAMES = {
    torch.strided: "Strided",
    torch.sparse_coo: "Sparse",
    torch.sparse_csr: "SparseCsr",
    torch.sparse_csc: "SparseCsc",
    torch.sparse_bsr: "SparseBsr",
    torch.sparse_bsc: "SparseBsc",
}


def _layout(layout: torch.layout) -> str:
    return _LAYOUT_NAMES.get(layout, str(layout))


def _check_flatten_list(tensors, dtype, device, ref, op):
    """The fake-tensor twin of csrc/flatten.h check_flatten_list (same errors)."""
    for i, t in enumerate(tensors):
        _check_strided(t, f"tensors[{i}]", op)
        if t.dtype != dtype:
            raise TypeError(
                f"{op}: tensors[{i}] has dtype {_name(t.dtype)} but {ref} has {_name(dtype)}; "
                "one call handles one dtype (group the tensors by dtype)"
            )
        if t.device != device:
            raise ValueError(
                f"{op}: tensors[{i}] is on {t.device} but {ref} is on {device}; one call "
                "handles one device"
            )


def _check_flat_buffer(flat, total, arg, op):
    """The fake-tensor twin of csrc/flatten.h check_flat_buffer (same errors)."""
    if flat.layout != torch.strided:
        raise TypeError(f"{op}: {arg} must be a strided tensor, got layout {_layout(flat.layout)}")
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
        raise ValueError(
            "flatten: tensors must not be empty (the result takes its dtype and device from "
            "them); use flatten_into to fill a given buffer"
        )
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


# --------------------------------------------------------------------------------------
# Sparsification family (top-k, random-k)
# --------------------------------------------------------------------------------------


def topk_payload_bytes(k: int, value_dtype: torch.dtype = torch.float32) -> int:
    """Bytes of a packed top-k payload: k int32 indices, then k values in ``value_dtype``
    (float32 when None)."""
    return k * (4 + (4 if value_dtype is None else value_dtype.itemsize))


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
    ``value_dtype`` (float32 when None); a finite value beyond the dtype's range is sent as
    its largest finite value (65504 for float16), not Inf. With a residual (error feedback),
    the residual becomes e at every unselected entry and what the value cast (and that
    saturation) lost at the selected ones (0 for float32 values). Exact mode (default)
    picks the k largest |e|, ties to the lower index; approximate mode derives its
    threshold from a sample keyed by (seed, step). NaN and Inf rank above every finite
    magnitude. See reference.topk_compress. With ``out`` (uint8, exactly
    ``topk_payload_bytes(k, value_dtype)`` long) the payload is written there and ``out``
    returned.

    >>> p = topk_compress(torch.tensor([0.5, -3.0, 1.0, 2.0]), None, 2)
    >>> p[:8].view(torch.int32).tolist(), p[8:].view(torch.float32).tolist()
    ([1, 3], [-3.0, 2.0])
    """
    _check_ints("topk_compress", k=k, seed=seed, step=step)
    if out is None:
        op = "topk_compress"
        vdtype = torch.float32 if value_dtype is None else value_dtype
        _check_value_dtype(vdtype, op)
        _check_sparse_numel_k(x.numel(), k, op)
        out = x.new_empty(topk_payload_bytes(k, vdtype), dtype=torch.uint8)
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
    check: bool = True,
) -> torch.Tensor:
    """Dense sum of N packed top-k payloads ([N, bytes] uint8) divided by ``divisor``.

    Rows are added in row (rank) order in fp32 (the kernels' own accumulators, whatever
    ``dtype``), so an index present in several rows sums in rank order; the result is cast
    to ``dtype`` once. With ``out`` the result is written there (no allocation).

    ``check`` validates every row's indices (strictly increasing, in [0, numel)) and raises
    for a bad row before anything is added. On CUDA that reads the verdict back to the host,
    a synchronization; ``check=False`` skips the validation for payloads made by
    :func:`topk_compress` (the collectives' own). A malformed row then gives unspecified
    sums, but nothing is written outside ``out``.
    """
    op = "sparse_accumulate"
    _check_ints(op, numel=numel, k=k, divisor=divisor)
    if out is None:
        _check_sparse_numel_k(numel, k, op)
        _check_divisor_dtype(divisor, dtype, op)
        out = payloads.new_empty(numel, dtype=dtype)
    else:
        _check_out(out, numel, dtype, op)
    _ops.sparse_accumulate_into(payloads, out, k, divisor, value_dtype, check)
    return out


def _check_strata(start, end, k, op):
    """checks.h check_strata: strata [start, end) of k (end -1: k); returns end resolved."""
    last = k if end == -1 else end
    _check(
        0 <= start <= last <= k,
        f"{op}: start and end must satisfy 0 <= start <= end <= k={k} (end=-1: k), got "
        f"start={start}, end={end}",
    )
    return last


def randk_compress(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    k: int,
    seed: int,
    step: int,
    bucket: int,
    out: torch.Tensor | None = None,
    start: int = 0,
    end: int | None = None,
) -> torch.Tensor:
    """The fp32 values of e = x (+ ``residual``) at k random-k indices (reference.randk_indices).

    The indices depend only on (numel, k, seed, step, bucket), so every rank draws the same
    ones and the values can be all-reduced directly. With a residual it becomes e, and 0 at
    the sent entries. Returns the k values, in ``out`` when given (float32, k elements).

    ``start``, ``end`` (None: k): only strata [start, end) are computed, into
    ``out[start:end]``; they read and update one contiguous range of x and the residual
    (reference.randk_strata), and a non-finite entry there makes only their values NaN
    (reference.randk_compress). A bucket is then compressed in pieces with the bits of one
    call wherever it is finite.
    """
    op = "randk_compress"
    _check_ints(op, k=k, seed=seed, step=step, bucket=bucket, start=start)
    if end is not None:
        _check_ints(op, end=end)
    _check_sparse_input(x, residual, k, op)
    if out is None:
        out = x.new_empty(k, dtype=torch.float32)
    else:
        _check_out(out, k, torch.float32, op)
    _ops.randk_compress_into(
        x, residual, out, seed, step, bucket, start, -1 if end is None else end
    )
    return out


def randk_decompress(
    values: torch.Tensor,
    numel: int,
    seed: int,
    step: int,
    bucket: int,
    divisor: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    start: int = 0,
    end: int | None = None,
) -> torch.Tensor:
    """Dense ``numel`` tensor holding ``values / divisor`` at the random-k indices, else 0
    (written into ``out`` when given).

    ``start``, ``end`` (None: k = values.numel()): only the elements of strata
    [start, end) are written (reference.randk_strata), from ``values[start:end]``; the
    rest of ``out`` is left as it is (without ``out``, uninitialized).
    """
    op = "randk_decompress"
    _check_ints(op, numel=numel, seed=seed, step=step, bucket=bucket, divisor=divisor, start=start)
    if end is not None:
        _check_ints(op, end=end)
    if out is None:
        _check_divisor_dtype(divisor, dtype, op)
        _check_sparse_numel_k(numel, values.numel(), op)
        out = values.new_empty(numel, dtype=dtype)
    else:
        _check_out(out, numel, dtype, op)
    _ops.randk_decompress_into(
        values, out, seed, step, bucket, divisor, start, -1 if end is None else end
    )
    return out


@torch.library.register_fake("ddpcomm::topk_compress_into")
def _(x, residual, out, k, approximate=False, seed=0, step=0, value_dtype=None):
    op = "topk_compress"
    _check_sparse_input(x, residual, k, op)
    vdtype = torch.float32 if value_dtype is None else value_dtype
    _check_value_dtype(vdtype, op)
    _check_topk_out(out, k, vdtype, op)
    _check(out.device == x.device, f"{op}: out is on {out.device} but x is on {x.device}")
    _check_apart(out, "out", x, "x", op)
    _check_apart(residual, "residual", x, "x", op)
    _check_apart(residual, "residual", out, "out", op)


@torch.library.register_fake("ddpcomm::sparse_accumulate_into")
def _(payloads, out, k, divisor, value_dtype, check=True):
    op = "sparse_accumulate"
    _check_sparse_payloads(payloads, out.numel(), k, value_dtype, op)
    _check_divisor_dtype(divisor, out.dtype, op)
    _check(out.is_contiguous(), f"{op}: out must be contiguous")
    _check(
        out.device == payloads.device,
        f"{op}: out is on {out.device} but payloads are on {payloads.device}",
    )
    _check_apart(out, "out", payloads, "payloads", op)


@torch.library.register_fake("ddpcomm::randk_compress_into")
def _(x, residual, out, seed, step, bucket, start=0, end=-1):
    op = "randk_compress"
    _check_sparse_input(x, residual, out.numel(), op)
    _check(
        out.dtype == torch.float32 and out.is_contiguous(),
        f"{op}: out must be a contiguous float32 tensor of k elements, got {_name(out.dtype)}",
    )
    _check(out.device == x.device, f"{op}: out is on {out.device} but x is on {x.device}")
    _check_apart(out, "out", x, "x", op)
    _check_apart(residual, "residual", x, "x", op)
    _check_apart(residual, "residual", out, "out", op)
    _check_strata(start, end, out.numel(), op)


@torch.library.register_fake("ddpcomm::randk_decompress_into")
def _(values, out, seed, step, bucket, divisor, start=0, end=-1):
    op = "randk_decompress"
    _check_float_tensor(values, "values", op)
    _check(values.dim() == 1, f"{op}: values must be 1-D, got {values.dim()} dimensions")
    _check(out.is_contiguous(), f"{op}: out must be contiguous")
    _check_sparse_numel_k(out.numel(), values.numel(), op)
    _check_divisor_dtype(divisor, out.dtype, op)
    _check(
        out.device == values.device,
        f"{op}: out is on {out.device} but values are on {values.device}",
    )
    _check_apart(out, "out", values, "values", op)
    _check_strata(start, end, values.numel(), op)
