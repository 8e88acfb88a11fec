"""Process groups: which collective each rank issues, in which order, and which ranks form
a node.

- ``all_gather_single`` / ``reduce_scatter_single``: torch's single-tensor all-gather and
  reduce-scatter, under either of their names.
- ``backend_of``: the backend that runs a group's collectives for a device.
- ``group_timeout``: the timeout a group was created with.
- ``Turns`` / ``Sequencer``: collectives issued from callbacks, in one order on every rank.
- ``check_hierarchy`` / ``node_size`` / ``Topology``: multi-node training, where ``L``
  consecutive ranks of a group share a node (a fast link) and nodes are joined by a slow
  one; the groups inside a node and across nodes of a two-level reduction.
"""

from __future__ import annotations

import datetime
import json
import math
import numbers
import os
import threading
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ddpcomm import node_memory
from ddpcomm.ops import numpy_bool

# torch 2.13 renamed all_gather_into_tensor to all_gather_single and reduce_scatter_tensor
# to reduce_scatter_single (the old names warn); older releases have only the former.
# Same collectives either way.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def backend_of(pg: dist.ProcessGroup, device: torch.device) -> str:
    """The backend that runs ``pg``'s collectives on ``device``'s tensors: ``"nccl"`` for
    a ``"cpu:gloo,cuda:nccl"`` group and CUDA tensors, for example."""
    name = str(dist.get_backend(pg))
    if ":" not in name:
        return name
    by_device = dict(part.split(":", 1) for part in name.split(","))
    return by_device.get(torch.device(device).type, name)


