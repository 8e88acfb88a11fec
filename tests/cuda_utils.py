"""Helpers shared by the CUDA test modules: the skip marker and bitwise comparisons.

NaNs compare by position only: IEEE leaves a NaN's sign and mantissa bits to the hardware
(an x86 core keeps the operand's NaN, a GPU returns its canonical one), so the payload of
a NaN computed on each device may differ while every other bit must not.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="no CUDA device (torch.cuda.is_available() is False)"
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bitwise equality of float tensors, NaNs compared by position."""
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    gnan, wnan = torch.isnan(got), torch.isnan(want)
    assert torch.equal(gnan, wnan), f"NaN positions differ: {int((gnan != wnan).sum())}"
    gi, wi = got.view(_INT_VIEW[got.dtype]), want.view(_INT_VIEW[want.dtype])
    diff = (gi != wi) & ~gnan
    if diff.any():
        i = int(diff.nonzero()[0])
        raise AssertionError(
            f"{int(diff.sum())} of {got.numel()} values differ; first at {i}: "
            f"got {got.view(-1)[i].item()!r}, want {want.view(-1)[i].item()!r}"
        )


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype == torch.uint8 and got.shape == want.shape
    diff = got != want
    if diff.any():
        i = int(diff.nonzero()[0])
        raise AssertionError(f"{int(diff.sum())} of {got.numel()} bytes differ; first at {i}")
