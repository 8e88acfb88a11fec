"""Ranks that disagree: the mismatch matrix, for DDP hooks and for the wrappers.

Every case makes one rank (the last) differ from the others in one setting, and checks
that every rank running ddpcomm raises a ddpcomm error that names the setting, within
10 s: never a hang, a backend abort or silent garbage. Each case runs on a fresh process
group with a short timeout, so a regression fails in seconds instead of hanging the
suite, and one case's leftovers cannot reach the next. One spawn per world size runs
every case (spawning dominates the cost).

Cases where the odd rank runs no ddpcomm code at all (DDP's default reduction, a plain
``dist.all_reduce``) cannot raise a ddpcomm error there: that rank fails in its
collective at the group's timeout, and the ddpcomm ranks name it.
"""

from __future__ import annotations

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.dist_utils import run_ranks

# A group timeout for cases where a rank never arrives: the ddpcomm ranks give up after
# min(DDPCOMM_AGREEMENT_TIMEOUT, group timeout), the rank outside ddpcomm at it.
MISSING_TIMEOUT = 4.0
# Every error must arrive within this; the target is 10 s.
DEADLINE = 10.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(24, 24) for _ in range(5)])


def _ddp_step(group, state, hook, bucket_cap_mb=0.002, steps=2, model=None, **kw):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = model or _model()
    ddp = DDP(model, process_group=group, bucket_cap_mb=bucket_cap_mb, **kw)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    _STARTED[0] = time.monotonic()  # errors are timed from the first step, not setup
    for step in range(steps):
        x = torch.randn(4, model[0].in_features, generator=torch.Generator().manual_seed(step))
        ddp(x).square().mean().backward()


_STARTED = [None]


def _attempt(fn) -> dict:
    _STARTED[0] = None
    t0 = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        error, msg = type(exc).__name__, str(exc)
    else:
        error, msg = None, ""
    return {"error": error, "msg": msg, "secs": time.monotonic() - (_STARTED[0] or t0)}


# --------------------------------------------------------------------------------------
# Hook cases: name -> (what the odd rank differs in, builder(odd, group) -> (state, hook))
# --------------------------------------------------------------------------------------


def _hook_cases():
    import ddpcomm
    from ddpcomm import CompressionState as S

    q, c = ddpcomm.quantize_hook, ddpcomm.compress_hook

    def quant(**diff):
        return lambda odd, g: (ddpcomm.QuantizeState(process_group=g, **(diff if odd else {})), q)

    def spec(base, other=None, **diff):
        def build(odd, g):
            name = other if (odd and other) else base
            return S(name, process_group=g, **(diff if odd else {})), c

        return build

    def loaded_iteration(odd, g):
        state = S("q8", start_iter=2, process_group=g)
        state.iteration = 3 if odd else 0  # as if the ranks loaded different checkpoints
        return state, c

    return {
        "bits": ("compression", quant(bits=4)),
        "block_size": ("block_size", quant(block_size=128)),
        "stochastic": ("stochastic", quant(stochastic=True)),
        "error_feedback": ("error_feedback", quant(error_feedback=True)),
        "algorithm": ("algorithm", quant(algorithm="two_phase")),
        "seed": ("seed", spec("q4", stochastic=True, seed=1)),
        "start_iter": ("start_iter", quant(start_iter=1)),
        "min_numel": ("min_numel", quant(min_numel=10**6)),
        "ramp": ("ramp", spec("q4", ramp=3)),  # q8 has no milder stage to ramp through
        "topk_ramp": ("ramp", spec("topk:0.01,ramp=5", "topk:0.01,ramp=6")),
        "iteration": ("iteration", loaded_iteration),
        "topk_ratio": ("compression", spec("topk:0.01", "topk:0.02")),
        "topk_approximate": ("approximate", spec("topk:0.1", approximate=True)),
        "topk_value_dtype": ("value_dtype", spec("topk:0.1", value_dtype=torch.bfloat16)),
        "topk_error_feedback": ("error_feedback", spec("topk:0.1", error_feedback=False)),
        "topk_start_iter": ("start_iter", spec("topk:0.1", start_iter=1)),
        "topk_min_numel": ("min_numel", spec("topk:0.1", min_numel=10**6)),
        "randk_ratio": ("compression", spec("randk:0.1", "randk:0.2")),
        "randk_seed": ("seed", spec("randk:0.1", seed=3)),
        "randk_error_feedback": ("error_feedback", spec("randk:0.1", error_feedback=False)),
        "randk_start_iter": ("start_iter", spec("randk:0.1", start_iter=1)),
        "randk_min_numel": ("min_numel", spec("randk:0.1", min_numel=10**6)),
        "fp16_vs_bf16": ("compression", spec("fp16", "bf16")),
        "fp16_vs_none": ("compression", spec("fp16", "none")),
        "q8_vs_topk": ("compression", spec("q8", "topk:0.1")),
        "q2_vs_q1.5": ("compression", spec("q2", "q1.5")),
        "q1.5_block_size": ("block_size", spec("q1.5", block_size=256)),
        "q8_vs_allreduce_hook": (
            "compression",
            lambda odd, g: (g, ddpcomm.allreduce_hook) if odd else (S("q8", process_group=g), c),
        ),
    }


