"""Quantizer ops on every device: bitwise against the oracle (reference.py for the CPU op, the
CPU op for CUDA), opcheck, error bounds, unbiasedness, canonical NaNs, bad input. The last
section sweeps the CUDA kernels' launch paths, which the CPU kernels do not have."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import ddpcomm
from ddpcomm import ops
from ddpcomm import reference as ref
from tests.cuda_utils import (
    CUDA,
    DTYPES,
    assert_same_bits,
    assert_same_bytes,
    needs_cuda,
    oracle,
)

BITS = [1, 2, 4, 8]
# 32: 64 blocks per CTA; 256: one warp per block; 4096 / 8192: 2 / 4 register rows per
# thread; 16384 / 65536: the split path (8 / 32 rows, blocks over several CTAs).
BLOCKS = [32, 256, 4096, 8192, 16384, 65536]
LARGE = [278011, (1 << 20) + 3]  # cross CTA, grid and block boundaries at every B


def _input(n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Mixed magnitudes so blocks differ in scale; a few exact zeros.
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))
    x[::17] = 0.0
    return x.to(dtype)


def gradient_like(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values whose fp32 sums are sensitive to addition order, with per-region scales
    spanning 2**-12 .. 2**12, and some all-zero stretches (degenerate blocks)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, generator=g) * 2 - 1
    scale = torch.exp2(torch.randint(-12, 13, ((n + 999) // 1000,), generator=g).float())
    x = x * scale.repeat_interleave(1000)[:n]
    if n >= 2 * 65536:
        x[65536 : 2 * 65536] = 0.0  # one whole block (m = 0) at every tested block size
    return x.to(dtype)


def residual_like(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return (torch.rand(n, generator=g) - 0.5) * 0.01


def random_payload_rows(rows, n, bits, block, seed):
    """Payload rows of arbitrary code bytes (any code value) and finite scales of either sign."""
    g = torch.Generator().manual_seed(seed)
    nbytes = ops.payload_bytes(n, bits, block)
    p = torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, generator=g)
    nb, rec = -(-n // block), ops.payload_bytes(block, bits, block)
    scales = torch.rand(rows, nb, generator=g) * 8 - 4
    p.view(rows, nb, rec)[:, :, :4] = scales.view(torch.uint8).view(rows, nb, 4)
    return p


def _nan(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


def check_dequantize(device, packed, n, bits, block, dtype):
    got = ops.dequantize(packed.to(device), n, bits, block, dtype)
    assert got.device.type == device and got.dtype == dtype
    assert_same_bits(got, oracle(device).dequantize(packed, n, bits, block, dtype))


def check_quantize(device, x, bits, block, *, ef, stochastic, seed=1, step=2, offset=3):
    """The op on `device` against the oracle: payload, residual, and its dequantization."""
    n = x.numel()
    r_want = residual_like(n, seed) if ef else None
    r_got = r_want.clone().to(device) if ef else None
    args = (bits, block, stochastic, seed, step, offset)
    got = ops.quantize(x.to(device), r_got, *args)
    want = oracle(device).quantize(x, r_want, *args)
    assert got.device.type == device and got.dtype == torch.uint8
    assert got.numel() == ops.payload_bytes(n, bits, block)
    assert_same_bytes(got, want)
    if ef:
        assert_same_bits(r_got, r_want)
    check_dequantize(device, want, n, bits, block, x.dtype)
    return got


# --------------------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------------------


@needs_cuda
def test_cuda_ops_are_built_when_cuda_is_available():
    # Fails, not skips: a CUDA machine running a CPU-only build would otherwise fail every
    # CUDA case with a dispatch error that hides the cause.
    info = ddpcomm.build_info()
    assert info["cuda"], (
        "torch sees a CUDA device but ddpcomm was built without CUDA ops "
        f"(build_info: {info}); rebuild with nvcc on PATH and a CUDA build of torch"
    )


# --------------------------------------------------------------------------------------
# quantize, dequantize
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [0, 1, 255, 257, 4096 + 7])
def test_quantize_matches_reference(device, n, dtype, bits):
    x = _input(n, dtype)
    for stochastic in (False, True):
        for ef in (False, True):
            check_quantize(device, x, bits, 256, ef=ef, stochastic=stochastic)


@pytest.mark.parametrize("bits", BITS)
def test_quantize_large_odd_sizes(device, bits):
    # Sizes crossing many blocks and parallel chunks: 2^20 + 3 and apex's 278011.
    for n in LARGE:
        check_quantize(device, _input(n, torch.float32), bits, 256, stochastic=bits == 4, ef=True)


@pytest.mark.parametrize("block", [32, 64, 1024, 65536])
def test_block_sizes(device, block):
    for n in (block - 1, block + 1, 3 * block):
        for bits in BITS:
            check_quantize(device, _input(n, torch.float32), bits, block, ef=True, stochastic=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", [32, 256, 4096, 65536])
def test_dequantize_arbitrary_payloads(device, block, bits, dtype):
    # Real payloads and ones of arbitrary codes and scales of either sign.
    sizes = [0, 1, block - 1, block + 1] + (LARGE if device == "cuda" else [])
    for n in sizes:
        real = ops.quantize(gradient_like(n, torch.float32, n), None, bits, block)
        for p in (real, random_payload_rows(1, n, bits, block, n)[0]):
            check_dequantize(device, p, n, bits, block, dtype)


@pytest.mark.parametrize("bits", [1, 8])
def test_non_finite_blocks_give_nan(device, bits):
    x = torch.randn(1000)
    x[10] = float("inf")
    x[700] = float("nan")
    packed = ops.quantize(x.to(device), None, bits, 256)
    deq = ops.dequantize(packed, 1000, bits, 256, torch.float32).cpu()
    assert bool(deq[:256].isnan().all()) and bool(deq[512:768].isnan().all())
    assert bool(deq[256:512].isfinite().all()) and bool(deq[768:].isfinite().all())


@pytest.mark.parametrize("bits", BITS)
def test_quantize_non_finite_blocks(device, bits):
    # The block of a non-finite value stores NaN and dequantizes to NaN; x + residual and
    # sums may overflow from finite values (3e38); blocks 2048 and 16384 take the other
    # CUDA paths.
    for block in (32, 2048, 16384):
        x = gradient_like(5 * block + 3, torch.float32, seed=block)
        x[3] = float("nan")
        x[block + 1] = float("inf")
        x[2 * block + 7] = -float("inf")
        x[4 * block + 2] = 3e38
        x[4 * block + 9] = 3e38
        for stochastic in (False, True):
            check_quantize(device, x, bits, block, ef=True, stochastic=stochastic)
            got = check_quantize(device, x, bits, block, ef=False, stochastic=stochastic)
        deq = ops.dequantize(got, x.numel(), bits, block, torch.float32).cpu()
        assert bool(deq[:block].isnan().all()) and bool(deq[3 * block : 4 * block].isfinite().all())


@pytest.mark.parametrize("bits", BITS)
def test_nan_outputs_are_canonical(device, bits):
    # NaN inputs with odd payloads (signalling, negative, all ones) and Inf - Inf: the x86
    # core would propagate or invent each of them, the GPU its own 0x7FFFFFFF; every op
    # writes the canonical NaN of its dtype instead (reference.canonical).
    n, block = 1000, 64
    x = _input(n, torch.float32)
    x[3], x[70], x[200] = _nan(0x7F800001), _nan(0xFFC00000), _nan(0x7FFFFFFF)
    x[300] = float("inf")
    r = torch.zeros(n)
    r[300] = float("-inf")
    r_got = r.clone().to(device)
    got = ops.quantize(x.to(device), r_got, bits, block)
    assert_same_bytes(got, ref.quantize(x, r, bits, block))
    assert_same_bits(r_got, r)
    assert r[[3, 70, 200, 300]].isnan().all()
    for dtype in DTYPES:
        deq = ops.dequantize(got, n, bits, block, dtype)
        assert_same_bits(deq, ref.dequantize(got.cpu(), n, bits, block, dtype))
        assert_same_bits(deq[3:4], ref.canonical(torch.tensor([float("nan")], dtype=dtype)))
    rows = torch.stack([got.cpu(), got.cpu()])
    r2 = torch.zeros(n)
    r2_got = r2.clone().to(device)
    requant = ops.dequantize_sum_requantize(rows.to(device), r2_got, n, bits, block, 2)
    assert_same_bytes(requant, ref.dequantize_sum_requantize(rows, r2, n, bits, block, 2))
    assert_same_bits(r2_got, r2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_unaligned_views(device, dtype):
    # Views that start mid-vector (the scalar load/store path on CUDA); elements of the
    # residual outside the view stay untouched.
    n, block = 10007, 256
    base = gradient_like(n + 3, dtype, seed=5)
    res_base = residual_like(n + 3, seed=5)
    for off in (1, 2, 3):
        res_want = res_base[off : off + n].clone()
        want = oracle(device).quantize(base[off : off + n], res_want, 4, block)
        res_got_base = res_base.clone().to(device)
        res_got = res_got_base[off : off + n]
        got = ops.quantize(base.to(device)[off : off + n], res_got, 4, block)
        assert_same_bytes(got, want)
        assert_same_bits(res_got, res_want)
        assert_same_bits(res_got_base[:off], res_base[:off])
        assert_same_bits(res_got_base[off + n :], res_base[off + n :])


def test_quantize_noncontiguous_input(device):
    x = gradient_like(2 * 3001, torch.float32, seed=11).view(3001, 2).t()
    assert not x.is_contiguous()
    got = ops.quantize(x.to(device), None, 8, 64)
    assert_same_bytes(got, oracle(device).quantize(x, None, 8, 64))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("offset", [0, 1, 2, 4])
def test_quantize_into_a_byte_slice(device, bits, offset):
    # `out` is a slice of a larger buffer: at offsets 1 and 2 the payload is not 4-byte
    # aligned (CUDA stores byte by byte); bytes outside the payload stay put.
    n, block = 70001, 512
    x = gradient_like(n, torch.float32, seed=bits)
    res_want = residual_like(n, seed=bits)
    res_got = res_want.clone().to(device)
    want = oracle(device).quantize(x, res_want, bits, block)
    size = want.numel()
    buf = torch.full((size + offset + 5,), 0xA5, dtype=torch.uint8, device=device)
    out = buf[offset : offset + size]
    got = ops.quantize(x.to(device), res_got, bits, block, out=out)
    assert got is out
    assert_same_bytes(got, want)
    assert_same_bits(res_got, res_want)
    assert bool((buf[:offset] == 0xA5).all()) and bool((buf[offset + size :] == 0xA5).all())


# --------------------------------------------------------------------------------------
# dequantize_sum, dequantize_sum_requantize
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequantize_sum_matches_reference(device, bits, dtype):
    for n in (0, 1, 1000, 2**16 + 5):
        payloads = torch.stack(
            [ops.quantize(_input(n, torch.float32, s), None, bits, 128) for s in range(3)]
        )
        for divisor in (1, 3):
            got = ops.dequantize_sum(payloads.to(device), n, bits, 128, divisor, dtype)
            want = oracle(device).dequantize_sum(payloads, n, bits, 128, divisor, dtype)
            assert got.dtype == dtype
            assert_same_bits(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", [*BITS, ops.SPARSE_BITS])
def test_dequantize_sum_times_a_scale(device, bits, dtype):
    # The normalize path: out.mul_(scale) folded into the decode, with its numbers (one
    # rounding of the product for fp32, a second one to the dtype for 16-bit outputs) and
    # canonical NaNs (a non-finite block).
    for n in (1, 1000, 2**16 + 5):
        x = _input(n, torch.float32, n)
        x[n // 2] = float("nan")
        payloads = torch.stack(
            [ops.quantize(x, None, bits, 128), ops.quantize(-x, None, bits, 128)]
        )
        scale = torch.rand(n, generator=torch.Generator().manual_seed(n)) * 1e3 + 1e-3
        for divisor in (1, 2):
            got = ops.dequantize_sum(
                payloads.to(device), n, bits, 128, divisor, dtype, scale=scale.to(device)
            )
            want = oracle(device).dequantize_sum(
                payloads, n, bits, 128, divisor, dtype, scale=scale
            )
            assert_same_bits(got, want)
            plain = ops.dequantize_sum(payloads.to(device), n, bits, 128, divisor, dtype)
            plain.mul_(scale.to(device))
            assert torch.equal(got.isnan(), plain.isnan())  # torch's NaN bits vary by path
            assert torch.equal(got.nan_to_num(), plain.nan_to_num())
        one = ops.dequantize(payloads[0].to(device), n, bits, 128, dtype, scale=scale.to(device))
        assert_same_bits(
            one, oracle(device).dequantize(payloads[0], n, bits, 128, dtype, scale=scale)
        )


def test_dequantize_sum_bad_scales(device):
    p = ops.quantize(torch.randn(100, device=device), None, 8, 64).view(1, -1)
    out = torch.empty(100, device=device)
    ones = functools.partial(torch.ones, device=device)  # .to("cuda") would make [::2] dense
    for scale in (ones(99), ones(100, dtype=torch.float64), ones(200)[::2]):
        with pytest.raises(
            RuntimeError, match="dequantize_sum: scale must be a contiguous float32"
        ):
            ops.dequantize_sum(p, 100, 8, 64, 1, torch.float32, out, scale)
        with pytest.raises(
            RuntimeError, match="dequantize_sum: scale must be a contiguous float32"
        ):
            torch.ops.ddpcomm.dequantize_sum_into(p, out, 8, 64, 1, scale)
    with pytest.raises(ValueError, match="dequantize_sum: scale and out share memory"):
        ops.dequantize_sum(p, 100, 8, 64, 1, torch.float32, out, out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", [32, 1024, 16384])
def test_dequantize_sum_arbitrary_rows(device, block, bits, dtype):
    sizes = [0, 1, block - 1, block + 1] + (LARGE if device == "cuda" else [])
    for n in sizes:
        for rows, divisor in ((1, 1), (3, 3), (4, 7)):
            p = random_payload_rows(rows, n, bits, block, seed=n + rows)
            got = ops.dequantize_sum(p.to(device), n, bits, block, divisor, dtype)
            assert_same_bits(got, oracle(device).dequantize_sum(p, n, bits, block, divisor, dtype))


@pytest.mark.parametrize("bits", BITS)
def test_dequantize_unaligned_payloads(device, bits):
    # Payloads that start at an odd byte (rows, exactly payload_bytes long, are whole records
    # of 4 + B * bits / 8 bytes, a multiple of 4): the byte-wise read path on CUDA.
    n, block, rows = 5000, 128, 3
    p = random_payload_rows(rows, n, bits, block, seed=bits)
    shifted = torch.zeros(p.numel() + 3, dtype=torch.uint8)
    shifted[3:] = p.reshape(-1)
    odd = shifted[3:].view(rows, -1)
    got = ops.dequantize_sum(odd.to(device), n, bits, block, 3, torch.float32)
    assert_same_bits(got, oracle(device).dequantize_sum(odd, n, bits, block, 3, torch.float32))
    flat = torch.zeros(p.shape[1] + 1, dtype=torch.uint8)
    flat[1:] = p[0]
    got = ops.dequantize(flat.to(device)[1:], n, bits, block, torch.float16)
    assert_same_bits(got, oracle(device).dequantize(flat[1:], n, bits, block, torch.float16))


def test_dequantize_non_finite_scales(device):
    n, block, bits = 3000, 64, 8
    p = random_payload_rows(2, n, bits, block, seed=1)
    rec = 4 + block
    p[0, 0:4] = torch.tensor([float("nan")]).view(torch.uint8)
    p[1, rec : rec + 4] = torch.tensor([float("inf")]).view(torch.uint8)
    for dtype in DTYPES:
        got = ops.dequantize_sum(p.to(device), n, bits, block, 2, dtype)
        assert_same_bits(got, oracle(device).dequantize_sum(p, n, bits, block, 2, dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_dequantize_into_a_view(device, dtype, offset):
    n, block, bits, rows = 40003, 128, 4, 3
    p = random_payload_rows(rows, n, bits, block, seed=offset)
    buf = torch.zeros(n + offset + 2, dtype=dtype, device=device)
    out = buf[offset : offset + n]
    got = ops.dequantize(p[0].to(device), n, bits, block, dtype, out=out)
    assert got is out
    assert_same_bits(got, oracle(device).dequantize(p[0], n, bits, block, dtype))
    got = ops.dequantize_sum(p.to(device), n, bits, block, 3, dtype, out=out)
    assert_same_bits(got, oracle(device).dequantize_sum(p, n, bits, block, 3, dtype))
    assert bool((buf[:offset] == 0).all()) and bool((buf[offset + n :] == 0).all())


def check_requantize(
    device, p, n, bits, block, divisor, *, ef, stochastic, res=None, rng=(77, 3, 1000)
):
    res_want = (residual_like(n, seed=n) * divisor if res is None else res.clone()) if ef else None
    res_got = res_want.clone().to(device) if ef else None
    args = (n, bits, block, divisor, stochastic, *rng)
    got = ops.dequantize_sum_requantize(p.to(device), res_got, *args)
    assert_same_bytes(got, oracle(device).dequantize_sum_requantize(p, res_want, *args))
    if ef:
        assert_same_bits(res_got, res_want)


@pytest.mark.parametrize("bits", BITS)
def test_dequantize_sum_requantize_matches_reference(device, bits):
    for n in (0, 1, 999, 2**16 + 5):
        payloads = torch.stack(
            [ops.quantize(_input(n, torch.float32, s), None, bits, 128) for s in range(4)]
        )
        for stochastic in (False, True):
            for ef in (False, True):
                res = torch.randn(n, generator=torch.Generator().manual_seed(n))
                check_requantize(
                    device,
                    payloads,
                    n,
                    bits,
                    128,
                    4,
                    ef=ef,
                    stochastic=stochastic,
                    res=res,
                    rng=(5, 6, 7),
                )


def test_dequantize_sum_requantize_non_finite_rows(device):
    n, block, bits = 4 * 512 + 9, 512, 4
    p = random_payload_rows(3, n, bits, block, seed=4)
    rec = 4 + block * bits // 8
    p[1, 0:4] = torch.tensor([float("nan")]).view(torch.uint8)
    p[2, 2 * rec : 2 * rec + 4] = torch.tensor([float("inf")]).view(torch.uint8)
    for stochastic in (False, True):
        check_requantize(device, p, n, bits, block, 3, ef=True, stochastic=stochastic)


# --------------------------------------------------------------------------------------
# Error bounds and rounding (properties of the payload; the oracle fixes the bits)
# --------------------------------------------------------------------------------------


def _magnitudes(packed, n, bits, block):
    nb = math.ceil(n / block)
    rec = 4 + block * bits // 8
    return packed.view(nb, rec)[:, :4].contiguous().view(torch.float32).view(nb)


@pytest.mark.parametrize("bits", [4, 8])
def test_error_bound_half_step(device, bits):
    # Deterministic rounding: |x - deq(q(x))| <= step/2 with step = m / L per block. The
    # dequantized level m * (k / L) carries one extra fp32 rounding of k / L, so allow
    # a relative 2^-22 of m on top.
    n, block = 100_003, 256
    x = _input(n, torch.float32)
    packed = ops.quantize(x.to(device), None, bits, block)
    deq = ops.dequantize(packed, n, bits, block, torch.float32).cpu()
    m = _magnitudes(packed.cpu(), n, bits, block).repeat_interleave(block)[:n]
    step = m / ref.max_level(bits)
    assert bool(((x - deq).abs() <= step / 2 + m * 2**-22).all())


def test_two_bit_magnitude_is_clipped(device):
    # Deterministic 2-bit: m = min(max |x|, 1.5 mean |x|) per block; values within m round
    # to the nearest of -m, 0, m (half-step bound), values beyond it code sign(x) * m.
    n, block = 10_007, 256
    x = _input(n, torch.float32)
    packed = ops.quantize(x.to(device), None, 2, block)
    deq = ops.dequantize(packed, n, 2, block, torch.float32).cpu()
    m = _magnitudes(packed.cpu(), n, 2, block)
    blocks = torch.zeros(m.numel() * block)
    blocks[:n] = x
    blocks = blocks.view(-1, block).abs()
    valid = torch.full_like(m, block)
    valid[-1] = n - (m.numel() - 1) * block
    mean = ref._tree_sum(blocks) / valid
    assert torch.equal(m, torch.minimum(blocks.amax(1), torch.tensor(1.5) * mean))
    assert bool((m < blocks.amax(1)).any()), "no block was clipped: the test shows nothing"
    m = m.repeat_interleave(block)[:n]
    inside = x.abs() <= m
    assert bool(((x - deq).abs()[inside] <= (m / 2 + m * 2**-22)[inside]).all())
    assert torch.equal(deq[~inside], (torch.sign(x) * m)[~inside])


def test_one_bit_error_bound(device):
    # 1-bit: deq = sign(x) * mean|x| of the block, so |x - deq| = ||x| - m| <= max(|x|, m).
    n, block = 10_007, 128
    x = _input(n, torch.float32)
    packed = ops.quantize(x.to(device), None, 1, block)
    deq = ops.dequantize(packed, n, 1, block, torch.float32).cpu()
    m = _magnitudes(packed.cpu(), n, 1, block).repeat_interleave(block)[:n]
    assert torch.equal(deq.abs(), m)
    assert bool((torch.sign(deq) == torch.where(x >= 0, 1.0, -1.0)).all())


def test_code_thresholds_match_reference(device):
    # The 1- and 2-bit codes come from comparisons, not rounding: a block whose values sit
    # exactly on the ternary thresholds v = +-0.5 (even rounding: code 0) and just past them,
    # and signed zeros for the 1-bit sign, must give the reference's bits. Block of 32:
    # 16 values of +-2 and 16 of +-1 (with -0.0 and neighbours of 1): 2-bit m = 2 (1.5 mean
    # |x| is larger), so +-1 sits at v = +-0.5.
    block = 32
    up, down = 1.0 + 2.0**-23, 1.0 - 2.0**-24  # float32's neighbours of 1
    half = [1.0, -1.0, up, -up, down, -down, 1.0, -1.0] * 2
    x = torch.tensor([2.0, -2.0] * 8 + half)
    zeros = torch.tensor([0.0, -0.0] * 16)
    zeros[::5] = 1.0
    zeros[1::7] = -1.0
    for case in (x, zeros):
        for bits in (1, 2):
            packed = ops.quantize(case.to(device), None, bits, block)
            assert torch.equal(packed.cpu(), ref.quantize(case, None, bits, block)), (bits, case)
    deq = ops.dequantize(ops.quantize(x.to(device), None, 2, block), 32, 2, block, torch.float32)
    assert deq.cpu()[16:].tolist() == [0.0, 0.0, 2.0, -2.0, 0.0, 0.0, 0.0, 0.0] * 2


@pytest.mark.parametrize("bits", [4, 8])
def test_rounding_ties_and_extremes_match_reference(device, bits):
    # 4- and 8-bit codes round v = x * L / m half to even, with no clamp left to hide a
    # wrong rounding: blocks of max |x| = L (so v = x) holding every half-way value
    # +-(j + 1/2) up to L - 1/2, their float neighbours, +-L itself and signed zeros.
    L = 2 ** (bits - 1) - 1
    halves = torch.arange(L, dtype=torch.float32) + 0.5
    near = torch.cat(
        [halves, torch.nextafter(halves, halves + 1), torch.nextafter(halves, halves - 1)]
    )
    x = torch.cat([near, -near, torch.tensor([float(L), -float(L), 0.0, -0.0])])
    x = torch.cat([x, torch.zeros(-len(x) % 32)])
    for block in (32, 256):
        y = torch.cat([x, torch.zeros(-len(x) % block)])
        for start in range(0, len(y), block):  # every block peaks at L
            y[start] = float(L)
        packed = ops.quantize(y.to(device), None, bits, block)
        assert torch.equal(packed.cpu(), ref.quantize(y, None, bits, block)), block


def test_ternary_thresholds_at_every_magnitude(device):
    # Where x * inv rounds to just above or just below +-0.5 (inv = 1 / m, m of any mantissa):
    # blocks of 32 whose m is their absmax A (16 values of +-A; the mean of the rest keeps
    # 1.5 mean |x| above A), and whose other 16 values sit on the largest x with
    # fl(x * inv) <= 0.5 and its float neighbours, of either sign. 2000 values of A.
    g = torch.Generator().manual_seed(5)
    a = torch.exp2(torch.randint(-60, 60, (2000,), generator=g).float())
    a = a * (1 + torch.rand(2000, generator=g))
    inv = 1.0 / a
    t = (0.5 / inv).contiguous()
    for _ in range(2):  # fp32 steps to the last x whose product is <= 0.5
        t = torch.where(t * inv > 0.5, torch.nextafter(t, torch.zeros(())), t)
        up = torch.nextafter(t, torch.tensor(math.inf))
        t = torch.where(up * inv <= 0.5, up, t)
    up, down = torch.nextafter(t, torch.tensor(math.inf)), torch.nextafter(t, torch.zeros(()))
    near = torch.stack([t, -t, up, -up, down, -down, t, -up] * 2, 1)
    x = torch.cat([torch.stack([a, -a] * 8, 1), near], 1).reshape(-1)
    assert bool(((x.view(-1, 32)[:, 16:] * inv[:, None]).abs() > 0.5).any())
    packed = ops.quantize(x.to(device), None, 2, 32)
    assert torch.equal(packed.cpu(), ref.quantize(x, None, 2, 32))


@pytest.mark.parametrize("bits", BITS)
def test_stochastic_rounding_unbiased(device, bits):
    # Mean of deq over many seeds converges to x: the standard error of one draw is at
    # most step/2 (m for 1-bit), so with S seeds the mean is within 5 * step / sqrt(S).
    n, block, seeds = 512, 64, 400
    x = torch.linspace(-1.0, 1.0, n) * torch.tensor([0.3, 1.0]).repeat(n // 2)
    xd = x.to(device)
    acc = torch.zeros(n, dtype=torch.float64, device=device)
    for s in range(seeds):
        acc += ops.dequantize(
            ops.quantize(xd, None, bits, block, True, s, 0), n, bits, block, torch.float32
        ).double()
    mean = (acc / seeds).float().cpu()
    m = x.abs().view(-1, block).amax(1).repeat_interleave(block)
    step = m if bits == 1 else m / ref.max_level(bits)
    assert bool(((mean - x).abs() <= 5 * step / math.sqrt(seeds)).all())
    # And deterministic rounding is visibly biased on the same input, so the test can fail.
    if bits <= 2:
        det = ops.dequantize(ops.quantize(xd, None, bits, block), n, bits, block, torch.float32)
        assert not bool(((det.cpu() - x).abs() <= 5 * step / math.sqrt(seeds)).all())


@pytest.mark.parametrize("bits", BITS)
def test_constant_blocks_round_trip_exactly(device, bits):
    for value in (0.0, 0.75, -3.0, 1e-20):
        x = torch.full((1024,), value, device=device)
        deq = ops.dequantize(ops.quantize(x, None, bits, 256), 1024, bits, 256, torch.float32)
        assert torch.equal(deq, x)


def test_error_feedback_accumulates_exactly(device):
    # residual after = e - deq(code(e)), so x + r_before == deq + r_after elementwise, up
    # to the rounding of the sum (q2 clips its scale, so a residual can be as large as x).
    n = 5000
    x = _input(n, torch.float32).to(device)
    r = (torch.randn(n) * 0.01).to(device)
    before = r.clone()
    packed = ops.quantize(x, r, 2, 256)
    deq = ops.dequantize(packed, n, 2, 256, torch.float32)
    torch.testing.assert_close(x + before, deq + r, rtol=2**-22, atol=1e-6)


# --------------------------------------------------------------------------------------
# opcheck, fakes, bad input
# --------------------------------------------------------------------------------------


def test_opcheck_every_op(device):
    x = _input(1000, torch.float32).to(device)
    r = torch.zeros(1000, device=device)
    payloads = torch.stack([ops.quantize(x, None, 4, 64), ops.quantize(-x, None, 4, 64)])
    packed = torch.empty(ops.payload_bytes(1000, 4, 64), dtype=torch.uint8, device=device)
    cases = [
        (torch.ops.ddpcomm.quantize_into.default, (x, r, packed, 4, 64, True, 1, 2, 3)),
        (torch.ops.ddpcomm.quantize_into.default, (x.half(), None, packed, 4, 64, False, 0, 0, 0)),
        (
            torch.ops.ddpcomm.dequantize_sum_into.default,
            (payloads[:1], torch.empty(1000, dtype=torch.bfloat16, device=device), 4, 64, 1),
        ),
        (
            torch.ops.ddpcomm.dequantize_sum_into.default,
            (payloads, torch.empty(1000, dtype=torch.float16, device=device), 4, 64, 2),
        ),
        (
            torch.ops.ddpcomm.dequantize_sum_into.default,
            (payloads, torch.empty(1000, device=device), 4, 64, 2, r + 2),
        ),
        (
            torch.ops.ddpcomm.dequantize_sum_requantize_into.default,
            (payloads, r, packed, 1000, 4, 64, 2, False, 0, 0, 0),
        ),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_bad_bits_and_block(device):
    x = torch.randn(100, device=device)
    with pytest.raises(
        RuntimeError, match=r"quantize: bits must be one of 1, 2, 4, 8 or 3 .*got 5"
    ):
        ops.quantize(x, None, 5, 64)
    with pytest.raises(RuntimeError, match="block_size must be a power of two"):
        ops.quantize(x, None, 8, 48)
    with pytest.raises(RuntimeError, match="block_size must be a power of two"):
        ops.quantize(x, None, 8, 16)


def test_bad_dtypes_and_residuals(device):
    x = torch.randn(10, device=device)
    with pytest.raises(RuntimeError, match="x must be float32, float16 or bfloat16, got Long"):
        ops.quantize(torch.arange(10, device=device), None, 8, 64)
    with pytest.raises(RuntimeError, match="x must be float32, float16 or bfloat16"):
        ops.quantize(x.double(), None, 8, 64)
    with pytest.raises(RuntimeError, match="x must be float32, float16 or bfloat16"):
        ops.quantize(torch.randn(10, dtype=torch.complex64, device=device), None, 8, 64)
    with pytest.raises(RuntimeError, match="residual must be float32"):
        ops.quantize(x, torch.zeros(10, dtype=torch.float16, device=device), 8, 64)
    with pytest.raises(RuntimeError, match="residual must have 10 elements"):
        ops.quantize(x, torch.zeros(11, device=device), 8, 64)
    if device == "cuda":
        with pytest.raises(RuntimeError, match="residual is on cpu"):
            ops.quantize(x, torch.zeros(10), 8, 64)


def test_mismatched_payload_sizes(device):
    p = ops.quantize(torch.randn(1000, device=device), None, 8, 64)
    with pytest.raises(RuntimeError, match="dequantize: .* needs 1088 bytes, got 1087"):
        ops.dequantize(p[:-1], 1000, 8, 64, torch.float32)
    with pytest.raises(RuntimeError, match="dequantize: .* needs 1088 bytes, got 1089"):
        ops.dequantize(torch.cat([p, p[:1]]), 1000, 8, 64, torch.float32)
    with pytest.raises(RuntimeError, match="dequantize_sum: .* needs 1088 bytes, got 2176 per row"):
        ops.dequantize_sum(torch.cat([p, p]).view(1, -1), 1000, 8, 64, 1, torch.float32)
    with pytest.raises(RuntimeError, match="dequantize_sum: payloads must hold at least one row"):
        ops.dequantize_sum(p.view(1, -1)[:0], 1000, 8, 64, 1, torch.float32)
    with pytest.raises(RuntimeError, match="dequantize_sum_requantize: payloads must hold at"):
        ops.dequantize_sum_requantize(p.view(1, -1)[:0], None, 1000, 8, 64, 1)
    with pytest.raises(RuntimeError, match="dequantize_sum: payloads must have 2 dimension"):
        ops.dequantize_sum(p, 1000, 8, 64, 1, torch.float32)
    with pytest.raises(RuntimeError, match="dequantize: payloads must have 1 dimension"):
        ops.dequantize(p.view(1, -1), 1000, 8, 64, torch.float32)
    with pytest.raises(RuntimeError, match="payloads must be uint8"):
        ops.dequantize(p.float(), 1000, 8, 64, torch.float32)
    with pytest.raises(RuntimeError, match="dtype must be float32, float16 or bfloat16"):
        ops.dequantize(p, 1000, 8, 64, torch.int32)
    with pytest.raises(RuntimeError, match="divisor must be >= 1"):
        ops.dequantize_sum(p.view(1, -1), 1000, 8, 64, 0, torch.float32)
    with pytest.raises(RuntimeError, match="dequantize_sum_requantize: payloads must have 2"):
        ops.dequantize_sum_requantize(p, None, 1000, 8, 64, 1)
    with pytest.raises(ValueError, match="dequantize: out must have 1000 elements"):
        ops.dequantize(p, 1000, 8, 64, torch.float32, out=torch.empty(999, device=device))
    with pytest.raises(RuntimeError, match="quantize: out must hold at least 1088 elements"):
        ops.quantize(torch.randn(1000), None, 8, 64, out=torch.empty(1087, dtype=torch.uint8))


def _raised(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the type and message are what is compared
        return type(exc), str(exc).splitlines()[0]
    return None


def test_fakes_raise_like_the_native_ops():
    # The fake implementations restate csrc/checks.h: under torch.compile a bad call fails
    # at trace time with the native op's exact error.
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = torch.ops.ddpcomm
    u8 = torch.uint8
    calls = [
        lambda: q.quantize_into(torch.randn(10), None, torch.empty(10, dtype=u8), 3, 64),
        lambda: q.quantize_into(torch.randn(100), None, torch.empty(10, dtype=u8), 8, 64),
        lambda: q.quantize_into(torch.arange(10), None, torch.empty(100, dtype=u8), 8, 64),
        lambda: q.quantize_into(torch.randn(10), torch.zeros(11), torch.empty(99, dtype=u8), 8, 64),
        lambda: q.quantize_into(torch.randn(10), None, torch.empty(99), 8, 64),
        lambda: q.dequantize_sum_into(torch.zeros(2, 10, dtype=u8), torch.empty(100), 8, 64, 1),
        lambda: q.dequantize_sum_into(torch.zeros(10, dtype=u8), torch.empty(1), 8, 64, 1),
        lambda: q.dequantize_sum_into(
            torch.zeros(2, 100, dtype=u8), torch.empty(10, dtype=torch.int32), 8, 64, 1
        ),
        lambda: q.dequantize_sum_into(torch.zeros(2, 100, dtype=u8), torch.empty(10), 8, 64, 0),
        lambda: q.dequantize_sum_requantize_into(
            torch.zeros(2, 100, dtype=u8), None, torch.empty(10, dtype=u8), 10, 8, 64, 1
        ),
        lambda: q.dequantize_sum_requantize_into(
            torch.zeros(2, 100, dtype=u8), torch.zeros(9), torch.empty(99, dtype=u8), 10, 8, 64, 1
        ),
    ]
    for call in calls:
        native = _raised(call)
        assert native is not None
        with FakeTensorMode():
            assert _raised(call) == native


def test_payloads_of_other_settings_are_refused(device):
    """A payload carries no header; its exact size tells other settings apart. Bits never
    share a size at one block size (same records count, other record size), nor do element
    counts a block or more apart, nor truncated, padded or empty payloads."""
    n = 1000
    p = ops.quantize(torch.randn(n, device=device), None, 8, 64)
    for bits in (1, 2, 4):  # the q8 payload decoded as q4 (it read as values near 1e31)
        need = ops.payload_bytes(n, bits, 64)
        with pytest.raises(RuntimeError, match=f"needs {need} bytes, got 1088"):
            ops.dequantize(p, n, bits, 64, torch.float32)
    for numel in (1, 960, 1025, 2000):
        with pytest.raises(RuntimeError, match="got 1088 .made with other settings"):
            ops.dequantize(p, numel, 8, 64, torch.float32)
    rows = torch.stack([p, p])
    with pytest.raises(RuntimeError, match="dequantize_sum: .* got 1088 per row"):
        ops.dequantize_sum(rows, n, 4, 64, 2, torch.float32)
    with pytest.raises(RuntimeError, match="dequantize_sum_requantize: .* got 1088 per row"):
        ops.dequantize_sum_requantize(rows, None, n, 4, 64, 2)
    # Every (bits, numel) pair here has its own size at one block size.
    assert len({ops.payload_bytes(m, b, 64) for b in BITS for m in (1, 100, 1000)}) == 12


# Blocks whose magnitude m is tiny: a denormal absmax (1e-38, 1e-44), a normal one below
# 2^-64 (where L / m overflowed to Inf), exactly 2^-64, and an ordinary one.
TINY = [1e-38, 1e-44, 2.0**-70, 2.0**-64, 0.5]


def tiny_blocks(block: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    shape = torch.rand(len(TINY), block, generator=g) * 2 - 1
    shape[:, 0] = 1.0  # the absmax is the block's magnitude exactly
    return (shape * torch.tensor(TINY)[:, None]).reshape(-1)


@pytest.mark.parametrize("bits", BITS)
def test_tiny_magnitudes_match_reference(device, bits):
    x = tiny_blocks(64)
    for stochastic in (False, True):
        check_quantize(device, x, bits, 64, ef=True, stochastic=stochastic)
        check_quantize(device, x, bits, 64, ef=False, stochastic=stochastic)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_error_bound_half_step_for_tiny_magnitudes(device, bits):
    # As test_error_bound_half_step, plus half a denormal ulp (2^-150): the dequantized
    # value m * (k / L) is a float, stored on the denormal grid when it is that small.
    block = 64
    x = tiny_blocks(block)
    n = x.numel()
    packed = ops.quantize(x.to(device), None, bits, block)
    deq = ops.dequantize(packed, n, bits, block, torch.float32).cpu()
    m = _magnitudes(packed.cpu(), n, bits, block)
    if bits != 2:  # q2's magnitude is clipped (test_two_bit_magnitude_is_clipped)
        assert torch.equal(m, torch.tensor(TINY))
    m = m.repeat_interleave(block)
    step = m / ref.max_level(bits)
    inside = x.abs() <= m
    err = (x - deq).abs()[inside]
    assert bool((err <= (step / 2 + m * 2**-22)[inside] + 2**-150).all())
    assert torch.equal(deq[~inside], x[~inside].sign() * m[~inside])  # beyond m: +-m
    assert torch.equal(deq.view(-1, block)[:, 0], m.view(-1, block)[:, 0])  # +-m exactly


@pytest.mark.parametrize("bits", BITS)
def test_stochastic_rounding_stays_within_a_step_for_tiny_magnitudes(device, bits):
    block = 64
    x = tiny_blocks(block)
    n = x.numel()
    m = torch.tensor(TINY).repeat_interleave(block)
    step = 2 * m if bits == 1 else m / ref.max_level(bits)  # 1-bit: deq is +-m
    for seed in range(8):
        packed = ops.quantize(x.to(device), None, bits, block, True, seed)
        deq = ops.dequantize(packed, n, bits, block, torch.float32).cpu()
        assert bool(((x - deq).abs() <= step * (1 + 2**-20) + 2**-149).all())


def _u8(n, device):
    return torch.empty(n, dtype=torch.uint8, device=device)


def _alias_calls(device):
    """(call, message) pairs where an output shares memory with an input or another output."""
    x = torch.randn(256, device=device)
    need = ops.payload_bytes(256, 8, 64)
    # Two payload rows at the start of a buffer whose float32 view also serves as `out`.
    buf = torch.zeros(4096, dtype=torch.uint8, device=device)
    rows = buf[: 2 * need].view(2, need)
    rows.copy_(torch.stack([ops.quantize(x, None, 8, 64)] * 2))
    over = buf.view(torch.float32)[:256]
    q = torch.ops.ddpcomm
    return [
        (lambda: ops.quantize(x, None, 8, 64, out=x.view(torch.uint8)), "out and x"),
        (lambda: ops.quantize(x, x, 8, 64), "residual and x"),
        (lambda: ops.quantize(x[:128], x[64:192], 8, 64), "residual and x"),
        (lambda: q.quantize_into(x, None, x.view(torch.uint8)[-need:], 8, 64), "out and x"),
        (lambda: ops.dequantize(rows[0], 256, 8, 64, torch.float32, out=over), "out and packed"),
        (lambda: ops.dequantize_sum(rows, 256, 8, 64, 2, torch.float32, out=over),
         "out and payloads"),
        (lambda: q.dequantize_sum_requantize_into(rows, None, rows[1], 256, 8, 64, 2),
         "out and payloads"),
        (lambda: q.dequantize_sum_requantize_into(rows, over, _u8(need, device), 256, 8, 64, 2),
         "residual and payloads"),
    ]  # fmt: skip


def test_outputs_that_alias_inputs_are_refused(device):
    for call, match in _alias_calls(device):
        with pytest.raises(ValueError, match=f"{match} share memory"):
            call()


def test_disjoint_views_of_one_buffer_are_accepted(device):
    # Output and input in one storage but different bytes: not an overlap.
    buf = torch.zeros(1024, device=device)
    x, res = buf[:256], buf[256:512]
    x.copy_(torch.randn(256))
    out = buf[512:].view(torch.uint8)[: ops.payload_bytes(256, 8, 64)]
    got = ops.quantize(x, res, 8, 64, out=out)
    assert_same_bytes(got, oracle(device).quantize(x.cpu(), torch.zeros(256), 8, 64))


@pytest.mark.parametrize(
    "call",
    [
        lambda x: ops.quantize(x, None, True, 64),
        lambda x: ops.quantize(x, None, 8, 64, seed=False),
        lambda x: ops.quantize(x, None, 8, 64.0),
        lambda x: ops.dequantize(ops.quantize(x, None, 8, 64), True, 8, 64, torch.float32),
        lambda x: ops.dequantize_sum(ops.quantize(x, None, 8, 64)[None], 64, 8, 64, True,
                                     torch.float32),
        lambda x: ops.dequantize_sum_requantize(ops.quantize(x, None, 8, 64)[None], None, 64, 8,
                                                64, 1, step=True),
    ],
)  # fmt: skip
def test_bool_is_not_an_int(device, call):
    with pytest.raises(TypeError, match=r"\w+: \w+ must be an int, got (True|False|64.0)"):
        call(torch.randn(64, device=device))


def test_alias_fakes_raise_like_the_native_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode

    for i, (call, _) in enumerate(_alias_calls("cpu")):
        native = _raised(call)
        assert native is not None and native[0] is ValueError
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake_call = _alias_calls("cpu")[i][0]  # its tensors made under the mode
            assert _raised(fake_call) == native


# --------------------------------------------------------------------------------------
# CUDA kernel paths: launch geometry, streams, devices (the CPU kernels have none of these;
# the cases above hold the CPU op to reference.py). Against the CPU op, bit for bit.
# --------------------------------------------------------------------------------------


def sizes(block: int) -> list[int]:
    return sorted({0, 1, block - 1, block + 1, *LARGE})


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", BLOCKS)
def test_cuda_quantize_paths(block, bits, dtype):
    # Same seed, same draws: element i uses counter rng_offset + i, padding included.
    for n in sizes(block):
        x = gradient_like(n, dtype, seed=n + block)
        check_quantize("cuda", x, bits, block, ef=False, stochastic=False, offset=0)
        check_quantize("cuda", x, bits, block, ef=True, stochastic=False, offset=0)
        check_quantize("cuda", x, bits, block, ef=True, stochastic=True, offset=(1 << 33) + 5)
        check_quantize("cuda", x, bits, block, ef=False, stochastic=True, seed=99, step=0)


@needs_cuda
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", BLOCKS)
def test_cuda_dequantize_sum_requantize_paths(block, bits):
    for n in sizes(block):
        rows = torch.stack(
            [
                ops.quantize(gradient_like(n, torch.float32, n + r), None, bits, block)
                for r in range(3)
            ]
        )
        for ef in (False, True):
            for stochastic in (False, True):
                check_requantize("cuda", rows, n, bits, block, 3, ef=ef, stochastic=stochastic)
        # Arbitrary codes and a divisor that does not match the row count.
        p = random_payload_rows(2, n, bits, block, seed=n)
        check_requantize("cuda", p, n, bits, block, 5, ef=True, stochastic=False)


@needs_cuda
def test_cuda_quantize_on_a_side_stream():
    x = gradient_like(300000, torch.float32, seed=2)
    want = ops.quantize(x, None, 2, 512)
    s = torch.cuda.Stream()
    xg = x.cuda()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = ops.quantize(xg, None, 2, 512)
    torch.cuda.current_stream().wait_stream(s)
    assert_same_bytes(got, want)


@needs_cuda
@pytest.mark.skipif(CUDA and torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_quantize_on_second_device():
    x = gradient_like(50000, torch.float32, seed=3)
    res = residual_like(50000, seed=3)
    res_gpu = res.to("cuda:1")
    want = ops.quantize(x, res, 8, 128)
    with torch.cuda.device(0):  # the op must switch to the input's device itself
        got = ops.quantize(x.to("cuda:1"), res_gpu, 8, 128)
    assert got.device == torch.device("cuda:1")
    assert_same_bytes(got, want)
    assert_same_bits(res_gpu, res)


@needs_cuda
def test_cuda_hot_path_never_synchronizes():
    # DESIGN.md 8: no host synchronization in a hook's hot path. Every quantizer op, with
    # the buffers the collectives pass, under torch's sync debug mode.
    n, block = 300007, 16384
    x = gradient_like(n, torch.float32, seed=1).cuda()
    r = torch.zeros(n, device="cuda")
    packed = torch.empty(ops.payload_bytes(n, 8, block), dtype=torch.uint8, device="cuda")
    rows = torch.stack([packed, packed])
    out = torch.empty(n, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.quantize(x, r, 8, block, True, 1, 2, 3, out=packed)
        ops.dequantize(packed, n, 8, block, torch.float32, out=out)
        ops.dequantize_sum(rows, n, 8, block, 2, torch.float32, out=out)
        ops.dequantize_sum_requantize(rows, r, n, 8, block, 2)
        ops.quantize(x, r, 1, 65536)
    finally:
        torch.cuda.set_sync_debug_mode("default")
