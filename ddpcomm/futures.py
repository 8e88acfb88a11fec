"""Futures that carry ddpcomm's results, and the one rule that makes them CUDA-correct.

- ``then``: every callback ddpcomm attaches to a Future (drained at interpreter exit, and
  checked against the stream rule below).
- ``device_future`` / ``completed`` / ``resolve``: Futures completed from Python.
- ``Latch`` / ``join``: one Future completed after several parts.

How torch orders CUDA work behind a Future (``ivalue::Future``: ``then``,
``invokeCallback``, ``markCompleted``). A Future made with ``devices=[cuda device]``
records, when it is completed, one event on the current stream of each device its value
holds tensors on; a waiter (DDP's reducer, ``Future.wait()``, a ``then`` callback) waits
for those events. A NCCL work's Future is already complete when it is returned, its events
on the NCCL stream. A ``then`` callback runs on a fresh stream from the pool that first
waits on its parent's events (at once and on the issuing thread when the parent is
complete, as NCCL's always is; on gloo's worker thread when its collective lands), and its
child Future records events only for the devices of the tensors the callback *returns*.

**The stream rule.** A callback that launches device work returns the tensors it wrote,
or, after writing them, completes a Future or ``Latch`` with them (``resolve``,
``Latch.arrive``). Its parent's tensors count as written: a callback that reads the
collective's result and returns None drops the collective's events too. A callback that
breaks the rule hands its waiters tensors the kernels (or the collective) have not
written yet: on a GPU the bucket DDP receives is the unreduced local gradient.

The rule is enforced here, where every callback passes. With ``DDPCOMM_CHECK_STREAM_RULE=1``
(the test suite sets it) each callback runs under a dispatch mode that records the device
of every tensor an op writes; a device written (or held by the parent's value) and not
covered when the callback returns raises ``StreamRuleError`` in the callback and is
recorded in ``violations``. CPU tensors go through the same bookkeeping, so the CPU test
suite proves every algorithm keeps the rule (tests/test_stream_rule.py).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

Future = torch.futures.Future


# --------------------------------------------------------------------------------------
# The stream rule, checked
# --------------------------------------------------------------------------------------

CHECK_ENV = "DDPCOMM_CHECK_STREAM_RULE"
_checking = os.environ.get(CHECK_ENV, "") not in ("", "0")
_local = threading.local()  # .pending: the checked callbacks running on this thread
violations: list[str] = []  # every breach of the rule seen in this process
checked = 0  # callbacks run under the check in this process


class StreamRuleError(RuntimeError):
    """A Future callback wrote (or received) tensors its Future does not carry."""


def check_stream_rule(on: bool = True) -> None:
    """Turns the stream-rule check on or off for callbacks attached from now on."""
    global _checking
    _checking = on


def _devices(value) -> set:
    """The devices of every tensor in ``value`` (a tensor, or lists/tuples/dicts of them)."""
    if isinstance(value, torch.Tensor):
        return {value.device}
    if isinstance(value, (list, tuple)):
        return set().union(*map(_devices, value)) if value else set()
    if isinstance(value, dict):
        return _devices(list(value.values()))
    return set()


class _Pending(TorchDispatchMode):
    """One checked callback: the devices it must still hand on to its waiters."""

    def __init__(self, parent: Future) -> None:
        super().__init__()
        try:
            self.devices = _devices(parent.value())
        except Exception:  # noqa: BLE001 - a failed parent hands on no tensors
            self.devices = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        stack = _local.pending
        # Only the innermost callback records: an inline child callback's work runs on its
        # own stream and is its own Future's to carry.
        if stack and stack[-1] is self:
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = kwargs.get(arg.name, args[i] if i < len(args) else None)
                    self.devices |= _devices(value)
        return func(*args, **kwargs)


def _cover(devices: set | None) -> None:
    """The running checked callback (if any) has handed on its work on ``devices`` (None:
    on every device, as when it completes a Future with an error: no tensor is read)."""
    stack = getattr(_local, "pending", None)
    if stack:
        stack[-1].devices = set() if devices is None else stack[-1].devices - devices


def _run_checked(fn: Callable[[Future], object], f: Future):
    global checked
    pending = _Pending(f)
    stack = _local.__dict__.setdefault("pending", [])
    stack.append(pending)
    try:
        with pending:
            value = fn(f)
    finally:
        stack.pop()
    checked += 1
    left = pending.devices - _devices(value)
    if left:
        name = getattr(fn, "__qualname__", repr(fn))
        message = (
            f"ddpcomm stream rule: the Future callback {name} wrote or received tensors on "
            f"{sorted(map(str, left))} and returned {type(value).__name__}, which carries "
            "none of them: its waiters would read them before the work that writes them "
            "(return the tensors written, or complete a Future or Latch with them)"
        )
        violations.append(message)
        raise StreamRuleError(message)
    return value


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
    """``fut.then(fn)``, the one way ddpcomm attaches a callback: ``fn`` keeps the stream
    rule (module docstring), checked when the check is on; the callback is tracked until
    torch frees it (see ``_drain``)."""
    global _used_callbacks
    check = _checking

    def callback(f: Future):  # a fresh object per call: freed exactly when torch drops it
        return _run_checked(fn, f) if check else fn(f)

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


def for_reducer(fut: Future) -> Future:
    """``fut`` as a DDP comm hook returns it. DDP's reducer reads the Future from C++: an
    error must be a C++-level one (raised in a callback), or it reaches the user as "Unable
    to cast <message> to Tensor". A collective's Future and a ``then``'s already are; one
    completed from Python gets a ``then`` that passes its value on."""
    return then(fut, _value) if set_from_python(fut) else fut


def _value(fut: Future):
    return fut.value()


def resolve(fut: Future, value) -> None:
    """Completes the ``device_future`` ``fut`` with ``value``. On CUDA the Future records an
    event on the current stream of ``value``'s device, so its waiters see every kernel
    enqueued there so far: inside a callback, this hands that callback's work on."""
    _cover(_devices(value))
    fut.set_result(value)


