"""Hook states and hook arguments, no process group needed: every bad argument raises the
promised error naming it (DESIGN.md §4), spec strings parse, states pickle and round-trip
through state_dict, and hooks refuse what they cannot reduce. One test spawns 2 ranks: a
model cast after DDP wrapped it warns."""

from __future__ import annotations

import contextlib
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpcomm
from ddpcomm import compressors
from ddpcomm.compressors import parse
from tests.ddp_utils import make_model
from tests.dist_utils import run_ranks


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"bits": 3}, ValueError, "bits must be one of 1, 1.5, 2, 4, 8"),
        ({"bits": True}, ValueError, "bits must be one of"),
        ({"block_size": 100}, ValueError, "block_size must be a power of two"),
        ({"block_size": 16}, ValueError, r"block_size must be in \[32, 65536\]"),
        ({"block_size": 64.0}, TypeError, "block_size must be an int"),
        ({"stochastic": 1}, TypeError, "stochastic must be a bool"),
        ({"error_feedback": "yes"}, TypeError, "error_feedback must be a bool"),
        ({"algorithm": "ring"}, ValueError, "algorithm must be one of"),
        # The same mistake raises the same exception type for every count argument.
        ({"start_iter": -1}, ValueError, "start_iter must be >= 0"),
        ({"start_iter": 2.0}, TypeError, "start_iter must be an int"),
        ({"min_numel": 1.5}, TypeError, "min_numel must be an int"),
        ({"min_numel": -1}, ValueError, "min_numel must be >= 0"),
        ({"seed": 1.0}, TypeError, "seed must be an int"),
        ({"seed": -3}, ValueError, "seed must be in"),
        ({"process_group": "world"}, TypeError, "process_group must be a ProcessGroup"),
        ({"bitz": 8}, TypeError, "unknown option 'bitz' for Quantizer; Quantizer takes bits"),
    ],
)
def test_bad_quantize_state_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ddpcomm.QuantizeState(**kwargs)


@pytest.mark.parametrize("cls", [ddpcomm.TopKState, ddpcomm.RandomKState])
@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), float("inf")])
def test_bad_ratio_raises_value_error(cls, bad):
    with pytest.raises(ValueError, match="ratio"):
        cls(bad)


@pytest.mark.parametrize("cls", [ddpcomm.TopKState, ddpcomm.RandomKState])
def test_non_number_ratio_raises_type_error(cls):
    with pytest.raises(TypeError, match="ratio"):
        cls("0.1")
    with pytest.raises(TypeError, match="ratio"):
        cls(True)


def test_other_sparse_options_are_checked():
    with pytest.raises(ValueError, match="value_dtype"):
        ddpcomm.TopKState(0.1, value_dtype=torch.int32)
    with pytest.raises(TypeError, match="approximate"):
        ddpcomm.TopKState(0.1, approximate=1)
    with pytest.raises(ValueError, match="seed"):
        ddpcomm.RandomKState(0.1, seed=-1)
    with pytest.raises(ValueError, match="min_numel"):
        ddpcomm.RandomKState(0.1, min_numel=-1)


def test_spec_strings():
    assert parse("topk:0.01").k(1000) == 10 and parse("randk:1").k(7) == 7
    assert parse("topk:0.001").k(10) == 1  # at least one entry
    for bad in ("topk:0", "topk:2", "topk:nan", "topk:abc", "topk", "randk:-1"):
        with pytest.raises(ValueError, match="ratio"):
            parse(bad)


def test_bad_specs():
    with pytest.raises(ValueError, match="unknown compression spec 'q3'; known methods"):
        ddpcomm.parse_compression("q3")
    with pytest.raises(ValueError, match="takes no ':' argument"):
        ddpcomm.parse_compression("q8:2")
    with pytest.raises(TypeError, match="spec string or a Compressor"):
        ddpcomm.parse_compression(8)


def test_hooks_reject_other_states():
    with pytest.raises(TypeError, match="quantize_hook needs a QuantizeState"):
        ddpcomm.quantize_hook(object(), None)
    with pytest.raises(TypeError, match="TopKState"):
        ddpcomm.topk_hook(ddpcomm.RandomKState(), None)
    with pytest.raises(TypeError, match="RandomKState"):
        ddpcomm.randomk_hook(ddpcomm.TopKState(), None)


