"""Sparsification ops (top-k, random-k) against reference.py, torch, opcheck and bad input."""

from __future__ import annotations

import math

import pytest
import torch

import ddpcomm.ops as ops
import ddpcomm.reference as ref

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
# Odd sizes: single element, around a 256-element scan block, the apex size, and one past
# the scan's 65536-element chunk so candidates come from several chunks.
SIZES = [1, 2, 255, 257, 278011, 65536 * 3 + 5]


def k_for(n: int, ratio: float) -> int:
    return max(1, math.ceil(ratio * n))


def split(payload: torch.Tensor, k: int, value_dtype=torch.float32):
    idx = payload[: 4 * k].clone().view(torch.int32).long()
    return idx, payload[4 * k :].clone().view(value_dtype)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def gen(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype)


# ---------------------------------------------------------------------------------------
# topk_compress
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("approximate", [False, True])
def test_topk_matches_reference(n, dtype, approximate):
    x = gen(n, dtype, n)
    for k in sorted({1, k_for(n, 0.01), k_for(n, 0.3), n}):
        res = gen(n, torch.float32, n + 1) * 0.1
        res_ref = res.clone()
        got = ops.topk_compress(x, res, k, approximate, seed=5, step=k)
        want = ref.topk_compress(x, res_ref, k, approximate, seed=5, step=k)
        assert_bitwise(got, want)
        assert_bitwise(res, res_ref)
        got = ops.topk_compress(x, None, k, approximate, 7, 1, value_dtype=dtype)
        assert_bitwise(got, ref.topk_compress(x, None, k, approximate, 7, 1, value_dtype=dtype))


@pytest.mark.parametrize("n", [257, 278011])
def test_topk_exact_is_torch_topk(n):
    """Independent of reference.py: same magnitudes as torch.topk, indices ascending."""
    x = gen(n, torch.float32, 3)
    k = k_for(n, 0.01)
    idx, val = split(ops.topk_compress(x, None, k), k)
    assert torch.all(idx[1:] > idx[:-1])
    assert torch.equal(val, x[idx])
    want = torch.topk(x.abs(), k).values
    assert torch.equal(val.abs().sort(descending=True).values, want)


def test_topk_ties_go_to_lower_index():
    x = torch.tensor([1.0, -2.0, 2.0, 0.5, -2.0, 2.0, 1.0])
    idx, val = split(ops.topk_compress(x, None, 3), 3)
    assert idx.tolist() == [1, 2, 4] and val.tolist() == [-2.0, 2.0, -2.0]
    zeros = torch.zeros(1000)
    for approximate in (False, True):
        idx, _ = split(ops.topk_compress(zeros, None, 10, approximate), 10)
        assert idx.tolist() == list(range(10))


def test_topk_k_equals_n_sends_everything():
    x = gen(1001, torch.float32)
    res = torch.full((1001,), 0.25)
    e = x + 0.25
    idx, val = split(ops.topk_compress(x, res, 1001), 1001)
    assert idx.tolist() == list(range(1001))
    assert torch.equal(val, e)
    assert torch.count_nonzero(res) == 0


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
def test_topk_when_the_sample_misses(approximate):
    """Exact mode's histogram fallback and approximate mode's fill-up path."""
    x, k = adversarial(), 1000
    assert _sample_misses(x, k, approximate)
    res, res_ref = torch.zeros_like(x), torch.zeros_like(x)
    got = ops.topk_compress(x, res, k, approximate)
    assert_bitwise(got, ref.topk_compress(x, res_ref, k, approximate))
    assert_bitwise(res, res_ref)
    exact = ops.topk_compress(x, None, k)
    if approximate:
        # Filled up with low indices: not the exact set, but every candidate is in it.
        assert not torch.equal(got, exact)
    else:
        idx, val = split(exact, k)
        assert torch.equal(val.abs().sort(descending=True).values, torch.topk(x.abs(), k).values)


