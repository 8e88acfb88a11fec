"""FSDP2 compression fails loudly where it used to give wrong gradients or hang.

On spawned gloo groups of 2 and 3 ranks (one group per world size runs every check, in
order; the check that leaves a rank behind runs last):

- HSDP: a ``replicate_group`` that shares ranks with the shard group (the default group
  itself) is refused at ``compress``, naming the ranks, and installs nothing; a proper
  one is accepted and keeps the replicas bitwise identical. At 3 ranks, replicate groups
  that pair ranks of different shard layouts fail at the first all-reduce on both ranks.
- ``compress`` twice on one model, one state on two models, a module with another
  custom reduce-scatter: refused; the first state keeps counting.
- Ranks that disagree on the method, start_iter, block_size, the tensor size or the
  step (one rank resumed): a ValueError on every rank naming the setting.
- One rank trains plain FSDP2 while the others compress: the compressing ranks raise
  ddpcomm's error naming it after ``DDPCOMM_AGREEMENT_TIMEOUT``, and the plain rank ends
  with its backend's error once they leave, not at the group's timeout.

Without a process group: state options written in the spec, and ``load_state_dict``
loading a valid state_dict (with or without its version) and loading nothing from a
malformed one (the malformed dicts themselves are rows of tests/test_bad_inputs.py).
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as TorchReduceScatter

import ddpcomm
import ddpcomm.fsdp
from ddpcomm.fsdp import FSDPCompressionState, ReduceScatter
from ddpcomm.reduce_scatter import reduce_scatter_single
from tests.dist_utils import run_checks, run_ranks

# A regression back to a hang fails after this long instead of the default 120 s.
PG_TIMEOUT = 30.0
R = dist.ReduceOp


def build(mesh=None, layers=(13, 29, 5)) -> nn.Module:
    """Linear layers, each sharded, then the root (which holds no parameters)."""
    torch.manual_seed(0)
    linears = [nn.Linear(a, b) for a, b in zip(layers, layers[1:], strict=False)]
    model = nn.Sequential(*linears)
    for layer in linears:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(rank: int, model: nn.Module, steps: int, after_step=None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(7919 * step + rank)
        x = torch.randn(8, model[0].in_features, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step(model)


def local(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])


def _error(fn, exc=ValueError) -> str:
    try:
        fn()
    except exc as e:
        return str(e)
    return "no error"


def fsdp_modules(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class _OwnReduceScatter(TorchReduceScatter):
    """A user's custom reduce-scatter (FSDP's plain one, by hand)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return reduce_scatter_single(output_tensor, input_tensor, op=op, group=group)


def _own_all_reduce(reduce_output: torch.Tensor) -> None:
    """A user's HSDP all-reduce hook (the plain mean over the default group)."""
    dist.all_reduce(reduce_output, op=dist.ReduceOp.AVG)


# --------------------------------------------------------------------------------------
# Checks, run on every rank
# --------------------------------------------------------------------------------------


def check_hsdp_groups(rank, world):
    res = {}
    # Sharded over the default group: the default group (or a 1-D mesh over it) as the
    # replicate group would average different parameters' shards.
    model = build()
    res["world"] = _error(
        lambda: ddpcomm.fsdp.compress(model, "q8", replicate_group=dist.group.WORLD)
    )
    res["mesh"] = _error(
        lambda: ddpcomm.fsdp.compress(
            model, "q8", replicate_group=init_device_mesh("cpu", (world,))
        )
    )
    # Nothing was installed: the model still reduces as plain FSDP2, bitwise.
    plain = build()
    train(rank, model, 1)
    train(rank, plain, 1)
    res["nothing installed"] = torch.equal(local(model), local(plain))

    # Replicas of one-rank shards: accepted, replicas bitwise identical after each step.
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("rep", "shard"))
    identical = []

    def check(model):
        flat = local(model)
        every = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(every, flat)
        identical.append(all(torch.equal(every[0], e) for e in every))

    hsdp = build(mesh=mesh["shard"])
    state = ddpcomm.fsdp.compress(hsdp, "q8", replicate_group=mesh["rep"])
    train(rank, hsdp, 2, after_step=check)
    res["accepted"] = (identical, sorted(state.stats()["paths"]))

    # A user's own all-reduce hook would be replaced by the replica all-reduce: refused.
    hooked = build(mesh=mesh["shard"])
    for m in fsdp_modules(hooked):
        m.set_all_reduce_hook(_own_all_reduce)
    res["other hook"] = _error(
        lambda: ddpcomm.fsdp.compress(hooked, "q8", replicate_group=mesh["rep"])
    )
    return res


def check_inconsistent_replicas(rank, world):
    """3 ranks: shard groups {0, 1} and {2}, replicate groups {0, 2} and {1}. No rank's
    replicate group holds two ranks of its shard group, so compress accepts it, but
    ranks 0 and 2 hold different shard layouts (half the parameters against all of them):
    their first all-reduce names the difference on both."""
    if world != 3:
        return {}
    groups = {tuple(r): dist.new_group(r) for r in ([0, 1], [2], [0, 2], [1])}
    shard = groups[(0, 1)] if rank < 2 else groups[(2,)]
    replicate = groups[(1,)] if rank == 1 else groups[(0, 2)]
    # One parameter group, so rank 1 (alone in its replicate group) finishes its step.
    model = build(mesh=DeviceMesh.from_group(shard, "cpu"), layers=(13, 5))
    ddpcomm.fsdp.compress(model, "q8", replicate_group=replicate)
    return {"message": _error(lambda: train(rank, model, 1))}


