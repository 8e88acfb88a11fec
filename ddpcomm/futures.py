"""Futures that carry ddpcomm's results, and the one rule that makes them CUDA-correct.

- ``then``: every callback ddpcomm attaches to a Future (drained at interpreter exit).
- ``device_future`` / ``completed``: Futures completed from Python.
- ``Latch`` / ``join``: one Future completed after several parts.

CUDA futures. A ``torch.futures.Future`` created with ``devices=[cuda device]`` records an
event on the current stream when it is completed, and whoever waits on it (DDP's reducer,
a ``then`` callback) waits for that event, i.e. for the kernels that produced its value. A
device-less Future records nothing: its waiter would read the result before the kernels
wrote it. Every Future here that carries a CUDA tensor is the collective's own future, a
``then`` of one, or made by ``device_future``.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable

import torch

Future = torch.futures.Future


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
