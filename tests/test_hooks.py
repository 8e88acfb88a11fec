"""Every hook under real DDP on spawned gloo groups: parity with DDP's default, bitwise
identical replicas, many small buckets (collective order), start_iter / min_numel,
state=None and two models, checkpoint/resume, a non-finite step, ranks configured
differently, torch.compile; with a GPU, parity of a CUDA model too.

Each (world size, device) group is spawned once and trains every run below
(tests/spawn_plan.py); each test reads its own. State objects and arguments without a
process group: test_hook_states.py.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import math
import pickle
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpcomm
from tests.cuda_utils import needs_cuda
from tests.ddp_utils import (
    DEEP,
    FROM_START,
    SHALLOW,
    Recipe,
    fixed_teacher,
    flat_params,
    held_out_loss,
    identical_across_ranks,
    make_deep_model,
    make_model,
    make_teacher,
    train,
)
from tests.spawn_plan import Groups


class Case(NamedTuple):
    recipe: Recipe
    state: Callable | None  # builds the state; None registers the hook with state=None
    hook: Callable
    bound: float  # see test_ddp_parity_with_default


PARITY = {
    "q8": Case(SHALLOW, lambda: ddpcomm.QuantizeState(bits=8), ddpcomm.quantize_hook, 0.01),
    "q4-ef": Case(
        SHALLOW,
        lambda: ddpcomm.QuantizeState(bits=4, error_feedback=True),
        ddpcomm.quantize_hook,
        0.05,
    ),
    "q8-state-none": Case(SHALLOW, None, ddpcomm.quantize_hook, 0.01),
    "q4-ef-spec": Case(
        SHALLOW,
        lambda: ddpcomm.CompressionState("q4", error_feedback=True),
        ddpcomm.compress_hook,
        0.05,
    ),
    "q8-spec-state-none": Case(SHALLOW, None, ddpcomm.compress_hook, 0.01),
    "topk": Case(DEEP, lambda: ddpcomm.TopKState(0.1, **FROM_START), ddpcomm.topk_hook, 0.9),
    "randk": Case(DEEP, lambda: ddpcomm.RandomKState(0.3, seed=1), ddpcomm.randomk_hook, 0.9),
}
# One state, one hook: a spec string runs exactly what the named state runs.
SPEC_TWINS = {"q4-ef-spec": "q4-ef", "q8-spec-state-none": "q8-state-none"}
WORLDS = {SHALLOW: (2, 3), DEEP: (3,)}
CUDA_WORLD = 2  # CUDA models: the shallow recipe, 2 ranks sharing GPU 0
PATHS = {"q": "q_two_phase", "topk": "topk_all_gather", "randk": "randk_all_reduce"}


class Runs:
    """One rank's training runs, the default's shared by every case of its recipe."""

    def __init__(self, rank: int, world: int, device: str) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.params: dict[str, torch.Tensor] = {}
        self.defaults: dict[Recipe, tuple] = {}

    def default(self, recipe: Recipe) -> tuple:
        """DDP's default run: (parameters, last training loss, held-out loss)."""
        if recipe not in self.defaults:
            model, losses = train(self.rank, recipe, None, None, device=self.device)
            self.defaults[recipe] = flat_params(model), losses[-1], held_out_loss(recipe, model)
        return self.defaults[recipe]

    def parity(self, name: str) -> dict:
        case = PARITY[name]
        state = None if case.state is None else case.state()
        model, losses = train(self.rank, case.recipe, state, case.hook, device=self.device)
        p = self.params[name] = flat_params(model)
        assert identical_across_ranks(p, self.world), "replicas differ"
        ref, ref_loss, ref_held_out = self.default(case.recipe)
        stats = None
        if state is not None:
            stats = state.stats()
            assert stats["paths"] and 0 < stats["bytes_sent"] < stats["dense_bytes"]
            stats = {k: stats[k] for k in ("paths", "bytes_sent", "dense_bytes")}
        return dict(
            rel=float((p - ref).norm() / ref.norm()),
            loss=losses[-1],
            ref_loss=ref_loss,
            held_out=held_out_loss(case.recipe, model),
            ref_held_out=ref_held_out,
            start_held_out=held_out_loss(case.recipe, case.recipe.model()),
            stats=stats,
        )

    def allreduce_hook_is_default(self) -> None:
        # allreduce_hook is DDP's default reduction: bitwise the same parameters.
        m, _ = train(self.rank, SHALLOW, None, ddpcomm.allreduce_hook, device=self.device)
        assert torch.equal(flat_params(m), self.default(SHALLOW)[0])

    def spec_twin(self, name: str) -> None:
        assert torch.equal(self.params[name], self.params[SPEC_TWINS[name]])