def fail(fut: Future, error: BaseException) -> None:
    """Completes ``fut`` with ``error``: its waiters read no tensors, so nothing is owed."""
    _cover(None)
    fut.set_exception(error)


def current_stream(t: torch.Tensor):
    """The current CUDA stream of ``t``'s device (None for a CPU tensor): where a callback's
    kernels for ``t`` ran, for a collective issued later from another thread to follow."""
    return torch.cuda.current_stream(t.device) if t.is_cuda else None


def on_stream(stream):
    """``torch.cuda.stream(stream)``, or nothing for None (CPU tensors)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def completed(value, device: torch.device) -> Future:
    fut = device_future(device)
    resolve(fut, value)
    return fut


class Latch:
    """A Future completed with ``value`` once ``count`` parts have arrived.

    Each part calls ``arrive()`` after enqueueing its work (typically inside a ``then``
    callback, whose current CUDA stream differs from part to part). On CUDA every arrival
    records an event on its current stream of the latch's device (not the thread's current
    device: gloo runs callbacks for CUDA tensors without setting one), and the last arrival
    makes its own stream wait for all of them before completing the Future, so its waiters
    see every part's kernels. The first failure completes the Future with that exception.
    """

    __slots__ = ("future", "_value", "_left", "_events", "_device", "_lock")

    def __init__(self, count: int, value, device: torch.device) -> None:
        self.future = device_future(device)
        self._value = value
        self._left = count
        self._events: list = []
        self._device = torch.device(device)
        self._lock = threading.Lock()
        if count == 0:
            resolve(self.future, value)

    def arrive(self, error: BaseException | None = None) -> None:
        """One part is done (its work enqueued on the current stream), or failed."""
        _cover(None if error is not None else {self._device})
        event = None
        cuda = self._device.type == "cuda"
        if cuda and error is None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
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
            if cuda:
                stream = torch.cuda.current_stream(self._device)
                for e in self._events:
                    stream.wait_event(e)
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