def test_topk_approximate_depends_on_seed_only():
    x = adversarial()
    a = ops.topk_compress(x, None, 1000, True, seed=0, step=0)
    assert_bitwise(a, ops.topk_compress(x, None, 1000, True, seed=0, step=0))
    assert not torch.equal(a, ops.topk_compress(x, None, 1000, True, seed=1, step=0))


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_topk_selects_non_finite(approximate, bad):
    x = gen(278011, torch.float32, 2)
    x[123457] = bad
    for k in (1, 2781):
        idx, val = split(ops.topk_compress(x, torch.zeros_like(x), k, approximate), k)
        assert 123457 in idx.tolist()
        assert not torch.isfinite(val).all()


@pytest.mark.parametrize("value_dtype", FLOATS)
def test_topk_error_feedback_conserves_e(value_dtype):
    """Dense(payload) + new residual == x + old residual, exactly, for every value dtype."""
    n, k = 278011, 2781
    x = gen(n, torch.float32, 4)
    res = gen(n, torch.float32, 5)
    e = x + res
    payload = ops.topk_compress(x, res, k, value_dtype=value_dtype)
    dense = ops.sparse_accumulate(payload[None], n, k, 1, value_dtype, torch.float32)
    assert torch.equal(dense + res, e)
    idx, _ = split(payload, k, value_dtype)
    mask = torch.ones(n, dtype=torch.bool)
    mask[idx] = False
    assert torch.equal(res[mask], e[mask])


def test_topk_approximate_close_to_exact():
    """On a Gaussian bucket the approximate selection keeps >= 97% of the exact top-k's
    L2 mass: its threshold keeps >= k candidates (then it is exact) in ~84% of sample
    draws, and otherwise fills up a few percent of k (bench sparse: 99.8% mean)."""
    n = 1 << 20
    x = gen(n, torch.float32, 6)
    k = k_for(n, 0.01)
    mass = []
    for approximate in (False, True):
        _, val = split(ops.topk_compress(x, None, k, approximate, seed=3, step=9), k)
        mass.append(float(val.double().pow(2).sum()))
    assert mass[1] <= mass[0] and mass[1] >= 0.97 * mass[0]


# ---------------------------------------------------------------------------------------
# sparse_accumulate
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("value_dtype", FLOATS)
def test_sparse_accumulate_matches_reference(dtype, value_dtype):
    n, k = 278011, 2781
    rows = torch.stack(
        [
            ops.topk_compress(gen(n, torch.float32, r), None, k, value_dtype=value_dtype)
            for r in range(3)
        ]
    )
    got = ops.sparse_accumulate(rows, n, k, 3, value_dtype, dtype)
    assert_bitwise(got, ref.sparse_accumulate(rows, n, k, 3, value_dtype, dtype))


def test_sparse_accumulate_adds_duplicates_in_rank_order():
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
    got = ops.sparse_accumulate(rows, 5, 2, 1, torch.float32, torch.float32)
    # (1e8 + 1) rounds to 1e8 in fp32, then - 1e8: rank order gives 0, not 1.
    assert got.tolist() == [0.0, 0.0, 4.0, 2.0, 0.0]
    assert_bitwise(got, ref.sparse_accumulate(rows, 5, 2, 1, torch.float32, torch.float32))


# ---------------------------------------------------------------------------------------
# random-k
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", FLOATS)
def test_randk_matches_reference(n, dtype):
    x = gen(n, dtype, n)
    for k in sorted({1, k_for(n, 0.01), n}):
        res = gen(n, torch.float32, 1) * 0.1
        res_ref = res.clone()
        got = ops.randk_compress(x, res, k, 3, 4, 5)
        assert_bitwise(got, ref.randk_compress(x, res_ref, k, 3, 4, 5))
        assert_bitwise(res, res_ref)
        assert_bitwise(
            ops.randk_compress(x, None, k, 3, 4, 5), ref.randk_compress(x, None, k, 3, 4, 5)
        )
        dense = ops.randk_decompress(got, n, 3, 4, 5, 3, dtype)
        assert_bitwise(dense, ref.randk_decompress(got, n, 3, 4, 5, 3, dtype))


