"""Two-level all-reduce for multi-node groups: exact inside each node, the method across.

``two_level_mean(flat, compressor, ctx, topology)`` is ``collectives.all_reduce_mean``
composed with the node layout ``groups.Topology`` gives (N nodes of L consecutive ranks):
an exact reduce-scatter inside the node, the method's own flat algorithm over this rank's
1/L shard among the ranks holding the same shard on the other nodes (the only compressed,
slow-link step), and an all-gather inside the node. The algorithms do not know about
nodes; the topology does not know about methods.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from ddpcomm import node_memory
from ddpcomm.collectives import all_reduce_mean
from ddpcomm.compressors import Compressor, dense_bytes
from ddpcomm.context import ReduceContext
from ddpcomm.futures import (
    Future,
    completed,
    current_stream,
    device_future,
    fail,
    on_stream,
    resolve,
    then,
)
from ddpcomm.groups import Topology, all_gather_single, reduce_scatter_single, shard_range

# The exact reduce-scatter inside a node on gloo: an all_to_all_single of the shards and a
# local sum. Measured on loopback between 2 ranks (one thread each, medians of 7-9 calls,
# three runs on a busy 2-core machine), against gloo's reduce_scatter_single (torch 2.13
# has it), the list reduce_scatter, and all_reduce + slice: 1 MiB 0.57-0.89 ms (2.9-3.8,
# 1.4-4.4, 1.3-4.5), 4 MiB 2.5-4.3 (5.3-7.4, 4.1-6.5, 4.1-5.4), 16 MiB 9.5-10.6 (17.8-27.4,
# 15.2-17.5, 16.9-18.0), 32 MiB 54 (79, 41, 67), 64 MiB 104-117 (144-222, 92-225,
# 143-163). The list reduce_scatter won some runs from 32 MiB (by up to 25%), but takes
# equal chunks only: a padded copy of the bucket for uneven shards. all_to_all takes the
# shards as they are, sends a ring reduce-scatter's bytes, and the owner sums the L rows
# in rank order, with fp32 accumulation for 16-bit tensors. NCCL reduce-scatters itself.


def two_level_mean(
    flat: torch.Tensor, compressor: Compressor, ctx: ReduceContext, topology: Topology
) -> Future:
    """Mean over every rank of ``ctx.group`` of the 1-D tensor ``flat``, compressed only
    where it crosses nodes (``topology``: N nodes of L consecutive ranks).

    1. Inside the node, exact: every rank scales ``flat`` by 1/L (DDP's order, scale then
       sum, so 16-bit sums do not overflow) and the node reduce-scatters it: its rank j
       gets shard j (ceil(n/L) elements; the last shards short, or empty when n < L) of
       the node's mean.
    2. Across nodes, the method: ``all_reduce_mean`` of the shard's elements over the N
       ranks holding the same shard (``topology.cross``), the method's own flat algorithm
       (all-gather, two-phase, top-k, ...). Only node means are compressed, each rank
       compresses 1/L of the bucket, and a node sends 1/L of the flat algorithm's bytes
       per rank between nodes.
    3. Inside the node: all-gather of the shards into ``flat``.

    On gloo with CPU tensors, where the node's ranks share a host (``topology.shared``),
    steps 1 and 3 go through shared memory instead (``SharedNode``), with the same node
    mean and result.

    ``flat`` is overwritten: the Future's value is ``flat`` holding the mean, in its
    dtype, bitwise identical on every rank (each shard is one cross group's result,
    identical on its ranks, and every rank of a node gathers all of them).

    Error feedback in step 2 keeps a residual per rank for its shard, under kinds
    ``"shard:..."`` (``ReduceContext.across``). It is in units of the node mean, so the
    invariant reads N*L * sum(outputs) + L * sum(shard residuals) = sum(inputs).

    Collective order: step 1 is issued here, in bucket order; steps 2 and 3 start in the
    callback of the step before, and ``topology``'s Turns issue them in bucket order too:
    step 2 on the cross group, step 3 on the node's gather group, which nothing else uses
    (gloo: the node group meanwhile carries later buckets' step 1), or inline on the node
    group itself (NCCL: callbacks run at once on the issuing thread).
    """
    if flat.dim() != 1 or not flat.is_contiguous():
        raise ValueError("two_level_mean takes a contiguous 1-D tensor")
    compressor.check_tensor(flat, "tensor")
    n, local = flat.numel(), topology.local_size
    if n == 0:  # nothing to reduce: no collective (every rank has the same numel)
        ctx.stats.record("empty", 0, 0)
        return completed(flat, flat.device)
    size = flat.element_size()
    shard_numel = math.ceil(n / local)
    lo, hi = shard_range(n, local, topology.local_rank)
    dense = dense_bytes(n, local * topology.nodes, size)

    def typed(name: str, numel: int) -> torch.Tensor:
        return ctx.buffer(name, numel * size, flat.device).view(flat.dtype)

    shared = topology.shared and flat.device.type == "cpu"
    even = shard_numel * local == n
    padded = flat if even or shared else typed("two_level_pad", shard_numel * local)
    intra = 2 * (local - 1) * shard_numel * size
    ctx.stats.record_two_level(intra, dense, dense // local, shared)
    node_sum = node = None
    if shared:
        node = SharedNode(flat, ctx, topology)
        work = node.write()
        shard = mine = node.shard  # in this rank's shared half: reduced there in place
        node_sum = node.sum
    elif topology.backend == "gloo":
        shard = typed("two_level_shard", shard_numel)
        mine = shard[: hi - lo]
        flat.mul_(1.0 / local)
        received = typed("two_level_receive", local * (hi - lo)).view(local, hi - lo)
        splits = [b - a for a, b in (shard_range(n, local, j) for j in range(local))]
        work = dist.all_to_all_single(
            received.view(-1), flat, [hi - lo] * local, splits, group=topology.intra, async_op=True
        )

        def node_sum():
            torch.sum(received, dim=0, out=mine)

    else:
        shard = typed("two_level_shard", shard_numel)
        mine = shard[: hi - lo]
        if padded is flat:
            flat.mul_(1.0 / local)
        else:
            torch.mul(flat, 1.0 / local, out=padded[:n])
            padded[n:].zero_()
        work = reduce_scatter_single(shard, padded, group=topology.intra, async_op=True)
    across = ctx.across(topology.cross)
    ticket = topology.cross_turns.ticket()
    result = device_future(flat.device)

    def landed(fut):
        try:
            fut.wait()
            if node_sum is not None:
                node_sum()
        except Exception as exc:  # noqa: BLE001 - handed to the waiter
            topology.cross_turns.submit(ticket, lambda: None)
            fail(result, exc)
            return None
        # Step 2 may be issued from a later bucket's callback, on another thread: it must
        # follow this callback's stream, which holds the shard.
        stream = current_stream(flat)
        topology.cross_turns.submit(ticket, lambda: cross(stream))
        return shard  # received (and summed) on this callback's stream

    def cross(stream) -> None:
        try:
            with on_stream(stream):
                fut = all_reduce_mean(mine, compressor, across)
            gather_ticket = topology.gather_turns.ticket()
        except Exception as exc:  # noqa: BLE001 - never raised into another bucket's callback
            fail(result, exc)
            return
        then(fut, functools.partial(crossed, gather_ticket))

    def crossed(gather_ticket, fut):
        try:
            fut.wait()
        except Exception as exc:  # noqa: BLE001
            topology.gather_turns.submit(gather_ticket, lambda: None)
            fail(result, exc)
            return None
        stream = current_stream(flat)
        topology.gather_turns.submit(gather_ticket, lambda: gather(stream))
        return mine  # the mean over every rank of this shard, on this callback's stream

    def gather(stream) -> None:
        try:
            if node is not None:
                work = node.publish()
            else:
                with on_stream(stream):
                    work = all_gather_single(padded, shard, group=topology.gather, async_op=True)
        except Exception as exc:  # noqa: BLE001
            fail(result, exc)
            return
        then(work.get_future(), gathered)

    def gathered(fut) -> None:
        try:
            fut.wait()
            if node is not None:
                node.read()
            elif padded is not flat:
                flat.copy_(padded[:n])
            resolve(result, flat)
        except Exception as exc:  # noqa: BLE001
            fail(result, exc)

    then(work.get_future(), landed)
    return result


class SharedNode:
    """Steps 1 and 3 inside a node through shared memory (``node_memory``), for CPU
    tensors on gloo when the node's ranks share a host: the node mean of the same shard
    as the all_to_all path, with two small gloo collectives as barriers.

    ``write``: this rank's bucket, scaled by 1/L, into its segment's half for this call;
    an all-gather of the segments' names (every rank's half is written once it lands).
    ``sum``: the node mean of this rank's shard from every rank's half, in rank order
    (fp32 accumulation for 16-bit), into ``shard``: the shard's place in this rank's own
    half, which no peer reads until the last barrier, so the cross-node step reduces it
    in place. ``publish``: that barrier, an 8-byte all_reduce on the gather group (every
    shard is reduced once it lands). ``read``: every rank's shard into ``flat``.
    """

    __slots__ = ("flat", "ctx", "topology", "segment", "rows", "halves", "shard", "lo", "hi")

    def __init__(self, flat, ctx, topology) -> None:
        self.flat, self.ctx, self.topology = flat, ctx, topology
        self.segment = ctx.segment("two_level_node", flat.numel() * flat.element_size())
        self.rows = torch.empty(topology.local_size, 4, dtype=torch.int64)
        self.halves: list[torch.Tensor] = []
        self.lo, self.hi = shard_range(flat.numel(), topology.local_size, topology.local_rank)
        self.shard: torch.Tensor | None = None  # write() places it

    def write(self) -> dist.Work:
        half = self.segment.begin()
        if half is None:  # no segment: sum() raises on every rank of the node
            self.shard = self.flat.new_empty(self.hi - self.lo)
        else:
            half = half.view(self.flat.dtype)
            torch.mul(self.flat, 1.0 / self.topology.local_size, out=half)
            self.shard = half[self.lo : self.hi]
        ident = self.segment.ident()
        return all_gather_single(
            self.rows.view(-1), ident, group=self.topology.intra, async_op=True
        )

    def sum(self) -> None:
        t, dtype = self.topology, self.flat.dtype
        node = [dist.get_global_rank(t.intra, j) for j in range(t.local_size)]
        node_memory.check_idents(self.rows, node)
        self.halves = [
            self.segment.peer(j, row).view(dtype) for j, row in enumerate(self.rows.tolist())
        ]
        parts = [h[self.lo : self.hi] for h in self.halves]  # parts[local_rank] is shard
        if dtype == torch.float32 and t.local_rank < 2:  # shard is read before written
            acc = torch.add(parts[0], parts[1], out=self.shard)
        else:
            acc = self.ctx.buffer("two_level_acc", 4 * self.shard.numel(), "cpu")
            acc = acc.view(torch.float32).copy_(parts[0]).add_(parts[1])  # added in float32
        for p in parts[2:]:
            acc.add_(p)
        if acc is not self.shard:
            self.shard.copy_(acc)

    def publish(self) -> dist.Work:
        return dist.all_reduce(
            torch.zeros(1, dtype=torch.int64), group=self.topology.gather, async_op=True
        )

    def read(self) -> None:
        t, n = self.topology, self.flat.numel()
        for j, half in enumerate(self.halves):
            lo, hi = shard_range(n, t.local_size, j)
            self.flat[lo:hi].copy_(half[lo:hi])
