"""What the all-reduce algorithms keep between calls, and the futures they hand back.

``collectives.py`` holds the algorithms; this module holds their bookkeeping, so the
algorithms read top-down:

- ``Stats``: bytes sent against a plain all_reduce, compression time, paths taken.
- ``ResidualMemory``: the fp32 error-feedback residuals of each bucket.
- ``Workspace``: reused payload buffers (a fresh multi-megabyte tensor per call costs more
  in first-touch page faults than the kernel that fills it), and each bucket's
  ``LinkRate``: the rate its gloo all-gathers measured, agreed across ranks.
- ``ReduceContext``: one call's group, bucket key, step and the three above.
- ``verify_config``: ranks that disagree on the method fail on every rank, not hang.
- ``Sequencer``: second-phase collectives issued in one order on every rank.
- ``device_future`` and ``Latch``: Futures that carry CUDA results correctly.
- ``then``: every callback ddpcomm attaches to a Future, drained at interpreter exit.

CUDA futures. A ``torch.futures.Future`` created with ``devices=[cuda device]`` records an
event on the current stream when it is completed, and whoever waits on it (DDP's reducer,
a ``then`` callback) waits for that event, i.e. for the kernels that produced its value. A
device-less Future records nothing: its waiter would read the result before the kernels
wrote it. Every Future here that carries a CUDA tensor is the collective's own future, a
``then`` of one, or made by ``device_future``.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
import math
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist

Future = torch.futures.Future

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; older releases have only
# the former. Same collective either way.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# --------------------------------------------------------------------------------------
# Futures
# --------------------------------------------------------------------------------------


# Every callback ddpcomm hands to a torch Future, until torch frees it. On gloo, torch runs
# callbacks on the group's worker thread; after the last one has completed the Future a
# training step waits on, that thread still takes the GIL to free the callbacks, their
# Futures and the finished collective's tensors. If the interpreter is finalizing by then,
# the thread is killed inside a destructor and the process aborts ("terminate called
# without an active exception"): a 2-rank torchrun script ending right after its last
# step did so in 1-2 runs of 40. So at exit, before finalizing, ddpcomm waits (GIL
# released) for its callbacks to be freed, then a moment more for the collectives that
# follow them; with that, 0 runs of 80 aborted.
_CALLBACKS: weakref.WeakSet = weakref.WeakSet()
_EXIT_WAIT = 2.0  # seconds exit waits at most, for collectives that never finished
_EXIT_GRACE = 0.05  # seconds more, for the worker to free each finished collective
_used_callbacks = False


def then(fut: Future, fn: Callable[[Future], object]) -> Future:
    """``fut.then(fn)``, its callback tracked until torch frees it (see ``_drain``)."""
    global _used_callbacks

    def callback(f: Future):  # a fresh object per call: freed exactly when torch drops it
        return fn(f)

    _used_callbacks = True
    _CALLBACKS.add(callback)
    return fut.then(callback)


@atexit.register
def _drain() -> None:
    if not _used_callbacks:
        return
    deadline = time.monotonic() + _EXIT_WAIT
    while _CALLBACKS and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(_EXIT_GRACE)


# The Futures ddpcomm completes from Python (set_result, set_exception): all made by
# device_future. An exception set from Python is kept as the value, which a C++ reader
# such as DDP's reducer then fails to cast to a Tensor; the hooks turn such errors into
# C++-level ones by returning a ``then`` of these Futures (and only of these: each ``then``
# is one more hop on the gloo worker thread: about 40 us, 6% of a 1 MiB plain all_reduce
# between two local ranks).
_SET_FROM_PYTHON: weakref.WeakSet = weakref.WeakSet()


def device_future(device: torch.device) -> Future:
    """A Future that, for a CUDA device, orders its waiters after the producing stream."""
    fut = Future(devices=[device]) if device.type == "cuda" else Future()
    _SET_FROM_PYTHON.add(fut)
    return fut


def set_from_python(fut: Future) -> bool:
    """Whether ``fut`` is completed from Python (made by device_future), so that an error
    in it is a Python object rather than a C++ exception."""
    return fut in _SET_FROM_PYTHON


def completed(value, device: torch.device) -> Future:
    fut = device_future(device)
    fut.set_result(value)
    return fut


class Latch:
    """A Future completed with ``value`` once ``count`` parts have arrived.

    Each part calls ``arrive()`` after enqueueing its work (typically inside a ``then``
    callback, whose current CUDA stream differs from part to part). On CUDA every arrival
    records an event on its current stream and the last arrival makes its own stream wait
    for all of them before completing the Future, so its waiters see every part's kernels.
    The first failure completes the Future with that exception.
    """

    __slots__ = ("future", "_value", "_left", "_events", "_cuda", "_lock")

    def __init__(self, count: int, value, device: torch.device) -> None:
        self.future = device_future(device)
        self._value = value
        self._left = count
        self._events: list = []
        self._cuda = device.type == "cuda"
        self._lock = threading.Lock()
        if count == 0:
            self.future.set_result(value)

    def arrive(self, error: BaseException | None = None) -> None:
        event = None
        if self._cuda and error is None:
            event = torch.cuda.Event()
            event.record()
        with self._lock:
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
                return
            self._left -= 1
            if event is not None:
                self._events.append(event)
            if self._left:
                return
            for e in self._events:
                torch.cuda.current_stream().wait_event(e)
            self.future.set_result(self._value)

    def watch(self, fut: Future, work: Callable[[Future], None] | None = None) -> None:
        """Arrives when ``fut`` completes, after running ``work(fut)`` (which may raise)."""

        def part(f: Future) -> None:
            try:
                f.wait()
                if work is not None:
                    work(f)
            except Exception as exc:  # noqa: BLE001 - handed to the latch's waiter
                self.arrive(exc)
                return
            self.arrive()

        then(fut, part)


def join(futures: list[Future], value, device: torch.device) -> Future:
    """A Future of ``value`` completed after every one of ``futures`` (CUDA-ordered)."""
    if len(futures) == 1:
        return then(futures[0], lambda f: (f.wait(), value)[1])
    latch = Latch(len(futures), value, device)
    for f in futures:
        latch.watch(f)
    return latch.future


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

    def timer(self) -> _Timer:
        """``with stats.timer(): ...`` adds the block's host time to compress_seconds."""
        return _Timer(self)

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
        if buf is None or buf.numel() != numel or self.signatures.get(k) != signature:
            buf = torch.zeros(numel, dtype=torch.float32, device=device)
            self.buffers[k] = buf
            self.signatures[k] = signature
        elif buf.device != torch.device(device):
            # A residual loaded from a checkpoint lives on the CPU until its bucket is
            # first reduced on the GPU: moved, not reset, so a resumed run stays bitwise.
            buf = self.buffers[k] = buf.to(device)
        return buf

    def state_dict(self) -> dict:
        return {
            "buffers": {k: v.detach().cpu().clone() for k, v in self.buffers.items()},
            "signatures": dict(self.signatures),
        }

    def load_state_dict(self, sd: dict) -> None:
        self.buffers = {k: v.clone() for k, v in sd["buffers"].items()}
        self.signatures = dict(sd["signatures"])


