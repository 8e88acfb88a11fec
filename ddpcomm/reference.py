"""Pure-torch definitions of every ddpcomm op.

This module is the specification: each function states, in torch, exactly what the
native op of the same name computes, bit for bit. The tests hold the C++ and CUDA kernels
to it. It is slow and allocates freely; nothing on a hot path calls it.

Packed quantized payload (see csrc/numerics.h): ``ceil(numel / B)`` records of
``4 + B * bits / 8`` bytes, each a float32 block magnitude ``m`` followed by the block's
codes packed LSB-first. ``m`` is the block absmax (bits >= 4, or stochastic 1- and 2-bit),
the mean |x| over the block's valid elements (deterministic 1-bit) or min(absmax, 1.5 mean
|x|) (deterministic 2-bit, numerics.h kTernaryClip); a block with a non-finite value
stores NaN. Signed code k in [-L, L], L = 2**(bits-1) - 1, is stored as k + L and
dequantizes to ``m * (k / L)``; 1-bit code c dequantizes to ``+m if c else -m``.

Every float an op writes that is NaN is its dtype's canonical NaN (:func:`canonical`): IEEE
leaves a NaN's sign and payload to the hardware, so the ops fix one bit pattern per dtype.
"""

from __future__ import annotations

import math

import torch

_MASK64 = (1 << 64) - 1

# numerics.h kCanonicalNan*: std::numeric_limits<T>::quiet_NaN() of float, c10::Half and
# c10::BFloat16, as (integer view dtype, bits).
CANONICAL_NAN_BITS = {
    torch.float32: (torch.int32, 0x7FC00000),
    torch.float16: (torch.int16, 0x7E00),
    torch.bfloat16: (torch.int16, 0x7FC0),
}


def canonical(t: torch.Tensor) -> torch.Tensor:
    """``t`` with every NaN replaced by its dtype's canonical NaN (numerics.h canonical)."""
    view, bits = CANONICAL_NAN_BITS[t.dtype]
    nan = torch.tensor(bits, dtype=view).view(t.dtype)
    return torch.where(torch.isnan(t), nan, t)


# --------------------------------------------------------------------------------------
# Counter-based RNG (numerics.h: mix64, rng_key, rng_u64_keyed, uniform24)
# --------------------------------------------------------------------------------------


def _mix64_int(z: int) -> int:
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= (1 << 63) else v


