"""A rank of ``python -m ddpcomm.bench collectives``: runs each (method, size) case.

Started by the parent (``_launch.run_group``) as ``python -m ddpcomm.bench._worker_collectives``,
possibly under ``ip netns exec``.
"""

from __future__ import annotations

import math
import os
import statistics
import time

import torch
import torch.distributed as dist

from ddpcomm.bench import _worker


class BenchBucket:
    """The GradBucket methods torch's and ddpcomm's hooks call, over one flat buffer.

    ``gradients()`` are views of ``buffer()`` shaped like the parameters, exactly as in a
    DDP bucket. ``parameters()`` are placeholders with those shapes: hooks use them only
    as identities (ddpcomm keys its per-model state and residual layout on them).
    """

    def __init__(self, buffer: torch.Tensor, shapes: list[tuple[int, ...]], index: int = 0):
        self._buffer = buffer
        self._index = index
        self._grads, self._params, offset = [], [], 0
        for shape in shapes:
            n = math.prod(shape)
            self._grads.append(buffer[offset : offset + n].view(shape))
            self._params.append(torch.nn.Parameter(torch.empty(0)))
            offset += n

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        # One bucket per step: every call ends an iteration (PowerSGD counts them).
        return True

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)


class Unavailable(Exception):
    """The method is not in this build of ddpcomm (the row says so)."""


