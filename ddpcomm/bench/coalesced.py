"""``python -m ddpcomm.bench coalesced``: many small all_reduces, and the fused flatten.

Two measurements, side by side in one run:

1. On ``--world`` spawned gloo ranks (CPU), reducing ``--tensors`` fp32 tensors of mixed
   small sizes: ``ddpcomm.all_reduce_coalesced`` against one ``dist.all_reduce`` per tensor
   and against torch's ``_flatten_dense_tensors`` + one all_reduce + unflatten + copy back.
   Every variant reduces with op=SUM; ranks meet at a barrier before each timed call, and
   rank 0 reports medians.
2. In this process: the native ``flatten`` against torch's ``_flatten_dense_tensors`` on
   ``--flatten-mb`` MB in ``--flatten-count`` tensors, the write back (``unflatten_into``
   against torch's unflatten + a copy per tensor), and a single memcpy of the same bytes,
   the memory-bandwidth limit.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ddpcomm.bench._spawn import spawn


def add_parser(sub) -> None:
    p = sub.add_parser(
        "coalesced",
        help=__doc__.splitlines()[0],
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--world", type=int, default=2, help="gloo ranks to spawn (default 2)")
    p.add_argument("--tensors", type=int, default=200, help="tensors per call (default 200)")
    p.add_argument(
        "--max-numel",
        type=int,
        default=4096,
        help="sizes are log-uniform in [1, max-numel] elements (default 4096)",
    )
    p.add_argument("--reps", type=int, default=30, help="timed calls per variant (default 30)")
    p.add_argument("--flatten-mb", type=int, default=64, help="flatten benchmark size in MB")
    p.add_argument("--flatten-count", type=int, default=1000, help="tensors in it")
    p.set_defaults(func=run)


def _medians_ms(variants: dict, reps: int, sync=None) -> dict:
    """Median milliseconds of each variant, timed round-robin: rep r runs every variant
    once, starting from a different one each rep, so load from other processes on the
    machine lands on all variants alike instead of on whichever ran during it."""
    names = list(variants)
    for fn in variants.values():
        fn()  # warm-up: first-call allocations, gloo connections
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(times[name]) for name in names}


def _small_tensors(n: int, max_numel: int, rank: int) -> list[torch.Tensor]:
    """The same log-uniform sizes on every rank (collectives must match), rank's values."""
    sizes = torch.rand(n, generator=torch.Generator().manual_seed(0))
    sizes = torch.exp(sizes * torch.log(torch.tensor(float(max_numel))))
    g = torch.Generator().manual_seed(1 + rank)
    return [torch.randn(max(1, int(s)), generator=g) for s in sizes]


def _rank(rank: int, world: int, args) -> dict:
    import ddpcomm

    tensors = _small_tensors(args.tensors, args.max_numel, rank)

    def per_tensor():
        for t in tensors:
            dist.all_reduce(t)

    def torch_flat():
        flat = _flatten_dense_tensors(tensors)
        dist.all_reduce(flat)
        for t, v in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
            t.copy_(v)

    def fused():
        ddpcomm.all_reduce_coalesced(tensors, op="sum")

    variants = {"per_tensor": per_tensor, "torch_flatten": torch_flat, "ddpcomm": fused}
    return _medians_ms(variants, args.reps, dist.barrier)


def _flatten_rows(args) -> dict:
    from ddpcomm import ops

    numel = args.flatten_mb * 2**20 // 4
    each = numel // args.flatten_count
    tensors = [torch.randn(each) for _ in range(args.flatten_count)]
    total = each * args.flatten_count
    out, src = torch.empty(total), torch.randn(total)
    targets = [torch.empty_like(t) for t in tensors]

    def torch_unflatten():
        for t, v in zip(targets, _unflatten_dense_tensors(out, targets), strict=True):
            t.copy_(v)

    variants = {
        "torch _flatten_dense_tensors": lambda: _flatten_dense_tensors(tensors),
        "ddpcomm flatten (new buffer)": lambda: ops.flatten(tensors),
        "ddpcomm flatten (into out)": lambda: ops.flatten(tensors, out=out),
        "torch unflatten + copy_": torch_unflatten,
        "ddpcomm unflatten_into": lambda: ops.unflatten_into(out, targets),
        "memcpy limit (one copy_)": lambda: out.copy_(src),
    }
    return _medians_ms(variants, max(5, args.reps // 3)), total * 4


def run(args) -> int:
    if args.world < 1 or args.tensors < 1 or args.max_numel < 1 or args.reps < 1:
        raise ValueError("--world, --tensors, --max-numel and --reps must be >= 1")
    if args.flatten_mb < 1 or args.flatten_count < 1:
        raise ValueError("--flatten-mb and --flatten-count must be >= 1")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads in this process")

    # One intra-op thread per rank: the ranks share the machine's cores.
    row = spawn(_rank, args.world, args, threads=1)[0]
    print(
        f"\n{args.tensors} fp32 tensors of 1..{args.max_numel} elements, all_reduce SUM "
        f"on {args.world} gloo ranks (median of {args.reps}, ms):"
    )
    for name, ms in row.items():
        print(f"  {name:<16} {ms:9.3f}   ddpcomm is {ms / row['ddpcomm']:5.2f}x faster")

    flat, nbytes = _flatten_rows(args)
    print(f"\nflatten {nbytes / 2**20:.0f} MB in {args.flatten_count} tensors (median, ms):")
    base = flat["torch _flatten_dense_tensors"]
    limit = flat["memcpy limit (one copy_)"]
    for name, ms in flat.items():
        print(
            f"  {name:<30} {ms:8.2f}   {nbytes / ms / 1e6:6.1f} GB/s   "
            f"{base / ms:5.2f}x torch flatten   {limit / ms:5.2f}x of memcpy speed"
        )
    return 0
