"""Checkpoints saved from rank 0 only: a gathered state_dict resumes bitwise on every
rank; a per-rank state_dict loaded on another rank, or at another world size, is
refused (or, with reset_residuals, keeps iteration and settings). 3 gloo ranks, one
spawn."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ddpcomm
from tests.ddp_utils import FROM_START, SHALLOW, flat_params, make_model
from tests.ddp_utils import train as _train
from tests.dist_utils import run_ranks


def train(rank, state, hook, **kwargs):
    return _train(rank, SHALLOW, state, hook, **kwargs)


def _resume_from_rank0_file(rank, make, hook, path):
    straight, _ = train(rank, make(), hook, steps=8)

    state = make()
    model, _ = train(rank, state, hook, steps=4)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    gathered = state.state_dict(gather=True)  # a collective
    if rank == 0:
        assert len(gathered["ranks"]) == dist.get_world_size()
        torch.save(gathered, path)
    else:
        assert gathered == {}
    dist.barrier()

    restored = make()
    restored.load_state_dict(torch.load(path, weights_only=False))  # the same file everywhere
    model2 = make_model()
    model2.load_state_dict(weights)
    resumed, _ = train(rank, restored, hook, steps=4, model=model2, start=4)
    assert torch.equal(flat_params(resumed), flat_params(straight))
    return state


def _body(rank, world, tmp):
    q4 = lambda: ddpcomm.QuantizeState(4, error_feedback=True)  # noqa: E731
    state = _resume_from_rank0_file(rank, q4, ddpcomm.quantize_hook, os.path.join(tmp, "q.pt"))
    topk = lambda: ddpcomm.TopKState(0.05, **FROM_START)  # noqa: E731
    _resume_from_rank0_file(rank, topk, ddpcomm.topk_hook, os.path.join(tmp, "t.pt"))

    errors = {}
    # Rank 0's own state_dict loaded on every rank: refused on the others.
    own = state.state_dict()
    path = os.path.join(tmp, "rank0.pt")
    if rank == 0:
        torch.save(own, path)
    dist.barrier()
    try:
        q4().load_state_dict(torch.load(path, weights_only=False))
        errors["other_rank"] = "no error"
    except ValueError as exc:
        errors["other_rank"] = str(exc)

    # A gathered state_dict of 3 ranks loaded where the state's group has 2.
    gathered = state.state_dict(gather=True)
    path = os.path.join(tmp, "gathered.pt")
    if rank == 0:
        torch.save(gathered, path)
    sub = dist.new_group([0, 1])
    dist.barrier()
    if rank < 2:
        sd = torch.load(path, weights_only=False)
        two = ddpcomm.QuantizeState(4, error_feedback=True, process_group=sub)
        try:
            two.load_state_dict(sd)
            errors["world_size"] = "no error"
        except ValueError as exc:
            errors["world_size"] = str(exc)
        two.load_state_dict(sd, reset_residuals=True)
        assert two.iteration == state.iteration and not two.memory.buffers
    return errors


def test_rank0_only_checkpoints(tmp_path):
    results = run_ranks(_body, 3, str(tmp_path), timeout=400)
    assert results[0]["other_rank"] == "no error"  # its own
    for rank in (1, 2):
        assert "holds the error-feedback residuals of rank 0" in results[rank]["other_rank"]
        assert f"this is rank {rank}" in results[rank]["other_rank"]
    for rank in (0, 1):
        msg = results[rank]["world_size"]
        assert "saved by 3 ranks and this run has 2" in msg and "reset_residuals" in msg


def test_malformed_state_dicts_are_refused_before_loading():
    state = ddpcomm.QuantizeState(4, error_feedback=True)
    good = state.state_dict()
    cases = [
        ("not a dict", TypeError, "state_dict must be a dict"),
        ({}, ValueError, "missing"),
        ({**good, "iteration": -1}, ValueError, r"state_dict\['iteration'\] must be >= 0"),
        ({**good, "iteration": 2.5}, ValueError, r"state_dict\['iteration'\] must be an int"),
        ({**good, "config": None}, ValueError, "config"),
        ({**good, "memory": {"buffers": {}}}, ValueError, "'buffers' and 'signatures'"),
        ({**good, "layout": []}, ValueError, "'shapes' and 'layouts'"),
        ({"gathered": True, "ranks": [good], "world_size": 2}, ValueError, "malformed gathered"),
    ]
    for sd, exc, match in cases:
        with pytest.raises(exc, match=match):
            state.load_state_dict(sd)
        assert state.iteration == 0
