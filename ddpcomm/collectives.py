"""All-reduce algorithms built on torch.distributed collectives.

``all_reduce_mean(flat, compressor, ctx)`` is the one entry point: it picks the algorithm
of the compressor's method and returns a ``torch.futures.Future`` of the mean over ranks,
in ``flat``'s dtype, bitwise the same on every rank (``two_level.py`` composes it for
multi-node groups; the algorithms here do not know about nodes). Nothing here knows
about DDP: hooks.py adapts buckets to it. The bookkeeping every algorithm shares
(residuals, reused buffers, stats) lives in context.py, the Futures and their CUDA
ordering in futures.py, the collective-order sequencer in groups.py.

On CUDA, kernels run on the current stream, collectives order themselves against it, and
every Future returned is the collective's own, a ``then`` of one, or a device Future: DDP's
reducer then waits for the last kernel, not just for the callback. No function here reads
a device value on the host: whether a step was finite stays a device flag.
"""

from __future__ import annotations

import functools
import hashlib
import math

import torch
import torch.distributed as dist

from ddpcomm import ops
from ddpcomm.compressors import (
    CastCompression,
    Compressor,
    NoCompression,
    Quantizer,
    RandomK,
    TopK,
    dense_bytes,
)
from ddpcomm.context import ReduceContext
from ddpcomm.futures import (
    Future,
    completed,
    current_stream,
    device_future,
    fail,
    join,
    on_stream,
    resolve,
    then,
)
from ddpcomm.groups import all_gather_single, sequencer


def all_reduce_mean(flat: torch.Tensor, compressor: Compressor, ctx: ReduceContext) -> Future:
    """Mean over the ranks of ``ctx.group`` of the 1-D tensor ``flat``, compressed.

    ``flat`` is overwritten: the Future's value is ``flat`` holding the mean, bitwise
    identical on every rank.
    """
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("all_reduce_mean takes a contiguous 1-D tensor")
    compressor.check_tensor(flat, "tensor")
    if ctx.scaling is not None and not isinstance(compressor, Quantizer):
        raise TypeError(f"{type(compressor).__name__} reductions take no normalize scaling")
    if isinstance(compressor, Quantizer):
        if compressor.resolve_algorithm(dist.get_world_size(ctx.pg)) == "all_gather":
            return _quantized_all_gather(flat, compressor, ctx)
        return _quantized_two_phase(flat, compressor, ctx)
    if isinstance(compressor, TopK):
        return _topk(flat, compressor, ctx)
    if isinstance(compressor, RandomK):
        return _randk(flat, compressor, ctx)
    if isinstance(compressor, CastCompression):
        return _cast(flat, compressor, ctx)
    if isinstance(compressor, NoCompression):
        return plain_all_reduce(flat, ctx)
    raise TypeError(f"no all-reduce algorithm for {type(compressor).__name__}")


# --------------------------------------------------------------------------------------
# Lossless and casts
# --------------------------------------------------------------------------------------


def plain_all_reduce(flat: torch.Tensor, ctx: ReduceContext) -> Future:
    """The lossless path: all_reduce of ``flat * (1/N)``, bitwise DDP's default."""
    world = dist.get_world_size(ctx.pg)
    # Scale by 1/N before the sum, exactly as DDP's reducer does when it copies gradients
    # into a bucket (multiplying by the reciprocal, not dividing): the lossless path is
    # then bitwise DDP's default, and fp16 buckets do not overflow in the sum.
    flat.mul_(1.0 / world)
    dense = dense_bytes(flat.numel(), world, flat.element_size())
    ctx.stats.record("plain", dense, dense)
    work = dist.all_reduce(flat, group=ctx.pg, async_op=True)
    return then(work.get_future(), lambda fut: fut.value()[0])


