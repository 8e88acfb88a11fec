"""Hook states and hook arguments, no process group needed: every bad argument raises the
promised error naming it (DESIGN.md §4), spec strings parse, states pickle and round-trip
through state_dict, and hooks refuse what they cannot reduce."""

from __future__ import annotations

import pickle

import pytest
import torch

import ddpcomm
from ddpcomm.compressors import parse


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"bits": 3}, ValueError, "bits must be one of 1, 2, 4, 8"),
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
        ({"bitz": 8}, TypeError, "unexpected keyword argument 'bitz'"),
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
    state.memory.get(kind, 3, 10, "cpu").copy_(torch.arange(10.0))
    state.iteration = 7
    for restored in (pickle.loads(pickle.dumps(state)), make()):
        if restored.iteration == 0:
            restored.load_state_dict(state.state_dict())
        assert restored.iteration == 7
        assert restored.compressor == state.compressor
        assert torch.equal(restored.memory.buffers[(kind, 3)], torch.arange(10.0))
    with pytest.raises(ValueError, match="config"):
        other().load_state_dict(state.state_dict())
