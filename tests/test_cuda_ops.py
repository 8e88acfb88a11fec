"""CUDA ops against the CPU ops, bit for bit.

The CPU ops are held to ddpcomm/reference.py by tests/test_quantize_ops.py; here every CUDA
op must give the same bits as the CPU op on the same input: payload bytes (scales and
codes), residuals and dequantized values. Sums run in the same (row) order on both devices,
so no tolerance is needed anywhere; NaNs compare by position (tests/cuda_utils.py says
why). Block scales of non-finite blocks are written as the same constant on both devices
and compare bytewise.

Without a CUDA device every test here is skipped, with that reason.
"""

from __future__ import annotations

import pytest
import torch

import ddpcomm
from ddpcomm import ops
from tests.cuda_utils import CUDA, DTYPES, assert_same_bits, assert_same_bytes, needs_cuda

BITS = [1, 2, 4, 8]
# 32: 64 blocks per CTA; 256: one warp per block; 4096 / 8192: 2 / 4 register rows per
# thread; 16384 / 65536: the streaming kernel (8 / 32 rows, bit-reversed tree).
BLOCKS = [32, 256, 4096, 8192, 16384, 65536]
LARGE = [278011, (1 << 20) + 3]  # cross CTA, grid and block boundaries at every B


def sizes(block: int) -> list[int]:
    return sorted({0, 1, block - 1, block + 1, *LARGE})


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


# --------------------------------------------------------------------------------------
# The build
# --------------------------------------------------------------------------------------


@needs_cuda
def test_cuda_ops_are_built_when_cuda_is_available():
    # Fails, not skips: a CUDA machine running a CPU-only build would otherwise skip or
    # fail every other test here with a dispatch error that hides the cause.
    info = ddpcomm.build_info()
    assert info["cuda"], (
        "torch sees a CUDA device but ddpcomm was built without CUDA ops "
        f"(build_info: {info}); rebuild with nvcc on PATH and a CUDA build of torch"
    )


# --------------------------------------------------------------------------------------
# quantize
# --------------------------------------------------------------------------------------


def check_quantize(x, bits, block, *, ef, stochastic, seed=1234, step=7, rng_offset=0):
    n = x.numel()
    res_cpu = residual_like(n, seed) if ef else None
    res_gpu = res_cpu.cuda() if ef else None
    kw = dict(stochastic=stochastic, seed=seed, step=step, rng_offset=rng_offset)
    want = ops.quantize(x, res_cpu, bits, block, **kw)
    got = ops.quantize(x.cuda(), res_gpu, bits, block, **kw)
    assert got.is_cuda
    assert_same_bytes(got, want)
    if ef:
        assert_same_bits(res_gpu, res_cpu)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", BLOCKS)
def test_quantize_matches_cpu(block, bits, dtype):
    for n in sizes(block):
        x = gradient_like(n, dtype, seed=n + block)
        check_quantize(x, bits, block, ef=False, stochastic=False)
        check_quantize(x, bits, block, ef=True, stochastic=False)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", BLOCKS)
def test_quantize_stochastic_matches_cpu(block, bits, dtype):
    # Same seed, same draws: element i uses counter rng_offset + i, padding included.
    for n in sizes(block):
        x = gradient_like(n, dtype, seed=3 * n + block)
        check_quantize(x, bits, block, ef=True, stochastic=True, rng_offset=(1 << 33) + 5)
        check_quantize(x, bits, block, ef=False, stochastic=True, seed=99, step=0)