def compressed_path(state, world: int) -> str:
    c = state.compressor
    if isinstance(c, ddpcomm.compressors.Quantizer):
        return f"q_{c.resolve_algorithm(world)}"
    return "topk_all_gather" if isinstance(c, ddpcomm.compressors.TopK) else "randk_all_reduce"


# Many small buckets: the case where out-of-order completion pairs the wrong buckets if a
# second collective is not sequenced (two-phase), and where every method's bucket order
# must hold.
SMALL_BUCKETS = {
    "q4-two_phase-ef": lambda: ddpcomm.QuantizeState(
        bits=4, algorithm="two_phase", error_feedback=True
    ),
    "topk": lambda: ddpcomm.TopKState(0.05, **FROM_START),
    "randk": lambda: ddpcomm.RandomKState(0.05, **FROM_START),
}


def check_many_small_buckets(rank, world, make_state):
    # Tiny buckets (one or two parameters each) and several steps on 3+ ranks.
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(24 + i, 25 + i) for i in range(12)])
    state = make_state()
    ddp = DDP(model, bucket_cap_mb=0.0005)
    ddp.register_comm_hook(state, ddpcomm.compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for step in range(6):
        g = torch.Generator().manual_seed(step * 10 + rank)
        loss = ddp(torch.randn(8, 24, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert state.stats()["paths"][compressed_path(state, world)] >= 6 * 10
    assert identical_across_ranks(flat_params(model), world)
    # Buckets all-gathered on gloo report their pieces and the link rate the ranks agreed
    # on after their 4th call: the same on every rank.
    pieces = state.stats().get("gloo_pieces", {})
    if compressed_path(state, world) == "topk_all_gather":
        assert len(pieces) >= 10, pieces
    rows = [[p["pieces"], p["agreed_MB_per_s"] or -1.0] for _, p in sorted(pieces.items())]
    assert all(n >= 1 and rate > 0 for n, rate in rows), pieces
    assert identical_across_ranks(torch.tensor(rows, dtype=torch.float64), world)


OPTIONS = {
    "q8": lambda: ddpcomm.QuantizeState(bits=8, start_iter=3, min_numel=1000),
    "topk": lambda: ddpcomm.TopKState(0.01, start_iter=3, min_numel=1000, ramp=0),
    "randk": lambda: ddpcomm.RandomKState(0.01, start_iter=3, min_numel=1000, ramp=0),
}


def check_start_iter_and_min_numel(rank, world, make_state):
    # Plain all_reduce before start_iter and for small buckets, compressed otherwise.
    state = make_state()
    train(rank, SHALLOW, state, ddpcomm.compress_hook, steps=5)
    paths = state.stats()["paths"]
    assert state.iteration == 5
    assert paths["plain"] > 0 and paths[compressed_path(state, world)] > 0


RAMPS = {
    "q1": "q1,start_iter=2,ramp=6",
    "q4-ef": "q4,error_feedback,start_iter=1,ramp=3",
    "topk": "topk:0.01,start_iter=2,ramp=6",
    "randk": "randk:0.01,start_iter=0,ramp=6,seed=3",
}


def check_ramp(rank, world, spec):
    """A warm-up and ramp through the state's own reduce: results bitwise identical on
    every rank, each iteration on its documented stage, and error feedback exact across
    stage changes: the sum of the means sent plus the mean residual is the mean of the
    summed inputs (up to fp32 rounding), so nothing a stage left unsent is lost."""
    state = ddpcomm.CompressionState(spec)
    n, steps = 5000, state.start_iter + state.ramp + 2
    sent, inputs = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    used = []
    for it in range(steps):
        g = torch.Generator().manual_seed(1000 * it + rank)
        x = torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(4)  # heavy tails
        inputs += x.double()
        out = state.reduce(x.clone(), 0, ()).wait()
        assert identical_across_ranks(out, world), f"iteration {it}: ranks differ"
        sent += out.double()
        used.append(state.compressor_at(it).spec if it >= state.start_iter else "plain")
        state.iteration += 1
    kind = {"q": "q", "t": "topk", "r": "randk"}[spec[0]]
    residual = state.memory.buffers.get((kind, 0))
    scale = state.memory.buffers.get(("scale", 0))
    if scale is not None:  # q1's default normalize: residuals in units of the scale
        residual = residual * scale
    every = [torch.empty_like(inputs) for _ in range(world)]
    dist.all_gather(every, inputs)
    mean_inputs = sum(every) / world
    if residual is not None:  # error feedback on
        res = [torch.empty(n, dtype=torch.float32) for _ in range(world)]
        dist.all_gather(res, residual)
        sent += sum(r.double() for r in res) / world
        err = (sent - mean_inputs).norm() / mean_inputs.norm()
        assert err < 1e-5, f"error feedback lost {err:.2e} across the ramp"
    return used


DEFAULT_STATES = {
    "compress_hook": (ddpcomm.compress_hook, ddpcomm.CompressionState),
    "quantize_hook": (ddpcomm.quantize_hook, ddpcomm.QuantizeState),
    "topk_hook": (ddpcomm.topk_hook, ddpcomm.TopKState),
    "randomk_hook": (ddpcomm.randomk_hook, ddpcomm.RandomKState),
}


def check_state_none(rank, world, hook, cls):
    # state=None: each model gets its own default state; two models never share buffers.
    a, b = make_model(1), make_model(2)
    ddp_a, ddp_b = DDP(a, bucket_cap_mb=0.01), DDP(b, bucket_cap_mb=0.01)
    ddp_a.register_comm_hook(None, hook)
    ddp_b.register_comm_hook(None, hook)
    for step in range(3):
        x = torch.randn(32, 32, generator=torch.Generator().manual_seed(SHALLOW.seed(rank, step)))
        y = fixed_teacher(x)
        (nn.functional.mse_loss(ddp_a(x), y) + nn.functional.mse_loss(ddp_b(x), y)).backward()
    sa = ddpcomm.hooks._DEFAULT_STATES[next(a.parameters())]
    sb = ddpcomm.hooks._DEFAULT_STATES[next(b.parameters())]
    assert type(sa) is cls and sa.compressor == cls().compressor  # the defaults
    assert sa is not sb and sa.iteration == 3 and sb.iteration == 3
    assert identical_across_ranks(flat_params(a), world)
    # ... and trains: the defaults (q8; top-k and random-k at 1% density) stay finite.
    model, _ = train(rank, DEEP, None, hook, steps=5)
    assert math.isfinite(held_out_loss(DEEP, model))


RESUME = {
    "q2-stochastic": Case(
        SHALLOW,
        lambda: ddpcomm.QuantizeState(bits=2, stochastic=True, seed=5, **FROM_START),
        ddpcomm.quantize_hook,
        0,
    ),
    "topk-approximate-bf16": Case(
        DEEP,
        lambda: ddpcomm.TopKState(0.05, approximate=True, value_dtype=torch.bfloat16, **FROM_START),
        ddpcomm.topk_hook,
        0,
    ),
    "randk": Case(
        DEEP, lambda: ddpcomm.RandomKState(0.1, seed=3, **FROM_START), ddpcomm.randomk_hook, 0
    ),
}


def check_resume(rank, world, case: Case):
    # Train 8 steps straight vs 4 steps, checkpoint (state_dict through torch.save, and
    # pickle), fresh objects, 4 more steps: bitwise the same parameters. The fresh DDP
    # groups its first iteration's buckets differently from the checkpoint's (DDP rebuilds
    # after iteration 0), so this also checks that the state re-forms the saved buckets for
    # that iteration. The residuals carry the unsent gradient mass, so a lost one would
    # change the result. Plain SGD: no optimizer state to checkpoint.
    recipe = dataclasses.replace(case.recipe, momentum=0.0)
    straight, _ = train(rank, recipe, case.state(), case.hook, steps=8)

    state = case.state()
    model, _ = train(rank, recipe, state, case.hook, steps=4)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    pickled = pickle.loads(pickle.dumps(state))
    assert pickled.process_group is None and pickled.iteration == 4
    fresh = case.state()
    buf.seek(0)
    fresh.load_state_dict(torch.load(buf, weights_only=False))

    for restored in (fresh, pickled):
        model = recipe.model()
        model.load_state_dict(weights)
        resumed, _ = train(rank, recipe, restored, case.hook, steps=4, model=model, start=4)
        assert torch.equal(flat_params(resumed), flat_params(straight))


NON_FINITE = {
    "q8": lambda: ddpcomm.QuantizeState(bits=8),
    "q4-ef": lambda: ddpcomm.QuantizeState(bits=4, error_feedback=True),
    "topk": lambda: ddpcomm.TopKState(0.01, **FROM_START),
    "randk": lambda: ddpcomm.RandomKState(0.01, **FROM_START),
}


def check_non_finite_step(rank, world, make_state):
    """One rank feeds NaN: every bucket's result is non-finite on every rank, no residual
    keeps a NaN, and the next (finite) step trains normally."""
    finite: list[bool] = []
    state = make_state()

    def checked(state, bucket):
        def record(fut):
            finite.append(bool(torch.isfinite(fut.value()).all()))
            return fut.value()

        return ddpcomm.compress_hook(state, bucket).then(record)

    teacher = make_teacher()
    model = DDP(make_deep_model(), bucket_cap_mb=DEEP.bucket_cap_mb)
    model.register_comm_hook(state, checked)
    for step in range(4):
        x = torch.randn(32, 32, generator=torch.Generator().manual_seed(DEEP.seed(rank, step)))
        y = teacher(x)
        if step == 2 and rank == world - 1:
            x[0, 0] = float("nan")
        finite.clear()
        model.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        assert finite  # one bucket before DDP rebuilds them, five after
        if step == 2:
            assert not any(finite), f"rank {rank}: a bucket stayed finite after a NaN"
            for buf in state.memory.buffers.values():
                assert bool(torch.isfinite(buf).all()), "NaN left in a residual"
        else:
            assert all(finite)


# Ranks configured differently: a clear error on every rank at the first step, no hang.
MISMATCH = {
    "q8-vs-q4": (lambda rank: ddpcomm.QuantizeState(bits=8 if rank == 0 else 4), "quantize"),
    "topk-ratio": (lambda rank: ddpcomm.TopKState(0.01 if rank == 0 else 0.02), "topk"),
    "randk-seed": (lambda rank: ddpcomm.RandomKState(0.01, seed=rank), "randomk"),
}


def check_config_mismatch(rank, world, make_state, hook) -> str:
    try:
        train(rank, SHALLOW, make_state(rank), getattr(ddpcomm, f"{hook}_hook"), steps=1)
    except Exception as exc:  # noqa: BLE001 - DDP re-raises hook errors as RuntimeError
        return str(exc)
    return "no error"


def check_torch_compile(rank, world):
    # torch.compile over DDP (the default optimize_ddp mode splits the graph at bucket
    # boundaries; hooks run as usual): same parameters as the eager run with the same hook.
    out = {}
    for compiled in (False, True):
        model = make_model()
        # Default bucket cap: dynamo's DDP optimizer refuses a cap below DDP's 1 MiB first bucket.
        ddp = DDP(model)
        ddp.register_comm_hook(
            ddpcomm.CompressionState("q4", error_feedback=True), ddpcomm.compress_hook
        )
        run = torch.compile(ddp, backend="aot_eager") if compiled else ddp
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(4):
            x = torch.randn(32, 32, generator=torch.Generator().manual_seed(7919 * step + rank))
            opt.zero_grad()
            nn.functional.mse_loss(run(x), fixed_teacher(x)).backward()
            opt.step()
        out[compiled] = flat_params(model)
    assert identical_across_ranks(out[True], world)
    torch.testing.assert_close(out[True], out[False], rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------
# The plan every rank of a group runs, and the tests reading it
# --------------------------------------------------------------------------------------


def parity_worlds(case: Case, device: str) -> tuple:
    if device == "cuda":
        return (CUDA_WORLD,) if case.recipe is SHALLOW else ()
    return WORLDS[case.recipe]


RESUME_WORLDS = {name: WORLDS[case.recipe] for name, case in RESUME.items()}


def plan(rank: int, world: int, device: str):
    p = functools.partial
    if device == "cuda":
        torch.cuda.set_device(0)
    runs = Runs(rank, world, device)
    for name, case in PARITY.items():
        if world in parity_worlds(case, device):
            yield ("parity", name), p(runs.parity, name)
    yield ("allreduce_hook",), runs.allreduce_hook_is_default
    for name in SPEC_TWINS:
        yield ("spec_twin", name), p(runs.spec_twin, name)
    if device == "cuda":
        return
    if world == 3:
        for name, make in SMALL_BUCKETS.items():
            yield ("small_buckets", name), p(check_many_small_buckets, rank, world, make)
        for name, make in NON_FINITE.items():
            yield ("non_finite", name), p(check_non_finite_step, rank, world, make)
    if world == 2:
        for name, make in OPTIONS.items():
            yield ("options", name), p(check_start_iter_and_min_numel, rank, world, make)
        for name, spec in RAMPS.items():
            yield ("ramp", name), p(check_ramp, rank, world, spec)
        for name, (hook, cls) in DEFAULT_STATES.items():
            yield ("state_none", name), p(check_state_none, rank, world, hook, cls)
        yield ("torch_compile",), p(check_torch_compile, rank, world)
    for name, case in RESUME.items():
        if world in RESUME_WORLDS[name]:
            yield ("resume", name), p(check_resume, rank, world, case)
    # Last: a hook that raised leaves its DDP model unusable.
    for name, (make, hook) in MISMATCH.items():
        yield ("mismatch", name), p(check_config_mismatch, rank, world, make, hook)


@pytest.fixture(scope="module")
def groups():
    return Groups(plan)


PARITY_RUNS = [
    pytest.param(name, world, device, marks=[needs_cuda] if device == "cuda" else [])
    for device in ("cpu", "cuda")
    for name, case in PARITY.items()
    for world in parity_worlds(case, device)
]


@pytest.mark.parametrize("method, world, device", PARITY_RUNS)
def test_ddp_parity_with_default(groups, method, world, device):
    """Close to DDP's default, replicas bitwise identical, stats() showing the saving."""
    r = groups.values(world, device, "parity", method)[0]
    case = PARITY[method]
    if case.recipe is SHALLOW:
        # Bounds. q8 moves each gradient element by at most absmax/254 of its 256-element
        # block per step (under 0.4% of the block's largest gradient), unbiased in sign on
        # average; over 50 SGD steps the parameters stay within 1% (relative L2) of DDP's
        # default. q4 with error feedback has steps 18x coarser, but error feedback
        # re-injects what was dropped, so the trajectory stays within 5%. Loss within 5%
        # of the default's final loss for both.
        assert r["rel"] < case.bound, r["rel"]
        assert abs(r["loss"] - r["ref_loss"]) <= 0.05 * r["ref_loss"], r
        assert r["rel"] > 0, "a lossy hook that changes nothing is not compressing"
        return
    # Bound: reach at least 90% of the loss reduction DDP's default reaches in 100 steps.
    # Both runs compress 3.3x (top-k 10%, random-k 30%). With error feedback every gradient
    # entry is applied eventually, delayed by about 1/ratio steps (Stich et al. 2018,
    # "Sparsified SGD with memory"), which is small next to 100 steps, so most of the
    # progress must survive. Measured at the time of writing: top-k 97.8%, random-k 96.7%;
    # the 90% bound leaves room for platform float differences, while a broken hook (no
    # error feedback, wrong scaling, dropped buckets) lands far below it.
    start = r["start_held_out"]
    achieved = (start - r["held_out"]) / (start - r["ref_held_out"])
    assert achieved >= case.bound, f"{achieved:.3f} of the default's loss reduction"
    stats = r["stats"]
    path = "topk_all_gather" if method == "topk" else "randk_all_reduce"
    assert stats["paths"].get(path, 0) >= 5 * (DEEP.steps - 1)
    assert stats["bytes_sent"] * 3 < stats["dense_bytes"]


PARITY_GROUPS = [
    pytest.param(2, "cpu"),
    pytest.param(3, "cpu"),
    pytest.param(CUDA_WORLD, "cuda", marks=needs_cuda),
]


@pytest.mark.parametrize("world, device", PARITY_GROUPS)
def test_allreduce_hook_is_bitwise_ddp_default(groups, world, device):
    groups.values(world, device, "allreduce_hook")


@pytest.mark.parametrize("world, device", PARITY_GROUPS)
@pytest.mark.parametrize("method", SPEC_TWINS)
def test_spec_string_runs_what_the_named_state_runs(groups, method, world, device):
    groups.values(world, device, "spec_twin", method)


@pytest.mark.parametrize("method", SMALL_BUCKETS)
def test_many_small_buckets_three_ranks(groups, method):
    groups.values(3, "cpu", "small_buckets", method)


@pytest.mark.parametrize("method", OPTIONS)
def test_start_iter_and_min_numel(groups, method):
    groups.values(2, "cpu", "options", method)


RAMP_STAGES = {
    "q1": ["plain"] * 2 + ["q8"] * 2 + ["q4"] * 2 + ["q2"] * 2 + ["q1"] * 2,
    "q4-ef": ["plain", "q8", "q8", "q8", "q4", "q4"],
    "topk": ["plain"] * 2
    + [f"topk:{r!r}" for r in (0.25, 0.25, 0.0625, 0.0625)]
    + [f"topk:{0.25**3!r}"] * 2
    + ["topk:0.01"] * 2,
    "randk": [f"randk:{r!r}" for r in (0.25, 0.25, 0.0625, 0.0625, 0.25**3, 0.25**3)]
    + ["randk:0.01"] * 2,
}


@pytest.mark.parametrize("method", RAMPS)
def test_warmup_and_ramp_keep_ranks_identical_and_error_feedback_exact(groups, method):
    for used in groups.values(2, "cpu", "ramp", method):
        assert used == RAMP_STAGES[method]


@pytest.mark.parametrize("hook", DEFAULT_STATES)
def test_state_none_gives_each_model_its_own_defaults(groups, hook):
    groups.values(2, "cpu", "state_none", hook)


@pytest.mark.parametrize(
    "method, world", [(name, w) for name, worlds in RESUME_WORLDS.items() for w in worlds]
)
def test_checkpoint_resume_is_bitwise(groups, method, world):
    groups.values(world, "cpu", "resume", method)


@pytest.mark.parametrize("method", NON_FINITE)
def test_non_finite_step(groups, method):
    groups.values(3, "cpu", "non_finite", method)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("method", MISMATCH)
def test_ranks_with_different_configs_fail_clearly(groups, method, world):
    for msg in groups.values(world, "cpu", "mismatch", method):
        assert "ranks disagree on the compression configuration" in msg


def test_torch_compile_with_compress_hook(groups):
    groups.values(2, "cpu", "torch_compile")