def check_compress_twice(rank, world):
    res = {}
    model = build()
    first = ddpcomm.fsdp.compress(model, "q8")
    res["twice"] = _error(lambda: ddpcomm.fsdp.compress(model, "q4"))
    res["twice, same state"] = _error(lambda: ddpcomm.fsdp.compress(model, first))
    res["two models"] = _error(lambda: ddpcomm.fsdp.compress(build(), first))
    train(rank, model, 2)
    s = first.stats()
    res["first counts"] = (s["iteration"], s["bytes_sent"] > 0)

    own = build()
    for m in fsdp_modules(own):
        m.set_custom_reduce_scatter(_OwnReduceScatter())
    res["other custom"] = _error(lambda: ddpcomm.fsdp.compress(own, "q8"))
    return res


def check_mismatch(rank, world):
    """Each mismatch raises on every rank at the same agreement, before any collective:
    the groups stay usable for the next one."""
    res = {}
    first = rank == 0
    kinds = {
        "compression": ("q8" if first else "q4", {}),
        "start_iter": ("q8", {"start_iter": 0 if first else 2}),
        "block_size": ("q8", {"block_size": 64 if first else 128}),
    }
    for kind, (spec, options) in kinds.items():
        model = build()
        ddpcomm.fsdp.compress(model, spec, **options)
        res[kind] = _error(lambda model=model: train(rank, model, 1))

    # One rank resumed from a checkpoint, the others not: its steps differ.
    model = build()
    state = ddpcomm.fsdp.compress(model, "q8", start_iter=3)
    if first:
        state.load_state_dict({**state.state_dict(), "steps": {"rs:1": 5, "rs:0": 5}})
    res["step"] = _error(lambda: train(rank, model, 1))

    # The comm alone, on a tensor of another size on rank 0.
    n = 128 if first else 64
    x = torch.randn(world * n)
    res["numel"] = _error(lambda: ReduceScatter("q8")(torch.empty(n), x, dist.group.WORLD, R.AVG))
    return res


def check_one_rank_plain(rank, world):
    """Last: rank 0 never calls ddpcomm and waits in FSDP's reduce-scatter until the
    other ranks leave."""
    os.environ["DDPCOMM_AGREEMENT_TIMEOUT"] = "2"
    model = build()
    if rank != 0:
        ddpcomm.fsdp.compress(model, "q8")
    return {"message": _error(lambda: train(rank, model, 1), RuntimeError)}


CHECKS = (check_hsdp_groups, check_inconsistent_replicas, check_compress_twice, check_mismatch)
CHECKS += (check_one_rank_plain,)


def check_all(rank, world):
    return run_checks(rank, world, CHECKS)


@pytest.fixture(scope="module", params=[2, 3])
def world(request):
    return request.param


_RESULTS: dict = {}


def results(world: int, check: str) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(check_all, world, pg_timeout=PG_TIMEOUT)
    per_rank = [r[check] for r in _RESULTS[world]]
    for r in per_rank:
        assert "error" not in r, r.get("error")
    return per_rank


def test_replicate_group_overlapping_the_shard_group_is_refused(world):
    everyone = list(range(world))
    for r in results(world, "check_hsdp_groups"):
        for key in ("world", "mesh"):
            assert "replicate_group" in r[key], r[key]
            assert f"ranks {everyone} are also in the shard group" in r[key], r[key]
        assert r["nothing installed"]
        identical, paths = r["accepted"]
        assert identical == [True, True]
        assert any(p.startswith("q_") for p in paths), paths
        assert "already has an all-reduce hook" in r["other hook"], r["other hook"]


def test_replicas_of_different_shard_layouts_disagree(world):
    if world != 3:
        pytest.skip("the groups need 3 ranks")
    per_rank = results(world, "check_inconsistent_replicas")
    for rank in (0, 2):
        message = per_rank[rank]["message"]
        assert "disagree" in message and "HSDP replica all-reduce" in message, message
        assert "shard_size: rank 0 2, rank 2 1" in message, message
    assert per_rank[1]["message"] == "no error"  # its own groups are consistent


def test_compress_twice_is_refused(world):
    for r in results(world, "check_compress_twice"):
        for key in ("twice", "twice, same state"):
            assert "module '0' is already compressed by ddpcomm" in r[key], r[key]
            assert "build and shard a new model" in r[key], r[key]
        assert "already compresses another model" in r["two models"], r["two models"]
        # The refused calls replaced nothing: the first state counted both steps.
        assert r["first counts"] == (2, True)
        assert "custom reduce-scatter (_OwnReduceScatter)" in r["other custom"]


