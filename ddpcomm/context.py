"""What the all-reduce algorithms keep between calls.

``collectives.py`` holds the algorithms; this module holds their bookkeeping, so the
algorithms read top-down:

- ``Stats``: bytes sent against a plain all_reduce, compression time, paths taken.
- ``ResidualMemory``: the fp32 error-feedback residuals of each bucket.
- ``Workspace``: reused payload buffers (a fresh multi-megabyte tensor per call costs more
  in first-touch page faults than the kernel that fills it), and each bucket's
  ``LinkRate``: the rate its gloo all-gathers measured, agreed across ranks.
- ``WorkspacePool``: the Workspaces of one-off calls (``ddpcomm.all_reduce``), by the
  call's signature, bounded.
- ``ReduceContext``: one call's group, bucket key, step and the three above.

Futures live in ``futures.py``, process-group ordering in ``groups.py``.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections import Counter, OrderedDict

import torch
import torch.distributed as dist

from ddpcomm.node_memory import Segment

# The residual kinds and buffer names of a two-level reduction's cross-node step start
# with this (ReduceContext.across).
SHARD = "shard:"

# --------------------------------------------------------------------------------------
# Stats and per-bucket memory
# --------------------------------------------------------------------------------------


class Stats:
    """What compression bought: bytes handed to collectives vs a plain all_reduce.

    ``bytes_sent`` counts the bytes this rank puts on the wire, as a ring schedule would
    send them: 2(N-1)/N*S for an all_reduce of S bytes, (N-1)*S for an all_gather of S
    bytes per rank, the bytes addressed to other ranks for an all_to_all (each method's
    ``Compressor.wire_bytes`` is the one formula). ``dense_bytes`` is what a plain
    all_reduce of the same tensors would have sent. ``compress_seconds`` is host time spent
    in (de)compression ops (on CUDA, launch time: kernels run asynchronously).

    Across nodes (a hook state or call with a ``hierarchy`` of N nodes of L ranks, P = NL):
    ``intra_node_bytes`` and ``cross_node_bytes`` split ``bytes_sent`` into what this rank
    sends inside its node and to other nodes, ``cross_node_dense_bytes`` is what a plain,
    flat all_reduce of the same tensors would send across nodes, and ``compression_ratio``
    becomes ``cross_node_dense_bytes / cross_node_bytes``: what the slow link gained. With
    ranks numbered node by node, a flat ring all_reduce of S bytes has every rank send
    D = 2(P-1)/P*S to the next rank of the ring, and N of the ring's P links join a node
    to the next (each node's last rank sends to the next node's first): D bytes leave
    every node, D/L per rank, and D(L-1)/L per rank stay inside. A flat collective under
    a hierarchy (warm-up, small or sparse buckets) is split that way. A two-level
    reduction sends 2(L-1)/L*S' inside its node (the reduce-scatter and the all-gather,
    ring schedules; S' is S padded to L equal shards) and across nodes what its method
    sends for its shard of about S/L over N ranks; ``intra_node_shared_bytes`` is the
    part of ``intra_node_bytes`` that went through shared memory (``node_memory``) instead
    of the backend. So ``none`` two-level has the ratio
    (P-1)/P / ((N-1)/N) (1.5 at 2 nodes of 2 ranks: each node's shards cross with
    2(N-1)/N*S in all, the ring's one link with 2(P-1)/P*S), and a compressing method
    about that times its own ratio on the shard.
    """

    __slots__ = (
        "bytes_sent",
        "dense_bytes",
        "compress_seconds",
        "calls",
        "paths",
        "intra_node_bytes",
        "cross_node_bytes",
        "cross_node_dense_bytes",
        "intra_node_shared_bytes",
        "nodes",
        "_lock",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.bytes_sent = 0
        self.dense_bytes = 0
        self.compress_seconds = 0.0
        self.calls = 0
        self.paths: Counter[str] = Counter()
        self.intra_node_bytes = 0
        self.cross_node_bytes = 0
        self.cross_node_dense_bytes = 0
        self.intra_node_shared_bytes = 0
        self.nodes = False  # whether anything was counted per node since the reset

    def record(self, path: str, sent: int, dense: int) -> None:
        with self._lock:
            self.calls += 1
            self.bytes_sent += sent
            self.dense_bytes += dense
            self.paths[path] += 1

    def record_two_level(self, intra: int, dense: int, cross_dense: int, shared: bool) -> None:
        """One two-level reduction: its steps inside the node (through shared memory or
        not), and what a flat all_reduce would send in all and across nodes. Its
        cross-node step records through ``across()``."""
        with self._lock:
            self.calls += 1
            self.paths["two_level"] += 1
            self.bytes_sent += intra
            self.dense_bytes += dense
            self.intra_node_bytes += intra
            self.intra_node_shared_bytes += intra if shared else 0
            self.cross_node_dense_bytes += cross_dense
            self.nodes = True

    def across(self) -> _Part:
        """What the cross-node step of a two-level reduction records into."""
        return _Part(self, across=True)

    def overhead(self, path: str) -> _Part:
        """What a collective serving a call (not standing for a plain all_reduce of its
        own) records into, under ``path``: normalize's scale refresh."""
        return _Part(self, path=path)

    def flat_over(self, local_size: int) -> _FlatOverNodes:
        """What a flat collective over nodes of ``local_size`` ranks records into."""
        return _FlatOverNodes(self, local_size)

    def timer(self) -> _Timer:
        """``with stats.timer(): ...`` adds the block's host time to compress_seconds."""
        return _Timer(self)

    def as_dict(self) -> dict:
        with self._lock:
            if self.nodes:
                sent, dense = self.cross_node_bytes, self.cross_node_dense_bytes
            else:
                sent, dense = self.bytes_sent, self.dense_bytes
            d = {
                "calls": self.calls,
                "bytes_sent": self.bytes_sent,
                "dense_bytes": self.dense_bytes,
                "compression_ratio": dense / sent if sent else float("nan"),
                "compress_seconds": self.compress_seconds,
                "paths": dict(self.paths),
            }
            if self.nodes:
                d["intra_node_bytes"] = self.intra_node_bytes
                d["cross_node_bytes"] = self.cross_node_bytes
                d["cross_node_dense_bytes"] = self.cross_node_dense_bytes
                d["intra_node_shared_bytes"] = self.intra_node_shared_bytes
            return d


class _Part:
    """``Stats`` as a collective that is part of a counted call sees it: its path and
    bytes count; the call and the plain all_reduce it stands for were counted by the
    call. The cross-node step of a two-level reduction (``across``: all its bytes cross
    nodes), or an overhead under a path of its own (``path``)."""

    __slots__ = ("stats", "across", "path")

    def __init__(self, stats: Stats, across: bool = False, path: str | None = None) -> None:
        self.stats = stats
        self.across = across
        self.path = path

    def record(self, path: str, sent: int, dense: int) -> None:
        s = self.stats
        with s._lock:
            s.paths[self.path or path] += 1
            s.bytes_sent += sent
            if self.across:
                s.cross_node_bytes += sent
                s.nodes = True

    def timer(self) -> _Timer:
        return self.stats.timer()


class _FlatOverNodes:
    """``Stats`` for a flat collective over nodes of L ranks: counted as it is, and split
    into the shares that cross nodes by the ring model of ``Stats``' docstring."""

    __slots__ = ("stats", "local_size")

    def __init__(self, stats: Stats, local_size: int) -> None:
        self.stats = stats
        self.local_size = local_size

    def record(self, path: str, sent: int, dense: int) -> None:
        s = self.stats
        s.record(path, sent, dense)
        with s._lock:
            s.cross_node_bytes += sent // self.local_size
            s.intra_node_bytes += sent - sent // self.local_size
            s.cross_node_dense_bytes += dense // self.local_size
            s.nodes = True

    def timer(self) -> _Timer:
        return self.stats.timer()


class _Timer:
    __slots__ = ("stats", "t0")

    def __init__(self, stats: Stats) -> None:
        self.stats = stats

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        elapsed = time.perf_counter() - self.t0
        with self.stats._lock:
            self.stats.compress_seconds += elapsed


class ResidualMemory:
    """fp32 error-feedback buffers keyed by (kind, bucket key).

    A buffer is handed out zeroed when first asked for, and again whenever the bucket's
    numel or signature (its parameters' shapes, in bucket order) changes: a residual laid
    out for another bucket would add errors to the wrong parameters.

    A residual is per element, so it is per parameter too. When the caller says which
    parameters a key's bucket holds (``place``, by the ordinals of ``ddpcomm.layout``; the
    DDP hooks do), a bucket laid out anew (DDP's rebuild after its first iteration, a run
    resumed with another ``bucket_cap_mb``) takes over each of its parameters' residual from
    the bucket that held it instead of starting from zero, so the error-feedback invariant
    (N * sum(outputs) + sum(residuals) = sum(inputs), over ranks) holds across the change.
    ``end_iteration`` then drops what no bucket of the iteration used: a ``state_dict``
    holds live residuals only.

    The two-phase quantizer's owner residual ("q_owner") covers this rank's chunk of the
    bucket, and chunks move with the bucket's size: most of its elements land in other
    ranks' chunks. So it is not carried as it is: on a layout change its elements are added
    to this rank's whole-bucket residual ("q") at the same parameters, and the new owner
    residual starts from zero. Both count once in the invariant, and the next step feeds
    "q" into the sum the owners reduce: the same mass, in the same sum.
    """

    # Kinds that cover a part of the bucket -> the whole-bucket kind their elements fold
    # into on a layout change (see the class docstring).
    PARTS = {"q_owner": "q"}
    # What a kind's elements start as, where not 0: normalize's scale is 1 (gradient
    # units) wherever none was shared yet, in a new bucket or a parameter new to one.
    FILL = {"scale": 1.0}

    __slots__ = ("buffers", "signatures", "placed", "_loose", "_used")

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.signatures: dict[tuple, object] = {}
        self.placed: dict[object, tuple[int, ...]] = {}  # key -> its parameters' ordinals
        # kind -> ordinal -> residual of one parameter, between its old bucket and its new
        # one (within one iteration).
        self._loose: dict[str, dict[int, torch.Tensor]] = {}
        self._used: set = set()  # keys placed in this iteration

    def _fresh(self, kind: str, numel: int, device) -> torch.Tensor:
        return torch.full((numel,), self.FILL.get(kind, 0.0), dtype=torch.float32, device=device)

    def get(self, kind: str, key, numel: int, device, signature=None) -> torch.Tensor:
        k = (kind, key)
        buf = self.buffers.get(k)
        if buf is None or buf.numel() != numel or self.signatures.get(k) != signature:
            buf = self._fresh(kind, numel, device)
            self.buffers[k] = buf
            self.signatures[k] = signature
        elif buf.device != torch.device(device):
            # A residual loaded from a checkpoint lives on the CPU until its bucket is
            # first reduced on the GPU: moved, not reset, so a resumed run stays bitwise.
            buf = self.buffers[k] = buf.to(device)
        return buf

    def place(self, key, ords: tuple, signature: tuple, device, chunk_start=None) -> None:
        """Lays ``key``'s residuals out over the parameters ``ords`` (shapes ``signature``),
        before its bucket is reduced: each parameter's residual comes from the key that held
        it, zeros (``FILL``) where none did. ``chunk_start(numel)``: where this rank's
        two-phase chunk of a bucket of ``numel`` elements starts (None: no owner residual to
        fold). Cheap when the key's parameters did not change: one tuple comparison."""
        self._used.add(key)
        if self.placed.get(key) == ords:
            return
        if key not in self.placed and any(
            self.signatures.get(k) == signature for k in self.buffers if k[1] == key
        ):
            # Made by ``get`` alone, or loaded without a layout: its shapes are this
            # bucket's, so it is taken as laid out over these parameters (as before ``place``).
            self.placed[key] = ords
        wanted = set(ords)
        for k in [k for k, held in self.placed.items() if k == key or not wanted.isdisjoint(held)]:
            self._release(k, chunk_start)
        for k in [k for k in self.buffers if k[1] == key]:  # over parameters nobody knows
            del self.buffers[k]
            self.signatures.pop(k, None)
        sizes = [math.prod(shape) for shape in signature]
        for kind, loose in self._loose.items():
            if wanted.isdisjoint(loose):
                continue
            parts = []
            for o, n in zip(ords, sizes, strict=True):
                piece = loose.pop(o, None)
                if piece is None or piece.numel() != n:
                    piece = self._fresh(kind, n, device)
                parts.append(piece.to(device))
            self.buffers[(kind, key)] = torch.cat(parts)
            self.signatures[(kind, key)] = signature
        self.placed[key] = ords

    def _release(self, key, chunk_start) -> None:
        """Cuts ``key``'s residuals into one loose piece per parameter."""
        ords = self.placed.pop(key)
        kinds = [kind for kind, k in self.buffers if k == key]
        bufs = {kind: self.buffers.pop((kind, key)) for kind in kinds}
        signatures = {kind: self.signatures.pop((kind, key), None) for kind in kinds}
        for part, whole in self.PARTS.items():
            piece = bufs.pop(part, None)
            if piece is None or whole not in bufs or chunk_start is None:
                continue  # nowhere to fold it: dropped
            target = bufs[whole]
            start = chunk_start(target.numel())
            if start + piece.numel() <= target.numel():
                target[start : start + piece.numel()] += piece.to(target.device)
        for kind, buf in bufs.items():
            sizes = [math.prod(shape) for shape in signatures[kind] or ()]
            if len(sizes) != len(ords) or sum(sizes) != buf.numel():
                continue  # not laid out over these parameters: dropped
            loose = self._loose.setdefault(kind, {})
            at = 0
            for o, n in zip(ords, sizes, strict=True):
                piece = buf[at : at + n]
                # Two holders of one parameter (never in a valid layout): the mass adds up.
                loose[o] = loose[o] + piece if o in loose else piece
                at += n

    def end_iteration(self) -> None:
        """After a hook call of every bucket of an iteration: drops the residuals of keys not
        placed in it, and the loose pieces no bucket claimed (parameters that left every
        bucket)."""
        for key in [k for k in self.placed if k not in self._used]:
            del self.placed[key]
        for k in [k for k in self.buffers if k[1] not in self._used]:
            del self.buffers[k]
            self.signatures.pop(k, None)
        self._loose.clear()
        self._used.clear()

    def nbytes(self) -> int:
        """Bytes of the per-element state held (what ``state_dict`` saves)."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def state_dict(self) -> dict:
        return {
            "buffers": {k: v.detach().cpu().clone() for k, v in self.buffers.items()},
            "signatures": dict(self.signatures),
        }

    def load_state_dict(self, sd: dict, layout: dict | None = None) -> None:
        """``layout`` (a ``LayoutTracker`` state_dict: shapes, key -> ordinals) says which
        parameters each key's residuals are laid out over, where their shapes agree."""
        self.buffers = {k: v.clone() for k, v in sd["buffers"].items()}
        self.signatures = dict(sd["signatures"])
        self.placed, self._loose, self._used = {}, {}, set()
        if layout is None:
            return
        shapes = layout["shapes"]
        for key, ords in layout["layouts"].items():
            signature = tuple(shapes[o] for o in ords)
            if all(s == signature for (_, k), s in self.signatures.items() if k == key):
                self.placed[key] = ords


class LinkRate:
    """What one bucket's gloo all-gathers measured of the link, and the rate the ranks agreed on.

    Each call records when each piece was issued and when it landed, in the ``Timing`` that
    ``start`` returns (one per call, so calls that overlap, such as async
    ``ddpcomm.all_reduce`` calls of one signature, never write into each other's). A piece
    was on the wire from the later of its issue and the previous landing until its own
    landing, so the payload over the sum of those spans is the rate of the wire: pieces
    issued slower than they travel (a fast link, the time spent compressing) do not make the
    link look slow. A rank's rate is the best of its calls since the last agreement, so a
    call slowed by something else (a cold first call, a busy CPU) does not either. At fixed
    call counts (the ``FIRST``th, then every ``EVERY`` more), after its pieces, a call sends
    that rate to a MAX all_reduce of 8 bytes (``sent``), and the next call reads the result
    (``agreed``). MAX, because a piece lands only once every rank has sent it: a rank that
    issued early also timed its wait for the others, and the last to issue timed the least
    of it. Every rank issues that all_reduce at the same call and reads it at the same call,
    so all of them see the same rate, and whatever is derived from it (the piece size) is
    the same everywhere.
    """

    __slots__ = ("calls", "_last", "_best", "_pending", "_agreed")

    FIRST, EVERY = 4, 64

    def __init__(self) -> None:
        self.calls = 0  # all-gathers of this bucket so far
        self._last: Timing | None = None  # the last call's pieces
        self._best = 0.0  # payload bytes per second on the wire, best call since agreeing
        self._pending = None  # (work, tensor) of the MAX all_reduce in flight
        self._agreed = math.inf  # the agreed rate; inf: none agreed yet

    @property
    def pieces(self) -> int:
        """Pieces of the last call."""
        return 0 if self._last is None else len(self._last.issued_at)

    def as_dict(self) -> dict:
        """The last call's piece count and the rate in force, in MB/s (None before the
        first agreement), without waiting for an agreement in flight."""
        rate = None if math.isinf(self._agreed) else self._agreed / 1e6
        return {"pieces": self.pieces, "agreed_MB_per_s": rate}

    def agreed(self) -> float:
        """The agreed payload rate (bytes/s) as of the last agreement, or inf."""
        if self._pending is not None:
            work, rate = self._pending
            work.wait()
            self._agreed, self._pending = float(rate), None
        return self._agreed

    def start(self, payload_bytes: int, pieces: int) -> Timing:
        """Before the first piece is sent: closes the previous call's measurement (if all
        its pieces landed) and returns this call's."""
        if self._last is not None:
            self._best = max(self._best, self._last.rate())
        self._last = Timing(payload_bytes, pieces)
        return self._last

    def sent(self, pg: dist.ProcessGroup) -> None:
        """After the last piece is issued: at an agreement call, the MAX all_reduce."""
        self.calls += 1
        if self.calls >= self.FIRST and (self.calls - self.FIRST) % self.EVERY == 0:
            rate = torch.tensor([self._best or math.inf], dtype=torch.float64)
            self._best = 0.0
            work = dist.all_reduce(rate, op=dist.ReduceOp.MAX, group=pg, async_op=True)
            self._pending = (work, rate)


class Timing:
    """One call's pieces on the wire (``LinkRate.start``): ``issued(i)`` as piece i is
    handed to its collective, ``landed(i)`` as it arrives (on the collective's thread)."""

    __slots__ = ("payload", "issued_at", "landed_at")

    def __init__(self, payload_bytes: int, pieces: int) -> None:
        self.payload = payload_bytes
        self.issued_at, self.landed_at = [0.0] * pieces, [None] * pieces

    def issued(self, i: int) -> None:
        self.issued_at[i] = time.perf_counter()

    def landed(self, i: int) -> None:
        self.landed_at[i] = time.perf_counter()

    def rate(self) -> float:
        """Payload bytes per second on the wire; 0 until every piece has landed."""
        if not self.payload or any(t is None for t in self.landed_at):
            return 0.0
        wire, free = 0.0, -math.inf  # seconds on the wire; when it was free again
        for t0, t1 in zip(self.issued_at, self.landed_at, strict=True):
            wire += max(0.0, t1 - max(t0, free))
            free = max(free, t1)
        return self.payload / wire if wire > 0 else math.inf


class Workspace:
    """Reusable uint8 buffers keyed by (name, bucket key).

    A key's buffers are reused by its next call: callers must not overlap two calls with
    the same key (DDP never does: a bucket's next reduction starts after its previous one
    finished, and on CUDA after the previous one's kernels, through its Future's events).
    ``allocations`` counts the buffers it made (tests pin steady-state calls at none).
    """

    __slots__ = ("buffers", "links", "allocations", "keep_segments")

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.links: dict[object, LinkRate] = {}
        self.allocations = 0
        # Whether shared-memory segments are kept for the key's next call: not for calls
        # that may overlap one of the same key (async ddpcomm.all_reduce), which must never
        # write a segment a peer may still read (node_memory.Segment).
        self.keep_segments = True

    def nbytes(self) -> int:
        """Bytes of the buffers (and shared-memory segments) held for the next calls."""
        return _nbytes(self.buffers)

    def link(self, key) -> LinkRate:
        """The bucket's LinkRate (its gloo all-gathers' measured and agreed rate)."""
        return self.links.setdefault(key, LinkRate())

    def get(self, name: str, key, nbytes: int, device) -> torch.Tensor:
        buf = self.buffers.get((name, key))
        if buf is None or buf.numel() != nbytes or buf.device != torch.device(device):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.buffers[(name, key)] = buf
            self.allocations += 1
        return buf

    def segment(self, name: str, key, nbytes: int) -> Segment:
        """The key's shared-memory segment of ``nbytes`` per half (node_memory.Segment)."""
        if not self.keep_segments:
            return Segment(nbytes)
        seg = self.buffers.get((name, key))
        if seg is None or seg.nbytes != nbytes:
            seg = self.buffers[(name, key)] = Segment(nbytes)
            self.allocations += 1
        return seg


def _nbytes(buffers: dict) -> int:
    return sum(b.numel() for b in buffers.values())


class WorkspacePool:
    """The Workspaces of one group's one-off calls (``ddpcomm.all_reduce``), by signature.

    A call has no state to keep buffers in, and a fresh multi-megabyte buffer per call costs
    its first-touch page faults: q8 at 64 MiB fp32 between two gloo ranks on loopback took
    55.7 ms a call with fresh buffers against 38.4 through a DDP hook and 37.3 with buffers
    kept (one run, a loaded 2-core machine). glibc hands an allocation above its mmap
    threshold (at most 32 MiB) back to the kernel when it is freed, so every call faults in
    q8's 33.6 MB gather buffer again: filling a fresh one took 21.7 ms, a kept one 0.9 (a
    fresh 16.8 MB one, reused from the heap, 0.37). And pieces follow the link only where a
    LinkRate persists: at 1 Gbit/s q4 took 88.9 ms a call against the hook's 79.0, 79.6
    with a kept Workspace, 91.4 with kept buffers but no LinkRate (q8: 155.3, 145.9, 146.9,
    156.3).

    ``checkout(signature, keep_buffers)`` gives a call a Workspace: the signature's
    LinkRates, always (every rank makes the same calls in the same order, so every rank
    uses, agrees on and evicts the same LinkRates at the same calls), and its buffers, which
    ``checkin`` returns. A call that overlaps another of its signature (async calls) finds
    the buffers taken and allocates its own; a call with ``keep_buffers=False`` (CUDA
    tensors, whose caching allocator already reuses memory, and where a later call on
    another stream would not be ordered after this one's kernels) never takes them.

    Bounds: the signatures of the last ``SIGNATURES`` calls keep their LinkRates (a few
    hundred bytes each); buffers beyond the most recent signature's are dropped, least
    recently used first, once the pool holds more than ``BYTES``. A long-lived process
    calling all_reduce on many shapes so holds at most BYTES plus its latest call's payload
    buffers (0.75x the tensor's bytes for q8 at two ranks: one payload sent, two gathered),
    and a group's pool goes with the group. 256 MiB keeps five such 64 MiB q8 calls.
    """

    SIGNATURES = 64
    BYTES = 256 << 20

    __slots__ = ("_entries", "_lock", "allocations")

    def __init__(self) -> None:
        # signature -> [links, buffers or None while checked out], least recent first
        self._entries: OrderedDict[object, list] = OrderedDict()
        self._lock = threading.Lock()
        self.allocations = 0  # buffers allocated by calls through this pool

    def checkout(self, signature, keep_buffers: bool = True) -> Workspace:
        ws = Workspace()
        with self._lock:
            entry = self._entries.get(signature)
            if entry is None:
                entry = self._entries[signature] = [{}, {}]
                while len(self._entries) > self.SIGNATURES:
                    self._entries.popitem(last=False)
            self._entries.move_to_end(signature)
            ws.links = entry[0]
            if keep_buffers and entry[1] is not None:
                ws.buffers, entry[1] = entry[1], None
        return ws

    def checkin(self, signature, ws: Workspace, keep_buffers: bool = True) -> None:
        """After the call (on CPU, once its last callback ran): its buffers go back."""
        with self._lock:
            self.allocations += ws.allocations
            entry = self._entries.get(signature)
            if not keep_buffers or entry is None or entry[1]:
                return  # evicted, or an overlapping call's buffers went back first
            entry[1] = ws.buffers
            held = sum(_nbytes(e[1]) for e in self._entries.values() if e[1])
            for e in self._entries.values():  # least recent first
                if held <= self.BYTES:
                    break
                if e is not entry and e[1]:
                    held -= _nbytes(e[1])
                    e[1] = {}

    def nbytes(self) -> int:
        """Bytes of the buffers the pool holds (not those checked out)."""
        with self._lock:
            return sum(_nbytes(e[1]) for e in self._entries.values() if e[1])


class ReduceContext:
    """Everything an algorithm needs beyond the tensor and the method: the group, the
    bucket's key, the step, and where residuals, buffers and stats live.

    ``part`` prefixes the residual kinds and buffer names of a call that reduces a part of
    the bucket: the cross-node step of a two-level reduction (``across``) keeps its shard's
    residuals as ``"shard:q"`` etc. under the bucket's own key, so a state that switches
    between flat and two-level never mixes a whole-bucket residual with a shard's.

    The group is held weakly: the algorithms' callbacks hold the context, and a callback
    must never hold the last reference to a process group, whose destructor would then
    run on (and try to join) that group's own worker thread.
    """

    __slots__ = (
        "_group",
        "memory",
        "key",
        "step",
        "signature",
        "stats",
        "workspace",
        "residuals",
        "part",
        "scaling",
    )

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        memory: ResidualMemory | None = None,
        key=0,
        step: int = 0,
        signature=None,
        stats: Stats | None = None,
        workspace: Workspace | None = None,
        part: str = "",
    ) -> None:
        self._group = None if group is None else weakref.ref(group)
        self.memory = memory
        self.key = key
        self.step = step
        self.signature = signature
        self.stats = Stats() if stats is None else stats
        self.workspace = workspace
        self.residuals: list[torch.Tensor] = []  # handed out by residual(), for resets
        self.part = part
        # A quantizer's normalize.Scaling for this step, applied piece by piece, or None.
        self.scaling = None

    def across(self, group: dist.ProcessGroup) -> ReduceContext:
        """The context of a two-level reduction's cross-node step, over ``group``: the same
        bucket, step, memory and workspace; residuals and buffers of part ``"shard:"``;
        bytes counted as crossing nodes (``Stats.across``)."""
        return ReduceContext(
            group,
            self.memory,
            self.key,
            self.step,
            self.signature,
            self.stats.across(),
            self.workspace,
            part=SHARD + self.part,
        )

    @property
    def pg(self) -> dist.ProcessGroup:
        if self._group is None:
            return dist.group.WORLD
        group = self._group()
        if group is None:
            raise RuntimeError("ddpcomm: the process group of this reduction was destroyed")
        return group

    def buffer(self, name: str, nbytes: int, device) -> torch.Tensor:
        """A uint8 scratch buffer: the workspace's for this key, or a new one."""
        if self.workspace is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.workspace.get(self.part + name, self.key, nbytes, device)

    def segment(self, name: str, nbytes: int) -> Segment:
        """A shared-memory segment for this key (node_memory.Segment): the workspace's, or
        a new one."""
        if self.workspace is None:
            return Segment(nbytes)
        return self.workspace.segment(self.part + name, self.key, nbytes)

    def link(self) -> LinkRate | None:
        """This bucket's LinkRate: the workspace's, or None (one-off calls measure nothing)."""
        return None if self.workspace is None else self.workspace.link(self.key)

    def residual(self, kind: str, numel: int, device) -> torch.Tensor:
        if self.memory is None:
            raise ValueError("error feedback needs a ResidualMemory in the ReduceContext")
        buf = self.memory.get(self.part + kind, self.key, numel, device, self.signature)
        self.residuals.append(buf)
        return buf

    def reset_unless(self, finite: torch.Tensor) -> None:
        """Zeroes this call's residuals where the 0-dim bool ``finite`` is False.

        On a GPU a device-side select, not a Python branch: reading ``finite`` on the host
        would stall the stream (and DDP's backward) on every bucket. On the CPU the value is
        already there, and a branch spares a pass over every residual at every step. After
        a non-finite step the residuals hold NaN/Inf; zeroing them keeps the next step's
        input clean.
        """
        if finite.device.type == "cpu":
            if not bool(finite):
                for buf in self.residuals:
                    buf.zero_()
            return
        for buf in self.residuals:
            buf.masked_fill_(finite.logical_not(), 0.0)
