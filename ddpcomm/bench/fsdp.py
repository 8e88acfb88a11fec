"""``python -m ddpcomm.bench fsdp``: FSDP2's gradient reduce-scatter, plain and compressed.

Two parts on the same ranks and link: one gradient reduce-scattered by each method the
way FSDP2 calls its comm (``comm(output, input, group, ReduceOp.AVG)``), then ``train``'s
GPT sharded with ``fully_shard`` per block and trained per method. ``plain`` is FSDP2's
own ``reduce_scatter_single``; the others are ``ddpcomm.fsdp.ReduceScatter(spec)``.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard

import ddpcomm
import ddpcomm.fsdp
from ddpcomm.bench import _ranks, collectives, train
from ddpcomm.bench._gpt import GPT, GPTConfig, Language, describe, num_params
from ddpcomm.bench._util import environment, finish, link_lines, short, table, wall
from ddpcomm.reduce_scatter import reduce_scatter_single

DESCRIPTION = """\
Measures FSDP2 (fully_shard) with its gradient reduce-scatter compressed by ddpcomm, on
spawned gloo ranks, in two parts:

rs     one gradient of each --sizes reduce-scattered by each method at each --world, as
       FSDP2 calls its comm; per method: the median time of the slowest rank, the bytes
       a rank sends and, with --link, the bytes its interface really sent, the error of
       rank 0's shard against the exact mean, the speedup over FSDP2's plain
       reduce-scatter and the limit of that speedup from bytes alone.
train  the GPT of 'train' (its default model) sharded per block and trained from the
       same weights on the same batches with each method; per method: the median step
       time of the slowest rank and the speedup over plain FSDP2, the bytes per step,
       the held-out loss after training and its gap to plain. 'nocomm' replaces the
       reduce-scatter by a local copy: its step time (compute and FSDP2's uncompressed
       parameter all-gathers) is the floor no gradient compression can beat.

