"""DDP communication hooks and their state.

>>> ddp.register_comm_hook(ddpcomm.CompressionState("q4"), ddpcomm.compress_hook)
>>> ddp.register_comm_hook(None, ddpcomm.quantize_hook)                  # q8, defaults

DDP checks hook annotations at registration, so this module keeps real (not
postponed) annotations: ``bucket: dist.GradBucket``, ``-> torch.futures.Future[torch.Tensor]``.

A hook receives one gradient bucket at a time (in bucket index order on every rank) and
returns a Future of the bucket's mean over ranks. ``CompressionState`` holds the method
(a spec string or compressor, see ``ddpcomm.compressors``), the per-bucket
error-feedback residuals and the statistics; ``state=None`` gives each DDP model its own
default state, so two models in one process never share buffers. ``QuantizeState``,
``TopKState`` and ``RandomKState`` with their named hooks are conveniences over it.
"""

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from ddpcomm import agreement, checkpoint, collectives, groups, normalize, traced, two_level
from ddpcomm.adaptive import DEFAULT_EVERY, MIN_EVERY, Adaptive
from ddpcomm.compressors import (
    Compressor,
    NoCompression,
    Quantizer,
    RandomK,
    TopK,
    check_float_tensor,
    check_int,
    check_option,
    check_ramp,
    default_schedule,
    parse,
    ramp_stages,
    resolve_normalize,
    take_state_options,
)
from ddpcomm.context import (
    ReduceContext,
    ResidualMemory,
    Stats,
    Workspace,
)
from ddpcomm.futures import for_reducer
from ddpcomm.layout import LayoutTracker, Reformer, end_iteration, place, watch_casts


