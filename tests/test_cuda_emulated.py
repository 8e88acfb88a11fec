"""The CUDA quantizer, sparsification and flatten kernels (csrc/cuda/ternary_kernels.cu,
quantize_kernels.cu, sparse_kernels.cu, flatten_kernels.cu) run on the CPU under tests/cuda_emu,
bit for bit against the CPU ops, on every machine, GPU or not.

The emulation runs the kernels' own code with shuffled thread orders, garbage in shared memory
and workspaces, and checks barriers and warp intrinsics (tests/cuda_emu/include/cuda_runtime.h
lists what it checks and what it cannot). q1.5's cases aim at its hard paths: the cap among
ties, blocks over several CTAs, non-finite and extreme values; the quantizer's at its three
encode paths. Top-k's cases take each of its device-chosen paths (compacted candidates, every
entry, candidates padded) with ties, NaN and Inf; sparse_accumulate's cross tiles with unaligned
rows and refuses malformed ones as the CPU op does; random-k's cover strata ranges. Flatten's
copy lists of every dtype, with pieces at every alignment, into an ``out`` at an offset and back,
and lists of thousands of entries over several launches (one with nothing to copy). The last
tests plant bugs in a copy of the source and expect them found.
"""

from __future__ import annotations

import pytest
import torch

from ddpcomm import ops
from tests import cuda_emu
from tests.cuda_utils import DTYPES, assert_same_bits, assert_same_bytes
from tests.test_ops_flatten import DTYPES as FLATTEN_DTYPES
from tests.test_ops_flatten import _destinations, _mixed_list, _random
from tests.test_ops_quantize import _input, gradient_like, random_payload_rows, residual_like
from tests.test_ops_sparse import (
    _sample_misses,
    adversarial,
    gen,
    k_for,
    strata_cuts,
    values_like,
)

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
# top-k, sparse_accumulate, random-k (sparse_kernels.cu)
# --------------------------------------------------------------------------------------


def check_topk(emu, x, k, approximate, *, ef, value_dtype=None) -> torch.Tensor:
    r_want = residual_like(x.numel(), k) * 100 if ef else None
    r_got = r_want.clone() if ef else None
    args = (k, approximate, 5, 2, value_dtype)
    want = ops.topk_compress(x, r_want, *args)
    assert_same_bytes(emu.topk_compress(x, r_got, *args), want)
    if ef:
        assert_same_bits(r_got, r_want)
    return want


def plateau(n: int) -> torch.Tensor:
    """Equal magnitudes but every 1000th: the sampled threshold keeps every entry, more than
    the candidate buffer holds, so the selection runs over all of them (the dense path)."""
    x = torch.ones(n)
    x[::1000] = 5.0
    x[1::2] *= -1
    return x


