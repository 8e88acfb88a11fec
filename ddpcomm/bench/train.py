"""``python -m ddpcomm.bench train``: end-to-end DDP training of a small GPT per method.

Each method trains the same model from the same initial weights on the same batches
(a synthetic second-order Markov language generated in-process, see ``_gpt.py``) for a
fixed number of steps. Reported per method: median step time (forward + backward +
optimizer, slowest rank, after ``--warmup-steps``), bytes a rank sends per step (ddpcomm's
own count, torch's hooks by their formula, DDP's default by the ring formula), bytes its
interface really sent (with ``--link``), ddpcomm's compression time per step, and the
loss curve. ``nocomm`` trains without any gradient exchange: its step time is the
compute floor, what a method's step time would be with an infinitely fast network.

The per-rank batch is small on purpose (default 2 x 64 tokens): this 2-core machine
computes slowly, and the benchmark is about the regime where the network, not compute,
limits the step, as it does for large models on 1-10 Gbit/s links.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics

from ddpcomm.bench import _report
from ddpcomm.bench._gpt import GPTConfig, describe
from ddpcomm.bench._launch import progress, run_group
from ddpcomm.bench._worker import under_torchrun
from ddpcomm.bench.collectives import DDPCOMM_METHODS
from ddpcomm.bench.netns import open_links, parse_rate

METHODS = ["nocomm", "ddp", "torch-fp16", "powersgd-r4", *DDPCOMM_METHODS]
DEFAULT_METHODS = [
    "nocomm",
    "ddp",
    "torch-fp16",
    "powersgd-r4",
    "q8",
    "q4",
    "q1",
    "topk:0.01",
    "randk:0.01",
]
LAST = 10  # the "final loss" is the mean of the last LAST steps: one step's loss is noisy


def _methods(text: str) -> list[str]:
    names = [m for m in text.split(",") if m]
    for m in names:
        if m not in METHODS:
            raise argparse.ArgumentTypeError(
                f"--methods: unknown method {m!r}; choose from {', '.join(METHODS)}"
            )
    if not names:
        raise argparse.ArgumentTypeError("--methods: give at least one method")
    return names


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="end-to-end DDP training of a small GPT per "
        "method: step time, bytes, loss curves, plot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--methods",
        type=_methods,
        default=DEFAULT_METHODS,
        help=f"comma-separated subset of {','.join(METHODS)}",
    )
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--steps", type=int, default=100, help="training steps per method")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=5,
        help="steps left out of step time and bytes (DDP rebuilds buckets)",
    )
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument(
        "--eval-batch",
        type=int,
        default=32,
        help="sequences in the fixed held-out batch scored after training",
    )
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--link",
        default=None,
        metavar="RATE",
        help="shape each rank's link to RATE (tc units: 1gbit, 10gbit); needs root",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds without progress before a method is failed "
        "(default: from model size and link rate)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON")
    p.add_argument(
        "--plot",
        default="ddpcomm-train.png",
        metavar="PATH",
        help="PNG of loss vs step and step time per method "
        "(default ddpcomm-train.png; '' for none)",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny model for 12 steps")
    p.set_defaults(func=run)


def _validate(args) -> GPTConfig:
    for name in ("world", "steps", "batch", "seq", "eval_batch"):
        value = getattr(args, name)
        if value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.world < 2:
        raise SystemExit(f"--world must be >= 2 (DDP needs peers to talk to), got {args.world}")
    if not 0 <= args.warmup_steps < args.steps:
        raise SystemExit(f"--warmup-steps must be in [0, --steps), got {args.warmup_steps}")
    if args.timeout is not None and not args.timeout > 0:
        raise SystemExit(f"--timeout must be > 0 seconds, got {args.timeout}")
    if not args.lr > 0:
        raise SystemExit(f"--lr must be > 0, got {args.lr}")
    if args.link is not None:
        try:
            parse_rate(args.link)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    try:
        return GPTConfig(
            vocab=args.vocab,
            seq=args.seq,
            d_model=args.d_model,
            layers=args.layers,
            heads=args.heads,
        )
    except ValueError as exc:
        raise SystemExit(f"model: {exc}") from None


def run(args) -> int:
    if args.quick:
        args.steps, args.warmup_steps, args.batch, args.seq = 12, 2, 2, 32
        args.eval_batch = 4
        args.d_model, args.layers, args.heads, args.vocab = 64, 2, 2, 256
    cfg = _validate(args)
    env = _report.environment()
    env["model"] = describe(cfg)
    cases = [
        {
            "method": m,
            "model": cfg.__dict__,
            "steps": args.steps,
            "lr": args.lr,
            "warmup_steps": args.warmup_steps,
            "batch": args.batch,
            "eval_batch": args.eval_batch,
            "seed": args.seed,
            "label": f"train {m}: {args.steps} steps",
        }
        for m in args.methods
    ]
    if under_torchrun():
        return _run_under_torchrun(args, cases, env)
    progress(env["model"])
    links, note = open_links(args.world, args.link)
    rate = parse_rate(args.link) / 8 if links is not None else None
    grad_bytes = 4 * _param_count(cfg)
    speed = rate or 100e6

    def case_timeout(case) -> float:
        # Between heartbeats (every 5 s, or every step when steps are slower): 20x a
        # plain all_reduce of the gradients, plus slack for a loaded machine.
        if args.timeout:
            return args.timeout
        return 120 + 20 * 2 * grad_bytes / speed

    rows = []
    with links if links is not None else contextlib.nullcontext():
        env["link"] = links.describe() if links is not None else note
        env["link_short"] = args.link if links is not None else "loopback"
        env["world"] = args.world
        progress(f"world {args.world}: {env['link']}")
        threads = max(1, (os.cpu_count() or 1) // args.world)
        common = {
            "pg_timeout": case_timeout(None) + 60,
            "threads": threads,
            "ifname": links.ifname if links is not None else None,
            "link_check_mb": (8 if args.quick else 64) if links is not None else 0,
        }
        env["link_checks"] = []
        while cases:
            outcome = run_group(
                "ddpcomm.bench._worker_train",
                args.world,
                links,
                cases,
                common,
                case_timeout,
                threads,
            )
            common["link_check_mb"] = 0
            env["link_checks"] += [dict(i, world=args.world) for i in outcome.info]
            rows += outcome.results
            if outcome.teardown_error:
                env.setdefault("warnings", []).append(
                    f"a rank failed after its last case: {outcome.teardown_error}"
                )
            if outcome.failure is None:
                break
            f = outcome.failure
            rows.append(
                {
                    "method": f.case["method"],
                    "world": args.world,
                    "status": "failed",
                    "reason": f.reason,
                }
            )
            cases = cases[len(outcome.results) + 1 :]
    _report_all(args, rows, env)
    return 0


def _report_all(args, rows: list[dict], env: dict) -> None:
    # JSON first: the measurements survive even if printing or plotting fails.
    if args.json:
        args_out = {k: v for k, v in vars(args).items() if k != "func"}
        _report.write_json(
            args.json, {"command": "train", "environment": env, "args": args_out, "rows": rows}
        )
    print_train(rows, env)
    if args.plot:
        plot(rows, env, args.plot)
        progress(f"plot written to {args.plot}")


def _run_under_torchrun(args, cases: list[dict], env: dict) -> int:
    """``train`` under torchrun: every rank trains in-process (NCCL on GPUs)."""
    import torch.distributed as dist

    from ddpcomm.bench._worker import run_inline
    from ddpcomm.bench._worker_train import run_case

    if args.link is not None:
        raise SystemExit(
            "--link cannot be used under torchrun: torchrun's ranks already "
            "run on the network they were launched on"
        )
    rank, world, rows = run_inline(cases, {"pg_timeout": args.timeout or 600}, run_case)
    if rank == 0:
        env.update(
            link=f"torchrun, {dist.get_backend()}, {world} ranks",
            link_short="torchrun",
            world=world,
        )
        _report_all(args, rows, env)
    dist.destroy_process_group()
    return 0


def _param_count(cfg: GPTConfig) -> int:
    from ddpcomm.bench._gpt import GPT, num_params

    return num_params(GPT(cfg))


def final_loss(row: dict) -> float:
    return statistics.fmean(row["loss"][-LAST:])


def print_train(rows: list[dict], env: dict) -> None:
    print(f"{env['model']}")
    print(f"link: {env['link']}   cpus: {env['host_cpus']}   load: {env['loadavg_1_5_15']}")
    for c in env.get("link_checks", []):
        print(
            f"link check: {c['link_check_MiB']} MiB rank 0 -> 1 at {c['link_check_MBps']:.1f} MB/s"
        )
    base = next((r for r in rows if r["method"] == "ddp" and r.get("status") == "ok"), None)
    headers = [
        "method",
        "step ms",
        "vs ddp",
        "MB/step",
        "wire MB",
        "compress ms",
        "first loss",
        f"train loss (last {LAST})",
        "eval loss",
        "vs ddp",
        "status",
    ]
    body = []
    for r in rows:
        if r.get("status") != "ok":
            body.append(
                [r["method"]] + ["-"] * 9 + [f"{r['status']}: {_report.short(r.get('reason', ''))}"]
            )
            continue
        fl = final_loss(r)
        body.append(
            [
                r["method"],
                f"{r['median_step_s'] * 1e3:.0f}",
                f"{base['median_step_s'] / r['median_step_s']:.2f}x" if base else "-",
                f"{r['bytes_per_step'] / 1e6:.2f}",
                f"{r['wire_bytes_per_step'] / 1e6:.2f}" if "wire_bytes_per_step" in r else "-",
                f"{r['compress_s_per_step'] * 1e3:.0f}" if "compress_s_per_step" in r else "-",
                f"{r['loss'][0]:.3f}",
                f"{fl:.3f}",
                f"{r['eval_loss']:.3f}",
                f"{(r['eval_loss'] / base['eval_loss'] - 1) * 100:+.2f}%" if base else "-",
                "ok" if r.get("replicas_identical", True) else "ok (replicas differ!)",
            ]
        )
    print(_report.table(headers, body))
    for w in env.get("warnings", []):
        print(f"warning: {w}")


def _moving_average(xs: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def plot(rows: list[dict], env: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on benchmark machines
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    fig, (ax_loss, ax_time) = plt.subplots(
        1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]}
    )
    for i, r in enumerate(ok):
        if r["method"] == "nocomm":
            continue  # each rank trains alone: its loss is not comparable
        steps = range(1, len(r["loss"]) + 1)
        color = f"C{i % 10}"
        # One step's loss on a small batch is noisy: faint raw curve, bold moving average.
        ax_loss.plot(steps, r["loss"], color=color, lw=0.6, alpha=0.3)
        ax_loss.plot(
            steps, _moving_average(r["loss"], LAST), color=color, lw=1.5, label=r["method"]
        )
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel(f"training loss (mean over ranks; bold: {LAST}-step average)")
    ax_loss.set_title("loss vs step")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)
    names = [r["method"] for r in ok]
    ms = [r["median_step_s"] * 1e3 for r in ok]
    bars = ax_time.barh(names, ms, color=[f"C{i % 10}" for i in range(len(ok))])
    ax_time.bar_label(bars, labels=[f"{v:.0f} ms" for v in ms], fontsize=8, padding=2)
    ax_time.invert_yaxis()
    ax_time.set_xlabel("median step time (ms)")
    ax_time.set_title("step time (nocomm: compute only)")
    ax_time.set_xlim(0, max(ms, default=1) * 1.25)
    ax_time.grid(axis="x", alpha=0.3)
    fig.suptitle(
        f"{env['model'].split(':')[0]}; {env['world']} ranks; link {env['link_short']}", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
