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
