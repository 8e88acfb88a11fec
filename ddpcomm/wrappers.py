"""Compressed drop-ins for ``torch.distributed.all_reduce`` outside DDP.

``all_reduce`` reduces one tensor in place; ``all_reduce_coalesced`` reduces a list of
tensors with one collective per (dtype) group, flattened and unflattened by the fused
native ops. Both take the spec strings the hooks take (``"none"``, ``"fp16"``, ``"q8"``,
...) or a compressor object, and return ``None``, or with ``async_op=True`` an
:class:`AllReduceHandle` with torch Work's ``wait()`` / ``get_future()``.

Reductions. ``op`` is ``"sum"``, ``"mean"`` or a ``torch.distributed.ReduceOp``:

- ``"none"`` + ``"sum"`` is ``dist.all_reduce(t, ReduceOp.SUM)``, bit for bit; other
  ReduceOps (MIN, MAX, PRODUCT, ...) are passed to torch unchanged.
- ``"none"`` + ``"mean"`` (or ``ReduceOp.AVG``) multiplies by 1/N and then sums, on every
  backend: what DDP's reducer does and ``ddpcomm.allreduce_hook`` does (the same code
  path, ``collectives.plain_all_reduce``), so results are bitwise DDP's; scaling first
  keeps float16 sums from overflowing, and gloo has no AVG to defer to.
- Lossy methods compute the mean over ranks (``collectives.all_reduce_mean``); ``"sum"``
  multiplies it by the world size. Every rank ends with bitwise the same values.

Multi-node: ``hierarchy`` (a keyword, or in the spec: ``"q8,hierarchy=auto"``) reduces
in two levels as the hook states do (``two_level.two_level_mean``): exact inside each
node of L consecutive ranks, the method across nodes, on 1/L of the tensor per rank. An
int L, or ``"auto"`` for L from torchrun's ``LOCAL_WORLD_SIZE`` (``groups.node_size``;
decided at the group's first call with it, through the store, then kept); L = 1, L = the
group's size, or an ``"auto"`` that finds no nodes reduce flat. It applies to ``"sum"`` and
``"mean"`` of every method, ``"none"`` included (exact up to rounding, no longer bitwise
``dist.all_reduce``), and is refused with other ReduceOps.

Buffers. A lossy (or two-level) call runs with its group's Workspace for the call's
signature (method, device, and each job's dtype and size): payload buffers reused from the
previous call of that signature, as a DDP hook reuses its bucket's, and each job's
LinkRate, so gloo pieces follow the link the ranks measured (``context.WorkspacePool``
says what each was worth and what it keeps: beyond the latest signature's buffers, at most
256 MiB per group, freed with the group). Buffers are kept for CPU tensors only; async
calls of one signature in flight together each have their own.

Error feedback needs a residual kept across steps, which a one-off call has nowhere to
keep: spec strings are built with ``error_feedback=False`` (q1/q2 default it on in hooks),
and a compressor object with error feedback on is refused. Use the hooks to get it.

Every argument is checked on every tensor before any tensor is touched or any collective
issued, so a refused call leaves its inputs unchanged; its peers, if their own call was
accepted, fail naming the refused rank: at once, unless they repeat a call checked before
and got to it first (see Agreement). (The one check that runs later is whether coalesced
entries share memory; see there.)

Agreement. Before its collectives a call can check, through the group's store, that
every rank makes the same call: method and options, op, and the dtype and size of every
collective (``ddpcomm.agreement``). A mismatch is then a ValueError on every rank naming
the setting and the ranks; nothing is reduced. A checked call is a rendezvous, even with
``async_op=True``: it returns once every rank has made it.

Every check writes to the store, and torch's FileStore (``init_method="file://..."``)
keeps every write in its file (about 200 bytes per check with 2 ranks), so calls are not
all checked: a call is checked when its signature (all of the above) is new on the group
(not among the last ``agreement.CACHE_SIZE`` agreed), at the group's calls 1, 2, 4, 8, ...
(comparing also the sequence of calls since the previous check), and when another rank
already waits in a check at this call. Otherwise the call only reads the store: a loop
of a million calls of one kind makes 20 checks, and the check costs 28 us a call instead
of 207 on a FileStore (97 instead of 432 on a TCPStore; 2 ranks, a loaded 2-core
machine). What this gives up: a mismatch in a call that some ranks repeat from before
is no longer refused before its collective on every rank:

- one rank makes a new call while the others repeat one: if the others arrive later,
  they join its check and every rank gets the ValueError; if they arrived first, they
  wait in their collective, the new rank names them after the group's timeout and their
  collective fails in the backend;
- ranks repeat different calls checked before (one skips a call, or switches between
  two): their collectives pair as they come (different results on different ranks, or a
  backend abort: gloo aborts the process on mismatched sizes) until the next check, at
  the latest when the group's call count doubles, raises the ValueError on every rank.

A configuration that differs from the start is still refused at the first call.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ddpcomm import agreement, collectives, normalize, ops, two_level
from ddpcomm.compressors import Compressor, parse, take_state_options
from ddpcomm.context import ReduceContext, Workspace, WorkspacePool
from ddpcomm.futures import completed, join, then
from ddpcomm.groups import Topology, check_hierarchy, node_size
from ddpcomm.groups import topology as group_topology

Future = torch.futures.Future
ReduceOp = dist.ReduceOp


class AllReduceHandle:
    """What ``async_op=True`` returns: the parts of torch's ``Work`` that callers use.

    ``wait()`` blocks until the reduced values are in the caller's tensors (re-raising a
    failure) and returns True; ``get_future()`` gives a ``torch.futures.Future`` whose value
    is the list of those tensors; ``is_completed()`` polls.
    """

    __slots__ = ("_future",)

    def __init__(self, future: Future) -> None:
        self._future = future

    def wait(self) -> bool:
        self._future.wait()
        return True

    def get_future(self) -> Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def __repr__(self) -> str:
        return f"AllReduceHandle(completed={self.is_completed()})"


# --------------------------------------------------------------------------------------
# Argument checks (all before any side effect)
# --------------------------------------------------------------------------------------

_OPS = ("sum", "mean")


def _parse_op(op, lossy: bool):
    """``"sum"`` or ``"mean"`` for the two reductions every method supports; the ReduceOp
    itself for the others, which only the lossless path passes through."""
    if isinstance(op, str):
        if op not in _OPS:
            raise ValueError(
                f"op must be 'sum', 'mean' or a torch.distributed.ReduceOp, got {op!r}"
            )
        return op
    if isinstance(op, (ReduceOp, ReduceOp.RedOpType)):
        if op == ReduceOp.SUM:
            return "sum"
        if op == ReduceOp.AVG:
            return "mean"
        if lossy:
            raise ValueError(
                f"op {op} is not supported by lossy compression; use 'sum' or 'mean' "
                "(ReduceOp.SUM / ReduceOp.AVG), or compression='none'"
            )
        return op
    raise TypeError(f"op must be 'sum', 'mean' or a torch.distributed.ReduceOp, got {op!r}")


def _parse_compression(compression, hierarchy=None) -> tuple[Compressor, int | str | None]:
    """The method, and ``hierarchy`` from the keyword or the spec (not both, unless equal)."""
    if isinstance(compression, str):
        spec, state = take_state_options(compression, ("hierarchy",))
        if "hierarchy" in state:
            if hierarchy is not None and hierarchy != state["hierarchy"]:
                raise ValueError(
                    f"hierarchy given both in the spec {compression!r} and as a keyword "
                    f"({state['hierarchy']!r}, {hierarchy!r})"
                )
            hierarchy = state["hierarchy"]
        c = parse(spec)
        normalize.refuse(c, "ddpcomm.all_reduce")
        # Stateless calls cannot carry a residual; build the method without it.
        c = parse(spec, error_feedback=False) if c.error_feedback else c
        return c, check_hierarchy(hierarchy)
    if isinstance(compression, Compressor):
        normalize.refuse(compression, "ddpcomm.all_reduce")
        if compression.error_feedback:
            raise ValueError(
                f"compression {compression!r} has error_feedback on, which needs a residual "
                "kept across steps; ddpcomm.all_reduce is stateless: build it with "
                "error_feedback=False, or use a DDP hook"
            )
        return compression, check_hierarchy(hierarchy)
    raise TypeError(
        f"compression must be a spec string (e.g. 'none', 'fp16', 'q8') or a Compressor, "
        f"got {type(compression).__name__}"
    )


def _check_hierarchy(hierarchy, op, pg) -> None:
    """``hierarchy`` against the op, and an int L against the group's size (before any
    side effect: a refused call tells its peers)."""
    if hierarchy is not None and op not in _OPS:
        raise ValueError(
            f"hierarchy={hierarchy!r} reduces with op 'sum' or 'mean' only (a two-level mean), "
            f"got op {op}"
        )
    if isinstance(hierarchy, int):
        node_size(pg, hierarchy)


def _check_two_level_dtype(hierarchy, t: torch.Tensor, arg: str) -> None:
    if hierarchy is not None and not t.dtype.is_floating_point:
        raise TypeError(
            f"{arg} has dtype {t.dtype}; hierarchy={hierarchy!r} reduces floating point "
            "tensors only (a mean inside each node, then across nodes)"
        )


def _check_device(t: torch.Tensor, arg: str, pg: dist.ProcessGroup) -> None:
    types = [d.type for d in getattr(pg, "_device_types", ())]
    if types and t.device.type not in types:
        raise ValueError(
            f"{arg} is on {t.device}, but the group's backend ({dist.get_backend(pg)}) "
            f"reduces tensors on {', '.join(types)} only"
        )


def _check_group(group) -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise RuntimeError(
            "ddpcomm.all_reduce needs torch.distributed.init_process_group() to have run"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup or None, got {type(group).__name__}")
    return group if group is not None else dist.group.WORLD


# What gloo and NCCL reduce (int16 and the wider unsigned types neither does).
_REDUCIBLE = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.complex128,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
)


def _check_plain(t: torch.Tensor, arg: str) -> None:
    """Dense, and not a subclass that reroutes every op (FakeTensor, DTensor, ...): the
    reduction runs through collectives and native ops that would see its inner tensors, or
    none, and fail later inside a callback."""
    if t.layout != torch.strided:
        raise TypeError(f"{arg} must be a dense (strided) tensor, got layout {t.layout}")
    if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        raise TypeError(
            f"{arg} is a {type(t).__name__}, a tensor subclass with its own "
            "__torch_dispatch__; ddpcomm.all_reduce reduces plain tensors (pass the local "
            "torch.Tensor it wraps)"
        )


def _check_tensor(t, arg: str, compressor: Compressor, op) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    _check_plain(t, arg)
    if t.device.type == "meta":
        raise ValueError(f"{arg} is on the meta device, which holds no values to reduce")
    compressor.check_tensor(t, arg)
    if t.dtype not in _REDUCIBLE:
        raise TypeError(
            f"{arg} has dtype {t.dtype}; ddpcomm.all_reduce reduces "
            f"{', '.join(str(d).removeprefix('torch.') for d in _REDUCIBLE)}"
        )
    if op == "mean" and not (t.dtype.is_floating_point or t.dtype.is_complex):
        raise TypeError(
            f"{arg} has dtype {t.dtype}; op='mean' needs a floating point or complex tensor "
            "(use op='sum' for integers)"
        )


def _group_by_dtype(tensors, compressor: Compressor, op, pg) -> dict[torch.dtype, list]:
    """Checks every entry and groups them by dtype, in order of first appearance.

    The dtype-dependent checks run once per dtype: with hundreds of small tensors per
    call, per-tensor Python work is a visible share of the call's latency.
    """
    groups: dict[torch.dtype, list] = {}
    device = None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}] must be a torch.Tensor, got {type(t).__name__}")
        members = groups.get(t.dtype)
        if members is None:
            _check_tensor(t, f"tensors[{i}]", compressor, op)
            members = groups[t.dtype] = []
        _check_plain(t, f"tensors[{i}]")
        if device is None:
            device = t.device
            _check_device(t, f"tensors[{i}]", pg)
        elif t.device != device:
            raise ValueError(
                f"tensors[{i}] is on {t.device} but tensors[0] is on {device}; "
                "all_reduce_coalesced takes tensors on one device (call it once per device)"
            )
        # Reducing values is not differentiable (dist.all_reduce ignores autograd too);
        # a detached alias lets parameters that require grad be written in place.
        members.append(t.detach() if t.requires_grad else t)
    return groups


# --------------------------------------------------------------------------------------
# Per-group bookkeeping for lossy calls
# --------------------------------------------------------------------------------------

_LOCK = threading.Lock()
# Calls so far per group (keyed weakly, so a destroyed group is not kept alive here): the
# `step` of stochastic rounding, so repeated calls draw fresh roundings. Ranks issue
# collectives on a group in the same order, so they agree.
_CALLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _next_step(pg: dist.ProcessGroup) -> int:
    with _LOCK:
        step = _CALLS.get(pg, 0)
        _CALLS[pg] = step + 1
        return step


# Group -> the Workspaces of its lossy calls (context.WorkspacePool, which says why and how
# much it keeps), by call signature: reused buffers and each job's LinkRate.
_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _pool(pg: dist.ProcessGroup) -> WorkspacePool:
    with _LOCK:
        pool = _POOLS.get(pg)
        if pool is None:
            pool = _POOLS[pg] = WorkspacePool()
        return pool


# Group -> {hierarchy: (L or None, why)}: the node size decided at the group's first call
# with that hierarchy (for "auto" through the store, on every rank at the same call).
_NODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _decided(pg: dist.ProcessGroup, hierarchy) -> tuple | None:
    with _LOCK:
        return _NODES.get(pg, {}).get(hierarchy)


def _topology(pg: dist.ProcessGroup, hierarchy, device) -> Topology | None:
    """The group's Topology under ``hierarchy``, or None for flat; decided and made at the
    first call (every rank makes the same calls, agreed before this)."""
    if hierarchy is None:
        return None
    decided = _decided(pg, hierarchy)
    if decided is None:
        decided = agreement.node_size(pg, hierarchy)
        with _LOCK:
            _NODES.setdefault(pg, {})[hierarchy] = decided
    local = decided[0]
    return None if local is None else group_topology(pg, local, device)


def _agree(pg, compressor: Compressor, op, groups: list, fn: str, hierarchy=None) -> None:
    """Before any collective: ranks that differ in the method, op, or the dtypes and sizes
    of the tensors (per collective, in order) get a ValueError on every rank, instead of
    a backend abort, a hang, or different values on different ranks. Checked through the
    store when this call's signature is new on the group, at calls 1, 2, 4, 8, ... and
    when a peer waits in a check at this call (``agreement.agree_repeated``; see the
    module docstring for what a repeated call gives up); a rank that never makes a
    checked call is reported after the group's timeout, with a warning after 10 s."""
    tensors = [[agreement.plain(ts[0].dtype), [t.numel() for t in ts]] for ts in groups]
    fields = {
        "call": "all_reduce",
        **agreement.method_fields(compressor),
        "op": agreement.plain(op),
        "tensors": tensors,
    }
    if hierarchy is not None:
        fields["hierarchy"] = hierarchy
        decided = _decided(pg, hierarchy)
        if decided is not None:
            fields["local_size"] = decided[0]
    # The call's name in a mismatch message that counts each rank's calls.
    shapes = " ".join(f"{dtype}{numels}" for dtype, numels in tensors)
    label = f"{fn}({compressor.spec}, op={agreement.plain(op)}, {shapes or 'nothing'})"
    agreement.agree_repeated(
        pg, fields, f"a ddpcomm.{fn} call", label=label, note=fn, warn_after=10.0
    )


