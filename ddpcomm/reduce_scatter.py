"""Compressed reduce-scatter algorithms built on torch.distributed collectives.

``reduce_scatter(output, input, compressor, op, ctx, residual)`` is the one entry point,
the reduce-scatter twin of ``collectives.all_reduce_mean``: ``input`` holds N equal
chunks (chunk i is addressed to rank i of ``ctx.pg``), ``output`` receives this rank's
chunk reduced over the N ranks with ``op``. It is the first phase of the two-phase
all-reduce (DESIGN.md section 3): every rank compresses each destination chunk into one
packed buffer, one ``all_to_all_single`` delivers chunk i to rank i, and the owner
decodes the N payloads and sums them in fp32, in rank order. Nothing here knows about
FSDP: ``fsdp.py`` adapts FSDP2's comm interface to it.

Reductions: ``op`` is what FSDP2 passes, SUM, AVG, or PREMUL_SUM(f) (sum of f * x, FSDP's
custom gradient divide factor). The sum is formed in fp32 whatever the tensors' dtype,
divided by N for AVG or multiplied by f for PREMUL_SUM, then cast once to ``output``.

Non-finite input. A lossy method that finds a NaN/Inf anywhere in this rank's payload
marks the first value of every chunk it sends as NaN, so every owner's shard comes out
non-finite, as an all-reduce's would (AMP's GradScaler skips the step), and every rank
derives the same device flag from what it received: its residual is reset on every rank
alike. The flag stays on the device: no host synchronisation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpcomm import ops
from ddpcomm.collectives import _bucket_int, _magnitudes_finite, _stream_seed
from ddpcomm.compressors import CastCompression, Compressor, NoCompression, Quantizer, RandomK, TopK
from ddpcomm.context import ReduceContext

RedOpType = dist.ReduceOp.RedOpType

# torch 2.13 names it reduce_scatter_single; older releases have reduce_scatter_tensor.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _kind(op):
    # ReduceOp.AVG is a RedOpType; ReduceOp.PREMUL_SUM(f) a ReduceOp holding one.
    return op if isinstance(op, RedOpType) else getattr(op, "op", None)


def reduction(op, world: int) -> tuple[int, float | torch.Tensor | None]:
    """(divisor, factor) of a reduce op: SUM (1, None), AVG (N, None), PREMUL_SUM(f) (1, f).

    Raises ValueError for any other op (MAX, PRODUCT, ...), which no gradient uses.
    """
    kind = _kind(op)
    if kind == RedOpType.SUM:
        return 1, None
    if kind == RedOpType.AVG:
        return world, None
    if kind == RedOpType.PREMUL_SUM:
        return 1, op.factor
    raise ValueError(f"op must be ReduceOp.SUM, AVG or PREMUL_SUM, got {op!r}")


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    compressor: Compressor,
    op,
    ctx: ReduceContext,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Writes this rank's chunk of ``op`` over every rank's ``input`` into ``output``.

    ``input`` is 1-D and contiguous with N * ``output.numel()`` elements. ``residual`` is
    an fp32 error-feedback buffer of ``input``'s size (updated in place) or None. Returns
    a 0-dim device bool, the same on every rank, saying whether every rank's input was
    finite (lossy methods; the caller resets residuals where it is False), or None.
    """
    pg = ctx.pg
    world = dist.get_world_size(pg)
    if output.numel() == 0:
        ctx.stats.record("empty", 0, 0)
        return None
    divisor, factor = reduction(op, world)
    if isinstance(compressor, Quantizer):
        return _quantized(output, input, compressor, ctx, residual, divisor, factor)
    if isinstance(compressor, TopK):
        return _topk(output, input, compressor, ctx, residual, divisor, factor)
    if isinstance(compressor, RandomK):
        return _randk(output, input, compressor, ctx, residual, divisor, factor)
    if isinstance(compressor, CastCompression):
        return _cast(output, input, compressor, ctx, divisor, factor)
    if isinstance(compressor, NoCompression):
        plain(output, input, op, ctx)
        return None
    raise TypeError(f"no reduce-scatter algorithm for {type(compressor).__name__}")


def plain(output: torch.Tensor, input: torch.Tensor, op, ctx: ReduceContext) -> None:
    """The lossless path: exactly the collective FSDP2 issues by default."""
    world = dist.get_world_size(ctx.pg)
    dense = _dense_bytes(output, world)
    ctx.stats.record("plain", dense, dense)
    if _kind(op) == RedOpType.PREMUL_SUM and dist.get_backend(ctx.pg) == "gloo":
        # gloo has no PREMUL_SUM (FSDP's op for a custom divide factor): multiply
        # first, as NCCL does, then sum. FSDP's input buffer is scratch it never reads.
        input.mul_(op.factor)
        op = dist.ReduceOp.SUM
    reduce_scatter_single(output, input, op=op, group=ctx.pg)


