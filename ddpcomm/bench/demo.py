"""``python -m ddpcomm.bench demo``: the main job, with nothing to configure.

A preset of ``train``: a small GPT on 2 gloo ranks on the CPU, trained with DDP's
default, torch's own compression hooks and ddpcomm's, one table at the end.
"""

from __future__ import annotations

import argparse

from ddpcomm.bench import netns, train
from ddpcomm.compressors import SPARSE_SCHEDULE

DESCRIPTION = """\
Trains the same small GPT from the same start on 2 gloo ranks on this CPU with DDP's
default all_reduce, torch's fp16_compress_hook and quantization_pertensor_hook, and
ddpcomm's q8, q4 and top-k 1%, then prints one table: bytes each rank sends per step and
their share of DDP's, median step time, held-out loss, and the largest parameter
difference from DDP's default. torch's quantization hook fails on gloo; its row says why.
On loopback the link is not the limit. Where it can create network namespaces (as root),
it then trains DDP's default, q8 and q4 again over a real, shaped 1 Gbit/s link and
prints their step times and speedups; otherwise it says why it skipped that part.
Takes one to two minutes."""

# torch-qpt last: a failed case restarts the ranks for the cases after it.
METHODS = ["ddp", "torch-fp16", "q8", "q4", "topk:0.01", "torch-qpt"]
MODEL = {"d_model": 128, "layers": 2, "heads": 4, "vocab": 512, "seq": 32, "batch": 4}
# Over the link, a model whose gradients take longer on a 1 Gbit/s wire than its compute
# (about 13 MiB of fp32 gradients: some 220 ms of all_reduce per step), as in real jobs.
LINK, LINK_METHODS = "1gbit", ["ddp", "q8", "q4"]
LINK_MODEL = dict(MODEL, d_model=256, layers=4)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="start here: train a small model on 2 CPU ranks with each method, one table",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=440, help="training steps per method (default 440)")
    p.add_argument(
        "--out", metavar="PATH", help="write the results (with loss curves) as JSON to PATH"
    )
    p.add_argument(
        "--plot", metavar="PATH", help="write a PNG of loss vs step and step time to PATH"
    )
    p.add_argument("--quick", action="store_true", help="20 steps per method: checks that it runs")
    p.set_defaults(func=run)


def _timed_from(steps: int) -> int:
    """The first step counted in step times and bytes: the end of top-k's default schedule
    (200 plain, then 200 ramp iterations), or step 5 of a run too short to time after it."""
    schedule = sum(SPARSE_SCHEDULE)
    return schedule if steps >= schedule + 20 else min(5, steps - 1)


def _preset(args, methods: list[str], steps: int, link: str | None, suffix: str):
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    preset = parser.parse_args([])  # train's defaults, then the demo's model and methods
    vars(preset).update(LINK_MODEL if link else MODEL, methods=methods, steps=steps, link=link)
    vars(preset).update(
        warmup_steps=_timed_from(steps),
        out=args.out and args.out.replace(".json", suffix + ".json"),
        plot=args.plot and args.plot.replace(".png", suffix + ".png"),
    )
    return preset


def run(args) -> int:
    steps = 20 if args.quick else args.steps
    print("== On loopback: the link is not the limit; bytes and accuracy are the point")
    status = train.run(_preset(args, METHODS, steps, None, ""), command="demo")
    reason = netns.unavailable_reason()
    if reason is not None:
        print(f"== Skipped the run over a shaped {LINK} link: {reason}")
        return status
    print(f"== Over a real {LINK} link (network namespaces + tc tbf): step time is the point")
    link_steps = 10 if args.quick else 30
    preset = _preset(args, LINK_METHODS, link_steps, LINK, "_" + LINK)
    return train.run(preset, command="demo") or status


report = train.report  # a demo result is a train result