class IntBucket:
    def buffer(self):
        return torch.arange(10)

    def index(self):
        return 0

    def is_last(self):
        return True

    def parameters(self):
        return []


@pytest.mark.parametrize(
    "hook, state",
    [
        (ddpcomm.quantize_hook, ddpcomm.QuantizeState()),
        (ddpcomm.topk_hook, ddpcomm.TopKState()),
        (ddpcomm.randomk_hook, ddpcomm.RandomKState()),
        (ddpcomm.compress_hook, ddpcomm.CompressionState("bf16")),
    ],
)
def test_integer_bucket_rejected(hook, state):
    # The dtype is checked before any collective, so no process group is needed.
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        hook(state, IntBucket())


@pytest.mark.parametrize(
    "hook, state, why",
    [
        (ddpcomm.randomk_hook, None, "per-step seed"),
        (ddpcomm.quantize_hook, ddpcomm.QuantizeState(stochastic=True), "stochastic"),
        (ddpcomm.topk_hook, ddpcomm.TopKState(approximate=True), "approximate"),
        (ddpcomm.compress_hook, ddpcomm.CompressionState("q4", start_iter=3), "start_iter"),
        (ddpcomm.compress_hook, ddpcomm.CompressionState("q1,ramp=9"), "ramp"),
        (ddpcomm.compress_hook, ddpcomm.CompressionState("q8,adaptive"), "adaptive"),
        (ddpcomm.quantize_hook, ddpcomm.QuantizeState(1, start_iter=0, ramp=0), "normalize=0"),
    ],
)
def test_python_reducer_refuses_what_cannot_be_traced(hook, state, why):
    # DDP's python_reducer calls hook(state, (grad, param)) per parameter (tests/
    # test_compile.py runs the supported methods); these fail before any collective.
    param = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(NotImplementedError, match=f"python_reducer.*{why}"):
        hook(state, (torch.ones(4), param))


def test_python_reducer_rejects_non_float_grad():
    param = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="grad has dtype torch.float64"):
        ddpcomm.quantize_hook(None, (torch.ones(4, dtype=torch.float64), param))


@pytest.mark.parametrize(
    "make, other, kind",
    [
        (
            lambda: ddpcomm.QuantizeState(bits=2, stochastic=True, seed=5),
            lambda: ddpcomm.QuantizeState(bits=2, stochastic=True, seed=6),
            "q",
        ),
        (
            lambda: ddpcomm.TopKState(0.05, approximate=True, value_dtype=torch.bfloat16),
            lambda: ddpcomm.TopKState(0.5),
            "topk",
        ),
        (
            lambda: ddpcomm.RandomKState(0.2, seed=9),
            lambda: ddpcomm.RandomKState(0.2, seed=8),
            "randk",
        ),
    ],
    ids=["q2", "topk", "randk"],
)
def test_state_pickles_and_round_trips(make, other, kind):
    state = make()
    # A bucket of a (2, 3) and a (4,) parameter: a signature is its parameters' shapes.
    state.memory.get(kind, 3, 10, "cpu", ((2, 3), (4,))).copy_(torch.arange(10.0))
    state.iteration = 7
    for restored in (pickle.loads(pickle.dumps(state)), make()):
        if restored.iteration == 0:
            restored.load_state_dict(state.state_dict())
        assert restored.iteration == 7
        assert restored.compressor == state.compressor
        assert torch.equal(restored.memory.buffers[(kind, 3)], torch.arange(10.0))
    with pytest.raises(ValueError, match="config"):
        other().load_state_dict(state.state_dict())


# --------------------------------------------------------------------------------------
# Options in spec strings, warm-up and ramp schedules
# --------------------------------------------------------------------------------------


def test_spec_options():
    assert parse("q4,error_feedback,block_size=128") == parse(
        "q4", error_feedback=True, block_size=128
    )
    assert parse(" topk:0.01 , value_dtype=bfloat16, approximate=true") == parse(
        "topk:0.01", value_dtype=torch.bfloat16, approximate=True
    )
    assert parse("q2,error_feedback=false").error_feedback is False
    assert parse("randk:0.1,seed=4").seed == 4
    state = ddpcomm.CompressionState("q1,start_iter=5,min_numel=7,ramp=30,block_size=64")
    assert (state.start_iter, state.min_numel, state.ramp) == (5, 7, 30)
    assert state.compressor == parse(
        "q1", block_size=64, normalize=compressors.DEFAULT_NORMALIZE
    )  # q1 state default
    assert ddpcomm.CompressionState("q2", ramp=4).ramp == ddpcomm.QuantizeState(2, ramp=4).ramp


