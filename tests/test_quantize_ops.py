"""Quantizer ops: native == reference bitwise, opcheck, error bounds, unbiasedness, bad input."""

import math

import pytest
import torch

from ddpcomm import ops
from ddpcomm import reference as ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = [1, 2, 4, 8]


def _input(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Mixed magnitudes so blocks differ in scale; a few exact zeros.
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    x[::17] = 0.0
    return x.to(dtype)


def _check_quantize(n, dtype, bits, block, stochastic, ef, seed=1, step=2, offset=3):
    x = _input(n, dtype)
    r_native = torch.randn(n) * 0.1 if ef else None
    r_ref = r_native.clone() if ef else None
    p_native = ops.quantize(x, r_native, bits, block, stochastic, seed, step, offset)
    p_ref = ref.quantize(x, r_ref, bits, block, stochastic, seed, step, offset)
    assert p_native.dtype == torch.uint8
    assert p_native.numel() == ops.payload_bytes(n, bits, block)
    assert torch.equal(p_native, p_ref)
    if ef:
        assert torch.equal(r_native, r_ref)
    d_native = ops.dequantize(p_native, n, bits, block, dtype)
    assert torch.equal(d_native, ref.dequantize(p_ref, n, bits, block, dtype))
    return x, p_native


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 255, 257, 4096 + 7])
def test_quantize_matches_reference(n, dtype, bits):
    for stochastic in (False, True):
        for ef in (False, True):
            _check_quantize(n, dtype, bits, 256, stochastic, ef)


@pytest.mark.parametrize("bits", BITS)
def test_quantize_large_odd_sizes(bits):
    # Sizes crossing many blocks and parallel chunks: 2^20 + 3 and apex's 278011.
    for n in (2**20 + 3, 278011):
        _check_quantize(n, torch.float32, bits, 256, stochastic=bits == 4, ef=True)


@pytest.mark.parametrize("block", [32, 64, 1024, 65536])
def test_block_sizes(block):
    for n in (block - 1, block + 1, 3 * block):
        for bits in BITS:
            _check_quantize(n, torch.float32, bits, block, stochastic=False, ef=True)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_sum_matches_reference(bits, dtype):
    for n in (0, 1, 1000, 2**16 + 5):
        payloads = torch.stack(
            [ops.quantize(_input(n, torch.float32, s), None, bits, 128) for s in range(3)]
        )
        for divisor in (1, 3):
            got = ops.dequantize_sum(payloads, n, bits, 128, divisor, dtype)
            want = ref.dequantize_sum(payloads, n, bits, 128, divisor, dtype)
            assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("bits", BITS)
def test_dequantize_sum_requantize_matches_reference(bits):
    for n in (0, 1, 999, 2**16 + 5):
        payloads = torch.stack(
            [ops.quantize(_input(n, torch.float32, s), None, bits, 128) for s in range(4)]
        )
        for stochastic in (False, True):
            for ef in (False, True):
                r1 = torch.randn(n) if ef else None
                r2 = r1.clone() if ef else None
                got = ops.dequantize_sum_requantize(
                    payloads, r1, n, bits, 128, 4, stochastic, 5, 6, 7
                )
                want = ref.dequantize_sum_requantize(
                    payloads, r2, n, bits, 128, 4, stochastic, 5, 6, 7
                )
                assert torch.equal(got, want)
                if ef:
                    assert torch.equal(r1, r2)


def _magnitudes(packed, n, bits, block):
    nb = math.ceil(n / block)
    rec = 4 + block * bits // 8
    return packed.view(nb, rec)[:, :4].contiguous().view(torch.float32).view(nb)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_error_bound_half_step(bits):
    # Deterministic rounding: |x - deq(q(x))| <= step/2 with step = m / L per block. The
    # dequantized level m * (k / L) carries one extra fp32 rounding of k / L, so allow
    # a relative 2^-22 of m on top.
    n, block = 100_003, 256
    x = _input(n, torch.float32)
    packed = ops.quantize(x, None, bits, block)
    deq = ops.dequantize(packed, n, bits, block, torch.float32)
    m = _magnitudes(packed, n, bits, block).repeat_interleave(block)[:n]
    step = m / ref.max_level(bits)
    assert bool(((x - deq).abs() <= step / 2 + m * 2**-22).all())