# Cases where the odd rank never enters the check the others wait in.
def _missing_cases():
    import ddpcomm
    from ddpcomm import CompressionState as S

    c = ddpcomm.compress_hook

    def other_group(odd, g):
        # Same members, another group object: the two sides wait on different channels.
        g2 = _fresh_group(MISSING_TIMEOUT)
        return S("q8", process_group=g2 if odd else g), c

    return {
        "q8_vs_default_ddp": (
            "did not reach",
            lambda odd, g: (None, None) if odd else (S("q8", process_group=g), c),
        ),
        "topk_vs_default_ddp": (
            "did not reach",
            lambda odd, g: (None, None) if odd else (S("topk:0.1", process_group=g), c),
        ),
        "allreduce_hook_vs_default_ddp": (
            "did not reach",
            lambda odd, g: (None, None) if odd else (g, ddpcomm.allreduce_hook),
        ),
        "state_on_another_group": ("waits in bucket 0", other_group),
    }


def _fresh_group(timeout: float):
    return dist.new_group(
        list(range(dist.get_world_size())), timeout=datetime.timedelta(seconds=timeout)
    )


def _hook_matrix(rank, world):
    odd = rank == world - 1
    results = {}
    for name, (_, build) in _hook_cases().items():
        g = _fresh_group(30.0)
        state, hook = build(odd, g)
        results[name] = _attempt(lambda g=g, s=state, h=hook: _ddp_step(g, s, h))
    for name, (_, build) in _missing_cases().items():
        g = _fresh_group(MISSING_TIMEOUT)
        state, hook = build(odd, g)
        results[name] = _attempt(lambda g=g, s=state, h=hook: _ddp_step(g, s, h))

    import ddpcomm

    # Buckets of different sizes: bucket_cap_mb differs, which with
    # find_unused_parameters shapes the first iteration's buckets (torch 2.13 puts every
    # parameter in one bucket otherwise; later iterations use rank 0's layout anyway).
    g = _fresh_group(30.0)
    state = ddpcomm.CompressionState("q8", process_group=g)
    cap = 0.004 if odd else 0.002
    results["bucket_sizes"] = _attempt(
        lambda: _ddp_step(g, state, ddpcomm.compress_hook, cap, find_unused_parameters=True)
    )

    # A hook's first step on some ranks, a wrapper call on the odd one.
    g = _fresh_group(30.0)
    if odd:
        from torch.nn.parallel import DistributedDataParallel as DDP

        DDP(_model(), process_group=g)  # the constructor's collectives, as the others
        results["hook_vs_wrapper"] = _attempt(
            lambda: ddpcomm.all_reduce(torch.ones(600), "q8", group=g)
        )
    else:
        state = ddpcomm.CompressionState("q8", process_group=g)
        results["hook_vs_wrapper"] = _attempt(lambda: _ddp_step(g, state, ddpcomm.compress_hook))

    # DDP on a subgroup with state=None: the default state reduces over the default
    # group, which the odd rank is not reducing on. Last: it uses the default group. The
    # hook's first check waits MISSING_TIMEOUT for the odd rank instead of its 10 s.
    from ddpcomm import agreement

    os.environ[agreement.TIMEOUT_ENV] = str(MISSING_TIMEOUT)
    sub = dist.new_group(list(range(world - 1)))
    if odd:
        results["subgroup_default_state"] = {"error": None, "msg": "not in the subgroup"}
    else:
        results["subgroup_default_state"] = _attempt(
            lambda: _ddp_step(sub, None, ddpcomm.compress_hook)
        )
    return results