def test_randk_indices_distinct_and_keyed():
    n, k = 100003, 1001
    idx = ref.randk_indices(n, k, 0, 0, 0)
    assert idx.numel() == k and torch.all(idx[1:] > idx[:-1]) and 0 <= idx[0] and idx[-1] < n
    # The native op sends exactly those entries.
    x = torch.arange(n, dtype=torch.float32)
    assert torch.equal(ops.randk_compress(x, None, k, 0, 0, 0).long(), idx)
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


def test_randk_error_feedback_conserves_e():
    n, k = 278011, 2781
    x, res = gen(n, torch.float32, 1), gen(n, torch.float32, 2)
    e = x + res
    values = ops.randk_compress(x, res, k, 1, 2, 3)
    assert torch.equal(ops.randk_decompress(values, n, 1, 2, 3, 1, torch.float32) + res, e)


# ---------------------------------------------------------------------------------------
# opcheck and bad input
# ---------------------------------------------------------------------------------------


def test_opcheck_every_op():
    n, k = 1000, 10
    x = gen(n, torch.float32)
    packed = torch.empty(k * 8, dtype=torch.uint8)
    for approximate in (False, True):
        torch.library.opcheck(
            torch.ops.ddpcomm.topk_compress_into,
            (x, torch.zeros(n), packed, k, approximate, 1, 2, None),
        )
    torch.library.opcheck(
        torch.ops.ddpcomm.topk_compress_into,
        (x.half(), None, torch.empty(k * 6, dtype=torch.uint8), k, False, 0, 0, torch.bfloat16),
    )
    rows = torch.stack([ops.topk_compress(gen(n, torch.float32, r), None, k) for r in range(2)])
    torch.library.opcheck(
        torch.ops.ddpcomm.sparse_accumulate_into,
        (rows, torch.empty(n, dtype=torch.bfloat16), torch.empty(n), k, 2, torch.float32),
    )
    torch.library.opcheck(
        torch.ops.ddpcomm.randk_compress_into, (x, torch.zeros(n), torch.empty(k), 1, 2, 3)
    )
    torch.library.opcheck(
        torch.ops.ddpcomm.randk_decompress_into,
        (torch.ones(k), torch.empty(n, dtype=torch.float16), 1, 2, 3, 2),
    )


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: ops.topk_compress(torch.ones(10), None, 0), "k must be in"),
        (lambda: ops.topk_compress(torch.ones(10), None, 11), "k must be in"),
        (lambda: ops.topk_compress(torch.ones(10, dtype=torch.int32), None, 1), "x must be"),
        (lambda: ops.topk_compress(torch.ones(10), torch.zeros(9), 1), "residual must have"),
        (lambda: ops.topk_compress(torch.ones(10), torch.zeros(10).half(), 1), "residual must be"),
        (
            lambda: ops.topk_compress(torch.ones(10), None, 1, value_dtype=torch.int8),
            "value_dtype must be",
        ),
        (lambda: ops.topk_compress(torch.ones(0), None, 1), "numel must be"),
        (lambda: ops.randk_compress(torch.ones(10), None, 0, 0, 0, 0), "k must be in"),
        (
            lambda: ops.randk_compress(torch.ones(4, dtype=torch.int64), None, 1, 0, 0, 0),
            "x must be",
        ),
        (
            lambda: ops.randk_decompress(torch.ones(11), 10, 0, 0, 0, 1, torch.float32),
            "k must be in",
        ),
        (
            lambda: ops.randk_decompress(torch.ones(2), 10, 0, 0, 0, 0, torch.float32),
            "divisor must be",
        ),
        (lambda: ops.randk_decompress(torch.ones(2), 10, 0, 0, 0, 1, torch.int32), "dtype must be"),
        (
            lambda: ops.sparse_accumulate(
                torch.zeros(2, 15, dtype=torch.uint8), 10, 2, 1, torch.float32, torch.float32
            ),
            "payloads rows are",
        ),
        (
            lambda: ops.sparse_accumulate(
                torch.zeros(16, dtype=torch.uint8), 10, 2, 1, torch.float32, torch.float32
            ),
            "2 dimensions",
        ),
        (
            lambda: ops.sparse_accumulate(
                torch.zeros(1, 4, dtype=torch.float32), 10, 2, 1, torch.float32, torch.float32
            ),
            "must be uint8",
        ),
        (
            lambda: ops.sparse_accumulate(
                torch.zeros(1, 16, dtype=torch.uint8), 10, 2, 0, torch.float32, torch.float32
            ),
            "divisor must be",
        ),
        (
            lambda: ops.sparse_accumulate(
                torch.zeros(1, 16, dtype=torch.uint8), 10, 2, 1, torch.float32, torch.float32
            ),
            "strictly increasing",
        ),
    ],
)
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(RuntimeError, match=match):
        call()


