"""``python -m ddpcomm.bench collectives``: one gradient bucket reduced by each DDP hook.

Every method is driven the way DDP drives it, ``hook(state, bucket)`` returning a Future
of the mean, on a ``_Bucket``: an object with the GradBucket methods hooks call, whose
buffer is the message and whose gradients are [rows, 1024] views of it (the shape of a
transformer's linear layers, so PowerSGD sees the matrices it sees in training). One
bucket per call rather than a DDP model: the message size is exact, and the time is the
reduction alone, not backward compute overlapped with it.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics

import torch
import torch.distributed as dist

from ddpcomm import adaptive
from ddpcomm.bench import _methods, _ranks
from ddpcomm.bench._util import environment, finish, link_lines, short, table, wall

DESCRIPTION = """\
Reduces one gradient bucket through each method's DDP hook (torch's allreduce_hook,
fp16_compress_hook, quantization and PowerSGD hooks; ddpcomm's hooks) on spawned gloo
ranks, for each message size and world size, and prints per method: the median time of
the slowest rank, the bytes a rank sends (from the method's wire format) and, with
--link, the bytes its interface really sent, the error against the exact mean, the
speedup over plain all_reduce and the limit of that speedup from bytes alone.

A method followed by ',adaptive' (q8,adaptive) makes untimed calls first, in which
adaptive pass-through times the plain and the compressed path and decides; its row says
which path the decision took ('-> plain', '-> compressed') and its bytes are those sent.
Its case also times plain all_reduce and the fixed method (q8): after each has made its
untimed calls alone, the three take turns call by call, each first in turn. Its speedup
and the summary under the table compare it with those two, timed under the same load,
not with their own rows.

--link RATE gives each rank its own network namespace joined by links shaped to RATE
with tc tbf (needs root; without it the run falls back to loopback and says so)."""

COLS = 1024  # columns of every gradient matrix in the bucket
MIB = 2**20


def add_parser(sub) -> None:
    p = sub.add_parser(
        "collectives",
        help="one gradient bucket through each DDP hook, every method, sizes x ranks",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sizes",
        type=_positive(float),
        default=[1, 4, 16, 64, 256],
        metavar="LIST",
        help="message sizes in MiB (default 1,4,16,64,256)",
    )
    p.add_argument(
        "--world",
        type=_positive(int),
        default=[2, 4],
        metavar="LIST",
        help="world sizes, each >= 2 (default 2,4)",
    )
    p.add_argument(
        "--methods",
        type=_methods.method_list(),
        default=[*_methods.TORCH, *_methods.DDPCOMM, *_methods.ADAPTIVE],
        metavar="LIST",
        help=_methods.METHODS_HELP + " (default: all, topk and randk at 0.01, each with and "
        "without adaptive)",
    )
    p.add_argument(
        "--link", metavar="RATE", help="shape each rank's link to RATE (1gbit, 10gbit); needs root"
    )
    p.add_argument(
        "--iters",
        type=int,
        default=5,
        help="timed calls per case, times 16 MiB / size (at most 8) below 16 MiB, whose "
        "calls take milliseconds and vary by several; the median is reported (default 5)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="untimed calls per case (default 5: a bucket's gloo pieces follow the link "
        "from its 5th call)",
    )
    p.add_argument(
        "--timeout", type=float, help="seconds a case may take (default: from size and link rate)"
    )
    p.add_argument("--out", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument(
        "--quick", action="store_true", help="1 MiB, 2 ranks, 2 timed calls: checks that it runs"
    )
    p.set_defaults(func=run)


def _positive(kind):
    def parse(text: str):
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not a comma-separated list of {kind.__name__}: {text!r}"
            ) from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"values must be > 0, got {text!r}")
        return values

    return parse


def bucket_shapes(numel: int) -> list[tuple[int, ...]]:
    """[1024, 1024] matrices (4 MiB each), then one [rows, 1024], then a 1-D tail."""
    full, rest = divmod(numel, COLS * COLS)
    rows, tail = divmod(rest, COLS)
    return [(COLS, COLS)] * full + [(rows, COLS)] * (rows > 0) + [(tail,)] * (tail > 0)


def run(args) -> int:
    if args.quick:
        args.sizes, args.world, args.iters, args.warmup = [1], [2], 2, 1
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit(f"--iters must be >= 1 and --warmup >= 0, got {args.iters}, {args.warmup}")
    if any(w < 2 for w in args.world):
        raise SystemExit(f"--world: every world size must be >= 2, got {args.world}")
    if args.timeout is not None and not args.timeout > 0:
        raise SystemExit(f"--timeout must be > 0 seconds, got {args.timeout}")
    rate = _ranks.link_rate(args.link)
    env = environment()
    worlds = [_ranks.world_size(0)] if _ranks.under_torchrun() else args.world
    rows = []
    for world in worlds:
        cases = _cases(args, world)

        def timeout(case) -> float:
            # 10x a plain all_reduce's wire time per call (100 MB/s on loopback), + slack.
            calls = case["iters"] + case["warmup"] + 3
            if ",adaptive" in case["row"]["method"]:  # + plain and the fixed method
                calls = 3 * calls + adaptive.first_decision()
            return args.timeout or 60 + 10 * calls * 8 * case["row"]["numel"] / (rate or 100e6)

        common = {"link_check_mb": 8 if args.quick else 64}
        out = _ranks.run_cases(
            "ddpcomm.bench.collectives:run_case",
            cases,
            world,
            env,
            link=args.link,
            common=common,
            timeout=timeout,
        )
        if out is None:  # a torchrun rank other than 0
            return 0
        rows += out
    result = {"command": "collectives", "environment": env, "rows": rows}
    finish(result, report, args.out)
    return 0


def _cases(args, world: int) -> list[dict]:
    cases = []
    for size in args.sizes:
        numel = int(size * MIB) // 4
        shapes = bucket_shapes(numel)
        for method in args.methods:
            row = {
                "method": method,
                "world": world,
                "size_mib": size,
                "numel": numel,
                "formula_bytes": _methods.formula_bytes(method, shapes, world),
            }
            label = f"{world} ranks, {size:g} MiB, {method}"
            cases.append(
                {
                    "label": label,
                    "row": row,
                    "shapes": shapes,
                    "iters": args.iters * (1 if args.quick else min(8, max(1, int(16 / size)))),
                    "warmup": args.warmup,
                }
            )
    return cases


class _Bucket:
    """The GradBucket methods torch's and ddpcomm's hooks call, over one flat buffer.
    ``parameters()`` are placeholders with the gradients' count: hooks use them only as
    identities (ddpcomm keys its per-model state on them)."""

    def __init__(self, buffer: torch.Tensor, shapes: list[tuple[int, ...]]):
        self._buffer, self._grads, offset = buffer, [], 0
        for shape in shapes:
            self._grads.append(buffer[offset : offset + math.prod(shape)].view(shape))
            offset += math.prod(shape)
        self._params = [torch.nn.Parameter(torch.empty(0)) for _ in shapes]

    def index(self) -> int:
        return 0

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return True  # one bucket per step: every call ends an iteration (PowerSGD counts them)

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)


def make_grad(shapes, rank: int, seed: int, device) -> torch.Tensor:
    """Rank ``rank``'s gradient: per-matrix scale x (shared low-rank signal + rank noise).

    Real gradients differ by orders of magnitude between layers, agree partly across
    ranks (same loss, different minibatches), and a linear layer's gradient (a sum of
    per-token outer products) has a fast-decaying spectrum. The signal here is a sum of 8
    rank-1 terms weighted 1, 1/2, 1/4, ...; each rank adds noise of relative size 0.3.
    PowerSGD and the sparsifiers see the structure they exploit in training, not white
    noise that no compressor can shrink.
    """
    parts = []
    for i, shape in enumerate(shapes):
        g_shared = torch.Generator().manual_seed(seed * 1_000_003 + i)
        g_rank = torch.Generator().manual_seed((seed * 1_000_003 + i) * 131 + rank + 1)
        scale = 10 ** (-2 * torch.rand((), generator=g_shared).item())
        if len(shape) == 2:
            weights = 0.5 ** torch.arange(8.0)
            u = torch.randn(shape[0], 8, generator=g_shared) * weights
            t = (u @ torch.randn(8, shape[1], generator=g_shared)) / weights.norm()
        else:
            t = torch.randn(shape, generator=g_shared)
        parts.append(
            t.add_(torch.randn(shape, generator=g_rank), alpha=0.3).mul_(scale).reshape(-1)
        )
    return torch.cat(parts).to(device)


_exact: dict = {}  # rank 0's exact mean of the current size (up to 256 MiB: one at a time)


def _reduce(hook, state, activation, bucket):
    return hook(state, bucket).wait()


def run_case(case: dict, common: dict, device: torch.device) -> dict:
    """One method at one size on every rank: untimed calls, then timed calls. An adaptive
    method's case also times plain all_reduce and its fixed method, taking turns with it
    call by call, so that the three are compared under the same load."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes, seed, result = [tuple(s) for s in case["shapes"]], 1234, dict(case["row"])
    grad = make_grad(shapes, rank, seed, device)
    methods = [result["method"]]
    if methods[0].endswith(",adaptive"):
        methods += ["allreduce", methods[0].removesuffix(",adaptive")]
    runs = [
        (*_methods.make_hook(m, dist.group.WORLD, False), _Bucket(grad.clone(), shapes))
        for m in methods
    ]
    # Untimed calls one method after another: an adaptive state times whole steps (here,
    # from one of its calls to the next), so its decision is made with no other calls
    # in between. The timed calls then take turns, each first in turn.
    for run in runs:
        for _ in range(run[2] + case["warmup"]):
            run[3].buffer().copy_(grad)  # hooks write the mean into the bucket in place
            dist.barrier()
            _reduce(*run)
    stats, ifname = getattr(runs[0][1], "stats", None), common.get("ifname")
    st0, times, wire, out = stats and stats(), [[] for _ in runs], 0, None
    for i in range(case["iters"]):
        for j in range(len(runs)):
            j = (i + j) % len(runs)
            runs[j][3].buffer().copy_(grad)
            dist.barrier()
            tx0 = _ranks.tx_bytes(ifname) if j == 0 else None
            value, seconds = wall(functools.partial(_reduce, *runs[j]), device)
            times[j].append(seconds)
            if j == 0:
                out = value[0] if isinstance(value, (list, tuple)) else value
                dist.barrier()  # every rank's sends of this call have left
                if tx0 is not None:
                    wire += _ranks.tx_bytes(ifname) - tx0
    # The slowest rank's time per call is the collective's time.
    every = [None] * world
    dist.all_gather_object(every, times)
    medians = []
    for j in range(len(runs)):
        per_call = [max(ts[j][i] for ts in every) for i in range(case["iters"])]
        medians.append(statistics.median(per_call))
        if j == 0:
            result.update(median_s=medians[0], times_s=per_call)
    if len(runs) > 1:
        result.update(plain_s=medians[1], fixed_s=medians[2])
    if ifname:
        result["wire_bytes"] = wire / case["iters"]
    if stats:  # ddpcomm's own accounting, per call
        st1 = stats()
        result["measured_bytes"] = (st1["bytes_sent"] - st0["bytes_sent"]) / case["iters"]
        result["compress_s"] = (st1["compress_seconds"] - st0["compress_seconds"]) / case["iters"]
        if "adaptive" in st1:  # the path the decision took for this bucket's size class
            result["adaptive_path"] = st1["adaptive"]["classes"][-1]["decision"]
    # Every rank must hold the same result: compare checksums.
    probe = torch.stack([out.double().sum(), out.double().square().sum()])
    probes = [torch.empty_like(probe) for _ in range(world)]
    dist.all_gather(probes, probe)
    result["ranks_identical"] = all(torch.equal(p, probes[0]) for p in probes)
    if rank == 0:
        key = (tuple(shapes), world)
        if key not in _exact:
            _exact.clear()
            _exact[key] = sum(make_grad(shapes, r, seed, device) for r in range(world)) / world
        exact = _exact[key]
        result["rel_error"] = (out.float().reshape(-1) - exact).norm().item() / max(
            exact.norm().item(), 1e-30
        )
    result["status"] = "ok"
    return result


