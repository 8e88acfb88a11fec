"""The stream rule (ddpcomm/futures.py), enforced on the CPU.

On a GPU, a ``then`` callback's Future carries CUDA ordering only for the tensors the
callback returns: one that launches kernels (or reads its parent's collective result) and
returns None hands its waiters unwritten tensors. With ``DDPCOMM_CHECK_STREAM_RULE=1``
every callback attached through ``futures.then`` records the devices it writes or
receives and must hand them on. This module checks the checker, that no callback in
ddpcomm bypasses it, and drives every algorithm through it on spawned gloo groups
(tests/conftest.py turns the check on for the whole suite as well).
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
import torch.distributed as dist

import ddpcomm
from ddpcomm import collectives, compressors, futures
from ddpcomm.context import ReduceContext, ResidualMemory, Workspace
from tests.collective_utils import rank_input
from tests.ddp_utils import FROM_START, make_model
from tests.dist_utils import run_ranks

# --------------------------------------------------------------------------------------
# The checker itself
# --------------------------------------------------------------------------------------


def _done(value) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


@pytest.fixture
def checking():
    futures.check_stream_rule(True)
    before = len(futures.violations)
    yield
    del futures.violations[before:]


def test_a_callback_that_writes_and_returns_nothing_breaks_the_rule(checking):
    out = torch.zeros(4)
    # Writes a tensor its Future does not carry: the collectives' bug on 73636dc.
    child = futures.then(_done(None), lambda f: (out.add_(1), None)[1])
    with pytest.raises(RuntimeError, match="stream rule"):
        child.wait()
    # Receives its parent's tensors (a collective's result) and drops them.
    child = futures.then(_done([torch.ones(2)]), lambda f: None)
    with pytest.raises(RuntimeError, match="stream rule"):
        child.wait()
    assert len(futures.violations) >= 2


def test_callbacks_that_hand_their_work_on_keep_the_rule(checking):
    out = torch.zeros(4)
    assert futures.then(_done(None), lambda f: out.add_(1)).wait() is out
    assert futures.then(_done([out]), lambda f: f.value()).wait()[0] is out
    # A device Future or a Latch completed after the work carries it too.
    result = futures.device_future(out.device)
    futures.then(_done([out]), lambda f: futures.resolve(result, out.mul_(2)))
    latch = futures.Latch(1, out, out.device)
    latch.watch(_done([out]), lambda f: out.sub_(1))
    assert result.wait() is out and latch.future.wait() is out
    # An error handed on owes no tensors.
    failed = futures.device_future(out.device)
    futures.then(_done([out]), lambda f: futures.fail(failed, ValueError("x")))
    with pytest.raises(ValueError):
        failed.wait()
    # Writing nothing and receiving nothing owes nothing.
    assert futures.then(_done(None), lambda f: None).wait() is None


def test_inline_child_callbacks_answer_for_their_own_work(checking):
    out = torch.zeros(2)

    def outer(f):
        # An inline child's write is the child's to hand on, not the outer callback's.
        inner = futures.then(_done(None), lambda g: out.add_(1))
        return inner.wait()

    assert futures.then(_done(None), outer).wait() is out


def test_no_callback_in_ddpcomm_bypasses_the_check():
    root = pathlib.Path(ddpcomm.__file__).parent
    raw = [
        f"{path.relative_to(root)}:{n}"
        for path in root.rglob("*.py")
        if path.name != "futures.py"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\.(then|add_done_callback)\(", line)
    ]
    assert raw == [], f"callbacks attached without futures.then: {raw}"


# --------------------------------------------------------------------------------------
# Every algorithm, on spawned gloo groups
# --------------------------------------------------------------------------------------

N = 10007


def _mean(spec: str, group=None, **options):
    """One compressed all-reduce of every rank's input, twice (error feedback, reused
    buffers), through futures.then's check; returns the result of the second."""

    def run(rank):
        comp = compressors.parse(spec, **options)
        memory, workspace = ResidualMemory(), Workspace()
        for step in range(2):
            ctx = ReduceContext(group=group, memory=memory, key=0, step=step, workspace=workspace)
            out = collectives.all_reduce_mean(rank_input(rank, N, step), comp, ctx).wait()
        return out

    return run