--link RATE gives each rank its own network namespace joined by links shaped to RATE
with tc tbf (needs root; without it the run falls back to loopback and says so)."""

RS_DEFAULT = ["plain", "q8", "q4", "q1", "topk:0.01"]
TRAIN_DEFAULT = ["nocomm", "plain", "q8"]
MIB, SEED = 2**20, 1234


def _method_list(own: tuple[str, ...]):
    """argparse type: comma-separated ``own`` names or ddpcomm spec strings."""

    def parse(text: str) -> list[str]:
        names = [m.strip() for m in text.split(",") if m.strip()]
        for m in (m for m in names if m not in own):
            try:
                ddpcomm.parse_compression(m)
            except (TypeError, ValueError) as exc:
                raise argparse.ArgumentTypeError(f"{exc}; or {', '.join(own)}") from None
        if not names:
            raise argparse.ArgumentTypeError("give at least one method")
        return names

    return parse


def add_parser(sub) -> None:
    p = sub.add_parser(
        "fsdp",
        help="FSDP2's gradient reduce-scatter per method, and FSDP2 training of a small GPT",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    lists, rs, tr = collectives._positive, ",".join(RS_DEFAULT), ",".join(TRAIN_DEFAULT)
    p.add_argument("--parts", default="rs,train", help="rs, train or rs,train (default)")
    p.add_argument(
        "--sizes",
        type=lists(float),
        default=[64],
        metavar="LIST",
        help="gradient sizes in MiB (default 64)",
    )
    p.add_argument(
        "--world",
        type=lists(int),
        default=[2, 4],
        metavar="LIST",
        help="world sizes of the rs part, each >= 2 (default 2,4)",
    )
    p.add_argument(
        "--methods",
        type=_method_list(("plain",)),
        default=RS_DEFAULT,
        metavar="LIST",
        help=f"rs methods: plain (FSDP2's own) or ddpcomm specs (default {rs})",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=5,
        help="timed calls per rs case; the median is reported (default 5)",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per rs case (default 1)")
    p.add_argument(
        "--train-methods",
        type=_method_list(("nocomm", "plain")),
        default=TRAIN_DEFAULT,
        metavar="LIST",
        help=f"train methods: as --methods, and nocomm (default {tr})",
    )
    p.add_argument("--train-world", type=int, default=2, help="ranks of the train part (default 2)")
    p.add_argument("--steps", type=int, default=100, help="training steps per method (default 100)")
    p.add_argument(
        "--link", metavar="RATE", help="shape each rank's link to RATE (1gbit, 10gbit); needs root"
    )
    p.add_argument("--timeout", type=float, help="seconds a case may go without progress")
    p.add_argument("--out", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument(
        "--quick",
        action="store_true",
        help="1 MiB at 2 ranks, a tiny GPT for 8 steps: checks that it runs",
    )
    p.set_defaults(func=run)


def _training(args) -> tuple[GPTConfig, dict]:
    """``train``'s default model and schedule, with this command's steps."""
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    t = p.parse_args([])
    t.steps = args.steps
    if args.quick:
        t.steps, t.warmup_steps, t.seq, t.eval_batch = 8, 2, 32, 4
        t.d_model, t.layers, t.heads, t.vocab = 64, 2, 2, 256
    if not t.warmup_steps < t.steps:
        raise SystemExit(f"--steps must be > {t.warmup_steps} (the warm-up), got {t.steps}")
    keep = ("steps", "warmup_steps", "batch", "eval_batch", "lr", "seed")
    return GPTConfig(t.vocab, t.seq, t.d_model, t.layers, t.heads), {k: vars(t)[k] for k in keep}


def run(args) -> int:
    if args.quick:
        args.sizes, args.world, args.iters, args.warmup = [1], [2], 2, 1
    parts = set(args.parts.split(","))
    if parts - {"rs", "train"}:
        raise SystemExit(f"--parts must be rs, train or rs,train, got {args.parts!r}")
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit(f"--iters must be >= 1 and --warmup >= 0, got {args.iters}, {args.warmup}")
    if min(args.world) < 2 or args.train_world < 2:
        raise SystemExit(f"--world and --train-world must be >= 2, got {args.world}")
    if args.timeout is not None and not args.timeout > 0:
        raise SystemExit(f"--timeout must be > 0 seconds, got {args.timeout}")
    rate = _ranks.link_rate(args.link) or 100e6  # bytes/s; loopback counted as 100 MB/s
    env, cases = environment(), {}
    for world in [_ranks.world_size(0)] if _ranks.under_torchrun() else args.world:
        for size in args.sizes if "rs" in parts else []:
            numel = int(size * MIB) // 4 // world * world  # N equal chunks, as FSDP's
            cases.setdefault(world, []).extend(
                {
                    "label": f"rs, {world} ranks, {size:g} MiB, {m}",
                    "row": {"part": "rs", "method": m, "world": world, "size_mib": size},
                    "numel": numel,
                    "iters": args.iters,
                    "warmup": args.warmup,
                    "timeout": 60 + 10 * (args.iters + args.warmup + 3) * 8 * numel / rate,
                }
                for m in args.methods
            )
    if "train" in parts:
        cfg, settings = _training(args)
        env["model"], world = describe(cfg), _ranks.world_size(args.train_world)
        cases.setdefault(world, []).extend(
            {
                "label": f"train, {world} ranks, {m}: {settings['steps']} steps",
                "row": {"part": "train", "method": m, "world": world},
                "model": cfg.__dict__,
                # The whole case, not the time between heartbeats: a spawned rank's notes
                # never reach the watchdog (_ranks sets their event file in its __main__
                # copy only). 5x the 2 gradients' worth a plain step puts on the wire.
                "timeout": 120 + 5 * settings["steps"] * 2 * 4 * num_params(GPT(cfg)) / rate,
                **settings,
            }
            for m in args.train_methods
        )
    rows = []
    for world, world_cases in sorted(cases.items()):
        out = _ranks.run_cases(
            "ddpcomm.bench.fsdp:run_case",
            world_cases,
            world,
            env,
            link=args.link,
            common={"link_check_mb": 8 if args.quick else 64},
            timeout=lambda case: args.timeout or case["timeout"],
        )
        if out is None:  # a torchrun rank other than 0
            return 0
        rows += out
    finish({"command": "fsdp", "environment": env, "rows": rows}, report, args.out)
    return 0


# -- on every rank -------------------------------------------------------------------------


def run_case(case: dict, common: dict, device: torch.device) -> dict:
    part = _rs_case if case["row"]["part"] == "rs" else _train_case
    return dict(case["row"], status="ok", **part(case, common.get("ifname"), device))


@functools.lru_cache(maxsize=1)
def _exact_shard(numel: int, world: int, device: torch.device) -> torch.Tensor:
    """Rank 0's shard of the exact mean of every rank's gradient."""
    shapes = collectives.bucket_shapes(numel)
    grads = (collectives.make_grad(shapes, r, SEED, device) for r in range(world))
    return (sum(grads) / world)[: numel // world]


def _rs_case(case: dict, ifname: str | None, device: torch.device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    method, n, iters = case["row"]["method"], case["numel"], case["iters"]
    grad = collectives.make_grad(collectives.bucket_shapes(n), rank, SEED, device)
    inp, out = torch.empty_like(grad), torch.empty(n // world, device=device)
    group, avg, state = dist.group.WORLD, dist.ReduceOp.AVG, None
    if method == "plain":  # FSDP2's default comm
        call = functools.partial(reduce_scatter_single, out, inp, op=avg, group=group)
    else:
        comm = ddpcomm.fsdp.ReduceScatter(method)
        call, state = functools.partial(comm, out, inp, group, avg), comm.state
    times = []
    for i in range(case["warmup"] + iters):
        if i == case["warmup"]:  # counters start at the first timed call
            tx0 = _ranks.tx_bytes(ifname)
            if state is not None:
                state.reset_stats()
        inp.copy_(grad)  # FSDP's input buffer is scratch: a method may write into it
        dist.barrier()
        times.append(wall(call, device)[1])
    dist.barrier()  # every rank's last send has left before the counters are read
    tx1 = _ranks.tx_bytes(ifname)
    every = [None] * world
    dist.all_gather_object(every, times[-iters:])
    per_call = [max(ts) for ts in zip(*every, strict=True)]  # the slowest rank's
    result = dict(numel=n, median_s=statistics.median(per_call), times_s=per_call)
    result["bytes"] = (world - 1) * (n // world) * 4  # plain: N-1 fp32 chunks
    if state is not None:  # ddpcomm's own count
        st = state.stats()
        result.update(bytes=st["bytes_sent"] / iters, compress_s=st["compress_seconds"] / iters)
    if tx1 is not None:
        result["wire_bytes"] = (tx1 - tx0) / iters
    if rank == 0:
        exact = _exact_shard(n, world, device)
        result["rel_error"] = ((out - exact).norm() / exact.norm()).item()
    return result


class _LocalChunk(ddpcomm.fsdp.ReduceScatter):
    """This rank's own chunk, unreduced: FSDP2 with no gradient communication."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        own = input_tensor.view(dist.get_world_size(group), -1)[dist.get_rank(group)]
        output_tensor.copy_(own)


