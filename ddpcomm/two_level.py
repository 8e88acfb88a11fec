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
    ctx.stats.record_two_level(2 * (local - 1) * shard_numel * size, dense, dense // local)

    def typed(name: str, numel: int) -> torch.Tensor:
        return ctx.buffer(name, numel * size, flat.device).view(flat.dtype)

    shard = typed("two_level_shard", shard_numel)
    mine = shard[: hi - lo]
    padded = flat if shard_numel * local == n else typed("two_level_pad", shard_numel * local)
    node_sum = None
    if topology.backend == "gloo":
        flat.mul_(1.0 / local)
        received = typed("two_level_receive", local * (hi - lo)).view(local, hi - lo)
        splits = [b - a for a, b in (shard_range(n, local, j) for j in range(local))]
        work = dist.all_to_all_single(
            received.view(-1), flat, [hi - lo] * local, splits, group=topology.intra, async_op=True
        )

        def node_sum():
            torch.sum(received, dim=0, out=mine)

    else:
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
            with on_stream(stream):
                work = all_gather_single(padded, shard, group=topology.gather, async_op=True)
        except Exception as exc:  # noqa: BLE001
            fail(result, exc)
            return
        then(work.get_future(), gathered)

    def gathered(fut) -> None:
        try:
            fut.wait()
            if padded is not flat:
                flat.copy_(padded[:n])
            resolve(result, flat)
        except Exception as exc:  # noqa: BLE001
            fail(result, exc)

    then(work.get_future(), landed)
    return result
