"""``python -m ddpcomm.bench demo``: the main job, with nothing to configure.

A preset of ``train``: a small GPT on 2 gloo ranks on the CPU, trained with DDP's
default, torch's own compression hooks and ddpcomm's, one table at the end.
"""

from __future__ import annotations

import argparse

from ddpcomm.bench import train

DESCRIPTION = """\
Trains the same small GPT from the same start on 2 gloo ranks on this CPU with DDP's
default all_reduce, torch's fp16_compress_hook and quantization_pertensor_hook, and
ddpcomm's q8, q4 and top-k 1%, then prints one table: bytes each rank sends per step and
their share of DDP's, median step time, held-out loss, and the largest parameter
difference from DDP's default. torch's quantization hook fails on gloo; its row says why.
Takes about a minute."""

# torch-qpt last: a failed case restarts the ranks for the cases after it.
METHODS = ["ddp", "torch-fp16", "q8", "q4", "topk:0.01", "torch-qpt"]
MODEL = {"d_model": 128, "layers": 2, "heads": 4, "vocab": 512, "seq": 32, "batch": 4}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="start here: train a small model on 2 CPU ranks with each method, one table",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=100, help="training steps per method (default 100)")
    p.add_argument(
        "--out", metavar="PATH", help="write the results (with loss curves) as JSON to PATH"
    )
    p.add_argument(
        "--plot", metavar="PATH", help="write a PNG of loss vs step and step time to PATH"
    )
    p.add_argument("--quick", action="store_true", help="20 steps per method: checks that it runs")
    p.set_defaults(func=run)


def run(args) -> int:
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    preset = parser.parse_args([])  # train's defaults, then the demo's model and methods
    vars(preset).update(MODEL, methods=METHODS, steps=20 if args.quick else args.steps)
    vars(preset).update(warmup_steps=min(5, preset.steps - 1), out=args.out, plot=args.plot)
    return train.run(preset, command="demo")


report = train.report  # a demo result is a train result