def report(result: dict, markdown: bool = False) -> str:
    """The table of a collectives result (as printed after a run)."""
    env, rows = result["environment"], result["rows"]
    lines = link_lines(env)
    order = {m: i for i, m in enumerate([*_methods.TORCH, *_methods.DDPCOMM])}

    def position(method: str) -> tuple[int, str]:  # q8,adaptive right after q8
        base = method.split(",")[0]
        return order.get(base, len(order)), method

    rows = sorted(rows, key=lambda r: (r["world"], r["size_mib"], position(r["method"])))
    plain = {
        (r["world"], r["size_mib"]): r
        for r in rows
        if r["method"] == "allreduce" and r["status"] == "ok"
    }
    headers = [
        "method",
        "ranks",
        "MiB",
        "ms",
        "compress ms",
        "MB sent/rank",
        "MB on wire/rank",
        "error vs exact mean",
        "speedup vs allreduce",
        "limit from bytes",
        "status",
    ]
    body = []
    for r in rows:
        ok, base = r["status"] == "ok", plain.get((r["world"], r["size_mib"]))
        plain_bytes = _methods.formula_bytes("allreduce", [(r["numel"],)], r["world"])
        sent = r["formula_bytes"]
        if "adaptive_path" in r and "measured_bytes" in r:
            sent = r["measured_bytes"]  # what the decided path sent
        status = "ok" if r.get("ranks_identical", True) else "ok, but ranks differ"
        body.append(
            [
                r["method"] + (f" -> {r['adaptive_path']}" if "adaptive_path" in r else ""),
                str(r["world"]),
                f"{r['size_mib']:g}",
                f"{r['median_s'] * 1e3:.1f}" if ok else "-",
                f"{r['compress_s'] * 1e3:.1f}" if "compress_s" in r else "-",
                _mb(sent),
                _mb(r["wire_bytes"]) if "wire_bytes" in r else "-",
                f"{r['rel_error']:.1e}" if "rel_error" in r else "-",
                f"{r.get('plain_s', base and base['median_s']) / r['median_s']:.2f}x"
                if ok and (base or "plain_s" in r)
                else "-",
                f"{plain_bytes / sent:.1f}x" if sent else "-",
                status if ok else f"{r['status']}: {short(r.get('reason', ''))}",
            ]
        )
    lines += ["", table(headers, body, markdown)]
    lines += _adaptive_summary(rows, plain)
    lines += [f"warning: {w}" for w in env.get("warnings", [])]
    return "\n".join(lines)


