"""``python -m ddpcomm.bench train``: end-to-end DDP training of a small GPT per method.

Every method trains the same model from the same initial weights on the same batches (a
pure function of step and rank, from the synthetic language of ``_gpt.py``), so results
differ only by what the method did to the gradients. The per-rank batch is small on
purpose: the benchmark is about the regime where the network, not compute, limits the
step, as it does for large models on 1-10 Gbit/s links.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import math
import os
import re
import statistics

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpcomm
from ddpcomm.bench import _methods, _probes, _ranks
from ddpcomm.bench._gpt import GPT, GPTConfig, Text, corpus, describe, num_params
from ddpcomm.bench._util import (
    check_line,
    environment,
    finish,
    machine_line,
    progress,
    short,
    table,
    wall,
)

DESCRIPTION = """\
Trains the same small GPT from the same initial weights on the same batches with each
method, on spawned gloo ranks, and prints per method: the bytes a rank sends per step
and their share of DDP's default, the median step time of the slowest rank and the
speedup over DDP's default, the held-out loss after training and the largest parameter
difference from DDP's default. 'nocomm' trains without any gradient exchange: its step
time is the compute floor. The data is a synthetic language made in-process.

--link RATE shapes the links between ranks as for 'collectives' (needs root); with
--nodes N --ranks-per-node L, between N nodes of L ranks, and the wire bytes are those
that left a node (node 0's counters)."""

OWN = ("nocomm", "ddp")  # no hook: no gradient exchange, and DDP's built-in all_reduce
DEFAULT_METHODS = ["nocomm", "ddp", "torch-fp16", "powersgd-r4", *_methods.DDPCOMM]
DEFAULT_METHODS.remove("q2")
DEFAULT_METHODS.insert(DEFAULT_METHODS.index("q8") + 1, "q8,adaptive")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="end-to-end DDP training of a small GPT per method: step time, bytes, loss",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.add_argument(
        "--quick", action="store_true", help="a tiny model for 12 steps: checks that it runs"
    )
    p.set_defaults(func=run)


def add_arguments(p) -> None:
    p.add_argument(
        "--methods",
        type=_methods.method_list((*OWN, _methods.LOCAL)),
        default=DEFAULT_METHODS,
        metavar="LIST",
        help=f"nocomm (no gradient exchange), ddp (DDP's default), and {_methods.METHODS_HELP}"
        f" (default {','.join(DEFAULT_METHODS)}); ddp runs first",
    )
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    _ranks.add_node_arguments(p)
    p.add_argument("--steps", type=int, default=100, help="training steps per method (default 100)")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=5,
        help="first steps left out of step time and bytes (default 5)",
    )
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step (default 2)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument(
        "--eval-batch",
        type=int,
        default=32,
        help="sequences in the held-out batch scored after training (default 32)",
    )
    p.add_argument("--d-model", type=int, default=512, help="model width (default 512)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    p.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument(
        "--accum",
        type=int,
        default=1,
        help="micro-batches of --batch sequences per optimizer step, gradients accumulated "
        "locally (DDP no_sync) and exchanged once per step (default 1)",
    )
    p.add_argument(
        "--lr-decay",
        choices=("none", "cosine"),
        default="none",
        help="after the 10-step linear warm-up: constant (none, default) or cosine decay "
        "to 10%% of --lr at the last step",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data (default 0)")
    p.add_argument(
        "--probe-every",
        type=int,
        default=0,
        metavar="N",
        help="every N steps, compare each bucket's reduced gradient with the exact mean "
        "(one more plain all_reduce) and report the relative error by parameter kind, "
        "over the first and the second half of training (default 0: off)",
    )
    p.add_argument(
        "--adam-exact",
        choices=("m", "v"),
        help="mechanism probe: AdamW's first (m) or second (v) moment takes the exact mean "
        "gradient (one more plain all_reduce per bucket) and the other the method's, to "
        "split a method's loss gap between Adam's direction and its per-coordinate scale",
    )
    p.add_argument(
        "--exact-params",
        metavar="REGEX",
        help="mechanism probe: the parameters whose names REGEX finds (tok.weight, "
        "blocks.0.qkv.weight, ...; '[.](qkv|proj)[.]' for attention) take the exact mean "
        "gradient (one more plain all_reduce per bucket) and the rest the method's, to "
        "find which parameters a method's loss gap comes from",
    )
    p.add_argument(
        "--data",
        choices=("markov", "text"),
        default="markov",
        help="markov: the synthetic second-order Markov language of --vocab tokens (default); "
        "text: character-level English (CPython's pydoc help texts, vocab 128)",
    )
    p.add_argument(
        "--link", metavar="RATE", help="shape each rank's link to RATE (1gbit, 10gbit); needs root"
    )
    p.add_argument(
        "--timeout", type=float, help="seconds without progress before a method is failed"
    )
    p.add_argument(
        "--out", metavar="PATH", help="write the results (with loss curves) as JSON to PATH"
    )
    p.add_argument(
        "--plot", metavar="PATH", help="write a PNG of loss vs step and step time to PATH"
    )


def _config(args) -> GPTConfig:
    for name in ("world", "steps", "batch", "seq", "eval_batch", "accum"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.world < 2:
        raise SystemExit(f"--world must be >= 2 (DDP needs peers), got {args.world}")
    if not 0 <= args.warmup_steps < args.steps:
        raise SystemExit(f"--warmup-steps must be in [0, --steps), got {args.warmup_steps}")
    if not args.lr > 0 or (args.timeout is not None and not args.timeout > 0):
        raise SystemExit(f"--lr and --timeout must be > 0, got {args.lr}, {args.timeout}")
    if args.data == "text":
        args.vocab = Text.VOCAB
    try:
        cfg = GPTConfig(args.vocab, args.seq, args.d_model, args.layers, args.heads)
    except ValueError as exc:
        raise SystemExit(f"model: {exc}") from None
    if args.exact_params is not None:
        try:
            pattern = re.compile(args.exact_params)
        except re.error as exc:
            raise SystemExit(f"--exact-params: {exc}") from None
        with torch.device("meta"):
            names = [n for n, _ in GPT(cfg).named_parameters()]
        if not any(pattern.search(n) for n in names):
            raise SystemExit(
                f"--exact-params {args.exact_params!r} finds none of the model's parameters "
                f"({', '.join(names[:6])}, ...)"
            )
    return cfg


def run(args, command: str = "train") -> int:
    if getattr(args, "quick", False):  # demo presets its own model
        args.steps, args.warmup_steps, args.batch, args.seq, args.eval_batch = 12, 2, 2, 32, 4
        args.d_model, args.layers, args.heads, args.vocab = 64, 2, 2, 256
    cfg = _config(args)
    rate = _ranks.link_rate(args.link)
    methods = sorted(args.methods, key=lambda m: m != "ddp")  # the others compare with it
    env = dict(environment(), model=describe(cfg, args.data))
    progress(env["model"])
    grad_bytes = 4 * num_params(GPT(cfg))
    world = _ranks.world_size(_ranks.nodes_world(args) or args.world)
    settings = {
        k: getattr(args, k)
        for k in (
            "steps",
            "warmup_steps",
            "batch",
            "eval_batch",
            "lr",
            "seed",
            "accum",
            "lr_decay",
            "data",
            "probe_every",
            "adam_exact",
            "exact_params",
        )
    }
    cases = [
        {
            "label": f"{m}: {args.steps} steps",
            "row": {"method": m, "world": world},
            "model": cfg.__dict__,
            **settings,
        }
        for m in methods
    ]

    def timeout(case) -> float:
        # Between heartbeats (every 5 s, or every step): 20x a plain all_reduce of the
        # gradients, plus slack for a loaded machine.
        return args.timeout or 120 + 20 * 2 * grad_bytes / (rate or 100e6)

    common = {"link_check_mb": 8 if getattr(args, "quick", False) else 64}
    rows = _ranks.run_cases(
        "ddpcomm.bench.train:run_case",
        cases,
        world,
        env,
        link=args.link,
        common=common,
        timeout=timeout,
        per_node=args.ranks_per_node if args.nodes else 1,
    )
    if rows is None:  # a torchrun rank other than 0
        return 0
    env["world"] = world
    result = {"command": command, "environment": env, "args": _args(args), "rows": rows}
    finish(result, report, args.out)
    if args.plot:
        plot(result, args.plot)
        progress(f"plot written to {args.plot}")
    return 0


def _args(args) -> dict:
    return {k: v for k, v in vars(args).items() if k != "func"}


def _counting(hook, method: str, world: int, counter: list):
    """torch's hook, adding each bucket's formula bytes to ``counter[0]`` (torch's hooks
    count nothing). functools.wraps keeps the annotations DDP checks at registration."""

    @functools.wraps(hook)
    def wrapper(state, bucket):
        counter[0] += _methods.formula_bytes(
            method, [tuple(g.shape) for g in bucket.gradients()], world
        )
        return hook(state, bucket)

    return wrapper


def _lr_factor(s: int, steps: int, decay: str) -> float:
    """Linear warm-up over 10 steps (Adam's first steps on a fresh transformer are large
    enough to swamp any difference between methods), then constant or cosine to 10%."""
    if s < 10 or decay == "none":
        return min(1.0, (s + 1) / 10)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (s - 10) / max(1, steps - 11))))


