"""``python -m ddpcomm.bench sparse``: top-k and random-k speed, quality and bytes."""

from __future__ import annotations

import argparse

import torch

import ddpcomm
from ddpcomm import ops
from ddpcomm.bench import _methods, kernels
from ddpcomm.bench._util import environment, finish, machine_line, table

DESCRIPTION = """\
Times ddpcomm's top-k (exact and approximate) and random-k selection with error feedback,
as the hooks run them, and the scatter-add that sums N top-k payloads, next to a copy of
the same bytes, the pure-torch reference, and torch.topk of |e| + gather (what Python
top-k compressors run). Then: the share of the exact top-k's L2 mass and index set that
the approximate selection keeps, and the bytes a rank sends per bucket at N = 2, 3, 4."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sparse",
        help="top-k / random-k selection speed against torch.topk; approximate quality; bytes",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kernels.add_arguments(p, "64,256: 16 Mi and 64 Mi elements")
    p.add_argument("--ratio", type=float, default=0.01, help="density R of topk:R (default 0.01)")
    p.add_argument(
        "--draws", type=int, default=8, help="sample draws of approximate top-k (default 8)"
    )
    p.add_argument(
        "--quick", action="store_true", help="4 MB, one short round, 2 draws: checks that it runs"
    )
    p.set_defaults(func=run)


def run(args) -> int:
    kernels.check_device(args)
    if not 0 < args.ratio <= 1 or args.draws < 1:
        raise SystemExit(
            f"--ratio must be in (0, 1] and --draws >= 1, got {args.ratio}, {args.draws}"
        )
    sizes, rounds, min_time = args.sizes or [64, 256], args.rounds, 0.2
    if args.quick:
        sizes, rounds, min_time, args.draws = [4], 1, 0.02, 2
    specs = [f"{op}:{args.ratio}" for op in ("topk", "topk_approx", "randk", "sparse_accumulate")]
    rows = kernels.measure(
        specs, sizes, args.device, world=args.world, rounds=rounds, min_run_time=min_time
    )
    quality = [_quality(s * 2**20 // 4, args.ratio, args.device, args.draws) for s in sizes]
    n = sizes[0] * 2**20 // 4
    env = dict(environment(), threads=torch.get_num_threads(), world=args.world)
    result = {
        "command": "sparse",
        "environment": env,
        "rows": rows,
        "quality": quality,
        "bytes": _bytes(n, args.ratio),
    }
    finish(result, report, args.out)
    return 0


def _quality(n: int, ratio: float, device: str, draws: int) -> dict:
    """How close approximate top-k comes to exact over ``draws`` sample draws."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    k = max(1, ddpcomm.parse_compression(f"topk:{ratio}").k(n))

    def split(payload):  # k int32 indices, then k fp32 values
        return payload[: 4 * k].view(torch.int32), payload[4 * k :].view(torch.float32)

    idx, val = split(ops.topk_compress(x, None, k))
    mass, overlap = [], []
    for draw in range(draws):
        a_idx, a_val = split(ops.topk_compress(x, None, k, True, 1, draw))
        mass.append((a_val.double().square().sum() / val.double().square().sum()).item())
        overlap.append(torch.isin(a_idx, idx).double().mean().item())
    return {
        "numel": n,
        "k": k,
        "mass_mean": sum(mass) / draws,
        "mass_min": min(mass),
        "overlap_mean": sum(overlap) / draws,
    }


def _bytes(n: int, ratio: float) -> list[dict]:
    """Bytes a rank sends for one bucket of ``n`` fp32 elements."""
    topk = ddpcomm.parse_compression(f"topk:{ratio}")
    return [
        {
            "world": w,
            "numel": n,
            "dense": _methods.formula_bytes("allreduce", [(n,)], w),
            "topk": _methods.formula_bytes(f"topk:{ratio}", [(n,)], w),
            "topk_path": "dense" if topk.use_dense(n, w) else "all_gather",
            "randk": _methods.formula_bytes(f"randk:{ratio}", [(n,)], w),
        }
        for w in (2, 3, 4)
    ]


def report(result: dict, markdown: bool = False) -> str:
    env = result["environment"]
    lines = [f"machine: {machine_line(env)}; {env['threads']} threads; N = {env['world']} payloads"]
    lines += [kernels.op_table(result["rows"], markdown), ""]
    q = [
        [
            f"{r['numel']:,}",
            f"{r['k']:,}",
            f"{r['mass_mean']:.2%}",
            f"{r['mass_min']:.2%}",
            f"{r['overlap_mean']:.1%}",
        ]
        for r in result["quality"]
    ]
    lines += [
        table(
            ["elements", "k", "L2 mass kept, mean", "L2 mass kept, worst", "indices shared"],
            q,
            markdown,
        ),
        "",
    ]
    b = [
        [str(r["world"]), f"{r['dense']:,}", f"{r['topk']:,}", f"{r['randk']:,}", r["topk_path"]]
        for r in result["bytes"]
    ]
    lines.append(
        f"bytes a rank sends for one bucket of {result['bytes'][0]['numel']:,} fp32 elements:"
    )
    lines.append(table(["ranks", "dense all_reduce", "topk", "randk", "topk path"], b, markdown))
    return "\n".join(lines)