def _adaptive_summary(rows: list[dict], plain: dict) -> list[str]:
    """How each adaptive row's decision and time compare with plain and its fixed method,
    timed call by call with it in its case (in results from before that: their own rows);
    a path within 5% of the other counts as either."""
    done = {(r["world"], r["size_mib"], r["method"]): r for r in rows if r["status"] == "ok"}
    found = {"cells": 0, "faster": 0, "slower": 0, "tie": 0, "over_plain": 0, "over_best": 0}
    for (world, size, method), r in done.items():
        fixed = done.get((world, size, method.removesuffix(",adaptive")))
        base = plain.get((world, size))
        if not method.endswith(",adaptive") or fixed is None or base is None:
            continue
        t = r["median_s"]
        t_plain, t_fixed = r.get("plain_s", base["median_s"]), r.get("fixed_s", fixed["median_s"])
        found["cells"] += 1
        if abs(t_plain - t_fixed) <= 0.05 * min(t_plain, t_fixed):
            found["tie"] += 1
        else:
            best = "compressed" if t_fixed < t_plain else "plain"
            found["faster" if r.get("adaptive_path") == best else "slower"] += 1
        found["over_plain"] += t > 1.03 * t_plain
        found["over_best"] += t > 1.05 * min(t_plain, t_fixed)
    if not found["cells"]:
        return []
    return [
        "",
        f"adaptive, {found['cells']} cells: took the faster of plain and its method in "
        f"{found['faster']}, the slower in {found['slower']}, either (within 5%) in "
        f"{found['tie']}; ran more than 3% slower than plain in {found['over_plain']} and "
        f"more than 5% slower than the faster in {found['over_best']} (each against plain "
        "and its method timed call by call with it)",
    ]


def _mb(b: float) -> str:
    return f"{b / 1e6:.3f}" if b < 1e6 else f"{b / 1e6:.1f}"
