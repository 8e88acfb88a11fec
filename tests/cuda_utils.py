"""Helpers of the op tests: the CUDA skip marker, the oracle per device, bitwise comparisons.

Bits compare exactly, NaNs included: IEEE leaves a NaN's sign and payload to the hardware,
so every op writes its dtype's canonical NaN (csrc/numerics.h) and both devices agree.
"""

from __future__ import annotations

import pytest
import torch

from ddpcomm import ops
from ddpcomm import reference as ref

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="no CUDA device (torch.cuda.is_available() is False)"
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def oracle(device: str):
    """What an op on ``device`` must equal bit for bit, called with CPU tensors: reference.py
    (the spec) for the CPU op, the CPU op (held to the spec by the CPU case) for CUDA."""
    return ref if device == "cpu" else ops


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise equality of float tensors, NaN payloads included."""
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = got.cpu().contiguous().reshape(-1), want.cpu().contiguous().reshape(-1)
    gi, wi = got.view(_INT_VIEW[got.dtype]), want.view(_INT_VIEW[want.dtype])
    diff = gi != wi
    if diff.any():
        i = int(diff.nonzero()[0])
        mask = (1 << (8 * got.element_size())) - 1
        raise AssertionError(
            f"{int(diff.sum())} of {got.numel()} values differ; first at {i}: got "
            f"{got[i].item()!r} (bits {int(gi[i]) & mask:#x}), want "
            f"{want[i].item()!r} (bits {int(wi[i]) & mask:#x})"
        )


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    """Byte equality of any two tensors of one dtype and shape."""
    assert got.dtype == want.dtype and got.shape == want.shape
    got = got.cpu().contiguous().reshape(-1).view(torch.uint8)
    want = want.cpu().contiguous().reshape(-1).view(torch.uint8)
    diff = got != want
    if diff.any():
        i = int(diff.nonzero()[0])
        raise AssertionError(f"{int(diff.sum())} of {got.numel()} bytes differ; first at {i}")
