"""CUDA sparsification ops against the CPU ops, bit for bit (payload bytes, residuals,
dense results). Indices and values are selected by integer keys and summed in rank order on
both devices, so no tolerance is needed; NaNs compare by position (see test_cuda_ops)."""

from __future__ import annotations

import pytest
import torch

from ddpcomm import ops
from tests.cuda_utils import DTYPES, assert_same_bits, assert_same_bytes, needs_cuda

SIZES = [1, 7, 4095, 4097, 278011, (1 << 20) + 3]


def values_like(n: int, dtype: torch.dtype, seed: int, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    if ties:  # few distinct magnitudes: the k-th largest key is shared by many entries
        x = torch.round(x * 2) / 2
    return x.to(dtype)


def ks(n: int) -> list[int]:
    return sorted({1, max(1, n // 100), max(1, n // 3), n})


def check_topk(x, k, *, ef, approximate, value_dtype=None, seed=5, step=2):
    res = (torch.randn(x.numel(), generator=torch.Generator().manual_seed(9)) * 0.1) if ef else None
    res_gpu = res.clone().cuda() if ef else None
    want = ops.topk_compress(x, res, k, approximate, seed, step, value_dtype)
    got = ops.topk_compress(x.cuda(), res_gpu, k, approximate, seed, step, value_dtype)
    assert_same_bytes(got, want)
    if ef:
        assert_same_bits(res_gpu, res)


@needs_cuda
@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("n", SIZES)
def test_topk_compress_matches_cpu(n, approximate):
    for dtype in DTYPES:
        x = values_like(n, dtype, seed=n)
        for k in ks(n):
            check_topk(x, k, ef=False, approximate=approximate)
            check_topk(x, k, ef=True, approximate=approximate)


@needs_cuda
@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("value_dtype", DTYPES, ids=str)
def test_topk_compress_ties_and_value_dtypes(value_dtype, approximate):
    # Many equal magnitudes: ties must go to the lowest indices on both devices; odd k
    # puts fp16/bf16 payload values 2 bytes off a word boundary in sparse_accumulate rows.
    x = values_like(100003, torch.float32, seed=1, ties=True)
    for k in (1, 999, 5001, 33333):
        check_topk(x, k, ef=True, approximate=approximate, value_dtype=value_dtype)


@needs_cuda
@pytest.mark.parametrize("approximate", [False, True])
def test_topk_compress_sample_misses(approximate):
    # All-equal magnitudes except a few: the sampled threshold keeps far fewer or far more
    # than k entries, exercising exact mode's fallback and approximate mode's padding.
    x = torch.ones(300000)
    x[::1000] = 5.0
    for k in (10, 299, 301, 5000, 299999):
        check_topk(x, k, ef=True, approximate=approximate)
        check_topk(x, k, ef=False, approximate=approximate)


@needs_cuda
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_topk_compress_non_finite(bad):
    x = values_like(50000, torch.float32, seed=3)
    x[1234] = bad
    x[40000] = bad
    for approximate in (False, True):
        check_topk(x, 100, ef=True, approximate=approximate)


@needs_cuda
@pytest.mark.parametrize("value_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sparse_accumulate_matches_cpu(dtype, value_dtype):
    for n in (1, 4097, 278011):
        for k in sorted({1, max(1, n // 50), n}):
            rows = torch.stack(
                [
                    ops.topk_compress(
                        values_like(n, torch.float32, seed=r), None, k, value_dtype=value_dtype
                    )
                    for r in range(3)
                ]
            )
            for divisor in (1, 3):
                want = ops.sparse_accumulate(rows, n, k, divisor, value_dtype, dtype)
                got = ops.sparse_accumulate(rows.cuda(), n, k, divisor, value_dtype, dtype)
                assert_same_bits(got, want)


@needs_cuda
def test_sparse_accumulate_rejects_bad_indices_like_cpu():
    n, k = 1000, 10
    rows = torch.stack(
        [ops.topk_compress(values_like(n, torch.float32, seed=r), None, k) for r in range(2)]
    )
    for bad_index in (5000, -1):
        p = rows.clone()
        p[1, 4 * 3 : 4 * 4] = torch.tensor([bad_index], dtype=torch.int32).view(torch.uint8)
        with pytest.raises(RuntimeError) as cpu_err:
            ops.sparse_accumulate(p, n, k, 1, torch.float32, torch.float32)
        with pytest.raises(RuntimeError) as gpu_err:
            ops.sparse_accumulate(p.cuda(), n, k, 1, torch.float32, torch.float32)
        assert str(cpu_err.value).splitlines()[0] == str(gpu_err.value).splitlines()[0]


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_randk_matches_cpu(n, dtype):
    x = values_like(n, dtype, seed=n)
    for k in ks(n):
        for ef in (False, True):
            res = torch.randn(n) * 0.1 if ef else None
            res_gpu = res.clone().cuda() if ef else None
            want = ops.randk_compress(x, res, k, 11, 4, 2)
            got = ops.randk_compress(x.cuda(), res_gpu, k, 11, 4, 2)
            assert_same_bits(got, want)
            if ef:
                assert_same_bits(res_gpu, res)
            for out_dtype in DTYPES:
                want_d = ops.randk_decompress(want, n, 11, 4, 2, 3, out_dtype)
                got_d = ops.randk_decompress(got, n, 11, 4, 2, 3, out_dtype)
                assert_same_bits(got_d, want_d)


@needs_cuda
def test_randk_non_finite_anywhere_poisons_every_value():
    x = values_like(10000, torch.float32, seed=1)
    x[7777] = float("inf")
    for res in (None, torch.zeros(10000)):
        want = ops.randk_compress(x, res, 10, 1, 2, 3)
        got = ops.randk_compress(x.cuda(), None if res is None else res.cuda(), 10, 1, 2, 3)
        assert torch.isnan(got).all()
        assert_same_bits(got, want)


@needs_cuda
@pytest.mark.parametrize("offset", [0, 1, 2])
def test_topk_compress_into_matches_cpu(offset):
    # `out` a byte slice at an odd offset: the payload goes through an aligned buffer.
    n, k = 100003, 1000
    x = values_like(n, torch.float32, seed=4)
    want = ops.topk_compress(x, None, k, value_dtype=torch.float16)
    buf = torch.zeros(want.numel() + offset, dtype=torch.uint8, device="cuda")
    got = ops.topk_compress(x.cuda(), None, k, value_dtype=torch.float16, out=buf[offset:])
    assert_same_bytes(got, want)
    assert_same_bytes(buf[offset:], want)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sparse_accumulate_and_randk_into_match_cpu(dtype):
    n, k = 50001, 777
    rows = torch.stack(
        [ops.topk_compress(values_like(n, torch.float32, seed=r), None, k) for r in range(3)]
    )
    scratch = torch.empty(n) if dtype != torch.float32 else None
    want = ops.sparse_accumulate(
        rows, n, k, 3, torch.float32, dtype, out=torch.empty(n, dtype=dtype), scratch=scratch
    )
    got = ops.sparse_accumulate(
        rows.cuda(),
        n,
        k,
        3,
        torch.float32,
        dtype,
        out=torch.empty(n, dtype=dtype, device="cuda"),
        scratch=None if scratch is None else scratch.cuda(),
    )
    assert_same_bits(got, want)
    values = ops.randk_compress(values_like(n, torch.float32, seed=9), None, k, 1, 2, 3)
    want = ops.randk_decompress(values, n, 1, 2, 3, 3, dtype, out=torch.empty(n, dtype=dtype))
    got = ops.randk_decompress(
        values.cuda(), n, 1, 2, 3, 3, dtype, out=torch.full((n,), 7.0, dtype=dtype, device="cuda")
    )
    assert_same_bits(got, want)