def _wrappers(rank):
    t = rank_input(rank, N)
    ddpcomm.all_reduce(t, "q8")
    ddpcomm.all_reduce(t, "q4", op="sum", async_op=True).wait()
    parts = [rank_input(rank, 100), rank_input(rank, 50).half(), torch.randn(9, 6).t()]
    ddpcomm.all_reduce_coalesced(parts, "fp16", op="sum", async_op=True).wait()
    ddpcomm.all_reduce_coalesced(parts, "none", async_op=True).wait()
    return t


def _ddp_and_resume(rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    def step(ddp, i):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * i + rank))
        ddp(x).sum().backward()

    ddp = DDP(make_model(), bucket_cap_mb=0.004)
    state = ddpcomm.CompressionState("q2", **FROM_START)
    ddp.register_comm_hook(state, ddpcomm.compress_hook)
    for i in range(3):
        step(ddp, i)
    saved = state.state_dict()
    # A fresh process's first iteration re-forms the saved buckets (layout.Reformer).
    resumed = DDP(make_model(), bucket_cap_mb=0.004)
    again = ddpcomm.CompressionState("q2", **FROM_START)
    again.load_state_dict(saved)
    resumed.register_comm_hook(again, ddpcomm.compress_hook)
    step(resumed, 3)
    return again.iteration


def _fsdp(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("rep", "shard"))
    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = ddpcomm.fsdp.compress(model, "q4", replicate_group=mesh["rep"])
    for i in range(2):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * i + rank))
        model(x).sum().backward()
    plain = dist.new_group(list(range(world)))
    reduce = ddpcomm.fsdp.ReduceScatter("topk:0.1")
    out = torch.empty(64)
    reduce(out, rank_input(rank, 64 * world), plain, dist.ReduceOp.AVG, async_op=True).wait()
    return state.stats()["calls"]


def _normalize(rank):
    """q1 in units of each element's scale: the refresh's collective and scale_up."""
    state = ddpcomm.CompressionState("q1", normalize=1, **FROM_START)
    for step in range(2):
        state.iteration = step
        state.reduce(rank_input(rank, N, step), 0, ((N,),)).wait()


CASES = {
    "q8 all-gather in pieces": _mean("q8", algorithm="all_gather", error_feedback=True),
    "q4 two-phase in pieces": _mean("q4", algorithm="two_phase", error_feedback=True),
    "topk sparse in pieces": _mean("topk:0.3"),
    "topk dense": _mean("topk:0.9"),
    "randk": _mean("randk:0.3"),
    "q1 normalized (hook state)": _normalize,
    "fp16": _mean("fp16"),
    "none": _mean("none"),
    "wrappers sync and async": _wrappers,
    "DDP hook and resume": _ddp_and_resume,
    "FSDP2 reduce-scatter and HSDP": _fsdp,
}


def _every_case(rank, world):
    # Small pieces: every multi-piece path runs on these small tensors.
    collectives._GLOO_PIECE_BYTES = collectives._GLOO_MIN_PIECE_BYTES = 2048
    futures.check_stream_rule(True)
    seen = {}
    for name, case in CASES.items():
        before = futures.checked
        case(rank)
        seen[name] = futures.checked - before
    return seen, list(futures.violations)


@pytest.mark.parametrize("world", [2, 3])
def test_every_algorithm_keeps_the_stream_rule(world):
    for rank, (seen, violations) in enumerate(run_ranks(_every_case, world)):
        assert violations == [], f"rank {rank}: {violations}"
        # Each case ran callbacks under the check (none passed it by).
        quiet = [name for name, count in seen.items() if count == 0]
        assert quiet == [], f"rank {rank}: no checked callback in {quiet}"