def group_timeout(pg: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout ``pg`` was created with (None, torch's default, if torch does not say)."""
    for device in getattr(pg, "_device_types", ()):
        try:
            return pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


# --------------------------------------------------------------------------------------
# Collective-order sequencer for second-phase collectives
# --------------------------------------------------------------------------------------


class Turns:
    """Runs functions in the order their tickets were taken, whatever order they arrive in.

    A ticket is taken on the issuing thread (in bucket order, the same on every rank); the
    function that issues the next collective is submitted from a ``Future`` callback,
    which runs when the previous collective lands (a different order on each rank), and
    runs only once every earlier ticket's has. ``inline``: callbacks run at once on the
    issuing thread (NCCL: a work's Future is complete when it is returned), so each
    ticket's function must have run before the next ticket is taken; anything else means
    the backend defers callbacks after all, and is refused rather than mis-ordered.
    """

    def __init__(self, inline: bool) -> None:
        self.inline = inline
        self._lock = threading.Lock()
        self._next_ticket = 0
        self._next_to_run = 0
        self._ready: dict[int, Callable[[], None]] = {}

    def ticket(self) -> int:
        """Taken on the issuing thread, right after the collective the ticket follows."""
        with self._lock:
            if self.inline and self._next_to_run != self._next_ticket:
                # Sharing the group is safe only if the previous ticket's function ran at
                # once; a backend whose callbacks are deferred would interleave its
                # collectives with later buckets' differently on every rank.
                raise RuntimeError(
                    "ddpcomm: the previous bucket's next collective (a second phase, or a "
                    "two-level reduction's next step) was not issued inline: this backend "
                    "runs Future callbacks later, and sharing its group between steps would "
                    "pair collectives differently on each rank"
                )
            t = self._next_ticket
            self._next_ticket += 1
            return t

    def submit(self, ticket: int, issue: Callable[[], None]) -> None:
        """Runs ``issue`` once every earlier ticket's has run; never blocks on the network."""
        with self._lock:
            self._ready[ticket] = issue
            while self._next_to_run in self._ready:
                fn = self._ready.pop(self._next_to_run)
                self._next_to_run += 1
                fn()


class Sequencer(Turns):
    """Issues second-phase collectives in ticket order, on a group of their own.

    gloo and NCCL pair collectives by the order each rank issues them on a group, while
    ``Future.then`` callbacks run in whatever order collectives finish. A ticket is taken
    when the first phase is issued (bucket order, the same on every rank); the second
    phase is issued strictly in ticket order.

    Where the first phase's callbacks run inline (NCCL: a work's Future is complete when
    it is returned, so its callback runs at once on the issuing thread), each ticket's
    second phase is issued before the next ticket is taken: the order on the group itself
    is already the same everywhere, and the companion is the group. No second communicator,
    and no group created inside a hook: with ``init_process_group(device_id=...)`` torch
    connects a new NCCL group by splitting the world's communicator, which every world
    rank must join, so a group made by the members alone at their first step would hang.
    Elsewhere (gloo) callbacks run on the group's worker thread as collectives land, and
    the second phase goes on a companion group that only the members create, at their
    first two-phase step, in the same order.
    """

    def __init__(self, group: dist.ProcessGroup, inline: bool) -> None:
        super().__init__(inline)
        if inline:
            self.companion = group
        else:
            # The companion runs on the group's own backend with the group's timeout: a
            # frozen peer fails phase 2 when the user's timeout says, not after torch's
            # default of 30 minutes.
            align_group_names(group, torch.device("cpu"))
            self.companion = dist.new_group(
                dist.get_process_group_ranks(group),
                backend=dist.get_backend(group),
                timeout=group_timeout(group),
                use_local_synchronization=True,
            )


# Weak keys: a destroyed process group is not kept alive by its sequencers.
_SEQUENCERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SEQUENCERS_LOCK = threading.Lock()


def sequencer(group: dist.ProcessGroup, device: torch.device) -> Sequencer:
    """The Sequencer of ``group``'s second phases for tensors on ``device``."""
    inline = backend_of(group, device) == "nccl"
    with _SEQUENCERS_LOCK:
        per_group = _SEQUENCERS.setdefault(group, {})
        seq = per_group.get(inline)
        if seq is None:
            seq = per_group[inline] = Sequencer(group, inline)
        return seq


# --------------------------------------------------------------------------------------
# Nodes: which ranks share a fast link
# --------------------------------------------------------------------------------------

HIERARCHY_VALUES = "None (flat), 'auto' (from torchrun's LOCAL_WORLD_SIZE) or an int >= 1"
# What torchrun tells each process about its node (it numbers ranks node by node).
LOCAL_SIZE_ENV, LOCAL_RANK_ENV = "LOCAL_WORLD_SIZE", "LOCAL_RANK"


def check_hierarchy(value):
    """``hierarchy`` as given to a hook state or ``ddpcomm.all_reduce``: None, ``"auto"``
    or an int >= 1 (ranks per node). Bools, floats and other strings raise TypeError or
    ValueError naming ``hierarchy``. Whether an int suits the group is ``node_size``'s
    question (it needs the group)."""
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if isinstance(value, str):
        raise ValueError(f"hierarchy must be {HIERARCHY_VALUES}, got {value!r}")
    if isinstance(value, (bool, numpy_bool)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"hierarchy must be {HIERARCHY_VALUES}, got {value!r}")
    if value < 1:
        raise ValueError(f"hierarchy must be {HIERARCHY_VALUES}, got {value!r}")
    return int(value)


def local_report() -> str:
    """This process's place on its node as torchrun gives it (``LOCAL_WORLD_SIZE``,
    ``LOCAL_RANK``; null where unset), as exchanged by ``hierarchy="auto"``."""
    return json.dumps([os.environ.get(LOCAL_SIZE_ENV), os.environ.get(LOCAL_RANK_ENV)])


def node_size(group: dist.ProcessGroup, hierarchy, reports: list[str] | None = None):
    """``(L, why)``: the number of consecutive ranks of ``group`` that form a node under
    ``hierarchy`` (``check_hierarchy``'s values), or ``(None, why)`` for a flat reduction;
    ``why`` says which and why, for ``stats()``.

    - An int L: L consecutive group ranks form a node. L must divide the group's size
      (ValueError naming ``hierarchy`` otherwise). L == 1 (every rank its own node) and L ==
      the group's size (one node: nothing crosses a slow link) mean flat: the method runs
      as without a hierarchy, as asked.
    - ``"auto"``: ``reports`` holds every rank's ``local_report()`` in group-rank order
      (``agreement.node_size`` exchanges them, so every rank decides alike). Two-level when
      every rank was started by torchrun with the same ``LOCAL_WORLD_SIZE`` W, every rank's
      ``LOCAL_RANK`` is its global rank mod W (torchrun numbers ranks node by node), and the
      group's ranks fall into whole nodes consistently: in group-rank order they come node
      by node, the same number L of them from every node they touch. L (which is W for the
      world group) is then the node size, unless it is 1 or the whole group (flat, as for
      an int). Anything else is flat, and ``why`` names the ranks that made it so.
    """
    world = dist.get_world_size(group)
    if hierarchy is None:
        return None, "hierarchy=None: flat"
    if hierarchy != "auto":
        if world % hierarchy:
            raise ValueError(
                f"hierarchy must divide the group's size {world} (it is the number of "
                f"consecutive ranks that form a node), got {hierarchy}"
            )
        return _sized(hierarchy, world, f"hierarchy={hierarchy}")
    ranks = dist.get_process_group_ranks(group)
    placed = [json.loads(r) for r in reports]
    unset = [ranks[i] for i, (size, local) in enumerate(placed) if size is None or local is None]
    if unset:
        return None, (
            f"hierarchy='auto': {LOCAL_SIZE_ENV} or {LOCAL_RANK_ENV} is not set on "
            f"{_ranks(unset)} (not started by torchrun?): flat"
        )
    try:
        sizes = [int(size) for size, _ in placed]
        locals_ = [int(local) for _, local in placed]
    except ValueError:
        return None, f"hierarchy='auto': {LOCAL_SIZE_ENV} is not an int on every rank: flat"
    by_size: dict[int, list[int]] = {}
    for g, size in zip(ranks, sizes, strict=True):
        by_size.setdefault(size, []).append(g)
    if len(by_size) > 1:
        seen = "; ".join(f"{_ranks(gs)}: {size}" for size, gs in by_size.items())
        return None, f"hierarchy='auto': {LOCAL_SIZE_ENV} differs across ranks ({seen}): flat"
    per_node = sizes[0]
    if per_node < 1:
        return None, f"hierarchy='auto': {LOCAL_SIZE_ENV}={per_node}: flat"
    stray = [g for g, local in zip(ranks, locals_, strict=True) if local != g % per_node]
    if stray:
        return None, (
            f"hierarchy='auto': ranks are not numbered node by node ({LOCAL_RANK_ENV} is not "
            f"the rank mod {LOCAL_SIZE_ENV}={per_node} on {_ranks(stray)}): flat"
        )
    nodes = [g // per_node for g in ranks]
    runs: list[list[int]] = []  # consecutive group ranks on one node
    for node in nodes:
        if runs and runs[-1][0] == node:
            runs[-1].append(node)
        else:
            runs.append([node])
    if len({r[0] for r in runs}) != len(runs) or len({len(r) for r in runs}) != 1:
        return None, (
            f"hierarchy='auto': the group's ranks {ranks} do not fall into whole nodes of "
            f"{LOCAL_SIZE_ENV}={per_node} (node by node, as many from each): flat"
        )
    return _sized(len(runs[0]), world, f"hierarchy='auto' ({LOCAL_SIZE_ENV}={per_node})")


def _sized(local_size: int, world: int, given: str):
    if local_size == 1:
        return None, f"{given}: one rank per node, nothing to reduce inside a node: flat"
    if local_size == world:
        return None, f"{given}: one node holds all {world} ranks, nothing crosses nodes: flat"
    nodes = world // local_size
    return local_size, f"{given}: {nodes} nodes of {local_size} ranks"


def _ranks(global_ranks: list[int]) -> str:
    return f"rank {global_ranks[0]}" if len(global_ranks) == 1 else f"ranks {global_ranks}"


def shard_range(numel: int, local_size: int, local_rank: int) -> tuple[int, int]:
    """Elements ``[lo, hi)`` of a ``numel``-element tensor that the rank at ``local_rank``
    in its node reduces across nodes: shards of ceil(numel / L), the last ones short or
    empty."""
    shard = math.ceil(numel / local_size)
    return min(numel, local_rank * shard), min(numel, (local_rank + 1) * shard)


class Topology:
    """A group's ranks as N nodes of L consecutive ranks, and the groups a two-level
    reduction runs on (``two_level.two_level_mean``).

    Attributes:
        local_size, nodes: L and N.
        node, local_rank: this rank's node and its index in it (group rank = node * L +
            local_rank).
        intra: this rank's node (the reduce-scatter inside the node).
        gather: this rank's node again, for the all-gather that ends a reduction; on NCCL
            ``intra`` itself (see ``Turns``).
        cross: the N ranks with this rank's local index, one per node: the only step that
            crosses nodes, and the one that is compressed.
        cross_turns, gather_turns: the order the cross step and the all-gather are issued
            in, from callbacks (``Turns``).
        shared: on gloo, whether the node's ranks share a host and reduce inside it
            through shared memory (``node_memory``); decided here, by the node.

    Groups are made once per (group, L, backend), at the first two-level reduction, by
    every member of ``group`` in the same order: the node split, then the cross split.
    On NCCL with a bound device (``init_process_group(device_id=...)``), torch connects a
    new group eagerly by splitting the world's communicator, which every world rank must
    join, so a member-only ``new_group`` would hang: there ``dist.split_group`` splits
    ``group`` itself (every member calls it with the same split lists; no rank outside
    ``group`` takes part). Elsewhere (gloo, and NCCL connected lazily) each rank creates its
    own node's and its own cross group with ``new_group(..., use_local_synchronization=
    True)``, which only the members wait on, as ``Sequencer`` makes its companion, after
    ``align_group_names``; on gloo also the all-gather's companion and the cross group's
    ``Sequencer`` (for a two-phase quantizer across nodes), now rather than inside a
    callback.
    """

    __slots__ = (
        "local_size",
        "nodes",
        "node",
        "local_rank",
        "backend",
        "intra",
        "gather",
        "cross",
        "cross_turns",
        "gather_turns",
        "shared",
    )

    def __init__(
        self, group: dist.ProcessGroup, local_size: int, backend: str, device: torch.device
    ) -> None:
        world = dist.get_world_size(group)
        if local_size < 2 or world % local_size or local_size == world:
            raise ValueError(
                f"a two-level reduction needs nodes of 2 or more ranks that divide the "
                f"group's {world} ranks into 2 or more nodes, got local_size={local_size}"
            )
        self.local_size = local_size
        self.nodes = world // local_size
        self.node, self.local_rank = divmod(dist.get_rank(group), local_size)
        self.backend = backend
        by_node = [list(range(i * local_size, (i + 1) * local_size)) for i in range(self.nodes)]
        by_index = [list(range(j, world, local_size)) for j in range(local_size)]
        inline = backend == "nccl"
        if inline and _splits_eagerly():
            timeout = group_timeout(group)
            self.intra = dist.split_group(parent_pg=group, split_ranks=by_node, timeout=timeout)
            self.cross = dist.split_group(parent_pg=group, split_ranks=by_index, timeout=timeout)
        else:
            align_group_names(group, device if inline else torch.device("cpu"))
            self.intra = _member_group(group, by_node[self.node], backend)
            self.cross = _member_group(group, by_index[self.local_rank], backend)
        if inline:
            self.gather = self.intra  # issued inline, in bucket order (Turns)
        else:
            self.gather = _member_group(group, by_node[self.node], backend)
            sequencer(self.cross, device)
        self.cross_turns = Turns(inline)
        self.gather_turns = Turns(inline)
        self.shared = backend == "gloo" and node_memory.agreed(self.intra)


def _splits_eagerly() -> bool:
    """Whether torch connects new NCCL groups at once, by splitting the default group's
    communicator: it does when the default group has a bound device."""
    return getattr(c10d._get_default_group(), "bound_device_id", None) is not None


def align_group_names(group: dist.ProcessGroup, device: torch.device) -> None:
    """Before ``group``'s members make groups of their own (``new_group(...,
    use_local_synchronization=True)``): torch 2.13 names such a group after its ranks and
    the number of groups this process has registered (``c10d._hash_ranks_to_str``), and
    the members rendezvous under that name. Ranks that made different numbers of groups
    before (a subgroup one of them belongs to and another does not: non-members register
    nothing) would compute different names and wait for each other until the timeout. So
    the members take the largest count (a MAX all_reduce over ``group``, which they all
    reach at the same point: the first reduction that needs the groups) and each makes up
    its difference with groups of itself alone, which no other rank waits for."""
    registered = c10d._world.pg_names
    count = torch.tensor([len(registered)], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    me = dist.get_rank()
    for _ in range(int(count.item()) - len(registered)):
        dist.new_group([me], backend="gloo", use_local_synchronization=True)


def _member_group(group: dist.ProcessGroup, members: list[int], backend: str):
    """A group of ``members`` (ranks of ``group``) that only they create, on ``backend``
    (the one that runs ``group``'s collectives for the tensors at hand), with ``group``'s
    timeout: a frozen peer fails the step when the user's timeout says."""
    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(
        [ranks[r] for r in members],
        backend=backend,
        timeout=group_timeout(group),
        use_local_synchronization=True,
    )


# Weak keys: a destroyed process group is not kept alive by its topologies.
_TOPOLOGIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TOPOLOGIES_LOCK = threading.Lock()


def topology(group: dist.ProcessGroup, local_size: int, device: torch.device) -> Topology:
    """``group``'s ``Topology`` with nodes of ``local_size`` ranks, for tensors on
    ``device``: made at the first call (a collective over ``group``: every member calls it
    at the same point), the same object after."""
    backend = backend_of(group, device)
    with _TOPOLOGIES_LOCK:
        per_group = _TOPOLOGIES.setdefault(group, {})
        topo = per_group.get((local_size, backend))
        if topo is None:
            topo = per_group[local_size, backend] = Topology(
                group, local_size, backend, torch.device(device)
            )
        return topo