# --------------------------------------------------------------------------------------
# Shared steps
# --------------------------------------------------------------------------------------


def _dense_bytes(output: torch.Tensor, world: int) -> int:
    """What a plain reduce-scatter in the reduce dtype sends per rank: N-1 chunks."""
    return (world - 1) * output.numel() * output.element_size()


def _chunks(t: torch.Tensor | None, world: int) -> list[torch.Tensor | None]:
    return [None] * world if t is None else list(t.view(world, -1))


def _poison(first_values: torch.Tensor, finite: torch.Tensor) -> None:
    """NaN into ``first_values`` (one entry per outgoing chunk) unless ``finite``."""
    first_values.masked_fill_(finite.logical_not(), float("nan"))


def _exchange(received: torch.Tensor, sent: torch.Tensor, ctx: ReduceContext) -> None:
    """Chunk i of ``sent`` to rank i. Blocking on gloo; on NCCL the current stream waits
    for it (no host synchronisation)."""
    dist.all_to_all_single(received, sent, group=ctx.pg)


def _fp32_scratch(ctx: ReduceContext, numel: int, device) -> torch.Tensor:
    return ctx.buffer("fp32_sum", 4 * numel, device).view(torch.float32)


def _write(output, divisor, factor, ctx, decode) -> None:
    """``decode(out, divisor)`` writes the divided fp32 sum into ``out``; a PREMUL_SUM
    factor is applied to that fp32 sum before the one cast into ``output``."""
    with ctx.stats.timer():
        if factor is None:
            decode(output, divisor)
            return
        acc = output
        if output.dtype != torch.float32:
            acc = _fp32_scratch(ctx, output.numel(), output.device)
        decode(acc, divisor)
        acc.mul_(factor)
        if acc is not output:
            output.copy_(acc)


def _sum_rows(rows: torch.Tensor, out: torch.Tensor, divisor: int, ctx: ReduceContext) -> None:
    """fp32 sum of the [N, S] rows in rank order, divided by ``divisor``, into ``out``."""
    acc = out if out.dtype == torch.float32 else _fp32_scratch(ctx, out.numel(), out.device)
    acc.copy_(rows[0])
    for row in rows[1:]:
        acc.add_(row)
    if divisor != 1:
        acc.div_(ops.divisor(divisor, acc))
    if acc is not out:
        out.copy_(acc)


# --------------------------------------------------------------------------------------
# Methods
# --------------------------------------------------------------------------------------


def _quantized(output, input, q: Quantizer, ctx, residual, divisor, factor):
    world, rank = dist.get_world_size(ctx.pg), dist.get_rank(ctx.pg)
    n, dev = output.numel(), output.device
    bits, block, rec = q.code, q.block_size, q.record_bytes
    size = q.payload_bytes(n)  # one chunk's records
    send = ctx.buffer("send", world * size, dev)
    received = ctx.buffer("receive", world * size, dev)
    seed = _stream_seed(q.seed, ctx.key)
    # Counter ranges disjoint across ranks and chunks: no two roundings share a draw.
    base = rank * world * n
    with ctx.stats.timer():
        if n % block == 0:
            # Chunks are whole blocks: one pass over the input makes the same bytes as
            # one pass per chunk (blocks are independent, RNG counters are indices).
            ops.quantize(input, residual, bits, block, q.stochastic, seed, ctx.step, base, out=send)
        else:
            inputs, residuals = _chunks(input, world), _chunks(residual, world)
            for i in range(world):
                out = send[i * size : (i + 1) * size]
                r, offset = residuals[i], base + i * n
                ops.quantize(
                    inputs[i], r, bits, block, q.stochastic, seed, ctx.step, offset, out=out
                )
        # A block holding NaN/Inf has a non-finite magnitude (at the head of its record).
        dtype = ops.magnitude_dtype(bits)
        first = send.view(world, size)[:, : dtype.itemsize].view(dtype)
        _poison(first, _magnitudes_finite(send, rec, bits))
    ctx.stats.record("q_reduce_scatter", (world - 1) * size, _dense_bytes(output, world))
    _exchange(received, send, ctx)
    rows = received.view(world, size)

    def decode(out, d):
        ops.dequantize_sum(rows, n, bits, block, d, out.dtype, out=out)

    _write(output, divisor, factor, ctx, decode)
    return _magnitudes_finite(received, rec, bits)


