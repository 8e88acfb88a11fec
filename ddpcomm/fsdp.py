"""Compressed gradient reduction for FSDP2 (``torch.distributed.fsdp.fully_shard``).

>>> model = fully_shard(model)                                  # after sharding layers
>>> state = ddpcomm.fsdp.compress(model, "q8")                  # every FSDP module
>>> layer.set_custom_reduce_scatter(ddpcomm.fsdp.ReduceScatter("q4"))   # or one by hand
>>> state.stats()["compression_ratio"]

FSDP2 reduce-scatters each parameter group's gradients once per backward. ``ReduceScatter``
is a torch ``ReduceScatter`` comm (``FSDPModule.set_custom_reduce_scatter``) that does it
compressed with any ddpcomm method (``ddpcomm.reduce_scatter``): each destination chunk is
compressed into one packed buffer, one ``all_to_all_single`` delivers it, and its owner
sums the N payloads in fp32. FSDP's ``op`` (SUM, AVG or PREMUL_SUM for a divide factor)
and ``reduce_dtype`` are honoured. HSDP's replica all-reduce (shard with a 1-D mesh, pass
``replicate_group``) runs ddpcomm's DDP algorithms through ``set_all_reduce_hook``.

Error feedback (on by default for q1, q2, topk, randk) keeps, per FSDP parameter group,
what compression dropped from this rank's *unsharded* gradient: 4 bytes per parameter
element on every rank, as much as an fp32 copy of the whole model's gradients, which
FSDP otherwise never holds. ``residual_dtype=torch.bfloat16`` halves that (the residual
is rounded to bf16 between steps); ``error_feedback=False`` removes it. The HSDP replica
all-reduce adds a residual of the shard's size (1/N of that).

Ranks agree before they reduce. At each parameter group's first reduce-scatter (and first
replica all-reduce) every rank publishes what it is about to do (the method and its
options, start_iter, min_numel, the step, the tensor's size, dtype and op) through the
group's store (``ddpcomm.agreement``, as the DDP hooks do): ranks that differ raise the
same ValueError naming the setting, and a rank that runs FSDP's own reduce-scatter (or
no ddpcomm at all) is named after ``DDPCOMM_AGREEMENT_TIMEOUT`` seconds (default 10),
instead of pairing a compressed collective with whatever that rank issues. ``compress``
refuses what would reduce silently wrong: a ``replicate_group`` sharing ranks with the
shard group, a model that already has a custom reduce-scatter (ddpcomm's or another),
and one state for two models.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _TorchReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from ddpcomm import agreement, checkpoint, collectives, normalize, reduce_scatter
from ddpcomm.compressors import Compressor, NoCompression, check_int, parse, take_state_options
from ddpcomm.context import ReduceContext, ResidualMemory, Stats, Workspace
from ddpcomm.futures import completed

RESIDUAL_DTYPES = (torch.float32, torch.bfloat16)
# state_dict format. Checkpoints written before the field existed are version 1.
VERSION = 1
_SD_KEYS = ("config", "steps", "memory")
# The hook states' options that FSDP2 has no use for: one reduction per parameter group
# and backward has no DDP buckets to ramp or route, and HSDP is its own two-level form.
_DDP_ONLY_OPTIONS = ("ramp", "adaptive", "adaptive_every", "hierarchy")
_DDP_ONLY_WHY = {
    "hierarchy": "; HSDP (fully_shard over a 2-D DeviceMesh: sharded inside a node, "
    "replicated across nodes) is FSDP2's two-level form, and ddpcomm.fsdp.compress "
    "compresses its replica all-reduce"
}
_INT64_MAX = 2**63 - 1


class _SharedWorkspace(Workspace):
    """Grow-only scratch buffers shared by every parameter group.

    DDP keeps buffers per bucket; FSDP exists to never hold unsharded-size memory for
    every layer at once. FSDP reduces one group at a time on one stream (a CUDA stream's
    kernels run in order), so consecutive calls can share each buffer, sized by the
    largest group.
    """

    __slots__ = ()

    def get(self, name: str, key, nbytes: int, device) -> torch.Tensor:
        buf = self.buffers.get((name, device))
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self.buffers[(name, device)] = buf
        return buf[:nbytes]


class _ResidualMemory(ResidualMemory):
    """``ResidualMemory`` with a storage dtype, and a loaded (CPU) residual moved to the
    device it is used on instead of being reset there."""

    __slots__ = ()

    def get(self, kind, key, numel, device, signature=None, dtype=torch.float32):
        k, device = (kind, key), torch.device(device)
        buf = self.buffers.get(k)
        if buf is not None and buf.device != device:
            buf = self.buffers[k] = buf.to(device)
        if (
            buf is None
            or buf.numel() != numel
            or buf.dtype != dtype
            or self.signatures.get(k) != signature
        ):
            buf = self.buffers[k] = torch.zeros(numel, dtype=dtype, device=device)
            self.signatures[k] = signature
        return buf


class FSDPCompressionState:
    """The method, residuals, step counters and statistics of FSDP2 gradient compression.

    ``compress`` makes one and shares it among the comms it installs; a ``ReduceScatter``
    built from a spec makes its own. Arguments as ``ddpcomm.CompressionState``'s
    (``compression``, ``start_iter``, ``min_numel``, method ``**options``), plus
    ``residual_dtype``: float32 (default) or bfloat16 error-feedback storage. A spec
    string may carry ``start_iter`` and ``min_numel`` too (``"q2,start_iter=100"``);
    ``start_iter`` and ``min_numel`` default to 0. DDP's ``ramp``, ``adaptive`` and
    ``adaptive_every`` are refused: FSDP2 reduces each parameter group once per backward,
    with no buckets to ramp or route.
    """

    __slots__ = (
        "compressor",
        "start_iter",
        "min_numel",
        "residual_dtype",
        "memory",
        "steps",
        "_stats",
        "_rs_workspace",
        "_ar_workspace",
        "_agreed",
        "_names",
        "_model",
        "_pending_position",
    )

    def __init__(
        self,
        compression: str | Compressor = "q8",
        *,
        start_iter: int | None = None,
        min_numel: int | None = None,
        residual_dtype: torch.dtype = torch.float32,
        **options,
    ) -> None:
        given = {"start_iter": start_iter, "min_numel": min_numel}
        ddp_only = [name for name in _DDP_ONLY_OPTIONS if name in options]
        if ddp_only:
            raise ValueError(
                f"FSDP2 does not take {ddp_only[0]} (an option of the DDP hook states"
                f"{_DDP_ONLY_WHY.get(ddp_only[0], '')}); FSDPCompressionState takes "
                f"start_iter and min_numel, got {ddp_only[0]}={options[ddp_only[0]]!r}"
            )
        if isinstance(compression, str):
            spec = compression
            compression, spec_state = take_state_options(spec)
            for name, value in spec_state.items():
                if name not in given:
                    raise ValueError(
                        f"compression spec {spec!r}: FSDP2 does not take {name} (an option of "
                        f"the DDP hook states{_DDP_ONLY_WHY.get(name, '')}); "
                        "FSDPCompressionState takes start_iter and min_numel"
                    )
                if given[name] is not None and given[name] != value:
                    raise ValueError(
                        f"{name} given both in the compression spec {spec!r} ({value!r}) and "
                        f"as a keyword ({given[name]!r})"
                    )
                given[name] = value
        self.compressor = parse(compression, **options)
        normalize.refuse(self.compressor, "FSDP's reduce-scatter")
        self.start_iter = check_int(_or_zero(given["start_iter"]), "start_iter", 0)
        self.min_numel = check_int(_or_zero(given["min_numel"]), "min_numel", 0)
        if not isinstance(residual_dtype, torch.dtype):
            raise TypeError(f"residual_dtype must be a torch.dtype, got {residual_dtype!r}")
        if residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(
                f"residual_dtype must be torch.float32 or torch.bfloat16, got {residual_dtype}"
            )
        self.residual_dtype = residual_dtype
        self.memory = _ResidualMemory()
        self.steps: dict[str, int] = {}  # reductions done per key ("rs:<group>", "ar:<group>")
        self._stats = Stats()
        # Reduce-scatters and HSDP all-reduces run on different CUDA streams: their
        # buffers must not be shared.
        self._rs_workspace = _SharedWorkspace()
        self._ar_workspace = _SharedWorkspace()
        # Process group -> keys whose first reduction the ranks agreed on.
        self._agreed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._names = itertools.count()
        self._model: weakref.ref | None = None  # the model ``compress`` installed this on
        # (rank, world size) a loaded state_dict's residuals belong to, checked at the first
        # reduction when it was loaded before init_process_group.
        self._pending_position: tuple | None = None

    def config(self) -> tuple:
        """The settings a state_dict must match to be loaded."""
        return (
            *self.compressor.config(),
            self.start_iter,
            self.min_numel,
            str(self.residual_dtype),
        )

    def stats(self) -> dict:
        """``ddpcomm.CompressionState.stats()``'s keys: bytes handed to collectives
        against FSDP's plain reduce-scatter (and, for HSDP, plain all-reduce), time spent
        (de)compressing, calls per path, ``iteration``: reductions of the most-reduced
        parameter group so far, and the residuals' and scratch buffers' bytes."""
        d = self._stats.as_dict()
        d["iteration"] = max(self.steps.values(), default=0)
        d["state_bytes"] = self.memory.nbytes()
        d["buffer_bytes"] = self._rs_workspace.nbytes() + self._ar_workspace.nbytes()
        return d

    def reset_stats(self) -> None:
        self._stats.reset()

    def _agree(self, group: dist.ProcessGroup, key: str, tensor, call: str, **extra) -> None:
        """At a parameter group's first reduction on ``group`` (again after
        load_state_dict), compressed or not: every rank must reduce a tensor of the same
        size, dtype and op the same way, or the collectives below pair with different
        ones on the other ranks. Through the group's store (``ddpcomm.agreement``, as the
        DDP hooks): a rank that runs FSDP's own reduce-scatter never publishes, and is
        named after the agreement's deadline instead of at the group's timeout."""
        if self._pending_position is not None:
            _check_position(self._pending_position)
            self._pending_position = None
        done = self._agreed.setdefault(group, set())
        if key in done:
            return
        fields = {"call": f"ddpcomm.fsdp {call}", **agreement.method_fields(self.compressor)}
        if self.compressor.lossy:
            # The lossless path ignores them: it is FSDP's own collective.
            fields["start_iter"] = self.start_iter
            fields["min_numel"] = self.min_numel
            fields["step"] = self.steps.get(key, 0)
        if self.compressor.error_feedback:
            fields["residual_dtype"] = agreement.plain(self.residual_dtype)
        fields.update(extra)
        fields["numel"] = tensor.numel()
        fields["dtype"] = agreement.plain(tensor.dtype)
        agreement.agree(
            group,
            fields,
            f"the first {call} of FSDP parameter group {key[3:]!r} (ddpcomm.fsdp)",
            limit=agreement.hook_timeout(),
        )
        done.add(key)

    def _plain(self, key: str, numel: int) -> bool:
        return (
            isinstance(self.compressor, NoCompression)
            or self.steps.get(key, 0) < self.start_iter
            or numel < self.min_numel
        )

    # -- the reduce-scatter ------------------------------------------------------------

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        name: str,
        layout: tuple[int, ...] | None = None,
    ) -> None:
        """One FSDP reduce-scatter of the parameter group ``name``. ``layout`` (elements
        per rank of each parameter of the group) tells a full-group call from one that
        reduces only the parameters that got gradients; residuals serve full calls only."""
        _check_pair(output, input, group)
        key = "rs:" + name
        self._agree(group, key, input, "reduce-scatter", op=_op_name(op))
        ctx = ReduceContext(
            group=group,
            key=key,
            step=self.steps.get(key, 0),
            stats=self._stats,
            workspace=self._rs_workspace,
        )
        if self._plain(key, input.numel()):
            reduce_scatter.plain(output, input, op, ctx)
        else:
            self.compressor.check_tensor(input, "input_tensor")
            stored = self._residual(key, input, group, layout)
            residual = None if stored is None else stored.float()  # itself when fp32
            finite = reduce_scatter.reduce_scatter(
                output, input, self.compressor, op, ctx, residual
            )
            if stored is not None:
                if finite is not None:
                    residual.masked_fill_(finite.logical_not(), 0.0)
                if residual is not stored:
                    stored.copy_(residual)
        self.steps[key] = ctx.step + 1

    def _residual(self, key, input, group, layout) -> torch.Tensor | None:
        if not self.compressor.error_feedback:
            return None
        world = dist.get_world_size(group)
        if layout is not None and sum(layout) * world != input.numel():
            # Only the parameters that got gradients are reduced (FSDP skips the others
            # unless set_reduce_scatter_unused_params): this call's layout is not the
            # residual's. It goes without error feedback; the residual is dropped.
            self.memory.buffers.pop(("rs", key), None)
            return None
        signature = (world, layout if layout is not None else input.numel())
        return self.memory.get(
            "rs", key, input.numel(), input.device, signature, dtype=self.residual_dtype
        )

    # -- checkpointing -----------------------------------------------------------------

    def state_dict(self) -> dict:
        """Step counters, residuals and config: resuming continues bitwise. Load it into
        a state of the same config, installed on the same model, before its first step."""
        rank, world = checkpoint.group_position(None)
        return {
            "version": VERSION,
            "rank": rank,  # the default group's: the process whose residuals these are
            "world_size": world,
            "config": self.config(),
            "steps": dict(self.steps),
            "memory": self.memory.state_dict(),
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restores a ``state_dict``. Raises, loading nothing, for another config's or a
        malformed one (naming the field): a checkpoint is either resumed bitwise or
        refused, never partly dropped. The ranks agree again at the next reduction of
        each parameter group, so one rank resuming from another step is an error."""
        steps, memory = _validate(sd, self.config(), self.residual_dtype)
        # Residuals belong to the process that made them: rank 0's on rank 1 would feed
        # another rank's leftovers into this rank's gradients.
        saved = (sd.get("rank"), sd.get("world_size")) if memory["buffers"] else None
        if saved is not None and saved[0] is not None and dist.is_initialized():
            _check_position(saved)
            saved = None
        self.steps = steps
        self.memory.load_state_dict(memory)
        self._agreed = weakref.WeakKeyDictionary()
        self._pending_position = saved if saved is not None and saved[0] is not None else None

    def __getstate__(self) -> dict:
        return {
            "compressor": self.compressor,
            "residual_dtype": self.residual_dtype,
            "state": self.state_dict(),
            "start_iter": self.start_iter,
            "min_numel": self.min_numel,
        }

    def __setstate__(self, d: dict) -> None:
        FSDPCompressionState.__init__(
            self,
            d["compressor"],
            start_iter=d["start_iter"],
            min_numel=d["min_numel"],
            residual_dtype=d["residual_dtype"],
        )
        self.load_state_dict(d["state"])

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.compressor!r}, start_iter={self.start_iter}, "
            f"min_numel={self.min_numel}, residual_dtype={self.residual_dtype})"
        )