# --------------------------------------------------------------------------------------
# Reducing one flat, contiguous buffer
# --------------------------------------------------------------------------------------


def _issue(flat, compressor: Compressor, op, pg, step: int, key: int, topology, workspace):
    """Issues the collective(s) reducing the 1-D contiguous ``flat``.

    Returns what to wait on: a Work for lossless SUM and other ReduceOps (``flat`` is
    reduced in place), a Future otherwise (lossless mean: of ``flat``, in place; lossy or
    two-level (``topology``): of the mean, written into ``flat`` or, for casts, a new
    tensor). ``workspace``: the call's (``_run``), for lossy and two-level reductions.
    """
    if topology is not None:
        ctx = ReduceContext(group=pg, key=key, step=step, workspace=workspace)
        return two_level.two_level_mean(flat, compressor, ctx, topology)
    if not compressor.lossy:
        if op == "mean":
            # The same lossless path as ddpcomm.allreduce_hook: scale by 1/N, then sum.
            return collectives.plain_all_reduce(flat, ReduceContext(group=pg))
        rop = ReduceOp.SUM if op == "sum" else op
        return dist.all_reduce(flat, op=rop, group=pg, async_op=True)
    return collectives.all_reduce_mean(
        flat, compressor, ReduceContext(group=pg, key=key, step=step, workspace=workspace)
    )


