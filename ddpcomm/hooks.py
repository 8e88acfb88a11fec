"""DDP communication hooks and their state.

>>> ddp.register_comm_hook(None, ddpcomm.quantize_hook)                  # q8, defaults
>>> ddp.register_comm_hook(ddpcomm.QuantizeState(bits=4), ddpcomm.quantize_hook)

DDP checks hook annotations at registration, so this module keeps real (not
postponed) annotations: ``bucket: dist.GradBucket``, ``-> torch.futures.Future[torch.Tensor]``.

A hook receives one gradient bucket at a time (in bucket index order on every rank) and
returns a Future of the bucket's mean over ranks. State objects hold the method, the
per-bucket error-feedback residuals and the statistics; ``state=None`` gives each DDP
model its own default state, so two models in one process never share buffers.
"""

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from ddpcomm import collectives
from ddpcomm.collectives import ReduceContext, ResidualMemory, Stats, Workspace
from ddpcomm.compressors import Compressor, Quantizer, RandomK, TopK, check_float_tensor
from ddpcomm.layout import LayoutTracker, Reformer


def _check_iter(value, arg: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{arg} must be an int >= 0, got {value!r}")
    return value


class CompressionState:
    """Base state of a compressing hook: the method plus what it remembers.

    Args:
        compressor: the method, a ``ddpcomm.compressors.Compressor``.
        start_iter: iterations (backward passes) before this one use a plain all_reduce.
            Lets DDP settle its bucket layout and the model leave its first, large-gradient
            steps before compression starts.
        min_numel: buckets with fewer elements go uncompressed (latency-bound anyway).
        process_group: the group to reduce over; None means the default group.
    """

    __slots__ = (
        "compressor",
        "start_iter",
        "min_numel",
        "process_group",
        "iteration",
        "memory",
        "workspace",
        "layout",
        "_resume",
        "_reformer",
        "_stats",
        "_verified",
        "__weakref__",
    )

    def __init__(
        self,
        compressor: Compressor,
        start_iter: int = 0,
        min_numel: int = 0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"compressor must be a ddpcomm Compressor, got {compressor!r}")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a ProcessGroup or None, got {process_group!r}")
        self.compressor = compressor
        self.start_iter = _check_iter(start_iter, "start_iter")
        self.min_numel = _check_iter(min_numel, "min_numel")
        self.process_group = process_group
        self.iteration = 0
        self.memory = ResidualMemory()
        self.workspace = Workspace()
        self.layout = LayoutTracker()
        self._resume: dict | None = None  # a loaded checkpoint's bucket layout
        self._reformer: Reformer | None = None
        self._stats = Stats()
        self._verified = False

    def stats(self) -> dict:
        """Bytes handed to collectives, the plain all_reduce equivalent, compression time,
        and how many buckets took each path."""
        d = self._stats.as_dict()
        d["iteration"] = self.iteration
        return d

    def reset_stats(self) -> None:
        self._stats.reset()

    # -- checkpointing -----------------------------------------------------------------

    def state_dict(self) -> dict:
        """Iteration, residuals, bucket layout and method config: enough to resume bitwise.

        Load it into a state of the same configuration, registered on the same model
        built the same way, before the first backward pass of the resumed run.
        """
        return {
            "config": self.compressor.config(),
            "iteration": self.iteration,
            "start_iter": self.start_iter,
            "min_numel": self.min_numel,
            "memory": self.memory.state_dict(),
            "layout": self.layout.state_dict(),
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restores a ``state_dict``. DDP's first iteration in the new process groups
        gradients differently from the checkpoint's buckets; that iteration reduces them
        in the saved buckets (ddpcomm.layout), so training continues bitwise."""
        if tuple(sd["config"]) != self.compressor.config():
            raise ValueError(
                f"state_dict was saved with config {sd['config']}, this state has "
                f"{self.compressor.config()}"
            )
        self.iteration = int(sd["iteration"])
        self.start_iter = int(sd["start_iter"])
        self.min_numel = int(sd["min_numel"])
        self.memory.load_state_dict(sd["memory"])
        self.layout = LayoutTracker()
        self._resume = sd["layout"] if sd["layout"]["layouts"] else None
        self._reformer = None

    def __getstate__(self) -> dict:
        # Process groups do not pickle; a restored state reduces over the default group.
        return {"compressor": self.compressor, "state": self.state_dict()}

    def __setstate__(self, d: dict) -> None:
        CompressionState.__init__(self, d["compressor"])
        self.load_state_dict(d["state"])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.compressor!r}, start_iter={self.start_iter}, "
            f"min_numel={self.min_numel}, iteration={self.iteration})"
        )


class QuantizeState(CompressionState):
    """State of ``quantize_hook``: block-wise b-bit quantization of every bucket.

    Args:
        bits: 8, 4, 2 or 1 bits per element (plus 4 bytes per block for its scale).
        block_size: elements per scale, a power of two in [32, 65536] (default 256).
        stochastic: unbiased stochastic rounding instead of round-to-nearest.
        error_feedback: carry each step's quantization error into the next; None = on for
            1 and 2 bits, off for 4 and 8.
        algorithm: "two_phase", "all_gather" or "auto" (all_gather for 2 ranks or fewer).
        start_iter, min_numel, process_group: see ``CompressionState``.
        seed: seed of the stochastic rounding stream.

    Example::

        state = ddpcomm.QuantizeState(bits=4)
        ddp.register_comm_hook(state, ddpcomm.quantize_hook)
        ...
        print(state.stats()["compression_ratio"])
    """

    __slots__ = ()

    def __init__(
        self,
        bits: int = 8,
        block_size: int = 256,
        stochastic: bool = False,
        error_feedback: bool | None = None,
        algorithm: str = "auto",
        start_iter: int = 0,
        min_numel: int = 0,
        process_group: dist.ProcessGroup | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(
            Quantizer(bits, block_size, stochastic, error_feedback, algorithm, seed),
            start_iter,
            min_numel,
            process_group,
        )


# --------------------------------------------------------------------------------------
# Default states for state=None: one per DDP model
# --------------------------------------------------------------------------------------

# Parameter -> the default state of the model it belongs to. A hook cannot see its DDP
# module, but a bucket's parameters belong to exactly one model; weak keys let a deleted
# model's state go with it (keyed by identity: tensors compare elementwise).
_DEFAULT_STATES = WeakIdKeyDictionary()


def default_state(bucket: dist.GradBucket, factory) -> CompressionState:
    """The state ``factory()`` made for the model owning ``bucket``'s parameters."""
    params = bucket.parameters()
    state = None
    for p in params:
        state = _DEFAULT_STATES.get(p)
        if state is not None and isinstance(state, factory):
            break
        state = None
    if state is None:
        state = factory()
    for p in params:
        _DEFAULT_STATES[p] = state
    return state


# --------------------------------------------------------------------------------------
# Hooks
# --------------------------------------------------------------------------------------


def _reduce(state: CompressionState, flat: torch.Tensor, key: int, signature: tuple):
    """Plain before start_iter and for small buckets, the compressed all-reduce otherwise."""
    ctx = ReduceContext(
        group=state.process_group,
        memory=state.memory,
        key=key,
        step=state.iteration,
        signature=signature,
        stats=state._stats,
        workspace=state.workspace,
    )
    if state.iteration < state.start_iter or flat.numel() < state.min_numel:
        return collectives.plain_all_reduce(flat, ctx)
    if not state._verified:
        collectives.verify_config(
            state.compressor.config(), flat.numel(), state.process_group, flat.device
        )
        state._verified = True
    return collectives.all_reduce_mean(flat, state.compressor, ctx)


def run_compressed_hook(state: CompressionState, bucket: dist.GradBucket):
    """The body every compressing hook shares. Residuals are keyed by bucket index and
    checked against the bucket's layout (parameter shapes), so DDP's bucket rebuild
    resets them instead of applying them to the wrong parameters."""
    buffer = bucket.buffer()
    check_float_tensor(buffer, "bucket")
    ords, params = state.layout.observe(bucket)
    fut = None
    if state._resume is not None:
        if state._reformer is None:
            state._reformer = Reformer(
                state._resume, state.layout, lambda flat, key, sig: _reduce(state, flat, key, sig)
            )
        if not state._reformer.matches(bucket.index(), ords):
            fut = state._reformer.add(bucket, ords, params)
    if fut is None:
        fut = _reduce(state, buffer, bucket.index(), state.layout.signature(ords))
    if bucket.is_last():
        state.iteration += 1
        state._resume = state._reformer = None  # DDP has its own layout from now on
    return fut


def quantize_hook(
    state: QuantizeState | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: all-reduces the bucket as packed b-bit codes with block scales.

    ``state=None`` uses ``QuantizeState()`` (8 bits, block 256), one per DDP model.
    """
    if state is None:
        state = default_state(bucket, QuantizeState)
    elif not isinstance(state, QuantizeState):
        raise TypeError(f"quantize_hook needs a QuantizeState or None, got {type(state).__name__}")
    return run_compressed_hook(state, bucket)


def allreduce_hook(
    state: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: the plain, lossless mean (what DDP does without a hook).

    ``state`` is the process group to use, or None for the default group.
    """
    if state is not None and not isinstance(state, dist.ProcessGroup):
        raise TypeError(f"allreduce_hook takes a ProcessGroup or None, got {type(state).__name__}")
    return collectives.plain_all_reduce(bucket.buffer(), ReduceContext(group=state))


# --------------------------------------------------------------------------------------
# Sparsification hooks: top-k and random-k
# --------------------------------------------------------------------------------------


class TopKState(CompressionState):
    """State of ``topk_hook``: each rank sends its k = ceil(ratio * n) largest entries.

    Args:
        ratio: density in (0, 1] (default 0.01).
        approximate: threshold from a sample, one pass guaranteed (see compressors.TopK).
        error_feedback: carry the entries not sent into the next step (default True).
        value_dtype: wire dtype of the values; None means float32.
        start_iter, min_numel, process_group: see ``CompressionState``.

    ``stats()["paths"]`` counts ``topk_all_gather`` (sparse payloads) and ``topk_dense``
    (buckets where N * k * (4 + value bytes) would exceed a dense all_reduce).

    Example::

        state = ddpcomm.TopKState(ratio=0.01)
        ddp.register_comm_hook(state, ddpcomm.topk_hook)
    """

    __slots__ = ()

    def __init__(
        self,
        ratio: float = 0.01,
        approximate: bool = False,
        error_feedback: bool = True,
        value_dtype: torch.dtype | None = None,
        start_iter: int = 0,
        min_numel: int = 0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            TopK(ratio, approximate, error_feedback, value_dtype),
            start_iter,
            min_numel,
            process_group,
        )


class RandomKState(CompressionState):
    """State of ``randomk_hook``: every rank sends its entries at the same k random indices.

    Args:
        ratio: density in (0, 1] (default 0.01).
        seed: seed of the index stream; indices depend on (seed, iteration, bucket index),
            so ranks agree without sending them.
        error_feedback: carry the entries not sent into the next step (default True).
        start_iter, min_numel, process_group: see ``CompressionState``.

    Example::

        ddp.register_comm_hook(ddpcomm.RandomKState(ratio=0.05), ddpcomm.randomk_hook)
    """

    __slots__ = ()

    def __init__(
        self,
        ratio: float = 0.01,
        seed: int = 0,
        error_feedback: bool = True,
        start_iter: int = 0,
        min_numel: int = 0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(RandomK(ratio, seed, error_feedback), start_iter, min_numel, process_group)


def topk_hook(
    state: TopKState | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: all-gathers each rank's top-k (index, value) pairs and sums them.

    ``state=None`` uses ``TopKState()`` (1% density, exact, error feedback), one per model.
    """
    if state is None:
        state = default_state(bucket, TopKState)
    elif not isinstance(state, TopKState):
        raise TypeError(f"topk_hook needs a TopKState or None, got {type(state).__name__}")
    return run_compressed_hook(state, bucket)


def randomk_hook(
    state: RandomKState | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: all-reduces the bucket's entries at k shared random indices.

    ``state=None`` uses ``RandomKState()`` (1% density, seed 0, error feedback), one per
    model.
    """
    if state is None:
        state = default_state(bucket, RandomKState)
    elif not isinstance(state, RandomKState):
        raise TypeError(f"randomk_hook needs a RandomKState or None, got {type(state).__name__}")
    return run_compressed_hook(state, bucket)