def _or_zero(value):
    return 0 if value is None else value


def _op_name(op) -> str:
    kind = getattr(op, "op", op)  # ReduceOp.PREMUL_SUM(f) holds its RedOpType
    return getattr(kind, "name", str(kind))


def _validate(sd, config: tuple, residual_dtype: torch.dtype) -> tuple[dict, dict]:
    """(steps, memory) of a well-formed FSDPCompressionState state_dict saved with
    ``config``; otherwise a TypeError (not a dict) or a ValueError naming the field."""
    if not isinstance(sd, Mapping):
        raise TypeError(
            "state_dict must be a dict from FSDPCompressionState.state_dict(), got "
            f"{type(sd).__name__}"
        )
    missing = [k for k in _SD_KEYS if k not in sd]
    unknown = [k for k in sd if k not in ("version", "rank", "world_size", *_SD_KEYS)]
    if missing or unknown:
        raise ValueError(
            f"not an FSDPCompressionState state_dict: missing {missing}, unknown {unknown} "
            f"(it has 'version', {', '.join(map(repr, _SD_KEYS))})"
        )
    for key in ("rank", "world_size"):
        if sd.get(key) is not None:
            try:
                check_int(sd[key], f"state_dict[{key!r}]", 0, _INT64_MAX)
            except TypeError as exc:
                raise ValueError(str(exc)) from None
    version = sd.get("version", 1)
    if type(version) is not int or version != VERSION:
        raise ValueError(
            f"state_dict['version'] must be {VERSION} (the format this ddpcomm reads), "
            f"got {version!r}"
        )
    if not isinstance(sd["config"], (tuple, list)):
        raise ValueError(f"state_dict['config'] must be a tuple, got {sd['config']!r}")
    if tuple(sd["config"]) != config:
        raise ValueError(
            f"state_dict was saved with config {tuple(sd['config'])}, this state has {config}"
        )
    if not isinstance(sd["steps"], Mapping):
        raise ValueError(f"state_dict['steps'] must be a dict, got {type(sd['steps']).__name__}")
    steps = {}
    for key, value in sd["steps"].items():
        if not (isinstance(key, str) and key[:3] in ("rs:", "ar:")):
            raise ValueError(
                f"state_dict['steps'] keys must be 'rs:<group>' or 'ar:<group>', got {key!r}"
            )
        try:
            steps[key] = check_int(value, f"state_dict['steps'][{key!r}]", 0, _INT64_MAX)
        except TypeError as exc:  # a bool or a float: malformed, like the rest
            raise ValueError(str(exc)) from None
    memory = sd["memory"]
    if not (
        isinstance(memory, Mapping)
        and isinstance(memory.get("buffers"), Mapping)
        and isinstance(memory.get("signatures"), Mapping)
    ):
        raise ValueError("state_dict['memory'] must be a dict with 'buffers' and 'signatures'")
    for key, buf in memory["buffers"].items():
        field = f"state_dict['memory']['buffers'][{key!r}]"
        name = key[1] if isinstance(key, tuple) and len(key) == 2 else None
        if not (isinstance(name, str) and name[:3] in ("rs:", "ar:")):
            raise ValueError(f"{field}: keys must be (kind, 'rs:<group>' or 'ar:<group>')")
        # The reduce-scatter's residuals are stored in residual_dtype; the replica
        # all-reduce's are the DDP algorithms', always float32.
        dtype = residual_dtype if name.startswith("rs:") else torch.float32
        if not (isinstance(buf, torch.Tensor) and buf.dtype == dtype and buf.dim() == 1):
            raise ValueError(f"{field} must be a 1-D {dtype} tensor, got {buf!r:.80}")
        if not bool(torch.isfinite(buf).all()):
            raise ValueError(
                f"{field} holds NaN or Inf (a residual is reset after a non-finite step, "
                "never saved so)"
            )
        if key not in memory["signatures"]:
            raise ValueError(
                f"state_dict['memory']['signatures'] has no entry for {key!r}: the residual "
                "would be dropped at its first use"
            )
    return steps, memory


