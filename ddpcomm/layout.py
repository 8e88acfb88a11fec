"""DDP bucket layouts: re-forming a checkpoint's buckets after a restart, carrying residuals
to new buckets, and noticing parameters that DDP lost to a cast.

A compressed all-reduce depends on how gradients are grouped into buckets: quantization
blocks, two-phase chunks and error-feedback residuals are laid out over the bucket. DDP
groups parameters one way in its first iteration and rebuilds the buckets in gradient
order after it, so a process that resumes from a checkpoint sees, in its first
iteration, a layout the checkpoint's residuals were not made for.

``LayoutTracker`` numbers parameters in the order the hook first sees them (the
first-iteration layout, identical in every fresh process built the same way) and records
the parameters each bucket key was reduced over (``place``). After ``load_state_dict``, a
first-iteration bucket that does not match the saved layout is handed to a ``Reformer``,
which gathers the parameters of each saved bucket as they arrive, reduces them exactly as
the saved bucket would have been reduced (same elements, order, key and residual), and
writes the results back: the resumed run continues bitwise as if it had never stopped.

When the layout changes for good (DDP's rebuild after its first iteration, a run resumed
with another ``bucket_cap_mb``), ``place`` hands the residual memory the new bucket's
parameters and the memory carries each parameter's residual over
(``context.ResidualMemory``); at the end of an iteration, what no bucket used is dropped.

``watch_casts``: a model cast after DDP wrapped it (``model.half()``, ``.to(dtype)``) gets
new tensor types under the same parameters; autograd then gives them new gradient
accumulators, and DDP's hooks, registered on the old ones, never fire again. Measured on
torch 2.13 (gloo, CPU, 2 ranks): from the first backward after ``ddp.half()`` (likewise
bfloat16, float64) DDP calls no comm hook and runs no all-reduce of its own, each rank
keeps its own gradients, and nothing is raised or warned; the replicas drift apart. (A cast
of some layers only leaves their buckets unfinished, and DDP raises "Expected to have
finished reduction in the prior iteration" at the next forward.) The hook cannot see that
happen, as it is not called; a post-accumulate-grad hook on the first parameter of each
bucket of the state's first iteration can, for one Python call per such bucket per
backward pass, and warns once.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from ddpcomm.compressors import Quantizer
from ddpcomm.futures import Latch, then


class LayoutTracker:
    """Parameter ordinals, and the parameters each bucket key was reduced over in the
    latest iteration."""

    __slots__ = ("ordinals", "shapes", "layouts", "_placed", "_loaded")

    def __init__(self, loaded: dict | None = None) -> None:
        self.ordinals = WeakIdKeyDictionary()  # parameter -> ordinal
        self.shapes: list[tuple] = []  # ordinal -> shape
        self.layouts: dict[int, tuple[int, ...]] = {}  # key -> ordinals, latest iteration
        self._placed: dict[int, tuple[int, ...]] = {}  # the same, this iteration so far
        # A checkpoint's layout: what state_dict reports until an iteration has run here.
        self._loaded = loaded

    def serves_another_model(self, params: list) -> bool:
        """Whether ``params`` (bucket 0's) are all unknown while others are known: bucket 0
        of a second model (a model's bucket 0 holds parameters it has shown before)."""
        return len(self.ordinals) > 0 and not any(p in self.ordinals for p in params)

    def observe(self, params: list) -> tuple[int, ...]:
        """The ordinals of a bucket's parameters, numbering new ones."""
        ords = []
        for p in params:
            o = self.ordinals.get(p)
            if o is None:
                o = self.ordinals[p] = len(self.shapes)
                self.shapes.append(tuple(p.shape))
            ords.append(o)
        return tuple(ords)

    def signature(self, ords: tuple[int, ...]) -> tuple:
        """Shapes in bucket order: portable across processes, used to key residuals."""
        return tuple(self.shapes[o] for o in ords)

    def place(self, key: int, ords: tuple[int, ...]) -> tuple:
        """Records that bucket ``key`` is reduced over ``ords`` in this iteration; returns
        its signature."""
        self._placed[key] = ords
        return self.signature(ords)

    def end_iteration(self) -> None:
        """The iteration's buckets are the layout now (a bucket not reduced in it is gone)."""
        self.layouts, self._placed = self._placed, {}
        self._loaded = None

    def state_dict(self) -> dict:
        if self._loaded is not None:
            return {
                "shapes": [tuple(s) for s in self._loaded["shapes"]],
                "layouts": {int(k): tuple(v) for k, v in self._loaded["layouts"].items()},
            }
        return {"shapes": list(self.shapes), "layouts": dict(self.layouts)}


def place(state, key: int, ords: tuple[int, ...], device) -> tuple:
    """Bucket ``key`` of hook state ``state`` is reduced over parameters ``ords`` in this
    iteration: recorded, and its residuals laid out over them (carried from the buckets
    that held them). Returns the bucket's signature."""
    signature = state.layout.place(key, ords)
    chunk_start = owner_chunk_start(state.compressor, state.process_group)
    state.memory.place(key, ords, signature, device, chunk_start)
    return signature


def end_iteration(state) -> None:
    """After the last bucket of an iteration: the iteration's layout becomes the state's,
    and residuals no bucket used are dropped."""
    state.layout.end_iteration()
    state.memory.end_iteration()


def owner_chunk_start(compressor, group: dist.ProcessGroup | None) -> Callable | None:
    """``start(numel)``: the first element of this rank's chunk of a ``numel``-element
    bucket in the two-phase quantizer (as ``collectives._quantized_two_phase`` splits it);
    None for methods without one. Ramp stages share the method's block size."""
    if not isinstance(compressor, Quantizer):
        return None

    def start(numel: int) -> int:
        pg = group if group is not None else dist.group.WORLD
        return dist.get_rank(pg) * compressor.chunk_numel(numel, dist.get_world_size(pg))

    return start


# reduce(flat, key, signature) -> Future of the mean, written into flat.
ReduceFn = Callable[[torch.Tensor, int, tuple], torch.futures.Future]


class Reformer:
    """Reduces one iteration's buckets in a saved layout (see the module docstring).

    Made by ``load_state_dict`` for its state; lives for one iteration.
    """

    def __init__(self, saved: dict, state) -> None:
        self.saved_shapes = [tuple(s) for s in saved["shapes"]]
        self.targets = {int(k): tuple(v) for k, v in saved["layouts"].items()}
        self.state = state
        self.issued: set[int] = set()
        self.segments: dict[int, tuple] = {}  # ordinal -> (buffer, offset, numel, latch)

    def matches(self, index: int, ords: tuple[int, ...]) -> bool:
        """Whether this bucket already is the saved bucket of the same index."""
        target = self.targets.get(index)
        return target is not None and self.state.layout.signature(ords) == tuple(
            self.saved_shapes[o] for o in target
        )

    def add(
        self, bucket: dist.GradBucket, ords: tuple[int, ...], params: list
    ) -> torch.futures.Future:
        """The Future of ``bucket``'s mean: complete once every saved bucket holding one of
        its parameters has been reduced and copied back."""
        shapes = self.state.layout.shapes
        for o in ords:
            if o >= len(self.saved_shapes) or shapes[o] != self.saved_shapes[o]:
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
        signature = place(self.state, t, target, flat.device)

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

        then(self.state.reduce(flat, t, signature), scatter)


# Parameter -> its CastWatch: one post-accumulate-grad hook per parameter, whatever the
# number of states watching it.
_WATCHES = WeakIdKeyDictionary()


def watch_casts(param: torch.Tensor, state) -> None:
    """Warns once if ``param`` is cast while ``state`` (or any state watching it) stops being
    called (see the module docstring)."""
    if not param.requires_grad:
        return
    watch = _WATCHES.get(param)
    if watch is None:
        watch = _WATCHES[param] = CastWatch(param)
    watch.states[state] = None


class CastWatch:
    """One parameter's dtype at the time a hook first reduced it, checked at each of its
    gradient accumulations. A different dtype alone is no error (the model may have been
    wrapped again, by a new DDP that calls the hook); a different dtype at two backward
    passes in a row without any of the watching states having reduced a bucket in between
    is DDP no longer reducing this model."""

    __slots__ = ("dtype", "states", "_progress", "_warned")

    def __init__(self, param: torch.Tensor) -> None:
        self.dtype = param.dtype
        self.states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._progress: tuple | None = None  # the states' iterations at the last mismatch
        self._warned = False
        # The hook lives on the tensor, not on its gradient accumulator: it survives the
        # cast that makes DDP's own hooks silent (measured, torch 2.13).
        param.register_post_accumulate_grad_hook(self._accumulated)

    def _accumulated(self, param: torch.Tensor) -> None:
        if param.dtype == self.dtype or self._warned:
            return
        progress = tuple(state.iteration for state in self.states.keys())
        if progress == self._progress:
            self._warned = True
            names = ", ".join(f"{type(s).__name__}(iteration {s.iteration})" for s in self.states)
            warnings.warn(
                f"ddpcomm: a parameter of a DDP model served by {names} was cast from "
                f"{self.dtype} to {param.dtype} after DistributedDataParallel wrapped the "
                "model (model.half(), .to(dtype)), and two backward passes have run since "
                "without a single call of the comm hook: DDP's gradient hooks sat on the "
                "old tensors, so it no longer averages these gradients at all (no comm "
                "hook, no all-reduce of its own, no error from torch) and the replicas "
                "drift apart. Cast the model before wrapping it in DDP, or wrap it again "
                "after the cast",
                RuntimeWarning,
                stacklevel=2,
            )
        self._progress = progress
