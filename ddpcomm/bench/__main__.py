"""``python -m ddpcomm.bench <command>``: ddpcomm's benchmarks and demo.

Each command lives in its own module exposing ``add_parser(subparsers)``, which registers
the command and sets ``func`` to the function that runs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Command modules, in the order `--help` lists them.
COMMANDS = ["demo", "kernels"]
# Fused flatten + all_reduce_coalesced against per-tensor and torch-flatten all_reduces.
COMMANDS.append("coalesced")
COMMANDS += ["sparse"]  # sparsification: top-k / random-k
# Every method over shaped links: one bucket per call, and end-to-end DDP training.
COMMANDS += ["collectives", "train"]
COMMANDS += ["fsdp"]  # FSDP2 reduce-scatter and training


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddpcomm.bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        importlib.import_module(f"ddpcomm.bench.{name}").add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