def _train_case(case: dict, ifname: str | None, device: torch.device) -> dict:
    """As ``train.run_case``, with the model under ``fully_shard`` instead of DDP."""
    rank, world = dist.get_rank(), dist.get_world_size()
    method, steps, warm = case["row"]["method"], case["steps"], case["warmup_steps"]
    cfg = GPTConfig(**case["model"])
    torch.manual_seed(case["seed"])  # the same initial weights on every rank and method
    model = GPT(cfg).to(device)
    # FSDP pads each parameter's dim 0 to a multiple of N; plain sends N-1 of N chunks.
    padded = sum(math.ceil(p.shape[0] / world) * world * p[0].numel() for p in model.parameters())
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = None
    if method == "nocomm":
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_reduce_scatter(_LocalChunk("none"))
    elif method != "plain":
        state = ddpcomm.fsdp.compress(model, method)
    opt = torch.optim.AdamW(model.parameters(), lr=case["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))  # as train
    lang = Language(cfg.vocab, seed=case["seed"])

    def step(x, y) -> float:
        loss = model(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        return loss.item()

    log = _ranks.StepLog(method, steps)
    for i in range(steps):
        if i == warm:  # counters cover the timed steps
            tx0 = _ranks.tx_bytes(ifname)
            if state is not None:
                state.reset_stats()
        x, y = lang.batch(case["batch"], cfg.seq, seed=(i * 1000 + rank) * 7919 + 17)
        loss, seconds = wall(functools.partial(step, x, y), device)
        log.add(i, loss, seconds)
    dist.barrier()
    tx1 = _ranks.tx_bytes(ifname)
    ex, ey = lang.batch(case["eval_batch"], cfg.seq, seed=999_999_937)  # train's held-out batch
    with torch.no_grad():
        eval_loss = model(ex.to(device), ey.to(device)).item()
    every = [None] * world  # per rank: (losses, times, eval loss); nocomm's ranks differ
    dist.all_gather_object(every, (log.losses, log.times, eval_loss))
    timed = [max(ts) for ts in zip(*(g[1] for g in every), strict=True)]  # the slowest rank's
    result = dict(
        loss=[statistics.fmean(ls) for ls in zip(*(g[0] for g in every), strict=True)],
        step_times_s=timed,
        median_step_s=statistics.median(timed[warm:]),
        eval_loss=statistics.fmean(g[2] for g in every),
        rs_bytes_per_step=0 if method == "nocomm" else (world - 1) * padded // world * 4,
    )
    if state is not None:
        st = state.stats()
        result["rs_bytes_per_step"] = st["bytes_sent"] / (steps - warm)
        result["compress_s_per_step"] = st["compress_seconds"] / (steps - warm)
    if tx1 is not None:
        result["wire_bytes_per_step"] = (tx1 - tx0) / (steps - warm)
    return result


# -- the tables --------------------------------------------------------------------------


def report(result: dict, markdown: bool = False) -> str:
    """The tables of an fsdp result (as printed after a run)."""
    env, rows = result["environment"], result["rows"]
    lines = link_lines(env)
    rs = [r for r in rows if r["part"] == "rs"]
    if rs:
        lines += ["", "Reduce-scatter of one fp32 gradient (ReduceOp.AVG), per call:", ""]
        lines.append(table(*_rs_table(rs), markdown))
        extra = [
            f"{r['wire_bytes'] / r['bytes']:.1f}x at {r['world']} ranks"
            for r in rs
            if r["method"] == "plain" and r.get("wire_bytes", 0) > 1.5 * r["bytes"]
        ]
        if extra:
            lines.append(
                f"plain's bytes on the wire were {', '.join(extra)} its N-1 chunks: gloo "
                "reduce-scatters by an all_reduce of the whole input, then a copy (NCCL sends "
                "the chunks only), so speedups over plain here can pass the limit from bytes."
            )
    trained = [r for r in rows if r["part"] == "train"]
    if trained:
        lines += ["", f"FSDP2 training, {env['model']}:", ""]
        lines += [table(*_train_table(trained), markdown), ""]
        lines += [
            "nocomm: the reduce-scatter replaced by a local copy (each rank steps on its own "
            "gradient): compute and FSDP2's uncompressed parameter all-gathers, the floor.",
            "RS MB/step: ddpcomm's own count; plain's from FSDP2's padded shards. MB on "
            "wire/step includes the all-gathers. ms/step: median after the warm-up, slowest rank.",
        ]
    lines += [f"warning: {w}" for w in env.get("warnings", [])]
    return "\n".join(lines)


def _status(r: dict) -> str:
    return "ok" if r["status"] == "ok" else f"{r['status']}: {short(r.get('reason', ''))}"


def _rs_table(rows: list[dict]):
    plain = {(r["world"], r["size_mib"]): r for r in rows if r["method"] == "plain"}
    headers = ["method", "ranks", "MiB", "ms", "compress ms", "MB sent/rank", "MB on wire/rank"]
    headers += ["error vs exact mean", "speedup vs plain", "limit from bytes", "status"]
    body = []
    for r in rows:
        base = plain.get((r["world"], r["size_mib"]), {})
        both = "median_s" in r and "median_s" in base
        body.append(
            [
                r["method"],
                str(r["world"]),
                f"{r['size_mib']:g}",
                f"{r['median_s'] * 1e3:.1f}" if "median_s" in r else "-",
                f"{r['compress_s'] * 1e3:.1f}" if "compress_s" in r else "-",
                collectives._mb(r["bytes"]) if "bytes" in r else "-",
                collectives._mb(r["wire_bytes"]) if "wire_bytes" in r else "-",
                f"{r['rel_error']:.1e}" if "rel_error" in r else "-",
                f"{base['median_s'] / r['median_s']:.2f}x" if both else "-",
                f"{base['bytes'] / r['bytes']:.1f}x" if r.get("bytes") and "bytes" in base else "-",
                _status(r),
            ]
        )
    return headers, body


def _train_table(rows: list[dict]):
    base = next((r for r in rows if r["method"] == "plain" and r["status"] == "ok"), None)
    headers = ["method", "ranks", "RS MB/step", "MB on wire/step", "ms/step", "speedup vs plain"]
    headers += ["compress ms/step", "held-out loss", "loss vs plain", "status"]
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append([r["method"], str(r["world"]), *["-"] * 7, _status(r)])
            continue
        body.append(
            [
                r["method"],
                str(r["world"]),
                f"{r['rs_bytes_per_step'] / 1e6:.2f}",
                f"{r['wire_bytes_per_step'] / 1e6:.2f}" if "wire_bytes_per_step" in r else "-",
                f"{r['median_step_s'] * 1e3:.1f}",
                f"{base['median_step_s'] / r['median_step_s']:.2f}x" if base else "-",
                f"{r['compress_s_per_step'] * 1e3:.1f}" if "compress_s_per_step" in r else "-",
                f"{r['eval_loss']:.4f}",
                f"{r['eval_loss'] / base['eval_loss'] - 1:+.2%}" if base else "-",
                "ok",
            ]
        )
    return headers, body