def _topk(output, input, c: TopK, ctx, residual, divisor, factor):
    world = dist.get_world_size(ctx.pg)
    n, dev = output.numel(), output.device
    k, vdtype = c.k(n), c.value_dtype
    size = c.payload_bytes(n)
    dense_eq = _dense_bytes(output, world)
    inputs, residuals = _chunks(input, world), _chunks(residual, world)

    def compress(i, out):
        # The sample seed only matters in approximate mode; per chunk so chunks differ.
        seed = _stream_seed(i, ctx.key)
        ops.topk_compress(
            inputs[i], residuals[i], k, c.approximate, seed, ctx.step, vdtype, out=out
        )

    if size >= 4 * n:
        # Dense switch: the k pairs of a chunk outweigh its fp32 values. Send each chunk's
        # sparsified values densely in fp32 (the same numbers, fewer bytes).
        packed = ctx.buffer("packed", size, dev)
        send = ctx.buffer("send", world * 4 * n, dev).view(torch.float32)
        received = ctx.buffer("receive", world * 4 * n, dev).view(torch.float32)
        with ctx.stats.timer():
            for i in range(world):
                compress(i, packed)
                dense = send[i * n : (i + 1) * n]
                ops.sparse_accumulate(packed.view(1, -1), n, k, 1, vdtype, torch.float32, out=dense)
            _poison(send.view(world, n)[:, :1], torch.isfinite(send).all())
        ctx.stats.record("topk_dense", (world - 1) * 4 * n, dense_eq)
        _exchange(received, send, ctx)
        rows = received.view(world, n)
        _write(output, divisor, factor, ctx, lambda out, d: _sum_rows(rows, out, d, ctx))
        return torch.isfinite(received).all()

    send = ctx.buffer("send", world * size, dev)
    received = ctx.buffer("receive", world * size, dev)
    with ctx.stats.timer():
        for i in range(world):
            compress(i, send[i * size : (i + 1) * size])
        # NaN/Inf rank above every finite magnitude: a non-finite chunk always sends one.
        values = send.view(world, size)[:, 4 * k :].view(vdtype)
        _poison(values[:, :1], torch.isfinite(values).all())
    ctx.stats.record("topk_reduce_scatter", (world - 1) * size, dense_eq)
    _exchange(received, send, ctx)
    rows = received.view(world, size)

    def decode(out, d):
        ops.sparse_accumulate(rows, n, k, d, vdtype, out.dtype, out=out)

    _write(output, divisor, factor, ctx, decode)
    return torch.isfinite(rows[:, 4 * k :].contiguous().view(vdtype)).all()


def _randk(output, input, c: RandomK, ctx, residual, divisor, factor):
    world, rank = dist.get_world_size(ctx.pg), dist.get_rank(ctx.pg)
    n, dev = output.numel(), output.device
    k = c.k(n)
    # Chunk i's indices come from (seed, step, key, i): its owner draws the same ones.
    buckets = [_bucket_int((ctx.key, i)) for i in range(world)]
    send = ctx.buffer("send", world * 4 * k, dev).view(torch.float32).view(world, k)
    received = ctx.buffer("receive", 4 * k, dev).view(torch.float32)
    with ctx.stats.timer():
        inputs, residuals = _chunks(input, world), _chunks(residual, world)
        for i in range(world):
            # A non-finite entry anywhere in a chunk makes all its values NaN.
            send[i] = ops.randk_compress(inputs[i], residuals[i], k, c.seed, ctx.step, buckets[i])
        _poison(send[:, :1], torch.isfinite(send).all())
    ctx.stats.record("randk_reduce_scatter", (world - 1) * 4 * k, _dense_bytes(output, world))
    # The values of one index set: a plain fp32 reduce-scatter sums them.
    reduce_scatter_single(received, send.view(-1), op=dist.ReduceOp.SUM, group=ctx.pg)

    def decode(out, d):
        ops.randk_decompress(received, n, c.seed, ctx.step, buckets[rank], d, out.dtype, out=out)

    _write(output, divisor, factor, ctx, decode)
    return torch.isfinite(received).all()


def _cast(output, input, c: CastCompression, ctx, divisor, factor):
    world = dist.get_world_size(ctx.pg)
    n, dev = output.numel(), output.device
    nbytes = world * n * 2
    send = ctx.buffer("send", nbytes, dev).view(c.dtype)
    received = ctx.buffer("receive", nbytes, dev).view(c.dtype)
    with ctx.stats.timer():
        send.copy_(input)
        _poison(send.view(world, n)[:, :1], torch.isfinite(send).all())
    ctx.stats.record(c.spec + "_reduce_scatter", (world - 1) * n * 2, _dense_bytes(output, world))
    _exchange(received, send, ctx)
    rows = received.view(world, n)
    _write(output, divisor, factor, ctx, lambda out, d: _sum_rows(rows, out, d, ctx))
    return torch.isfinite(received).all()