def test_ranks_that_disagree_get_a_value_error_naming_the_setting(world):
    for r in results(world, "check_mismatch"):
        assert 'compression: rank 0 "q8"' in r["compression"], r["compression"]
        assert "start_iter: rank 0 0" in r["start_iter"], r["start_iter"]
        assert "block_size: rank 0 64" in r["block_size"], r["block_size"]
        assert "step: rank 0 5" in r["step"], r["step"]
        assert "numel: rank 0 " in r["numel"], r["numel"]
        for message in r.values():
            assert "ranks disagree" in message, message


def test_one_rank_without_ddpcomm_fails_fast_on_every_rank(world):
    per_rank = results(world, "check_one_rank_plain")
    for r in per_rank[1:]:
        assert "ddpcomm: rank 0 did not reach the first reduce-scatter" in r["message"], r
        assert "within 2 s" in r["message"], r
    # Rank 0 issued FSDP's own reduce-scatter: its backend fails once the others have
    # left, not at the group's timeout (gloo says "Timed out waiting 30000ms" then).
    plain = per_rank[0]["message"]
    assert plain != "no error"
    assert "Timed out" not in plain, plain


# --------------------------------------------------------------------------------------
# Without a process group
# --------------------------------------------------------------------------------------


def test_state_options_in_the_spec():
    spec = FSDPCompressionState("q4,start_iter=2,min_numel=128,block_size=64")
    keyword = FSDPCompressionState("q4", start_iter=2, min_numel=128, block_size=64)
    assert spec.config() == keyword.config()
    assert (spec.start_iter, spec.min_numel, spec.compressor.block_size) == (2, 128, 64)
    # The same value both ways is one setting, not a conflict.
    assert FSDPCompressionState("q8,start_iter=2", start_iter=2).start_iter == 2
    assert ReduceScatter("q2,min_numel=7").state.min_numel == 7
    assert FSDPCompressionState("q8").start_iter == 0


def _saved(state: FSDPCompressionState) -> dict:
    key = ("rs", "rs:0")
    return {
        "version": 1,
        "config": state.config(),
        "steps": {"rs:0": 3, "ar:0": 2},
        "memory": {
            "buffers": {key: torch.arange(4.0), ("q", "ar:0"): torch.ones(2)},
            "signatures": {key: (2, (2,)), ("q", "ar:0"): (2, 2)},
        },
    }


@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.bfloat16])
def test_load_state_dict_loads_a_valid_one(residual_dtype):
    state = FSDPCompressionState("q2", residual_dtype=residual_dtype)
    sd = _saved(state)
    sd["memory"]["buffers"][("rs", "rs:0")] = torch.arange(4.0).to(residual_dtype)
    state.load_state_dict(sd)
    assert state.steps == {"rs:0": 3, "ar:0": 2}
    again = state.state_dict()
    assert again["version"] == 1 and again["steps"] == sd["steps"]
    assert torch.equal(
        again["memory"]["buffers"][("rs", "rs:0")], torch.arange(4.0).to(residual_dtype)
    )
    # Written before state_dicts had a version: version 1.
    fresh = FSDPCompressionState("q2", residual_dtype=residual_dtype)
    fresh.load_state_dict({k: v for k, v in sd.items() if k != "version"})
    assert fresh.steps == sd["steps"]


def test_load_state_dict_loads_nothing_from_a_malformed_one():
    state = FSDPCompressionState("q2")
    state.load_state_dict(_saved(state))
    bad = _saved(state)
    bad["steps"] = {"rs:0": 9}
    bad["memory"]["buffers"][("rs", "rs:0")] = torch.full((4,), float("nan"))
    with pytest.raises(ValueError, match="NaN or Inf"):
        state.load_state_dict(bad)
    # Validated before anything was assigned: the steps are still the good ones.
    assert state.steps == {"rs:0": 3, "ar:0": 2}
    assert torch.equal(state.memory.buffers[("rs", "rs:0")], torch.arange(4.0))


def _load_another_ranks(rank, world):
    state = FSDPCompressionState("q2")
    mine = {**_saved(state), "rank": rank, "world_size": world}
    every = [None] * world
    dist.all_gather_object(every, mine)
    state.load_state_dict(every[rank])  # its own: fine
    try:
        FSDPCompressionState("q2").load_state_dict(every[(rank + 1) % world])
    except ValueError as exc:
        return str(exc)
    return "loaded"


def test_a_state_dict_loads_on_its_own_rank_only():
    for rank, outcome in enumerate(run_ranks(_load_another_ranks, 2)):
        assert f"residuals of rank {1 - rank} of 2, and this is rank {rank} of 2" in outcome


def test_a_position_loaded_before_init_is_checked_at_the_first_reduction(monkeypatch):
    from ddpcomm import checkpoint

    state = FSDPCompressionState("q2")
    assert not dist.is_initialized()
    state.load_state_dict({**_saved(state), "rank": 1, "world_size": 2})  # nothing to compare
    monkeypatch.setattr(checkpoint, "group_position", lambda pg: (0, 2))
    with pytest.raises(ValueError, match="residuals of rank 1 of 2, and this is rank 0 of 2"):
        state._agree(None, "rs:0", torch.zeros(4), "reduce-scatter")