def _check_position(saved: tuple) -> None:
    """Raises ValueError when residuals saved at (rank, world size) ``saved`` of the default
    group are not this process's."""
    now = checkpoint.group_position(None)
    if tuple(saved) != now:
        raise ValueError(
            "FSDPCompressionState.load_state_dict: this state_dict holds the error-feedback "
            f"residuals of rank {saved[0]} of {saved[1]}, and this is rank {now[0]} of "
            f"{now[1]}: a residual is what compression left out of that rank's own "
            "gradients. Save every rank's own state_dict() and load it on the same rank"
        )


def _check_pair(output, input, group) -> None:
    for arg, t in (("output_tensor", output), ("input_tensor", input)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{arg} must be a contiguous 1-D tensor, got shape {tuple(t.shape)}")
    if output.dtype != input.dtype or output.device != input.device:
        raise ValueError(
            f"output_tensor ({output.dtype}, {output.device}) and input_tensor "
            f"({input.dtype}, {input.device}) must share dtype and device"
        )
    world = dist.get_world_size(group)
    if input.numel() != world * output.numel():
        raise ValueError(
            f"input_tensor must hold {world} x output_tensor's {output.numel()} elements, "
            f"got {input.numel()}"
        )


class ReduceScatter(_TorchReduceScatter):
    """A torch FSDP2 ``ReduceScatter`` comm that compresses the gradient reduce-scatter.

    Args:
        compression: a spec string (``"q8"``, ``"q4"``, ``"q2"``, ``"q1.5"``, ``"q1"``,
            ``"topk:0.01"``, ``"randk:0.01"``, ``"fp16"``, ``"bf16"``, ``"none"``), a
            compressor, or an ``FSDPCompressionState`` to share (then no options).
        name: the key of this comm's residuals and step counter in the state (and its
            state_dict); default: a number in creation order.
        **options: ``FSDPCompressionState``'s (``start_iter``, ``min_numel``,
            ``residual_dtype``) and the method's (``block_size``, ``error_feedback``, ...).

    Install one instance per FSDP module: error-feedback residuals belong to the instance
    (``compress`` does this for a whole model). ``none`` is FSDP's own reduce-scatter.

    Example::

        layer.set_custom_reduce_scatter(ddpcomm.fsdp.ReduceScatter("q4"))
    """

    def __init__(
        self,
        compression: str | Compressor | FSDPCompressionState = "q8",
        *,
        name: str | None = None,
        _layout: tuple[int, ...] | None = None,
        **options,
    ) -> None:
        if isinstance(compression, FSDPCompressionState):
            if options:
                raise ValueError("options cannot be combined with an FSDPCompressionState")
            self.state = compression
        else:
            self.state = FSDPCompressionState(compression, **options)
        if name is None:
            name = f"#{next(self.state._names)}"
        if not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {name!r}")
        self.name = name
        self._layout = _layout
        self._task = None  # the backward pass of the last call (shared-instance check)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP's reduce-scatter input and output buffers: plain device memory."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op,
        async_op: bool = False,
    ):
        task = torch._C._current_graph_task_id()  # -1 outside a backward pass
        if task >= 0 and task == self._task and self.state.compressor.error_feedback:
            raise ValueError(
                f"ddpcomm.fsdp.ReduceScatter {self.name!r} was called twice in one "
                "backward pass: it is installed on several FSDP modules, whose residuals "
                "would mix. Install one instance per module (ddpcomm.fsdp.compress does), "
                "or pass error_feedback=False."
            )
        self._task = task
        self.state.reduce_scatter(output_tensor, input_tensor, group, op, self.name, self._layout)
        if not async_op:
            return None
        # The work is done (gloo) or ordered on the current stream (NCCL): a completed
        # device future, whose waiters wait for that stream.
        fut = completed(output_tensor, output_tensor.device)
        return torch._C._distributed_c10d._create_work_from_future(fut)

    def stats(self) -> dict:
        return self.state.stats()

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.state.load_state_dict(sd)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.state.compressor!r}, name={self.name!r})"


