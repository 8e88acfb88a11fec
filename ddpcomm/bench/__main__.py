"""``python -m ddpcomm.bench <command>``: the benchmark CLI.

Each command is a module with ``add_parser(subparsers)`` (which sets ``func``) and
``report(result, markdown=False)``, the table of a result it wrote with ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# In the order --help lists them.
COMMANDS = ["demo", "kernels", "sparse", "coalesced", "collectives", "train", "fsdp"]

DESCRIPTION = """\
Benchmarks of ddpcomm, each measured side by side with what PyTorch already offers (DDP's
default all_reduce, torch's compression hooks, torch's own ops) in the same run, so that
every comparison is a ratio taken on one machine at one time. Each command prints one
table; --out PATH also writes the results as JSON. Nothing is written unless asked."""

EPILOG = """\
Every command has --help and --quick (a small run that checks it works). Examples:
  python -m ddpcomm.bench demo
  python -m ddpcomm.bench kernels --sizes 64 --out kernels.json
  python -m ddpcomm.bench collectives --world 2 --sizes 64 --methods allreduce,q8,q4
  python -m ddpcomm.bench train --link 1gbit --plot train.png     # as root: a shaped link
  torchrun --nproc_per_node 8 -m ddpcomm.bench collectives         # NCCL on 8 GPUs"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddpcomm.bench",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    argv = sys.argv[1:] if argv is None else argv
    # Only the command asked for is imported (each pulls in more of torch); --help: all.
    for name in argv[:1] if argv[:1] and argv[0] in COMMANDS else COMMANDS:
        importlib.import_module(f"ddpcomm.bench.{name}").add_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
