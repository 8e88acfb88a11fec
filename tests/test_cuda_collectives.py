"""Collectives and hooks with CUDA tensors: gloo with 2 ranks sharing one GPU, NCCL with 1.

The CUDA ops give the CPU ops' bits, and the algorithms are deterministic, so a compressed
all-reduce of CUDA tensors must give bitwise the result (and error-feedback residuals) of
the same all-reduce of CPU tensors, step after step. Under DDP (CUDA model, tiny buckets)
every replica must stay bitwise identical and close to DDP's default. Skipped without a
CUDA device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpcomm
from ddpcomm import collectives, compressors
from ddpcomm.context import ReduceContext, ResidualMemory
from tests.cuda_utils import needs_cuda
from tests.dist_utils import run_ranks

pytestmark = needs_cuda

STEPS = 3
# (spec, options): every bit width, both algorithms, error feedback, stochastic rounding;
# top-k (exact, approximate with fp16 values) and random-k with error feedback.
CONFIGS = [
    ("q8", dict(algorithm="all_gather")),
    ("q8", dict(algorithm="two_phase", error_feedback=True)),
    ("q4", dict(algorithm="two_phase", stochastic=True, error_feedback=True, seed=3)),
    ("q2", dict(block_size=64)),
    ("q1", dict(block_size=1024, algorithm="all_gather")),
    ("topk:0.05", dict()),
    ("topk:0.05", dict(approximate=True, value_dtype=torch.float16)),
    ("randk:0.05", dict(seed=5)),
]


def rank_input(rank: int, n: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))


def _compare_devices(rank: int, cuda_group, cpu_group) -> list[str]:
    """Runs every config on CUDA tensors over cuda_group and on CPU tensors over cpu_group;
    returns a description of every mismatch (empty when bitwise equal)."""
    torch.cuda.set_device(0)
    bad = []
    n = 3 * 4096 + 77  # several blocks and chunks, a partial last block
    for spec, opts in CONFIGS:
        comp = compressors.parse(spec, **opts)
        mem_cpu, mem_gpu = ResidualMemory(), ResidualMemory()
        for step in range(STEPS):
            x = rank_input(rank, n, step)
            ctx_cpu = ReduceContext(group=cpu_group, memory=mem_cpu, key=0, step=step)
            ctx_gpu = ReduceContext(group=cuda_group, memory=mem_gpu, key=0, step=step)
            want = collectives.all_reduce_mean(x.clone(), comp, ctx_cpu).wait()
            got = collectives.all_reduce_mean(x.cuda(), comp, ctx_gpu).wait()
            torch.cuda.synchronize()
            if not got.is_cuda or not torch.equal(got.cpu(), want):
                bad.append(f"{spec} {opts} step {step}: result differs")
            for key, buf in mem_cpu.buffers.items():
                other = mem_gpu.buffers.get(key)
                if other is None or not torch.equal(other.cpu(), buf):
                    bad.append(f"{spec} {opts} step {step}: residual {key} differs")
    return bad


def check_gloo(rank, world):
    return _compare_devices(rank, None, None)


def check_nccl(rank, world):
    nccl = dist.new_group(backend="nccl")
    try:
        return _compare_devices(rank, nccl, None)
    finally:
        dist.destroy_process_group(nccl)


def test_cuda_all_reduce_matches_cpu_on_gloo_two_ranks_one_gpu():
    for rank, bad in enumerate(run_ranks(check_gloo, 2)):
        assert bad == [], f"rank {rank}: {bad}"


def test_cuda_all_reduce_matches_cpu_on_nccl_one_rank():
    assert run_ranks(check_nccl, 1) == [[]]


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)
    )


def train(rank, state, hook, steps=20):
    model = make_model().cuda()
    ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.01)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(7919 * step + rank)
        x = torch.randn(32, 32, generator=g).cuda()
        loss = nn.functional.mse_loss(ddp(x), torch.sin(x[:, :8] * 2.0))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def check_ddp(rank, world):
    torch.cuda.set_device(0)
    ref = train(rank, None, None)
    out = {}
    for name, state in (
        ("q8", ddpcomm.QuantizeState(bits=8)),
        ("q4ef", ddpcomm.QuantizeState(bits=4, error_feedback=True)),
        ("default", None),
    ):
        p = train(rank, state, ddpcomm.quantize_hook)
        every = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(every, p)
        out[name] = (
            all(torch.equal(every[0], e) for e in every),
            float((p - ref).norm() / ref.norm()),
        )
    return out


def test_quantize_hook_with_cuda_model_on_gloo():
    for name, (identical, rel) in run_ranks(check_ddp, 2)[0].items():
        assert identical, f"{name}: replicas differ"
        # Same bounds as tests/test_hooks.py's CPU parity (20 steps here, not 50).
        assert 0 < rel < (0.01 if name != "q4ef" else 0.05), (name, rel)


def check_wrappers(rank, world):
    # all_reduce_coalesced flattens with the native flatten ops (CUDA ones here): CUDA
    # tensors must end bitwise where the same call leaves CPU tensors.
    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(rank)
    shapes = [(3, 5), (1000,), (7, 11, 13), (1,), (4097,)]
    bad = []
    for compression in ("none", "q8", "q4", "fp16"):
        cpu = [torch.randn(s, generator=g) for s in shapes]
        cpu.append(torch.randn(9, 6, generator=g).t())  # a strided entry
        gpu = [t.cuda() for t in cpu]
        ddpcomm.all_reduce_coalesced(cpu, compression=compression)
        ddpcomm.all_reduce_coalesced(gpu, compression=compression)
        if not all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu, strict=True)):
            bad.append(compression)
    return bad


def test_all_reduce_coalesced_with_cuda_tensors_on_gloo():
    for rank, bad in enumerate(run_ranks(check_wrappers, 2)):
        assert bad == [], f"rank {rank}: CUDA differs from CPU for {bad}"


# --------------------------------------------------------------------------------------
# CUDA futures and streams (DESIGN.md §8): no host sync in the hot path, and a waiter on
# the returned Future sees the last kernel's output even when that kernel is slow.
# --------------------------------------------------------------------------------------

# One config per algorithm, error feedback on where it has a residual to reset.
HOT_PATHS = [
    ("q8", dict(algorithm="all_gather", error_feedback=True)),
    ("q4", dict(algorithm="two_phase", error_feedback=True)),
    ("topk:0.05", dict()),
    ("topk:0.9", dict()),  # the dense switch
    ("randk:0.05", dict()),
    ("fp16", dict()),
]


def check_no_host_sync(rank, world):
    torch.cuda.set_device(0)
    nccl = dist.new_group(backend="nccl")
    bad = []
    try:
        for spec, opts in HOT_PATHS:
            comp = compressors.parse(spec, **opts)
            ctx = ReduceContext(group=nccl, memory=ResidualMemory(), key=0)
            xs = [rank_input(rank, 3 * 4096 + 77, s).cuda() for s in range(2)]
            collectives.all_reduce_mean(xs[0], comp, ctx).wait()  # buffers allocated
            torch.cuda.synchronize()
            ctx.step = 1
            torch.cuda.set_sync_debug_mode("error")
            try:
                collectives.all_reduce_mean(xs[1], comp, ctx).wait()
            except RuntimeError as exc:
                bad.append(f"{spec}: {exc}")
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    finally:
        dist.destroy_process_group(nccl)
    return bad


def test_no_host_sync_in_any_algorithm_on_nccl():
    assert run_ranks(check_no_host_sync, 1) == [[]]


# The op each algorithm's last kernel comes from (collectives calls them as ops.<name>).
LAST_OPS = {"q8": "dequantize_sum", "q4": "dequantize", "topk:0.05": "sparse_accumulate"}
LAST_OPS.update({"topk:0.9": "sparse_accumulate", "randk:0.05": "randk_decompress"})


def check_slow_last_kernel(rank, world, backend):
    """Delays the algorithm's last kernel by ~50 ms on its stream; reading the result on
    the caller's stream right after Future.wait() must still see the final values."""
    from ddpcomm import ops

    torch.cuda.set_device(0)
    group = dist.new_group(backend=backend) if backend == "nccl" else None
    bad = []
    for spec, opts in HOT_PATHS:
        name = LAST_OPS.get(spec)
        if name is None:
            continue
        comp = compressors.parse(spec, **opts)
        x = rank_input(rank, 3 * 4096 + 77, 0)
        want = collectives.all_reduce_mean(
            x.clone(), comp, ReduceContext(group=None, memory=ResidualMemory())
        ).wait()
        real = getattr(ops, name)

        def slow(*args, real=real, **kwargs):
            torch.cuda._sleep(100_000_000)  # ~50 ms of spinning on the current stream
            return real(*args, **kwargs)

        setattr(ops, name, slow)
        try:
            ctx = ReduceContext(group=group, memory=ResidualMemory())
            out = collectives.all_reduce_mean(x.cuda(), comp, ctx).wait()
            seen = out.clone()  # on the caller's stream, no synchronize before it
        finally:
            setattr(ops, name, real)
        torch.cuda.synchronize()
        if not torch.equal(seen.cpu(), want):
            bad.append(spec)
    if group is not None:
        dist.destroy_process_group(group)
    return bad


def test_future_orders_waiter_after_last_kernel_nccl():
    assert run_ranks(check_slow_last_kernel, 1, "nccl") == [[]]


def test_future_orders_waiter_after_last_kernel_gloo_two_ranks():
    assert run_ranks(check_slow_last_kernel, 2, "gloo") == [[], []]
