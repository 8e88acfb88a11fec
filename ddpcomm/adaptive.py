"""Adaptive pass-through: send a bucket plain where compressing it does not pay.

Compression wins only where the link is the bottleneck: on a fast link, or for small
buckets, quantizing and decoding cost more than the bytes saved. A hook state with
``adaptive=True`` times both paths and routes each bucket size class (power-of-two
numel ranges: class c holds buckets of 2^(c-1) to 2^c - 1 elements) through the faster.

Schedule, in steps s counted from ``start_iter``:

- Probe (s < 8): every class alternates, plain at even steps, compressed at odd ones. The
  first call of each path is a warm-up (buffers, page faults) and is not counted, which
  leaves 3 samples per path.
- Decide (s = 8, then every ``every`` steps): each rank publishes, per class, the median
  of its latest samples of each path through the process group's store; every rank reads
  all of them and takes, per class and path, the maximum over ranks (a collective ends
  when its slowest rank does). Compressed is chosen where it is estimated at least
  ``MARGIN`` faster than plain. Every rank computes this from the same records, so every
  rank routes every bucket the same way.
- Re-probe: in the ``REPROBE_STEPS`` steps before each later decision, each class takes
  the path it lost, so the next decision sees both paths as the link is now. The path in
  use keeps being timed on every call.

Cost: the losing path for 2 steps in every ``every`` (default 500: 0.4% of steps), plus
one store exchange per decision; until the first decision half the steps go plain.

What is timed: from the call to the Future's completion (wall clock on the CPU; CUDA
events, read only once they have completed, on the GPU: no host synchronisation), less
any part of it spent waiting for the state's previous call to finish, so a bucket queued
behind another is not charged for that one's transfer.

Error feedback: a bucket sent plain leaves its residuals untouched (the plain path is then
bitwise DDP's default); they are added in at the bucket's next compressed step, so the
invariant N * sum(outputs) + sum(residuals) = sum(inputs) holds across path changes.
"""

from __future__ import annotations

import collections
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ddpcomm import agreement, collectives
from ddpcomm.compressors import Compressor, check_int
from ddpcomm.context import Future, ReduceContext

PLAIN, COMPRESSED = "plain", "compressed"
PROBE_STEPS = 4  # steps per path before the first decision, the first one a warm-up
REPROBE_STEPS = 2  # steps of the losing path before each later decision
WINDOW = 3  # latest samples kept per (class, path); the estimate is their median
MARGIN = 0.03  # compression must be estimated this much faster than plain to be used
DEFAULT_EVERY = 500
MIN_EVERY = REPROBE_STEPS + 1


def size_class(numel: int) -> int:
    """Buckets of 2^(c-1) .. 2^c - 1 elements are class c."""
    return numel.bit_length()


def _other(path: str) -> str:
    return PLAIN if path == COMPRESSED else COMPRESSED


