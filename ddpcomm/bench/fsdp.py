"""``python -m ddpcomm.bench fsdp``: FSDP2's gradient reduce-scatter, plain and compressed.

Two parts, both over shaped links (``--link``, as the collectives bench) or loopback:

* ``rs``: one gradient of ``--sizes`` MiB reduce-scattered by each method at each world
  size, the way FSDP2 calls its comm: ``comm(output, input, group, ReduceOp.AVG)``.
  ``plain`` is FSDP2's default (``reduce_scatter_single``); the others are
  ``ddpcomm.fsdp.ReduceScatter(spec)``. Reported: the median over ``--iters`` of the
  slowest rank's time, the bytes a rank hands to the wire (the method's formula; for
  ddpcomm its own count), the bytes its interface really sent (with ``--link``), the
  relative error of rank 0's shard against the exact mean, and the speedup over plain.
* ``train``: the benchmark GPT (``_gpt.py``) sharded with ``fully_shard`` per block and
  trained ``--steps`` steps per method from the same weights on the same batches:
  median step time, reduce-scatter bytes per step, interface bytes per step (these include
  FSDP's uncompressed parameter all-gathers), and the loss.

Each rank of a group is ``python -m ddpcomm.bench.fsdp`` started by ``_launch.run_group``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import time

from ddpcomm.bench import _report
from ddpcomm.bench._gpt import GPTConfig, describe
from ddpcomm.bench._launch import progress, run_group
from ddpcomm.bench._worker import under_torchrun
from ddpcomm.bench.collectives import _positive_list
from ddpcomm.bench.netns import open_links, parse_rate

RS_METHODS = ["plain", "q8", "q4", "q2", "q1", "topk:0.01", "randk:0.01", "bf16"]
DEFAULT_RS_METHODS = ["plain", "q8", "q4", "q1", "topk:0.01"]
TRAIN_METHODS = ["plain", "q8", "q4", "q1"]
MIB = 2**20
LAST = 10  # the final training loss is the mean of the last LAST steps


def _methods(allowed: list[str], arg: str):
    def parse(text: str) -> list[str]:
        names = [m for m in text.split(",") if m]
        bad = [m for m in names if m not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"{arg}: unknown method {bad[0] if bad else text!r}; choose from "
                f"{', '.join(allowed)}"
            )
        return names

    return parse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "fsdp",
        help="FSDP2 gradient reduce-scatter per method, and FSDP2 training of a small GPT",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--parts", default="rs,train", help="rs, train or both (default rs,train)")
    p.add_argument(
        "--sizes",
        type=_positive_list(float, "--sizes"),
        default=[64],
        help="gradient sizes in MiB (default 64)",
    )
    p.add_argument(
        "--world",
        type=_positive_list(int, "--world"),
        default=[2, 4],
        help="world sizes of the reduce-scatter part (default 2,4)",
    )
    p.add_argument(
        "--methods",
        type=_methods(RS_METHODS, "--methods"),
        default=DEFAULT_RS_METHODS,
        help=f"reduce-scatter methods, a subset of {','.join(RS_METHODS)}",
    )
    p.add_argument("--iters", type=int, default=5, help="timed repetitions per case (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions per case")
    p.add_argument(
        "--train-methods",
        type=_methods(TRAIN_METHODS, "--train-methods"),
        default=["plain", "q8"],
        help=f"training methods, a subset of {','.join(TRAIN_METHODS)} (default plain,q8)",
    )
    p.add_argument("--train-world", type=int, default=2, help="ranks of the training part")
    p.add_argument("--steps", type=int, default=100, help="training steps per method")
    p.add_argument("--warmup-steps", type=int, default=5, help="steps left out of step time")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--link",
        default=None,
        metavar="RATE",
        help="shape each rank's link to RATE (tc units: 1gbit, 10gbit); needs root",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds a case may take")
    p.add_argument("--json", default=None, metavar="PATH", help="write all rows as JSON")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 1 MiB at 2 ranks, 2 iterations; a tiny GPT for 8 steps",
    )
    p.set_defaults(func=run)


def _validate(args) -> GPTConfig:
    parts = set(args.parts.split(","))
    if not parts or parts - {"rs", "train"}:
        raise SystemExit(f"--parts must be rs, train or rs,train, got {args.parts!r}")
    args.parts = parts
    for name in ("iters", "steps", "batch", "seq"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {args.warmup}")
    if not 0 <= args.warmup_steps < args.steps:
        raise SystemExit(f"--warmup-steps must be in [0, --steps), got {args.warmup_steps}")
    if any(w < 2 for w in args.world) or args.train_world < 2:
        raise SystemExit("--world and --train-world: every world size must be >= 2")
    if args.timeout is not None and not args.timeout > 0:
        raise SystemExit(f"--timeout must be > 0 seconds, got {args.timeout}")
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
        args.sizes, args.world, args.iters, args.warmup = [1], [2], 2, 1
        args.steps, args.warmup_steps, args.seq = 8, 2, 32
        args.d_model, args.layers, args.heads, args.vocab = 64, 2, 2, 256
    if under_torchrun():  # torchrun's ranks are the one world size
        args.world = [int(os.environ["WORLD_SIZE"])]
        args.train_world = args.world[0]
    cfg = _validate(args)
    env = _report.environment()
    env["model"] = describe(cfg)
    cases = {world: [] for world in sorted(set(args.world) | {args.train_world})}
    if "rs" in args.parts:
        for world in args.world:
            for size in args.sizes:
                numel = int(size * MIB) // 4 // world * world  # whole shards
                for m in args.methods:
                    label = f"rs world {world}  {size:g} MiB  {m}"
                    cases[world].append(
                        dict(
                            part="rs",
                            method=m,
                            size_mib=size,
                            numel=numel,
                            label=label,
                            iters=args.iters,
                            warmup=args.warmup,
                        ),
                    )
    if "train" in args.parts:
        for m in args.train_methods:
            cases[args.train_world].append(
                dict(
                    part="train",
                    method=m,
                    model=cfg.__dict__,
                    steps=args.steps,
                    lr=args.lr,
                    warmup_steps=args.warmup_steps,
                    batch=args.batch,
                    seed=0,
                    label=f"train world {args.train_world} {m}: {args.steps} steps",
                ),
            )
    if under_torchrun():
        return _run_under_torchrun(args, cases, env)
    rows = []
    grad_bytes = max([4 * c["numel"] for cs in cases.values() for c in cs if "numel" in c] + [0])
    grad_bytes = max(grad_bytes, 4 * _param_count(cfg) if "train" in args.parts else 0)
    env["links"], env["link_checks"] = {}, []
    for world, world_cases in cases.items():
        if not world_cases:
            continue
        links, note = open_links(world, args.link)
        speed = parse_rate(args.link) / 8 if links is not None else 100e6

        def case_timeout(case, speed=speed) -> float:
            # 20x a plain all-reduce of the largest gradient per heartbeat, plus slack.
            return args.timeout or 120 + 20 * 2 * grad_bytes / speed

        with links if links is not None else contextlib.nullcontext():
            env["links"][world] = links.describe() if links is not None else note
            progress(f"world {world}: {env['links'][world]}")
            threads = max(1, (os.cpu_count() or 1) // world)
            common = {
                "pg_timeout": case_timeout(None) + 60,
                "threads": threads,
                "ifname": links.ifname if links is not None else None,
                "link_check_mb": (8 if args.quick else 64) if links is not None else 0,
            }
            while world_cases:
                outcome = run_group(
                    "ddpcomm.bench.fsdp", world, links, world_cases, common, case_timeout, threads
                )
                common["link_check_mb"] = 0
                env["link_checks"] += [dict(i, world=world) for i in outcome.info]
                rows += outcome.results
                if outcome.failure is None:
                    break
                f = outcome.failure
                rows.append({**_keys(f.case, world), "status": "failed", "reason": f.reason})
                world_cases = world_cases[len(outcome.results) + 1 :]
    _report_all(args, rows, env)
    return 0


def _keys(case: dict, world: int) -> dict:
    keep = ("part", "method", "size_mib", "numel")
    return {"world": world, **{k: case[k] for k in keep if k in case}}


def _param_count(cfg: GPTConfig) -> int:
    from ddpcomm.bench._gpt import GPT, num_params

    return num_params(GPT(cfg))


def _run_under_torchrun(args, cases: dict, env: dict) -> int:
    """Under torchrun every rank runs the cases of its world size in-process (NCCL on
    GPUs)."""
    import torch.distributed as dist

    from ddpcomm.bench._worker import run_inline

    if args.link is not None:
        raise SystemExit("--link cannot be used under torchrun")
    mine = [c for cs in cases.values() for c in cs]
    rank, world, rows = run_inline(mine, {"pg_timeout": args.timeout or 600}, run_case)
    if rank == 0:
        env["links"] = {world: f"torchrun, {dist.get_backend()}, {world} ranks"}
        _report_all(args, rows, env)
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------


def _report_all(args, rows: list[dict], env: dict) -> None:
    if args.json:  # first: the measurements survive even if printing fails
        _report.write_json(args.json, {"command": "fsdp", "environment": env, "rows": rows})
    print_rows(rows, env)


def _ms(s) -> str:
    return f"{s * 1e3:.1f}"


def print_rows(rows: list[dict], env: dict) -> None:
    print(f"cpus: {env['host_cpus']}   load at start: {env['loadavg_1_5_15']}")
    for world, link in env.get("links", {}).items():
        print(f"link (world {world}): {link}")
    for c in env.get("link_checks", []):
        print(f"link check (world {c['world']}): {c['link_check_MBps']:.1f} MB/s rank 0 -> 1")
    ok = [r for r in rows if r.get("status") == "ok"]
    failed = [r for r in rows if r.get("status") != "ok"]
    rs = [r for r in ok if r["part"] == "rs"]
    if rs:
        plain = {(r["world"], r["size_mib"]): r for r in rs if r["method"] == "plain"}
        body = []
        for r in rs:
            base = plain.get((r["world"], r["size_mib"]))
            body.append(
                [
                    r["method"],
                    str(r["world"]),
                    f"{r['size_mib']:g}",
                    _ms(r["median_s"]),
                    _ms(r["compress_s"]) if "compress_s" in r else "-",
                    f"{r['bytes'] / 1e6:.2f}",
                    f"{r['wire_bytes'] / 1e6:.2f}" if "wire_bytes" in r else "-",
                    f"{r['rel_error']:.2e}",
                    f"{base['median_s'] / r['median_s']:.2f}x" if base else "-",
                    f"{base['bytes'] / r['bytes']:.1f}x" if base and r["bytes"] else "-",
                ],
            )
        headers = ["method", "world", "MiB", "median ms", "compress ms", "MB/rank", "wire MB"]
        print(_report.table(headers + ["rel err", "speedup", "ideal"], body))
    train = [r for r in ok if r["part"] == "train"]
    if train:
        print(env["model"])
        base = next((r for r in train if r["method"] == "plain"), None)
        body = []
        for r in train:
            final = statistics.fmean(r["loss"][-LAST:])
            body.append(
                [
                    r["method"],
                    str(r["world"]),
                    f"{r['median_step_s'] * 1e3:.0f}",
                    f"{base['median_step_s'] / r['median_step_s']:.2f}x" if base else "-",
                    f"{r['rs_bytes_per_step'] / 1e6:.2f}",
                    f"{r['wire_bytes_per_step'] / 1e6:.2f}" if "wire_bytes_per_step" in r else "-",
                    f"{r['loss'][0]:.3f}",
                    f"{final:.3f}",
                    f"{(final / statistics.fmean(base['loss'][-LAST:]) - 1) * 100:+.2f}%"
                    if base
                    else "-",
                ],
            )
        headers = ["method", "world", "step ms", "speedup", "RS MB/step", "wire MB/step"]
        headers += ["first loss", f"loss (last {LAST})", "vs plain"]
        print(_report.table(headers, body))
    for r in failed:
        what = f"{r.get('part')} {r.get('method')} world {r.get('world')}"
        print(f"{what}: {r.get('status')}: {_report.short(r.get('reason', ''))}")


# --------------------------------------------------------------------------------------
# A rank (python -m ddpcomm.bench.fsdp, started by _launch.run_group)
# --------------------------------------------------------------------------------------


def run_case(case: dict, common: dict, device) -> dict:
    if case["part"] == "rs":
        return _rs_case(case, common, device)
    return _train_case(case, common, device)


def _slowest(times: list[float]) -> list[float]:
    import torch.distributed as dist

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, times)
    return [max(ts[i] for ts in every) for i in range(len(times))]


def _rs_case(case: dict, common: dict, device) -> dict:
    import torch
    import torch.distributed as dist

    import ddpcomm.fsdp
    from ddpcomm.bench import _worker
    from ddpcomm.bench._worker_collectives import make_grad
    from ddpcomm.reduce_scatter import reduce_scatter_single

    rank, world = dist.get_rank(), dist.get_world_size()
    group, op = dist.group.WORLD, dist.ReduceOp.AVG
    n, method = case["numel"], case["method"]
    result = {**_keys(case, world), "method": method}
    grad = make_grad([(n,)], rank, 1234, device)
    inp, out = torch.empty_like(grad), torch.empty(n // world, device=device)
    if method == "plain":  # FSDP2's DefaultReduceScatter
        comm = lambda o, i: reduce_scatter_single(o, i, op=op, group=group)  # noqa: E731
        stats = None
    else:
        rs = ddpcomm.fsdp.ReduceScatter(method)
        comm = lambda o, i: rs(o, i, group, op)  # noqa: E731
        stats = rs.state
    times = []
    for i in range(case["warmup"] + case["iters"]):
        if i == case["warmup"]:
            tx0 = _worker.tx_bytes(common.get("ifname"))
            if stats is not None:
                stats.reset_stats()
        inp.copy_(grad)  # FSDP's input buffer is scratch: methods may write into it
        dist.barrier()
        _worker.sync(device)
        t0 = time.perf_counter()
        comm(out, inp)
        _worker.sync(device)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    tx1 = _worker.tx_bytes(common.get("ifname"))
    timed = _slowest(times[case["warmup"] :])
    result.update(status="ok", median_s=statistics.median(timed), times_s=timed)
    if stats is None:
        result["bytes"] = (world - 1) * (n // world) * 4
    else:
        st = stats.stats()
        result["bytes"] = st["bytes_sent"] / case["iters"]
        result["compress_s"] = st["compress_seconds"] / case["iters"]
        result["paths"] = st["paths"]
    if tx1 is not None:
        result["wire_bytes"] = (tx1 - tx0) / case["iters"]
    if rank == 0:  # the row is rank 0's
        exact = sum(make_grad([(n,)], r, 1234, device)[: n // world] for r in range(world))
        exact /= world
        result["rel_error"] = float((out - exact).norm() / exact.norm())
    return result


def _train_case(case: dict, common: dict, device) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import ddpcomm.fsdp
    from ddpcomm.bench import _worker
    from ddpcomm.bench._gpt import GPT, Language

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**case["model"])
    steps, warm, method = case["steps"], case["warmup_steps"], case["method"]
    torch.manual_seed(case["seed"])  # the same initial weights on every rank and method
    model = GPT(cfg).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = None if method == "plain" else ddpcomm.fsdp.compress(model, method)
    numel = sum(p.numel() for p in model.parameters())  # unsharded
    # FSDP pads each parameter's dim 0 to a multiple of N before reduce-scattering.
    padded = sum(math.ceil(p.shape[0] / world) * world * p[0].numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=case["lr"], betas=(0.9, 0.95), weight_decay=0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    lang = Language(cfg.vocab, seed=case["seed"])
    losses, times, tx0, last_note = [], [], None, time.perf_counter()
    for step in range(steps):
        if step == warm:
            tx0 = _worker.tx_bytes(common.get("ifname"))
            if state is not None:
                state.reset_stats()
        x, y = lang.batch(case["batch"], cfg.seq, seed=(step * 1000 + rank) * 7919 + 17)
        x, y = x.to(device), y.to(device)
        _worker.sync(device)
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        _worker.sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"loss is {losses[-1]} at step {step}")
        if time.perf_counter() - last_note > 5 or step + 1 == steps:
            last_note = time.perf_counter()
            _worker.note(f"  {method}: step {step + 1}/{steps}  loss {losses[-1]:.3f}")
    dist.barrier()
    tx1 = _worker.tx_bytes(common.get("ifname"))
    every = [None] * world
    dist.all_gather_object(every, losses)
    measured = steps - warm
    timed = _slowest(times)[warm:]
    result = {
        **_keys(case, world),
        "status": "ok",
        "loss": [statistics.fmean(ls[i] for ls in every) for i in range(steps)],
        "median_step_s": statistics.median(timed),
        "params": numel,
    }
    if state is None:  # FSDP2's plain reduce-scatter: N-1 of N padded fp32 shards
        result["rs_bytes_per_step"] = (world - 1) * padded // world * 4
    else:
        result["rs_bytes_per_step"] = state.stats()["bytes_sent"] / measured
        result["paths"] = state.stats()["paths"]
    if tx1 is not None:
        result["wire_bytes_per_step"] = (tx1 - tx0) / measured
    return result


if __name__ == "__main__":
    from ddpcomm.bench import _worker

    _worker.run(run_case)