def sparse_all_reduce(grad: torch.Tensor, ctx: ReduceContext) -> Future:
    """A sparse gradient bucket (``nn.Embedding(sparse=True)``): reduced plainly, bitwise
    as DDP's default does (divide by N, then torch's sparse all_reduce; the reducer
    divides sparse gradients where it multiplies dense ones by 1/N); the lossy methods
    take dense buckets only. ``stats()`` counts it as path ``sparse_plain``."""
    world = dist.get_world_size(ctx.pg)
    grad.div_(world)
    # gloo's sparse all_reduce all-gathers every rank's indices and values.
    own = grad._indices().numel() * 8 + grad._values().numel() * grad.element_size()
    ctx.stats.record(
        "sparse_plain", (world - 1) * own, dense_bytes(grad.numel(), world, grad.element_size())
    )
    work = dist.all_reduce(grad, group=ctx.pg, async_op=True)
    return then(work.get_future(), lambda fut: fut.value()[0])


def _cast(flat: torch.Tensor, c: CastCompression, ctx: ReduceContext) -> Future:
    world = dist.get_world_size(ctx.pg)
    with ctx.stats.timer():
        wire = flat.to(c.dtype).div_(world)
    ctx.stats.record(
        c.spec,
        c.wire_bytes(flat.numel(), world),
        dense_bytes(flat.numel(), world, flat.element_size()),
    )
    work = dist.all_reduce(wire, group=ctx.pg, async_op=True)

    def decode(fut):
        with ctx.stats.timer():
            # In place into the caller's buffer, as torch's fp16 hook decompresses into the
            # bucket: no second bucket-sized tensor alive at the peak.
            return flat.copy_(fut.value()[0])

    return then(work.get_future(), decode)


# --------------------------------------------------------------------------------------
# Quantized: all-gather (N <= 2 by default) and two-phase
# --------------------------------------------------------------------------------------

# gloo moves one large all_gather between two ranks at ~80 MB/s on a 1 Gbit/s link (119
# MB/s line rate), while several smaller all_gathers in flight at once reach line rate
# (q8 at 64 MiB, 2 ranks, went from 2.14x to 3.03x the plain all_reduce). Pieces also let
# each piece be compressed just before it is sent and decoded as it lands, overlapping both
# with the wire. Compression and decoding cost follows the bucket, not the payload, so a
# high-ratio method's small payload is cut by bucket size too: q1, top-k and random-k at
# 64 MiB go in 4 pieces (q8 and q4 in the 8 and 4 of their 2 MiB payload pieces, as
# before). NCCL pipelines one collective by itself.
#
# A slow link wants smaller pieces still, a fast one larger: 8.7 MB all-gathered between
# two ranks at 1 Gbit/s took 79.1 ms in 4 pieces and 73.6 in 16, while on loopback q4 at
# 64 MiB took 21.6 ms in 2 MiB pieces and 28.6 in 512 KiB ones (medians, same runs). So a
# bucket with a Workspace sizes its pieces from the payload rate the ranks measured and
# agreed on (context.LinkRate): about _LINK_PIECE_SECONDS of wire each, between
# _GLOO_MIN_PIECE_BYTES and _GLOO_PIECE_BYTES. At 1 Gbit/s (110-130 MB/s agreed) that is
# 512 KiB; on loopback q8 and q4 agreed on 590-2100 MB/s: 2 MiB, or nearly.
_GLOO_PIECE_BYTES = 2 << 20
_GLOO_MIN_PIECE_BYTES = 512 << 10
_GLOO_PIECE_BUCKET_BYTES = 16 << 20
_GLOO_MAX_PIECES = 16  # of _GLOO_PIECE_BYTES; smaller pieces may be as many more
_LINK_PIECE_SECONDS = 0.004


def _piece_bytes(link) -> int:
    """Payload bytes per gloo piece: _GLOO_PIECE_BYTES, or fewer on a slow agreed link."""
    if link is None:
        return _GLOO_PIECE_BYTES
    wire = link.agreed() * _LINK_PIECE_SECONDS  # inf until a rate is agreed
    return int(min(_GLOO_PIECE_BYTES, max(_GLOO_MIN_PIECE_BYTES, wire)))


