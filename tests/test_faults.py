"""Faults and misuse under real DDP, 3 gloo ranks in one spawn: inf/nan with AMP's
GradScaler, sparse gradient buckets, one state on two models, then a frozen rank and a
killed rank (last: they leave the ranks' groups unusable)."""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.ddp_utils import FROM_START
from tests.dist_utils import EXITED, run_ranks

GROUP_TIMEOUT = 5.0
# gloo's own words in a failed collective: its source path in most messages, or the text
# of a pair it closed itself (under load a survivor may see the other's timeout close
# their pair first: "Application timeout caused pair closure", no path).
GLOO_WORDS = ("gloo", "Application timeout caused pair closure")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _same_on_every_rank(t: torch.Tensor) -> bool:
    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t)
    return all(torch.equal(every[0], e) for e in every)


def _grad_scaler(rank, world):
    """A non-finite gradient on one rank: every rank's output is non-finite, GradScaler
    skips the step on every rank alike, residuals are reset, training goes on."""
    import ddpcomm

    out = {}
    for name, state in [
        ("q4_two_phase_ef", ddpcomm.QuantizeState(4, error_feedback=True)),
        ("q4_all_gather_ef", ddpcomm.QuantizeState(4, error_feedback=True, algorithm="all_gather")),
        ("topk", ddpcomm.TopKState(0.1, **FROM_START)),
        ("randk", ddpcomm.RandomKState(0.1, **FROM_START)),
    ]:
        model = _model()
        ddp = DDP(model, bucket_cap_mb=0.004)
        ddp.register_comm_hook(state, ddpcomm.compress_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scales = []
        for step in range(5):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))
            if step == 2 and rank == 1:
                x[0, 0] = float("nan") if name == "randk" else float("inf")
            before = _flat(model).clone()
            opt.zero_grad()
            scaler.scale(ddp(x).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            if step == 2:
                assert torch.equal(_flat(model), before), name  # the step was skipped
                assert all(bool(b.isfinite().all()) for b in state.memory.buffers.values())
        assert _same_on_every_rank(_flat(model)), name
        assert bool(_flat(model).isfinite().all()), name
        out[name] = scales
    return out


def _sparse_buckets(rank, world):
    """nn.EmbeddingBag(sparse=True): its bucket is reduced plainly, bitwise as DDP's
    default, and counted in stats()."""
    import ddpcomm

    def run(state, hook, steps):
        torch.manual_seed(0)
        model = nn.Sequential(nn.EmbeddingBag(50, 16, sparse=True), nn.Linear(16, 4))
        ddp = DDP(model)
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            g = torch.Generator().manual_seed(10 * step + rank)
            idx = torch.randint(0, 50, (6, 3), generator=g)
            opt.zero_grad()
            ddp(idx).square().sum().backward()
            grad = model[0].weight.grad.to_dense().clone()
            opt.step()
        return _flat(model), grad

    ref, _ = run(None, None, 3)
    plain, _ = run(None, ddpcomm.allreduce_hook, 3)
    assert torch.equal(plain, ref)
    state = ddpcomm.CompressionState("q8")
    _, grad = run(state, ddpcomm.compress_hook, 1)
    _, ref_grad = run(None, None, 1)
    assert torch.equal(grad, ref_grad)  # the sparse bucket: plain, bitwise
    return state.stats()["paths"]


def _two_models_one_state(rank, world):
    import ddpcomm

    state = ddpcomm.QuantizeState(8)
    a, b = DDP(_model()), DDP(_model())
    a.register_comm_hook(state, ddpcomm.quantize_hook)
    b.register_comm_hook(state, ddpcomm.quantize_hook)
    x = torch.randn(4, 32)
    a(x).sum().backward()
    try:
        b(x).sum().backward()
    except Exception as exc:  # noqa: BLE001 - DDP re-raises hook errors
        return str(exc)
    return "no error"


def _freeze_then_kill(rank, world):
    """Rank 2 stops (sleeps, as SIGSTOP would, its connections open) before a two-phase
    step: the survivors fail at the group's timeout, once: a failed phase 1 issues no
    phase 2. Then rank 2 dies mid-run: the survivors fail at once. The
    errors carry the backend's message, not 'Unable to cast ... to Tensor'."""
    import ddpcomm

    # Everything that needs every rank first: a gloo group connects its ranks within its
    # own timeout, DDP's constructor and the first two-phase step (which makes the
    # companion group) are collectives.
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT)
    runs = {}
    for case in ("freeze", "kill"):
        g = dist.new_group(list(range(world)), timeout=timeout)
        ddp = DDP(_model(), process_group=g, bucket_cap_mb=0.004)
        state = ddpcomm.QuantizeState(8, algorithm="two_phase", process_group=g)
        ddp.register_comm_hook(state, ddpcomm.quantize_hook)
        ddp(torch.randn(4, 32)).sum().backward()
        runs[case] = ddp
    out = {}
    for case, ddp in runs.items():
        dist.barrier()  # the default group (60 s): the frozen rank is awake again
        t0 = time.monotonic()
        try:
            for step in range(1, 4):
                if step == 2 and rank == 2:
                    if case == "kill":
                        os._exit(0)
                    time.sleep(4 * GROUP_TIMEOUT)
                t0 = time.monotonic()
                ddp(torch.randn(4, 32)).sum().backward()
            out[case] = ("no error", time.monotonic() - t0)
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
            out[case] = (f"{type(exc).__name__}: {exc}", time.monotonic() - t0)
    return out


def _body(rank, world):
    return {
        "scaler": _grad_scaler(rank, world),
        "sparse": _sparse_buckets(rank, world),
        "two_models": _two_models_one_state(rank, world),
        "faults": _freeze_then_kill(rank, world),
    }


def test_faults_and_misuse():
    results = run_ranks(_body, 3, pg_timeout=60, allow_exit=True, timeout=300)
    survivors = results[:2]
    for r in survivors:
        for name, scales in r["scaler"].items():
            # Skipped step: the scale halves at step 2 on every rank alike.
            assert scales[2] == scales[1] / 2, (name, scales)
            assert scales == survivors[0]["scaler"][name], name
        assert r["sparse"].get("sparse_plain", 0) >= 1, r["sparse"]
        assert "already serves another DDP model" in r["two_models"], r["two_models"]
        for case in ("freeze", "kill"):
            msg, secs = r["faults"][case]
            print(f"{case}: reported after {secs:.1f} s (group timeout {GROUP_TIMEOUT:g} s)")
            assert msg != "no error", case
            assert "Unable to cast" not in msg, msg
            # The backend's own message reaches the user.
            assert any(words in msg for words in GLOO_WORDS), msg
            # Phase 1 times out and phase 2 is not issued after it (the group is unusable):
            # one group timeout, not two (it was twice before, and until the frozen rank
            # woke up before that).
            assert secs < GROUP_TIMEOUT + 3, (case, secs, msg)
    assert results[2] == EXITED  # the killed rank