def _reduced(flat: torch.Tensor, means: bool, op, world: int, value) -> torch.Tensor:
    """The reduced values of ``flat`` once its work is done; ``value`` is what it gave
    (``means``: the mean over ranks, as lossy and two-level reductions give)."""
    if not means:
        return flat
    return value.mul_(world) if op == "sum" else value


def _run(jobs, compressor: Compressor, op, pg, step: int, tensors, async_op: bool, topology):
    """Issues every job's collective in job order (the same on every rank), then writes
    each result back with its job's ``write(reduced)``, which returns the tensors holding
    the result: on this thread once all are issued (sync), or in the completion callbacks
    (async_op), which hand those tensors on (futures.py's stream rule).

    Lossy and two-level jobs run with the group's Workspace for this call's signature
    (method, node size, device, and each job's dtype and size; a job's key is its index),
    taken from the group's pool and given back once every job is done."""
    means = compressor.lossy or topology is not None
    device = jobs[0][0].device
    keep = device.type == "cpu"  # buffers kept for CPU tensors only (WorkspacePool)
    pool = signature = workspace = None
    if means:
        pool = _pool(pg)
        shapes = tuple((flat.dtype, flat.numel()) for flat, _ in jobs)
        local = None if topology is None else topology.local_size
        signature = (compressor, local, device, shapes)
        workspace = pool.checkout(signature, keep)
        workspace.keep_segments = not async_op  # async calls may overlap (node_memory)
    issued = [
        (flat, write, _issue(flat, compressor, op, pg, step, key, topology, workspace))
        for key, (flat, write) in enumerate(jobs)
    ]
    # The callbacks below get the world size, never the group: a callback must not hold
    # the last reference to a process group (see context.ReduceContext).
    world = dist.get_world_size(pg)
    if not async_op:
        # Waiting here rather than in callbacks keeps the write-back on the caller's
        # thread and its intra-op thread settings, and saves a Future per job.
        for flat, write, pending in issued:
            write(_reduced(flat, means, op, world, pending.wait()))
        if pool is not None:
            pool.checkin(signature, workspace, keep)
        return None
    done = None if pool is None else _countdown(len(issued), pool, signature, workspace, keep)

    def finisher(flat, write):
        def finish(f):
            out = write(_reduced(flat, means, op, world, f.value()))
            if done is not None:
                done()
            return out

        return finish

    futures = [
        then(p.get_future() if isinstance(p, dist.Work) else p, finisher(flat, write))
        for flat, write, p in issued
    ]

    return AllReduceHandle(join(futures, tensors, issued[0][0].device))