@pytest.fixture(scope="module", params=[2, 3])
def hook_matrix(request):
    world = request.param
    return world, run_ranks(_hook_matrix, world, pg_timeout=60, timeout=400)


def test_hook_mismatches_fail_clearly_on_every_rank(hook_matrix):
    world, results = hook_matrix
    settings = {name: setting for name, (setting, _) in _hook_cases().items()}
    for name, setting in settings.items():
        for rank, res in enumerate(results):
            out = res[name]
            assert out["error"] == "ValueError", (name, rank, out)
            assert "ranks disagree on the compression configuration" in out["msg"], (name, out)
            assert f"{setting}:" in out["msg"], (name, rank, out["msg"])
            assert f"rank {world - 1}" in out["msg"], (name, out["msg"])
            assert out["secs"] < DEADLINE, (name, rank, out["secs"])


def test_missing_ranks_are_named(hook_matrix):
    world, results = hook_matrix
    odd = world - 1
    for name, (expected, _) in _missing_cases().items():
        ddpcomm_ranks = range(world) if name == "state_on_another_group" else range(odd)
        for rank in ddpcomm_ranks:
            out = results[rank][name]
            assert out["error"] == "RuntimeError", (name, rank, out)
            assert expected in out["msg"] and "ddpcomm:" in out["msg"], (name, rank, out)
            assert out["secs"] < min(DEADLINE, MISSING_TIMEOUT + 3), (name, rank, out["secs"])
        if name != "state_on_another_group":
            # The odd rank runs DDP's default reduction: it fails in its collective.
            assert results[odd][name]["error"] is not None, (name, results[odd][name])


def test_bucket_sizes_hook_vs_wrapper_and_subgroup(hook_matrix):
    world, results = hook_matrix
    for rank in range(world):
        out = results[rank]["bucket_sizes"]
        assert out["error"] == "ValueError" and "numel:" in out["msg"], out
        out = results[rank]["hook_vs_wrapper"]
        assert out["error"] == "ValueError" and "call:" in out["msg"], out
        assert out["secs"] < DEADLINE
    for rank in range(world - 1):
        out = results[rank]["subgroup_default_state"]
        assert out["error"] == "RuntimeError", out
        assert f"rank {world - 1} did not reach" in out["msg"], out
        assert "process_group=group" in out["msg"], out


# --------------------------------------------------------------------------------------
# Wrappers
# --------------------------------------------------------------------------------------


def _wrapper_cases(rank, world):
    import ddpcomm

    odd = rank == world - 1
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))

    def call(**kw):
        def run(g):
            ddpcomm.all_reduce(x.clone(), group=g, **kw)

        return run

    def differ(base: dict, other: dict):
        return call(**(other if odd else base))

    def later_size(g):
        ddpcomm.all_reduce(x.clone(), "q8", group=g)  # agreed
        ddpcomm.all_reduce(torch.ones(1001 if odd else 1000), "q8", group=g)

    def coalesced(g):
        ts = [torch.ones(7)] if odd else [torch.ones(3), torch.ones(4)]
        ddpcomm.all_reduce_coalesced(ts, group=g)

    def refused(g):
        ddpcomm.all_reduce(x.clone(), op="max" if odd else "sum", group=g)

    return {
        "q8_vs_none": ("compression", differ({"compression": "q8"}, {"compression": "none"})),
        "q8_vs_q4": ("compression", differ({"compression": "q8"}, {"compression": "q4"})),
        "fp16_vs_none": ("compression", differ({"compression": "fp16"}, {})),
        "sum_vs_mean": ("op", differ({"op": "sum"}, {"op": "mean"})),
        "q8_sum_vs_mean": ("op", differ({"compression": "q8", "op": "sum"}, {"compression": "q8"})),
        "max_vs_sum": ("op", differ({"op": dist.ReduceOp.MAX}, {"op": "sum"})),
        "dtype": (
            "tensors",
            lambda g: ddpcomm.all_reduce(x.clone().half() if odd else x.clone(), "q8", group=g),
        ),
        "size_at_a_later_call": ("tensors", later_size),
        "empty_on_one_rank": (
            "tensors",
            lambda g: ddpcomm.all_reduce(torch.ones(0 if odd else 300), "q8", group=g),
        ),
        "coalesced_layout": ("tensors", coalesced),
        "refused_on_one_rank": ("refused", refused),
    }