class LinkRate:
    """What one bucket's gloo all-gathers measured of the link, and the rate the ranks agreed on.

    Each call records when each piece was issued and when it landed (``issued``,
    ``landed``). A piece was on the wire from the later of its issue and the previous
    landing until its own landing, so the payload over the sum of those spans is the rate
    of the wire: pieces issued slower than they travel (a fast link, the time spent
    compressing) do not make the link look slow. A rank's rate is the best of its calls
    since the last agreement, so a call slowed by something else (a cold first call, a
    busy CPU) does not either. At fixed call counts (the ``FIRST``th, then every ``EVERY``
    more), after its pieces, a call sends that rate to a MAX all_reduce of 8 bytes
    (``sent``), and the next call reads the result (``agreed``). MAX, because a piece lands
    only once every rank has sent it: a rank that issued early also timed its wait for the
    others, and the last to issue timed the least of it. Every rank issues that all_reduce
    at the same call and reads it at the same call, so all of them see the same rate, and
    whatever is derived from it (the piece size) is the same everywhere.
    """

    __slots__ = ("calls", "_payload", "_issued", "_landed", "_best", "_pending", "_agreed")

    FIRST, EVERY = 4, 64

    def __init__(self) -> None:
        self.calls = 0  # all-gathers of this bucket so far
        self._payload, self._issued, self._landed = 0, [], []
        self._best = 0.0  # payload bytes per second on the wire, best call since agreeing
        self._pending = None  # (work, tensor) of the MAX all_reduce in flight
        self._agreed = math.inf  # the agreed rate; inf: none agreed yet

    @property
    def pieces(self) -> int:
        """Pieces of the last call."""
        return len(self._issued)

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

    def start(self, payload_bytes: int, pieces: int) -> None:
        """Before the first piece is sent: closes the previous call's measurement."""
        if self._payload and all(t is not None for t in self._landed):
            wire, free = 0.0, -math.inf  # seconds on the wire; when it was free again
            for t0, t1 in zip(self._issued, self._landed, strict=True):
                wire += max(0.0, t1 - max(t0, free))
                free = max(free, t1)
            self._best = max(self._best, self._payload / wire if wire > 0 else math.inf)
        self._payload = payload_bytes
        self._issued, self._landed = [0.0] * pieces, [None] * pieces

    def issued(self, i: int) -> None:
        self._issued[i] = time.perf_counter()

    def landed(self, i: int) -> None:
        self._landed[i] = time.perf_counter()

    def sent(self, pg: dist.ProcessGroup) -> None:
        """After the last piece is issued: at an agreement call, the MAX all_reduce."""
        self.calls += 1
        if self.calls >= self.FIRST and (self.calls - self.FIRST) % self.EVERY == 0:
            rate = torch.tensor([self._best or math.inf], dtype=torch.float64)
            self._best = 0.0
            work = dist.all_reduce(rate, op=dist.ReduceOp.MAX, group=pg, async_op=True)
            self._pending = (work, rate)