def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 tensors holding uint64 bit patterns."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    # int64 multiplication wraps modulo 2**64, which is the uint64 product's bit pattern.
    z = (z ^ _shr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _signed(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def rng_key(seed: int, step: int) -> int:
    h = _mix64_int(seed + 0x9E3779B97F4A7C15)
    return _mix64_int(h ^ ((step + 0x632BE59BD9B4E019) & _MASK64))


def rng_u64(seed: int, step: int, index: torch.Tensor) -> torch.Tensor:
    """64 random bits (as int64 bit patterns) for each counter in ``index``."""
    return _mix64(index.to(torch.int64) ^ _signed(rng_key(seed, step)))


def rng_uniform(seed: int, step: int, index: torch.Tensor) -> torch.Tensor:
    """Uniform float32 in [0, 1) from 24 random bits: a pure function of its key."""
    bits24 = _shr(rng_u64(seed, step, index), 40)
    return bits24.to(torch.float32) * (1.0 / 16777216.0)


# --------------------------------------------------------------------------------------
# Quantizer
# --------------------------------------------------------------------------------------


def max_level(bits: int) -> int:
    return (1 << (bits - 1)) - 1


SPARSE_BITS = 3  # ops' bits for q1.5's code (numerics.h kSparseBits)


def _record_bytes(bits: int, block_size: int) -> int:
    if bits == SPARSE_BITS:
        return 2 + block_size * 3 // 16  # a bfloat16 magnitude
    return 4 + block_size * bits // 8


def payload_bytes(numel: int, bits: int, block_size: int) -> int:
    return math.ceil(numel / block_size) * _record_bytes(bits, block_size)


def _tree_sum(a: torch.Tensor) -> torch.Tensor:
    """Pairwise sum over the last dim (a power of two): element i adds i + w/2."""
    while a.shape[-1] > 1:
        w = a.shape[-1] // 2
        a = a[..., :w] + a[..., w:]
    return a[..., 0]


def _blocks(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, int]:
    n = x.numel()
    nb = math.ceil(n / block_size)
    padded = torch.zeros(nb * block_size, dtype=torch.float32)
    padded[:n] = x.reshape(-1).float()
    return padded.view(nb, block_size), n


def _levels(bits: int) -> torch.Tensor:
    lmax = max_level(bits)
    codes = torch.arange(1 << bits, dtype=torch.int32)
    return (codes - lmax).float() / torch.tensor(float(lmax), dtype=torch.float32)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[nb, B] codes in [0, 2**bits) -> [nb, B*bits/8] bytes, LSB-first."""
    per_byte = 8 // bits
    c = codes.to(torch.int32).view(codes.shape[0], codes.shape[1] // per_byte, per_byte)
    shifts = torch.arange(per_byte, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def _unpack(code_bytes: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    shifts = torch.arange(per_byte, dtype=torch.int32) * bits
    c = (code_bytes.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.view(code_bytes.shape[0], code_bytes.shape[1] * per_byte)


def _magnitudes(e: torch.Tensor, valid: torch.Tensor, bits: int, stochastic: bool):
    finite = torch.isfinite(e).all(1)
    m = e.abs().amax(1)
    if bits <= 2 and not stochastic:
        mean = _tree_sum(e.abs()) / valid.float()
        # 2-bit: clipped at 1.5 mean |x| (numerics.h kTernaryClip, mean_magnitude).
        m = mean if bits == 1 else torch.minimum(m, torch.tensor(1.5, dtype=torch.float32) * mean)
    return torch.where(finite, m, torch.full_like(m, float("nan")))


# numerics.h block_inv: blocks with m < 2^-64 are quantized with x and m scaled by 2^64
# (exact), where L / m would overflow; every other block uses v = x * (L / m).
TINY_MAGNITUDE = 2.0**-64


def _codes(e, m, bits, stochastic, seed, step, rng_offset):
    lmax = max_level(bits)
    pre = torch.where(m < TINY_MAGNITUDE, 2.0**64, 1.0)
    inv = torch.tensor(1.0 if bits == 1 else float(lmax), dtype=torch.float32) / (m * pre)
    v = (e * pre[:, None]) * inv[:, None]
    if stochastic:
        idx = torch.arange(e.numel(), dtype=torch.int64) + rng_offset
        u = rng_uniform(seed, step, idx).view_as(e)
    if bits == 1:
        codes = (e >= 0) if not stochastic else (u < 0.5 * (1.0 + v))
        codes = codes.to(torch.int32)
        degenerate_code = 1
    else:
        r = torch.floor(v + u) if stochastic else torch.round(v)
        codes = r.clamp(-lmax, lmax).to(torch.int32) + lmax
        degenerate_code = lmax
    ok = (m > 0) & torch.isfinite(m)
    return torch.where(ok[:, None], codes, torch.full_like(codes, degenerate_code))


def _dequant_blocks(m: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 1:
        return torch.where(codes.bool(), m[:, None], -m[:, None])
    return m[:, None] * _levels(bits)[codes.long()]


# numerics.h, q1.5: the dead zone in block RMS units.
DEAD_ZONE = 0.675


def _sparse_kept(e: torch.Tensor, valid: torch.Tensor):
    """q1.5's choice for [nb, B] blocks (numerics.h): (kept [nb, B] bool, m [nb])."""
    nb, block = e.shape
    a = e.abs()
    finite = torch.isfinite(e).all(1)
    absmax = torch.where(finite, a.amax(1), torch.zeros(nb))
    # numerics.h sparse_pre: 2^-k for 2^k <= absmax < 2^(k+1), k in [-126, 126].
    k = ((absmax.view(torch.int32) >> 23) - 127).clamp(-126, 126)
    pre = ((127 - k) << 23).to(torch.int32).view(torch.float32)
    ap = a * pre[:, None]
    t = torch.tensor(DEAD_ZONE, dtype=torch.float32) * torch.sqrt(
        _tree_sum(ap * ap) / valid.float()
    )
    over = ap > t[:, None]
    cap = block // 2
    # Past the cap, the cap largest |e|, ties to the lower index (a stable sort).
    order = torch.sort(a, dim=1, descending=True, stable=True).indices[:, :cap]
    top = torch.zeros_like(over).scatter_(1, order, True)
    kept = torch.where((over.sum(1) > cap)[:, None], top, over) & finite[:, None]
    count = kept.sum(1)
    mean = _tree_sum(torch.where(kept, ap, torch.zeros(()))) / count.clamp(min=1).float()
    m = torch.where(count > 0, mean * (1.0 / pre), torch.zeros(nb))
    return kept, torch.where(finite, m, torch.full_like(m, float("nan")))


def _sparse_wire_m(m: torch.Tensor) -> torch.Tensor:
    """numerics.h sparse_m_bits: m as bfloat16 (nearest even), saturated, not Inf."""
    b = canonical(m.to(torch.bfloat16))
    top = torch.tensor(torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)
    return torch.where(torch.isinf(b), top, b)


def _sparse_values(kept: torch.Tensor, negative: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """numerics.h sparse_value for [nb, B] bitmaps and signs."""
    mm = m[:, None].expand_as(kept)
    return torch.where(kept, torch.where(negative, -mm, mm), mm * 0.0)


def _sparse_encode(e, valid):
    kept, m = _sparse_kept(e, valid)
    wire = _sparse_wire_m(m)
    m = wire.float()
    nb, block = e.shape
    negative = e < 0
    # Sign i of a record is that of its i-th kept element.
    slot = torch.cumsum(kept.long(), 1) - 1
    signs = torch.zeros(nb, block // 2, dtype=torch.int32)
    rows = torch.arange(nb)[:, None].expand_as(kept)
    signs[rows[kept], slot[kept]] = negative[kept].int()
    packed = torch.cat(
        [wire.view(nb, 1).view(torch.uint8), _pack(kept.int(), 1), _pack(signs, 1)], dim=1
    )
    return packed.reshape(-1), _sparse_values(kept, negative & kept, m)


def _sparse_decode(rec: torch.Tensor, block: int) -> torch.Tensor:
    nb = rec.shape[0]
    m = rec[:, :2].reshape(-1).clone().view(torch.bfloat16).float()
    kept = _unpack(rec[:, 2 : 2 + block // 8], 1).bool()
    signs = _unpack(rec[:, 2 + block // 8 :], 1).bool()
    slot = (torch.cumsum(kept.long(), 1) - 1).clamp(min=0)
    # Set bits past the (B/2)-th read as positive (numerics.h).
    negative = torch.gather(signs, 1, slot.clamp(max=block // 2 - 1)) & kept & (slot < block // 2)
    return _sparse_values(kept, negative, m).view(nb, block)


def _encode(e, n, bits, block_size, stochastic, seed, step, rng_offset):
    """Quantize [nb, B] fp32 blocks holding n valid values; returns (packed, deq)."""
    nb = e.shape[0]
    valid = torch.full((nb,), block_size, dtype=torch.int64)
    if nb:
        valid[-1] = n - (nb - 1) * block_size
    if bits == SPARSE_BITS:
        return _sparse_encode(e, valid)
    m = _magnitudes(e, valid, bits, stochastic)
    codes = _codes(e, m, bits, stochastic, seed, step, rng_offset)
    packed = torch.cat([m.view(nb, 1).view(torch.uint8), _pack(codes, bits)], dim=1)
    return packed.reshape(-1), _dequant_blocks(m, codes, bits)


def quantize(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    bits: int,
    block_size: int,
    stochastic: bool = False,
    seed: int = 0,
    step: int = 0,
    rng_offset: int = 0,
) -> torch.Tensor:
    """Quantize ``x`` (+ ``residual``) into one packed uint8 payload.

    With a residual (error feedback), quantizes e = x + residual in fp32 and writes
    residual = e - dequantize(code(e)) in place. Stochastic rounding draws element i's
    uniform from ``rng_uniform(seed, step, rng_offset + i)``.
    """
    e, n = _blocks(x, block_size)
    if residual is not None:
        e = e + _blocks(residual, block_size)[0]
    packed, deq = _encode(e, n, bits, block_size, stochastic, seed, step, rng_offset)
    if residual is not None:
        residual.copy_(canonical(e - deq).reshape(-1)[:n].view_as(residual))
    return packed


def _decode(packed: torch.Tensor, numel: int, bits: int, block_size: int) -> torch.Tensor:
    nb = math.ceil(numel / block_size)
    rb = _record_bytes(bits, block_size)
    rec = packed.reshape(-1)[: nb * rb].view(nb, rb)
    if bits == SPARSE_BITS:
        return _sparse_decode(rec, block_size).reshape(-1)[:numel]
    m = rec[:, :4].reshape(-1).clone().view(torch.float32)
    codes = _unpack(rec[:, 4:], bits)
    return _dequant_blocks(m, codes, bits).reshape(-1)[:numel]


def dequantize(
    packed: torch.Tensor,
    numel: int,
    bits: int,
    block_size: int,
    dtype: torch.dtype,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ``numel`` values a payload encodes, in ``dtype``: :func:`dequantize_sum` of the one
    payload with divisor 1. Its fp32 sum starts from +0, so a value of -0 (a negative scale
    times level 0, in a payload quantize never makes) reads +0."""
    return dequantize_sum(packed.reshape(1, -1), numel, bits, block_size, 1, dtype, scale)


def dequantize_sum(
    payloads: torch.Tensor,
    numel: int,
    bits: int,
    block_size: int,
    divisor: int,
    dtype: torch.dtype,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum of the [N, P] payloads' values in row order in fp32, divided by ``divisor``, in
    ``dtype``; then, with a ``scale``, multiplied by it in fp32 and rounded to ``dtype``
    again (``out.mul_(scale)``'s numbers, with canonical NaNs)."""
    s = torch.zeros(numel, dtype=torch.float32)
    for row in payloads:
        s = s + _decode(row, numel, bits, block_size)
    out = canonical((s / float(divisor)).to(dtype))
    return out if scale is None else canonical((out.float() * scale).to(dtype))


def dequantize_sum_requantize(
    payloads: torch.Tensor,
    residual: torch.Tensor | None,
    numel: int,
    bits: int,
    block_size: int,
    divisor: int,
    stochastic: bool = False,
    seed: int = 0,
    step: int = 0,
    rng_offset: int = 0,
) -> torch.Tensor:
    """The owner step of the two-phase all-reduce, as one pass.

    S = (sum of the payloads' values in row order) + residual; quantizes S / divisor and
    returns its payload. The residual is kept in sum units: residual = S - divisor * deq.
    """
    s = torch.zeros(numel, dtype=torch.float32)
    for row in payloads:
        s = s + _decode(row, numel, bits, block_size)
    if residual is not None:
        s = s + residual.reshape(-1)
    t, n = _blocks(s / float(divisor), block_size)
    packed, deq = _encode(t, n, bits, block_size, stochastic, seed, step, rng_offset)
    if residual is not None:
        deq = deq.reshape(-1)[:numel]
        residual.copy_(canonical(s - float(divisor) * deq).view_as(residual))
    return packed


# --------------------------------------------------------------------------------------
# Multi-tensor flatten family
# --------------------------------------------------------------------------------------


def flatten(tensors: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Every tensor's elements in logical (row-major) order, concatenated in list order.

    Exactly ``torch._utils._flatten_dense_tensors`` for tensors of one dtype and device
    (the native op refuses mixed dtypes instead of promoting them). With ``out``, the
    result is copied into it and ``out`` returned; an empty list then needs an empty out
    (without ``out``, an empty list raises ValueError, as torch's does).
    """
    if not tensors and out is not None:
        return out
    flat = torch._utils._flatten_dense_tensors(list(tensors))
    if out is None:
        return flat
    return out.copy_(flat)


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """Copies consecutive pieces of ``flat`` into ``tensors`` in place, in list order.

    The pieces are ``torch._utils._unflatten_dense_tensors(flat, tensors)``.
    """
    pieces = torch._utils._unflatten_dense_tensors(flat, list(tensors))
    for t, piece in zip(tensors, pieces, strict=True):
        t.copy_(piece)


# Sparsification (numerics.h "Sparsification")
#
# Top-k payload: k int32 indices in ascending order, then the k values in value_dtype.
# Magnitude key: |e|'s float32 bit pattern (bits & 0x7fffffff) as an integer. It orders like
# |e| on finite values and puts Inf above them and NaN above Inf. Entry i ranks above j
# when its key is larger, or the keys tie and i < j.
# --------------------------------------------------------------------------------------

TOPK_SAMPLE_MAX = 16384


def magnitude_key(e: torch.Tensor) -> torch.Tensor:
    """int64 magnitude keys of a float32 tensor."""
    return (e.contiguous().view(torch.int32).to(torch.int64)) & 0x7FFFFFFF


def _topk_exact_indices(keys: torch.Tensor, k: int) -> torch.Tensor:
    # A stable descending sort keeps equal keys in index order: ties go to the lower index.
    order = torch.sort(keys, descending=True, stable=True).indices
    return order[:k].sort().values


def topk_sample_indices(n: int, seed: int, step: int) -> torch.Tensor:
    """The S = min(n, 16384) sampled positions: 53 random bits of draw j, modulo n."""
    j = torch.arange(min(n, TOPK_SAMPLE_MAX), dtype=torch.int64)
    return _shr(rng_u64(seed, step, j), 11) % n


def topk_approx_threshold(e: torch.Tensor, k: int, seed: int, step: int) -> int:
    """Approximate mode's key threshold: the sample's r-th largest key (0-based), with
    m = k*S//n and r = m + isqrt(m), or 0 when r >= S."""
    n = e.numel()
    samples = min(n, TOPK_SAMPLE_MAX)
    m = k * samples // n
    rank = m + math.isqrt(m)
    if rank >= samples:
        return 0
    keys = magnitude_key(e[topk_sample_indices(n, seed, step)])
    return int(keys.sort(descending=True).values[rank])


def _topk_indices(e: torch.Tensor, k: int, approximate: bool, seed: int, step: int):
    keys = magnitude_key(e)
    if not approximate:
        return _topk_exact_indices(keys, k)
    candidate = keys >= topk_approx_threshold(e, k, seed, step)
    count = int(candidate.sum())
    if count >= k:
        # Every entry outside the candidates ranks below all of them: this is exact top-k.
        return _topk_exact_indices(keys, k)
    # Too few passed: all of them, plus the lowest indices that did not.
    pads = (~candidate).nonzero().reshape(-1)[: k - count]
    return torch.cat([candidate.nonzero().reshape(-1), pads]).sort().values


def topk_compress(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    k: int,
    approximate: bool = False,
    seed: int = 0,
    step: int = 0,
    value_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Select k entries of e = x + residual (fp32) and pack them.

    Exact mode: the k best entries in the order above (a function of e alone).
    Approximate mode: the threshold T = topk_approx_threshold; when at least k entries have
    key >= T the result is the exact one (they include the exact top k), otherwise it is
    those entries plus the lowest-index entries below T, k in all.
    The payload holds the indices ascending, then e at them cast to value_dtype (default
    float32), a finite e first saturated at the dtype's largest finite value (65504 for
    float16), so it never becomes Inf on the wire. With a residual: residual = e, except
    residual[i] = e[i] - float(value[i]) at the selected entries (0 for float32 values; the
    excess over 65504 of a saturated float16 value).
    """
    vdtype = value_dtype or torch.float32
    e = x.reshape(-1).float()
    if residual is not None:
        e = e + residual.reshape(-1)
    e = canonical(e)  # every NaN one key: NaNs rank among themselves by index
    idx = _topk_indices(e, k, approximate, seed, step)
    picked = e[idx]
    top = torch.finfo(vdtype).max
    picked = torch.where(picked.isfinite(), picked.clamp(-top, top), picked)
    values = canonical(picked.to(vdtype))
    if residual is not None:
        new = e.clone()
        new[idx] = canonical(e[idx] - values.float())
        residual.copy_(new.view_as(residual))
    return torch.cat([idx.to(torch.int32).view(torch.uint8), values.view(torch.uint8)])


def sparse_accumulate(
    payloads: torch.Tensor,
    numel: int,
    k: int,
    divisor: int,
    value_dtype: torch.dtype,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rows of [N, k*(4+value bytes)] payloads scattered-added in row order into fp32 zeros,
    divided by ``divisor``, cast to ``dtype``."""
    s = torch.zeros(numel, dtype=torch.float32)
    for row in payloads:
        idx = row[: 4 * k].clone().view(torch.int32).long()
        val = row[4 * k :].clone().view(value_dtype).float()
        s[idx] = s[idx] + val
    return canonical((s / float(divisor)).to(dtype))


def randk_key(seed: int, step: int, bucket: int) -> int:
    return _mix64_int(rng_key(seed, step) ^ ((bucket + 0xD6E8FEB86659FD93) & _MASK64))


def randk_indices(numel: int, k: int, seed: int, step: int, bucket: int) -> torch.Tensor:
    """k distinct ascending indices, one per stratum [j*n//k, (j+1)*n//k), each drawn with
    32 random bits u as lo + (u * size) >> 32 from the key (seed, step, bucket)."""
    j = torch.arange(k, dtype=torch.int64)
    lo, hi = j * numel // k, (j + 1) * numel // k
    u32 = _shr(_mix64(j ^ _signed(randk_key(seed, step, bucket))), 32)
    return lo + _shr(u32 * (hi - lo), 32)


def randk_strata(numel: int, k: int, start: int = 0, end: int | None = None) -> tuple:
    """Strata [start, end) (end None: k) and the bucket elements they cover, [lo, hi):
    stratum j is [j*numel//k, (j+1)*numel//k), so a range of strata is one contiguous range
    of the bucket. Raises ValueError unless 0 <= start <= end <= k."""
    end = k if end is None else end
    if not 0 <= start <= end <= k:
        raise ValueError(f"strata must satisfy 0 <= start <= end <= k={k}, got {start}, {end}")
    return start, end, start * numel // k, end * numel // k


def randk_compress(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    k: int,
    seed: int,
    step: int,
    bucket: int,
    start: int = 0,
    end: int | None = None,
) -> torch.Tensor:
    """fp32 e = x + residual at randk_indices; the residual becomes e, 0 at those indices.

    If any entry of e is non-finite (sent or not), every value is NaN, so the reduced
    result is non-finite on every rank.

    ``start``, ``end``: only strata [start, end) (of k; end None: k), which cover the
    elements [lo, hi) of :func:`randk_strata`. Returns their end - start values, reads and
    updates x and the residual on [lo, hi) only, and the NaN rule covers [lo, hi): a
    non-finite entry makes its own range's values NaN, not the other ranges'. The ranges
    of a partition of [0, k) therefore give, concatenated, the values (and residual) of
    the whole call whenever every e is finite; collectives._randk spreads the NaN of a
    non-finite range over the whole result itself.
    """
    start, end, lo, hi = randk_strata(x.numel(), k, start, end)
    e = x.reshape(-1)[lo:hi].float()
    if residual is not None:
        e = canonical(e + residual.reshape(-1)[lo:hi])
    idx = randk_indices(x.numel(), k, seed, step, bucket)[start:end] - lo
    values = e[idx].clone()
    if not bool(torch.isfinite(e).all()):
        values.fill_(float("nan"))
    if residual is not None:
        e = e.clone()
        e[idx] = 0.0
        residual.reshape(-1)[lo:hi] = e
    return values


def randk_decompress(
    values: torch.Tensor,
    numel: int,
    seed: int,
    step: int,
    bucket: int,
    divisor: int,
    dtype: torch.dtype,
    start: int = 0,
    end: int | None = None,
) -> torch.Tensor:
    """Zeros of ``numel`` with values / divisor (fp32) at randk_indices, cast to dtype.

    ``values`` holds all k values; ``start``, ``end``: only strata [start, end) (end None:
    k), whose elements [lo, hi) (:func:`randk_strata`) are returned: hi - lo of them, from
    values[start:end]. Ranges of a partition of [0, k) concatenate to the whole result.
    """
    k = values.numel()
    start, end, lo, hi = randk_strata(numel, k, start, end)
    out = torch.zeros(hi - lo, dtype=torch.float32)
    idx = randk_indices(numel, k, seed, step, bucket)[start:end] - lo
    out[idx] = values[start:end].float() / float(divisor)
    return canonical(out.to(dtype))


def scale_down(
    x: torch.Tensor, average: torch.Tensor | None, scale: torch.Tensor, beta: float
) -> torch.Tensor:
    """normalize's way in: ``average = beta * average + (1 - beta) * x * x`` in place (torch's
    addcmul_: on a CPU with FMA, fma((1 - beta) * x, x, beta * average)), then ``x / scale``
    rounded to x's dtype, the values ops.quantize quantizes when given a ``scale``."""
    if average is not None:
        average.mul_(beta).addcmul_(x, x, value=1 - beta)
    return (x / scale).to(x.dtype)
