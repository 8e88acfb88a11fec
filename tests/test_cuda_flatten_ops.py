"""CUDA multi-tensor flatten ops against the CPU ops: byte-identical flat buffers and
round trips, over lists mixing odd sizes, empty and 0-dim tensors, strided views and
narrow dtypes (pieces at every alignment), and lists longer than one launch's table."""

from __future__ import annotations

import pytest
import torch

from ddpcomm import ops
from tests.cuda_utils import needs_cuda

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.bool, torch.float64]


def _random(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return torch.randint(-128, 127, shape, generator=gen).to(dtype)


def mixed_list(dtype, count=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 5000, (count,), generator=gen).tolist()
    tensors = [_random((s,), dtype, gen) for s in sizes]
    base = _random((37, 23), dtype, gen)
    tensors += [
        _random((), dtype, gen),
        base.t(),
        base[3:30:4, 1::3],
        base[5],
        _random((278011,), dtype, gen),
        _random((0, 5), dtype, gen),
    ]
    return tensors


def same_bytes(a, b):
    """Byte equality (NaN payloads and -0.0 included), 0-dim tensors too."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8))


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("count", [1, 40, 1000, 2500])
def test_flatten_matches_cpu(dtype, count):
    tensors = mixed_list(dtype, count)
    want = ops.flatten(tensors)
    got = ops.flatten([t.cuda() for t in tensors])
    assert got.is_cuda and same_bytes(got, want)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flatten_into_and_unflatten_into_round_trip(dtype):
    tensors = [t.cuda() for t in mixed_list(dtype, 300, seed=1)]
    total = sum(t.numel() for t in tensors)
    buf = torch.zeros(total + 3, dtype=dtype, device="cuda")
    out = buf[1 : 1 + total]  # an offset view: pieces at new alignments
    ops.flatten(tensors, out=out)
    assert same_bytes(out, ops.flatten([t.cpu() for t in tensors]))
    assert not bool(buf[0].bool()) and not bool(buf[-2:].bool().any())
    targets = [torch.zeros_like(t) for t in tensors]
    # Non-contiguous destinations too: a transposed view of a fresh matrix.
    m = torch.zeros(37, 23, dtype=dtype, device="cuda")
    targets[-5] = m.t()
    ops.unflatten_into(out, targets)
    for t, u in zip(tensors, targets, strict=True):
        assert same_bytes(u, t)


@needs_cuda
def test_flatten_errors_match_cpu():
    a = torch.zeros(3, device="cuda")
    with pytest.raises(TypeError, match="one call handles one dtype"):
        ops.flatten([a, a.half()])
    with pytest.raises(ValueError, match="one call handles one device"):
        ops.flatten([a, a.cpu()])
    with pytest.raises(ValueError, match="shares memory with out"):
        ops.flatten([a], out=a)