def test_sparse_accumulate_rejects_out_of_range_index():
    p = torch.cat(
        [
            torch.tensor([3, 10], dtype=torch.int32).view(torch.uint8),
            torch.ones(2).view(torch.uint8),
        ]
    )
    with pytest.raises(RuntimeError, match=r"index 10 at position 1"):
        ops.sparse_accumulate(p[None], 10, 2, 1, torch.float32, torch.float32)


@pytest.mark.parametrize("with_residual", [False, True])
def test_randk_non_finite_anywhere_poisons_every_value(with_residual):
    n, k = 10007, 10
    x = gen(n, torch.float32, 8)
    x[5000] = float("inf")
    assert 5000 not in ref.randk_indices(n, k, 0, 0, 0).tolist()
    res = torch.zeros(n) if with_residual else None
    values = ops.randk_compress(x, res, k, 0, 0, 0)
    assert torch.isnan(values).all()
    res_ref = torch.zeros(n) if with_residual else None
    assert_bitwise(values, ref.randk_compress(x, res_ref, k, 0, 0, 0))


@pytest.mark.parametrize("dtype", FLOATS)
def test_out_variants_match_allocating_ops(dtype):
    n, k = 278011, 2781
    rows = torch.stack([ops.topk_compress(gen(n, torch.float32, r), None, k) for r in range(3)])
    want = ops.sparse_accumulate(rows, n, k, 3, torch.float32, dtype)
    out = torch.full((n,), 7.0, dtype=dtype)  # stale contents must not leak through
    scratch = torch.full((n,), 5.0) if dtype != torch.float32 else None
    got = ops.sparse_accumulate(rows, n, k, 3, torch.float32, dtype, out=out, scratch=scratch)
    assert got is out
    assert_bitwise(out, want)
    x, res, res_into = gen(n, dtype, 1), gen(n, torch.float32, 2), gen(n, torch.float32, 2)
    packed = torch.full((ops.topk_payload_bytes(k, dtype),), 255, dtype=torch.uint8)
    got = ops.topk_compress(x, res_into, k, True, 1, 2, dtype, out=packed)
    assert got is packed
    assert_bitwise(packed, ops.topk_compress(x, res, k, True, 1, 2, dtype))
    assert_bitwise(res_into, res)
    values = ops.randk_compress(gen(n, torch.float32), None, k, 1, 2, 3)
    out = torch.full((n,), 7.0, dtype=dtype)
    ops.randk_decompress(values, n, 1, 2, 3, 3, dtype, out=out)
    assert_bitwise(out, ops.randk_decompress(values, n, 1, 2, 3, 3, dtype))