def _wrapper_matrix(rank, world):
    import ddpcomm

    odd = rank == world - 1
    results = {}
    for name, (_, run) in _wrapper_cases(rank, world).items():
        g = _fresh_group(30.0)
        results[name] = _attempt(lambda run=run, g=g: run(g))
    # A plain dist.all_reduce on the odd rank: the others name it at the group's timeout.
    g = _fresh_group(MISSING_TIMEOUT)
    t = torch.ones(8)
    results["vs_dist_all_reduce"] = _attempt(
        lambda: dist.all_reduce(t, group=g) if odd else ddpcomm.all_reduce(t, "q8", group=g)
    )
    # No false alarms: calls that differ only where it does not matter agree.
    g = _fresh_group(30.0)
    t = torch.ones(10)
    h = ddpcomm.all_reduce(t, "q8", group=g, async_op=odd)
    if h is not None:
        h.wait()
    if odd:
        ddpcomm.all_reduce_coalesced([t], "q8", group=g)
    else:
        ddpcomm.all_reduce(t, "q8", group=g)
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_wrapper_mismatches_fail_clearly_on_every_rank(world):
    results = run_ranks(_wrapper_matrix, world, pg_timeout=60, timeout=300)
    odd = world - 1
    for name, (setting, _) in _wrapper_cases(0, world).items():
        for rank, res in enumerate(results):
            out = res[name]
            if name == "refused_on_one_rank":
                # The refused rank raises its own argument error; the others name it.
                expected = "ValueError" if rank == odd else "RuntimeError"
                assert out["error"] == expected, (name, rank, out)
                if rank != odd:
                    assert f"refused on rank {odd}" in out["msg"], out
            else:
                assert out["error"] == "ValueError", (name, rank, out)
                assert "ranks disagree" in out["msg"] and f"{setting}:" in out["msg"], out
            assert out["secs"] < DEADLINE, (name, rank, out["secs"])
    for rank in range(odd):
        out = results[rank]["vs_dist_all_reduce"]
        assert out["error"] == "RuntimeError" and f"rank {odd} did not reach" in out["msg"], out
        assert out["secs"] < MISSING_TIMEOUT + 3
    assert results[odd]["vs_dist_all_reduce"]["error"] is not None  # gloo's own timeout


# --------------------------------------------------------------------------------------
# Wrappers: repeated calls are not all checked (the store stays small)
# --------------------------------------------------------------------------------------


def _store_file() -> str:
    """The path of the FileStore under the default group's store (dist_utils uses one)."""
    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store.path


def _store_growth(rank, world):
    """Bytes the store file grows by over two windows of one loop of q8 calls (after the
    first 20): calls 21-320 and calls 321-1320."""
    import os

    import ddpcomm

    g = _fresh_group(30.0)
    t = torch.ones(1000)
    sizes = []
    for calls in (20, 300, 1000):
        for _ in range(calls):
            ddpcomm.all_reduce(t, "q8", group=g)
        dist.barrier(g)  # gloo's barrier is a collective: it writes nothing to the store
        sizes.append(os.path.getsize(_store_file()))
    return [b - a for a, b in zip(sizes, sizes[1:], strict=False)]


def _warm(g, odd, delay, late: str, switch):
    """49 agreed q8 calls, then call 50: the odd rank calls ``switch`` (the others q8
    again); the rank named by ``late`` ("odd" or "others") arrives ``delay`` s after the
    rest."""
    import ddpcomm

    t = torch.ones(1000)
    for _ in range(49):
        ddpcomm.all_reduce(t, "q8", group=g)
    if (late == "odd") == odd:
        time.sleep(delay)
    _STARTED[0] = time.monotonic()
    return switch(t) if odd else ddpcomm.all_reduce(t, "q8", group=g)


