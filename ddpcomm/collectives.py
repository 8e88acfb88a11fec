"""All-reduce algorithms built on torch.distributed collectives.

Every algorithm takes a flat 1-D tensor, returns a ``torch.futures.Future`` of the mean
over ranks in the tensor's dtype, and gives every rank bitwise the same result. Nothing
here knows about DDP: hooks.py adapts buckets to these functions.

Collective order. gloo and NCCL pair collectives by the order each rank issues them on a
process group, while ``Future.then`` callbacks run in whatever order collectives finish,
which differs across ranks. The two-phase quantized algorithm therefore issues its second
collective on a companion process group, strictly in the order the first phases were
issued (a ticket taken when phase 1 is issued), through one ``_Sequencer`` per group.
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

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

Future = torch.futures.Future

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; older releases have only
# the former. Same collective either way.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --------------------------------------------------------------------------------------
# Bookkeeping: stats and per-bucket memory
# --------------------------------------------------------------------------------------


class Stats:
    """What compression bought: bytes handed to collectives vs a plain all_reduce.

    ``bytes_sent`` counts the bytes this rank puts on the wire, as a ring schedule would
    send them: 2(N-1)/N*S for an all_reduce of S bytes, (N-1)*S for an all_gather of S
    bytes per rank, the bytes addressed to other ranks for an all_to_all.
    ``dense_bytes`` is what a plain all_reduce of the same tensors would have sent.
    ``compress_seconds`` is host time spent in (de)compression ops (on CUDA, launch
    time: kernels run asynchronously on the stream).
    """

    __slots__ = ("bytes_sent", "dense_bytes", "compress_seconds", "calls", "paths", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.bytes_sent = 0
        self.dense_bytes = 0
        self.compress_seconds = 0.0
        self.calls = 0
        self.paths: Counter[str] = Counter()

    def record(self, path: str, sent: int, dense: int) -> None:
        with self._lock:
            self.calls += 1
            self.bytes_sent += sent
            self.dense_bytes += dense
            self.paths[path] += 1

    def add_time(self, seconds: float) -> None:
        with self._lock:
            self.compress_seconds += seconds

    def as_dict(self) -> dict:
        with self._lock:
            ratio = self.dense_bytes / self.bytes_sent if self.bytes_sent else float("nan")
            return {
                "calls": self.calls,
                "bytes_sent": self.bytes_sent,
                "dense_bytes": self.dense_bytes,
                "compression_ratio": ratio,
                "compress_seconds": self.compress_seconds,
                "paths": dict(self.paths),
            }


class _Timer:
    def __init__(self, stats: Stats | None) -> None:
        self.stats = stats

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.stats is not None:
            self.stats.add_time(time.perf_counter() - self.t0)


class ResidualMemory:
    """fp32 error-feedback buffers keyed by (kind, bucket key).

    A buffer is handed out zeroed when first asked for, and again whenever the bucket's
    numel or signature changes: DDP rebuilds its buckets after the first iteration, and a
    residual laid out for the old bucket would add errors to the wrong parameters.
    """

    __slots__ = ("buffers", "signatures")

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.signatures: dict[tuple, object] = {}

    def get(self, kind: str, key, numel: int, device, signature=None) -> torch.Tensor:
        k = (kind, key)
        buf = self.buffers.get(k)
        if (
            buf is None
            or buf.numel() != numel
            or buf.device != torch.device(device)
            or (self.signatures.get(k) != signature)
        ):
            buf = torch.zeros(numel, dtype=torch.float32, device=device)
            self.buffers[k] = buf
            self.signatures[k] = signature
        return buf

    def reset(self, key) -> None:
        """Zeroes every buffer of one bucket (after a non-finite step)."""
        for (_, k), buf in self.buffers.items():
            if k == key:
                buf.zero_()

    def state_dict(self) -> dict:
        return {
            "buffers": {k: v.detach().cpu().clone() for k, v in self.buffers.items()},
            "signatures": dict(self.signatures),
        }

    def load_state_dict(self, sd: dict) -> None:
        self.buffers = {k: v.clone() for k, v in sd["buffers"].items()}
        self.signatures = dict(sd["signatures"])


class Workspace:
    """Reusable uint8 buffers keyed by (name, bucket key).

    A fresh multi-megabyte tensor costs more in first-touch page faults than the kernel
    that fills it, so payload buffers live as long as their bucket. A key's buffers are
    reused by its next call: callers must not overlap two calls with the same key (DDP
    never does: a bucket's next reduction starts after its previous one finished).
    """

    __slots__ = ("buffers",)

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, key, nbytes: int, device) -> torch.Tensor:
        buf = self.buffers.get((name, key))
        if buf is None or buf.numel() != nbytes or buf.device != torch.device(device):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.buffers[(name, key)] = buf
        return buf


@dataclass
class ReduceContext:
    """Everything an algorithm needs beyond the tensor and the method."""

    group: dist.ProcessGroup | None = None
    memory: ResidualMemory | None = None
    key: object = 0
    step: int = 0
    signature: object = None
    stats: Stats = field(default_factory=Stats)
    workspace: Workspace | None = None

    @property
    def pg(self) -> dist.ProcessGroup:
        return self.group if self.group is not None else dist.group.WORLD

    def buffer(self, name: str, nbytes: int, device) -> torch.Tensor:
        """A uint8 scratch buffer: the workspace's for this key, or a new one."""
        if self.workspace is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.workspace.get(name, self.key, nbytes, device)

    def residual(self, kind: str, numel: int, device) -> torch.Tensor:
        if self.memory is None:
            raise ValueError("error feedback needs a ResidualMemory in the ReduceContext")
        return self.memory.get(kind, self.key, numel, device, self.signature)


# --------------------------------------------------------------------------------------
# Configuration agreement
# --------------------------------------------------------------------------------------


def _fingerprint(config: tuple) -> int:
    digest = hashlib.sha256(repr(config).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def verify_config(config: tuple, numel: int, group: dist.ProcessGroup | None, device) -> None:
    """Raises ValueError on every rank when ranks disagree on ``config`` or ``numel``.

    One small blocking all_gather; callers run it once, at their first compressed step,
    so a mismatch is a clear error everywhere instead of a hang or silent garbage.
    """
    pg = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(pg)
    mine = torch.tensor([_fingerprint(config), numel], dtype=torch.int64, device=device)
    every = torch.empty(world * 2, dtype=torch.int64, device=device)
    _all_gather_single(every, mine, group=pg)
    every = every.view(world, 2).cpu()
    if not bool((every == every[0]).all()):
        rows = [
            f"rank {r}: config {int(every[r, 0]):#x}, numel {int(every[r, 1])}"
            for r in range(world)
        ]
        raise ValueError(
            "ddpcomm: ranks disagree on the compression configuration or bucket size "
            f"(this rank: {config}, numel {numel}); " + "; ".join(rows)
        )


# --------------------------------------------------------------------------------------
# Collective-order sequencer for second-phase collectives
# --------------------------------------------------------------------------------------


class _Sequencer:
    """Issues second-phase collectives on a companion group in ticket order."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        ranks = dist.get_process_group_ranks(group)
        # Only members call this, at their first two-phase step, in the same order.
        self.companion = dist.new_group(ranks, use_local_synchronization=True)
        self._lock = threading.Lock()
        self._next_ticket = 0
        self._next_to_run = 0
        self._ready: dict[int, Callable[[], None]] = {}

    def ticket(self) -> int:
        """Taken on the issuing thread, right after the first phase is issued."""
        with self._lock:
            t = self._next_ticket
            self._next_ticket += 1
            return t

    def submit(self, ticket: int, issue: Callable[[], None]) -> None:
        """Runs ``issue`` once every earlier ticket's has run; never blocks on the network."""
        with self._lock:
            self._ready[ticket] = issue
            while self._next_to_run in self._ready:
                fn = self._ready.pop(self._next_to_run)
                self._next_to_run += 1
                fn()


_SEQUENCERS: dict[dist.ProcessGroup, _Sequencer] = {}
_SEQUENCERS_LOCK = threading.Lock()


def _sequencer(group: dist.ProcessGroup) -> _Sequencer:
    with _SEQUENCERS_LOCK:
        seq = _SEQUENCERS.get(group)
        if seq is None:
            seq = _SEQUENCERS[group] = _Sequencer(group)
        return seq


# --------------------------------------------------------------------------------------
# Algorithms
# --------------------------------------------------------------------------------------

_ALGORITHMS: dict[type, Callable[[torch.Tensor, Compressor, ReduceContext], Future]] = {}


def register_algorithm(cls: type, fn: Callable[[torch.Tensor, Compressor, ReduceContext], Future]):
    """Makes ``all_reduce_mean`` run ``fn`` for compressors of class ``cls``."""
    _ALGORITHMS[cls] = fn


def all_reduce_mean(flat: torch.Tensor, compressor: Compressor, ctx: ReduceContext) -> Future:
    """Mean over the ranks of ``ctx.group`` of the 1-D tensor ``flat``, compressed.

    ``flat`` is overwritten: the Future's value is a tensor of ``flat``'s dtype and size
    (``flat`` itself, or for casts a new tensor), bitwise identical on every rank.
    """
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("all_reduce_mean takes a contiguous 1-D tensor")
    compressor.check_tensor(flat, "tensor")
    fn = _ALGORITHMS.get(type(compressor))
    if fn is None:
        raise TypeError(f"no all-reduce algorithm registered for {type(compressor).__name__}")
    return fn(flat, compressor, ctx)


def _plain(flat: torch.Tensor, _: Compressor, ctx: ReduceContext) -> Future:
    world = dist.get_world_size(ctx.pg)
    # Scale by 1/N before the sum, exactly as DDP's reducer does when it copies gradients
    # into a bucket (multiplying by the reciprocal, not dividing): the lossless path is
    # then bitwise DDP's default, and fp16 buckets do not overflow in the sum.
    flat.mul_(1.0 / world)
    ctx.stats.record(
        "plain",
        dense_bytes(flat.numel(), world, flat.element_size()),
        dense_bytes(flat.numel(), world, flat.element_size()),
    )
    work = dist.all_reduce(flat, group=ctx.pg, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def plain_all_reduce(flat: torch.Tensor, ctx: ReduceContext) -> Future:
    """The lossless path: all_reduce of ``flat * (1/N)``, bitwise DDP's default."""
    return _plain(flat, NoCompression(), ctx)


def _cast(flat: torch.Tensor, c: CastCompression, ctx: ReduceContext) -> Future:
    world = dist.get_world_size(ctx.pg)
    with _Timer(ctx.stats):
        wire = flat.to(c.dtype).div_(world)
    ctx.stats.record(
        c.spec,
        dense_bytes(flat.numel(), world, 2),
        dense_bytes(flat.numel(), world, flat.element_size()),
    )
    work = dist.all_reduce(wire, group=ctx.pg, async_op=True)

    def decode(fut):
        with _Timer(ctx.stats):
            return fut.value()[0].to(flat.dtype)

    return work.get_future().then(decode)


def _stream_seed(seed: int, key) -> int:
    """Per-bucket seed, so buckets draw independent stochastic roundings."""
    k = key if isinstance(key, int) else _fingerprint(("key", key))
    return (seed * 0x9E3779B1 + (k & 0xFFFFFFFF)) & (2**63 - 1)


def _blocks_finite(payload: torch.Tensor, records: int, record_bytes: int) -> bool:
    """Whether every block magnitude in the first ``records`` records is finite."""
    if records == 0:
        return True
    m = payload[: records * record_bytes].view(records, record_bytes)[:, :4]
    return bool(torch.isfinite(m.contiguous().view(torch.float32)).all())


# gloo moves one large all_gather between two ranks at ~80 MB/s on a 1 Gbit/s link (119
# MB/s line rate), while several smaller all_gathers in flight at once reach line rate
# (benchmarks/chunked_allgather.py: q8 at 64 MiB, 2 ranks, went from 2.14x to 3.03x the
# plain all_reduce). Pieces also let decoding start before the last bytes arrive.
_GLOO_PIECE_BYTES = 2 << 20
_GLOO_MAX_PIECES = 16


def _pieces(records: int, record_bytes: int, group: dist.ProcessGroup) -> list[tuple[int, int]]:
    """Record ranges [r0, r1) to all_gather separately: several on gloo, one on NCCL."""
    count = 1
    if dist.get_backend(group) == "gloo":
        count = min(_GLOO_MAX_PIECES, max(1, records * record_bytes // _GLOO_PIECE_BYTES))
    count = max(1, min(count, records))
    return [(records * i // count, records * (i + 1) // count) for i in range(count)]


def _quantized_all_gather(flat: torch.Tensor, q: Quantizer, ctx: ReduceContext) -> Future:
    pg, n = ctx.pg, flat.numel()
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    residual = ctx.residual("q", n, flat.device) if q.error_feedback else None
    seed = _stream_seed(q.seed, ctx.key)
    size = q.payload_bytes(n)
    block, rec = q.block_size, 4 + q.block_size * q.bits // 8
    records = math.ceil(n / block)
    packed = ctx.buffer("send", size, flat.device)
    gathered = ctx.buffer("gather", world * size, flat.device)
    ctx.stats.record("q_all_gather", (world - 1) * size, dense_bytes(n, world, flat.element_size()))

    # Records are whole blocks, so each piece is quantized on its own (same bytes as the
    # whole tensor: blocks are independent and RNG counters are element indices) and sent
    # at once, letting the wire start after the first piece; its gathered rows are N
    # payloads of its element range and decode straight into that slice of `flat`.
    futures = []
    for r0, r1 in _pieces(records, rec, pg):
        e0, e1 = r0 * block, min(r1 * block, n)
        send = packed[r0 * rec : r1 * rec]
        with _Timer(ctx.stats):
            ops.quantize(
                flat[e0:e1],
                None if residual is None else residual[e0:e1],
                q.bits,
                block,
                q.stochastic,
                seed,
                ctx.step,
                rank * n + e0,
                out=send,
            )
        piece = gathered[world * r0 * rec : world * r1 * rec]
        work = _all_gather_single(piece, send, group=pg, async_op=True)
        out_rows = piece.view(world, (r1 - r0) * rec)

        def decode(fut, out_rows=out_rows, e0=e0, e1=e1):
            fut.wait()
            with _Timer(ctx.stats):
                ops.dequantize_sum(
                    out_rows, e1 - e0, q.bits, block, world, flat.dtype, out=flat[e0:e1]
                )

        futures.append(work.get_future().then(decode))

    def finish(fut):
        for f in fut.value():
            f.wait()  # re-raises a piece's failure
        # Every rank sees every payload, so all agree on whether the step was finite.
        if residual is not None and not _blocks_finite(gathered, world * records, rec):
            ctx.memory.reset(ctx.key)
        return flat

    if not futures:  # an empty tensor: nothing to send
        done: Future = Future()
        done.set_result(flat)
        return done
    return torch.futures.collect_all(futures).then(finish)


def _quantized_two_phase(flat: torch.Tensor, q: Quantizer, ctx: ReduceContext) -> Future:
    pg, n = ctx.pg, flat.numel()
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    bits, block = q.bits, q.block_size
    chunk = q.chunk_numel(n, world)  # elements per rank, whole blocks
    rec = 4 + block * bits // 8
    per_chunk = chunk // block  # records per chunk
    records = math.ceil(n / block)
    # Phase 1 sends the payload of the unpadded tensor: the trailing chunks may be short.
    splits = [
        (min(records, (i + 1) * per_chunk) - min(records, i * per_chunk)) * rec
        for i in range(world)
    ]
    mine = splits[rank]
    my_numel = max(0, min(n, (rank + 1) * chunk) - rank * chunk)
    chunk_bytes = per_chunk * rec

    seq = _sequencer(pg)
    seed = _stream_seed(q.seed, ctx.key)
    # Disjoint counter ranges for every (rank, phase) so no two roundings share a draw.
    stride = 2 * world * chunk
    residual = ctx.residual("q", n, flat.device) if q.error_feedback else None
    owner_residual = ctx.residual("q_owner", my_numel, flat.device) if q.error_feedback else None
    packed = ctx.buffer("send", records * rec, flat.device)
    with _Timer(ctx.stats):
        ops.quantize(
            flat, residual, bits, block, q.stochastic, seed, ctx.step, rank * stride, out=packed
        )
    received = ctx.buffer("receive", world * mine, flat.device)
    ctx.stats.record(
        "q_two_phase",
        sum(splits) - mine + (world - 1) * chunk_bytes,
        dense_bytes(n, world, flat.element_size()),
    )
    work = dist.all_to_all_single(received, packed, [mine] * world, splits, group=pg, async_op=True)
    ticket = seq.ticket()
    result: Future = Future()
    gathered = ctx.buffer("gather", world * chunk_bytes, flat.device)
    send = ctx.buffer("send2", chunk_bytes, flat.device)

    def finish(fut):
        try:
            fut.wait()
            with _Timer(ctx.stats):
                out = ops.dequantize(gathered, n, bits, block, flat.dtype, out=flat)
                if q.error_feedback and not _blocks_finite(gathered, world * per_chunk, rec):
                    ctx.memory.reset(ctx.key)
            result.set_result(out)
        except Exception as exc:  # noqa: BLE001 - handed to the waiter, not swallowed
            result.set_exception(exc)

    def owner_step(fut):
        error = None
        try:
            fut.wait()
            with _Timer(ctx.stats):
                reduced = ops.dequantize_sum_requantize(
                    received.view(world, mine),
                    owner_residual,
                    my_numel,
                    bits,
                    block,
                    world,
                    q.stochastic,
                    seed,
                    ctx.step,
                    rank * stride + world * chunk + rank * chunk,
                )
            send[: reduced.numel()] = reduced
            send[reduced.numel() :] = 0  # short trailing chunks: zero records, never read
        except Exception as exc:  # noqa: BLE001
            # Still take part in phase 2 so no peer hangs; all-ones bytes make NaN
            # magnitudes, so every rank's result is non-finite, and this rank raises.
            send.fill_(0xFF)
            error = exc

        def issue():
            w2 = _all_gather_single(gathered, send, group=seq.companion, async_op=True)
            if error is not None:
                w2.get_future().then(lambda _: result.set_exception(error))
            else:
                w2.get_future().then(finish)

        seq.submit(ticket, issue)

    work.get_future().then(owner_step)
    return result


def _quantized(flat: torch.Tensor, q: Quantizer, ctx: ReduceContext) -> Future:
    if q.resolve_algorithm(dist.get_world_size(ctx.pg)) == "all_gather":
        return _quantized_all_gather(flat, q, ctx)
    return _quantized_two_phase(flat, q, ctx)


register_algorithm(NoCompression, _plain)
register_algorithm(CastCompression, _cast)
register_algorithm(Quantizer, _quantized)


# --------------------------------------------------------------------------------------
# Sparsification: top-k and random-k
#
# Both take one collective per bucket: every rank's top-k payload has the same size (exactly
# k entries), and random-k indices agree across ranks by construction. So the collective
# order is the bucket order in which the hook is called, and no sequencer is needed.
# --------------------------------------------------------------------------------------


def _bucket_int(key) -> int:
    """An int64 naming the bucket, for the kernels' RNG keys."""
    return key if isinstance(key, int) else _fingerprint(("key", key))


def _sparse_values_finite(rows: torch.Tensor, k: int, value_dtype: torch.dtype) -> bool:
    values = rows[:, 4 * k :].contiguous().view(value_dtype)
    return bool(torch.isfinite(values).all())


def _fp32_scratch(ctx: ReduceContext, flat: torch.Tensor) -> torch.Tensor | None:
    """A reused fp32 buffer of flat's size for sums of a 16-bit bucket (None for fp32:
    the sum is formed in ``flat`` itself)."""
    if flat.dtype == torch.float32:
        return None
    return ctx.buffer("fp32_sum", 4 * flat.numel(), flat.device).view(torch.float32)


def _empty(flat: torch.Tensor, ctx: ReduceContext) -> Future:
    """Nothing to select from: no collective (every rank has the same numel), mean of none."""
    ctx.stats.record("empty", 0, 0)
    fut: Future = Future()
    fut.set_result(flat)
    return fut


def _topk(flat: torch.Tensor, c: TopK, ctx: ReduceContext) -> Future:
    pg, n = ctx.pg, flat.numel()
    if n == 0:
        return _empty(flat, ctx)
    world = dist.get_world_size(pg)
    k, vdtype = c.k(n), c.value_dtype
    dense_eq = dense_bytes(n, world, flat.element_size())
    residual = ctx.residual("topk", n, flat.device) if c.error_feedback else None
    packed = ctx.buffer("send", c.payload_bytes(n), flat.device)
    with _Timer(ctx.stats):
        # The sample seed only matters in approximate mode; per bucket so buckets differ.
        ops.topk_compress(
            flat, residual, k, c.approximate, _stream_seed(0, ctx.key), ctx.step, vdtype, out=packed
        )
    scratch = _fp32_scratch(ctx, flat)

    if c.use_dense(n, world):
        # Dense switch: this rank's sparsified tensor in fp32, summed by all_reduce. The same
        # numbers as the sparse path up to the order gloo/NCCL add the N terms in.
        total = flat if scratch is None else scratch
        with _Timer(ctx.stats):
            ops.sparse_accumulate(packed.view(1, -1), n, k, 1, vdtype, torch.float32, out=total)
        ctx.stats.record("topk_dense", dense_bytes(n, world, 4), dense_eq)
        work = dist.all_reduce(total, group=pg, async_op=True)

        def decode_dense(fut):
            fut.wait()
            with _Timer(ctx.stats):
                # Every rank holds the same sum, so all agree on resetting.
                finite = bool(torch.isfinite(total).all())
                total.div_(world)
                if scratch is not None:
                    flat.copy_(total)
                if residual is not None and not finite:
                    ctx.memory.reset(ctx.key)
            return flat

        return work.get_future().then(decode_dense)

    size = packed.numel()
    gathered = ctx.buffer("gather", world * size, flat.device)
    ctx.stats.record("topk_all_gather", (world - 1) * size, dense_eq)
    work = _all_gather_single(gathered, packed, group=pg, async_op=True)

    def decode(fut):
        fut.wait()
        with _Timer(ctx.stats):
            rows = gathered.view(world, size)
            ops.sparse_accumulate(rows, n, k, world, vdtype, flat.dtype, out=flat, scratch=scratch)
            # NaN/Inf rank above every finite magnitude, so a non-finite bucket always sends
            # one: every rank sees it in the gathered rows and resets the same residual.
            if residual is not None and not _sparse_values_finite(rows, k, vdtype):
                ctx.memory.reset(ctx.key)
        return flat

    return work.get_future().then(decode)


def _randk(flat: torch.Tensor, c: RandomK, ctx: ReduceContext) -> Future:
    pg, n = ctx.pg, flat.numel()
    if n == 0:
        return _empty(flat, ctx)
    world = dist.get_world_size(pg)
    k, bucket = c.k(n), _bucket_int(ctx.key)
    residual = ctx.residual("randk", n, flat.device) if c.error_feedback else None
    with _Timer(ctx.stats):
        values = ops.randk_compress(flat, residual, k, c.seed, ctx.step, bucket)
    # fp32 values on the wire keep the accumulation in fp32 whatever the bucket dtype.
    ctx.stats.record(
        "randk_all_reduce", dense_bytes(k, world, 4), dense_bytes(n, world, flat.element_size())
    )
    work = dist.all_reduce(values, group=pg, async_op=True)

    def decode(fut):
        with _Timer(ctx.stats):
            total = fut.value()[0]
            ops.randk_decompress(total, n, c.seed, ctx.step, bucket, world, flat.dtype, out=flat)
            # A non-finite entry anywhere makes its rank send NaN values (randk_compress).
            if residual is not None and not bool(torch.isfinite(total).all()):
                ctx.memory.reset(ctx.key)
        return flat

    return work.get_future().then(decode)


register_algorithm(TopK, _topk)
register_algorithm(RandomK, _randk)