def _pieces(
    records: int,
    record_bytes: int,
    bucket_bytes: int,
    group: dist.ProcessGroup,
    link=None,
) -> list[tuple[int, int]]:
    """Record ranges [r0, r1) to send separately: several on gloo, one on NCCL. ``link``
    (the bucket's LinkRate, or None) sets the piece size on gloo."""
    count = 1
    if dist.get_backend(group) == "gloo":
        piece = _piece_bytes(link)
        by_payload = records * record_bytes // piece
        most = _GLOO_MAX_PIECES * _GLOO_PIECE_BYTES // piece
        count = min(most, max(1, by_payload, bucket_bytes // _GLOO_PIECE_BUCKET_BYTES))
    count = max(1, min(count, records))
    return [(records * i // count, records * (i + 1) // count) for i in range(count)]


def _gather_pieces(send, gathered, spans, pg, prepare, land, link=None) -> list[Future]:
    """All-gathers the byte spans [b0, b1) of ``send`` as one all_gather each, in order:
    ``prepare(i)`` fills span i just before it is sent, and ``land(i, rows)`` runs as its
    (N, b1 - b0) rows arrive (at ``gathered[N * b0 : N * b1]``) and returns the tensor it
    wrote, or None. One Future per span, whose value is that tensor or the rows: it carries
    the collective's and the decode's CUDA work to its waiters (futures.py's stream rule).
    ``link`` (the bucket's LinkRate, or None) times the payload on its way."""
    world = dist.get_world_size(pg)
    futures = []
    timing = None if link is None else link.start(spans[-1][1] - spans[0][0], len(spans))
    for i, (b0, b1) in enumerate(spans):
        prepare(i)
        if timing is not None:
            timing.issued(i)
        piece = gathered[world * b0 : world * b1]
        work = all_gather_single(piece, send[b0:b1], group=pg, async_op=True)
        rows = piece.view(world, b1 - b0)

        def landed(fut, i=i, rows=rows):
            fut.wait()
            if timing is not None:
                timing.landed(i)
            written = land(i, rows)
            return rows if written is None else written

        futures.append(then(work.get_future(), landed))
    if link is not None:
        link.sent(pg)
    return futures


def _gloo_link(ctx: ReduceContext):
    """The bucket's LinkRate where pieces follow the link (gloo, with a Workspace)."""
    return ctx.link() if dist.get_backend(ctx.pg) == "gloo" else None


def _quantized_all_gather(flat: torch.Tensor, q: Quantizer, ctx: ReduceContext) -> Future:
    pg, n = ctx.pg, flat.numel()
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    if n == 0:
        return _empty(flat, ctx)
    residual = ctx.residual("q", n, flat.device) if q.error_feedback else None
    seed = _stream_seed(q.seed, ctx.key)
    block, rec = q.block_size, q.record_bytes
    records = math.ceil(n / block)
    size = records * rec
    packed = ctx.buffer("send", size, flat.device)
    gathered = ctx.buffer("gather", world * size, flat.device)
    ctx.stats.record(
        "q_all_gather", q.wire_bytes(n, world, rank), dense_bytes(n, world, flat.element_size())
    )

    # Records are whole blocks, so each piece is quantized on its own (same bytes as the
    # whole tensor: blocks are independent and RNG counters are element indices) and sent
    # at once, letting the wire start after the first piece; its gathered rows are N
    # payloads of its element range and decode straight into that slice of `flat`.
    link = _gloo_link(ctx)
    pieces = _pieces(records, rec, n * flat.element_size(), pg, link)

    def elements(i):
        r0, r1 = pieces[i]
        return r0 * block, min(r1 * block, n)

    def prepare(i):
        (r0, r1), (e0, e1) = pieces[i], elements(i)
        with ctx.stats.timer():
            ops.quantize(
                flat[e0:e1],
                None if residual is None else residual[e0:e1],
                q.code,
                block,
                q.stochastic,
                seed,
                ctx.step,
                rank * n + e0,
                out=packed[r0 * rec : r1 * rec],
                **_scaled(ctx, e0, e1),
            )

    def land(i, rows):
        e0, e1 = elements(i)
        with ctx.stats.timer():
            return ops.dequantize_sum(
                rows, e1 - e0, q.code, block, world, flat.dtype, flat[e0:e1], _scale(ctx, e0, e1)
            )

    spans = [(r0 * rec, r1 * rec) for r0, r1 in pieces]
    futures = _gather_pieces(packed, gathered, spans, pg, prepare, land, link)
    done = join(futures, flat, flat.device)
    if residual is None:
        return done
    # Every rank sees every payload, so all agree on whether the step was finite.
    return then(done, lambda f: _reset_unless(ctx, _magnitudes_finite(gathered, rec, q.code), f))


def _quantized_two_phase(flat: torch.Tensor, q: Quantizer, ctx: ReduceContext) -> Future:
    pg, n = ctx.pg, flat.numel()
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    if n == 0:
        return _empty(flat, ctx)
    bits, block, rec = q.code, q.block_size, q.record_bytes
    chunk = q.chunk_numel(n, world)  # elements per rank, whole blocks
    per_chunk = chunk // block  # records per chunk; the trailing chunks may hold fewer
    records = math.ceil(n / block)
    held = [size // rec for size in q.two_phase_splits(n, world)]  # records in each chunk
    my_numel = max(0, min(n, (rank + 1) * chunk) - rank * chunk)

    seq = sequencer(pg, flat.device)
    seed = _stream_seed(q.seed, ctx.key)
    # Disjoint counter ranges for every (rank, phase) so no two roundings share a draw.
    stride = 2 * world * chunk
    residual = ctx.residual("q", n, flat.device) if q.error_feedback else None
    owner_residual = ctx.residual("q_owner", my_numel, flat.device) if q.error_feedback else None
    ctx.stats.record(
        "q_two_phase", q.wire_bytes(n, world, rank), dense_bytes(n, world, flat.element_size())
    )
    packed = ctx.buffer("send", records * rec, flat.device)
    received = ctx.buffer("receive", world * held[rank] * rec, flat.device)
    gathered = ctx.buffer("gather", world * per_chunk * rec, flat.device)
    send = ctx.buffer("send2", per_chunk * rec, flat.device)

    def elements(d: int, c0: int, c1: int) -> tuple[int, int]:
        """The tensor's elements in records [c0, c1) of rank d's chunk."""
        lo, hi = min(c0, held[d]), min(c1, held[d])
        return d * chunk + lo * block, min(n, d * chunk + hi * block)

    def phase_one(c0: int, c1: int, out: torch.Tensor, splits: list[int]) -> None:
        with ctx.stats.timer():
            at = 0
            for d in range(world):
                e0, e1 = elements(d, c0, c1)
                if e1 > e0:
                    ops.quantize(
                        flat[e0:e1],
                        None if residual is None else residual[e0:e1],
                        bits,
                        block,
                        q.stochastic,
                        seed,
                        ctx.step,
                        rank * stride + e0,
                        out=out[at : at + splits[d]],
                        **_scaled(ctx, e0, e1),
                    )
                at += splits[d]

    def owner_step(c0, c1, inbox, ticket, result, fut):
        try:
            fut.wait()
        except Exception as exc:  # noqa: BLE001 - handed to the waiter
            # Phase 1 itself failed: a peer is gone or frozen past the group's timeout, and
            # the group is unusable. Phase 2 would only wait out that timeout once more
            # (a frozen peer was reported after twice the group's timeout): fail now.
            seq.submit(ticket, lambda: None)
            fail(result, exc)
            return None
        error = None
        e0, e1 = (e - rank * chunk for e in elements(rank, c0, c1))
        reply = send[c0 * rec : c1 * rec]
        try:
            if e1 > e0:
                with ctx.stats.timer():
                    reduced = ops.dequantize_sum_requantize(
                        inbox,
                        None if owner_residual is None else owner_residual[e0:e1],
                        e1 - e0,
                        bits,
                        block,
                        world,
                        q.stochastic,
                        seed,
                        ctx.step,
                        rank * stride + world * chunk + rank * chunk + e0,
                    )
                reply[: reduced.numel()] = reduced
            reply[inbox.shape[1] :] = 0  # past a short chunk's records: never read
        except Exception as exc:  # noqa: BLE001
            # This rank's own step failed, not the collective: still take part in phase 2
            # so no peer hangs; all-ones bytes make NaN magnitudes, so every rank's result
            # is non-finite, and this rank raises.
            reply.fill_(0xFF)
            error = exc
        # Phase 2 may be issued from a later bucket's callback (ticket order), on another
        # thread: it must wait for this callback's stream, which wrote `reply`.
        stream = current_stream(flat)
        rows = gathered[world * c0 * rec : world * c1 * rec]

        def issue():
            with on_stream(stream):
                w2 = all_gather_single(rows, reply, group=seq.companion, async_op=True)
            if error is not None:
                then(w2.get_future(), lambda _: fail(result, error))
            else:
                then(w2.get_future(), lambda f: decode(c0, c1, rows, result, f))

        seq.submit(ticket, issue)
        return reply  # written on this callback's stream (futures.py's stream rule)

    def decode(c0, c1, rows, result, fut):
        try:
            fut.wait()
            with ctx.stats.timer():
                if (c0, c1) == (0, per_chunk):  # one piece: whole chunks, in tensor order
                    whole = gathered[: records * rec]
                    ops.dequantize(whole, n, bits, block, flat.dtype, flat, _scale(ctx, 0, n))
                else:
                    rows = rows.view(world, (c1 - c0) * rec)
                    for d in range(world):
                        e0, e1 = elements(d, c0, c1)
                        if e1 > e0:
                            payload = rows[d, : math.ceil((e1 - e0) / block) * rec]
                            ops.dequantize(
                                payload, e1 - e0, bits, block, flat.dtype, flat[e0:e1],
                                _scale(ctx, e0, e1),
                            )  # fmt: skip
            resolve(result, flat)
        except Exception as exc:  # noqa: BLE001 - handed to the waiter, not swallowed
            fail(result, exc)

    # On gloo the chunks go in pieces, as the all-gather algorithm's payload does: piece
    # [c0, c1) is records c0..c1 of every chunk. Each piece is quantized just before its
    # all_to_all, reduced by its owner as it lands, all-gathered in ticket order and
    # decoded as that lands. Blocks and RNG counters are per element: the bits are those
    # of one piece.
    results, at = [], 0
    for c0, c1 in _pieces(per_chunk, world * rec, n * flat.element_size(), pg):
        splits = [max(0, min(c1, h) - c0) * rec for h in held]
        out = packed[at : at + sum(splits)]
        at += sum(splits)
        phase_one(c0, c1, out, splits)
        mine = splits[rank]
        inbox = received[world * c0 * rec : world * c0 * rec + world * mine]
        work = dist.all_to_all_single(inbox, out, [mine] * world, splits, group=pg, async_op=True)
        ticket = seq.ticket()
        result = device_future(flat.device)
        inbox = inbox.view(world, mine)
        then(work.get_future(), functools.partial(owner_step, c0, c1, inbox, ticket, result))
        results.append(result)
    done = join(results, flat, flat.device)
    if not q.error_feedback:
        return done
    # Every rank decodes every record, so all agree on whether the step was finite.
    return then(done, lambda f: _reset_unless(ctx, _magnitudes_finite(gathered, rec, q.code), f))


def _scale(ctx: ReduceContext, e0: int, e1: int) -> torch.Tensor | None:
    """What the decode of elements [e0, e1) multiplies by: the normalize scale, or None."""
    return None if ctx.scaling is None else ctx.scaling.scale[e0:e1]


def _scaled(ctx: ReduceContext, e0: int, e1: int) -> dict:
    """What the quantize of elements [e0, e1) divides by: the normalize scale's arguments."""
    return {} if ctx.scaling is None else ctx.scaling.args(e0, e1)


def _stream_seed(seed: int, key) -> int:
    """Per-bucket seed, so buckets draw independent stochastic roundings."""
    return (seed * 0x9E3779B1 + (_bucket_int(key) & 0xFFFFFFFF)) & (2**63 - 1)


def _magnitudes_finite(payloads: torch.Tensor, record_bytes: int, bits: int) -> torch.Tensor:
    """A 0-dim device bool: whether every block magnitude in the packed records is finite."""
    return torch.isfinite(ops.magnitudes(payloads, record_bytes, bits)).all()


def _reset_unless(ctx: ReduceContext, finite: torch.Tensor, fut: Future) -> torch.Tensor:
    ctx.reset_unless(finite)
    return fut.value()


def _empty(flat: torch.Tensor, ctx: ReduceContext) -> Future:
    """Nothing to reduce: no collective (every rank has the same numel), mean of none."""
    ctx.stats.record("empty", 0, 0)
    return completed(flat, flat.device)


# --------------------------------------------------------------------------------------
# Sparsification: top-k and random-k
#
# Both issue their collectives (one, or one per piece) from the hook itself: every rank's
# top-k payload has the same size (exactly k entries), and random-k indices agree across
# ranks by construction. So the collective order is the bucket order in which the hook is
# called, and no sequencer is needed.
# --------------------------------------------------------------------------------------


def _bucket_int(key) -> int:
    """An int64 naming the bucket, for the kernels' RNG keys: the key itself, or a stable
    digest of it (the same on every rank and in every process)."""
    if isinstance(key, int):
        return key
    digest = hashlib.sha256(repr(("key", key)).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def _fp32_scratch(ctx: ReduceContext, flat: torch.Tensor) -> torch.Tensor | None:
    """A reused fp32 buffer of flat's size for the dense switch's sum of a 16-bit bucket
    (None for fp32: the sum is formed in ``flat`` itself)."""
    if flat.dtype == torch.float32:
        return None
    return ctx.buffer("fp32_sum", 4 * flat.numel(), flat.device).view(torch.float32)


def _topk(flat: torch.Tensor, c: TopK, ctx: ReduceContext) -> Future:
    pg, n = ctx.pg, flat.numel()
    if n == 0:
        return _empty(flat, ctx)
    world = dist.get_world_size(pg)
    k, vdtype = c.k(n), c.value_dtype
    dense_eq = dense_bytes(n, world, flat.element_size())
    residual = ctx.residual("topk", n, flat.device) if c.error_feedback else None
    packed = ctx.buffer("send", c.payload_bytes(n), flat.device)
    with ctx.stats.timer():
        # The sample seed only matters in approximate mode; per bucket so buckets differ.
        ops.topk_compress(
            flat, residual, k, c.approximate, _stream_seed(0, ctx.key), ctx.step, vdtype, out=packed
        )
    sent = c.wire_bytes(n, world)

    if c.use_dense(n, world):
        # Dense switch: this rank's sparsified tensor in fp32, summed by all_reduce. The same
        # numbers as the sparse path up to the order gloo/NCCL add the N terms in.
        scratch = _fp32_scratch(ctx, flat)
        total = flat if scratch is None else scratch
        with ctx.stats.timer():
            ops.sparse_accumulate(
                packed.view(1, -1), n, k, 1, vdtype, torch.float32, out=total, check=False
            )
        ctx.stats.record("topk_dense", sent, dense_eq)
        work = dist.all_reduce(total, group=pg, async_op=True)

        def decode_dense(fut):
            fut.wait()
            with ctx.stats.timer():
                # Every rank holds the same sum, so all agree on resetting.
                if residual is not None:
                    ctx.reset_unless(torch.isfinite(total).all())
                total.div_(ops.divisor(world, total))
                if scratch is not None:
                    flat.copy_(total)
            return flat

        return then(work.get_future(), decode_dense)

    size = packed.numel()
    gathered = ctx.buffer("gather", world * size, flat.device)
    ctx.stats.record("topk_all_gather", sent, dense_eq)
    # Selection is global (per-piece top-k would pick other entries), so the payload is
    # sent in byte pieces only, for gloo's line rate, and each piece's rows are copied into
    # place as they land; the sum then adds whole rows in rank order, as with one piece.
    link = _gloo_link(ctx)
    spans = _pieces(size, 1, n * flat.element_size(), pg, link)
    rows = gathered.view(world, size)
    if len(spans) > 1:
        rows = ctx.buffer("rows", world * size, flat.device).view(world, size)

    def land(i, piece):
        if len(spans) == 1:
            return None  # decoded in place from the gathered rows
        b0, b1 = spans[i]
        return rows[:, b0:b1].copy_(piece)

    futures = _gather_pieces(packed, gathered, spans, pg, lambda i: None, land, link)

    def decode(fut):
        fut.wait()
        with ctx.stats.timer():
            ops.sparse_accumulate(rows, n, k, world, vdtype, flat.dtype, out=flat, check=False)
            # NaN/Inf rank above every finite magnitude, so a non-finite bucket always sends
            # one: every rank sees it in the gathered rows and resets the same residual.
            if residual is not None:
                values = rows[:, 4 * k :].contiguous().view(vdtype)
                ctx.reset_unless(torch.isfinite(values).all())
        return flat

    return then(join(futures, flat, flat.device), decode)


def _randk(flat: torch.Tensor, c: RandomK, ctx: ReduceContext) -> Future:
    pg, n = ctx.pg, flat.numel()
    if n == 0:
        return _empty(flat, ctx)
    world = dist.get_world_size(pg)
    k, bucket = c.k(n), _bucket_int(ctx.key)
    residual = ctx.residual("randk", n, flat.device) if c.error_feedback else None
    # fp32 values on the wire keep the accumulation in fp32 whatever the bucket dtype.
    values = ctx.buffer("values", 4 * k, flat.device).view(torch.float32)
    ctx.stats.record(
        "randk_all_reduce", c.wire_bytes(n, world), dense_bytes(n, world, flat.element_size())
    )
    compress = functools.partial(
        ops.randk_compress, flat, residual, k, c.seed, ctx.step, bucket, out=values
    )
    decompress = functools.partial(
        ops.randk_decompress, values, n, c.seed, ctx.step, bucket, world, flat.dtype, out=flat
    )
    # In pieces on gloo, for its line rate, at two ranks only: there a sum of two values is
    # the same whichever all_reduce carries them, while at more ranks the order gloo adds
    # the ranks in may depend on how the buffer is split, so one all_reduce keeps its bits.
    spans = _pieces(k, 4, n * flat.element_size(), pg) if world == 2 else [(0, k)]
    if len(spans) > 1 and not flat.is_cuda:
        return _randk_pipelined(flat, values, residual, spans, compress, decompress, ctx)
    with ctx.stats.timer():
        compress()
    futures = [
        dist.all_reduce(values[v0:v1], group=pg, async_op=True).get_future() for v0, v1 in spans
    ]

    def decode(fut):
        fut.wait()
        with ctx.stats.timer():
            decompress()
            # A non-finite entry anywhere makes its rank send NaN values (randk_compress).
            if residual is not None:
                ctx.reset_unless(torch.isfinite(values).all())
        return flat

    return then(join(futures, values, flat.device), decode)


def _randk_pipelined(flat, values, residual, spans, compress, decompress, ctx) -> Future:
    """Random-k in pieces of strata: piece i is compressed, then all-reduced while piece
    i + 1 is compressed, and decoded into its own slice of ``flat`` as it lands (strata are
    contiguous ranges of the bucket, so compressing piece i + 1 and decoding piece i touch
    disjoint elements). Per stratum these are the bits of one call over the bucket
    (reference.randk_compress), but a non-finite entry now poisons only the values of its
    own piece: once every piece has landed, a NaN among the sums (which at two ranks only a
    rank's non-finite input makes; finite sums overflow to Inf, never NaN) is spread over
    every value as one call would have, so the result and the residual reset are bitwise
    those of the whole bucket in one piece. The host branch is why GPU buckets (NCCL sends
    one piece anyway) take the whole-bucket path.

    Between two gloo ranks on a 1 Gbit/s link (64 MiB fp32, randk:0.01, 1 thread each,
    medians of 21 calls in four runs taking turns with the whole-bucket path, on a 2-core
    machine loaded 1.8-2.8 by other work): 20.6 ms a call against 26.1 (wire alone 8 ms,
    compress + decode alone 10-17). More pieces did not pay: 8 and 16 all_reduces of the
    same 671 KB took 28-31 and 33-42 ms a call against 21-23 for 4 (same conditions), and
    gloo's all_reduce of 8 pieces alone 8.2-8.9 ms against 5.3-5.5 for 4."""
    pg = ctx.pg

    def land(v0, v1, fut):
        fut.wait()
        with ctx.stats.timer():
            decompress(start=v0, end=v1)
        return flat

    futures = []
    for v0, v1 in spans:
        with ctx.stats.timer():
            compress(start=v0, end=v1)
        work = dist.all_reduce(values[v0:v1], group=pg, async_op=True)
        futures.append(then(work.get_future(), functools.partial(land, v0, v1)))

    def finish(fut):
        fut.wait()
        with ctx.stats.timer():
            if bool(torch.isnan(values).any()):
                values.fill_(float("nan"))
                decompress()
            if residual is not None:
                ctx.reset_unless(torch.isfinite(values).all())
        return flat

    return then(join(futures, flat, flat.device), finish)