def eval_steps(steps: int) -> list[int]:
    """Steps after which the held-out loss is scored: a sixth, half and all of them."""
    return sorted({max(1, steps // 6), max(1, steps // 2), steps})


def run_case(case: dict, common: dict, device: torch.device) -> dict:
    """Trains the model once with one method on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    method, steps, warm = case["row"]["method"], case["steps"], case["warmup_steps"]
    cfg = GPTConfig(**case["model"])
    torch.manual_seed(case["seed"])  # the same initial weights on every rank and method
    model = GPT(cfg).to(device)
    init = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    counter, state, settle = [0], None, 0
    # --probe-every's records (hooked: the method's hook compares with the exact mean)
    probe = {"on": False, "hooked": False, "steps": [], "err": [], "ref": []}
    net = model  # nocomm: each rank trains its own copy
    if method != "nocomm":
        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    local = method.startswith(_methods.LOCAL)
    if method not in OWN and not local:
        # settle: the first step the method compresses with no warm-up or ramp stage
        hook, state, settle = _methods.make_hook(method, dist.group.WORLD)
        if not hasattr(state, "stats"):
            hook = _counting(hook, method, world, counter)
        if case.get("probe_every"):
            hook, probe["hooked"] = _probes.probing(hook, model, probe), True
        if case.get("adam_exact"):
            hook = _probes.keeping_exact(hook)
        if case.get("exact_params"):
            hook = _probes.exact_for(hook, model, re.compile(case["exact_params"]))
        net.register_comm_hook(state, hook)
    if case.get("adam_exact") and method not in OWN and not local:
        opt = _probes.SplitAdam(model.parameters(), lr=case["lr"], exact=case["adam_exact"])
    else:
        opt = torch.optim.AdamW(
            model.parameters(), lr=case["lr"], betas=(0.9, 0.95), weight_decay=0.0
        )
    if local:  # steps locally, averaging the parameters every few steps
        state = ddpcomm.LocalSteps(net, opt, **_methods.local_options(method))
        settle = state.start_iter
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, functools.partial(_lr_factor, steps=steps, decay=case.get("lr_decay", "none"))
    )
    lang = corpus(case.get("data", "markov"), cfg.vocab, case["seed"])
    accum = case.get("accum", 1)

    def step(batches) -> float:
        total = 0.0
        for j, (x, y) in enumerate(batches):
            # Gradients of all but the last micro-batch stay local: one exchange per step.
            sync = j + 1 == len(batches) or method == "nocomm"
            with contextlib.nullcontext() if sync else net.no_sync():
                loss = net(x.to(device), y.to(device)) / len(batches)
                loss.backward()
            total += loss.item()
        (state if local else opt).step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        return total

    # Held-out loss on one fixed batch, the same for every method and rank, after a sixth,
    # half and all of the steps (after 100, 300 and 600 of 600).
    ex, ey = lang.held_out_batch(case["eval_batch"], cfg.seq, seed=999_999_937)
    evals, scored = {}, eval_steps(steps)
    log = _ranks.StepLog(method, steps)
    for i in range(steps):
        if i == warm:  # counters cover the timed steps (DDP rebuilds its buckets at step 1)
            tx0, sent0 = _ranks.tx_bytes(common.get("ifname")), counter[0]
            if hasattr(state, "reset_stats"):
                state.reset_stats()
        if i == max(warm, settle) and hasattr(state, "stats"):
            settled0 = state.stats()["bytes_sent"]
        batches = [
            lang.batch(case["batch"], cfg.seq, seed=((i * accum + j) * 1000 + rank) * 7919 + 17)
            for j in range(accum)
        ]
        every = case.get("probe_every") or 0
        probe["on"] = every > 0 and i % every == 0
        if probe["on"]:
            probe["steps"].append(i)
            probe["err"].append(collections.Counter())
            probe["ref"].append(collections.Counter())
        loss, seconds = wall(lambda b=batches: step(b), device)
        log.add(i, loss, seconds)
        if i + 1 in scored:
            if local:  # every rank evaluates the same parameters
                state.average()
            with torch.no_grad():
                evals[i + 1] = model(ex.to(device), ey.to(device)).item()
    dist.barrier()
    tx1 = _ranks.tx_bytes(common.get("ifname"))
    # Loss curve: mean over ranks per step. Step time: the slowest rank's.
    every = [None] * world
    dist.all_gather_object(every, (log.losses, log.times, evals))
    timed, measured = [max(g[1][i] for g in every) for i in range(steps)], steps - warm
    result = dict(
        case["row"],
        status="ok",
        loss=[statistics.fmean(g[0][i] for g in every) for i in range(steps)],
        step_times_s=timed,
        median_step_s=statistics.median(timed[warm:]),
        params=num_params(model),
        eval_loss=statistics.fmean(g[2][steps] for g in every),
        eval_losses=[[s, statistics.fmean(g[2][s] for g in every)] for s in sorted(evals)],
        bytes_per_step=(counter[0] - sent0) / measured,
    )
    if tx1 is not None:
        result["wire_bytes_per_step"] = (tx1 - tx0) / measured
    if hasattr(state, "stats"):
        st = state.stats()
        result.update(bytes_per_step=st["bytes_sent"] / measured, paths=st["paths"])
        if max(warm, settle) < steps:
            # What the method sends once it is past its warm-up and ramp.
            settled = (st["bytes_sent"] - settled0) / (steps - max(warm, settle))
            result["bytes_per_step_settled"] = settled
        result["compress_s_per_step"] = st["compress_seconds"] / measured
        result.update({k: st[k] for k in ("adaptive", "hierarchy") if k in st})
    elif method == "ddp":
        result["bytes_per_step"] = _methods.formula_bytes("ddp", [(result["params"],)], world)
    if probe["hooked"]:
        result["probe"] = _probes.probe_result(probe)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    if method != "nocomm":  # replicas must stay identical under every DDP method
        sums = torch.stack([flat.double().sum(), flat.double().square().sum()]).to(device)
        every_sums = [torch.empty_like(sums) for _ in range(world)]
        dist.all_gather(every_sums, sums)
        result["replicas_identical"] = all(torch.equal(s, every_sums[0]) for s in every_sums)
        baseline = os.path.join(common["workdir"], f"ddp_params_rank{rank}.pt")
        named = {n: p.detach().cpu() for n, p in model.named_parameters()}
        if method == "ddp":
            torch.save((flat, named), baseline)
        elif os.path.exists(baseline):
            ddp_flat, ddp_named = torch.load(baseline)
            result["max_param_diff"] = (flat - ddp_flat).abs().max().item()
            result["drift"] = _probes.drift(named, ddp_named, init)
    return result


def report(result: dict, markdown: bool = False) -> str:
    """The table of a train (or demo) result, as printed after a run."""
    env, rows = result["environment"], result["rows"]
    lines = [env["model"], f"link: {env['link']}", f"machine: {machine_line(env)}"]
    lines += [f"link check: {check_line(c)}" for c in env.get("link_checks", [])]
    base = next((r for r in rows if r["method"] == "ddp" and r["status"] == "ok"), None)
    headers = [
        "method",
        "MB/step",
        "bytes vs DDP",
        "ms/step",
        "speedup vs DDP",
        "MB across/node/step" if env.get("nodes") else "MB on wire/step",
        "compress ms/step",
        "held-out loss",
        "loss vs DDP",
        "max param diff vs DDP",
        "status",
    ]
    body = []
    for r in rows:
        if r["status"] != "ok":
            body.append([r["method"], *["-"] * 9, f"{r['status']}: {short(r.get('reason', ''))}"])
            continue
        body.append(
            [
                r["method"],
                f"{r['bytes_per_step'] / 1e6:.2f}",
                f"{r['bytes_per_step'] / base['bytes_per_step']:.1%}" if base else "-",
                f"{r['median_step_s'] * 1e3:.1f}",
                f"{base['median_step_s'] / r['median_step_s']:.2f}x" if base else "-",
                f"{r['wire_bytes_per_step'] / 1e6:.2f}" if "wire_bytes_per_step" in r else "-",
                f"{r['compress_s_per_step'] * 1e3:.1f}" if "compress_s_per_step" in r else "-",
                f"{r['eval_loss']:.4f}",
                f"{r['eval_loss'] / base['eval_loss'] - 1:+.2%}" if base else "-",
                f"{r['max_param_diff']:.1e}" if "max_param_diff" in r else "-",
                "ok" if r.get("replicas_identical", True) else "ok, but replicas differ",
            ]
        )
    lines += ["", table(headers, body, markdown), ""]
    lines += _eval_table(rows, base, markdown)
    lines += _drift_table(rows, markdown)
    lines += _probe_table(rows, markdown)
    lines += [f"{r['method']}: {_legend(r['method'])}{_decided(r)}" for r in rows]
    lines += [
        "MB/step: ddpcomm's own count (state.stats()); DDP and torch's hooks by their wire "
        "format. ms/step: median over steps after the warm-up, slowest rank."
    ]
    if "network namespaces" not in env["link"] and not env["link"].startswith("torchrun"):
        lines.append(
            "On loopback the link is not the limit: step times show compute overhead, not "
            "wire savings (see 'collectives --link 1gbit' for a shaped link)."
        )
    lines += [f"warning: {w}" for w in env.get("warnings", [])]
    return "\n".join(lines)


def _eval_table(rows: list[dict], base: dict | None, markdown: bool) -> list[str]:
    """Held-out loss after a sixth, half and all of the steps, the final gap to DDP's
    default, and how many times fewer bytes than DDP's the method sent over the run and
    once past its warm-up and ramp (results written before these points were scored have
    none)."""
    ok = [r for r in rows if r["status"] == "ok" and len(r.get("eval_losses", ())) > 1]
    if not ok:
        return []

    def fewer(r: dict, key: str) -> str:
        return f"{base['bytes_per_step'] / r[key]:.1f}x" if base and r.get(key) else "-"

    points = [s for s, _ in ok[0]["eval_losses"]]
    headers = ["method", *[f"held-out @{s}" for s in points], "gap to DDP"]
    headers += ["fewer bytes: run", "after warm-up"]
    body = [
        [
            r["method"],
            *[f"{v:.4f}" for _, v in r["eval_losses"]],
            f"{r['eval_loss'] / base['eval_loss'] - 1:+.2%}" if base else "-",
            fewer(r, "bytes_per_step"),
            fewer(r, "bytes_per_step_settled"),
        ]
        for r in ok
    ]
    return [table(headers, body, markdown), ""]


def _drift_table(rows: list[dict], markdown: bool) -> list[str]:
    """Where each method's weights ended away from DDP's, by parameter kind (``drift``)."""
    ok = [r for r in rows if r["status"] == "ok" and "drift" in r]
    if not ok:
        return []
    kinds = sorted(ok[0]["drift"])
    body = [[r["method"], *[f"{r['drift'].get(k, math.nan):.2f}" for k in kinds]] for r in ok]
    note = "distance from DDP's final weights over DDP's own distance from the start:"
    return [note, "", table(["method", *kinds], body, markdown), ""]


def _probe_table(rows: list[dict], markdown: bool) -> list[str]:
    """--probe-every: the reduced gradient's relative error by parameter kind."""
    ok = [r for r in rows if r["status"] == "ok" and "probe" in r]
    if not ok:
        return []
    kinds = sorted(ok[0]["probe"]["second_half"])
    body = [
        [
            f"{r['method']} ({half.replace('_', ' ')})",
            *[f"{r['probe'][half][k]:.3f}" for k in kinds],
        ]
        for r in ok
        for half in ("first_half", "second_half")
    ]
    note = "reduced gradient against the exact mean, ||error|| / ||mean||, by parameter kind:"
    return [note, "", table(["method", *kinds], body, markdown), ""]


def gaps_by_seed(results: list[dict], markdown: bool = False) -> str:
    """Final held-out-loss gap to DDP's default of each method in each of several train
    results (one per seed, say), with the mean and range: a single run's gap moves with
    the training trajectory, which any perturbation of the gradients changes."""
    seeds, gaps = [], {}
    for result in results:
        rows = [r for r in result["rows"] if r["status"] == "ok"]
        base = next(r["eval_loss"] for r in rows if r["method"] == "ddp")
        seeds.append(str(result["args"]["seed"]))
        for r in rows:
            gaps.setdefault(r["method"], {})[seeds[-1]] = r["eval_loss"] / base - 1
    headers = ["method", *[f"seed {s}" for s in seeds], "mean", "min", "max"]
    body = []
    for method, by_seed in gaps.items():
        values = list(by_seed.values())
        body.append(
            [
                method,
                *[f"{by_seed[s]:+.2%}" if s in by_seed else "-" for s in seeds],
                *[f"{v:+.2%}" for v in (statistics.fmean(values), min(values), max(values))],
            ]
        )
    return table(headers, body, markdown)


def _decided(row: dict) -> str:
    """What adaptive pass-through decided, by bucket size class; the node layout."""
    if "hierarchy" in row:
        return f"; {row['hierarchy']['why']}"
    if "adaptive" not in row:
        return ""
    found = {"compressed": 0, "plain": 0, "probing": 0}
    for c in row["adaptive"]["classes"]:
        found[c["decision"]] += 1
    buckets = row["adaptive"]["buckets"]
    probing = f", {found['probing']} still probing" if found["probing"] else ""
    return (
        f"; decided: {found['compressed']} size classes compressed, {found['plain']} plain"
        f"{probing} (timed steps: {buckets['compressed']} buckets compressed, "
        f"{buckets['plain']} plain)"
    )


def _legend(method: str) -> str:
    own = {
        "nocomm": "no gradient exchange (each rank trains alone: the compute floor)",
        "ddp": "DDP's default (fp32 all_reduce, no hook)",
    }
    return own.get(method) or _methods.describe(method)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: benchmark machines have no display
    import matplotlib.pyplot as plt

    env, ok = result["environment"], [r for r in result["rows"] if r["status"] == "ok"]
    fig, (ax_loss, ax_time) = plt.subplots(
        1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [3, 2]}
    )
    for i, r in enumerate(ok):
        if r["method"] == "nocomm":
            continue  # each rank trains alone: its loss is not comparable
        steps = range(1, len(r["loss"]) + 1)
        # One step's loss on a small batch is noisy: faint raw curve, bold 10-step average.
        avg = [statistics.fmean(r["loss"][max(0, j - 9) : j + 1]) for j in range(len(r["loss"]))]
        style = dict(color=f"C{i % 10}", ls=("-", "--", ":")[i // 10 % 3])  # 10 colours
        ax_loss.plot(steps, r["loss"], lw=0.6, alpha=0.3, **style)
        ax_loss.plot(steps, avg, lw=1.5, label=r["method"], **style)
    ax_loss.set(xlabel="step", ylabel="training loss (bold: 10-step average)", title="loss vs step")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)
    ms = [r["median_step_s"] * 1e3 for r in ok]
    bars = ax_time.barh([r["method"] for r in ok], ms, color=[f"C{i % 10}" for i in range(len(ok))])
    ax_time.bar_label(bars, labels=[f"{v:.0f} ms" for v in ms], fontsize=8, padding=2)
    ax_time.invert_yaxis()
    ax_time.set(xlabel="median step time (ms)", title="step time (nocomm: compute only)")
    ax_time.set_xlim(0, max(ms, default=1) * 1.25)
    ax_time.grid(axis="x", alpha=0.3)
    fig.suptitle(f"{env['model'].split(':')[0]}; {env['world']} ranks; {env['link']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
