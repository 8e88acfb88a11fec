"""A rank of ``python -m ddpcomm.bench train``: trains the small GPT once per method.

Every method starts from the same initial weights and sees the same batches (a pure
function of step and rank), so the loss curves differ only by what the method did to the
gradients.
"""

from __future__ import annotations

import functools
import math
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpcomm.bench import _worker
from ddpcomm.bench._gpt import GPT, GPTConfig, Language, num_params
from ddpcomm.bench._worker_collectives import Unavailable, make_hook


def _counting(hook, method: str, world: int, counter: list):
    """Wraps a torch hook to add each bucket's formula bytes to ``counter[0]``.

    torch's hooks keep no byte counts; the formula (collectives.formula_bytes) is the
    same one the collectives table uses. functools.wraps keeps the annotations DDP
    checks at registration.
    """
    from ddpcomm.bench.collectives import formula_bytes

    @functools.wraps(hook)
    def wrapper(state, bucket):
        shapes = [tuple(g.shape) for g in bucket.gradients()]
        counter[0] += formula_bytes(method, shapes, world)
        return hook(state, bucket)

    return wrapper


def run_case(case: dict, common: dict, device: torch.device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    method = case["method"]
    cfg = GPTConfig(**case["model"])
    steps, warm = case["steps"], case["warmup_steps"]
    result = {"method": method, "world": world, "steps": steps}

    torch.manual_seed(case["seed"])  # the same initial weights on every rank and method
    model = GPT(cfg).to(device)
    counter = [0]
    stats_of = None
    if method == "nocomm":
        net = model  # compute alone: no gradient exchange (each rank trains its own copy)
    else:
        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if method != "ddp":
            try:
                hook, state, _ = make_hook(method, dist.group.WORLD)
            except Unavailable as exc:
                result.update(status="unavailable", reason=str(exc))
                return result
            if method.startswith(("q", "topk", "randk")):
                stats_of, reset_stats = state.stats, state.reset_stats
            else:
                hook = _counting(hook, method, world, counter)
            net.register_comm_hook(state, hook)
    opt = torch.optim.AdamW(model.parameters(), lr=case["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    # Linear warm-up over the first 10 steps: Adam's first steps on a fresh transformer
    # are large enough to swamp any difference between methods.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    lang = Language(cfg.vocab, seed=case["seed"])

    losses, times = [], []
    tx0 = sent0 = None
    last_note = time.perf_counter()
    for step in range(steps):
        if step == warm:
            # Counters cover the timed steps only (DDP rebuilds its buckets after step 1).
            tx0 = _worker.tx_bytes(common.get("ifname"))
            sent0 = counter[0]
            if stats_of:
                reset_stats()
        x, y = lang.batch(case["batch"], cfg.seq, seed=(step * 1000 + rank) * 7919 + 17)
        x, y = x.to(device), y.to(device)
        _worker.sync(device)
        t0 = time.perf_counter()
        loss = net(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        _worker.sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"loss is {losses[-1]} at step {step}")
        # A progress line (and watchdog heartbeat) every 5 s and at the end.
        if time.perf_counter() - last_note > 5 or step + 1 == steps:
            last_note = time.perf_counter()
            _worker.note(
                f"  {method}: step {step + 1}/{steps}  loss {losses[-1]:.3f}  "
                f"{times[-1] * 1e3:.0f} ms/step"
            )
    dist.barrier()
    tx1 = _worker.tx_bytes(common.get("ifname"))
    # Held-out loss on one fixed batch, the same for every method and rank: a far less
    # noisy end point than the last training losses (128 tokens per rank per step).
    ex, ey = lang.batch(case["eval_batch"], cfg.seq, seed=999_999_937)
    with torch.no_grad():
        eval_loss = model(ex.to(device), ey.to(device)).item()
    measured = steps - warm

    # Loss curve: mean over ranks per step. Step time: the slowest rank's.
    gathered = [None] * world
    dist.all_gather_object(gathered, (losses, times, eval_loss))
    curve = [statistics.fmean(g[0][i] for g in gathered) for i in range(steps)]
    step_times = [max(g[1][i] for g in gathered) for i in range(steps)]
    timed = step_times[warm:]
    result.update(
        status="ok",
        loss=curve,
        step_times_s=step_times,
        median_step_s=statistics.median(timed),
        mean_step_s=statistics.fmean(timed),
        params=num_params(model),
        eval_loss=statistics.fmean(g[2] for g in gathered),
    )
    if tx1 is not None:
        result["wire_bytes_per_step"] = (tx1 - tx0) / measured
    if stats_of:
        st = stats_of()
        result["bytes_per_step"] = st["bytes_sent"] / measured
        result["compress_s_per_step"] = st["compress_seconds"] / measured
        result["paths"] = st["paths"]
    elif method == "ddp":
        result["bytes_per_step"] = 2 * (world - 1) / world * 4 * num_params(model)
    elif method == "nocomm":
        result["bytes_per_step"] = 0
    else:
        result["bytes_per_step"] = (counter[0] - sent0) / measured
    # Are the replicas still identical? (They must be for every DDP method.)
    if method != "nocomm":
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
        probe = torch.stack([flat.sum(), (flat * flat).sum()])
        probes = [torch.empty_like(probe) for _ in range(world)]
        dist.all_gather(probes, probe)
        result["replicas_identical"] = all(torch.equal(p, probes[0]) for p in probes)
    return result


if __name__ == "__main__":
    _worker.run(run_case)
