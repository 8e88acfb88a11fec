"""q1.5's code (ops bits=3, csrc/numerics.h): bitwise against the oracle on every device,
and what the code promises, checked without the reference: which elements are kept, the
cap, the magnitude, scale invariance, non-finite blocks, malformed payloads, bad input."""

from __future__ import annotations

import pytest
import torch

from ddpcomm import compressors, ops
from tests.cuda_utils import DTYPES, assert_same_bits, oracle
from tests.test_ops_quantize import (
    _input,
    check_dequantize,
    check_quantize,
    check_requantize,
    gradient_like,
    random_payload_rows,
)

Q15 = ops.SPARSE_BITS


def _decode(x: torch.Tensor, block: int) -> torch.Tensor:
    return ops.dequantize(ops.quantize(x, None, Q15, block), x.numel(), Q15, block, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 255, 257, 4096 + 7, 278011])
def test_quantize_matches_reference(device, n, dtype):
    x = _input(n, dtype)
    for block in (32, 256, 512):
        for ef in (False, True):
            check_quantize(device, x, Q15, block, ef=ef, stochastic=False)


@pytest.mark.parametrize("block", [64, 1024, 8192, 65536])
def test_block_sizes_and_gradient_like_values(device, block):
    for n in (block - 1, 3 * block + 5, 2 * 65536 + 9):
        check_quantize(
            device, gradient_like(n, torch.float32, n), Q15, block, ef=True, stochastic=False
        )


def test_every_block_writes_its_own_signs(device):
    # Blocks of opposite signs in turn: a record holding a sign bit left from the block
    # before (a CUDA CTA's shared memory at B = 32, whose 16 signs fill half a word) differs.
    g = torch.Generator().manual_seed(5)
    for block in (32, 64):
        blocks = torch.rand(4096, block, generator=g) + 0.5
        x = (blocks * torch.tensor([-1.0, 1.0]).repeat(2048)[:, None]).reshape(-1)
        for ef in (False, True):
            check_quantize(device, x, Q15, block, ef=ef, stochastic=False)


@pytest.mark.parametrize("world", [3, 11])  # the CPU sums 8 rows at a time
def test_sum_requantize_and_arbitrary_payloads_match_reference(device, world):
    for n in (0, 999, 2**16 + 5):
        rows = torch.stack(
            [ops.quantize(_input(n, torch.float32, s), None, Q15, 128) for s in range(world)]
        )
        for ef in (False, True):
            check_requantize(device, rows, n, Q15, 128, world, ef=ef, stochastic=False)
        # Random bytes: bitmaps with more set bits than the record has signs for.
        for p in random_payload_rows(2, n, Q15, 128, n) if n else ():
            for dtype in DTYPES:
                check_dequantize(device, p, n, Q15, 128, dtype)
        got = ops.dequantize_sum(rows.to(device), n, Q15, 128, world, torch.float32)
        want = oracle(device).dequantize_sum(rows, n, Q15, 128, world, torch.float32)
        assert_same_bits(got, want)


def test_kept_elements_are_the_dead_zone_and_m_their_mean_abs():
    # Heavy-tailed (cubes of Gaussians): 17% exceed the dead zone, far from the cap.
    x = torch.randn(512, generator=torch.Generator().manual_seed(3)) ** 3 * 0.01
    t = 0.675 * float(x.double().square().mean().sqrt())
    keep = x.abs() > t
    assert 0 < int(keep.sum()) <= 256
    d = _decode(x, 512)
    assert torch.equal(d != 0, keep)
    m = float(x.abs()[keep].double().mean())
    # m travels as bfloat16: within half its ulp (2^-9 relative) of the kept mean.
    got = d[keep].abs().double()
    assert torch.allclose(got, torch.full_like(got, m), rtol=2.0**-8)
    assert bool((got == got[0]).all())
    assert torch.equal(torch.sign(d[keep]), torch.sign(x[keep]))


def test_the_cap_keeps_the_largest_half_ties_to_the_lower_index():
    # Uniform magnitudes in [1, 2): far more than half exceed 0.675 RMS.
    x = torch.rand(512, generator=torch.Generator().manual_seed(1)) + 1.0
    x[::3] *= -1
    d = _decode(x, 512)
    assert int((d != 0).sum()) == 256
    assert torch.equal(d != 0, x.abs() >= x.abs().sort(descending=True).values[255])
    # A constant block: all tie, the first half is sent.
    d = _decode(torch.full((1000,), 0.5), 512)
    assert torch.equal(d[:256], torch.full((256,), 0.5)) and not d[256:512].any()
    assert torch.equal(d[512:768], torch.full((256,), 0.5)) and not d[768:].any()