@pytest.mark.parametrize(
    "build, exc, match",
    [
        (lambda: parse("q4,block_size=100"), ValueError, "block_size must be a power of two"),
        (lambda: parse("q4,bits=2"), ValueError, "unknown option .bits."),
        (lambda: parse("q4,colour=red"), ValueError, "unknown option .colour."),
        (lambda: parse("q4,error_feedback=2"), TypeError, "error_feedback must be a bool"),
        (lambda: parse("q4,=3"), ValueError, "malformed option '=3'"),
        (lambda: parse("q4,seed=1,seed=2"), ValueError, "option 'seed' twice"),
        (lambda: parse("q4,seed=1", seed=2), ValueError, r"\['seed'\] given both"),
        (lambda: parse("q4,ramp=3"), ValueError, "settings of the hook state"),
        (lambda: parse("topk:0.1,value_dtype=int8"), ValueError, "value_dtype must be one of"),
        (lambda: parse("fp16,seed=1"), ValueError, "takes no options"),
        (lambda: ddpcomm.CompressionState("q4", ramp=-1), ValueError, "ramp must be >= 0"),
        (lambda: ddpcomm.CompressionState("q4,ramp=1.5"), TypeError, "ramp must be an int"),
        (lambda: ddpcomm.TopKState(ramp=True), TypeError, "ramp must be an int"),
        (lambda: ddpcomm.CompressionState("fp16", ramp=10), ValueError, "ramp needs a"),
        (
            lambda: ddpcomm.CompressionState("q4,start_iter=2", start_iter=3),
            ValueError,
            "start_iter given both",
        ),
    ],
)
def test_bad_spec_options_and_ramps(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


def test_ramp_steps_through_milder_stages_in_order():
    state = ddpcomm.CompressionState("q1", start_iter=10, ramp=7)
    specs = [state.compressor_at(i).spec for i in range(10, 19)]
    # 7 iterations over 3 stages: stage i starts at ceil(7 i / 3) iterations in.
    assert specs == ["q8", "q8", "q8", "q4", "q4", "q2", "q2", "q1", "q1"]
    assert all(state.compressor_at(i).error_feedback for i in range(10, 19))
    assert state.compressor_at(12).block_size == state.compressor.block_size
    topk = ddpcomm.TopKState(0.001, start_iter=0, ramp=100, value_dtype=torch.float16)
    ratios = [c.ratio for c in compressors.ramp_stages(topk.compressor)]
    assert ratios == [0.25**i for i in range(1, 5)]  # 25% ... 0.390625%, then 0.1%
    assert topk.compressor_at(99).ratio == 0.25**4 and topk.compressor_at(100).ratio == 0.001
    assert topk.compressor_at(0).value_dtype == torch.float16
    # Nothing milder to step through: a ramp is refused, not ignored.
    for spec in ("q8", "topk:0.3"):
        with pytest.raises(ValueError, match="ramp needs a method with a milder stage"):
            ddpcomm.CompressionState(spec, ramp=50)


@pytest.mark.parametrize(
    "spec, schedule",
    [
        ("q8", (0, 0)),
        ("q4,error_feedback", (0, 0)),
        ("q2", compressors.LOW_BIT_SCHEDULE),
        ("q1", compressors.LOW_BIT_SCHEDULE),
        ("topk:0.01", compressors.SPARSE_SCHEDULE),
        ("randk:0.01", compressors.SPARSE_SCHEDULE),
        ("topk:0.25", (0, 0)),
        ("fp16", (0, 0)),
        ("none", (0, 0)),
    ],
)
def test_default_schedule_by_method(spec, schedule):
    state = ddpcomm.CompressionState(spec)
    assert (state.start_iter, state.ramp) == schedule
    # Given explicitly (keyword or spec), a schedule replaces the default, half or whole.
    assert ddpcomm.CompressionState(spec, start_iter=0, ramp=0).ramp == 0
    assert ddpcomm.CompressionState(f"{spec},start_iter=0,ramp=0").start_iter == 0
    assert ddpcomm.CompressionState(spec, start_iter=5).ramp == schedule[1]
    if schedule != (0, 0):  # a milder stage first, the method itself after the ramp
        assert state.compressor_at(schedule[0]).spec != state.compressor.spec
        assert state.compressor_at(sum(schedule)) is state.compressor


def test_named_states_take_the_default_schedule():
    q1 = ddpcomm.QuantizeState(bits=1)
    assert (q1.start_iter, q1.ramp) == compressors.LOW_BIT_SCHEDULE
    for state in (ddpcomm.TopKState(), ddpcomm.RandomKState()):
        assert (state.start_iter, state.ramp) == compressors.SPARSE_SCHEDULE
    assert ddpcomm.QuantizeState(bits=4).start_iter == 0


def test_spec_and_keyword_schedule_must_agree():
    with pytest.raises(ValueError, match="start_iter given both"):
        ddpcomm.CompressionState("q1,start_iter=20", start_iter=0)
    assert ddpcomm.CompressionState("q1,start_iter=20", start_iter=20).start_iter == 20


def test_ramp_round_trips_through_state_dict():
    state = ddpcomm.CompressionState("q2,start_iter=3,ramp=12")
    fresh = ddpcomm.CompressionState("q2")
    fresh.load_state_dict(state.state_dict())
    assert fresh.ramp == 12 and fresh.compressor_at(3).spec == "q8"
    assert pickle.loads(pickle.dumps(state)).ramp == 12
    old = state.state_dict()
    del old["ramp"]  # a checkpoint from before ramps existed
    fresh.load_state_dict(old)
    assert fresh.ramp == 0 and fresh.compressor_at(3).spec == "q2"


def _cast_body(rank, world):
    def steps(ddp, n, dtype=torch.float32, no_sync=False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(n):
                x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))
                context = ddp.no_sync() if no_sync else contextlib.nullcontext()
                with context:
                    ddp(x.to(dtype)).float().square().mean().backward()
        return [str(w.message) for w in caught if "ddpcomm" in str(w.message)]

    out = {}
    model = make_model()
    state = ddpcomm.QuantizeState(8)
    ddp = DDP(model, bucket_cap_mb=0.01)
    ddp.register_comm_hook(state, ddpcomm.quantize_hook)
    # Gradient accumulation: backward passes without a hook call, and no cast: no warning.
    out["no_sync"] = steps(ddp, 2) + steps(ddp, 3, no_sync=True) + steps(ddp, 1)
    # A cast under the same DDP: neither the hook nor DDP reduces from now on.
    ddp.half()
    at = state.iteration
    out["cast"] = steps(ddp, 3, torch.float16)
    out["hook calls after the cast"] = state.iteration - at
    grad = next(model.parameters()).grad.float()
    every = [torch.empty_like(grad) for _ in range(world)]
    dist.all_gather(every, grad)
    out["grads differ"] = not all(torch.equal(every[0], g) for g in every)
    # Cast, then wrapped in a new DDP with a new state: the first state's watch sees the
    # cast, but a state watching the same parameter is called at every step: no warning.
    model = make_model().half()
    ddp = DDP(model, bucket_cap_mb=0.01)
    ddp.register_comm_hook(ddpcomm.QuantizeState(8), ddpcomm.quantize_hook)
    steps(ddp, 1, torch.float16)
    ddp = DDP(model.float(), bucket_cap_mb=0.01)
    ddp.register_comm_hook(ddpcomm.QuantizeState(8), ddpcomm.quantize_hook)
    out["wrapped again"] = steps(ddp, 3)
    return out


def test_a_model_cast_after_ddp_wrapped_it_warns_once():
    """On torch 2.13 a model cast under its DDP (``ddp.half()``) silently leaves DDP: no
    comm hook call, no all-reduce, gradients differ across ranks, nothing raised. The
    hook state warns once, at the second backward pass after the cast; gradient
    accumulation (no_sync) and a model wrapped again after a cast do not warn."""
    for r in run_ranks(_cast_body, 2):
        assert r["no_sync"] == []
        assert r["hook calls after the cast"] == 0 and r["grads differ"]
        (message,) = r["cast"]
        assert "cast from torch.float32 to torch.float16 after DistributedDataParallel" in message
        assert "Cast the model before wrapping it in DDP" in message
        assert r["wrapped again"] == []
