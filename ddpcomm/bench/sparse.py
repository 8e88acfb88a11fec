"""``python -m ddpcomm.bench sparse``: top-k / random-k selection speed and wire bytes.

Side by side in one run, on the same input and thread count:
- exact top-k (ddpcomm::topk_compress) at a density against ``torch.topk`` on |x| plus the
  gather of the signed values (what Python top-k compressors run), next to a plain read
  of the same bytes (the memory limit for a selection that must look at every entry);
- approximate against exact: time, and the share of the exact top-k's L2 mass and index
  set the approximate selection keeps;
- the same with error feedback (the residual read, updated and written back);
- bytes per rank of topk:R and randk:R at N = 2, 3, 4 next to the dense all_reduce's.
"""

from __future__ import annotations

import statistics
import time

import torch

from ddpcomm import ops
from ddpcomm.compressors import dense_bytes, parse

MB = 1 << 20


def _time(fn, repeats: int) -> float:
    """Fastest of ``repeats`` runs after one warm-up call, in seconds. The minimum, not the
    median: on a shared machine a run that loses one of its threads to another process
    waits at every parallel barrier, and those outliers say nothing about the kernel."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _torch_topk(x: torch.Tensor, k: int):
    idx = torch.topk(x.abs(), k, sorted=False).indices
    return idx, x[idx]


def _split(payload: torch.Tensor, k: int):
    return payload[: 4 * k].view(torch.int32).long(), payload[4 * k :].view(torch.float32)


def selection_rows(numel: int, ratio: float, repeats: int, torch_repeats: int) -> dict:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    k = parse(f"topk:{ratio}").k(numel)
    residual = torch.zeros(numel)
    out = torch.empty_like(x)
    t_read = _time(lambda: torch.sum(x), repeats)
    t_copy = _time(lambda: out.copy_(x), repeats)
    t_torch = _time(lambda: _torch_topk(x, k), torch_repeats)
    t_exact = _time(lambda: ops.topk_compress(x, None, k), repeats)
    t_approx = _time(lambda: ops.topk_compress(x, None, k, True, 1, 2), repeats)
    t_exact_ef = _time(lambda: ops.topk_compress(x, residual, k), repeats)
    t_approx_ef = _time(lambda: ops.topk_compress(x, residual, k, True, 1, 2), repeats)

    exact_idx, exact_val = _split(ops.topk_compress(x, None, k), k)
    mass, overlap = [], []
    for step in range(8):  # approximate quality over several sample draws
        idx, val = _split(ops.topk_compress(x, None, k, True, 1, step), k)
        mass.append(float(val.double().pow(2).sum() / exact_val.double().pow(2).sum()))
        overlap.append(len(set(idx.tolist()) & set(exact_idx.tolist())) / k)
    return {
        "numel": numel,
        "k": k,
        "read": t_read,
        "copy": t_copy,
        "torch_topk": t_torch,
        "exact": t_exact,
        "approx": t_approx,
        "exact_ef": t_exact_ef,
        "approx_ef": t_approx_ef,
        "mass_min": min(mass),
        "mass_mean": statistics.mean(mass),
        "overlap_mean": statistics.mean(overlap),
    }


def wire_rows(numel: int, ratio: float) -> list[dict]:
    topk, randk = parse(f"topk:{ratio}"), parse(f"randk:{ratio}")
    rows = []
    for world in (2, 3, 4):
        rows.append(
            {
                "world": world,
                "dense": dense_bytes(numel, world, 4),
                "topk": topk.wire_bytes(numel, world),
                "topk_path": "dense" if topk.use_dense(numel, world) else "all_gather",
                "randk": randk.wire_bytes(numel, world),
            }
        )
    return rows


def run(args) -> int:
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(
        f"ddpcomm sparse on CPU, {torch.get_num_threads()} threads, density {args.ratio}, "
        f"fp32; best of {args.repeats} runs ({args.torch_repeats} for torch.topk)\n"
    )
    head = (
        f"{'elements':>10} {'k':>8} {'read':>7} {'torch.topk':>10} {'exact':>7} "
        f"{'x torch':>7} {'approx':>7} {'exact/approx':>12} {'exact+EF':>8} {'approx+EF':>9}"
    )
    print("times in ms; 'read' is torch.sum over the same input (one pass, the floor)")
    print(head)
    print("-" * len(head))
    rows = [selection_rows(n * MB, args.ratio, args.repeats, args.torch_repeats) for n in sizes]
    for r in rows:
        print(
            f"{r['numel']:>10,} {r['k']:>8,} {1e3 * r['read']:>7.1f} "
            f"{1e3 * r['torch_topk']:>10.1f} {1e3 * r['exact']:>7.1f} "
            f"{r['torch_topk'] / r['exact']:>6.1f}x {1e3 * r['approx']:>7.1f} "
            f"{r['exact'] / r['approx']:>11.2f}x {1e3 * r['exact_ef']:>8.1f} "
            f"{1e3 * r['approx_ef']:>9.1f}"
        )
    print("\napproximate vs exact selection (8 sample draws):")
    for r in rows:
        print(
            f"{r['numel']:>10,}: L2 mass kept {100 * r['mass_mean']:.2f}% of exact "
            f"(worst {100 * r['mass_min']:.2f}%), index overlap {100 * r['overlap_mean']:.1f}%"
        )
    numel = sizes[0] * MB
    print(f"\nbytes per rank, one bucket of {numel:,} fp32 elements, density {args.ratio}")
    head = f"{'N':>2} {'dense all_reduce':>17} {'topk':>12} {'path':>10} {'randk':>12}"
    print(head)
    for r in wire_rows(numel, args.ratio):
        print(
            f"{r['world']:>2} {r['dense']:>17,} {r['topk']:>12,} {r['topk_path']:>10} "
            f"{r['randk']:>12,}"
        )
    print(
        "\ntopk: (N-1) * k * 8 bytes (all_gather of int32 index + fp32 value); randk: "
        "2(N-1)/N * 4k (all_reduce of k fp32 values); dense: 2(N-1)/N * 4n."
    )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("sparse", help="top-k / random-k selection speed and wire bytes")
    p.add_argument("--sizes", default="16,64", help="bucket sizes in Mi elements (fp32)")
    p.add_argument("--ratio", type=float, default=0.01, help="density R of topk:R / randk:R")
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per ddpcomm case")
    p.add_argument("--torch-repeats", type=int, default=3, help="timed runs of torch.topk")
    p.set_defaults(func=run)
