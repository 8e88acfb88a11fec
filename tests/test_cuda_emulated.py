"""The CUDA quantizer kernels (csrc/cuda/ternary_kernels.cu, quantize_kernels.cu) run on the
CPU under tests/cuda_emu, bit for bit against the CPU ops, on every machine, GPU or not.

The emulation runs the kernels' own code with shuffled thread orders, garbage in shared memory
and workspaces, and checks barriers and warp intrinsics (tests/cuda_emu/include/cuda_runtime.h
lists what it checks and what it cannot). q1.5's cases aim at its hard paths: the cap among
ties, blocks over several CTAs, non-finite and extreme values; the quantizer's at its three
encode paths. The last tests plant bugs in a copy of the source and expect them found.
"""

from __future__ import annotations

import pytest
import torch

from ddpcomm import ops
from tests import cuda_emu
from tests.cuda_utils import DTYPES, assert_same_bits, assert_same_bytes
from tests.test_ops_quantize import _input, gradient_like, random_payload_rows, residual_like

Q15 = ops.SPARSE_BITS
RNG = (11, 12, 13)  # seed, step, rng_offset of stochastic rounding
FLT_MAX = torch.finfo(torch.float32).max


@pytest.fixture(scope="module")
def emu() -> cuda_emu.Emulator:
    return cuda_emu.load()