def _countdown(jobs: int, pool: WorkspacePool, signature, workspace: Workspace, keep: bool):
    """A function that gives ``workspace`` back to ``pool`` at its ``jobs``th call (each
    async job's last callback, on the CPU after its last use of the buffers)."""
    left, lock = [jobs], threading.Lock()

    def done() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            pool.checkin(signature, workspace, keep)

    return done


def _unflatten_to(tensors: list[torch.Tensor]):
    """A job's ``write``: the reduced flat buffer back into ``tensors``, which it returns."""

    def write(out: torch.Tensor) -> list[torch.Tensor]:
        ops.unflatten_into(out, tensors)
        return tensors

    return write


def _memory_order_view(t: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of ``t``'s elements in memory order if they fill one gap-free run.

    That is the order dist.all_reduce reduces a dense (possibly permuted) tensor in, and
    it needs no copy; tensors with gaps, overlaps or conjugate/negative bits get None.
    """
    if t.is_conj() or t.is_neg():
        return None
    if t.is_contiguous():
        return t.view(-1)
    expected = 1
    for stride, size in sorted(
        (st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz != 1
    ):
        if stride != expected:
            return None
        expected *= size
    return t.as_strided((t.numel(),), (1,))


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def all_reduce(
    tensor: torch.Tensor,
    compression: str | Compressor = "none",
    op: str | ReduceOp = "mean",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    hierarchy: int | str | None = None,
) -> AllReduceHandle | None:
    """Reduces ``tensor`` over the ranks of ``group``, in place, optionally compressed.

    Args:
        tensor: any dense tensor; lossy methods take float32/float16/bfloat16 only.
            A permuted (transposed) tensor is reduced in memory order, as dist.all_reduce
            does; one with gaps (a strided slice) through a flat copy, written back.
        compression: a spec string (``"none"``, ``"fp16"``, ``"bf16"``, ``"q8"`` ...
            ``"q1"``) or a compressor object from ``ddpcomm.compressors``.
        op: ``"mean"`` (default), ``"sum"``, or a ``torch.distributed.ReduceOp``; ops other
            than SUM/AVG only with ``compression="none"``.
        group: the process group; None for the default group.
        async_op: return an :class:`AllReduceHandle` instead of waiting.
        hierarchy: None (flat), an int L (L consecutive ranks form a node) or ``"auto"``
            (L from torchrun's ``LOCAL_WORLD_SIZE``): reduce in two levels, compressed
            only across nodes (see the module docstring). Also in the spec:
            ``"q8,hierarchy=auto"``.

    Returns:
        None, or the handle when ``async_op`` (its future's value is ``[tensor]``).

    Example (on every rank, after ``torch.distributed.init_process_group``)::

        >>> import torch, torch.distributed as dist, ddpcomm
        >>> t = torch.full((4,), 2.0 * (dist.get_rank() + 1))
        >>> ddpcomm.all_reduce(t, op="sum")             # lossless: exactly dist.all_reduce
        >>> bool((t == dist.get_world_size() * (dist.get_world_size() + 1)).all())
        True
        >>> g = torch.ones(1000)
        >>> handle = ddpcomm.all_reduce(g, compression="q8", async_op=True)
        >>> handle.wait()                              # g now holds the 8-bit mean
        True
        >>> handle.get_future().value()[0] is g
        True
    """
    pg = _check_group(group)
    try:
        compressor, hierarchy = _parse_compression(compression, hierarchy)
        rop = _parse_op(op, compressor.lossy)
        _check_hierarchy(hierarchy, rop, pg)
        _check_tensor(tensor, "tensor", compressor, rop)
        _check_two_level_dtype(hierarchy, tensor, "tensor")
        _check_device(tensor, "tensor", pg)
        if not isinstance(async_op, bool):
            raise TypeError(f"async_op must be a bool, got {async_op!r}")
    except Exception as exc:
        # Peers whose call was accepted fail at once, naming this rank, instead of waiting.
        agreement.refuse(pg, exc, "a ddpcomm.all_reduce call")
        raise
    # Before any early return: a rank with an empty tensor still meets its peers here.
    _agree(pg, compressor, rop, [[tensor]], "all_reduce", hierarchy)
    topology = _topology(pg, hierarchy, tensor.device)

    # Reducing values is not differentiable (dist.all_reduce ignores autograd too); a
    # detached alias lets a parameter that requires grad be reduced in place.
    target = tensor.detach() if tensor.requires_grad else tensor
    view = _memory_order_view(target)
    if not compressor.lossy and rop != "mean" and view is not None and topology is None:
        # Exactly dist.all_reduce: no copy, no callback.
        work = dist.all_reduce(
            tensor, op=ReduceOp.SUM if rop == "sum" else rop, group=pg, async_op=async_op
        )
        if not async_op:
            return None
        return AllReduceHandle(then(work.get_future(), lambda _: [tensor]))
    if (compressor.lossy or topology is not None) and tensor.numel() == 0:
        return AllReduceHandle(completed([tensor], tensor.device)) if async_op else None

    flat = view if view is not None else ops.flatten([target])

    def write(out: torch.Tensor) -> torch.Tensor:
        if out.data_ptr() != view.data_ptr():
            view.copy_(out)
        return view

    job = (flat, write) if view is not None else (flat, _unflatten_to([target]))
    return _run([job], compressor, rop, pg, _next_step(pg), [tensor], async_op, topology)


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    compression: str | Compressor = "none",
    op: str | ReduceOp = "mean",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    hierarchy: int | str | None = None,
) -> AllReduceHandle | None:
    """Reduces every tensor of a list in place with one collective per dtype.

    Tensors are grouped by dtype (in order of first appearance, so every rank issues the
    groups in the same order), each group is flattened into one buffer by the fused native
    op, reduced with one collective (or one compressed all-reduce), and written back in
    place. The values are those of :func:`all_reduce` on the group's flat buffer: for
    ``"none"`` what torch's own coalesced path (flatten, one all_reduce) gives; with one
    or two ranks, or integers, bitwise what reducing each tensor separately gives. (With
    three ranks or more, gloo and NCCL sum an element's contributions in an order set by
    its position in the buffer, so float results differ from per-tensor reductions by
    rounding.) All tensors must be on one device; empty groups issue nothing. Entries
    must not share memory: that is found when writing back, so the call raises ValueError
    after its collective (on every rank alike) with no entry written.

    Args:
        tensors: a list or tuple of dense tensors on one device (any shapes, strides and
            dtypes; lossy methods take float32/float16/bfloat16 only).
        compression, op, group, async_op, hierarchy: as in :func:`all_reduce`.

    Returns:
        None, or with ``async_op`` an :class:`AllReduceHandle` whose future's value is the
        list of the (reduced) input tensors.

    Example (on every rank, after ``torch.distributed.init_process_group``)::

        >>> import torch, torch.distributed as dist, ddpcomm
        >>> grads = [torch.ones(3, 3), torch.ones(5, dtype=torch.float16), torch.ones(0)]
        >>> ddpcomm.all_reduce_coalesced(grads, compression="fp16")   # 2 collectives
        >>> [round(g.sum().item()) for g in grads]                    # the mean of ones
        [9, 5, 0]
    """
    pg = _check_group(group)
    try:
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
            raise TypeError(
                f"tensors must be a list or tuple of tensors, got {type(tensors).__name__}"
            )
        compressor, hierarchy = _parse_compression(compression, hierarchy)
        rop = _parse_op(op, compressor.lossy)
        _check_hierarchy(hierarchy, rop, pg)
        if not isinstance(async_op, bool):
            raise TypeError(f"async_op must be a bool, got {async_op!r}")
        tensors = list(tensors)
        groups = _group_by_dtype(tensors, compressor, rop, pg)
        for dtype, ts in groups.items():
            first = next(i for i, t in enumerate(tensors) if t.dtype == dtype)
            _check_two_level_dtype(hierarchy, ts[0], f"tensors[{first}]")
    except Exception as exc:
        agreement.refuse(pg, exc, "a ddpcomm.all_reduce_coalesced call")
        raise
    # A group of empty tensors has nothing to reduce; every rank skips it alike.
    groups = [ts for ts in groups.values() if any(t.numel() for t in ts)]
    _agree(pg, compressor, rop, groups, "all_reduce_coalesced", hierarchy)
    if not groups:
        device = tensors[0].device if tensors else torch.device("cpu")
        return AllReduceHandle(completed(tensors, device)) if async_op else None

    topology = _topology(pg, hierarchy, groups[0][0].device)
    flats = [ops.flatten(ts) for ts in groups]
    jobs = [(flat, _unflatten_to(ts)) for flat, ts in zip(flats, groups, strict=True)]
    return _run(jobs, compressor, rop, pg, _next_step(pg), tensors, async_op, topology)