@pytest.mark.parametrize("over", [257, 300, 320, 400, 511])
def test_capped_blocks_whose_kept_values_sit_far_above_the_dead_zone(device, over):
    # `over` values of magnitude 10-11 (some of them tied) among near-zeros: the dead zone's
    # threshold lies far below them, so the kernels' search for the cap's key must widen its
    # band past the threshold several times before it holds the over - 256 it drops.
    g = torch.Generator().manual_seed(over)
    x = torch.rand(4 * 512, generator=g) * 1e-3
    for b in range(4):
        big = torch.randperm(512, generator=g)[:over] + 512 * b
        x[big] = 10.0 + torch.rand(over, generator=g).mul_(4).floor_().div_(4)
    x[torch.rand(x.numel(), generator=g) < 0.5] *= -1
    d = _decode(x, 512)
    assert int((d != 0).sum()) == 4 * 256
    check_quantize(device, x, Q15, 512, ef=False, stochastic=False)


def test_error_feedback_keeps_what_was_not_sent():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    r = torch.zeros(4096)
    p = ops.quantize(x, r, Q15, 512)
    d = ops.dequantize(p, 4096, Q15, 512, torch.float32)
    assert torch.equal(d + r, x) or torch.allclose(d + r, x, rtol=0, atol=1e-6)
    assert float((x - d).norm() / x.norm()) < 0.5  # 0.44 for Gaussian blocks


@pytest.mark.parametrize("exponent", [-100, -70, 70, 100])
def test_scale_invariant_down_to_tiny_and_up_to_huge(exponent):
    x = _input(3000, torch.float32, 4)
    scaled = x * 2.0**exponent
    a, b = ops.quantize(x, None, Q15, 256), ops.quantize(scaled, None, Q15, 256)
    rec = 2 + 256 * 3 // 16
    ra, rb = a.view(-1, rec), b.view(-1, rec)
    assert torch.equal(ra[:, 2:], rb[:, 2:])  # the same elements kept, the same signs
    ma, mb = (ops.magnitudes(p, rec, Q15).double() for p in (a, b))
    assert torch.equal(mb * 2.0**-exponent, ma)  # bfloat16 scales exactly by 2^k


def test_non_finite_blocks_decode_to_nan_and_leave_others_alone():
    x = torch.randn(1024, generator=torch.Generator().manual_seed(5))
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[700] = bad
        d = _decode(y, 512)
        assert d[512:].isnan().all()
        assert torch.equal(d[:512], _decode(x, 512)[:512])


def test_magnitudes_travel_as_bfloat16_saturated_not_infinite():
    x = torch.full((64,), 3.39e38)  # the mean rounds past bfloat16's largest finite value
    x[::2] = -3.39e38
    d = _decode(x, 32)
    big = torch.finfo(torch.bfloat16).max
    assert torch.equal(d.abs()[d != 0], torch.full((16, 2), big).reshape(-1))
    r = torch.zeros(64)
    p = ops.quantize(x, r, Q15, 32)
    assert torch.isfinite(r).all() and torch.isfinite(ops.magnitudes(p, 8, Q15)).all()


def test_payload_size_and_kept_share():
    n = 512 * 64
    g = torch.Generator().manual_seed(6)
    p = ops.quantize(torch.randn(n, generator=g), None, Q15, 512)
    assert p.numel() == ops.payload_bytes(n, Q15, 512) == 64 * (2 + 96)
    assert compressors.parse("q1.5").record_bytes == 98
    kept = float((_decode(torch.randn(n, generator=g), 512) != 0).float().mean())
    assert 0.45 < kept <= 0.5  # Gaussian blocks: about half exceed 0.675 sigma, capped at half


def test_stochastic_rounding_is_refused(device):
    x = torch.randn(100, device=device)
    with pytest.raises(RuntimeError, match="stochastic rounding is not defined for the 1.5-bit"):
        ops.quantize(x, None, Q15, 64, stochastic=True)
    rows = ops.quantize(x, None, Q15, 64).view(1, -1)
    with pytest.raises(RuntimeError, match="stochastic rounding is not defined for the 1.5-bit"):
        ops.dequantize_sum_requantize(rows, None, 100, Q15, 64, 1, stochastic=True)
    with pytest.raises(RuntimeError, match="stochastic rounding is not defined for the 1.5-bit"):
        torch.ops.ddpcomm.quantize_into(
            x,
            None,
            torch.empty(ops.payload_bytes(100, Q15, 64), dtype=torch.uint8, device=device),
            Q15,
            64,
            True,
            0,
            0,
            0,
        )
    with pytest.raises(ValueError, match="stochastic rounding is not defined for q1.5"):
        compressors.parse("q1.5", stochastic=True)


def test_spec_defaults():
    q = compressors.parse("q1.5")
    assert (q.bits, q.code, q.block_size, q.error_feedback, q.spec) == (1.5, Q15, 512, True, "q1.5")
    assert compressors.parse("q1.5,block_size=256").block_size == 256
    assert compressors.resolve_normalize(q, True).normalize == compressors.TERNARY_NORMALIZE
    assert compressors.default_schedule(q) == compressors.LOW_BIT_SCHEDULE
    assert [s.spec for s in compressors.ramp_stages(q)] == ["q8", "q4"]
    assert q.wire_bytes(512 * 10, 2) == 10 * 98
    with pytest.raises(ValueError, match="bits must be one of 1, 1.5, 2, 4, 8"):
        compressors.Quantizer(3)
