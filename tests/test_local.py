"""``ddpcomm.LocalSteps``: local optimizer steps with a compressed parameter average every
few steps. Checked at 2 ranks: that SGD averaged after every step is DDP's step (the
warm-up bitwise); that replicas are equal exactly at the averages; the error-feedback
invariant of an average; the learning rate it scales and restores; a bitwise resume from
a state_dict saved between two averages; bad arguments. At 3 ranks (the two-phase
quantizer): equal replicas, a bitwise resume, and a rank with other settings refused on
every rank."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpcomm
from tests.cuda_utils import needs_cuda
from tests.ddp_utils import fixed_teacher, flat_params, make_model
from tests.dist_utils import run_checks, run_ranks

DEVICE = ["cpu"]  # where the spawned rank's models live (the CUDA case sets it)


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, fixed_teacher(x)


def _backward(ddp, rank: int, step: int) -> None:
    x, y = (t.to(DEVICE[0]) for t in _batch(rank, step))
    nn.functional.mse_loss(ddp(x), y).backward()


def _setup(make_opt, **local):
    ddp = DDP(make_model().to(DEVICE[0]))
    opt = make_opt(ddp.parameters())
    return ddp, opt, ddpcomm.LocalSteps(ddp, opt, **local)


def _gathered(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(out, t)
    return out


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def check_sgd_every_step_is_ddp(rank, world):
    ref = DDP(make_model())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ddp, opt, local = _setup(
        lambda p: torch.optim.SGD(p, lr=0.1), every=1, compression="none", start_iter=2
    )
    assert local.lr_scale == 1.0
    out = {}
    for step in range(6):
        _backward(ref, rank, step)
        _backward(ddp, rank, step)
        ref_opt.step()
        local.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        if step == 1:  # the warm-up is DDP's own step
            out["warmup_bitwise"] = torch.equal(flat_params(ddp), flat_params(ref))
    # A local step runs at lr_scale times the rate: SGD moves by 3 * 0.1 * the own gradient.
    net, _, scaled = _setup(lambda p: torch.optim.SGD(p, lr=0.1), start_iter=0, lr_scale=3.0)
    before = flat_params(net)
    _backward(net, rank, 0)
    own = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    scaled.step()
    out["scaled"] = torch.allclose(flat_params(net), before - 0.3 * own, rtol=1e-6, atol=1e-8)
    a, b = flat_params(ddp), flat_params(ref)
    out["close"] = torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    out["moved"] = not torch.equal(a, flat_params(DDP(make_model())))
    return out


def check_replicas_equal_at_averages(rank, world):
    ddp, opt, local = _setup(_adamw, every=3, start_iter=1)
    assert local.lr_scale == pytest.approx(world**0.5)
    equal = []
    for step in range(8):
        _backward(ddp, rank, step)
        local.step()
        assert opt.param_groups[0]["lr"] == 1e-3  # restored after the scaled step
        opt.zero_grad()
        flat = flat_params(ddp)
        equal.append(all(torch.equal(t, flat) for t in _gathered(flat, world)))
    stats = local.stats()
    # Steps 0 (warm-up), 3 and 6 (the first and second average) leave equal replicas.
    out = {"equal": equal, "averages": stats["averages"], "paths": stats["paths"]}
    # q4's error feedback is on unless the spec turns it off.
    out["feedback"] = [
        _setup(_adamw, compression=spec)[2].compressor.error_feedback
        for spec in ("q4", "q4,error_feedback=False")
    ]
    # 1 plain step, 7 local ones, 2 q4 averages of the parameters: against 8 plain steps.
    out["ratio"] = stats["compression_ratio"]
    return out


def check_error_feedback_invariant(rank, world):
    # N * mean + sum(new residuals) = sum(change + old residual), over ranks.
    ddp, opt, local = _setup(_adamw, every=2, start_iter=0, compression="q2")
    gaps = []
    for step in range(6):
        _backward(ddp, rank, step)
        if step % 2 == 1:
            anchor = local.anchor.clone()
            old = local.memory.buffers.get(("q", 0))
            old = torch.zeros_like(anchor) if old is None else old.clone()
            opt.step()  # the local step LocalSteps would take, then its average
            local.optimizer.step = lambda closure=None: None
            change = flat_params(ddp) - anchor
            local.step()
            del local.optimizer.step
            mean = local.anchor - anchor
            lhs = change.double() + old.double()
            rhs = mean.double() + local.memory.buffers[("q", 0)].double()
            dist.all_reduce(lhs)
            dist.all_reduce(rhs)  # the mean is the same on every rank: N * mean
            gaps.append(((lhs - rhs).abs().max() / lhs.abs().max()).item())
        else:
            local.step()
        opt.zero_grad()
    return gaps


def check_resume_bitwise(rank, world):
    # At 3 ranks q4 reduces in two phases, with a residual for this rank's chunk too.
    def run(steps, resume=None):
        ddp, opt, local = _setup(_adamw, every=3, start_iter=2)
        if resume is not None:
            ddp.module.load_state_dict(resume[0])
            opt.load_state_dict(resume[1])
            local.load_state_dict(resume[2])
        saved = None
        for step in steps:
            _backward(ddp, rank, step)
            local.step()
            opt.zero_grad()
            if step == 3:  # between two averages (after 4 and 7)
                saved = [ddp.module.state_dict(), opt.state_dict(), local.state_dict()]
                saved = [_clone(s) for s in saved]
        return flat_params(ddp), saved

    whole, saved = run(range(9))
    resumed, _ = run(range(4, 9), resume=saved)
    return torch.equal(whole, resumed)


def _clone(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clone(v) for v in value]
    return value


def check_bad_arguments(rank, world):
    ddp = DDP(make_model())
    opt = _adamw(ddp.parameters())
    errors = {}
    attempts = {
        "model": lambda: ddpcomm.LocalSteps(make_model(), opt),
        "optimizer": lambda: ddpcomm.LocalSteps(ddp, "adam"),
        "every": lambda: ddpcomm.LocalSteps(ddp, opt, every=0),
        "start_iter": lambda: ddpcomm.LocalSteps(ddp, opt, start_iter=-1),
        "lr_scale": lambda: ddpcomm.LocalSteps(ddp, torch.optim.LBFGS(ddp.parameters())),
        "lr_scale value": lambda: ddpcomm.LocalSteps(ddp, opt, lr_scale=0.0),
        "normalize": lambda: ddpcomm.LocalSteps(ddp, opt, compression="q1,normalize=8"),
        "compression": lambda: ddpcomm.LocalSteps(ddp, opt, compression="q3"),
        "foreign tensor": lambda: ddpcomm.LocalSteps(ddp, _adamw([nn.Parameter(torch.ones(2))])),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            errors[name] = None
        except (TypeError, ValueError) as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    local = _setup(_adamw, every=2)[2]
    other = _setup(_adamw, every=4)[2]
    for name, sd in (("load", local.state_dict()), ("load missing", {"version": 1})):
        try:
            other.load_state_dict(sd)
            errors[name] = None
        except ValueError as exc:
            errors[name] = f"ValueError: {exc}"
    # Another rank's state_dict, or one from another world size: refused at the first
    # backward pass, on every rank, before any collective.
    for name, field, value in (("other rank", "rank", 1 - rank), ("other world", "world_size", 3)):
        ddp, _, moved = _setup(_adamw, every=2)
        moved.load_state_dict({**local.state_dict(), field: value})
        try:
            _backward(ddp, rank, 0)
            errors[name] = None
        except ValueError as exc:
            errors[name] = f"ValueError: {exc}"
    return errors


def test_bench_method_names():
    from ddpcomm.bench import _methods

    assert _methods.local_options("local:8,compression=q4,lr_scale=1.5") == {
        "every": 8,
        "compression": "q4",
        "lr_scale": 1.5,
    }
    legend = _methods.describe("local:8,lr_scale=1.5")
    assert "q2 every 8 steps after 300" in legend and "lr_scale 1.5" in legend
    with pytest.raises(ValueError, match="unknown option 'every=2'"):
        _methods.local_options("local:8,every=2")


def _checks_at_two(rank, world):
    return run_checks(
        rank,
        world,
        [
            check_sgd_every_step_is_ddp,
            check_replicas_equal_at_averages,
            check_error_feedback_invariant,
            check_resume_bitwise,
            check_bad_arguments,
        ],
    )


@pytest.fixture(scope="module")
def two():
    return run_ranks(_checks_at_two, 2)


def _result(results, name):
    for r in results:
        value = r[name]
        if isinstance(value, dict) and "error" in value:
            pytest.fail(value["error"])
    return [r[name] for r in results]


def test_sgd_averaged_every_step_is_ddp(two):
    for r in _result(two, "check_sgd_every_step_is_ddp"):
        assert r == {"warmup_bitwise": True, "scaled": True, "close": True, "moved": True}


def test_replicas_are_equal_exactly_at_the_averages(two):
    for r in _result(two, "check_replicas_equal_at_averages"):
        assert r["equal"] == [True, False, False, True, False, False, True, False]
        assert r["averages"] == 2
        assert r["paths"]["plain"] > 0 and r["paths"]["local"] > 0
        assert r["paths"]["q_all_gather"] == 2 and r["feedback"] == [True, False]
        assert 8 / 3 < r["ratio"] < 8


def test_error_feedback_keeps_every_rank_s_change(two):
    for gaps in _result(two, "check_error_feedback_invariant"):
        assert len(gaps) == 3 and max(gaps) < 1e-5


def test_resume_between_averages_is_bitwise(two):
    assert _result(two, "check_resume_bitwise") == [True, True]


def test_bad_arguments_name_the_argument(two):
    for errors in _result(two, "check_bad_arguments"):
        for name, error in errors.items():
            assert error is not None, f"{name} was accepted"
        for name in ("model", "optimizer", "every", "start_iter", "lr_scale", "normalize"):
            assert name.split()[0] in errors[name], errors[name]
        assert "every" in errors["load"] and "missing" in errors["load missing"]
        # The remedy LocalSteps has, not a CompressionState's options it does not.
        assert "another rank's residuals" in errors["other rank"], errors["other rank"]
        assert "saved by 3 ranks and this run has 2" in errors["other world"]
        for name in ("other rank", "other world"):
            assert "LocalSteps.state_dict()" in errors[name], errors[name]
            assert "gather=True" not in errors[name] and "reset_residuals" not in errors[name]


def _three(rank, world):
    ddp, opt, local = _setup(_adamw, every=2, start_iter=1, compression="q4")
    for step in range(5):
        _backward(ddp, rank, step)
        local.step()
        opt.zero_grad()
    flat = flat_params(ddp)
    equal = all(torch.equal(t, flat) for t in _gathered(flat, world))
    kinds = sorted(k[0] for k in local.memory.buffers)
    resumed = check_resume_bitwise(rank, world)
    ddp, opt, local = _setup(_adamw, every=2 + (rank == 2), start_iter=1)
    try:  # checked at the first bucket of the first backward pass, before any collective
        _backward(ddp, rank, 0)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return equal, kinds, resumed, refused


def test_three_ranks_agree_resume_and_refuse_other_settings():
    for equal, kinds, resumed, refused in run_ranks(_three, 3):
        assert equal and kinds == ["q", "q_owner"] and resumed
        assert refused is not None and "every" in refused


def _on_cuda(rank, world):
    torch.cuda.set_device(0)
    DEVICE[0] = "cuda"
    return run_checks(rank, world, [check_replicas_equal_at_averages, check_resume_bitwise])


@needs_cuda
def test_cuda_parameters_over_gloo():
    results = run_ranks(_on_cuda, 2)
    for r in _result(results, "check_replicas_equal_at_averages"):
        assert r["equal"] == [True, False, False, True, False, False, True, False]
    assert _result(results, "check_resume_bitwise") == [True, True]