def _repeated_matrix(rank, world):
    import ddpcomm

    odd = rank == world - 1
    results = {}

    # The odd rank makes a new call (q4) where the others repeat q8, and arrives first:
    # the others see its open check, join it, and every rank raises the ValueError.
    g = _fresh_group(30.0)
    results["new_call_others_later"] = _attempt(
        lambda: _warm(g, odd, 0.5, "others", lambda t: ddpcomm.all_reduce(t, "q4", group=g))
    )

    # The same with async_op, the others first: their call 50 is issued (it pairs with
    # nothing), and their call 51 joins the odd rank's check.
    g = _fresh_group(MISSING_TIMEOUT)

    def async_then_again():
        t = torch.ones(1000)
        for _ in range(49):
            ddpcomm.all_reduce(t, "q8", group=g)
        if odd:
            time.sleep(0.5)
            _STARTED[0] = time.monotonic()
            ddpcomm.all_reduce(t, "q4", group=g)
        else:
            _STARTED[0] = time.monotonic()
            ddpcomm.all_reduce(t, "q8", group=g, async_op=True)  # unchecked, never paired
            time.sleep(1.0)  # the odd rank opens its check meanwhile
            ddpcomm.all_reduce(t, "q8", group=g)

    results["new_call_async_others_first"] = _attempt(async_then_again)

    # Ranks repeat different calls they agreed on before (q8 sum and q8 mean, the same
    # collectives): not seen at call 50, whose results differ across ranks; the check at
    # call 64 raises on every rank, counting each rank's calls since call 32.
    g = _fresh_group(30.0)
    means = []

    def different_repeats():
        t = torch.full((1000,), float(rank))
        ddpcomm.all_reduce(t.clone(), "q8", op="sum", group=g)  # call 1: both agreed
        for call in range(2, 64):
            x = t.clone()
            op = "sum" if (odd and call == 50) else "mean"
            ddpcomm.all_reduce(x, "q8", op=op, group=g)
            if call == 50:
                means.append(x[0].item())
        _STARTED[0] = time.monotonic()
        ddpcomm.all_reduce(t.clone(), "q8", group=g)  # call 64: checked

    results["different_repeats"] = _attempt(different_repeats)
    results["different_repeats"]["call_50"] = means

    # The odd rank makes a new call and arrives last: the others are already in their
    # collective. It names them at the group's timeout; their collective fails in gloo.
    g = _fresh_group(MISSING_TIMEOUT)
    results["new_call_odd_later"] = _attempt(
        lambda: _warm(g, odd, 0.5, "odd", lambda t: ddpcomm.all_reduce(t, "q4", group=g))
    )
    return results


def test_repeated_calls_keep_the_file_store_small():
    """Before: every call wrote its check (about 200 bytes with 2 ranks: 60 kB for 300
    calls). Now the checks at calls 32, 64, 128, 256, then 512, 1024 only."""
    first, second = run_ranks(_store_growth, 2)[0]
    assert 0 < first < 4 * 400, first  # 4 checks of about 250 bytes
    assert 0 < second < 2 * 400, second  # 1000 calls, 2 checks


@pytest.mark.parametrize("world", [2, 3])
def test_mismatch_in_a_repeated_call(world):
    results = run_ranks(_repeated_matrix, world, pg_timeout=60, timeout=300)
    odd = world - 1
    for rank, res in enumerate(results):
        out = res["new_call_others_later"]
        assert out["error"] == "ValueError", (rank, out)
        assert "ranks disagree" in out["msg"] and "compression:" in out["msg"], out
        assert f"rank {odd} " in out["msg"] and "(step 50 on this group)" in out["msg"], out
        assert out["secs"] < DEADLINE, (rank, out["secs"])

        out = res["new_call_async_others_first"]
        assert out["error"] == "ValueError" and "compression:" in out["msg"], (rank, out)
        assert out["secs"] < DEADLINE, (rank, out["secs"])

        # What the cache gives up: call 50 ran unchecked, its results differ across ranks.
        out = res["different_repeats"]
        mean = sum(range(world)) / world
        assert out["call_50"] == [mean * world if rank == odd else mean], (rank, out)
        assert out["error"] == "ValueError", (rank, out)
        assert "(step 64 on this group)" in out["msg"], out
        counts = '{"count": 31, "each": {"all_reduce(q8, op=mean, float32[1000])": 31}'
        assert "steps since the last check: rank" in out["msg"] and counts in out["msg"], out
        assert '"all_reduce(q8, op=sum, float32[1000])": 1' in out["msg"], out  # call 50

    for rank in range(odd):
        # In their collective when the odd rank opened its check: gloo's timeout.
        out = results[rank]["new_call_odd_later"]
        assert out["error"] == "RuntimeError" and "Timed out" in out["msg"], (rank, out)
        assert out["secs"] < MISSING_TIMEOUT + 3, (rank, out["secs"])
    out = results[odd]["new_call_odd_later"]
    assert out["error"] == "RuntimeError" and "did not reach" in out["msg"], out
    assert "repeat a ddpcomm.all_reduce call agreed on before" in out["msg"], out
    assert out["secs"] < MISSING_TIMEOUT + 3, out["secs"]