class Adaptive:
    """The routing of one hook state: measurements, decisions, counters.

    Args:
        every: steps between decisions (re-evaluations), > ``REPROBE_STEPS``.
        clock: seconds, read at a call and at its completion on the CPU. A test seam:
            injected clocks make timings deterministic.
    """

    __slots__ = (
        "every",
        "clock",
        "decisions",
        "estimates",
        "next_decision",
        "rounds",
        "counts",
        "_samples",
        "_warm",
        "_pending",
        "_last_done",
        "_origin",
    )

    def __init__(self, every: int = DEFAULT_EVERY, clock: Callable[[], float] | None = None):
        self.every = check_int(every, "adaptive_every", MIN_EVERY)
        self.clock = time.perf_counter if clock is None else clock
        self.decisions: dict[int, str] = {}  # class -> path, the same on every rank
        self.estimates: dict[int, tuple[float, float]] = {}  # class -> (plain, compressed) s
        self.next_decision = 2 * PROBE_STEPS
        self.rounds = 0
        self.counts: collections.Counter = collections.Counter()  # (class, path) -> calls
        self._samples: dict[tuple[int, str], collections.deque] = {}
        self._warm: set[tuple[int, str]] = set()
        self._pending: collections.deque = collections.deque()  # [class, path, t0, t1]
        self._last_done = float("-inf")
        self._origin = None  # CUDA: the event times are measured from

    # -- routing ----------------------------------------------------------------------

    def path(self, cls: int, step: int) -> str:
        decision = self.decisions.get(cls)
        if decision is None:
            return PLAIN if step % 2 == 0 else COMPRESSED
        if step >= self.next_decision - REPROBE_STEPS:
            return _other(decision)
        return decision

    def reduce(
        self, flat: torch.Tensor, compressor: Compressor, ctx: ReduceContext, step: int
    ) -> Future:
        """``flat``'s mean over ranks by the path this step gives its class, timed."""
        if step >= self.next_decision:
            self.decide(step, ctx.pg)
        self._resolve()
        cls = size_class(flat.numel())
        path = self.path(cls, step)
        self.counts[cls, path] += 1
        entry = [cls, path, self._now(flat.device), None]
        self._pending.append(entry)
        if path == PLAIN:
            fut = collectives.plain_all_reduce(flat, ctx)
        else:
            fut = collectives.all_reduce_mean(flat, compressor, ctx)

        def done(f: Future):
            value = f.value()  # raises the path's error: nothing is recorded then
            entry[3] = self._now(flat.device)
            return value

        return fut.then(done)

    # -- measuring --------------------------------------------------------------------

    def _now(self, device: torch.device):
        if device.type != "cuda":
            return self.clock()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if self._origin is None:
            self._origin = event
        return event

    def _seconds(self, t) -> float | None:
        """A time stamp in seconds; None for a CUDA event that has not completed yet."""
        if not isinstance(t, torch.cuda.Event):
            return t
        return self._origin.elapsed_time(t) / 1e3 if t.query() else None

    def _resolve(self) -> None:
        """Turns completed calls, in call order, into samples (never waits)."""
        while self._pending and self._pending[0][3] is not None:
            cls, path, t0, t1 = self._pending[0]
            end = self._seconds(t1)
            if end is None:
                return
            start = self._seconds(t0)
            if start is None:
                return
            self._pending.popleft()
            start = max(start, self._last_done)  # not charged for waiting behind the last
            self._last_done = max(self._last_done, end)
            if (cls, path) not in self._warm:
                self._warm.add((cls, path))  # the first call of a path is a warm-up
                continue
            window = self._samples.setdefault((cls, path), collections.deque(maxlen=WINDOW))
            window.append(max(end - start, 0.0))

    def measured(self, cls: int, path: str) -> float | None:
        window = self._samples.get((cls, path))
        return statistics.median(window) if window else None

    # -- deciding ---------------------------------------------------------------------

    def decide(self, step: int, group: dist.ProcessGroup) -> None:
        """Every rank's medians through the store, then the same decision on every rank."""
        self._resolve()
        classes = sorted({cls for cls, _ in self._warm})  # every class timed at least once
        mine = {str(c): [self.measured(c, PLAIN), self.measured(c, COMPRESSED)] for c in classes}
        values = agreement.exchange(
            group,
            json.dumps(mine, sort_keys=True),
            f"the adaptive decision of a ddpcomm DDP comm hook (step {step} after start_iter)",
            limit=agreement.hook_timeout(),
        )
        records = [json.loads(v) for v in values]
        undecided = False
        for key in sorted({c for r in records for c in r}, key=int):
            pairs = [r.get(key) for r in records]
            if any(p is None or None in p for p in pairs):
                undecided |= int(key) not in self.decisions
                continue  # a path not timed on some rank yet: keep what was decided
            plain = max(p[0] for p in pairs)
            compressed = max(p[1] for p in pairs)
            self.estimates[int(key)] = (plain, compressed)
            self.decisions[int(key)] = COMPRESSED if compressed < plain * (1 - MARGIN) else PLAIN
        self.rounds += 1
        # A class still without a decision (first seen lately) is probed again soon.
        self.next_decision = step + (2 * PROBE_STEPS if undecided else self.every)

    # -- reporting and checkpoints ----------------------------------------------------

    def stats(self, start_iter: int) -> dict:
        self._resolve()
        classes = sorted({c for c, _ in self.counts} | set(self.decisions))

        def ms(value):
            return None if value is None else value * 1e3

        rows = []
        for c in classes:
            est = self.estimates.get(c)
            rows.append(
                {
                    "numel": [1 << (c - 1) if c else 0, (1 << c) - 1],
                    "decision": self.decisions.get(c, "probing"),
                    "estimated_ms": None
                    if est is None
                    else {PLAIN: ms(est[0]), COMPRESSED: ms(est[1])},
                    "measured_ms": {p: ms(self.measured(c, p)) for p in (PLAIN, COMPRESSED)},
                    "buckets": {p: self.counts[c, p] for p in (PLAIN, COMPRESSED)},
                }
            )
        return {
            "every": self.every,
            "decisions": self.rounds,
            "next_decision_iteration": start_iter + self.next_decision,
            "buckets": {
                p: sum(n for (_, q), n in self.counts.items() if q == p)
                for p in (
                    PLAIN,
                    COMPRESSED,
                )
            },
            "classes": rows,
        }

    def state_dict(self) -> dict:
        return {
            "every": self.every,
            "decisions": dict(self.decisions),
            "estimates": {c: list(e) for c, e in self.estimates.items()},
            "next_decision": self.next_decision,
            "rounds": self.rounds,
        }

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("every") != self.every:
            raise ValueError(
                f"state_dict was saved with adaptive_every={sd.get('every')!r}, this state "
                f"has {self.every}"
            )
        try:
            decisions = {int(c): p for c, p in sd["decisions"].items()}
            estimates = {int(c): (float(e[0]), float(e[1])) for c, e in sd["estimates"].items()}
            next_decision, rounds = int(sd["next_decision"]), int(sd["rounds"])
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise ValueError(f"malformed state_dict['adaptive']: {exc!r}") from None
        if not set(decisions.values()) <= {PLAIN, COMPRESSED}:
            raise ValueError(f"state_dict['adaptive']['decisions'] has unknown paths: {decisions}")
        self.decisions, self.estimates = decisions, estimates
        self.next_decision, self.rounds = next_decision, rounds
