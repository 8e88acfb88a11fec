"""``python -m ddpcomm.bench coalesced``: many small all_reduces, and the fused flatten."""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import ddpcomm
from ddpcomm.bench import _ranks, kernels
from ddpcomm.bench._util import environment, finish, machine_line, short, table, wall

DESCRIPTION = """\
Reduces --tensors fp32 tensors of mixed small sizes (log-uniform in 1..--max-numel
elements) with op=SUM on --world spawned gloo ranks, three ways: one dist.all_reduce per
tensor; torch's _flatten_dense_tensors + one all_reduce + unflatten + copy back; and
ddpcomm.all_reduce_coalesced. The three take turns, each call after a barrier; the
median of the slowest rank's times is reported. Then, in this process, the native
flatten and unflatten ops on --flatten-mb MB in --flatten-count tensors, against torch's
own and a copy of the same bytes."""

VARIANTS = {
    "per_tensor": "one dist.all_reduce per tensor",
    "torch_flatten": "torch _flatten_dense_tensors + all_reduce + copy back",
    "ddpcomm": "ddpcomm.all_reduce_coalesced",
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "coalesced",
        help="all_reduce_coalesced of many small tensors vs per-tensor and torch's flatten",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--world", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--tensors", type=int, default=200, help="tensors per call (default 200)")
    p.add_argument(
        "--max-numel", type=int, default=4096, help="largest tensor, elements (default 4096)"
    )
    p.add_argument("--reps", type=int, default=30, help="timed calls per variant (default 30)")
    p.add_argument("--flatten-mb", type=int, default=64, help="MB flattened (default 64)")
    p.add_argument(
        "--flatten-count", type=int, default=1000, help="tensors flattened (default 1000)"
    )
    p.add_argument("--threads", type=int, default=2, help="CPU threads for flatten (default 2)")
    p.add_argument("--out", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument(
        "--quick",
        action="store_true",
        help="20 tensors, 5 calls, 4 MB flatten: checks that it runs",
    )
    p.set_defaults(func=run)


def _small_tensors(n: int, max_numel: int, rank: int) -> list[torch.Tensor]:
    """The same log-uniform sizes on every rank (collectives must match), rank's values."""
    sizes = (
        torch.rand(n, generator=torch.Generator().manual_seed(0)) * torch.tensor(max_numel).log()
    )
    g = torch.Generator().manual_seed(1 + rank)
    return [torch.randn(max(1, int(s)), generator=g) for s in sizes.exp()]


def run_case(case: dict, common: dict, device: torch.device) -> dict:
    tensors = _small_tensors(case["tensors"], case["max_numel"], dist.get_rank())

    def torch_flatten():
        flat = _flatten_dense_tensors(tensors)
        dist.all_reduce(flat)
        for t, v in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
            t.copy_(v)

    variants = {
        "per_tensor": lambda: [dist.all_reduce(t) for t in tensors],
        "torch_flatten": torch_flatten,
        "ddpcomm": lambda: ddpcomm.all_reduce_coalesced(tensors, op="sum"),
    }
    times = {name: [] for name in variants}
    for fn in variants.values():
        fn()  # warm-up: first-call allocations, gloo connections
    names = list(variants)
    for rep in range(case["reps"]):  # in turn, from a different one each time
        for name in names[rep % 3 :] + names[: rep % 3]:
            dist.barrier()
            times[name].append(wall(variants[name])[1])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, times)
    slowest = {
        name: [max(t[name][i] for t in every) for i in range(case["reps"])] for name in names
    }
    return dict(
        case["row"], status="ok", ms={k: 1e3 * statistics.median(v) for k, v in slowest.items()}
    )


def run(args) -> int:
    if args.quick:
        args.tensors, args.reps, args.flatten_mb, args.flatten_count = 20, 5, 4, 100
    values = (
        args.world,
        args.tensors,
        args.max_numel,
        args.reps,
        args.flatten_mb,
        args.flatten_count,
    )
    if min(values) < 1:
        raise SystemExit(
            "--world, --tensors, --max-numel, --reps, --flatten-mb, --flatten-count must be >= 1"
        )
    env = dict(environment(), threads=args.threads)
    keys = ("tensors", "max_numel", "reps")
    world = _ranks.world_size(args.world)
    case = {
        "label": "all_reduce of small tensors",
        "row": {"world": world},
        **{k: getattr(args, k) for k in keys},
    }
    rows = _ranks.run_cases(
        "ddpcomm.bench.coalesced:run_case", [case], world, env, common={"threads": 1}
    )
    if rows is None:
        return 0
    torch.set_num_threads(args.threads)
    specs = [f"{op}:{args.flatten_count}" for op in ("flatten", "flatten_out", "unflatten")]
    flatten = kernels.measure(specs, [args.flatten_mb], "cpu", rounds=1 if args.quick else 3)
    result = {
        "command": "coalesced",
        "environment": env,
        "args": {k: getattr(args, k) for k in keys},
        "rows": rows,
        "flatten": flatten,
    }
    finish(result, report, args.out)
    return 0


def report(result: dict, markdown: bool = False) -> str:
    env, a, (row,) = result["environment"], result["args"], result["rows"]
    lines = [f"machine: {machine_line(env)}", ""]
    lines.append(
        f"{a['tensors']} fp32 tensors of 1..{a['max_numel']} elements, all_reduce SUM on "
        f"{row['world']} gloo ranks, median of {a['reps']} calls:"
    )
    if row["status"] == "ok":
        ms = row["ms"]
        body = [[VARIANTS[k], f"{v:.3f}", f"{v / ms['ddpcomm']:.2f}x"] for k, v in ms.items()]
        lines.append(table(["variant", "ms", "ddpcomm faster by"], body, markdown))
    else:
        lines.append(f"{row['status']}: {short(row.get('reason', ''))}")
    lines += [
        "",
        f"flatten in this process, {env['threads']} threads:",
        kernels.op_table(result["flatten"], markdown),
    ]
    return "\n".join(lines)