TOPK_INPUTS = {
    "gaussian": lambda n: values_like(n, torch.float32, n),
    # Few distinct magnitudes: the k-th largest key's ties span tiles.
    "ties": lambda n: values_like(n, torch.float32, n, ties=True),
    "special": lambda n: values("special", n, n),
    "plateau": plateau,
}


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("kind", TOPK_INPUTS)
# 7: one partial round; 4097: a tile and one; 20011: more entries than the 16384
# the threshold is sampled from (below that every sampled rank is exact).
@pytest.mark.parametrize("n", [7, 4097, 20011])
def test_topk_compress(emu, n, kind, approximate):
    x = TOPK_INPUTS[kind](n)
    # 1 %: compacted candidates (the plateau's overflow their buffer: the dense path); a
    # third: compacted, or at 20011 (gaussian, approximate) padded; k near n, and every k
    # at n = 7 in exact mode: the sampled rank is past the sample, the dense path.
    for k in sorted({1, k_for(n, 0.01), n // 3 + 1, n - 2 if n > 2 else n, n}):
        check_topk(emu, x, k, approximate, ef=True)
        check_topk(emu, x, k, approximate, ef=False, value_dtype=torch.float16)


@pytest.mark.parametrize("approximate", [False, True])
def test_topk_when_the_sample_misses(emu, approximate):
    # The threshold keeps fewer than k entries: exact mode selects over every entry, the
    # approximate one pads the candidates with the lowest-index others.
    x, k = adversarial(), 1000
    assert _sample_misses(x, k, approximate)
    for value_dtype in DTYPES:
        check_topk(emu, x, k, approximate, ef=True, value_dtype=value_dtype)
    check_topk(emu, x, 3, approximate, ef=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_topk_half_inputs_and_saturating_values(emu, dtype):
    # fp16/bf16 inputs with NaN, Inf and denormals; fp32 sums beyond the value dtype's
    # range (sent as its largest finite value, the rest kept in the residual).
    x = values("special", 9001, 3)
    x[100:106] = torch.tensor([1e5, -7e4, 65520.0, -3.4e38, 3.39e38, 65504.0])
    for approximate in (False, True):
        for k in (6, 97, 3001):
            check_topk(emu, x.to(dtype), k, approximate, ef=True, value_dtype=dtype)
            check_topk(emu, x, k, approximate, ef=True, value_dtype=dtype)


def sparse_rows(n: int, k: int, value_dtype: torch.dtype) -> torch.Tensor:
    """Four top-k payloads (overlapping indices), of inputs with NaN, Inf and wide ranges."""
    xs = [values(kind, n, n) for kind in ("special", "wide", "gaussian", "near_max")]
    return torch.stack([ops.topk_compress(x, None, k, value_dtype=value_dtype) for x in xs])


@pytest.mark.parametrize("value_dtype", DTYPES, ids=str)
# 4096 and 12289: whole tiles, then three and a bit; odd k puts fp16/bf16 rows 2 bytes off a
# word boundary.
@pytest.mark.parametrize(("n", "k"), [(1, 1), (4096, 4096), (12289, 123), (12289, 4097)])
def test_sparse_accumulate(emu, n, k, value_dtype):
    rows = sparse_rows(n, k, value_dtype)
    for r, divisor, dtype in [(1, 1, DTYPES[0]), (2, 3, DTYPES[1]), (3, 7, DTYPES[2])]:
        for check in (True, False):
            args = (n, k, divisor, value_dtype, dtype, check)
            assert_same_bits(
                emu.sparse_accumulate(rows[:r], *args),
                ops.sparse_accumulate(rows[:r], *args[:-1], check=check),
            )
    args = (n, k, 2, value_dtype, torch.float32)
    assert_same_bits(emu.sparse_accumulate(rows, *args), ops.sparse_accumulate(rows, *args))


def malformed(rows: torch.Tensor, row: int, position: int, index: int) -> torch.Tensor:
    p = rows.clone()
    p[row, 4 * position : 4 * position + 4] = torch.tensor([index], dtype=torch.int32).view(
        torch.uint8
    )
    return p


def test_sparse_accumulate_check_refuses_bad_rows(emu):
    # Out of range, negative, repeated and decreasing indices at the first, a middle and the
    # last position of a row, and two bad rows: the binding raises for the first bad row and
    # position (the kernel's verdict) with the CPU op's message.
    n, k = 9000, 300
    rows = sparse_rows(n, k, torch.float16)[:3]
    idx = rows[:, : 4 * k].clone().view(torch.int32)
    cases = [(0, 0, -5), (2, k - 1, n), (1, 150, int(idx[1, 149])), (2, 7, 2**31 - 1)]
    cases += [(1, 150, int(idx[1, 149]) - 1), (1, k - 1, int(idx[1, k - 2]))]
    payloads = [malformed(rows, *case) for case in cases]
    payloads.append(malformed(malformed(rows, 2, 3, -1), 1, 200, n + 7))
    for p in payloads:
        with pytest.raises(RuntimeError) as want:
            ops.sparse_accumulate(p, n, k, 3, torch.float16, torch.float32)
        with pytest.raises(RuntimeError) as got:
            emu.sparse_accumulate(p, n, k, 3, torch.float16, torch.float32)
        assert str(got.value).splitlines()[0] == str(want.value).splitlines()[0]


def two_buffers(n: int, value: float, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Equal output buffers for the CPU op and the emulator: what they leave shows."""
    out = torch.full((n,), value, dtype=dtype)
    return out, out.clone()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# 20011: the elementwise pass over several CTAs.
@pytest.mark.parametrize("n", [1, 4097, 20011])
def test_randk(emu, n, dtype):
    # Strata ranges (an empty one, uneven pieces) with and without a residual; the values
    # outside a range and the dense elements outside its strata are left as they were.
    x = gen(n, dtype, n)
    for k in sorted({1, k_for(n, 0.01), n // 3 + 1, n}):
        for ef in (False, True):
            r_want = gen(n, torch.float32, k) * 0.1 if ef else None
            r_got = r_want.clone() if ef else None
            want, got = two_buffers(k, 7.0)
            for start, end in strata_cuts(k):
                args = (k, 3, 4, 5)
                ops.randk_compress(x, r_want, *args, out=want, start=start, end=end)
                emu.randk_compress(x, r_got, *args, out=got, start=start, end=end)
                assert_same_bits(got, want)
                if ef:
                    assert_same_bits(r_got, r_want)
        values = ops.randk_compress(x, None, k, 3, 4, 5)
        for out_dtype, divisor in [(DTYPES[0], 1), (DTYPES[1], 3), (DTYPES[2], 7)]:
            want, got = two_buffers(n, 9.0, out_dtype)
            for start, end in strata_cuts(k):
                args = (n, 3, 4, 5, divisor, out_dtype)
                ops.randk_decompress(values, *args, out=want, start=start, end=end)
                emu.randk_decompress(values, *args, out=got, start=start, end=end)
                assert_same_bits(got, want)


def test_randk_non_finite_poisons_its_own_strata(emu):
    n, k = 10007, 10
    x = gen(n, torch.float32, 8)
    x[5000] = float("inf")  # in strata [4, 6)
    for ef in (False, True):
        r_want = torch.zeros(n) if ef else None
        r_got = r_want.clone() if ef else None
        want, got = two_buffers(k, 7.0)
        for start, end in [(0, 4), (4, 6), (6, 10)]:
            ops.randk_compress(x, r_want, k, 0, 0, 0, out=want, start=start, end=end)
            emu.randk_compress(x, r_got, k, 0, 0, 0, out=got, start=start, end=end)
        assert_same_bits(got, want)
        assert bool(got[4:6].isnan().all()) and bool(got[:4].isfinite().all())
        if ef:
            assert_same_bits(r_got, r_want)


# --------------------------------------------------------------------------------------
# flatten, flatten_into, unflatten_into (flatten_kernels.cu)
# --------------------------------------------------------------------------------------


def carved(dtype: torch.dtype, sizes: list[int], seed: int) -> list[torch.Tensor]:
    """Contiguous tensors of ``sizes`` elements, cut out of one buffer with gaps of 0 to 5
    elements between them: their addresses meet the flat buffer's at every alignment the
    dtype allows, and a write outside them shows in the buffer (``t._base``)."""
    g = torch.Generator().manual_seed(seed)
    gaps = torch.randint(0, 6, (len(sizes),), generator=g).tolist()
    buf = _random((sum(sizes) + sum(gaps) + 5,), dtype, g)
    tensors, at = [], 0
    for n, gap in zip(sizes, gaps, strict=True):
        tensors.append(buf[at + gap : at + gap + n])
        at += gap + n
    return tensors


def check_flatten(emu, tensors: list[torch.Tensor], dtype: torch.dtype, shift: int) -> None:
    """flatten_into an ``out`` that starts ``shift`` elements into a garbage buffer: ``out``
    holds the CPU op's bytes, the buffer around it is untouched."""
    total = sum(t.numel() for t in tensors)
    buf = cuda_emu._garbage(total + shift + 3, dtype)
    want = buf.view(torch.uint8).clone().view(dtype)  # a bool clone would make 0xCD 0x01
    ops.flatten(tensors, out=want[shift : shift + total])
    out = buf[shift : shift + total]
    assert emu.flatten(tensors, out=out) is out
    assert_same_bytes(buf, want)


def check_unflatten(emu, make, flat: torch.Tensor) -> None:
    """unflatten_into two lists of ``make()``'s (equal values, own storage): the emulator's
    and the CPU op's hold the same bytes, and so do the buffers of their views."""
    got, want = make(), make()
    emu.unflatten_into(flat, got)
    ops.unflatten_into(flat, want)
    for a, b in zip(got, want, strict=True):
        assert_same_bytes(a, b)
    bases = {
        id(a._base): (a._base, b._base)
        for a, b in zip(got, want, strict=True)
        if a._base is not None
    }
    for a, b in bases.values():
        assert_same_bytes(a, b)


@pytest.mark.parametrize("dtype", FLATTEN_DTYPES, ids=str)
def test_flatten(emu, dtype):
    # test_ops_flatten's lists: odd sizes up to 278011, empty and 0-dim tensors, views that
    # take the binding's strided copy; into a garbage result, then into a shifted ``out``.
    tensors = _mixed_list(dtype, seed=1)
    assert_same_bytes(emu.flatten(tensors), ops.flatten(tensors))
    check_flatten(emu, tensors, dtype, 3)
    total = sum(t.numel() for t in _destinations(dtype, 2))
    flat = _random((total,), dtype, torch.Generator().manual_seed(3))
    check_unflatten(emu, lambda: _destinations(dtype, 2), flat)


@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.float16, torch.float32, torch.complex64], ids=str
)
def test_flatten_at_every_alignment(emu, dtype):
    # Pieces a byte to a few KB long, at every offset from the flat buffer modulo 16 bytes:
    # every copy width (16 to 1 bytes) with its head and tail.
    g = torch.Generator().manual_seed(4)
    sizes = torch.randint(0, 40, (60,), generator=g).tolist()
    sizes += torch.randint(0, 3000, (20,), generator=g).tolist()
    tensors = carved(dtype, sizes, seed=5)
    for shift in range(16 // dtype.itemsize):
        check_flatten(emu, tensors, dtype, shift)
    flat = ops.flatten(tensors)
    check_unflatten(emu, lambda: carved(dtype, sizes, seed=6), flat)


def many_entries(seed: int) -> list[int]:
    """Sizes of 5409 entries of up to 40 elements, four launches of up to 1800 entries: the
    first's pieces span CTAs of 32 KB (about 72 KB in fp32), the second's are all empty (a
    launch with nothing to copy), then a full one and a short one."""
    g = torch.Generator().manual_seed(seed)

    def sizes(n: int) -> list[int]:
        return torch.randint(0, 41, (n,), generator=g).tolist()

    return sizes(1800) + [0] * 1800 + sizes(1809)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float32], ids=str)
def test_flatten_many_entries(emu, dtype):
    sizes = many_entries(7)
    tensors = carved(dtype, sizes, seed=8)
    check_flatten(emu, tensors, dtype, 1)
    check_unflatten(emu, lambda: carved(dtype, sizes, seed=9), ops.flatten(tensors))


# --------------------------------------------------------------------------------------
# The emulator finds bugs
# --------------------------------------------------------------------------------------

# Bugs planted in one copy of the kernel files, each in a kernel that the others' tests do not
# run: q1.5's encode clears its sign words only from B = 64 up (at B = 32 a record then
# carries the shared memory's old bits); q1.5's decode threads past the payload leave before
# the CTA's scan; sparse_accumulate adds a row without waiting for the zero fill and the row
# before (a race between threads); flatten's launcher puts 1799 entries in each launch of
# 1800 (the last one is never copied).
PLANTED = (
    (
        "sparse_kernels.cu",
        "rank order per element.\n    __syncthreads();\n",
        "rank order per element.\n",
    ),
    ("ternary_kernels.cu", "(B / 2 + kWord - 1) / kWord", "B / 2 / kWord"),
    (
        "ternary_kernels.cu",
        "const bool live = word * kWord < p.n;\n",
        "const bool live = word * kWord < p.n;\n  if (!live) return;\n",
    ),
    (
        "flatten_kernels.cu",
        "count - first < kMaxEntries ? count - first : kMaxEntries",
        "count - first < kMaxEntries ? count - first : kMaxEntries - 1",
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


def test_a_planted_race_is_found():
    buggy = cuda_emu.load(PLANTED)
    n, k = 4096, 1000
    rows = sparse_rows(n, k, torch.float32)[:2]
    args = (n, k, 1, torch.float32, torch.float32)
    with pytest.raises(AssertionError, match="values differ"):
        assert_same_bits(buggy.sparse_accumulate(rows, *args), ops.sparse_accumulate(rows, *args))


def test_a_planted_lost_entry_is_found():
    buggy = cuda_emu.load(PLANTED)
    with pytest.raises(AssertionError, match="bytes differ"):
        check_flatten(buggy, carved(torch.float32, [3] * 1801, seed=10), torch.float32, 0)