def values(kind: str, n: int, seed: int) -> torch.Tensor:
    """float32 inputs for q1.5's hard cases."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    if kind == "gaussian":
        return _input(n, torch.float32, seed)
    if kind == "student_t":  # 2 degrees of freedom: heavy tails
        chi2 = torch.randn(n, generator=g) ** 2 + torch.randn(n, generator=g) ** 2
        return torch.randn(n, generator=g) / (chi2 / 2).sqrt()
    if kind == "equal":  # every |x| ties: all over the dead zone, the cap falls among ties
        return 0.3 * sign
    if kind == "near_equal":  # four adjacent floats: ties at the cap's key, in a radix digit
        k = torch.randint(0, 4, (n,), generator=g, dtype=torch.int32)
        return (torch.tensor(1.0).view(torch.int32) + k).view(torch.float32) * sign
    if kind == "integers":  # small integers: many ties, some blocks capped
        return torch.randint(-3, 4, (n,), generator=g).float()
    if kind == "bimodal":  # more than half above the dead zone, spread out
        x = sign + torch.randn(n, generator=g) * 0.05
        return x.masked_fill(torch.rand(n, generator=g) < 0.1, 0.0)
    if kind == "signed_zeros":  # blocks of +-0.0 only (m = 0), a few with a 1.0
        return (0.0 * sign).masked_fill(torch.rand(n, generator=g) < 0.01, 1.0)
    if kind == "special":  # NaN, Inf, -0.0 and denormals in a Gaussian
        x, u = torch.randn(n, generator=g), torch.rand(n, generator=g)
        inf, nan = float("inf"), float("nan")
        for below, v in [(0.1, 1e-40), (0.05, -0.0), (0.006, -inf), (0.004, inf), (0.002, nan)]:
            x[u < below] = v  # each a part of the one before
        return x
    if kind == "denormal":
        bits = torch.randint(1, 1 << 20, (n,), generator=g, dtype=torch.int32)
        return bits.view(torch.float32) * sign
    if kind == "near_max":  # sums of squares and means overflow unless scaled first
        x = FLT_MAX * (1 - torch.rand(n, generator=g) * 1e-3) * sign
        return torch.where(torch.rand(n, generator=g) < 0.3, x * 0.25, x)
    if kind == "wide":  # magnitudes from 2^-140 to 2^120 in one block
        e = torch.randint(-140, 121, (n,), generator=g).float()
        return torch.randn(n, generator=g) * torch.exp2(e)
    raise ValueError(kind)


KINDS = ["gaussian", "student_t", "equal", "near_equal", "integers", "bimodal", "signed_zeros"]
KINDS += ["special", "denormal", "near_max", "wide"]
# 32: half a sign word per block; 8192: one CTA's tile; 16384 and 65536: blocks over 2 and 8
# tiles, the tree sum in the workspace, decode CTAs inside a block.
Q15_BLOCKS = [32, 64, 512, 8192, 16384, 65536]


def numel(block: int) -> int:
    """A few blocks, the last one partial."""
    return 3 * block + 17 if block <= 512 else block + 8192 + 5


def check_quantize(emu, x, bits, block, *, ef, stochastic=False) -> torch.Tensor:
    r_want = residual_like(x.numel(), block) if ef else None
    r_got = r_want.clone() if ef else None
    got = emu.quantize(x, r_got, bits, block, stochastic, *RNG)
    want = ops.quantize(x, r_want, bits, block, stochastic, *RNG)
    assert_same_bytes(got, want)
    if ef:
        assert_same_bits(r_got, r_want)
    return want


def check_dequantize_sum(emu, rows, n, bits, block, divisor, dtype, scale=None) -> None:
    got = emu.dequantize_sum(rows, n, bits, block, divisor, dtype, scale)
    assert_same_bits(got, ops.dequantize_sum(rows, n, bits, block, divisor, dtype, scale=scale))


def check_requantize(emu, rows, n, bits, block, divisor, *, ef, stochastic=False) -> None:
    r_want = residual_like(n, n) * divisor if ef else None
    r_got = r_want.clone() if ef else None
    got = emu.dequantize_sum_requantize(rows, r_got, n, bits, block, divisor, stochastic, *RNG)
    want = ops.dequantize_sum_requantize(rows, r_want, n, bits, block, divisor, stochastic, *RNG)
    assert_same_bytes(got, want)
    if ef:
        assert_same_bits(r_got, r_want)


def scale_like(n: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(n)) * 4 - 1


# --------------------------------------------------------------------------------------
# q1.5 (ternary_kernels.cu)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", Q15_BLOCKS)
def test_q15_quantize(emu, block, kind):
    x = values(kind, numel(block), block)
    for ef in (False, True):
        check_quantize(emu, x, Q15, block, ef=ef)


@pytest.mark.parametrize("block", [32, 512])
def test_q15_fewer_elements_than_a_block(emu, block):
    for n in (1, 2, 31, 33):
        for kind in KINDS:
            p = check_quantize(emu, values(kind, n, n), Q15, block, ef=True)
            check_dequantize_sum(emu, p.view(1, -1), n, Q15, block, 1, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block", [32, 512, 16384])
def test_q15_quantize_half_inputs(emu, block, dtype):
    x = values("special", numel(block), block).to(dtype)
    for ef in (False, True):
        check_quantize(emu, x, Q15, block, ef=ef)


@pytest.mark.parametrize("block", Q15_BLOCKS)
def test_q15_dequantize_sum(emu, block):
    # 1 to 4 rows of real payloads, then of arbitrary bytes (bitmaps with more set bits than
    # the record has signs for, any m); every output dtype, with and without a scale.
    n = numel(block)
    kinds = ["gaussian", "equal", "special", "near_max"]
    real = torch.stack([ops.quantize(values(k, n, block), None, Q15, block) for k in kinds])
    arbitrary = random_payload_rows(4, n, Q15, block, block)
    for rows in (real, arbitrary):
        for r, divisor, dtype in [(1, 1, torch.float32), (2, 2, torch.float16)]:
            check_dequantize_sum(emu, rows[:r], n, Q15, block, divisor, dtype)
        for r, divisor, dtype in [(3, 3, torch.bfloat16), (4, 7, torch.float32)]:
            check_dequantize_sum(emu, rows[:r], n, Q15, block, divisor, dtype, scale_like(n))


def test_q15_dequantize_sum_over_decode_ctas(emu):
    # 32-element blocks across three decode CTAs (8192 elements each), the last partial.
    n = 2 * 8192 + 37
    rows = random_payload_rows(3, n, Q15, 32, 1)
    for dtype in DTYPES:
        check_dequantize_sum(emu, rows, n, Q15, 32, 3, dtype, scale_like(n))


@pytest.mark.parametrize("block", Q15_BLOCKS)
def test_q15_dequantize_sum_requantize(emu, block):
    n = numel(block)
    kinds = ["student_t", "integers", "bimodal", "wide"]
    real = torch.stack([ops.quantize(values(k, n, block), None, Q15, block) for k in kinds])
    check_requantize(emu, real, n, Q15, block, 4, ef=True)
    check_requantize(emu, real[:3], n, Q15, block, 2, ef=False)
    check_requantize(emu, random_payload_rows(2, n, Q15, block, block), n, Q15, block, 3, ef=True)


@pytest.mark.parametrize(("block", "blocks"), [(32, 96), (64, 48), (512, 12), (16384, 3)])
def test_q15_blocks_of_mixed_kinds(emu, block, blocks):
    # Each block of another kind and scale (2^-20 .. 2^20), so neighbouring CTAs take other
    # paths; enough of them take the cap's that a change of the kinds cannot lose it unseen.
    g = torch.Generator().manual_seed(block)
    parts = []
    for b in range(blocks):
        kind = KINDS[int(torch.randint(len(KINDS), (1,), generator=g))]
        scale = 1.0 if kind in ("denormal", "near_max", "wide") else 2.0 ** (b % 41 - 20)
        parts.append(values(kind, block, b) * scale)
    x = torch.cat(parts)[: blocks * block - 7]
    n = x.numel()
    p = check_quantize(emu, x, Q15, block, ef=True)
    bitmaps = p.view(-1, 2 + 3 * block // 16)[:, 2 : 2 + block // 8]
    kept = ((bitmaps[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1).sum((1, 2))
    assert int((kept == block // 2).sum()) >= blocks // 8, "too few blocks take the capped path"
    others = [ops.quantize(y, None, Q15, block) for y in (x.flip(0), -0.5 * x)]
    rows = torch.stack([p, *others])
    check_dequantize_sum(emu, rows, n, Q15, block, 3, torch.float32)
    check_requantize(emu, rows, n, Q15, block, 3, ef=True)


# --------------------------------------------------------------------------------------
# q8, q4, q2, q1 (quantize_kernels.cu)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
# 32: 64 blocks per CTA; 256: a warp per block; 4096: two register rows per thread; 16384:
# the split path (partial sums over CTAs, then the magnitude, then the codes).
@pytest.mark.parametrize("block", [32, 256, 4096, 16384])
def test_quantizer(emu, block, bits):
    n = 2 * block + 13
    x = gradient_like(n + 1, torch.float32, block)
    x[5] = float("nan")
    for view in (x[:-1], x[1:]):  # aligned, then not: the vector and the scalar paths
        check_quantize(emu, view, bits, block, ef=True)
        check_quantize(emu, view, bits, block, ef=False, stochastic=True)
    check_quantize(emu, x[:n].to(torch.bfloat16), bits, block, ef=True, stochastic=True)
    rows = [ops.quantize(gradient_like(n, torch.float32, s), None, bits, block) for s in range(3)]
    rows = torch.stack(rows)
    check_dequantize_sum(emu, rows, n, bits, block, 3, torch.float16, scale_like(n))
    arbitrary = random_payload_rows(2, n, bits, block, 1)
    check_dequantize_sum(emu, arbitrary, n, bits, block, 2, torch.float32)
    check_requantize(emu, rows, n, bits, block, 3, ef=True)
    check_requantize(emu, rows, n, bits, block, 2, ef=False, stochastic=True)


# --------------------------------------------------------------------------------------
# The emulator finds bugs
# --------------------------------------------------------------------------------------

# Two bugs planted in one copy of ternary_kernels.cu, each in a kernel that the other's test
# does not run: encode clears its sign words only from B = 64 up (at B = 32 a record then
# carries the shared memory's old bits), and decode's threads past the payload leave before
# the CTA's scan.
PLANTED = (
    ("ternary_kernels.cu", "(B / 2 + kWord - 1) / kWord", "B / 2 / kWord"),
    (
        "ternary_kernels.cu",
        "const bool live = word * kWord < p.n;\n",
        "const bool live = word * kWord < p.n;\n  if (!live) return;\n",
    ),
)


def test_a_planted_wrong_result_is_found():
    buggy = cuda_emu.load(PLANTED)
    x = torch.rand(64, 32) + 0.5
    x[::2] *= -1  # blocks of negatives and of positives in turn
    with pytest.raises(AssertionError, match="bytes differ"):
        check_quantize(buggy, x.reshape(-1), Q15, 32, ef=False)


def test_a_planted_barrier_divergence_is_found():
    buggy = cuda_emu.load(PLANTED)
    rows = random_payload_rows(1, 100, Q15, 32, 1)
    with pytest.raises(cuda_emu.EmulationError, match="exited while others|deadlock"):
        buggy.dequantize_sum(rows, 100, Q15, 32, 1, torch.float32)
