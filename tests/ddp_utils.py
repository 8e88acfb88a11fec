"""Training under DDP for the hook tests: two recipes (model, data, optimizer, bucket cap)
and one training loop, on CPU or on GPU 0."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

# q2, q1 and sparse states start with a full-precision warm-up and a ramp by default
# (compressors.default_schedule); tests of the compressed path start it at once.
FROM_START = {"start_iter": 0, "ramp": 0}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A training run: the model, the regression target, each rank's batches (seeded by
    rank and step), SGD's settings and DDP's bucket cap."""

    model: Callable[[], nn.Module]
    target: Callable[[], Callable]
    seed: Callable[[int, int], int]
    lr: float
    momentum: float
    bucket_cap_mb: float
    steps: int


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)
    )


def make_deep_model() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(32, 64), nn.Tanh()]
    for _ in range(4):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(64, 8))


def make_teacher() -> nn.Module:
    torch.manual_seed(123)
    teacher = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 8))
    return teacher.requires_grad_(False)


def fixed_teacher(x: torch.Tensor) -> torch.Tensor:
    # A fixed teacher so the loss actually decreases.
    return torch.sin(x[:, :8] * 2.0) + 0.1 * x[:, 8:16]


# Plain SGD on a small model, 50 steps, 0.01 MB buckets.
SHALLOW = Recipe(make_model, lambda: fixed_teacher, lambda r, s: 7919 * s + r, 0.1, 0.0, 0.01, 50)
# SGD with momentum on a deeper model, 100 steps; a 4 KB bucket cap gives 5 buckets per step
# after DDP's rebuild, so collective order matters.
DEEP = Recipe(make_deep_model, make_teacher, lambda r, s: 10000 * s + r, 0.05, 0.9, 0.004, 100)


def train(
    rank,
    recipe,
    state,
    hook,
    *,
    steps=None,
    model=None,
    start=0,
    device="cpu",
    compiled_autograd=False,
):
    """Trains ``model`` (default: the recipe's) under DDP with ``hook``; returns it and the
    training losses. ``hook=None`` is DDP's default reduction. ``compiled_autograd`` runs
    each backward pass under compiled autograd."""
    model = (recipe.model() if model is None else model).to(device)
    target = recipe.target()
    ddp = DDP(
        model,
        bucket_cap_mb=recipe.bucket_cap_mb,
        device_ids=[0] if device == "cuda" else None,
    )
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=recipe.lr, momentum=recipe.momentum)
    losses = []
    for step in range(start, start + (recipe.steps if steps is None else steps)):
        x = torch.randn(32, 32, generator=torch.Generator().manual_seed(recipe.seed(rank, step)))
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x.to(device)), target(x).to(device))
        with compiled_backward(compiled_autograd):
            loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model, losses


def compiled_backward(enable: bool):
    """A context whose backward passes run under compiled autograd (when ``enable``),
    compiled by one aot_eager ``torch.compile``: every traced op goes through
    functionalization and the ops' fake impls, without inductor's C++ build."""
    if not enable:
        return contextlib.nullcontext()
    from torch._dynamo import compiled_autograd

    return compiled_autograd._enable(_COMPILER)


_COMPILER = torch.compile(backend="aot_eager")


def held_out_loss(recipe: Recipe, model: nn.Module) -> float:
    gx = torch.randn(512, 32, generator=torch.Generator().manual_seed(999))
    with torch.no_grad():
        device = next(model.parameters()).device
        return float(nn.functional.mse_loss(model(gx.to(device)).cpu(), recipe.target()(gx)))


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def identical_across_ranks(t: torch.Tensor, world: int) -> bool:
    every = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(every, t)
    return all(torch.equal(every[0], e) for e in every)