class _ReplicaAllReduce:
    """HSDP's replica all-reduce as an FSDP ``all_reduce_hook``: the mean over
    ``group`` of the group's reduce-scatter output, in place, with the DDP algorithms.

    FSDP (sharding over a 1-D mesh) has divided by the shard count only, so the mean
    over replicas makes the mean over all ranks; with a custom gradient divide factor
    FSDP's native HSDP sums replicas instead, and so does this (mean times replicas).
    """

    def __init__(self, state: FSDPCompressionState, group, name: str, param_group) -> None:
        self.state = state
        self._group = weakref.ref(group)
        self.key = "ar:" + name
        self._param_group = param_group

    def __call__(self, reduce_output: torch.Tensor) -> None:
        state, group = self.state, self._group()
        if group is None:
            raise RuntimeError("ddpcomm: the replicate process group was destroyed")
        flat = reduce_output
        # The replicas must hold the same shard: the same place in shard groups of the
        # same size (a replicate group across shard positions averages different
        # parameters, which compress cannot see from one rank's groups alone).
        mesh_info = self._param_group.mesh_info
        factor = getattr(self._param_group, "gradient_divide_factor", None)
        state._agree(
            group,
            self.key,
            flat,
            "HSDP replica all-reduce",
            shard_rank=mesh_info.shard_mesh_rank,
            shard_size=mesh_info.shard_mesh_size,
            divide_factor=factor,
        )
        ctx = ReduceContext(
            group=group,
            memory=state.memory,
            key=self.key,
            step=state.steps.get(self.key, 0),
            signature=(dist.get_world_size(group), flat.numel()),
            stats=state._stats,
            workspace=state._ar_workspace,
        )
        if state._plain(self.key, flat.numel()):
            fut = collectives.plain_all_reduce(flat, ctx)
        else:
            fut = collectives.all_reduce_mean(flat, state.compressor, ctx)
        fut.wait()
        if factor is not None:
            flat.mul_(dist.get_world_size(group))
        state.steps[self.key] = ctx.step + 1


