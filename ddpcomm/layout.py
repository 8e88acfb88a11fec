"""DDP bucket layouts, and re-forming a checkpoint's buckets after a restart.

A compressed all-reduce depends on how gradients are grouped into buckets: quantization
blocks, two-phase chunks and error-feedback residuals are laid out over the bucket. DDP
groups parameters one way in its first iteration and rebuilds the buckets in gradient
order after it, so a process that resumes from a checkpoint sees, in its first
iteration, a layout the checkpoint's residuals were not made for.

``LayoutTracker`` numbers parameters in the order the hook first sees them (the
first-iteration layout, identical in every fresh process built the same way) and records
each bucket as a tuple of those ordinals. After ``load_state_dict``, a first-iteration
bucket that does not match the saved layout is handed to a ``Reformer``, which gathers
the parameters of each saved bucket as they arrive, reduces them exactly as the saved
bucket would have been reduced (same elements, order, key and residual), and writes the
results back: the resumed run continues bitwise as if it had never stopped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from ddpcomm.futures import Latch, then


class LayoutTracker:
    """Parameter ordinals and the latest layout of every bucket index."""

    __slots__ = ("ordinals", "shapes", "layouts")

    def __init__(self) -> None:
        self.ordinals = WeakIdKeyDictionary()  # parameter -> ordinal
        self.shapes: list[tuple] = []  # ordinal -> shape
        self.layouts: dict[int, tuple[int, ...]] = {}  # bucket index -> ordinals

    def serves_another_model(self, params: list) -> bool:
        """Whether ``params`` (bucket 0's) are all unknown while others are known: bucket 0
        of a second model (a model's bucket 0 holds parameters it has shown before)."""
        return len(self.ordinals) > 0 and not any(p in self.ordinals for p in params)

    def observe(self, index: int, params: list) -> tuple[int, ...]:
        """The ordinals of bucket ``index``'s parameters, numbering new ones."""
        ords = []
        for p in params:
            o = self.ordinals.get(p)
            if o is None:
                o = self.ordinals[p] = len(self.shapes)
                self.shapes.append(tuple(p.shape))
            ords.append(o)
        ords = tuple(ords)
        self.layouts[index] = ords
        return ords

    def signature(self, ords: tuple[int, ...]) -> tuple:
        """Shapes in bucket order: portable across processes, used to key residuals."""
        return tuple(self.shapes[o] for o in ords)

    def state_dict(self) -> dict:
        return {"shapes": list(self.shapes), "layouts": dict(self.layouts)}


# reduce(flat, key, signature) -> Future of the mean, written into flat.
ReduceFn = Callable[[torch.Tensor, int, tuple], torch.futures.Future]


class Reformer:
    """Reduces one iteration's buckets in a saved layout (see the module docstring).

    Made by ``load_state_dict`` with the state's own ``reduce``; lives for one iteration.
    """

    def __init__(self, saved: dict, tracker: LayoutTracker, reduce: ReduceFn) -> None:
        self.saved_shapes = [tuple(s) for s in saved["shapes"]]
        self.targets = {int(k): tuple(v) for k, v in saved["layouts"].items()}
        self.tracker = tracker
        self.reduce = reduce
        self.issued: set[int] = set()
        self.segments: dict[int, tuple] = {}  # ordinal -> (buffer, offset, numel, latch)

    def matches(self, index: int, ords: tuple[int, ...]) -> bool:
        """Whether this bucket already is the saved bucket of the same index."""
        target = self.targets.get(index)
        return target is not None and self.tracker.signature(ords) == tuple(
            self.saved_shapes[o] for o in target
        )

    def add(
        self, bucket: dist.GradBucket, ords: tuple[int, ...], params: list
    ) -> torch.futures.Future:
        """The Future of ``bucket``'s mean: complete once every saved bucket holding one of
        its parameters has been reduced and copied back."""
        for o in ords:
            if o >= len(self.saved_shapes) or self.tracker.shapes[o] != self.saved_shapes[o]:
                raise ValueError(
                    "ddpcomm: this DDP model's first-iteration bucket layout does not match "
                    "the checkpoint's (parameter shapes differ); load the state into a hook "
                    "of the same model, built the same way"
                )
        buffer = bucket.buffer()
        latch = Latch(len(ords), buffer, buffer.device)  # one arrival per parameter
        offset = 0
        for o, p in zip(ords, params, strict=True):
            self.segments[o] = (buffer, offset, p.numel(), latch)
            offset += p.numel()
        for t, target in sorted(self.targets.items()):
            if t not in self.issued and all(o in self.segments for o in target):
                self.issued.add(t)
                self._issue(t, target)
        return latch.future

    def _issue(self, t: int, target: tuple[int, ...]) -> None:
        parts = [self.segments[o] for o in target]
        flat = torch.cat([buf[off : off + numel] for buf, off, numel, _ in parts])
        signature = tuple(self.saved_shapes[o] for o in target)

        def scatter(f: torch.futures.Future) -> None:
            try:
                out = f.value()
            except Exception as exc:  # noqa: BLE001 - delivered to every waiting bucket
                for *_, latch in parts:
                    latch.arrive(exc)
                return
            pos = 0
            for buf, off, numel, latch in parts:
                buf[off : off + numel].copy_(out[pos : pos + numel])
                pos += numel
                latch.arrive()

        then(self.reduce(flat, t, signature), scatter)
