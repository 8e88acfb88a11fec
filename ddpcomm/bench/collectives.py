"""``python -m ddpcomm.bench collectives``: one gradient bucket reduced by each method.

Every method is driven the way DDP drives it: ``hook(state, bucket)`` returns a Future
of the mean. The bucket is a ``BenchBucket`` (see ``_worker_collectives``): an object
with the GradBucket methods the hooks call, whose buffer is the message and whose
per-parameter gradients are [rows, 1024] matrix views of it, the shape of a
transformer's linear layers, so PowerSGD sees the matrices it would see in training.
One bucket per message rather than a real DDP model: the message size is then exact,
and the time is the reduction alone, not backward compute overlapped with it.

Each row reports the median over ``--iters`` of the slowest rank's time, the bytes a
rank sends (from the method's formula, as a ring schedule sends them), the bytes its
interface really sent (with ``--link``: TCP/IP headers and barriers included), the
relative error of rank 0's result against the exact fp32 mean, the speedup over plain
all_reduce, and the ideal speedup from bytes alone (plain bytes / method bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os

from ddpcomm.bench import _report
from ddpcomm.bench._launch import progress, run_group
from ddpcomm.bench._worker import under_torchrun
from ddpcomm.bench.netns import open_links, parse_rate

TORCH_METHODS = [
    "allreduce",
    "torch-fp16",
    "torch-qpt",
    "powersgd-r1",
    "powersgd-r4",
    "bpowersgd-r1",
    "bpowersgd-r4",
]
DDPCOMM_METHODS = ["q8", "q4", "q2", "q1", "topk:0.01", "randk:0.01"]
METHODS = TORCH_METHODS + DDPCOMM_METHODS
DESCRIPTIONS = {
    "allreduce": "torch allreduce_hook (DDP's default: fp32 all_reduce, then / N)",
    "torch-fp16": "torch fp16_compress_hook",
    "torch-qpt": "torch quantization_pertensor_hook (uint8 per tensor, all_gather)",
    "powersgd-r1": "torch powerSGD_hook, rank 1",
    "powersgd-r4": "torch powerSGD_hook, rank 4",
    "bpowersgd-r1": "torch batched_powerSGD_hook, rank 1",
    "bpowersgd-r4": "torch batched_powerSGD_hook, rank 4",
}
COLS = 1024  # columns of every gradient matrix in the bucket
MIB = 2**20


def bucket_shapes(numel: int) -> list[tuple[int, ...]]:
    """[1024, 1024] matrices (4 MiB each), then one [rows, 1024], then a 1-D tail."""
    full, rest = divmod(numel, COLS * COLS)
    shapes: list[tuple[int, ...]] = [(COLS, COLS)] * full
    rows, tail = divmod(rest, COLS)
    if rows:
        shapes.append((rows, COLS))
    if tail:
        shapes.append((tail,))
    return shapes


def _ring(world: int, nbytes: float) -> float:
    return 2 * (world - 1) / world * nbytes


def formula_bytes(method: str, shapes: list[tuple[int, ...]], world: int) -> int:
    """Bytes one rank sends for one bucket, from the method's wire format.

    Used for every row, so a method that fails still shows what it would have sent.
    """
    numel = sum(math.prod(s) for s in shapes)
    if method == "allreduce":
        return round(_ring(world, 4 * numel))
    if method == "torch-fp16":
        return round(_ring(world, 2 * numel))
    if method == "torch-qpt":
        # all_gather of (scale, zero point) as 2 fp32, then of the uint8 tensor.
        return (world - 1) * (8 + numel)
    if method.startswith("powersgd-r"):
        r = int(method.rsplit("r", 1)[1])
        # torch's _should_compress: a matrix is compressed when (m + n) r * 2 < m n;
        # the rest goes in one uncompressed all_reduce. P then Q are all_reduced.
        elems = 0
        for s in shapes:
            m, n = (s[0], math.prod(s[1:])) if len(s) > 1 else (0, 0)
            elems += (m + n) * r if len(s) > 1 and (m + n) * r * 2 < m * n else math.prod(s)
        return round(_ring(world, 4 * elems))
    if method.startswith("bpowersgd-r"):
        r = int(method.rsplit("r", 1)[1])
        side = math.ceil(math.sqrt(numel))  # the bucket, zero-padded to a square matrix
        return round(_ring(world, 4 * 2 * side * r))
    if method[0] == "q" and method[1:].isdigit():
        return _ddpcomm_bytes(method, numel, world)
    if method.startswith(("topk:", "randk:")):
        try:
            return _ddpcomm_bytes(method, numel, world)
        except ValueError:
            pass  # spec not in this build: the formula of DESIGN.md section 3
        k = math.ceil(float(method.split(":")[1]) * numel)
        if method.startswith("topk:"):
            return min((world - 1) * k * 8, round(_ring(world, 4 * numel)))
        return round(_ring(world, 4 * k))
    raise ValueError(f"unknown method {method!r}")


def _ddpcomm_bytes(spec: str, numel: int, world: int) -> int:
    import ddpcomm

    return ddpcomm.parse_compression(spec).wire_bytes(numel, world)


def check_method(name: str) -> str:
    if name in METHODS:
        return name
    raise argparse.ArgumentTypeError(
        f"--methods: unknown method {name!r}; choose from {', '.join(METHODS)}"
    )


def _positive_list(kind, arg: str):
    def parse(text: str):
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{arg}: not a comma-separated list of {kind.__name__}: {text!r}"
            ) from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"{arg}: values must be > 0, got {text!r}")
        return values

    return parse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "collectives",
        help="compressed all-reduce of one bucket, every method, sizes x world sizes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sizes",
        type=_positive_list(float, "--sizes"),
        default=[1, 4, 16, 64, 256],
        help="message sizes in MiB (default 1,4,16,64,256)",
    )
    p.add_argument(
        "--world",
        type=_positive_list(int, "--world"),
        default=[2, 4],
        help="world sizes (default 2,4)",
    )
    p.add_argument(
        "--methods",
        type=lambda s: [check_method(m) for m in s.split(",")],
        default=METHODS,
        help=f"comma-separated subset of {','.join(METHODS)}",
    )
    p.add_argument(
        "--link",
        default=None,
        metavar="RATE",
        help="shape each rank's link to RATE (tc units: 1gbit, 10gbit); needs root",
    )
    p.add_argument("--iters", type=int, default=5, help="timed repetitions per case (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions per case")
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds one case may take before it is failed (default: from size and link rate)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write all rows as JSON")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 MiB, 2 ranks, 2 iterations")
    p.set_defaults(func=run)


def _validate(args) -> None:
    if args.iters < 1:
        raise SystemExit(f"--iters must be >= 1, got {args.iters}")
    if args.timeout is not None and not args.timeout > 0:
        raise SystemExit(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {args.warmup}")
    if any(w < 2 for w in args.world):
        raise SystemExit(f"--world: every world size must be >= 2, got {args.world}")
    if args.link is not None:
        try:
            parse_rate(args.link)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None


def run(args) -> int:
    if args.quick:
        args.sizes, args.world, args.iters, args.warmup = [1], [2], 2, 1
    _validate(args)
    if under_torchrun():
        if args.link is not None:
            raise SystemExit(
                "--link cannot be used under torchrun: torchrun's ranks already "
                "run on the network they were launched on"
            )
        from ddpcomm.bench._worker_collectives import run_under_torchrun

        return run_under_torchrun(args)
    rows, env = [], _report.environment()
    env["link_checks"] = []
    for world in args.world:
        links, note = open_links(world, args.link)
        rate = parse_rate(args.link) / 8 if links is not None else None
        with links if links is not None else contextlib.nullcontext():
            env["link"] = links.describe() if links is not None else note
            env.setdefault("links", {})[world] = env["link"]
            progress(f"world {world}: {env['link']}")
            rows += sweep(args, world, links, rate, env)
    # JSON first: the measurements survive even if printing fails.
    if args.json:
        _report.write_json(args.json, {"command": "collectives", "environment": env, "rows": rows})
    _report.print_collectives(rows, env)
    return 0


def build_cases(args, world: int) -> list[dict]:
    """One case per (message size, method) for ``world`` ranks."""
    cases = []
    for size in args.sizes:
        numel = int(size * MIB) // 4
        shapes = bucket_shapes(numel)
        for method in args.methods:
            cases.append(
                {
                    "method": method,
                    "world": world,
                    "size_mib": size,
                    "numel": numel,
                    "shapes": shapes,
                    "iters": args.iters,
                    "warmup": args.warmup,
                    "formula_bytes": formula_bytes(method, shapes, world),
                    "label": f"world {world}  {size:g} MiB  {method}",
                }
            )
    return cases


def sweep(args, world: int, links, rate_Bps: float | None, env: dict) -> list[dict]:
    """All cases of one world size, restarting the group after each failed case."""
    cases = build_cases(args, world)

    # Assume 100 MB/s on loopback for the limit: generous for CPU gloo on a loaded machine.
    speed = rate_Bps or 100e6

    def case_timeout(case) -> float:
        if args.timeout:
            return args.timeout
        plain = _ring(world, case["numel"] * 4)
        return 60 + 10 * (case["iters"] + case["warmup"] + 3) * plain / speed

    threads = max(1, (os.cpu_count() or 1) // world)
    common = {
        "pg_timeout": max(case_timeout(c) for c in cases),
        "threads": threads,
        "ifname": links.ifname if links is not None else None,
        "link_check_mb": (8 if args.quick else 64) if links is not None else 0,
    }
    rows, failed_methods = [], {}
    while cases:
        outcome = run_group(
            "ddpcomm.bench._worker_collectives", world, links, cases, common, case_timeout, threads
        )
        common["link_check_mb"] = 0  # once per world size is enough
        env["link_checks"] += [dict(i, world=world) for i in outcome.info]
        rows += outcome.results
        if outcome.teardown_error:
            env.setdefault("warnings", []).append(
                f"world {world}: a rank failed after its last case: {outcome.teardown_error}"
            )
        done = len(outcome.results)
        if outcome.failure is None:
            break
        fail = outcome.failure
        rows.append(_failed_row(fail.case, fail.reason))
        failed_methods[fail.case["method"]] = (fail.case["size_mib"], fail.reason)
        # A method that failed is not retried at larger sizes: its failure (an exception
        # in torch's hook, a hang) does not depend on size, and each retry costs a group.
        rest = cases[done + 1 :]
        cases = []
        for c in rest:
            if c["method"] in failed_methods:
                at, reason = failed_methods[c["method"]]
                rows.append(_failed_row(c, f"failed at {at:g} MiB: {reason}", "not run"))
            else:
                cases.append(c)
    return rows


def _failed_row(case: dict, reason: str, status: str = "failed") -> dict:
    return {
        "method": case["method"],
        "world": case["world"],
        "size_mib": case["size_mib"],
        "numel": case["numel"],
        "status": status,
        "reason": reason,
        "formula_bytes": case["formula_bytes"],
    }