def _as_group(replicate_group) -> dist.ProcessGroup | None:
    if replicate_group is None or isinstance(replicate_group, dist.ProcessGroup):
        return replicate_group
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(replicate_group, DeviceMesh):
        if replicate_group.ndim != 1:
            raise ValueError(
                f"replicate_group must be a 1-D DeviceMesh, got {replicate_group.ndim} dims"
            )
        return replicate_group.get_group()
    raise TypeError(
        f"replicate_group must be a ProcessGroup, a 1-D DeviceMesh or None, got {replicate_group!r}"
    )


def _param_group(module: FSDPModule, name: str):
    """The module's one FSDP parameter group, or None when it manages no parameters."""
    groups = module._get_fsdp_state()._fsdp_param_groups
    if len(groups) > 1:
        raise ValueError(
            f"module {name!r} has {len(groups)} FSDP parameter groups (a per-parameter "
            "mesh); FSDP2 takes a custom reduce-scatter only for a single group"
        )
    return groups[0] if groups else None


def compress(
    model: nn.Module,
    compression: str | Compressor | FSDPCompressionState = "q8",
    *,
    replicate_group: dist.ProcessGroup | None = None,
    **options,
) -> FSDPCompressionState:
    """Compresses the gradient reduce-scatter of every ``FSDPModule`` in ``model``.

    Args:
        model: a module tree already sharded with ``fully_shard``.
        compression: as ``ReduceScatter``'s.
        replicate_group: for HSDP, the process group (or 1-D ``DeviceMesh``) of the
            ranks holding the same shard: the model is sharded over a 1-D shard mesh and
            the replica all-reduce runs compressed through ``set_all_reduce_hook``.
            (FSDP's native 2-D-mesh HSDP runs its own all-reduce first; it is refused.)
        **options: as ``ReduceScatter``'s.

    Returns the shared ``FSDPCompressionState`` (``stats()``, ``state_dict()``).

    Call it once per model, on every rank. Refused (ValueError), installing nothing: a
    ``replicate_group`` holding two ranks of a module's shard group (it would average
    different parameters' shards), a module that already has a custom reduce-scatter
    (ddpcomm's from an earlier call, whose state would silently stop counting, or
    another), and a state already installed on another model (residuals are keyed by
    module name, which two models share).

    Example::

        mesh = init_device_mesh("cuda", (2, 4), mesh_dim_names=("replicate", "shard"))
        for block in model.blocks:
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        state = ddpcomm.fsdp.compress(model, "q8", replicate_group=mesh["replicate"])
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    replicate = _as_group(replicate_group)
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("model has no FSDPModule: shard it with fully_shard first")
    if isinstance(compression, FSDPCompressionState):
        if options:
            raise ValueError("options cannot be combined with an FSDPCompressionState")
        state = compression
        served = state._model() if state._model is not None else None
        if served is not None and served is not model:
            raise ValueError(
                "this FSDPCompressionState already compresses another model (passed to an "
                "earlier ddpcomm.fsdp.compress): two models sharing it would mix their "
                "residuals and step counters, keyed by module name. Give each model its "
                "own state, or compress the module holding both once"
            )
    else:
        state = FSDPCompressionState(compression, **options)
    installs: list[tuple[FSDPModule, str, object]] = []
    for name, module in modules:
        group = _param_group(module, name)
        if group is None:
            continue
        if replicate is not None and group._is_hsdp:
            raise ValueError(
                f"module {name!r} is sharded with a 2-D (replicate, shard) mesh: FSDP runs "
                "its own uncompressed replica all-reduce before any hook. Shard over the "
                "1-D shard mesh and pass the replicate mesh as replicate_group."
            )
        _check_installed(group, name, replicate is not None)
        if replicate is not None:
            _check_replicate(replicate, group, name)
        installs.append((module, name, group))
    for module, name, group in installs:
        layout = tuple(p.padded_sharded_param_size.numel() for p in group.fsdp_params)
        module.set_custom_reduce_scatter(ReduceScatter(state, name=name, _layout=layout))
        if replicate is not None:
            module.set_all_reduce_hook(_ReplicaAllReduce(state, replicate, name, group))
    state._model = weakref.ref(model)
    return state


def _check_installed(param_group, name: str, hook: bool) -> None:
    """Refuses to replace a reduce-scatter (or, with ``hook``, an all-reduce hook) that is
    not FSDP's default: it would be dropped without a word. ddpcomm's own, from an
    earlier compress, would leave that call's state counting nothing."""
    comm = param_group._reduce_scatter_comm
    if isinstance(comm, ReduceScatter):
        raise ValueError(
            f"module {name!r} is already compressed by ddpcomm ({comm!r}, from an earlier "
            "ddpcomm.fsdp.compress or set_custom_reduce_scatter): compressing it again "
            "would replace that comm, and its state's stats() and state_dict() would stay "
            "empty. Keep using the state the first call returned; to change the method, "
            "build and shard a new model and compress it once, or install "
            "ddpcomm.fsdp.ReduceScatter(...) per module with set_custom_reduce_scatter"
        )
    if not isinstance(comm, DefaultReduceScatter):
        raise ValueError(
            f"module {name!r} already has a custom reduce-scatter "
            f"({type(comm).__name__}) that ddpcomm.fsdp.compress would replace. Compress "
            "the model before installing it, or install ddpcomm.fsdp.ReduceScatter(...) "
            "on the other modules with set_custom_reduce_scatter"
        )
    existing = param_group._all_reduce_hook
    if hook and existing is not None:
        raise ValueError(
            f"module {name!r} already has an all-reduce hook ({existing!r}) that "
            "replicate_group's compressed replica all-reduce would replace"
        )


def _check_replicate(replicate: dist.ProcessGroup, param_group, name: str) -> None:
    """Refuses a replicate group that holds two ranks of the module's shard group. The
    replica all-reduce averages what its members hold: members of one shard group hold
    different parameters' shards, so every rank would get the same wrong gradient and
    nothing downstream would show it. Both groups' global ranks are known on every
    rank; whether the replicas hold the same shard position is agreed at the first
    all-reduce (``_ReplicaAllReduce``)."""
    shard_ranks = dist.get_process_group_ranks(param_group.mesh_info.shard_process_group)
    replicate_ranks = dist.get_process_group_ranks(replicate)
    both = sorted(set(shard_ranks) & set(replicate_ranks))
    if len(both) > 1:
        raise ValueError(
            f"replicate_group (global ranks {replicate_ranks}) must hold one rank of each "
            f"shard group, but ranks {both} are also in the shard group of module "
            f"{name!r} (global ranks {shard_ranks}): they hold shards of different parameters, "
            "which the replica all-reduce would average. Pass the group of the ranks "
            "holding this rank's shard: shard over mesh['shard'] of a 2-D mesh and pass "
            "mesh['replicate']"
        )


__all__ = ["FSDPCompressionState", "ReduceScatter", "compress"]