@needs_cuda
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", [32, 2048, 16384])
def test_quantize_non_finite_blocks(block, bits):
    x = gradient_like(5 * block + 3, torch.float32, seed=block)
    x[3] = float("nan")
    x[block + 1] = float("inf")
    x[2 * block + 7] = -float("inf")
    x[4 * block + 2] = 3e38  # finite, but x + residual and sums may overflow
    x[4 * block + 9] = 3e38
    for stochastic in (False, True):
        check_quantize(x, bits, block, ef=True, stochastic=stochastic)
        check_quantize(x, bits, block, ef=False, stochastic=stochastic)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_unaligned_inputs(dtype):
    # Views that start mid-vector take the scalar load/store path.
    n, block = 10007, 256
    base = gradient_like(n + 3, dtype, seed=5)
    res_base = residual_like(n + 3, seed=5)
    for off in (1, 2, 3):
        x = base[off : off + n]
        res_cpu = res_base[off : off + n].clone()
        res_gpu_base = res_base.clone().cuda()
        res_gpu = res_gpu_base[off : off + n]
        assert res_gpu.data_ptr() % 16 != 0
        want = ops.quantize(x, res_cpu, 4, block)
        got = ops.quantize(base.cuda()[off : off + n], res_gpu, 4, block)
        assert_same_bytes(got, want)
        assert_same_bits(res_gpu, res_cpu)
        # Elements outside the view are untouched.
        assert_same_bits(res_gpu_base[:off], res_base[:off])
        assert_same_bits(res_gpu_base[off + n :], res_base[off + n :])


@needs_cuda
def test_quantize_noncontiguous_input():
    x = gradient_like(2 * 3001, torch.float32, seed=11).view(3001, 2).t()
    assert not x.is_contiguous()
    assert_same_bytes(ops.quantize(x.cuda(), None, 8, 64), ops.quantize(x, None, 8, 64))


@needs_cuda
def test_quantize_on_a_side_stream():
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
def test_quantize_on_second_device():
    x = gradient_like(50000, torch.float32, seed=3)
    res = residual_like(50000, seed=3)
    res_gpu = res.to("cuda:1")
    want = ops.quantize(x, res, 8, 128)
    with torch.cuda.device(0):  # the op must switch to the input's device itself
        got = ops.quantize(x.to("cuda:1"), res_gpu, 8, 128)
    assert got.device == torch.device("cuda:1")
    assert_same_bytes(got, want)
    assert_same_bits(res_gpu, res)


# --------------------------------------------------------------------------------------
# dequantize, dequantize_sum
# --------------------------------------------------------------------------------------


def payload(n, bits, block, seed):
    return ops.quantize(gradient_like(n, torch.float32, seed), None, bits, block)