def test_out_variants_opcheck_and_bad_input():
    n, k = 1000, 10
    rows = torch.stack([ops.topk_compress(gen(n, torch.float32, r), None, k) for r in range(2)])
    torch.library.opcheck(
        torch.ops.ddpcomm.randk_decompress_into, (torch.ones(k), torch.empty(n), 1, 2, 3, 2)
    )
    x = gen(n, torch.float32)
    with pytest.raises(RuntimeError, match="out must be a contiguous 1-D uint8"):
        ops.topk_compress(x, None, k, out=torch.empty(k * 8 - 1, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="needs a float32 scratch"):
        ops.sparse_accumulate(
            rows, n, k, 2, torch.float32, torch.float16, out=torch.empty(n, dtype=torch.float16)
        )
    with pytest.raises(RuntimeError, match="scratch must be"):
        torch.ops.ddpcomm.sparse_accumulate_into(
            rows, torch.empty(n, dtype=torch.float16), torch.empty(n - 1), k, 2, torch.float32
        )
    with pytest.raises(ValueError, match="out must have"):
        ops.sparse_accumulate(rows, n, k, 2, torch.float32, torch.float32, out=torch.empty(n + 1))


def test_sparse_accumulate_unchecked_matches_checked():
    n, k = 278011, 2781
    rows = torch.stack([ops.topk_compress(gen(n, torch.float32, r), None, k) for r in range(3)])
    for dtype in FLOATS:
        want = ops.sparse_accumulate(rows, n, k, 3, torch.float32, dtype)
        assert_bitwise(
            ops.sparse_accumulate(rows, n, k, 3, torch.float32, dtype, check=False), want
        )


def test_sparse_accumulate_unchecked_bad_rows_stay_in_bounds():
    # check=False trusts the payload: a bad one gives unspecified sums, but writes nothing
    # outside `out` (here a view with sentinels on both sides).
    idx = torch.tensor([3, 10, -1, 2**30], dtype=torch.int32)
    p = torch.cat([idx.view(torch.uint8), torch.ones(4).view(torch.uint8)])
    buf = torch.full((14,), 7.0)
    ops.sparse_accumulate(
        p[None], 10, 4, 1, torch.float32, torch.float32, out=buf[2:12], check=False
    )
    assert buf[:2].tolist() == [7.0, 7.0] and buf[12:].tolist() == [7.0, 7.0]
    assert buf[5].item() == 1.0


def _nan(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


@pytest.mark.parametrize("value_dtype", FLOATS)
def test_nan_outputs_are_canonical(value_dtype):
    # NaNs with odd payloads all rank as one key (ties to the lower index), and every NaN the
    # ops write is the canonical NaN of its dtype, as reference.py states.
    n = 5000
    x = gen(n, torch.float32, 3)
    x[10], x[20], x[30] = _nan(0x7FFFFFFF), _nan(0xFFC00000), _nan(0x7F800001)
    x[40] = float("inf")
    res = torch.zeros(n)
    res[40] = float("-inf")
    res_ref = res.clone()
    for k in (2, 50):
        got = ops.topk_compress(x, res, k, value_dtype=value_dtype)
        want = ref.topk_compress(x, res_ref, k, value_dtype=value_dtype)
        assert_bitwise(got, want)
        assert_bitwise(res, res_ref)
    idx, _ = split(ops.topk_compress(x, None, 2), 2)
    assert idx.tolist() == [10, 20]
    rows = torch.stack([ops.topk_compress(x, None, 50, value_dtype=value_dtype)] * 2)
    for dtype in FLOATS:
        assert_bitwise(
            ops.sparse_accumulate(rows, n, 50, 2, value_dtype, dtype),
            ref.sparse_accumulate(rows, n, 50, 2, value_dtype, dtype),
        )
    r, r_ref = torch.zeros(n), torch.zeros(n)
    values = ops.randk_compress(x, r, 50, 1, 2, 3)
    assert_bitwise(values, ref.randk_compress(x, r_ref, 50, 1, 2, 3))
    assert_bitwise(r, r_ref)
    for dtype in FLOATS:
        assert_bitwise(
            ops.randk_decompress(values, n, 1, 2, 3, 2, dtype),
            ref.randk_decompress(values, n, 1, 2, 3, 2, dtype),
        )
