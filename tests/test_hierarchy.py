"""Multi-node training: the two-level reduction (``hierarchy``), exact inside each node and
compressed only across nodes.

On spawned gloo groups of 4 ranks (2 nodes of 2) and 6 ranks (3 nodes of 2, where the
quantizers go two-phase across nodes; and 2 nodes of 3 for ``"auto"``), each spawned
once (tests/spawn_plan.py): every method two-level is bitwise identical on every rank and
within its analytic bound of the exact mean (the bound of N node means, not of N*L
inputs), ``none`` is a plain all_reduce up to float rounding, uneven and empty shards
work, error feedback keeps its invariant with the shard residuals, a DDP model trains
identically on every rank and close to DDP's default, a resumed run continues bitwise,
``"auto"`` reads torchrun's LOCAL_WORLD_SIZE (and says why it stays flat), and ranks that
differ get a ValueError, not a hang. Last, two torchrun "nodes" on loopback find their
nodes from the environment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import glob
import io
import itertools
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import ddpcomm
from ddpcomm import collectives, compressors, futures, groups, node_memory, run, two_level
from ddpcomm.context import ReduceContext, ResidualMemory, Stats, Workspace
from tests.collective_utils import (
    N,
    assert_same_on_every_rank,
    quantization_error_bound,
    quantizer,
    rank_input,
)
from tests.ddp_utils import SHALLOW, flat_params, identical_across_ranks, train
from tests.spawn_plan import Groups

LOCAL = 2  # ranks per node in most checks: 2 nodes at world 4, 3 at world 6
WORLDS = (4, 6)
U32, U16 = 2.0**-24, 2.0**-11  # unit roundoff of float32 and float16

# One step of every method without error feedback: the result is a function of the inputs.
METHODS = {
    "none": ("none", {}),
    "fp16": ("fp16", {}),
    "q8": quantizer(8, error_feedback=False),
    "q4": quantizer(4, error_feedback=False),
    "q1": quantizer(1, error_feedback=False),
    "topk": ("topk:0.1", dict(error_feedback=False)),
    "randk": ("randk:0.1", dict(seed=3, error_feedback=False)),
}
ERROR_FEEDBACK = {
    "q4": quantizer(4, error_feedback=True),  # all-gather at 2 nodes, two-phase at 3
    "q1": quantizer(1),
    "topk": ("topk:0.1", {}),
    "randk": ("randk:0.1", dict(seed=5)),
}
# n < L (an empty shard), n = 0, one more than L (a short last shard), an odd bucket.
UNEVEN = (0, 1, LOCAL + 1, N)
DTYPES = (torch.float32, torch.bfloat16)


def _method(name: str, table=METHODS):
    spec, options = table[name]
    return compressors.parse(spec, **options)


def _topology(local: int = LOCAL, group=None) -> groups.Topology:
    return groups.topology(group or dist.group.WORLD, local, torch.device("cpu"))


def _two_level(x, c, topology, memory=None, key=0, step=0, stats=None):
    ctx = ReduceContext(memory=memory or ResidualMemory(), key=key, step=step, stats=stats)
    return two_level.two_level_mean(x.clone(), c, ctx, topology).wait()


def _node_means(xs: list[torch.Tensor], local: int) -> list[torch.Tensor]:
    """Each node's mean as the intra-node step forms it in float32: inputs scaled by 1/L,
    summed in rank order."""
    return [
        functools.reduce(torch.add, [x * (1.0 / local) for x in xs[i : i + local]])
        for i in range(0, len(xs), local)
    ]


def _shards(n: int, local: int):
    return [groups.shard_range(n, local, j) for j in range(local)]


# --------------------------------------------------------------------------------------
# Collective checks (every world)
# --------------------------------------------------------------------------------------


def check_method(rank: int, world: int, name: str) -> dict:
    """Two-level against the exact mean and the method's bound; returns the RMS errors of
    two-level and flat on the same inputs (the flat one for the record)."""
    c = _method(name)
    nodes = world // LOCAL
    xs = [rank_input(i, N) for i in range(world)]
    stats = Stats()
    two = _two_level(xs[rank], c, _topology(), stats=stats)
    assert two.dtype == torch.float32 and two.shape == (N,)
    assert_same_on_every_rank(two, world)
    flat = collectives.all_reduce_mean(xs[rank].clone(), c, ReduceContext()).wait()
    exact = torch.stack(xs).double().mean(0)
    means = _node_means(xs, LOCAL)
    err = (two.double() - exact).abs()
    mean_abs = torch.stack(means).double().abs().mean(0)  # mean over nodes of |node mean|
    if name == "none":
        plain = xs[rank].clone()
        collectives.plain_all_reduce(plain, ReduceContext()).wait()
        # Both sides are sums of float32 terms scaled by reciprocals: flat adds W terms,
        # two-level L then N (plus one rounding per scaling), so each is within
        # (W + 1) u * mean_r |x_r| of the exact mean and they are within (L + N + W + 2) u
        # of each other. Measured: at most 3.2 u * mean_r |x_r| apart at 2x2 (two-level
        # 1.6 u from the exact mean, flat 2.1 u), 3.9 u at 3x2 (2.5 u, 3.2 u).
        scale = torch.stack(xs).double().abs().mean(0)
        gap = (two.double() - plain.double()).abs()
        assert bool((gap <= (LOCAL + nodes + world + 2) * U32 * scale + 1e-30).all())
    elif name == "fp16":
        # Each node mean is cast to fp16 (u16 relative), divided by N and summed in fp16
        # over N terms (N - 1 roundings of partial sums): within (N + 1) u16 of the
        # mean of node means, plus the node means' own float32 rounding and fp16's
        # subnormal spacing (2^-24) per term.
        bound = (nodes + 2) * U16 * mean_abs + nodes * 2.0**-24
        assert bool((err <= bound).all()), float((err / bound).max())
    elif isinstance(c, compressors.Quantizer):
        # The bound of quantizing N node means (each shard's blocks start at the shard),
        # not of quantizing N*L inputs; plus the node means' own float32 rounding.
        two_phase = c.resolve_algorithm(nodes) == "two_phase"
        bound = torch.empty(N)
        for lo, hi in _shards(N, LOCAL):
            part = [m[lo:hi] for m in means]
            chunk = c.chunk_numel(hi - lo, nodes)
            bound[lo:hi] = quantization_error_bound(part, c.bits, two_phase, chunk)
        bound = bound.double() + 2 * U32 * mean_abs
        assert bool((err <= bound).all()), float((err / bound).max())
    elif isinstance(c, compressors.TopK):
        # Each node keeps the k largest entries of its shard's node mean; the result is
        # their sum over nodes in node order, over N.
        want = torch.zeros(N)
        for lo, hi in _shards(N, LOCAL):
            k = c.k(hi - lo)
            total = torch.zeros(hi - lo)
            for m in means:
                keep = m[lo:hi].abs().topk(k).indices
                total[keep] += m[lo:hi][keep]
            want[lo:hi] = total / nodes
        torch.testing.assert_close(two, want, rtol=1e-6, atol=1e-7)
    else:
        # Random-k: the same k indices on every node of a shard, whose entries are the
        # exact mean there (up to float32 rounding); zero elsewhere.
        scale = torch.stack(xs).double().abs().mean(0)
        for lo, hi in _shards(N, LOCAL):
            got = two[lo:hi]
            kept = got != 0
            assert int(kept.sum()) == c.k(hi - lo)
            gap = (got[kept].double() - exact[lo:hi][kept]).abs()
            assert bool((gap <= (nodes + 3) * U32 * scale[lo:hi][kept]).all())
    d = stats.as_dict()
    assert d["paths"]["two_level"] == 1 and d["intra_node_bytes"] > 0
    assert d["intra_node_shared_bytes"] == d["intra_node_bytes"]  # one host: shared memory
    assert d["compression_ratio"] == d["cross_node_dense_bytes"] / d["cross_node_bytes"]
    rms = lambda t: float(((t.double() - exact) ** 2).mean().sqrt())  # noqa: E731
    return {"two_level": rms(two), "flat": rms(flat), "ratio": d["compression_ratio"]}


def check_uneven(rank: int, world: int, local: int) -> None:
    """n = 0, n < L (empty shards), a short last shard, an odd bucket: every method."""
    topology = _topology(local)
    for name in METHODS:
        c = _method(name)
        for n in UNEVEN + (local - 1,):
            xs = [rank_input(i, n) for i in range(world)]
            out = _two_level(xs[rank], c, topology)
            assert out.shape == (n,)
            assert_same_on_every_rank(out, world)
            exact = torch.stack(xs).double().mean(0) if n else torch.zeros(0)
            if name == "none" or (n == 1 and name != "fp16"):
                # Lossless, or one element: each method but the cast sends it whole (one
                # block scaled by its magnitude, k = 1).
                tol = (world + local + 2) * U32 * torch.stack(xs).abs().double().mean(0)
                assert bool(((out.double() - exact).abs() <= tol + 1e-30).all()), (name, n)


def check_error_feedback(rank: int, world: int, name: str) -> None:
    """Over 6 steps: N*L * sum(outputs) + L * sum(shard residuals) = sum(inputs), over
    ranks (the shard residuals are in units of the node mean: see two_level_mean)."""
    c = _method(name, ERROR_FEEDBACK)
    nodes, topology = world // LOCAL, _topology()
    memory = ResidualMemory()
    total_out = torch.zeros(N, dtype=torch.float64)
    total_in = torch.zeros(N, dtype=torch.float64)
    for step in range(6):
        xs = [rank_input(i, N, step) for i in range(world)]
        total_in += torch.stack(xs).double().sum(0)
        out = _two_level(xs[rank], c, topology, memory, key=7, step=step)
        assert_same_on_every_rank(out, world)
        total_out += out.double()
    lo, hi = groups.shard_range(N, LOCAL, topology.local_rank)
    residual = torch.zeros(N, dtype=torch.float64)
    kinds = {kind for kind, _ in memory.buffers}
    assert kinds <= {"shard:q", "shard:q_owner", "shard:topk", "shard:randk"}, kinds
    for (kind, _), buf in memory.buffers.items():
        if kind == "shard:q_owner":  # this rank's chunk of its shard, across the N nodes
            at = lo + topology.node * c.chunk_numel(hi - lo, nodes)
            residual[at : at + buf.numel()] += buf.double()
        else:
            assert buf.numel() == hi - lo
            residual[lo:hi] += buf.double()
    assert float(residual.abs().sum()) > 0  # the test is not vacuous
    dist.all_reduce(residual)
    lhs = world * total_out + LOCAL * residual
    scale = float(total_in.abs().max())
    # Only the float32 rounding of each step's node means and mean separates the sides.
    assert float((lhs - total_in).abs().max()) <= 1e-5 * scale
    # Not trivially true: without the residuals it fails.
    assert float((world * total_out - total_in).abs().max()) > 1e-3 * scale


def check_in_flight(rank: int, world: int, name: str) -> None:
    """Many buckets in flight at once, waited for in reverse order, for 3 steps: gloo lands
    them in a different order on every rank, and each step after the first must still pair
    by bucket (topology's Turns); bitwise what one bucket at a time gives."""
    c, topology = _method(name, ERROR_FEEDBACK), _topology()
    sizes = [64 * k + (37 * k) % 50 for k in range(1, 13)]
    together, alone = ResidualMemory(), ResidualMemory()
    for step in range(3):
        xs = [rank_input(rank, n, step) for n in sizes]
        futs = [
            two_level.two_level_mean(
                x.clone(), c, ReduceContext(memory=together, key=k, step=step), topology
            )
            for k, x in enumerate(xs)
        ]
        outs = [f.wait() for f in reversed(futs)][::-1]
        for k, (x, out) in enumerate(zip(xs, outs, strict=True)):
            assert torch.equal(out, _two_level(x, c, topology, alone, key=k, step=step))


def check_auto(rank: int, world: int) -> dict:
    """``hierarchy="auto"`` from LOCAL_WORLD_SIZE / LOCAL_RANK, per hook state (each decides
    at its first reduction): what it decides, and the same bits as the explicit L."""
    x = rank_input(rank, N)
    sizes = (LOCAL, 3) if world == 6 else (LOCAL,)
    cases = {f"lws={s}": {"LOCAL_WORLD_SIZE": str(s), "LOCAL_RANK": str(rank % s)} for s in sizes}
    cases["differs"] = {"LOCAL_WORLD_SIZE": "1" if rank == 1 else "2", "LOCAL_RANK": "0"}
    cases["unset"] = {} if rank == world - 1 else {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    cases["misnumbered"] = {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": str((rank + 1) % 2)}
    cases["whole group"] = {"LOCAL_WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}
    decided = {}
    for case, env in cases.items():
        with _environ(env):
            state = ddpcomm.CompressionState("q8,hierarchy=auto")
            out = state.reduce(x.clone(), 0, ()).wait()
        h = state.stats()["hierarchy"]
        local = h["local_size"]
        twin = ddpcomm.CompressionState("q8" if local is None else f"q8,hierarchy={local}")
        assert torch.equal(out, twin.reduce(x.clone(), 0, ()).wait())
        assert ("two_level" in state.stats()["paths"]) == (local is not None)
        decided[case] = h
    return decided


def check_auto_subgroups(rank: int, world: int) -> dict:
    """A group that is not the world: its ranks must fall into whole nodes, as many from
    each node, node by node (2 nodes of 3 ranks at world 6).

    The two-level group goes first: its members make groups that ranks 2 and 5 do not, so
    the flat group [0, 1, 2, 3] after it makes its two-phase companion among ranks that
    have made different numbers of groups (groups.align_group_names)."""
    decided = {}
    with _environ({"LOCAL_WORLD_SIZE": "3", "LOCAL_RANK": str(rank % 3)}):
        for ranks in ([0, 1, 3, 4], [0, 1, 2, 3], [0, 3]):
            group = dist.new_group(ranks)
            if rank not in ranks:
                continue
            x = rank_input(rank, 1001)
            state = ddpcomm.CompressionState("q8,hierarchy=auto", process_group=group)
            out = state.reduce(x.clone(), 0, ()).wait()
            assert_same_on(out, group)
            decided[str(ranks)] = (state.stats()["hierarchy"], dict(state.stats()["paths"]))
    return decided


def assert_same_on(t: torch.Tensor, group) -> None:
    rows = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, t, group=group)
    assert all(torch.equal(r, rows[0]) for r in rows)


@contextlib.contextmanager
def _environ(values: dict):
    names = {"LOCAL_WORLD_SIZE", "LOCAL_RANK", *values}
    saved = {k: os.environ.pop(k, None) for k in names}
    os.environ.update(values)
    try:
        yield
    finally:
        for k in names:
            os.environ.pop(k, None)
            if saved[k] is not None:
                os.environ[k] = saved[k]


def check_wrappers(rank: int, world: int) -> None:
    """ddpcomm.all_reduce / all_reduce_coalesced with ``hierarchy``: the two-level mean (sum:
    times the world size), as a keyword or in the spec, sync or async."""
    x = rank_input(rank, N)
    want = _two_level(x, compressors.parse("q8"), _topology())
    for kwargs in ({"compression": "q8", "hierarchy": LOCAL}, {"compression": "q8,hierarchy=2"}):
        t = x.clone()
        ddpcomm.all_reduce(t, **kwargs)
        assert torch.equal(t, want)
    t = x.clone()
    ddpcomm.all_reduce(t, "q8", op="sum", hierarchy=LOCAL, async_op=True).wait()
    assert torch.equal(t, want * world)
    pair = [x.clone(), x[:77].clone()]
    both = _two_level(torch.cat(pair), compressors.parse("q8"), _topology())
    ddpcomm.all_reduce_coalesced(pair, "q8", hierarchy=LOCAL)
    assert torch.equal(torch.cat(pair), both)  # one flat buffer, reduced two-level
    # "none" two-level: the plain sum up to float rounding.
    t, plain = x.clone(), x.clone()
    ddpcomm.all_reduce(t, op="sum", hierarchy=LOCAL)
    dist.all_reduce(plain)
    scale = torch.stack([rank_input(i, N) for i in range(world)]).abs().sum(0)
    assert bool(((t - plain).abs() <= 2 * (world + 2) * U32 * scale).all())


def check_inside_paths(rank: int, world: int) -> None:
    """Inside a node through shared memory (its ranks share this host) and through gloo's
    sockets (DDPCOMM_NODE_SHM=0): equal results, identical on every rank, for fp32 and
    bf16, empty and uneven shards, over three calls of each bucket (a segment's two halves
    in turn, then the first again), a hook-like workspace, a rank that starts over with
    new segments, and async calls in flight together; no file is left in /dev/shm."""
    mine = os.path.join(node_memory.DIRECTORY, f"ddpcomm-{node_memory.owner():x}-*")
    before = set(glob.glob(mine))
    outs = {}
    for env in ("1", "0"):
        group = dist.new_group(list(range(world)))
        with _environ({node_memory.ENV: env}):
            topology = _topology(group=group)
        assert topology.shared == (env == "1")
        workspace, got = Workspace(), outs.setdefault(env, [])
        for name, dtype, n in itertools.product(("none", "q4"), DTYPES, (1, LOCAL + 1, 1001)):
            c = _method(name)
            for step in range(3):
                x = rank_input(rank, n, step).to(dtype)
                ctx = ReduceContext(key=(name, dtype, n), step=step, workspace=workspace)
                got.append(two_level.two_level_mean(x, c, ctx, topology).wait())
                assert_same_on_every_rank(got[-1], world)
                d = ctx.stats.as_dict()
                shared = d["intra_node_shared_bytes"]
                assert shared == (d["intra_node_bytes"] if topology.shared else 0), d
        # Rank 0 starts over with new segments while the others keep theirs (as a pool
        # that found its buffers taken would): it maps theirs again.
        x = rank_input(rank, 1001, 9)
        for fresh in (False, rank == 0):
            ctx = ReduceContext(key="again", workspace=Workspace() if fresh else workspace)
            got.append(two_level.two_level_mean(x.clone(), _method("q4"), ctx, topology).wait())
        assert torch.equal(got[-1], got[-2])
        xs = [rank_input(rank, 5000, i) for i in range(3)]
        handles = [
            ddpcomm.all_reduce(x, "q8", group=group, hierarchy=LOCAL, async_op=True) for x in xs
        ]
        assert all(h.wait() for h in handles)
        got += xs
    assert all(torch.equal(a, b) for a, b in zip(outs["1"], outs["0"], strict=True))
    del workspace, ctx, handles
    gc.collect()
    assert set(glob.glob(mine)) <= before  # a dropped segment takes its file with it


def check_shared_memory_full(rank: int, world: int) -> str:
    """No room in /dev/shm on any rank: every rank raises a clear error (never a SIGBUS)."""

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    topology = _topology(group=dist.new_group(list(range(world))))
    saved, os.posix_fallocate = os.posix_fallocate, full
    try:
        with pytest.raises(RuntimeError, match="could not reserve shared memory") as info:
            _two_level(rank_input(rank, 100), compressors.parse("q8"), topology)
    finally:
        os.posix_fallocate = saved
    return str(info.value)


def check_bad_shm_setting(rank: int, world: int) -> str:
    """DDPCOMM_NODE_SHM=yes on rank 1: a ValueError on every rank of its node, naming it
    (after the node's collective, so nobody waits); the other node goes on."""
    group = dist.new_group(list(range(world)))
    with _environ({node_memory.ENV: "yes" if rank == 1 else "1"}):
        try:
            return str(_topology(group=group).shared)
        except ValueError as exc:
            return str(exc)


# --------------------------------------------------------------------------------------
# DDP (world 4)
# --------------------------------------------------------------------------------------


def check_parity(rank: int, world: int) -> dict:
    """q4 two-level under DDP: replicas identical, close to DDP's default; stats split."""
    state = ddpcomm.CompressionState("q4,hierarchy=2")
    model, losses = train(rank, SHALLOW, state, ddpcomm.compress_hook)
    p = flat_params(model)
    assert identical_across_ranks(p, world), "replicas differ"
    ref_model, ref_losses = train(rank, SHALLOW, None, None)
    ref = flat_params(ref_model)
    flat_model, _ = train(rank, SHALLOW, ddpcomm.CompressionState("q4"), ddpcomm.compress_hook)
    stats = state.stats()
    assert stats["hierarchy"] == {"local_size": 2, "why": "hierarchy=2: 2 nodes of 2 ranks"}
    assert stats["paths"]["two_level"] > 0 and stats["paths"]["q_all_gather"] > 0
    assert 0 < stats["cross_node_bytes"] < stats["cross_node_dense_bytes"]
    assert stats["bytes_sent"] == stats["intra_node_bytes"] + stats["cross_node_bytes"]
    return dict(
        rel=float((p - ref).norm() / ref.norm()),
        flat_rel=float((flat_params(flat_model) - ref).norm() / ref.norm()),
        loss=losses[-1],
        ref_loss=ref_losses[-1],
        ratio=stats["compression_ratio"],
    )


def check_resume(rank: int, world: int) -> None:
    """8 steps straight against 4, state_dict through torch.save, a fresh state on a fresh
    DDP model, 4 more: bitwise the same parameters (the shard residuals carry the unsent
    gradient mass, so a lost one would show)."""
    recipe = dataclasses.replace(SHALLOW, momentum=0.0)
    straight, _ = train(rank, recipe, _resumable(), ddpcomm.compress_hook, steps=8)
    state = _resumable()
    model, _ = train(rank, recipe, state, ddpcomm.compress_hook, steps=4)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved = _saved(state)
    assert any(kind.startswith("shard:") for kind, _ in saved["memory"]["buffers"])
    fresh = _resumable()
    fresh.load_state_dict(saved)
    model = recipe.model()
    model.load_state_dict(weights)
    resumed, _ = train(rank, recipe, fresh, ddpcomm.compress_hook, steps=4, model=model, start=4)
    assert torch.equal(flat_params(resumed), flat_params(straight))


def _resumable(hierarchy=LOCAL) -> ddpcomm.CompressionState:
    return ddpcomm.CompressionState("q4,error_feedback", hierarchy=hierarchy)


def _saved(state) -> dict:
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def check_checkpoint_hierarchy(rank: int, world: int) -> dict:
    """A state_dict records the hierarchy and the node size decided: a state with another
    hierarchy refuses it, and one whose "auto" decides other nodes fails at its first
    iteration (the shard residuals belong to the saved layout)."""
    with _environ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": str(rank % 2)}):
        state = _resumable("auto")
        train(rank, SHALLOW, state, ddpcomm.compress_hook, steps=2)
    saved = _saved(state)
    out = {"recorded": (saved.get("hierarchy"), saved.get("local_size"))}
    out["flat"] = _error(lambda: _resumable(None).load_state_dict(saved))
    out["explicit"] = _error(lambda: _resumable(LOCAL).load_state_dict(saved))
    with _environ({"LOCAL_WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)}):
        fresh = _resumable("auto")
        fresh.load_state_dict(saved)
        try:
            train(rank, SHALLOW, fresh, ddpcomm.compress_hook, steps=1)
        except Exception as exc:  # noqa: BLE001 - DDP re-raises hook errors as RuntimeError
            out["first_iteration"] = str(exc)
    return out


def _error(call) -> str:
    """The message of the ValueError ``call`` raises ("no error" if none): pytest.raises'
    failure is a BaseException, which would end the rank's whole plan."""
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return "no error"


def check_bad_size(rank: int, world: int) -> str:
    return _error(lambda: ddpcomm.CompressionState("q4", hierarchy=3))


def check_mismatch(rank: int, world: int) -> dict:
    """One rank with another hierarchy: a ValueError on every rank, from the hook and from
    ddpcomm.all_reduce, before any collective."""
    out = {}
    try:
        ddpcomm.all_reduce(rank_input(rank, 64), "q8", hierarchy=LOCAL if rank else None)
    except ValueError as exc:
        out["all_reduce"] = str(exc)
    state = ddpcomm.CompressionState("q4", hierarchy="auto" if rank == 1 else LOCAL)
    try:
        train(rank, SHALLOW, state, ddpcomm.compress_hook, steps=1)
    except Exception as exc:  # noqa: BLE001 - DDP re-raises hook errors as RuntimeError
        out["hook"] = str(exc)
    return out


def _stream_rule(rank: int, world: int) -> tuple:
    """The callbacks run so far under the stream-rule check, and its violations."""
    return futures.checked, list(futures.violations)


# --------------------------------------------------------------------------------------
# The plan, and the tests reading it
# --------------------------------------------------------------------------------------


def plan(rank: int, world: int, device: str):
    p = functools.partial
    # Small gloo pieces: the cross-node step's multi-piece paths run on these small tensors.
    collectives._GLOO_PIECE_BYTES = collectives._GLOO_MIN_PIECE_BYTES = 2048
    futures.check_stream_rule(True)
    for name in METHODS:
        yield ("method", name), p(check_method, rank, world, name)
    for local in (LOCAL, 3) if world == 6 else (LOCAL,):
        yield ("uneven", local), p(check_uneven, rank, world, local)
    for name in ERROR_FEEDBACK:
        yield ("error_feedback", name), p(check_error_feedback, rank, world, name)
    for name in ("q4", "topk"):
        yield ("in_flight", name), p(check_in_flight, rank, world, name)
    yield ("auto",), p(check_auto, rank, world)
    yield ("inside_paths",), p(check_inside_paths, rank, world)
    yield ("shm_full",), p(check_shared_memory_full, rank, world)
    if world == 6:
        yield ("auto_subgroups",), p(check_auto_subgroups, rank, world)
        yield ("stream_rule",), p(_stream_rule, rank, world)
        return
    yield ("bad_shm_setting",), p(check_bad_shm_setting, rank, world)
    yield ("wrappers",), p(check_wrappers, rank, world)
    yield ("bad_size",), p(check_bad_size, rank, world)
    yield ("parity",), p(check_parity, rank, world)
    yield ("resume",), p(check_resume, rank, world)
    yield ("stream_rule",), p(_stream_rule, rank, world)
    yield ("checkpoint_hierarchy",), p(check_checkpoint_hierarchy, rank, world)
    # Last: a hook that raised leaves its DDP model unusable.
    yield ("mismatch",), p(check_mismatch, rank, world)


@pytest.fixture(scope="module")
def spawned():
    # Mismatches are found at once (every rank publishes); the short timeouts only turn a
    # regression into a hang into a quick failure.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DDPCOMM_AGREEMENT_TIMEOUT", "15")
        yield Groups(plan, pg_timeout=60.0)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_two_level(spawned, method, world):
    """Bitwise identical on every rank, within the bound of N node means (checked in the
    rank); at 2x2 quantizing node means must not be worse than quantizing every input."""
    errors = spawned.values(world, "cpu", "method", method)
    # Every rank measured the same errors (the compression ratio is each rank's own: its
    # shard of an odd bucket may be one element short).
    assert len({(e["two_level"], e["flat"]) for e in errors}) == 1
    e = errors[0]
    if method.startswith("q") and world == 4:
        # At 2 nodes both quantize once (all-gather): two-level the 2 node means, flat the
        # 4 inputs, whose heavy-tailed block maxima averaging halves. Measured (n = 10007,
        # RMS against the exact mean): two-level 0.69x the flat error for q8, 0.74x for
        # q4, 0.89x for q1 (fp16 0.73x). At 3 nodes both go two-phase and the owner's
        # re-quantization dominates: 0.95x, 1.03x, 0.95x; recorded, not asserted. The
        # bound is the analytic one, checked in the rank; this guards the direction.
        assert e["two_level"] < e["flat"], e
    assert e["ratio"] > 1


@pytest.mark.parametrize("world", WORLDS)
def test_uneven_and_empty_shards(spawned, world):
    spawned.values(world, "cpu", "uneven")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("method", list(ERROR_FEEDBACK))
def test_error_feedback_invariant_with_shard_residuals(spawned, method, world):
    spawned.values(world, "cpu", "error_feedback", method)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("method", ["q4", "topk"])
def test_buckets_in_flight_pair_by_bucket(spawned, method, world):
    spawned.values(world, "cpu", "in_flight", method)


@pytest.mark.parametrize("world", WORLDS)
def test_shared_memory_and_sockets_inside_nodes_agree(spawned, world):
    spawned.values(world, "cpu", "inside_paths")


@pytest.mark.parametrize("world", WORLDS)
def test_a_full_dev_shm_is_a_clear_error_on_every_rank(spawned, world):
    for rank, message in enumerate(spawned.values(world, "cpu", "shm_full")):
        node = rank // LOCAL * LOCAL
        assert f"rank(s) {node}, {node + 1} could not reserve" in message, message
        assert "DDPCOMM_NODE_SHM=0" in message


def test_a_bad_shared_memory_setting_is_named_on_its_node(spawned):
    got = spawned.values(4, "cpu", "bad_shm_setting")
    for message in got[:2]:
        assert "DDPCOMM_NODE_SHM must be 0 or 1 (unset: 1); rank(s) 1 have" in message
    assert got[2:] == ["True", "True"]


def test_sweep_removes_only_the_files_of_ended_processes(monkeypatch, tmp_path):
    # Files of ended processes (no lock) go; a file in use (this process's segment, its
    # lock held) stays, and so does one too young to have been locked yet.
    monkeypatch.setattr(node_memory, "DIRECTORY", str(tmp_path))
    monkeypatch.setattr(node_memory, "_swept", [0])  # the first segment's own sweep: done
    old = time.time() - 2 * node_memory.SWEEP_AGE_S
    for name in ("ddpcomm-1-0", "ddpcomm-1-1", "ddpcomm-2-5", "other"):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (old, old))
    (tmp_path / "ddpcomm-3-0").write_bytes(b"x")  # young
    segment = node_memory.Segment(64)
    os.utime(segment.path, (old, old))
    assert node_memory.sweep() == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["other", "ddpcomm-3-0", os.path.basename(segment.path)]
    )
    del segment
    gc.collect()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddpcomm-3-0", "other"]
    # A process's first segment sweeps.
    (tmp_path / "ddpcomm-4-0").write_bytes(b"x")
    os.utime(tmp_path / "ddpcomm-4-0", (old, old))
    monkeypatch.setattr(node_memory, "_swept", [])
    assert node_memory.Segment(64).error is None
    assert not (tmp_path / "ddpcomm-4-0").exists() and node_memory._swept == [1]


def test_a_rank_without_its_segment_is_named():
    rows = torch.tensor([[10, 0, 1, 0], [11, 0, 0, 1], [12, 3, 1, 1]])
    with pytest.raises(RuntimeError, match=r"rank\(s\) 7 could not reserve"):
        node_memory.check_idents(rows, [6, 7, 8])
    node_memory.check_idents(rows[[0, 2]], [6, 8])


@pytest.mark.parametrize("world", WORLDS)
def test_every_callback_keeps_the_stream_rule(spawned, world):
    for rank, (checked, violations) in enumerate(spawned.values(world, "cpu", "stream_rule")):
        assert checked > 0 and violations == [], (rank, checked, violations)


@pytest.mark.parametrize("world", WORLDS)
def test_auto_from_local_world_size(spawned, world):
    decided = spawned.values(world, "cpu", "auto")
    assert all(d == decided[0] for d in decided)  # every rank decided alike
    d = decided[0]
    assert d[f"lws={LOCAL}"] == {
        "local_size": LOCAL,
        "why": f"hierarchy='auto' (LOCAL_WORLD_SIZE=2): {world // 2} nodes of 2 ranks",
    }
    if world == 6:
        assert d["lws=3"]["local_size"] == 3
    assert d["differs"]["local_size"] is None
    assert "LOCAL_WORLD_SIZE differs across ranks (ranks " in d["differs"]["why"]
    assert "rank 1: 1" in d["differs"]["why"]
    assert d["unset"]["local_size"] is None
    assert f"not set on rank {world - 1} (not started by torchrun?)" in d["unset"]["why"]
    assert d["misnumbered"]["local_size"] is None
    assert "not numbered node by node" in d["misnumbered"]["why"]
    assert d["whole group"]["local_size"] is None
    assert "nothing crosses nodes: flat" in d["whole group"]["why"]


def test_auto_on_a_subgroup(spawned):
    decided = spawned.values(6, "cpu", "auto_subgroups")
    for rank, d in enumerate(decided):
        if rank in (0, 1, 3, 4):
            why = "hierarchy='auto' (LOCAL_WORLD_SIZE=3): 2 nodes of 2 ranks"
            paths = {"two_level": 1, "q_all_gather": 1}
            assert d["[0, 1, 3, 4]"] == ({"local_size": 2, "why": why}, paths), d
        if rank in (0, 1, 2, 3):
            hierarchy, paths = d["[0, 1, 2, 3]"]
            assert hierarchy["local_size"] is None and paths == {"q_two_phase": 1}
            assert "do not fall into whole nodes" in hierarchy["why"]
        if rank in (0, 3):
            assert d["[0, 3]"][0] == {
                "local_size": None,
                "why": "hierarchy='auto' (LOCAL_WORLD_SIZE=3): one rank per node, nothing to "
                "reduce inside a node: flat",
            }


def test_all_reduce_with_hierarchy(spawned):
    spawned.values(4, "cpu", "wrappers")


def test_node_size_not_dividing_the_group(spawned):
    for message in spawned.values(4, "cpu", "bad_size"):
        assert "hierarchy must divide the group's size 4" in message and "got 3" in message


def test_ddp_parity(spawned):
    """Within 2% (relative L2) of DDP's default after 50 SGD steps, loss within 5%: each
    node mean moves by at most absmax/14 of its 256-element block per step, unbiased in
    sign on average (test_hooks holds q8, 18x finer, to 1% and q4 with error feedback to
    5%). Measured 0.29%; flat q4 on the same 4 ranks 0.40%."""
    r = spawned.values(4, "cpu", "parity")[0]
    assert 0 < r["rel"] < 0.02, r
    assert abs(r["loss"] - r["ref_loss"]) <= 0.05 * r["ref_loss"], r
    assert r["ratio"] > 1


def test_resume_is_bitwise(spawned):
    spawned.values(4, "cpu", "resume")


def test_a_checkpoint_keeps_its_hierarchy(spawned):
    for out in spawned.values(4, "cpu", "checkpoint_hierarchy"):
        assert out["recorded"] == ("auto", 2), out
        assert "saved with hierarchy='auto', this state has hierarchy=None" in out["flat"]
        assert "saved with hierarchy='auto', this state has hierarchy=2" in out["explicit"]
        assert "reset_residuals=True" in out["flat"]
        assert "saved reducing over nodes of 2 ranks" in out.get("first_iteration", ""), out
        assert "this run decides None" in out["first_iteration"]


def test_ranks_with_different_hierarchy_fail_clearly(spawned):
    for rank, out in enumerate(spawned.values(4, "cpu", "mismatch")):
        assert "ranks disagree" in out.get("all_reduce", ""), (rank, out)
        assert 'hierarchy: rank 0 "(not set)"' in out["all_reduce"]
        assert "ranks disagree" in out.get("hook", ""), (rank, out)
        assert "hierarchy: " in out["hook"] and '"auto"' in out["hook"]


# --------------------------------------------------------------------------------------
# Without a group
# --------------------------------------------------------------------------------------


def test_launcher_takes_hierarchy_as_an_option():
    args = run.build_parser().parse_args(["--compression", "q4", "--option", "hierarchy=auto", "x"])
    env, resolved = run.environment(args, base={})
    assert resolved.spec == env["DDPCOMM_COMPRESSION"] == "q4,hierarchy=auto"
    assert ddpcomm.CompressionState(resolved.spec).hierarchy == "auto"


def test_stats_split_the_bytes_across_nodes():
    """Stats' bookkeeping at 2 nodes of 2 ranks, S = 4000 bytes: a two-level bucket counts
    its steps inside the node and the cross step's bytes, a flat plain one its ring share
    (D/L of D = 2(P-1)/P*S across); the ratio is the flat ring's bytes across nodes over
    those sent across; the launcher's exit line says it."""
    state = ddpcomm.CompressionState("q4,hierarchy=2")
    assert state.stats()["hierarchy"] == {
        "local_size": None,
        "why": "decided at the first reduction",
    }
    stats = state._stats
    dense = compressors.dense_bytes(1000, 4, 4)  # 6000
    stats.record_two_level(2 * 1 * 500 * 4, dense, dense // 2, True)
    stats.across().record("q_all_gather", 300, 2000)  # the shard's own dense is not counted
    stats.flat_over(2).record("plain", dense, dense)
    d = state.stats()
    assert d["calls"] == 2 and d["paths"] == {"two_level": 1, "q_all_gather": 1, "plain": 1}
    assert d["bytes_sent"] == 4000 + 300 + 6000 and d["dense_bytes"] == 2 * dense
    assert d["intra_node_bytes"] == 4000 + 3000 and d["cross_node_bytes"] == 300 + 3000
    assert d["cross_node_dense_bytes"] == 3000 + 3000
    assert d["intra_node_shared_bytes"] == 4000  # through shared memory, of the 7000
    assert d["compression_ratio"] == 6000 / 3300
    line = ddpcomm.autohook.summary_line([state], "q4,hierarchy=2")
    assert "across nodes 0.00 MB vs 0.01 MB flat (1.82x less)" in line, line


def test_stats_of_a_flat_state_keep_their_keys():
    keys = set(ddpcomm.CompressionState("q8").stats())
    assert keys == {
        "calls",
        "bytes_sent",
        "dense_bytes",
        "compression_ratio",
        "compress_seconds",
        "paths",
        "iteration",
        "state_bytes",
        "buffer_bytes",
    }


# --------------------------------------------------------------------------------------
# Two torchrun "nodes" on loopback
# --------------------------------------------------------------------------------------

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "hierarchy_ddp.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_find_their_nodes():
    """Two ``torchrun --nnodes 2 --nproc-per-node 2`` agents on this machine: with
    ``"q4,hierarchy=auto"`` every rank finds 2 nodes of 2 ranks, and trains to bitwise the
    parameters of the same run with ``hierarchy=2``."""
    pytest.importorskip("torch.distributed.run", reason="torchrun is not available")
    port = _free_port()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as out:
        nodes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "2",
                    "--node-rank",
                    str(node),
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"127.0.0.1:{port}",
                    "--rdzv-conf",
                    f"is_host={int(node == 0)}",
                    "--max-restarts",
                    "0",
                    SCRIPT,
                    out,
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for node in (0, 1)
        ]
        logs = []
        try:
            for proc in nodes:
                logs.append(proc.communicate(timeout=120)[0])
        finally:
            for proc in nodes:
                if proc.poll() is None:
                    proc.kill()
        assert all(proc.returncode == 0 for proc in nodes), "\n".join(logs)
        results = []
        for rank in range(4):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    for r in results:
        assert r["hierarchy"] == {"local_size": 2, "why": "hierarchy='auto' "
                                  "(LOCAL_WORLD_SIZE=2): 2 nodes of 2 ranks"}, r  # fmt: skip
        assert r["two_level"] > 0 and r["bitwise_as_hierarchy_2"], r
    assert len({r["params"] for r in results}) == 1  # identical on every rank
    assert math.isfinite(results[0]["loss"])
