"""Adaptive pass-through: send a bucket plain where compressing it does not pay.

Compression wins only where the link is the bottleneck: on a fast link, or for small
buckets, quantizing and decoding cost more than the bytes saved. A hook state with
``adaptive=True`` routes each bucket size class (power-of-two numel ranges: class c holds
buckets of 2^(c-1) to 2^c - 1 elements) through the path that makes the step faster.

What is timed is the step, not the bucket. DDP overlaps communication with the backward
pass, so one bucket's time from call to completion says little about what it costs: a
plain bucket queued behind another looks slow, and compressing on the CPU looks free
while it delays the backward pass. A step is timed from its first hook call to the next
step's: the whole iteration (backward, waiting for the buckets, optimizer, forward), so
every cost a choice moves is inside it wherever it lands (CPU: wall clock; GPU: CUDA
events, read only once they have completed, so there is no host synchronisation).

Schedule, in steps s counted from ``start_iter``:

- Warm-up: step 0 sends every bucket plain and step 1 compressed, so each path's first
  call (buffers, page faults) is out of the way. A step that still holds a path's first
  call for some class is never timed.
- A round A/B-tests each class seen in the step before it, one class at a time: for
  ``SAMPLES`` cycles, one step as decided (the base), then for each class one step with
  only that class on its other path. Undecided classes are sent plain. A round over C
  classes takes ``SAMPLES * (C + 1)`` steps; the first starts at step 2.
- Decide (``SLACK`` steps after the round, so GPU events have completed): each rank
  publishes the median step time of the base and of every flipped configuration through the
  process group's store; every rank reads all of them and takes, per configuration, the
  maximum over ranks (a step ends when its slowest rank does). A class is sent plain where
  the step with it plain is at least ``MARGIN`` faster than with it compressed: a tie goes
  to the method asked for, and steps vary by several percent on a busy machine. Every
  rank computes this from the same records, so every rank routes every bucket the same way.
- Next round: ``every`` steps after a decision; at once after a decision that changed a
  path of one of several classes (at most ``QUICK_ROUNDS`` times in a row), since classes
  share the link and the CPU; and at once when a class without a decision appears (all
  ranks see the same buckets at the same step).

Cost: one round's flipped steps (``SAMPLES * C``) every ``every`` steps (default 500:
3% of steps with 3 classes), plus one store exchange per round; until the first
decision, half the steps or more go plain.

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
from ddpcomm.context import ReduceContext
from ddpcomm.futures import Future

PLAIN, COMPRESSED = "plain", "compressed"
WARMUP_STEPS = 2  # step 0 plain, step 1 compressed: first calls, never timed
SAMPLES = 5  # timed steps per configuration in a round; the estimate is their median
SLACK = 1  # steps between a round's end and its decision
MARGIN = 0.03  # plain must make the step this much faster than compressed to be used
QUICK_ROUNDS = 1  # rounds in a row started at once because the last one changed a path
DEFAULT_EVERY = 500
MIN_EVERY = 1
BASE = "base"


def size_class(numel: int) -> int:
    """Buckets of 2^(c-1) .. 2^c - 1 elements are class c."""
    return numel.bit_length()


def first_decision(classes: int = 1) -> int:
    """The step (after ``start_iter``) of the first decision when every step holds
    ``classes`` size classes."""
    return WARMUP_STEPS + SAMPLES * (classes + 1) + SLACK


def _other(path: str) -> str:
    return PLAIN if path == COMPRESSED else COMPRESSED


class _Step:
    """One step's timing: its configuration, its first call and the next step's."""

    __slots__ = ("step", "tag", "start", "end", "untimed", "futures")

    def __init__(self, step: int, tag, start) -> None:
        self.step, self.tag, self.start, self.end = step, tag, start, None
        self.untimed = tag is None  # a warm-up step, a first call, or a failed bucket
        self.futures: list[Future] = []  # the step's buckets: a failed one leaves it untimed

    def failed(self) -> bool | None:
        """Whether a bucket of the step failed; None while one has not completed."""
        if not all(f.done() for f in self.futures):
            return None
        for f in self.futures:
            try:
                f.value()
            except BaseException:
                return True
        self.futures = []
        return False


class Adaptive:
    """The routing of one hook state: measurements, decisions, counters.

    Args:
        every: steps from a decision to the next round.
        clock: seconds, read at each step's first call on the CPU. A test seam: injected
            clocks make timings deterministic.
    """

    __slots__ = (
        "every",
        "clock",
        "decisions",
        "estimates",
        "next_round",
        "round",
        "rounds",
        "counts",
        "_quick",
        "_step",
        "_seen",
        "_last_seen",
        "_used",
        "_open",
        "_samples",
        "_recent",
        "_origin",
    )

    def __init__(self, every: int = DEFAULT_EVERY, clock: Callable[[], float] | None = None):
        self.every = check_int(every, "adaptive_every", MIN_EVERY)
        self.clock = time.perf_counter if clock is None else clock
        self.decisions: dict[int, str] = {}  # class -> path, the same on every rank
        self.estimates: dict[int, tuple[float, float]] = {}  # class -> (plain, compressed) s
        self.next_round = WARMUP_STEPS
        self.round: tuple[int, tuple[int, ...]] | None = None  # (first step, classes)
        self.rounds = 0
        self.counts: collections.Counter = collections.Counter()  # (class, path) -> calls
        self._quick = 0
        self._step = None  # the step of the latest call
        self._seen: set[int] = set()  # classes in that step
        self._last_seen: set[int] = set()  # classes in the step before it
        self._used: set[tuple[int, str]] = set()  # (class, path) called at least once
        self._open: collections.deque = collections.deque()  # _Step, not yet timed
        self._samples: dict = {}  # round tag (BASE or a class) -> step times, this round
        self._recent: collections.deque = collections.deque(maxlen=9)  # step times off-round
        self._origin = None  # CUDA: the event times are measured from

    # -- routing ----------------------------------------------------------------------

    def _round_end(self) -> int:
        start, classes = self.round
        return start + SAMPLES * (len(classes) + 1)

    def _tag(self, step: int):
        """What step ``step`` runs: None (warm-up), BASE, or the class flipped."""
        if step < WARMUP_STEPS:
            return None
        if self.round is None or step >= self._round_end():
            return BASE
        start, classes = self.round
        k = (step - start) % (len(classes) + 1)
        return BASE if k == 0 else classes[k - 1]

    def path(self, cls: int, step: int) -> str:
        if step < WARMUP_STEPS:
            return PLAIN if step == 0 else COMPRESSED
        decision = self.decisions.get(cls, PLAIN)
        return _other(decision) if self._tag(step) == cls else decision

    def reduce(
        self, flat: torch.Tensor, compressor: Compressor, ctx: ReduceContext, step: int
    ) -> Future:
        """``flat``'s mean over ranks by the path this step gives its class, timed."""
        if step != self._step:
            self._begin(step, ctx.pg, flat.device)
        record = self._open[-1]
        cls = size_class(flat.numel())
        path = self.path(cls, step)
        self._seen.add(cls)
        self.counts[cls, path] += 1
        if (cls, path) not in self._used:
            self._used.add((cls, path))
            record.untimed = True
        try:
            if path == PLAIN:
                fut = collectives.plain_all_reduce(flat, ctx)
            else:
                fut = collectives.all_reduce_mean(flat, compressor, ctx)
        except BaseException:
            record.untimed = True
            raise
        # Checked once the step has ended (_resolve), not by a callback: a callback is one
        # more hop on the bucket's way back to DDP (about 40 us: 6% of a 1 MiB plain
        # all_reduce between two local ranks).
        record.futures.append(fut)
        return fut

    def _begin(self, step: int, group: dist.ProcessGroup, device: torch.device) -> None:
        """The first call of step ``step``: ends the last step's record, decides, starts a
        round, opens this step's record."""
        now = self._now(device)
        if self._step is not None:
            self._last_seen, self._seen = self._seen, set()
            self._open[-1].end = now
        self._step = step
        self._resolve()
        if self.round is not None and step >= self._round_end() + SLACK:
            self._decide(step, group)
        if self.round is None and step >= WARMUP_STEPS:
            new = self._last_seen - self.decisions.keys()
            if (step >= self.next_round or new) and self._last_seen:
                self.round = (step, tuple(sorted(self._last_seen)))
                self._samples = {}
        self._open.append(_Step(step, self._tag(step), now))

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
        """Turns ended steps, in order, into their times (never waits)."""
        while self._open and self._open[0].end is not None:
            record = self._open[0]
            if not record.untimed:
                failed = record.failed()
                if failed is None:
                    return
                record.untimed = failed
            if not record.untimed:
                start, end = self._seconds(record.start), self._seconds(record.end)
                if start is None or end is None:
                    return
                span = max(end - start, 0.0)
                if self.round is not None and record.step >= self.round[0]:
                    self._samples.setdefault(record.tag, []).append(span)
                else:
                    self._recent.append(span)
            self._open.popleft()

    # -- deciding ---------------------------------------------------------------------

    def _decide(self, step: int, group: dist.ProcessGroup) -> None:
        """Every rank's median step times through the store (``_begin`` has just resolved
        the round's steps), then the same decision on every rank."""
        _, classes = self.round
        mine = {
            str(tag): statistics.median(spans) if spans else None
            for tag in (BASE, *classes)
            for spans in [self._samples.get(tag, [])]
        }
        values = agreement.exchange(
            group,
            json.dumps(mine, sort_keys=True),
            f"the adaptive decision of a ddpcomm DDP comm hook (step {step} after start_iter)",
            limit=agreement.hook_timeout(),
        )
        records = [json.loads(v) for v in values]
        base = [r.get(BASE) for r in records]
        changed = False
        for cls in classes:
            flipped = [r.get(str(cls)) for r in records]
            if None in base or None in flipped:
                continue  # not timed on some rank: keep the path it has
            was = self.decisions.get(cls, PLAIN)
            same, other = max(base), max(flipped)
            plain, compressed = (same, other) if was == PLAIN else (other, same)
            self.estimates[cls] = (plain, compressed)
            self.decisions[cls] = PLAIN if plain < compressed * (1 - MARGIN) else COMPRESSED
            changed |= self.decisions[cls] != was
        self.rounds += 1
        self.round = None
        # Classes interact (they share the link and the CPU): a change is checked at once.
        quick = changed and len(classes) > 1 and self._quick < QUICK_ROUNDS
        self._quick = self._quick + 1 if quick else 0
        self.next_round = step if self._quick else step + self.every

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
                    "estimated_step_ms": None
                    if est is None
                    else {PLAIN: ms(est[0]), COMPRESSED: ms(est[1])},
                    "buckets": {p: self.counts[c, p] for p in (PLAIN, COMPRESSED)},
                }
            )
        recent = statistics.median(self._recent) if self._recent else None
        return {
            "every": self.every,
            "decisions": self.rounds,
            "probing": self.round is not None,
            "next_round_iteration": start_iter
            + (self.round[0] if self.round is not None else self.next_round),
            "step_ms": ms(recent),
            "buckets": {
                p: sum(n for (_, q), n in self.counts.items() if q == p)
                for p in (PLAIN, COMPRESSED)
            },
            "classes": rows,
        }

    def state_dict(self) -> dict:
        return {
            "every": self.every,
            "decisions": dict(self.decisions),
            "estimates": {c: list(e) for c, e in self.estimates.items()},
            "next_round": self.next_round,
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
            # "next_decision": the key before rounds of whole-step timings
            next_round = int(sd["next_round"] if "next_round" in sd else sd["next_decision"])
            rounds = int(sd["rounds"])
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise ValueError(f"malformed state_dict['adaptive']: {exc!r}") from None
        if not set(decisions.values()) <= {PLAIN, COMPRESSED}:
            raise ValueError(f"state_dict['adaptive']['decisions'] has unknown paths: {decisions}")
        self.decisions, self.estimates = decisions, estimates
        self.next_round, self.rounds, self.round = next_round, rounds, None