def random_payload_rows(rows, n, bits, block, seed):
    """Payload rows of arbitrary code bytes (any code value) and finite scales of either sign."""
    g = torch.Generator().manual_seed(seed)
    nbytes = ops.payload_bytes(n, bits, block)
    p = torch.randint(0, 256, (rows, nbytes), dtype=torch.uint8, generator=g)
    nb, rec = -(-n // block), 4 + block * bits // 8
    scales = torch.rand(rows, nb, generator=g) * 8 - 4
    p.view(rows, nb, rec)[:, :, :4] = scales.view(torch.uint8).view(rows, nb, 4)
    return p


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", [32, 256, 4096, 65536])
def test_dequantize_matches_cpu(block, bits, dtype):
    for n in sizes(block):
        for p in (payload(n, bits, block, seed=n), random_payload_rows(1, n, bits, block, n)[0]):
            want = ops.dequantize(p, n, bits, block, dtype)
            got = ops.dequantize(p.cuda(), n, bits, block, dtype)
            assert got.is_cuda and got.dtype == dtype
            assert_same_bits(got, want)


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", [32, 1024, 16384])
def test_dequantize_sum_matches_cpu(block, bits, dtype):
    for n in sizes(block):
        for rows, divisor in ((1, 1), (3, 3), (4, 7), (0, 2)):
            p = random_payload_rows(rows, n, bits, block, seed=n + rows)
            want = ops.dequantize_sum(p, n, bits, block, divisor, dtype)
            got = ops.dequantize_sum(p.cuda(), n, bits, block, divisor, dtype)
            assert_same_bits(got, want)


@needs_cuda
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_unaligned_payloads(bits):
    # A payload that starts at an odd byte, and rows whose stride is not a multiple of 4:
    # the byte-wise read path.
    n, block, rows = 5000, 128, 3
    p = random_payload_rows(rows, n, bits, block, seed=bits)
    padded = torch.zeros(rows, p.shape[1] + 3, dtype=torch.uint8)
    padded[:, : p.shape[1]] = p
    want = ops.dequantize_sum(padded, n, bits, block, 3, torch.float32)
    got = ops.dequantize_sum(padded.cuda(), n, bits, block, 3, torch.float32)
    assert_same_bits(got, want)

    flat = torch.zeros(p.shape[1] + 1, dtype=torch.uint8)
    flat[1:] = p[0]
    want = ops.dequantize(flat[1:], n, bits, block, torch.float16)
    got = ops.dequantize(flat.cuda()[1:], n, bits, block, torch.float16)
    assert_same_bits(got, want)


@needs_cuda
def test_dequantize_non_finite_scales():
    n, block, bits = 3000, 64, 8
    p = random_payload_rows(2, n, bits, block, seed=1)
    rec = 4 + block
    p[0, 0:4] = torch.tensor([float("nan")]).view(torch.uint8)
    p[1, rec : rec + 4] = torch.tensor([float("inf")]).view(torch.uint8)
    for dtype in DTYPES:
        want = ops.dequantize_sum(p, n, bits, block, 2, dtype)
        got = ops.dequantize_sum(p.cuda(), n, bits, block, 2, dtype)
        assert_same_bits(got, want)


# --------------------------------------------------------------------------------------
# dequantize_sum_requantize
# --------------------------------------------------------------------------------------


def check_requantize(p, n, bits, block, divisor, *, ef, stochastic):
    res_cpu = residual_like(n, seed=n) * divisor if ef else None
    res_gpu = res_cpu.cuda() if ef else None
    kw = dict(stochastic=stochastic, seed=77, step=3, rng_offset=1000)
    want = ops.dequantize_sum_requantize(p, res_cpu, n, bits, block, divisor, **kw)
    got = ops.dequantize_sum_requantize(p.cuda(), res_gpu, n, bits, block, divisor, **kw)
    assert_same_bytes(got, want)
    if ef:
        assert_same_bits(res_gpu, res_cpu)


@needs_cuda
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", BLOCKS)
def test_dequantize_sum_requantize_matches_cpu(block, bits):
    for n in sizes(block):
        rows = torch.stack([payload(n, bits, block, seed=n + r) for r in range(3)])
        for ef in (False, True):
            for stochastic in (False, True):
                check_requantize(rows, n, bits, block, 3, ef=ef, stochastic=stochastic)
        # Arbitrary codes and a divisor that does not match the row count.
        check_requantize(
            random_payload_rows(2, n, bits, block, seed=n),
            n,
            bits,
            block,
            5,
            ef=True,
            stochastic=False,
        )


@needs_cuda
def test_dequantize_sum_requantize_non_finite_rows():
    n, block, bits = 4 * 512 + 9, 512, 4
    p = random_payload_rows(3, n, bits, block, seed=4)
    rec = 4 + block * bits // 8
    p[1, 0:4] = torch.tensor([float("nan")]).view(torch.uint8)
    p[2, 2 * rec : 2 * rec + 4] = torch.tensor([float("inf")]).view(torch.uint8)
    for stochastic in (False, True):
        check_requantize(p, n, bits, block, 3, ef=True, stochastic=stochastic)


# --------------------------------------------------------------------------------------
# Out-variants (quantize_into, dequantize_into, dequantize_sum_into)
# --------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("offset", [0, 1, 2, 4])
def test_quantize_into_matches_cpu(bits, offset):
    # `out` is a slice of a larger buffer: at offsets 1 and 2 the payload is not 4-byte
    # aligned and the kernel stores byte by byte; bytes outside the payload stay put.
    n, block = 70001, 512
    x = gradient_like(n, torch.float32, seed=bits)
    res = residual_like(n, seed=bits)
    res_cpu = res.clone()
    want = ops.quantize(x, res_cpu, bits, block)
    size = want.numel()
    buf = torch.full((size + offset + 5,), 0xA5, dtype=torch.uint8, device="cuda")
    res_gpu = res.cuda()
    got = ops.quantize(x.cuda(), res_gpu, bits, block, out=buf[offset : offset + size])
    assert_same_bytes(got, want)
    assert_same_bits(res_gpu, res_cpu)
    assert bool((buf[:offset] == 0xA5).all()) and bool((buf[offset + size :] == 0xA5).all())


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_dequantize_into_matches_cpu(dtype, offset):
    n, block, bits, rows = 40003, 128, 4, 3
    p = random_payload_rows(rows, n, bits, block, seed=offset)
    want = ops.dequantize(p[0], n, bits, block, dtype)
    buf = torch.zeros(n + offset + 2, dtype=dtype, device="cuda")
    got = ops.dequantize(p[0].cuda(), n, bits, block, dtype, out=buf[offset : offset + n])
    assert_same_bits(got, want)
    want = ops.dequantize_sum(p, n, bits, block, 3, dtype)
    got = ops.dequantize_sum(p.cuda(), n, bits, block, 3, dtype, out=buf[offset : offset + n])
    assert_same_bits(got, want)
    assert bool((buf[:offset] == 0).all()) and bool((buf[offset + n :] == 0).all())


# --------------------------------------------------------------------------------------
# Errors and tracing
# --------------------------------------------------------------------------------------


@needs_cuda
def test_cuda_ops_reject_bad_arguments_like_cpu():
    x = torch.randn(100, device="cuda")
    with pytest.raises(RuntimeError, match="bits must be one of 1, 2, 4, 8"):
        ops.quantize(x, None, 3, 64)
    with pytest.raises(RuntimeError, match="block_size must be a power of two"):
        ops.quantize(x, None, 8, 48)
    with pytest.raises(RuntimeError, match="x must be float32, float16 or bfloat16"):
        ops.quantize(x.double(), None, 8, 64)
    with pytest.raises(RuntimeError, match="residual is on cpu"):
        ops.quantize(x, torch.zeros(100), 8, 64)
    with pytest.raises(RuntimeError, match="residual must have 100 elements"):
        ops.quantize(x, torch.zeros(99, device="cuda"), 8, 64)
    p = ops.quantize(x, None, 8, 64)
    with pytest.raises(RuntimeError, match="needs"):
        ops.dequantize(p[:-1], 100, 8, 64, torch.float32)
    with pytest.raises(RuntimeError, match="divisor must be >= 1"):
        ops.dequantize_sum(p.view(1, -1), 100, 8, 64, 0, torch.float32)
    with pytest.raises(RuntimeError, match="payloads must have 2 dimension"):
        ops.dequantize_sum_requantize(p, None, 100, 8, 64, 1)


@needs_cuda
def test_opcheck_on_cuda():
    x = torch.randn(1000, device="cuda")
    res = torch.zeros(1000, device="cuda")
    p = ops.quantize(x, None, 4, 64)
    rows = torch.stack([p, p])
    for op, args in [
        (torch.ops.ddpcomm.quantize.default, (x, res, 4, 64, True, 1, 2, 3)),
        (torch.ops.ddpcomm.dequantize.default, (p, 1000, 4, 64, torch.bfloat16)),
        (torch.ops.ddpcomm.dequantize_sum.default, (rows, 1000, 4, 64, 2, torch.float16)),
        (
            torch.ops.ddpcomm.dequantize_sum_requantize.default,
            (rows, res, 1000, 4, 64, 2, False, 0, 0, 0),
        ),
    ]:
        torch.library.opcheck(op, args)
