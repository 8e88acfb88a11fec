"""Sparsification ops (top-k, random-k) on every device: bitwise against the oracle
(reference.py for the CPU op, the CPU op for CUDA), against torch.topk, opcheck, canonical
NaNs, bad input, and (CUDA) no host synchronization."""

from __future__ import annotations

import math

import pytest
import torch

import ddpcomm.ops as ops
import ddpcomm.reference as ref
from tests.cuda_utils import (
    DTYPES,
    assert_same_bits,
    assert_same_bytes,
    needs_cuda,
    oracle,
)

# Odd sizes: single element, around a 256-element scan block, the apex size, and one past
# the CPU scan's 65536-element chunk so candidates come from several chunks. CUDA adds sizes
# around its 4096-element tile and one past 2^20 (cheap against the CPU op).
SIZES = [1, 2, 255, 257, 278011, 65536 * 3 + 5]
CUDA_SIZES = [7, 4095, 4097, (1 << 20) + 3]


def sizes(device: str) -> list[int]:
    return SIZES + (CUDA_SIZES if device == "cuda" else [])


def k_for(n: int, ratio: float) -> int:
    return max(1, math.ceil(ratio * n))


def ks(n: int) -> list[int]:
    return sorted({1, k_for(n, 0.01), max(1, n // 100), k_for(n, 0.3), max(1, n // 3), n})


def split(payload: torch.Tensor, k: int, value_dtype=torch.float32):
    payload = payload.cpu()
    idx = payload[: 4 * k].clone().view(torch.int32).long()
    return idx, payload[4 * k :].clone().view(value_dtype)


def gen(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


def values_like(n: int, dtype: torch.dtype, seed: int, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    if ties:  # few distinct magnitudes: the k-th largest key is shared by many entries
        x = torch.round(x * 2) / 2
    return x.to(dtype)


def _nan(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def check_topk(device, x, res, k, approximate, seed=5, step=2, value_dtype=None):
    """topk_compress on `device` against the oracle: payload bytes and residual bits."""
    res_got = None if res is None else res.clone().to(device)
    res_want = None if res is None else res.clone()
    args = (k, approximate, seed, step, value_dtype)
    got = ops.topk_compress(x.to(device), res_got, *args)
    assert got.device.type == device
    assert_same_bytes(got, oracle(device).topk_compress(x, res_want, *args))
    if res is not None:
        assert_same_bits(res_got, res_want)
    return got


# ---------------------------------------------------------------------------------------
# topk_compress
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_topk_matches_reference(device, dtype, approximate):
    for n in sizes(device):
        x = gen(n, dtype, n)
        for k in ks(n):
            check_topk(device, x, gen(n, torch.float32, n + 1) * 0.1, k, approximate, 5, k)
            check_topk(device, x, None, k, approximate, 7, 1, value_dtype=dtype)


@pytest.mark.parametrize("n", [257, 278011])
def test_topk_exact_is_torch_topk(device, n):
    """Independent of reference.py: same magnitudes as torch.topk, indices ascending."""
    x = gen(n, torch.float32, 3)
    k = k_for(n, 0.01)
    idx, val = split(ops.topk_compress(x.to(device), None, k), k)
    assert torch.all(idx[1:] > idx[:-1])
    assert torch.equal(val, x[idx])
    want = torch.topk(x.abs(), k).values
    assert torch.equal(val.abs().sort(descending=True).values, want)


def test_topk_ties_go_to_lower_index(device):
    x = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 2.0, 1.0], device=device)
    idx, val = split(ops.topk_compress(x, None, 3), 3)
    assert idx.tolist() == [1, 2, 4] and val.tolist() == [-2.0, 2.0, -2.0]
    zeros = torch.zeros(1000, device=device)
    for approximate in (False, True):
        idx, _ = split(ops.topk_compress(zeros, None, 10, approximate), 10)
        assert idx.tolist() == list(range(10))


def test_topk_k_equals_n_sends_everything(device):
    x = gen(1001, torch.float32)
    res = torch.full((1001,), 0.25, device=device)
    e = x + 0.25
    idx, val = split(ops.topk_compress(x.to(device), res, 1001), 1001)
    assert idx.tolist() == list(range(1001))
    assert torch.equal(val, e)
    assert torch.count_nonzero(res) == 0


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("value_dtype", DTYPES, ids=str)
def test_topk_ties_and_value_dtypes(device, value_dtype, approximate):
    # Many equal magnitudes: ties must go to the lowest indices; odd k puts fp16/bf16 payload
    # values 2 bytes off a word boundary in sparse_accumulate rows.
    x = values_like(100003, torch.float32, seed=1, ties=True)
    res = torch.randn(x.numel(), generator=torch.Generator().manual_seed(9)) * 0.1
    for k in (1, 999, 5001, 33333):
        check_topk(device, x, res, k, approximate, value_dtype=value_dtype)


def _sample_misses(e: torch.Tensor, k: int, approximate: bool) -> bool:
    """Whether the seed-0/step-0 sample's threshold keeps fewer than k entries of e."""
    n = e.numel()
    s = min(n, ref.TOPK_SAMPLE_MAX)
    m = k * s // n
    rank = m + math.isqrt(m) if approximate else m + 4 * (math.isqrt(m) + 1) + 8
    keys = ref.magnitude_key(e[ref.topk_sample_indices(n, 0, 0)]).sort(descending=True).values
    return int((ref.magnitude_key(e) >= keys[rank]).sum()) < k


def adversarial(n: int = 16384) -> torch.Tensor:
    """Large values exactly at the positions the sample draws more than once, so the
    sample (which counts them with multiplicity) overestimates the threshold."""
    x = gen(n, torch.float32, 11) * 1e-3
    drawn, counts = ref.topk_sample_indices(n, 0, 0).unique(return_counts=True)
    x[drawn[counts > 1]] = 10.0 + torch.arange(int((counts > 1).sum())).float()
    return x


@pytest.mark.parametrize("approximate", [False, True])
def test_topk_when_the_sample_misses(device, approximate):
    """Exact mode's fallback (CPU: histogram threshold; CUDA: selection over every entry)
    and approximate mode's fill-up path."""
    x, k = adversarial(), 1000
    assert _sample_misses(x, k, approximate)
    got = check_topk(device, x, torch.zeros_like(x), k, approximate, 0, 0)
    exact = ops.topk_compress(x.to(device), None, k)
    if approximate:
        # Filled up with low indices: not the exact set, but every candidate is in it.
        assert not torch.equal(got, exact)
    else:
        idx, val = split(exact, k)
        assert torch.equal(val.abs().sort(descending=True).values, torch.topk(x.abs(), k).values)


@pytest.mark.parametrize("approximate", [False, True])
def test_topk_threshold_ties(device, approximate):
    # All-equal magnitudes except a few: the sampled threshold keeps far fewer or far more
    # than k entries (more than the CUDA candidate buffer holds: its dense path).
    x = torch.ones(300000)
    x[::1000] = 5.0
    res = torch.randn(x.numel(), generator=torch.Generator().manual_seed(9)) * 0.1
    for k in (10, 299, 301, 5000, 299999):
        check_topk(device, x, res, k, approximate)
        check_topk(device, x, None, k, approximate)


def test_topk_approximate_depends_on_seed_only(device):
    x = adversarial().to(device)
    a = ops.topk_compress(x, None, 1000, True, seed=0, step=0)
    assert_same_bytes(a, ops.topk_compress(x, None, 1000, True, seed=0, step=0))
    assert not torch.equal(a, ops.topk_compress(x, None, 1000, True, seed=1, step=0))


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_topk_selects_non_finite(device, approximate, bad):
    x = gen(278011, torch.float32, 2)
    x[123457] = bad
    for k in (1, 2781):
        idx, val = split(
            ops.topk_compress(x.to(device), torch.zeros_like(x, device=device), k, approximate), k
        )
        assert 123457 in idx.tolist()
        assert not torch.isfinite(val).all()
    x = values_like(50000, torch.float32, seed=3)
    x[1234] = bad
    x[40000] = bad
    check_topk(device, x, torch.randn(50000) * 0.1, 100, approximate)


@pytest.mark.parametrize("value_dtype", DTYPES, ids=str)
def test_topk_error_feedback_conserves_e(device, value_dtype):
    """Dense(payload) + new residual == x + old residual, exactly, for every value dtype."""
    n, k = 278011, 2781
    x = gen(n, torch.float32, 4).to(device)
    res = gen(n, torch.float32, 5).to(device)
    e = x + res
    payload = ops.topk_compress(x, res, k, value_dtype=value_dtype)
    dense = ops.sparse_accumulate(payload[None], n, k, 1, value_dtype, torch.float32)
    assert torch.equal(dense + res, e)
    idx, _ = split(payload, k, value_dtype)
    mask = torch.ones(n, dtype=torch.bool)
    mask[idx] = False
    assert torch.equal(res.cpu()[mask], e.cpu()[mask])


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("value_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_topk_values_saturate_and_the_residual_keeps_the_rest(device, value_dtype, approximate):
    """A finite |e| beyond the value dtype's range goes on the wire as its largest finite
    value (65504 for float16), not Inf; the residual keeps e - sent. Inf and NaN are sent
    as they are."""
    top = torch.finfo(value_dtype).max
    big = [1e5, -7e4, 65520.0, -3.4e38, 3.39e38, 65504.0]
    x = gen(1000, torch.float32, 6) * 1e-3
    x[10 : 10 + len(big)] = torch.tensor(big)
    res = torch.zeros(1000)
    got = check_topk(device, x, res, len(big), approximate, value_dtype=value_dtype)
    idx, val = split(got, len(big), value_dtype)
    assert idx.tolist() == list(range(10, 10 + len(big)))
    e = torch.tensor(big)
    want = torch.where(e.abs() > top, e.sign() * top, e.to(value_dtype).float())
    assert torch.equal(val.float(), want) and bool(val.isfinite().all())
    r = res.clone().to(device)
    payload = ops.topk_compress(x.to(device), r, len(big), approximate, value_dtype=value_dtype)
    dense = ops.sparse_accumulate(payload[None], 1000, len(big), 1, value_dtype, torch.float32)
    assert torch.equal(dense + r, x.to(device))  # nothing lost
    assert r.cpu()[10].item() == 1e5 - top or value_dtype == torch.bfloat16
    x[12] = float("inf")
    x[13] = float("nan")
    got = check_topk(device, x, res, len(big), approximate, value_dtype=value_dtype)
    _, val = split(got, len(big), value_dtype)
    assert val[2].item() == float("inf") and math.isnan(val[3].item())


def test_topk_approximate_close_to_exact(device):
    """On a Gaussian bucket the approximate selection keeps >= 97% of the exact top-k's
    L2 mass: its threshold keeps >= k candidates (then it is exact) in ~84% of sample
    draws, and otherwise fills up a few percent of k (bench sparse: 99.8% mean)."""
    n = 1 << 20
    x = gen(n, torch.float32, 6).to(device)
    k = k_for(n, 0.01)
    mass = []
    for approximate in (False, True):
        _, val = split(ops.topk_compress(x, None, k, approximate, seed=3, step=9), k)
        mass.append(float(val.double().pow(2).sum()))
    assert mass[1] <= mass[0] and mass[1] >= 0.97 * mass[0]


@pytest.mark.parametrize("offset", [0, 1, 2])
def test_topk_into_a_byte_slice(device, offset):
    # `out` a byte slice at an odd offset (CUDA: the payload goes through an aligned buffer).
    n, k = 100003, 1000
    x = values_like(n, torch.float32, seed=4)
    want = oracle(device).topk_compress(x, None, k, value_dtype=torch.float16)
    buf = torch.zeros(want.numel() + offset, dtype=torch.uint8, device=device)
    got = ops.topk_compress(x.to(device), None, k, value_dtype=torch.float16, out=buf[offset:])
    assert_same_bytes(got, want)
    assert_same_bytes(buf[offset:], want)


# ---------------------------------------------------------------------------------------
# sparse_accumulate
# ---------------------------------------------------------------------------------------


def topk_rows(n, k, value_dtype=torch.float32, count=3, seed=0):
    return torch.stack(
        [
            ops.topk_compress(
                values_like(n, torch.float32, seed=seed + r), None, k, value_dtype=value_dtype
            )
            for r in range(count)
        ]
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value_dtype", DTYPES, ids=str)
def test_sparse_accumulate_matches_reference(device, dtype, value_dtype):
    for n in (1, 4097, 278011):
        for k in sorted({1, max(1, n // 50), k_for(n, 0.01), n}):
            rows = topk_rows(n, k, value_dtype)
            for divisor in (1, 3):
                got = ops.sparse_accumulate(rows.to(device), n, k, divisor, value_dtype, dtype)
                want = oracle(device).sparse_accumulate(rows, n, k, divisor, value_dtype, dtype)
                assert_same_bits(got, want)


@pytest.mark.parametrize("value_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_sums_streamed_past_the_caches_keep_their_bits(value_dtype):
    # An fp32 result of 4 MiB or more at a 32-byte aligned address is written whole with
    # streaming stores (the x86-64-v3 kernels); one element further on, as zeros and entries.
    n = (1 << 20) + 37
    k = k_for(n, 0.01)
    rows = topk_rows(n, k, value_dtype)
    rows[1, 4 * k :].view(value_dtype)[:3] = torch.tensor([math.nan, -0.0, 0.0])
    streamed, plain = torch.empty(n + 8)[:n], torch.empty(n + 1)[1:]
    assert streamed.data_ptr() % 32 == 0
    for divisor in (2, 3):  # a power of two multiplies by its inverse
        ops.sparse_accumulate(rows, n, k, divisor, value_dtype, torch.float32, out=streamed)
        ops.sparse_accumulate(rows, n, k, divisor, value_dtype, torch.float32, out=plain)
        assert_same_bits(streamed, plain)
        want = ref.sparse_accumulate(rows, n, k, divisor, value_dtype, torch.float32)
        assert_same_bits(streamed, want)
        assert bool(streamed.isnan().any())


def test_sparse_accumulate_adds_duplicates_in_rank_order(device):
    def payload(idx, val):
        return torch.cat(
            [
                torch.tensor(idx, dtype=torch.int32).view(torch.uint8),
                torch.tensor(val, dtype=torch.float32).view(torch.uint8),
            ]
        )

    rows = torch.stack(
        [payload([0, 2], [1e8, 1.0]), payload([0, 3], [1.0, 2.0]), payload([0, 2], [-1e8, 3.0])]
    )
    got = ops.sparse_accumulate(rows.to(device), 5, 2, 1, torch.float32, torch.float32)
    # (1e8 + 1) rounds to 1e8 in fp32, then - 1e8: rank order gives 0, not 1.
    assert got.tolist() == [0.0, 0.0, 4.0, 2.0, 0.0]
    assert_same_bits(got, ref.sparse_accumulate(rows, 5, 2, 1, torch.float32, torch.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sparse_accumulate_unchecked_matches_checked(device, dtype):
    n, k = 278011, 2781
    rows = topk_rows(n, k).to(device)
    want = ops.sparse_accumulate(rows, n, k, 3, torch.float32, dtype)
    assert_same_bits(ops.sparse_accumulate(rows, n, k, 3, torch.float32, dtype, check=False), want)


def test_sparse_accumulate_unchecked_bad_rows_stay_in_bounds(device):
    # check=False trusts the payload: a bad one gives unspecified sums, but writes nothing
    # outside `out` (here a view with sentinels on both sides).
    idx = torch.tensor([3, 10, -1, 2**30], dtype=torch.int32)
    p = torch.cat([idx.view(torch.uint8), torch.ones(4).view(torch.uint8)]).to(device)
    buf = torch.full((14,), 7.0, device=device)
    out = buf[2:12]
    ops.sparse_accumulate(p[None], 10, 4, 1, torch.float32, torch.float32, out=out, check=False)
    assert buf[:2].tolist() == [7.0, 7.0] and buf[12:].tolist() == [7.0, 7.0]
    assert buf[5].item() == 1.0


def test_sparse_accumulate_rejects_bad_indices(device):
    # The same first line of the message on every device, before anything is scattered.
    n, k = 1000, 10
    rows = topk_rows(n, k, count=2)
    for bad_index, position in ((5000, 3), (-1, 3)):
        p = rows.clone()
        p[1, 4 * position : 4 * position + 4] = torch.tensor([bad_index], dtype=torch.int32).view(
            torch.uint8
        )
        with pytest.raises(RuntimeError) as err:
            ops.sparse_accumulate(p.to(device), n, k, 1, torch.float32, torch.float32)
        assert str(err.value).splitlines()[0] == (
            f"sparse_accumulate: payloads row 1 holds index {bad_index} at position {position}: "
            f"indices must be strictly increasing and in [0, numel={n})"
        )


def test_sparse_accumulate_rejects_out_of_range_index(device):
    p = torch.cat(
        [
            torch.tensor([3, 10], dtype=torch.int32).view(torch.uint8),
            torch.ones(2).view(torch.uint8),
        ]
    )
    with pytest.raises(RuntimeError, match=r"index 10 at position 1"):
        ops.sparse_accumulate(p[None].to(device), 10, 2, 1, torch.float32, torch.float32)


# ---------------------------------------------------------------------------------------
# random-k
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_randk_matches_reference(device, dtype):
    for n in sizes(device):
        x = gen(n, dtype, n)
        for k in sorted({1, k_for(n, 0.01), max(1, n // 3), n}):
            res = gen(n, torch.float32, 1) * 0.1
            res_got = res.clone().to(device)
            got = ops.randk_compress(x.to(device), res_got, k, 3, 4, 5)
            assert_same_bits(got, oracle(device).randk_compress(x, res, k, 3, 4, 5))
            assert_same_bits(res_got, res)
            assert_same_bits(
                ops.randk_compress(x.to(device), None, k, 3, 4, 5),
                oracle(device).randk_compress(x, None, k, 3, 4, 5),
            )
            for out_dtype in DTYPES:
                dense = ops.randk_decompress(got, n, 3, 4, 5, 3, out_dtype)
                assert_same_bits(
                    dense, oracle(device).randk_decompress(got.cpu(), n, 3, 4, 5, 3, out_dtype)
                )


def test_randk_indices_distinct_and_keyed(device):
    n, k = 100003, 1001
    idx = ref.randk_indices(n, k, 0, 0, 0)
    assert idx.numel() == k and torch.all(idx[1:] > idx[:-1]) and 0 <= idx[0] and idx[-1] < n
    # The native op sends exactly those entries.
    x = torch.arange(n, dtype=torch.float32, device=device)
    assert torch.equal(ops.randk_compress(x, None, k, 0, 0, 0).long().cpu(), idx)
    others = [ref.randk_indices(n, k, *key) for key in [(1, 0, 0), (0, 1, 0), (0, 0, 1)]]
    assert all(not torch.equal(idx, o) for o in others)
    assert ref.randk_indices(n, n, 9, 9, 9).tolist() == list(range(n))


def test_randk_inclusion_is_uniform():
    """Each index is drawn with probability ~k/n: over 400 steps the per-index count of a
    1000-element bucket at k = 100 stays within 5 binomial sigmas of 40."""
    n, k, steps = 1000, 100, 400
    hits = torch.zeros(n)
    for step in range(steps):
        hits[ref.randk_indices(n, k, 0, step, 0)] += 1
    sigma = math.sqrt(steps * 0.1 * 0.9)
    assert float((hits - 40).abs().max()) < 5 * sigma


def test_randk_error_feedback_conserves_e(device):
    n, k = 278011, 2781
    x, res = gen(n, torch.float32, 1).to(device), gen(n, torch.float32, 2).to(device)
    e = x + res
    values = ops.randk_compress(x, res, k, 1, 2, 3)
    assert torch.equal(ops.randk_decompress(values, n, 1, 2, 3, 1, torch.float32) + res, e)


@pytest.mark.parametrize("with_residual", [False, True])
def test_randk_non_finite_anywhere_poisons_every_value(device, with_residual):
    n, k = 10007, 10
    x = gen(n, torch.float32, 8)
    x[5000] = float("inf")
    assert 5000 not in ref.randk_indices(n, k, 0, 0, 0).tolist()
    res = torch.zeros(n) if with_residual else None
    values = ops.randk_compress(x.to(device), None if res is None else res.to(device), k, 0, 0, 0)
    assert torch.isnan(values).all()
    assert_same_bits(values, oracle(device).randk_compress(x, res, k, 0, 0, 0))


def strata_cuts(k: int) -> list[tuple[int, int]]:
    """Uneven consecutive ranges covering the strata [0, k), after an empty one."""
    cuts = sorted({0, min(1, k), k // 3, min(k // 2 + 1, k), k})
    return [(0, 0), *zip(cuts, cuts[1:], strict=False)]


def randk_range_oracle(device, x, res, k, start, end):
    """The oracle's values of strata [start, end) (the CPU op returns all k)."""
    if device == "cpu":
        return ref.randk_compress(x, res, k, 3, 4, 5, start=start, end=end)
    return ops.randk_compress(x, res, k, 3, 4, 5, start=start, end=end)[start:end]


def randk_dense_oracle(device, values, n, dtype, start, end):
    """The oracle's elements of strata [start, end) (the CPU op returns all n)."""
    if device == "cpu":
        return ref.randk_decompress(values, n, 3, 4, 5, 3, dtype, start=start, end=end)
    lo, hi = start * n // values.numel(), end * n // values.numel()
    return ops.randk_decompress(values, n, 3, 4, 5, 3, dtype, start=start, end=end)[lo:hi]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_randk_strata_match_reference_and_the_whole_call(device, dtype):
    # Strata [start, end) read and write one range of the bucket: each range is the
    # oracle's (reference.py on CPU, the CPU op for CUDA), and a partition of [0, k) gives
    # the whole call's values, residual and dense result, bit for bit.
    for n in sizes(device):
        x = gen(n, dtype, n + 1)
        for k in sorted({1, k_for(n, 0.01), max(1, n // 3), n}):
            res0 = gen(n, torch.float32, 3) * 0.1
            whole_res = res0.clone().to(device)
            whole = ops.randk_compress(x.to(device), whole_res, k, 3, 4, 5)
            res, res_oracle = res0.clone().to(device), res0.clone()
            values = torch.full((k,), 7.0, device=device)
            for start, end in strata_cuts(k):
                got = ops.randk_compress(x.to(device), res, k, 3, 4, 5, values, start, end)
                assert got is values
                want = randk_range_oracle(device, x, res_oracle, k, start, end)
                assert_same_bits(values[start:end], want)
            assert_same_bits(values, whole)
            assert_same_bits(res, whole_res)
            assert_same_bits(res_oracle, whole_res)
            for out_dtype in DTYPES:
                dense = torch.full((n,), 9.0, dtype=out_dtype, device=device)
                for start, end in strata_cuts(k):
                    lo, hi = start * n // k, end * n // k
                    ops.randk_decompress(whole, n, 3, 4, 5, 3, out_dtype, dense, start, end)
                    want = randk_dense_oracle(device, whole.cpu(), n, out_dtype, start, end)
                    assert_same_bits(dense[lo:hi], want)
                    assert bool((dense[hi:] == 9.0).all())  # the rest is not touched
                assert_same_bits(dense, ops.randk_decompress(whole, n, 3, 4, 5, 3, out_dtype))


@pytest.mark.parametrize("with_residual", [False, True])
def test_randk_strata_non_finite_poisons_its_own_range(device, with_residual):
    # A range's NaN rule covers its own elements: a non-finite entry in the middle range
    # makes that range's values NaN, and the other ranges keep the whole call's values
    # of a finite bucket (collectives._randk spreads the NaN over the result itself).
    n, k = 10007, 10
    x = gen(n, torch.float32, 8)
    finite = ops.randk_compress(x.to(device), None, k, 0, 0, 0)
    x[5000] = float("inf")  # in strata [4, 6)
    res = torch.zeros(n) if with_residual else None
    for start, end in [(0, 4), (4, 6), (6, 10)]:
        got = ops.randk_compress(
            x.to(device),
            None if res is None else res.to(device),
            k,
            0,
            0,
            0,
            start=start,
            end=end,
        )[start:end]
        if start == 4:
            assert torch.isnan(got).all()
        else:
            assert_same_bits(got, finite[start:end])
        ref_res = None if res is None else torch.zeros(n)
        want = ref.randk_compress(x, ref_res, k, 0, 0, 0, start=start, end=end)
        assert_same_bits(got, want)


# ---------------------------------------------------------------------------------------
# Canonical NaNs, out-variants
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value_dtype", DTYPES, ids=str)
def test_nan_outputs_are_canonical(device, value_dtype):
    # NaNs with odd payloads all rank as one key (ties to the lower index), and every NaN the
    # ops write is the canonical NaN of its dtype, as reference.py states.
    n = 5000
    x = gen(n, torch.float32, 3)
    x[10], x[20], x[30] = _nan(0x7FFFFFFF), _nan(0xFFC00000), _nan(0x7F800001)
    x[40] = float("inf")
    res = torch.zeros(n)
    res[40] = float("-inf")
    for k in (2, 50):
        check_topk(device, x, res, k, False, value_dtype=value_dtype)
    idx, _ = split(ops.topk_compress(x.to(device), None, 2), 2)
    assert idx.tolist() == [10, 20]
    rows = torch.stack([ops.topk_compress(x, None, 50, value_dtype=value_dtype)] * 2)
    for dtype in DTYPES:
        assert_same_bits(
            ops.sparse_accumulate(rows.to(device), n, 50, 2, value_dtype, dtype),
            ref.sparse_accumulate(rows, n, 50, 2, value_dtype, dtype),
        )
    r = torch.zeros(n)
    r_got = r.clone().to(device)
    values = ops.randk_compress(x.to(device), r_got, 50, 1, 2, 3)
    assert_same_bits(values, ref.randk_compress(x, r, 50, 1, 2, 3))
    assert_same_bits(r_got, r)
    for dtype in DTYPES:
        assert_same_bits(
            ops.randk_decompress(values, n, 1, 2, 3, 2, dtype),
            ref.randk_decompress(values.cpu(), n, 1, 2, 3, 2, dtype),
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_variants_match_allocating_ops(device, dtype):
    n, k = 278011, 2781
    rows = topk_rows(n, k).to(device)
    want = ops.sparse_accumulate(rows, n, k, 3, torch.float32, dtype)
    out = torch.full((n,), 7.0, dtype=dtype, device=device)  # stale contents must not leak
    got = ops.sparse_accumulate(rows, n, k, 3, torch.float32, dtype, out=out)
    assert got is out
    assert_same_bits(out, want)
    x = gen(n, dtype, 1).to(device)
    res, res_into = gen(n, torch.float32, 2).to(device), gen(n, torch.float32, 2).to(device)
    packed = torch.full((ops.topk_payload_bytes(k, dtype),), 255, dtype=torch.uint8, device=device)
    got = ops.topk_compress(x, res_into, k, True, 1, 2, dtype, out=packed)
    assert got is packed
    assert_same_bytes(packed, ops.topk_compress(x, res, k, True, 1, 2, dtype))
    assert_same_bits(res_into, res)
    values = ops.randk_compress(gen(n, torch.float32).to(device), None, k, 1, 2, 3)
    out = torch.full((n,), 7.0, dtype=dtype, device=device)
    ops.randk_decompress(values, n, 1, 2, 3, 3, dtype, out=out)
    assert_same_bits(out, ops.randk_decompress(values, n, 1, 2, 3, 3, dtype))
    assert_same_bits(out, oracle(device).randk_decompress(values.cpu(), n, 1, 2, 3, 3, dtype))


# ---------------------------------------------------------------------------------------
# opcheck, fakes, bad input
# ---------------------------------------------------------------------------------------


def test_opcheck_every_op(device):
    n, k = 1000, 10
    x = gen(n, torch.float32).to(device)
    zeros = torch.zeros(n, device=device)
    for approximate in (False, True):
        torch.library.opcheck(
            torch.ops.ddpcomm.topk_compress_into,
            (
                x,
                zeros,
                torch.empty(k * 8, dtype=torch.uint8, device=device),
                k,
                approximate,
                1,
                2,
                None,
            ),
        )
    torch.library.opcheck(
        torch.ops.ddpcomm.topk_compress_into,
        (
            x.half(),
            None,
            torch.empty(k * 6, dtype=torch.uint8, device=device),
            k,
            False,
            0,
            0,
            torch.bfloat16,
        ),
    )
    rows = topk_rows(n, k, count=2).to(device)
    for check in (True, False):
        torch.library.opcheck(
            torch.ops.ddpcomm.sparse_accumulate_into,
            (
                rows,
                torch.empty(n, dtype=torch.bfloat16, device=device),
                k,
                2,
                torch.float32,
                check,
            ),
        )
    torch.library.opcheck(
        torch.ops.ddpcomm.sparse_accumulate_into,
        (rows, torch.empty(n, device=device), k, 1, torch.float32),
    )
    torch.library.opcheck(
        torch.ops.ddpcomm.randk_compress_into, (x, zeros, torch.empty(k, device=device), 1, 2, 3)
    )
    torch.library.opcheck(
        torch.ops.ddpcomm.randk_decompress_into,
        (
            torch.ones(k, device=device),
            torch.empty(n, dtype=torch.float16, device=device),
            1,
            2,
            3,
            2,
        ),
    )
    # Strata ranges: a middle one, an empty one, and end=-1 (k).
    for start, end in [(3, 7), (5, 5), (4, -1)]:
        torch.library.opcheck(
            torch.ops.ddpcomm.randk_compress_into,
            (x, zeros, torch.zeros(k, device=device), 1, 2, 3, start, end),
        )
        torch.library.opcheck(
            torch.ops.ddpcomm.randk_decompress_into,
            (torch.ones(k, device=device), torch.zeros(n, device=device), 1, 2, 3, 2, start, end),
        )


def _bad_calls(d):
    u8 = torch.uint8
    return [
        (lambda: ops.topk_compress(torch.ones(10, device=d), None, 0), "k must be in"),
        (lambda: ops.topk_compress(torch.ones(10, device=d), None, 11), "k must be in"),
        (
            lambda: ops.topk_compress(torch.ones(10, dtype=torch.int32, device=d), None, 1),
            "x must be",
        ),
        (
            lambda: ops.topk_compress(torch.ones(10, device=d), torch.zeros(9, device=d), 1),
            "residual must have",
        ),
        (
            lambda: ops.topk_compress(
                torch.ones(10, device=d), torch.zeros(10, device=d).half(), 1
            ),
            "residual must be",
        ),
        (
            lambda: ops.topk_compress(torch.ones(10, device=d), None, 1, value_dtype=torch.int8),
            "value_dtype must be",
        ),
        (lambda: ops.topk_compress(torch.ones(0, device=d), None, 1), "numel must be"),
        (
            lambda: ops.topk_compress(
                torch.ones(10, device=d), None, 1, out=torch.empty(7, dtype=u8, device=d)
            ),
            "out must be a contiguous 1-D uint8",
        ),
        (lambda: ops.randk_compress(torch.ones(10, device=d), None, 0, 0, 0, 0), "k must be in"),
        (
            lambda: ops.randk_compress(
                torch.ones(4, dtype=torch.int64, device=d), None, 1, 0, 0, 0
            ),
            "x must be",
        ),
        (
            lambda: ops.randk_decompress(torch.ones(11, device=d), 10, 0, 0, 0, 1, torch.float32),
            "k must be in",
        ),
        (
            lambda: ops.randk_decompress(torch.ones(2, device=d), 10, 0, 0, 0, 0, torch.float32),
            "divisor must be",
        ),
        (
            lambda: ops.randk_compress(torch.ones(10, device=d), None, 4, 0, 0, 0, start=3, end=2),
            r"start and end must satisfy 0 <= start <= end <= k=4 \(end=-1: k\), got start=3",
        ),
        (
            lambda: ops.randk_compress(torch.ones(10, device=d), None, 4, 0, 0, 0, end=5),
            "start and end must satisfy",
        ),
        (
            lambda: ops.randk_decompress(
                torch.ones(4, device=d), 10, 0, 0, 0, 1, torch.float32, start=-1
            ),
            "start and end must satisfy",
        ),
        (
            lambda: ops.randk_decompress(torch.ones(2, device=d), 10, 0, 0, 0, 1, torch.int32),
            "dtype must be",
        ),
        (
            lambda: ops.sparse_accumulate(
                torch.zeros(2, 15, dtype=u8, device=d), 10, 2, 1, torch.float32, torch.float32
            ),
            "payloads rows are",
        ),
        (
            lambda: ops.sparse_accumulate(
                torch.zeros(16, dtype=u8, device=d), 10, 2, 1, torch.float32, torch.float32
            ),
            "2 dimensions",
        ),
        (
            lambda: ops.sparse_accumulate(
                torch.zeros(1, 4, device=d), 10, 2, 1, torch.float32, torch.float32
            ),
            "must be uint8",
        ),
        (
            lambda: ops.sparse_accumulate(
                torch.zeros(1, 16, dtype=u8, device=d), 10, 2, 0, torch.float32, torch.float32
            ),
            "divisor must be",
        ),
        (
            lambda: ops.sparse_accumulate(
                torch.zeros(1, 16, dtype=u8, device=d), 10, 2, 1, torch.float32, torch.float32
            ),
            "strictly increasing",
        ),
    ]


def test_bad_input_names_the_argument(device):
    for call, match in _bad_calls(device):
        with pytest.raises(RuntimeError, match=match):
            call()


def test_out_variants_bad_input(device):
    n, k = 1000, 10
    rows = topk_rows(n, k, count=2).to(device)
    x = gen(n, torch.float32).to(device)
    with pytest.raises(RuntimeError, match="out must be a contiguous 1-D uint8"):
        ops.topk_compress(x, None, k, out=torch.empty(k * 8 - 1, dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match="out must have"):
        ops.sparse_accumulate(
            rows, n, k, 2, torch.float32, torch.float32, out=torch.empty(n + 1, device=device)
        )


def _alias_calls(d):
    """(call, message): an output sharing memory with an input or another output."""
    n, k = 1000, 10
    x = gen(n, torch.float32).to(d)
    # Two rows of k=2 float32 entries at the start of a buffer whose float32 view also
    # serves as an output of 10 elements.
    buf = torch.zeros(1024, dtype=torch.uint8, device=d)
    rows = buf[:32].view(2, 16)
    over = buf.view(torch.float32)[:10]
    q = torch.ops.ddpcomm
    return [
        (lambda: ops.topk_compress(x, None, k, out=x.view(torch.uint8)[: 8 * k]), "out and x"),
        (lambda: ops.topk_compress(x, x, k), "residual and x"),
        (lambda: q.topk_compress_into(x, x[:0].new_zeros(n), x.view(torch.uint8)[-8 * k :], k),
         "out and x"),
        (lambda: ops.sparse_accumulate(rows, 10, 2, 1, torch.float32, torch.float32, out=over),
         "out and payloads"),
        (lambda: q.sparse_accumulate_into(rows, buf.view(torch.half)[:10], 2, 1, torch.float32),
         "out and payloads"),
        (lambda: ops.randk_compress(x, x, k, 0, 0, 0), "residual and x"),
        (lambda: q.randk_compress_into(x, None, x[5 : 5 + k], 0, 0, 0), "out and x"),
        (lambda: ops.randk_decompress(x[:k], n, 0, 0, 0, 1, torch.float32, out=x),
         "out and values"),
    ]  # fmt: skip


def test_outputs_that_alias_inputs_are_refused(device):
    for call, match in _alias_calls(device):
        with pytest.raises(ValueError, match=f"{match} share memory"):
            call()


def test_alias_fakes_raise_like_the_native_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for i, (call, _) in enumerate(_alias_calls("cpu")):
        with pytest.raises(ValueError) as native:
            call()
        with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError) as fake:
            _alias_calls("cpu")[i][0]()
        assert str(fake.value) == str(native.value)


def test_no_rows_and_bools_are_refused(device):
    rows = topk_rows(1000, 10, count=2).to(device)
    with pytest.raises(RuntimeError, match="payloads must hold at least one row, got 0"):
        ops.sparse_accumulate(rows[:0], 1000, 10, 1, torch.float32, torch.float32)
    x = gen(100, torch.float32).to(device)
    bad = [
        lambda: ops.topk_compress(x, None, True),
        lambda: ops.topk_compress(x, None, 1, step=False),
        lambda: ops.sparse_accumulate(rows, 1000, 10, True, torch.float32, torch.float32),
        lambda: ops.randk_compress(x, None, 3, 0, 0, True),
        lambda: ops.randk_decompress(x[:3], 100, 0, True, 0, 1, torch.float32),
        lambda: ops.randk_compress(x, None, 3, 0, 0, 0, start=True),
        lambda: ops.randk_decompress(x[:3], 100, 0, 0, 0, 1, torch.float32, end=False),
    ]
    for call in bad:
        with pytest.raises(TypeError, match=r"\w+: \w+ must be an int, got (True|False)"):
            call()


def test_fakes_raise_like_the_native_ops():
    # The fake implementations restate csrc/checks.h: under torch.compile a bad call fails
    # at trace time with the native op's exact error.
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, u8 = torch.ops.ddpcomm, torch.uint8
    calls = [
        lambda: q.topk_compress_into(torch.randn(10), None, torch.empty(10, dtype=u8), 2),
        lambda: q.topk_compress_into(torch.randn(10), None, torch.empty(16, dtype=u8), 11),
        lambda: q.topk_compress_into(
            torch.randn(10), None, torch.empty(16, dtype=u8), 2, False, 0, 0, torch.int8
        ),
        lambda: q.topk_compress_into(torch.randn(10), torch.zeros(9), torch.empty(16, dtype=u8), 2),
        lambda: q.sparse_accumulate_into(
            torch.zeros(2, 16, dtype=u8), torch.empty(10, dtype=torch.half), 2, 0, torch.float32
        ),
        lambda: q.sparse_accumulate_into(
            torch.zeros(2, 16, dtype=u8), torch.empty(10, dtype=torch.half), 2, 1, torch.int8
        ),
        lambda: q.sparse_accumulate_into(
            torch.zeros(2, 15, dtype=u8), torch.empty(10), 2, 1, torch.float32
        ),
        lambda: q.sparse_accumulate_into(
            torch.zeros(2, 16, dtype=u8), torch.empty(10), 2, 0, torch.float32
        ),
        lambda: q.randk_compress_into(torch.randn(10), None, torch.empty(11), 1, 2, 3),
        lambda: q.randk_compress_into(
            torch.randn(10), None, torch.empty(3, dtype=torch.half), 1, 2, 3
        ),
        lambda: q.randk_decompress_into(
            torch.ones(3), torch.empty(10, dtype=torch.int32), 1, 2, 3, 1
        ),
        lambda: q.randk_decompress_into(torch.ones(3, 1), torch.empty(10), 1, 2, 3, 1),
        lambda: q.randk_compress_into(torch.randn(10), None, torch.empty(3), 1, 2, 3, 2, 1),
        lambda: q.randk_compress_into(torch.randn(10), None, torch.empty(3), 1, 2, 3, 0, 4),
        lambda: q.randk_decompress_into(torch.ones(3), torch.empty(10), 1, 2, 3, 1, -1, 2),
        lambda: q.randk_decompress_into(torch.ones(3), torch.empty(10), 1, 2, 3, 1, 0, -2),
    ]
    for call in calls:
        try:
            call()
            raise AssertionError("the native op accepted a bad call")
        except RuntimeError as exc:
            native = str(exc).splitlines()[0]
        with FakeTensorMode(), pytest.raises(RuntimeError) as fake:
            call()
        assert str(fake.value).splitlines()[0] == native


@needs_cuda
def test_cuda_hot_path_never_synchronizes():
    # DESIGN.md 8: top-k picks its path on the device and sparse_accumulate(check=False)
    # reads nothing back; proven under torch's sync debug mode, on every top-k path.
    n, k = 300007, 3001
    cases = [
        values_like(n, torch.float32, seed=1).cuda(),  # compact
        torch.ones(n, device="cuda"),  # ties: more candidates than fit (dense)
        adversarial().cuda(),  # the sample misses (exact: dense; approximate: padded)
    ]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in cases:
            res = torch.zeros_like(x)
            for approximate in (False, True):
                payload = ops.topk_compress(x, res, min(k, x.numel() // 10), approximate)
            rows = torch.stack([payload, payload])
            kk = rows.shape[1] // 8
            ops.sparse_accumulate(rows, x.numel(), kk, 2, torch.float32, torch.float32, check=False)
            values = ops.randk_compress(x, res, kk, 1, 2, 3)
            ops.randk_decompress(values, x.numel(), 1, 2, 3, 2, torch.float32)
    finally:
        torch.cuda.set_sync_debug_mode("default")