class CompressionState:
    """State of ``compress_hook``: the method plus what it remembers across steps.

    Args:
        compression: a spec string (``"q8"``, ``"q4"``, ``"q2"``, ``"q1.5"``, ``"q1"``,
            ``"topk:0.01"``, ``"randk:0.01"``, ``"fp16"``, ``"bf16"``, ``"none"``) or a
            compressor object from ``ddpcomm.compressors``.
        start_iter: iterations (backward passes) before this one use a plain all_reduce:
            the full-precision warm-up. Lets DDP settle its bucket layout and the model
            (and Adam's moments) leave its first, large-gradient steps before compression
            starts. None means the method's default (``compressors.default_schedule``:
            100 for q2 and q1, 200 for top-k or random-k below 25% density, 0 for the
            rest).
        min_numel: buckets with fewer elements go uncompressed (latency-bound anyway).
        process_group: the group to reduce over; None means the default group.
        ramp: iterations after ``start_iter`` that step through milder versions of the
            method before it (``compressors.ramp_stages``: q1 runs q8, q4, q2; topk:0.01
            runs 25%, 6.25%, 1.5625% density), the ``ramp`` iterations split evenly
            between them in order. The residuals carry across stages. None means the
            method's default (200 where ``start_iter``'s default is not 0, else 0). Give
            ``start_iter=0, ramp=0`` to compress from the first iteration. A method with
            no milder stage (q8, the casts, top-k and random-k at 25% or more) refuses a
            ramp > 0.
        adaptive: time the plain and the compressed path per bucket size class and send
            plain where compression does not pay (``ddpcomm.adaptive``). Off by default:
            with it, which buckets are compressed depends on measured speed, so two runs
            of the same script need not give the same numbers bit for bit.
        adaptive_every: steps from one adaptive decision to the next round of timings.
        hierarchy: multi-node training. None (default): one flat reduction over the
            group. An int L: L consecutive ranks of the group form a node, and each
            compressed bucket is reduced in two levels (``two_level.two_level_mean``):
            exactly inside the node (reduce-scatter, the fast link), with the method
            across nodes on 1/L of the bucket per rank (the slow link, the only
            compressed step), then all-gathered inside the node. ``"auto"``: L from
            torchrun's ``LOCAL_WORLD_SIZE``, where every rank reports the same and the
            group falls into whole nodes (``groups.node_size``), else flat. L = 1 or L =
            the group's size means flat (nothing to split, or nothing crosses nodes).
            ``stats()["hierarchy"]`` says what was decided and why, and ``stats()``
            counts bytes inside and across nodes. Warm-up, small and sparse buckets stay
            one flat, exact all_reduce. Not with ``adaptive``.
        **options: the method's options (``block_size``, ``error_feedback``, ...; see its
            class in ``ddpcomm.compressors``), with a spec string only. A spec string may
            also carry them and ``start_iter``, ``min_numel``, ``ramp``, ``hierarchy``
            after commas: ``"q1,start_iter=50,ramp=200"``, ``"q4,hierarchy=auto"``.

    Example::

        state = ddpcomm.CompressionState("q4", error_feedback=True)
        ddp.register_comm_hook(state, ddpcomm.compress_hook)
        ...
        print(state.stats()["compression_ratio"])
    """

    __slots__ = (
        "compressor",
        "adaptive",
        "start_iter",
        "min_numel",
        "ramp",
        "process_group",
        "iteration",
        "memory",
        "workspace",
        "layout",
        "_reformer",
        "_stats",
        "_unchecked",
        "_pending_position",
        "_stages",
        "param_residuals",
        "hierarchy",
        "_nodes",
        "_pending_nodes",
        "__weakref__",
    )

    def __init__(
        self,
        compression: str | Compressor = "q8",
        start_iter: int | None = None,
        min_numel: int = 0,
        process_group: dist.ProcessGroup | None = None,
        ramp: int | None = None,
        adaptive: bool = False,
        adaptive_every: int = DEFAULT_EVERY,
        hierarchy: int | str | None = None,
        **options,
    ) -> None:
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a ProcessGroup or None, got {process_group!r}")
        if isinstance(compression, str):
            compression, spec_state = take_state_options(compression)
            given = {
                "start_iter": start_iter,
                "min_numel": min_numel,
                "ramp": ramp,
                "adaptive": adaptive,
                "adaptive_every": adaptive_every,
                "hierarchy": hierarchy,
            }
            default = {"start_iter": None, "ramp": None, "min_numel": 0, "adaptive": False}
            default["adaptive_every"] = DEFAULT_EVERY
            default["hierarchy"] = None
            for name, value in spec_state.items():
                if given[name] not in (default[name], value):
                    raise ValueError(
                        f"{name} given both in the spec and as a keyword "
                        f"({value!r}, {given[name]!r})"
                    )
                given[name] = value
            start_iter, min_numel, ramp = given["start_iter"], given["min_numel"], given["ramp"]
            adaptive, adaptive_every = given["adaptive"], given["adaptive_every"]
            hierarchy = given["hierarchy"]
        self.compressor = parse(compression, **options)
        self.adaptive = _make_adaptive(self.compressor, adaptive, adaptive_every)
        self.hierarchy = groups.check_hierarchy(hierarchy)
        flat = self.hierarchy is None and self.adaptive is None
        self.compressor = resolve_normalize(self.compressor, flat_hook=flat)
        if self.hierarchy is not None:
            normalize.refuse(self.compressor, "a two-level reduction (hierarchy)")
        if self.adaptive is not None:
            normalize.refuse(self.compressor, "adaptive pass-through")
        if self.hierarchy is not None and self.adaptive is not None:
            raise ValueError(
                f"hierarchy={self.hierarchy!r} cannot be combined with adaptive=True: adaptive "
                "times the flat paths only; give one of them"
            )
        if isinstance(self.hierarchy, int) and dist.is_initialized():
            # Checked here where the group exists already, else at the first reduction.
            groups.node_size(_group(process_group), self.hierarchy)
        # (L, why) once decided, at this process's first iteration (_check_first_iteration).
        self._nodes: tuple[int | None, str] | None = None
        # (local_size,) a loaded state_dict was saved with, checked against the decision.
        self._pending_nodes: tuple[int | None] | None = None
        default_start, default_ramp = default_schedule(self.compressor)
        self.start_iter = check_int(_or(start_iter, default_start), "start_iter", 0)
        self.min_numel = check_int(min_numel, "min_numel", 0)
        self.ramp = check_int(_or(ramp, default_ramp), "ramp", 0)
        self._stages = check_ramp(self.compressor, self.ramp)
        self.process_group = process_group
        self.iteration = 0
        self.memory = ResidualMemory()
        self.workspace = Workspace()
        self.layout = LayoutTracker()
        self._reformer: Reformer | None = None  # set by load_state_dict for one iteration
        self._stats = Stats()
        # True until this process's first iteration has been checked against the other
        # ranks (hooks.py _check_first_iteration); again after load_state_dict.
        self._unchecked = True
        self._pending_position: tuple | None = None  # saved (rank, world) to check
        # Error-feedback residuals of DDP's python_reducer path, per parameter (traced.py).
        self.param_residuals: dict[torch.Tensor, torch.Tensor] = {}

    def stats(self) -> dict:
        """Bytes handed to collectives, the plain all_reduce equivalent, compression time,
        how many buckets took each path, the memory the state holds between steps, and on
        gloo each bucket's all-gather pieces and the link rate they follow. Under DDP's
        python_reducer (compiled autograd) the reductions are counted per parameter, by
        traced.py."""
        d = self._stats.as_dict()
        d["iteration"] = self.iteration
        d["state_bytes"] = self.memory.nbytes()
        d["buffer_bytes"] = self.workspace.nbytes()
        traced.add_counts(self, d)
        if self.workspace.links:  # gloo all-gathers: each bucket's pieces and link rate
            d["gloo_pieces"] = {k: link.as_dict() for k, link in self.workspace.links.items()}
        if self.adaptive is not None:
            d["adaptive"] = self.adaptive.stats(self.start_iter)
        if self.hierarchy is not None:
            local, why = self._nodes or (None, "decided at the first reduction")
            d["hierarchy"] = {"local_size": local, "why": why}
        return d

    def reset_stats(self) -> None:
        self._stats.reset()
        traced.reset_counts(self)
        if self.adaptive is not None:
            self.adaptive.counts.clear()

    def reduce(self, flat: torch.Tensor, key: int, signature: tuple) -> torch.futures.Future:
        """Mean over ranks of one bucket's flat gradients: plain before ``start_iter`` and
        for small buckets, compressed otherwise, in two levels under a ``hierarchy``.
        ``signature`` keys the residuals."""
        local = self._local_size()
        ctx = ReduceContext(
            group=self.process_group,
            memory=self.memory,
            key=key,
            step=self.iteration,
            signature=signature,
            # A flat collective over nodes: its node-crossing share counted too.
            stats=self._stats if local is None else self._stats.flat_over(local),
            workspace=self.workspace,
        )
        if flat.layout != torch.strided:
            return collectives.sparse_all_reduce(flat, ctx)
        normalizing = getattr(self.compressor, "normalize", 0) and flat.numel() >= self.min_numel
        if self.iteration < self.start_iter or flat.numel() < self.min_numel:
            if normalizing:  # the scales form during the plain steps
                normalize.observe(flat, ctx)
            # Exact anyway: one all_reduce, which NCCL already routes by topology.
            return collectives.plain_all_reduce(flat, ctx)
        compressor = self.compressor_at(self.iteration)
        done = self.iteration - self.start_iter  # compressed iterations before this one
        if normalizing:
            ctx.scaling = normalize.scaling(flat, self.compressor, ctx, done)
            return collectives.all_reduce_mean(flat, compressor, ctx)
        if self.adaptive is not None:
            return self.adaptive.reduce(flat, compressor, ctx, done)
        if local is None:
            return collectives.all_reduce_mean(flat, compressor, ctx)
        ctx.stats = self._stats
        topology = groups.topology(ctx.pg, local, flat.device)
        return two_level.two_level_mean(flat, compressor, ctx, topology)

    def _local_size(self) -> int | None:
        """Ranks per node of the two-level reduction, or None for flat. Decided once: for
        ``"auto"`` through the store, which every rank calls at the same point (the first
        bucket of its first iteration, after agreeing on ``hierarchy``)."""
        if self.hierarchy is None:
            return None
        if self._nodes is None:
            self._nodes = agreement.node_size(
                _group(self.process_group), self.hierarchy, limit=agreement.hook_timeout()
            )
        return self._nodes[0]

    def compressor_at(self, iteration: int) -> Compressor:
        """The method iteration ``iteration`` compresses with (at or after ``start_iter``):
        a ramp stage during the ``ramp`` iterations after ``start_iter``, then the method."""
        done = iteration - self.start_iter
        if not self._stages or not 0 <= done < self.ramp:
            return self.compressor
        return self._stages[done * len(self._stages) // self.ramp]

    # -- checkpointing -----------------------------------------------------------------

    def state_dict(self, gather: bool = False) -> dict:
        """Iteration, residuals, bucket layout, method config, and the rank and world size
        the residuals belong to: enough to resume bitwise.

        Load it into a state of the same configuration, registered on the same model
        built the same way, on the same rank, before the first backward pass of the
        resumed run. To save from rank 0 only, call ``state_dict(gather=True)`` on every
        rank (a collective): rank 0 gets every rank's state_dict in one dict, the others
        ``{}``; load that file on every rank. See ``ddpcomm.checkpoint``.
        """
        rank, world = checkpoint.group_position(self.process_group)
        sd = {
            "version": checkpoint.VERSION,
            "rank": rank,
            "world_size": world,
            "config": self.compressor.config(),
            "iteration": self.iteration,
            "start_iter": self.start_iter,
            "min_numel": self.min_numel,
            "ramp": self.ramp,
            "memory": self.memory.state_dict(),
            "layout": self.layout.state_dict(),
            # Shard residuals ("shard:<kind>") cover this rank's shard of each bucket in
            # the node layout decided at the first iteration: both go with them.
            "hierarchy": self.hierarchy,
        }
        if self._nodes is not None:
            sd["local_size"] = self._nodes[0]
        if self.adaptive is not None:
            sd["adaptive"] = self.adaptive.state_dict()
        return checkpoint.gather(sd, self.process_group) if gather else sd

    def load_state_dict(self, sd: dict, reset_residuals: bool = False) -> None:
        """Restores a ``state_dict`` (this rank's own, or a gathered one). DDP's first
        iteration in the new process groups gradients differently from the checkpoint's
        buckets; that iteration reduces them in the saved buckets (ddpcomm.layout), so
        training continues bitwise.

        A model wrapped with another ``bucket_cap_mb`` than the checkpoint's resumes too:
        after that first iteration DDP's own buckets take over each parameter's residual
        from the saved buckets (``context.ResidualMemory``; the two-phase quantizer's
        owner residual is added to the rank's own residual at the same parameters), so no
        error feedback is lost, though the run is no longer bitwise the uninterrupted one.

        Raises, loading nothing, for a malformed state_dict (every field is checked first:
        ``checkpoint.validate``), another method's, or one whose residuals belong to
        another rank or world size; with ``reset_residuals`` the latter keeps the
        iteration and settings and starts residuals from zero.
        """
        if not isinstance(reset_residuals, bool):
            raise TypeError(f"reset_residuals must be a bool, got {reset_residuals!r}")
        sd, drop, pending = checkpoint.select(
            sd, self.process_group, reset_residuals, self.compressor
        )
        ramp = sd.get("ramp", 0)  # absent from checkpoints from before ramps
        if ("adaptive" in sd) != (self.adaptive is not None):
            raise ValueError(
                f"state_dict was saved with adaptive={'adaptive' in sd}, this state has "
                f"adaptive={self.adaptive is not None}"
            )
        saved_hierarchy = sd.get("hierarchy")  # absent from checkpoints before hierarchies
        if saved_hierarchy != self.hierarchy:
            if not reset_residuals:
                raise ValueError(
                    f"state_dict was saved with hierarchy={saved_hierarchy!r}, this state has "
                    f"hierarchy={self.hierarchy!r}: its error-feedback residuals belong to the "
                    "other reduction (a two-level one keeps one shard of each bucket per "
                    "rank). Give the same hierarchy, or load with reset_residuals=True to keep "
                    "the iteration and settings and start the residuals from zero"
                )
            drop = True
        if self.adaptive is not None:
            self.adaptive.load_state_dict(sd["adaptive"])
        self.iteration = sd["iteration"]
        self.start_iter = sd["start_iter"]
        self.min_numel = sd["min_numel"]
        self.ramp = ramp
        self._stages = ramp_stages(self.compressor) if ramp else []
        saved = sd["layout"]
        if drop:
            self.memory = ResidualMemory()
        else:
            self.memory.load_state_dict(sd["memory"], saved)
        self.layout = LayoutTracker(loaded=saved)
        self._reformer = Reformer(saved, self) if saved["layouts"] else None
        self._pending_position = pending
        # The node size the residuals were laid out for, checked against this run's
        # decision at the first iteration (_check_first_iteration).
        self._pending_nodes = None if drop or "local_size" not in sd else (sd["local_size"],)
        self._unchecked = True

    def __getstate__(self) -> dict:
        # Process groups do not pickle; a restored state reduces over the default group.
        return {"compressor": self.compressor, "state": self.state_dict()}

    def __setstate__(self, d: dict) -> None:
        # Checked before __init__ reads the adaptive period from it.
        checkpoint.validate(d["state"])
        adaptive = d["state"].get("adaptive")
        CompressionState.__init__(
            self,
            d["compressor"],
            adaptive=adaptive is not None,
            adaptive_every=adaptive["every"] if adaptive else DEFAULT_EVERY,
            hierarchy=d["state"].get("hierarchy"),
        )
        self.load_state_dict(d["state"])

    def __repr__(self) -> str:
        adaptive = "" if self.adaptive is None else f"adaptive=True (every {self.adaptive.every}), "
        hierarchy = "" if self.hierarchy is None else f"hierarchy={self.hierarchy!r}, "
        return (
            f"{type(self).__name__}({self.compressor!r}, start_iter={self.start_iter}, "
            f"min_numel={self.min_numel}, ramp={self.ramp}, {adaptive}{hierarchy}"
            f"iteration={self.iteration})"
        )


def _or(value, default):
    return default if value is None else value


def _group(pg: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return pg if pg is not None else dist.group.WORLD


def _make_adaptive(compressor: Compressor, adaptive, every) -> Adaptive | None:
    """The state's ``Adaptive`` router, or None."""
    if not isinstance(adaptive, bool):
        raise TypeError(f"adaptive must be a bool, got {adaptive!r}")
    every = check_int(every, "adaptive_every", MIN_EVERY)  # checked even when unused
    if not adaptive:
        return None
    if not compressor.lossy:
        raise ValueError(
            f"adaptive needs a compressing method; {compressor.spec!r} is the plain path already"
        )
    return Adaptive(every)


class _MethodState(CompressionState):
    """A ``CompressionState`` whose method is fixed: ``cls(*args, **options)`` builds
    ``CompressionState(cls.method(*args, **method_options), start_iter, min_numel,
    process_group, ramp, ..., hierarchy)``, so the method's arguments and defaults are its
    class's alone."""

    __slots__ = ()
    method: type[Compressor]

    def __init__(
        self,
        *args,
        start_iter: int | None = None,
        min_numel: int = 0,
        process_group: dist.ProcessGroup | None = None,
        ramp: int | None = None,
        adaptive: bool = False,
        adaptive_every: int = DEFAULT_EVERY,
        hierarchy: int | str | None = None,
        **options,
    ) -> None:
        for name, value in options.items():
            check_option(self.method, name, f"{type(self).__name__}({name}={value!r})")
        super().__init__(
            self.method(*args, **options),
            start_iter,
            min_numel,
            process_group,
            ramp,
            adaptive=adaptive,
            adaptive_every=adaptive_every,
            hierarchy=hierarchy,
        )


class QuantizeState(_MethodState):
    """``CompressionState`` of a ``Quantizer(bits=8, block_size=None, stochastic=False,
    error_feedback=None, algorithm="auto", seed=0)``: block-wise b-bit quantization.

    Example::

        ddp.register_comm_hook(ddpcomm.QuantizeState(bits=4), ddpcomm.quantize_hook)
    """

    __slots__ = ()
    method = Quantizer


class TopKState(_MethodState):
    """``CompressionState`` of a ``TopK(ratio=0.01, approximate=False, error_feedback=True,
    value_dtype=None)``: each rank sends its k = ceil(ratio * n) largest entries.
    ``stats()["paths"]`` counts ``topk_all_gather`` (sparse payloads) and ``topk_dense``
    (buckets where the payloads would outweigh a dense all_reduce).

    Example::

        ddp.register_comm_hook(ddpcomm.TopKState(ratio=0.01), ddpcomm.topk_hook)
    """

    __slots__ = ()
    method = TopK


class RandomKState(_MethodState):
    """``CompressionState`` of a ``RandomK(ratio=0.01, seed=0, error_feedback=True)``:
    every rank sends its entries at the same k random indices.

    Example::

        ddp.register_comm_hook(ddpcomm.RandomKState(ratio=0.05), ddpcomm.randomk_hook)
    """

    __slots__ = ()
    method = RandomK


# --------------------------------------------------------------------------------------
# Hooks
# --------------------------------------------------------------------------------------

# Parameter -> the default state of the model it belongs to. A hook cannot see its DDP
# module, but a bucket's parameters belong to exactly one model; weak keys let a deleted
# model's state go with it (keyed by identity: tensors compare elementwise).
_DEFAULT_STATES = WeakIdKeyDictionary()


def _state_for(state, bucket: dist.GradBucket, cls: type, hook: str) -> CompressionState:
    """``state`` checked against ``cls``, or for None the model's default ``cls()``."""
    if state is not None:
        if not isinstance(state, cls):
            raise TypeError(f"{hook} needs a {cls.__name__} or None, got {type(state).__name__}")
        return state
    params = [bucket[1]] if isinstance(bucket, tuple) else bucket.parameters()
    found = [s for s in map(_DEFAULT_STATES.get, params) if type(s) is cls]
    default = found[0] if found else cls()
    for p in params:
        _DEFAULT_STATES[p] = default
    return default


def _hook(state: CompressionState, bucket: dist.GradBucket, hook: str) -> torch.futures.Future:
    """The body of every compressing hook. Residuals are keyed by bucket index and laid out
    over the bucket's parameters (``layout.place``): DDP's bucket rebuild hands each
    parameter's residual to its new bucket instead of applying it to the wrong parameters
    or dropping it, and what no bucket uses is dropped at the end of the iteration."""
    if isinstance(bucket, tuple):
        # DDP's python_reducer (optimize_ddp="python_reducer", compiled autograd) calls
        # hooks per parameter with (grad, param) and ignores the return value.
        return traced.hook(state, bucket, hook)
    buffer = bucket.buffer()
    if buffer.layout == torch.strided:
        check_float_tensor(buffer, "bucket")
    index = bucket.index()
    params = bucket.parameters()
    if index == 0 and state.layout.serves_another_model(params):
        raise ValueError(
            f"{hook}: this {type(state).__name__} already serves another DDP model; two "
            "models sharing one state would mix their residuals and count each iteration "
            "twice. Give each model its own state (state=None does that)"
        )
    if state._unchecked:
        _check_first_iteration(state, buffer, index, hook)
        if params:
            # A cast of the model after DDP wrapped it silences DDP, and this hook with it.
            watch_casts(params[0], state)
    ords = state.layout.observe(params)
    reformer = state._reformer
    if buffer.layout != torch.strided:
        fut = state.reduce(buffer, index, ())  # sparse: reduced plainly, never re-formed
    elif reformer is not None and not reformer.matches(index, ords):
        fut = reformer.add(bucket, ords, params)  # the first iteration after a resume
    else:
        fut = state.reduce(buffer, index, place(state, index, ords, buffer.device))
    if bucket.is_last():
        state.iteration += 1
        state._reformer = None  # DDP has its own layout from now on
        state._unchecked = False
        end_iteration(state)
    return for_reducer(fut)


def _check_first_iteration(state, buffer: torch.Tensor, index: int, hook: str) -> None:
    """Every bucket of this process's first iteration: every rank must reduce a bucket of
    the same size and dtype the same way (method, options, start_iter, min_numel,
    iteration, ramp, hierarchy and the node size decided from it). After it DDP's buckets
    are rank 0's layout, broadcast, and which path a bucket takes follows from the
    settings agreed here."""
    checkpoint.check_pending_position(state, hook)
    fields = _bucket_fields(state.compressor, state, buffer, index)
    pg = state.process_group if state.process_group is not None else dist.group.WORLD
    agreement.agree(
        pg,
        fields,
        f"bucket {index} of a ddpcomm DDP comm hook's first iteration "
        f"(iteration {state.iteration})",
        note=f"{hook} with {type(state).__name__}",
        limit=agreement.hook_timeout(),
    )
    if state.hierarchy is not None:
        # After agreeing on ``hierarchy``: for "auto" every rank is then in the same store
        # exchange. Later buckets' records carry the decision.
        local = state._local_size()
        if state._pending_nodes is not None:
            (saved,) = state._pending_nodes
            state._pending_nodes = None
            if saved != local:
                raise ValueError(
                    f"{hook}: loaded state_dict was saved reducing over nodes of {saved} ranks "
                    f"(None: flat), this run decides {local} ({state._nodes[1]}): its "
                    "error-feedback residuals belong to the other layout. Resume with the "
                    "same nodes, or load with reset_residuals=True"
                )


def _bucket_fields(compressor: Compressor, state, buffer: torch.Tensor, index: int) -> dict:
    fields = {"call": "DDP comm hook", **agreement.method_fields(compressor)}
    if state is not None and state.hierarchy is not None:
        # Unlike start_iter below, also for "none": its two-level path issues other
        # collectives than the flat one (and than allreduce_hook).
        fields["hierarchy"] = state.hierarchy
        if state._nodes is not None:
            fields["local_size"] = state._nodes[0]
    if compressor.lossy:
        # The lossless path ignores them: a "none" state and allreduce_hook agree.
        fields["start_iter"] = state.start_iter
        fields["min_numel"] = state.min_numel
        fields["ramp"] = state.ramp
        fields["iteration"] = state.iteration
        fields["adaptive"] = state.adaptive is not None
        if state.adaptive is not None:
            fields["adaptive_every"] = state.adaptive.every
    fields["bucket"] = index
    fields["numel"] = buffer.numel()
    fields["dtype"] = agreement.plain(buffer.dtype)
    if buffer.layout != torch.strided:
        fields["layout"] = str(buffer.layout)
    return fields


def compress_hook(
    state: CompressionState | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: the bucket's mean over ranks, sent with ``state``'s method.

    ``state=None`` uses ``CompressionState()`` (q8, defaults), one per DDP model.
    """
    return _hook(
        _state_for(state, bucket, CompressionState, "compress_hook"), bucket, "compress_hook"
    )


def quantize_hook(
    state: QuantizeState | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """``compress_hook`` for a ``QuantizeState``; ``None`` means ``QuantizeState()`` (q8)."""
    return _hook(_state_for(state, bucket, QuantizeState, "quantize_hook"), bucket, "quantize_hook")


def topk_hook(
    state: TopKState | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """``compress_hook`` for a ``TopKState``; ``None`` means ``TopKState()`` (1%, exact, EF)."""
    return _hook(_state_for(state, bucket, TopKState, "topk_hook"), bucket, "topk_hook")


def randomk_hook(
    state: RandomKState | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """``compress_hook`` for a ``RandomKState``; ``None`` means ``RandomKState()`` (1%, EF)."""
    return _hook(_state_for(state, bucket, RandomKState, "randomk_hook"), bucket, "randomk_hook")


def allreduce_hook(
    state: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: the plain, lossless mean (what DDP does without a hook), bitwise.

    ``state`` is the process group to use, or None for the default group. In a model's
    first iteration it takes part in the rank agreement like the compressing hooks, so a
    rank running it while another runs a compressing hook is an error on both.
    """
    if state is not None and not isinstance(state, dist.ProcessGroup):
        raise TypeError(f"allreduce_hook takes a ProcessGroup or None, got {type(state).__name__}")
    if isinstance(bucket, tuple):  # DDP's python_reducer: (grad, param), see _hook
        grad, param = bucket
        traced.reduce_param(NoCompression(), {}, grad, param, state, 0)
        return grad
    buffer = bucket.buffer()
    params = bucket.parameters()
    if params and params[0] not in _PLAIN_SEEN:  # this model's first iteration
        agreement.agree(
            state if state is not None else dist.group.WORLD,
            _bucket_fields(NoCompression(), None, buffer, bucket.index()),
            f"bucket {bucket.index()} of a ddpcomm DDP comm hook's first iteration",
            note="allreduce_hook",
            limit=agreement.hook_timeout(),
        )
        for p in params:
            _PLAIN_SEEN[p] = True
    if buffer.layout != torch.strided:
        return collectives.sparse_all_reduce(buffer, ReduceContext(group=state))
    return collectives.plain_all_reduce(buffer, ReduceContext(group=state))


# Parameters whose model has had its first iteration under allreduce_hook.
_PLAIN_SEEN = WeakIdKeyDictionary()
