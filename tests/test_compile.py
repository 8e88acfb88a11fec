"""ddpcomm's hooks under compiled autograd with DDP's python_reducer
(``torch._dynamo.config.optimize_ddp = "python_reducer"``), on spawned gloo ranks.

DDP then calls the hook per parameter as ``hook(state, (grad, param))`` from a
post-accumulate-grad hook that compiled autograd traces into the backward graph
(ddpcomm/traced.py). Checked: training close to DDP's default, replicas bitwise identical,
the compiled backward equal to the same per-parameter hooks run eagerly, and the methods
that cannot be traced failing with their reason. torch.compile with DDP's default
optimize_ddp is covered in test_hooks.py (test_torch_compile_with_compress_hook).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn as nn

import ddpcomm
from tests.ddp_utils import FROM_START, SHALLOW, flat_params, identical_across_ranks, train
from tests.spawn_plan import Groups

WORLD = 2


def make_tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 8))


# Compiling a backward costs seconds per parameter hook traced: a 4-parameter model, few steps.
TINY = dataclasses.replace(SHALLOW, model=make_tiny_model, steps=5)

# (state, hook, bound on the distance from DDP's default run relative to how far that run
# moved the parameters in TINY's 5 steps; see off_default). q8 rounds each element by at
# most absmax/254 of its 256-element block, so the runs differ by a fraction of a percent
# (measured 0.35%; bound 2%). q4's step is 18x coarser and error feedback re-injects what
# it dropped a step later (measured 3.2%; bound 10%). Top-k at 10% applies the largest
# tenth of each gradient and carries the rest in its residuals, so after 5 steps a good
# part of the update is still held back (measured 38%; bound 60%; a hook that dropped
# the update would sit at 100%, one that did not reduce fails "replicas differ").
CASES = {
    "q8": (lambda: ddpcomm.QuantizeState(bits=8), ddpcomm.quantize_hook, 0.02),
    "q4-ef": (
        lambda: ddpcomm.CompressionState("q4", error_feedback=True),
        ddpcomm.compress_hook,
        0.1,
    ),
    "topk": (lambda: ddpcomm.TopKState(0.1, **FROM_START), ddpcomm.topk_hook, 0.6),
    # What 3 or more ranks run by default: all_to_all, owner re-quantization, all_gather.
    # Quantized twice (sender and owner), both with error feedback: measured 4.4%.
    "q4-ef-two-phase": (
        lambda: ddpcomm.QuantizeState(bits=4, error_feedback=True, algorithm="two_phase"),
        ddpcomm.quantize_hook,
        0.1,
    ),
}


def python_reducer_run(rank, make_state, hook, compiled):
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        state = make_state()
        model, _ = train(rank, TINY, state, hook, compiled_autograd=compiled)
    return flat_params(model), state


def check_parity(rank, world, name, default):
    make_state, hook, _ = CASES[name]
    params, state = python_reducer_run(rank, make_state, hook, compiled=True)
    assert identical_across_ranks(params, world), "replicas differ"
    eager, _ = python_reducer_run(rank, make_state, hook, compiled=False)
    stats = state.stats()
    state.reset_stats()
    return dict(
        rel=off_default(params, default()),
        equal_to_eager=torch.equal(params, eager),
        residuals=len(state.param_residuals),
        stats=stats,
        after_reset=state.stats(),
    )


def off_default(params: torch.Tensor, ref: torch.Tensor) -> float:
    """Distance from DDP's default run, relative to how far that run moved the model."""
    start = flat_params(make_tiny_model())
    return float((params - ref).norm() / (ref - start).norm())


def check_dense_topk(rank, world, default):
    # topk:0.5 sends more as (index, value) pairs than a dense fp32 all_reduce: every
    # parameter takes the dense path. Eager per-parameter hooks: the compiled ones above
    # trace the same ops.
    params, _ = python_reducer_run(rank, lambda: ddpcomm.TopKState(0.5), ddpcomm.topk_hook, False)
    assert identical_across_ranks(params, world), "replicas differ"
    return off_default(params, default())


def check_refused(rank, world):
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        try:
            train(
                rank,
                TINY,
                ddpcomm.RandomKState(0.1),
                ddpcomm.randomk_hook,
                steps=1,
                compiled_autograd=True,
            )
        except NotImplementedError as exc:  # raised as is through the compiled backward
            return str(exc)
    return "no error"


def plan(rank, world, device):
    default = functools.cache(lambda: flat_params(train(rank, TINY, None, None)[0]))
    for name in CASES:
        yield ("parity", name), functools.partial(check_parity, rank, world, name, default)
    yield ("dense_topk",), functools.partial(check_dense_topk, rank, world, default)
    yield ("refused",), functools.partial(check_refused, rank, world)


@pytest.fixture(scope="module")
def groups():
    return Groups(plan)


@pytest.mark.parametrize("method", CASES)
def test_python_reducer_parity(groups, method):
    for r in groups.values(WORLD, "cpu", "parity", method):
        assert r["rel"] < CASES[method][2], r
        assert r["rel"] > 0, "a lossy hook that changes nothing is not compressing"
        assert r["equal_to_eager"], "the compiled backward differs from the eager hooks"
        # stats() counts the traced reductions: TINY's 4 parameters, once per step each.
        stats = r["stats"]
        assert stats["iteration"] == TINY.steps and stats["calls"] == 4 * TINY.steps, stats
        assert 0 < stats["bytes_sent"] < stats["dense_bytes"], stats
        after = r["after_reset"]  # reset_stats() restarts the counts, not the iteration
        assert after["calls"] == after["bytes_sent"] == 0, after
        assert after["iteration"] == TINY.steps, after


def test_python_reducer_dense_topk(groups):
    for rel in groups.values(WORLD, "cpu", "dense_topk"):
        # Half of every gradient each step, the rest a step later: measured 7.3%.
        assert 0 < rel < 0.25, rel


def test_python_reducer_refuses_random_k(groups):
    for msg in groups.values(WORLD, "cpu", "refused"):
        assert "randk:0.1 cannot run under DDP's python_reducer" in msg, msg
