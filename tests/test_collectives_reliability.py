"""collectives.all_reduce_mean across steps, buckets and failures, for every method.

On the spawned groups of tests/collective_utils.py (1 to 4 ranks; CPU tensors over gloo,
or CUDA tensors over gloo on GPU 0 and NCCL at one rank). Error feedback loses nothing
over steps (N * sum of outputs + residuals = sum of inputs); buckets completed out of
order still pair their collectives; a non-finite input is non-finite on every rank and
resets the residuals (DESIGN.md §4, §6.3); ranks that disagree on the configuration are
tests/test_agreement.py's. On CUDA: no host synchronisation in any algorithm; with every
collective and kernel delayed, a waiter reading right after Future.wait() sees the final
values, for every algorithm and the async wrappers, on NCCL and on gloo with 2 and 3
ranks; NCCL's two-phase creates no group (DESIGN.md §8).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist

import ddpcomm
from ddpcomm import collectives, compressors
from ddpcomm.compressors import Quantizer
from ddpcomm.context import ReduceContext, ResidualMemory
from tests.collective_utils import (
    ALGORITHMS,
    BLOCK,
    CUDA_ONLY,
    N,
    Rank,
    assert_same_on_every_rank,
    per_group,
    quantization_error_bound,
    quantizer,
    rank_input,
)
from tests.spawn_plan import Groups

# Every method that keeps a residual: each algorithm at 8 and 2 bits, stochastic rounding,
# 1 bit; top-k exact and approximate with bf16 values; random-k.
ERROR_FEEDBACK = {
    **{f"q{b}-{a}": quantizer(b, a, error_feedback=True) for b in (8, 2) for a in ALGORITHMS},
    "q4-stochastic": quantizer(4, stochastic=True, error_feedback=True),
    "q1": quantizer(1),
    "topk": ("topk:0.05", {}),
    "topk-approximate-bf16": ("topk:0.05", dict(approximate=True, value_dtype=torch.bfloat16)),
    "randk": ("randk:0.05", dict(seed=1)),
}
NON_FINITE = {
    **{f"q{b}-{a}": quantizer(b, a, error_feedback=True) for b in (8, 1) for a in ALGORITHMS},
    "topk-approximate": ("topk:0.01", dict(approximate=True)),
    "topk-dense": ("topk:0.5", {}),
    "randk": ("randk:0.01", {}),
}
# Non-finite entries of the last rank's input: both kinds at once, and each alone.
BAD = ({5: float("nan"), N - 2: float("inf")}, {4321: float("nan")}, {4321: float("inf")})


def check_error_feedback_invariant(r: Rank, c) -> None:
    # N * sum_t out_t + sum over ranks of residuals = sum_t sum over ranks of x_t.
    memory = ResidualMemory()
    total_out = torch.zeros(N, dtype=torch.float64)
    total_in = torch.zeros(N, dtype=torch.float64)
    for step in range(6):
        xs = [rank_input(i, N, step) for i in range(r.world)]
        total_in += torch.stack(xs).double().sum(0)
        out, _ = r.reduce(xs[r.rank], c, memory, key=7, step=step)
        assert_same_on_every_rank(out, r.world)
        total_out += out.double()
    residual = torch.zeros(N, dtype=torch.float64)
    for (kind, _), buf in memory.buffers.items():
        if kind == "q_owner":  # the two-phase owner's residual of its re-quantized chunk
            chunk = c.chunk_numel(N, r.world)
            residual[r.rank * chunk : r.rank * chunk + buf.numel()] += buf.cpu().double()
        else:
            residual += buf.cpu().double()
    assert float(residual.abs().sum()) > 0  # the test is not vacuous
    dist.all_reduce(residual)
    lhs = r.world * total_out + residual
    scale = float(total_in.abs().max())
    # Only the fp32 rounding of each step's mean separates the two sides.
    assert float((lhs - total_in).abs().max()) <= 1e-5 * scale
    torch.testing.assert_close(lhs, total_in, rtol=1e-5, atol=1e-4)
    # The invariant is not trivially true: without the residuals it fails.
    assert float((r.world * total_out - total_in).abs().max()) > 1e-3 * scale


def check_out_of_order_completion(r: Rank, q) -> None:
    # Many buckets in flight at once, waited for in reverse order: gloo completes them in
    # different orders on different ranks, and phase 2 must still pair by bucket.
    sizes = [BLOCK * r.world * k + (7 * k) % 50 for k in range(1, 16)]
    memory = ResidualMemory()
    xs = [rank_input(r.rank, s, k) for k, s in enumerate(sizes)]
    futs = [
        collectives.all_reduce_mean(r.put(x), q, ReduceContext(group=r.group, memory=memory, key=k))
        for k, x in enumerate(xs)
    ]
    outs = [f.wait().cpu() for f in reversed(futs)][::-1]
    for k, (s, out) in enumerate(zip(sizes, outs, strict=True)):
        assert out.numel() == s
        everyone = [rank_input(i, s, k) for i in range(r.world)]
        bound = quantization_error_bound(everyone, 4, True, q.chunk_numel(s, r.world))
        assert bool(((out - torch.stack(everyone).mean(0)).abs() <= bound).all()), k
        assert_same_on_every_rank(out, r.world)


def check_non_finite(r: Rank, c) -> None:
    for bad in BAD:
        memory = ResidualMemory()
        r.reduce(rank_input(r.rank, N), c, memory, key=3)  # a finite step fills the residual
        x = rank_input(r.rank, N, 1)
        if r.rank == r.world - 1:
            for i, value in bad.items():
                x[i] = value
        out, _ = r.reduce(x, c, memory, key=3, step=1)
        assert not bool(out.isfinite().all()), bad
        if isinstance(c, Quantizer):  # the blocks holding a bad entry
            assert not bool(out[list(bad)].isfinite().any()), bad
        assert_same_on_every_rank(out.nan_to_num(1.0, 2.0, 3.0), r.world)
        for buf in memory.buffers.values():
            assert bool((buf == 0).all()), "residual must be reset after a non-finite step"
        out, _ = r.reduce(rank_input(r.rank, N, 2), c, memory, key=3, step=2)
        assert bool(out.isfinite().all())


# --------------------------------------------------------------------------------------
# CUDA futures and streams (DESIGN.md §8): no host sync in the hot path, and a waiter on
# the returned Future sees the last kernel's output even when that kernel is slow.
# --------------------------------------------------------------------------------------

# One config per algorithm, error feedback on where it has a residual to reset.
HOT_PATHS = [
    ("q8", dict(algorithm="all_gather", error_feedback=True)),
    ("q4", dict(algorithm="two_phase", error_feedback=True)),
    ("topk:0.05", dict()),
    ("topk:0.9", dict()),  # the dense switch
    ("randk:0.05", dict()),
    ("fp16", dict()),
]


def check_no_host_sync(rank, world):
    torch.cuda.set_device(0)
    nccl = dist.new_group(backend="nccl")
    bad = []
    try:
        for spec, opts in HOT_PATHS:
            comp = compressors.parse(spec, **opts)
            ctx = ReduceContext(group=nccl, memory=ResidualMemory(), key=0)
            xs = [rank_input(rank, 3 * 4096 + 77, s).cuda() for s in range(2)]
            collectives.all_reduce_mean(xs[0], comp, ctx).wait()  # buffers allocated
            torch.cuda.synchronize()
            ctx.step = 1
            torch.cuda.set_sync_debug_mode("error")
            try:
                collectives.all_reduce_mean(xs[1], comp, ctx).wait()
            except RuntimeError as exc:
                bad.append(f"{spec}: {exc}")
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    finally:
        dist.destroy_process_group(nccl)
    return bad


# Every algorithm (both quantized ones, top-k sparse and dense, random-k, casts, plain).
DELAYED = HOT_PATHS + [
    ("q8", dict(algorithm="two_phase")),
    ("topk:0.05", dict(approximate=True, value_dtype=torch.float16)),
    ("bf16", dict()),
    ("none", dict()),
]
# The ops the algorithms and the wrappers launch, and the collectives they issue.
DELAYED_OPS = (
    "quantize dequantize_sum dequantize_sum_requantize dequantize topk_compress "
    "sparse_accumulate randk_compress randk_decompress flatten unflatten_into"
).split()
SPIN = 20_000_000  # cycles, ~10 ms: longer than any kernel or collective here takes


@contextlib.contextmanager
def everything_delayed():
    """Every collective the algorithms issue and every op they launch first spins ~10 ms on
    its current stream: the issuing stream before a collective, a callback's pool stream
    before a decode. A waiter not ordered after all of it reads values not yet written."""
    from ddpcomm import ops

    def slow(real):
        def call(*args, **kwargs):
            torch.cuda._sleep(SPIN)
            return real(*args, **kwargs)

        return call

    names = [(dist, "all_reduce"), (dist, "all_to_all_single"), (collectives, "all_gather_single")]
    names += [(ops, name) for name in DELAYED_OPS]
    saved = [(module, name, getattr(module, name)) for module, name in names]
    for module, name, real in saved:
        setattr(module, name, slow(real))
    try:
        yield
    finally:
        for module, name, real in saved:
            setattr(module, name, real)


def check_delayed_waiter(rank, world, backend):
    """With every collective and kernel delayed, the result read on the caller's stream right
    after Future.wait() (or handle.wait()), with no synchronize, is the CPU run's, bit for
    bit: for every algorithm, two steps (residuals), and the async wrappers."""
    torch.cuda.set_device(0)
    group = dist.new_group(backend=backend) if backend == "nccl" else None
    bad = []
    n = 3 * 4096 + 77
    for spec, opts in DELAYED:
        comp = compressors.parse(spec, **opts)
        mem_cpu, mem_gpu = ResidualMemory(), ResidualMemory()
        for step in range(2):
            x = rank_input(rank, n, step)
            ctx = ReduceContext(group=None, memory=mem_cpu, step=step)
            want = collectives.all_reduce_mean(x.clone(), comp, ctx).wait()
            ctx = ReduceContext(group=group, memory=mem_gpu, step=step)
            with everything_delayed():
                out = collectives.all_reduce_mean(x.cuda(), comp, ctx).wait()
                seen = out.clone()  # the caller's stream, right after wait()
            if not torch.equal(seen.cpu(), want):
                bad.append(f"{spec} {opts} step {step}")
    parts = [
        rank_input(rank, 1000),
        rank_input(rank, 77).half(),
        rank_input(rank, 54).view(9, 6).t(),
    ]
    for spec in ("q8", "topk:0.05", "fp16", "none"):
        want = [p.clone() for p in parts]
        ddpcomm.all_reduce(want[0], spec)
        ddpcomm.all_reduce_coalesced(want, spec)
        got = [p.cuda() for p in parts]
        with everything_delayed():
            ddpcomm.all_reduce(got[0], spec, group=group, async_op=True).wait()
            ddpcomm.all_reduce_coalesced(got, spec, group=group, async_op=True).wait()
            seen = [g.clone() for g in got]
        if not all(torch.equal(s.cpu(), w) for s, w in zip(seen, want, strict=True)):
            bad.append(f"wrappers {spec}")
    if group is not None:
        dist.destroy_process_group(group)
    return bad


def check_nccl_phase_two_on_the_group(rank, world):
    """On NCCL the two-phase algorithm issues phase 2 on the group itself: no group is
    created inside a reduction (DESIGN.md section 8)."""
    from torch.distributed import distributed_c10d as c10d

    from ddpcomm import groups

    torch.cuda.set_device(0)
    nccl = dist.new_group(backend="nccl")
    before = len(c10d._world.pg_map)
    comp = compressors.parse("q8", algorithm="two_phase", error_feedback=True)
    for step in range(2):
        ctx = ReduceContext(group=nccl, memory=ResidualMemory(), step=step)
        collectives.all_reduce_mean(rank_input(rank, N, step).cuda(), comp, ctx).wait()
    bad = []
    if len(c10d._world.pg_map) != before:
        bad.append(f"{len(c10d._world.pg_map) - before} process group(s) created")
    if groups.sequencer(nccl, torch.device("cuda", 0)).companion is not nccl:
        bad.append("phase 2 runs on a companion group")
    dist.destroy_process_group(nccl)
    return bad


# --------------------------------------------------------------------------------------
# The plan every rank of a group runs, and the tests reading it
# --------------------------------------------------------------------------------------

CHECKS = [
    ("error_feedback", ERROR_FEEDBACK, check_error_feedback_invariant),
    (
        "out_of_order",
        {"q4-two_phase": quantizer(4, "two_phase", error_feedback=True)},
        check_out_of_order_completion,
    ),
    ("non_finite", NON_FINITE, check_non_finite),
]


def run_check(check, r: Rank, spec: str, options: dict) -> None:
    check(r, compressors.parse(spec, **options))


def nothing_fails(check, *args) -> None:
    bad = check(*args)
    assert bad == [], bad


def plan(rank: int, world: int, device: str):
    if device == "cuda":
        torch.cuda.set_device(0)
    for r, suffix in Rank(rank, world, device).groups():
        for name, methods, check in CHECKS:
            for method, (spec, options) in methods.items():
                key = (name, method, *suffix)
                yield key, functools.partial(run_check, check, r, spec, options)
    if device == "cuda" and world == 1:
        yield ("no_host_sync",), functools.partial(nothing_fails, check_no_host_sync, 0, 1)
        delayed = functools.partial(nothing_fails, check_delayed_waiter, 0, 1, "nccl")
        yield ("delayed", "nccl"), delayed
        on_group = functools.partial(nothing_fails, check_nccl_phase_two_on_the_group, 0, 1)
        yield ("phase_two_on_the_group",), on_group
    if device == "cuda" and world in (2, 3):
        delayed = functools.partial(nothing_fails, check_delayed_waiter, rank, world, "gloo")
        yield ("delayed", "gloo"), delayed


@pytest.fixture(scope="module")
def groups():
    return Groups(plan)


@per_group
@pytest.mark.parametrize("method", ERROR_FEEDBACK)
def test_error_feedback_invariant(groups, method, world, device):
    groups.values(world, device, "error_feedback", method)


@per_group
def test_two_phase_pairs_buckets_completed_out_of_order(groups, world, device):
    groups.values(world, device, "out_of_order", "q4-two_phase")


@per_group
@pytest.mark.parametrize("method", NON_FINITE)
def test_non_finite_input_is_non_finite_everywhere_and_resets_residuals(
    groups, method, world, device
):
    groups.values(world, device, "non_finite", method)


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_no_host_sync_in_any_algorithm_on_nccl(groups, device):
    groups.values(1, device, "no_host_sync")


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("world, backend", [(1, "nccl"), (2, "gloo"), (3, "gloo")])
def test_waiters_see_every_delayed_collective_and_kernel(groups, world, backend, device):
    groups.values(world, device, "delayed", backend)


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_nccl_two_phase_creates_no_group(groups, device):
    groups.values(1, device, "phase_two_on_the_group")