class Workspace:
    """Reusable uint8 buffers keyed by (name, bucket key).

    A key's buffers are reused by its next call: callers must not overlap two calls with
    the same key (DDP never does: a bucket's next reduction starts after its previous one
    finished, and on CUDA after the previous one's kernels, through its Future's events).
    """

    __slots__ = ("buffers", "links")

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.links: dict[object, LinkRate] = {}

    def link(self, key) -> LinkRate:
        """The bucket's LinkRate (its gloo all-gathers' measured and agreed rate)."""
        return self.links.setdefault(key, LinkRate())

    def get(self, name: str, key, nbytes: int, device) -> torch.Tensor:
        buf = self.buffers.get((name, key))
        if buf is None or buf.numel() != nbytes or buf.device != torch.device(device):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.buffers[(name, key)] = buf
        return buf


class ReduceContext:
    """Everything an algorithm needs beyond the tensor and the method: the group, the
    bucket's key, the step, and where residuals, buffers and stats live.

    The group is held weakly: the algorithms' callbacks hold the context, and a callback
    must never hold the last reference to a process group, whose destructor would then
    run on (and try to join) that group's own worker thread.
    """

    __slots__ = ("_group", "memory", "key", "step", "signature", "stats", "workspace", "residuals")

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        memory: ResidualMemory | None = None,
        key=0,
        step: int = 0,
        signature=None,
        stats: Stats | None = None,
        workspace: Workspace | None = None,
    ) -> None:
        self._group = None if group is None else weakref.ref(group)
        self.memory = memory
        self.key = key
        self.step = step
        self.signature = signature
        self.stats = Stats() if stats is None else stats
        self.workspace = workspace
        self.residuals: list[torch.Tensor] = []  # handed out by residual(), for resets

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
        return self.workspace.get(name, self.key, nbytes, device)

    def link(self) -> LinkRate | None:
        """This bucket's LinkRate: the workspace's, or None (one-off calls measure nothing)."""
        return None if self.workspace is None else self.workspace.link(self.key)

    def residual(self, kind: str, numel: int, device) -> torch.Tensor:
        if self.memory is None:
            raise ValueError("error feedback needs a ResidualMemory in the ReduceContext")
        buf = self.memory.get(kind, self.key, numel, device, self.signature)
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


# --------------------------------------------------------------------------------------
# Configuration agreement
# --------------------------------------------------------------------------------------


def fingerprint(config: tuple) -> int:
    """A stable int64 digest of a configuration tuple (same on every rank and process)."""
    digest = hashlib.sha256(repr(config).encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def verify_config(config: tuple, numel: int, group: dist.ProcessGroup | None, device) -> None:
    """Raises ValueError on every rank when ranks disagree on ``config`` or ``numel``.

    One small blocking all_gather; callers run it once, at their first compressed step,
    so a mismatch is a clear error everywhere instead of a hang or silent garbage.
    """
    pg = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(pg)
    mine = torch.tensor([fingerprint(config), numel], dtype=torch.int64, device=device)
    every = torch.empty(world * 2, dtype=torch.int64, device=device)
    all_gather_single(every, mine, group=pg)
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


class Sequencer:
    """Issues second-phase collectives on a companion group in ticket order.

    gloo and NCCL pair collectives by the order each rank issues them on a group, while
    ``Future.then`` callbacks run in whatever order collectives finish. A ticket is taken
    when the first phase is issued (bucket order, the same on every rank); the second
    phase is issued on the companion group strictly in ticket order.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        ranks = dist.get_process_group_ranks(group)
        # Only members call this, at their first two-phase step, in the same order. The
        # companion runs on the group's own backend (a NCCL group's phase 2 stays on
        # NCCL) with the group's timeout: a frozen peer fails phase 2 when the user's
        # timeout says, not after torch's default of 30 minutes.
        self.companion = dist.new_group(
            ranks,
            backend=dist.get_backend(group),
            timeout=group_timeout(group),
            use_local_synchronization=True,
        )
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


def group_timeout(pg: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout ``pg`` was created with (None, torch's default, if torch does not say)."""
    for device in getattr(pg, "_device_types", ()):
        try:
            return pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


# Weak keys: a destroyed process group is not kept alive by its sequencer.
_SEQUENCERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SEQUENCERS_LOCK = threading.Lock()


def sequencer(group: dist.ProcessGroup) -> Sequencer:
    with _SEQUENCERS_LOCK:
        seq = _SEQUENCERS.get(group)
        if seq is None:
            seq = _SEQUENCERS[group] = Sequencer(group)
        return seq