def test_one_bit_error_bound():
    # 1-bit: deq = sign(x) * mean|x| of the block, so |x - deq| = ||x| - m| <= max(|x|, m).
    n, block = 10_007, 128
    x = _input(n, torch.float32)
    packed = ops.quantize(x, None, 1, block)
    deq = ops.dequantize(packed, n, 1, block, torch.float32)
    m = _magnitudes(packed, n, 1, block).repeat_interleave(block)[:n]
    assert torch.equal(deq.abs(), m)
    assert bool((torch.sign(deq) == torch.where(x >= 0, 1.0, -1.0)).all())


@pytest.mark.parametrize("bits", BITS)
def test_stochastic_rounding_unbiased(bits):
    # Mean of deq over many seeds converges to x: the standard error of one draw is at
    # most step/2 (m for 1-bit), so with S seeds the mean is within 5 * step / sqrt(S).
    n, block, seeds = 512, 64, 400
    x = torch.linspace(-1.0, 1.0, n) * torch.tensor([0.3, 1.0]).repeat(n // 2)
    acc = torch.zeros(n, dtype=torch.float64)
    for s in range(seeds):
        acc += ops.dequantize(
            ops.quantize(x, None, bits, block, True, s, 0), n, bits, block, torch.float32
        ).double()
    mean = (acc / seeds).float()
    m = x.abs().view(-1, block).amax(1).repeat_interleave(block)
    step = m if bits == 1 else m / ref.max_level(bits)
    assert bool(((mean - x).abs() <= 5 * step / math.sqrt(seeds)).all())
    # And deterministic rounding is visibly biased on the same input, so the test can fail.
    if bits <= 2:
        det = ops.dequantize(ops.quantize(x, None, bits, block), n, bits, block, torch.float32)
        assert not bool(((det - x).abs() <= 5 * step / math.sqrt(seeds)).all())


@pytest.mark.parametrize("bits", BITS)
def test_constant_blocks_round_trip_exactly(bits):
    for value in (0.0, 0.75, -3.0, 1e-20):
        x = torch.full((1024,), value)
        stochastic = False
        deq = ops.dequantize(
            ops.quantize(x, None, bits, 256, stochastic), 1024, bits, 256, torch.float32
        )
        assert torch.equal(deq, x)


def test_error_feedback_accumulates_exactly():
    # residual after = e - deq(code(e)), so x + r_before == deq + r_after elementwise.
    n = 5000
    x = _input(n, torch.float32)
    r = torch.randn(n) * 0.01
    before = r.clone()
    packed = ops.quantize(x, r, 2, 256)
    deq = ops.dequantize(packed, n, 2, 256, torch.float32)
    torch.testing.assert_close(x + before, deq + r, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bits", [1, 8])
def test_non_finite_blocks_give_nan(bits):
    x = torch.randn(1000)
    x[10] = float("inf")
    x[700] = float("nan")
    deq = ops.dequantize(ops.quantize(x, None, bits, 256), 1000, bits, 256, torch.float32)
    assert bool(deq[:256].isnan().all()) and bool(deq[512:768].isnan().all())
    assert bool(deq[256:512].isfinite().all()) and bool(deq[768:].isfinite().all())


def test_opcheck_every_op():
    x = _input(1000, torch.float32)
    r = torch.zeros(1000)
    payloads = torch.stack([ops.quantize(x, None, 4, 64), ops.quantize(-x, None, 4, 64)])
    packed = torch.empty(ops.payload_bytes(1000, 4, 64), dtype=torch.uint8)
    cases = [
        (torch.ops.ddpcomm.quantize_into.default, (x, r, packed, 4, 64, True, 1, 2, 3)),
        (torch.ops.ddpcomm.quantize_into.default, (x, None, packed, 4, 64, False, 0, 0, 0)),
        (
            torch.ops.ddpcomm.dequantize_sum_into.default,
            (payloads[:1], torch.empty(1000, dtype=torch.float16), 4, 64, 1),
        ),
        (torch.ops.ddpcomm.dequantize_sum_into.default, (payloads, torch.empty(1000), 4, 64, 2)),
        (
            torch.ops.ddpcomm.dequantize_sum_requantize_into.default,
            (payloads, r, packed, 1000, 4, 64, 2, False, 0, 0, 0),
        ),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


# -- bad input ------------------------------------------------------------------------


def test_bad_bits_and_block():
    x = torch.randn(100)
    with pytest.raises(RuntimeError, match="bits must be one of 1, 2, 4, 8"):
        ops.quantize(x, None, 3, 64)
    with pytest.raises(RuntimeError, match="block_size must be a power of two"):
        ops.quantize(x, None, 8, 48)
    with pytest.raises(RuntimeError, match="block_size must be a power of two"):
        ops.quantize(x, None, 8, 16)


def test_bad_dtypes():
    with pytest.raises(RuntimeError, match="x must be float32, float16 or bfloat16"):
        ops.quantize(torch.arange(10), None, 8, 64)
    with pytest.raises(RuntimeError, match="x must be float32, float16 or bfloat16"):
        ops.quantize(torch.randn(10, dtype=torch.complex64), None, 8, 64)
    with pytest.raises(RuntimeError, match="residual must be float32"):
        ops.quantize(torch.randn(10), torch.zeros(10, dtype=torch.float16), 8, 64)
    with pytest.raises(RuntimeError, match="residual must have 10 elements"):
        ops.quantize(torch.randn(10), torch.zeros(11), 8, 64)


def test_mismatched_payload_sizes():
    p = ops.quantize(torch.randn(1000), None, 8, 64)
    with pytest.raises(RuntimeError, match="needs 1088 bytes, got 1087"):
        ops.dequantize(p[:-1], 1000, 8, 64, torch.float32)
    with pytest.raises(RuntimeError, match="payloads must have 2 dimension"):
        ops.dequantize_sum(p, 1000, 8, 64, 1, torch.float32)
    with pytest.raises(RuntimeError, match="payloads must be uint8"):
        ops.dequantize(p.float(), 1000, 8, 64, torch.float32)
    with pytest.raises(RuntimeError, match="dtype must be float32, float16 or bfloat16"):
        ops.dequantize(p, 1000, 8, 64, torch.int32)
    with pytest.raises(RuntimeError, match="divisor must be >= 1"):
        ops.dequantize_sum(p.view(1, -1), 1000, 8, 64, 0, torch.float32)


def _nan(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("bits", BITS)
def test_nan_outputs_are_canonical(bits):
    # NaN inputs with odd payloads (signalling, negative, all ones) and Inf - Inf: the x86
    # core would propagate or invent each of them; every op writes the canonical NaN instead.
    n, block = 1000, 64
    x = _input(n, torch.float32)
    x[3], x[70], x[200] = _nan(0x7F800001), _nan(0xFFC00000), _nan(0x7FFFFFFF)
    x[300] = float("inf")
    r = torch.zeros(n)
    r[300] = float("-inf")
    r_ref = r.clone()
    p = ops.quantize(x, r, bits, block)
    assert _same_bits(p, ref.quantize(x, r_ref, bits, block))
    assert _same_bits(r, r_ref)
    assert r[[3, 70, 200, 300]].isnan().all()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        got = ops.dequantize(p, n, bits, block, dtype)
        assert _same_bits(got, ref.dequantize(p, n, bits, block, dtype))
        nan_bits = ref.canonical(torch.tensor([float("nan")], dtype=dtype))
        assert _same_bits(got[3:4], nan_bits)
    rows = torch.stack([p, p])
    r2 = torch.zeros(n)
    r2_ref = r2.clone()
    got = ops.dequantize_sum_requantize(rows, r2, n, bits, block, 2)
    assert _same_bits(got, ref.dequantize_sum_requantize(rows, r2_ref, n, bits, block, 2))
    assert _same_bits(r2, r2_ref)