def make_hook(method: str, group: dist.ProcessGroup):
    """(hook, state, activation calls): calls before the hook runs the compressed path."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as qh

    if method == "allreduce":
        return dh.allreduce_hook, group, 0
    if method == "torch-fp16":
        return dh.fp16_compress_hook, group, 0
    if method == "torch-qpt":
        return qh.quantization_pertensor_hook, group, 0
    if method.startswith(("powersgd-r", "bpowersgd-r")):
        rank = int(method.rsplit("r", 1)[1])
        # start_powerSGD_iter=2 is the smallest torch accepts with error feedback and warm
        # start (both on, as by default); two activation calls make compression active.
        state = ps.PowerSGDState(group, matrix_approximation_rank=rank, start_powerSGD_iter=2)
        hook = ps.powerSGD_hook if method.startswith("p") else ps.batched_powerSGD_hook
        return hook, state, 2
    import ddpcomm

    if method[0] == "q" and method[1:].isdigit():
        return (
            ddpcomm.quantize_hook,
            ddpcomm.QuantizeState(bits=int(method[1:]), process_group=group),
            0,
        )
    kind, ratio = method.split(":")
    names = {"topk": ("TopKState", "topk_hook"), "randk": ("RandomKState", "randomk_hook")}
    state_name, hook_name = names[kind]
    if not hasattr(ddpcomm, state_name) or not hasattr(ddpcomm, hook_name):
        raise Unavailable(f"not available in this build (no ddpcomm.{hook_name})")
    state = getattr(ddpcomm, state_name)(ratio=float(ratio), process_group=group)
    return getattr(ddpcomm, hook_name), state, 0


def make_grad(shapes, rank: int, seed: int, device) -> torch.Tensor:
    """Rank ``rank``'s gradient: per-matrix scale x (shared low-rank signal + rank noise).

    Real gradients differ by orders of magnitude between layers, agree partly across
    ranks (same loss, different minibatches), and a linear layer's gradient (a sum of
    per-token outer products) has a fast-decaying spectrum. The signal here is a sum of
    8 rank-1 terms with weights 1, 1/2, 1/4, ...; each rank adds noise of relative size
    0.3. Low-rank methods (PowerSGD) and sparsifiers see the structure they exploit in
    training, rather than white noise that no compressor can shrink.
    """
    parts = []
    for i, shape in enumerate(shapes):
        g_shared = torch.Generator().manual_seed(seed * 1_000_003 + i)
        g_rank = torch.Generator().manual_seed((seed * 1_000_003 + i) * 131 + rank + 1)
        scale = 10 ** (-2 * torch.rand((), generator=g_shared).item())
        if len(shape) == 2:
            m, n = shape
            weights = 0.5 ** torch.arange(8.0)
            u = torch.randn(m, 8, generator=g_shared) * weights
            v = torch.randn(8, n, generator=g_shared)
            t = (u @ v).div_(math.sqrt(float((weights**2).sum())))
        else:
            t = torch.randn(shape, generator=g_shared)
        t.add_(torch.randn(shape, generator=g_rank), alpha=0.3).mul_(scale)
        parts.append(t.reshape(-1))
    return torch.cat(parts).to(device) if parts else torch.empty(0, device=device)


def exact_mean(shapes, world: int, seed: int, device) -> torch.Tensor:
    total = make_grad(shapes, 0, seed, device)
    for r in range(1, world):
        total += make_grad(shapes, r, seed, device)
    return total / world


def _value(fut) -> torch.Tensor:
    v = fut.wait()
    return v[0] if isinstance(v, (list, tuple)) else v


_exact_cache: dict = {}


def run_case(case: dict, common: dict, device: torch.device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    shapes = [tuple(s) for s in case["shapes"]]
    seed = 1234
    result = {k: case[k] for k in ("method", "world", "size_mib", "numel", "formula_bytes")}
    try:
        hook, state, activation = make_hook(case["method"], group)
    except Unavailable as exc:
        result.update(status="unavailable", reason=str(exc))
        return result
    grad = make_grad(shapes, rank, seed, device)
    bucket = BenchBucket(grad.clone(), shapes)
    stats_of = getattr(state, "stats", None)

    times, out = [], None
    total = activation + case["warmup"] + case["iters"]
    for i in range(total):
        timed = i >= activation + case["warmup"]
        if timed and i == activation + case["warmup"]:
            # Counters start at the first timed call (after warm-up).
            tx0 = _worker.tx_bytes(common.get("ifname"))
            st0 = stats_of() if stats_of else None
        bucket.buffer().copy_(grad)  # hooks write the mean into the bucket in place
        dist.barrier()
        _worker.sync(device)
        t0 = time.perf_counter()
        out = _value(hook(state, bucket))
        _worker.sync(device)
        if timed:
            times.append(time.perf_counter() - t0)
    dist.barrier()  # every rank's last send has left before the counters are read
    tx1 = _worker.tx_bytes(common.get("ifname"))

    # The slowest rank's time per repetition is the collective's time.
    all_times = [None] * world
    dist.all_gather_object(all_times, times)
    per_rep = [max(ts[i] for ts in all_times) for i in range(len(times))]
    result["median_s"] = statistics.median(per_rep)
    result["times_s"] = per_rep
    if tx1 is not None:
        result["wire_bytes"] = (tx1 - tx0) / case["iters"]
    if stats_of:
        # ddpcomm's own accounting: bytes handed to collectives and host time spent in
        # (de)compression ops, both per call.
        st1 = stats_of()
        result["measured_bytes"] = (st1["bytes_sent"] - st0["bytes_sent"]) / case["iters"]
        result["compress_s"] = (st1["compress_seconds"] - st0["compress_seconds"]) / case["iters"]

    # Do all ranks hold the same result? Hash-free check: compare a checksum vector.
    probe = torch.stack([out.double().sum(), (out.double() ** 2).sum()]).to(device)
    probes = [torch.empty_like(probe) for _ in range(world)]
    dist.all_gather(probes, probe)
    result["ranks_identical"] = all(torch.equal(p, probes[0]) for p in probes)
    if rank == 0:
        key = (tuple(shapes), world)
        if key not in _exact_cache:
            _exact_cache.clear()  # one size at a time: up to 256 MiB each
            _exact_cache[key] = exact_mean(shapes, world, seed, device)
        exact = _exact_cache[key]
        diff = (out.float().reshape(-1) - exact).norm().item()
        result["rel_error"] = diff / max(exact.norm().item(), 1e-30)
    result["status"] = "ok"
    return result


def run_under_torchrun(args) -> int:
    """``collectives`` under torchrun: every rank runs the sweep in-process."""
    from ddpcomm.bench import _report
    from ddpcomm.bench.collectives import build_cases

    world = int(os.environ["WORLD_SIZE"])
    cases = build_cases(args, world)
    rank, world, rows = _worker.run_inline(cases, {"pg_timeout": args.timeout or 600}, run_case)
    if rank == 0:
        env = _report.environment()
        env["link"] = f"torchrun, {dist.get_backend()}, {world} ranks"
        if args.json:
            _report.write_json(
                args.json, {"command": "collectives", "environment": env, "rows": rows}
            )
        _report.print_collectives(rows, env)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    _worker.run(run_case)
