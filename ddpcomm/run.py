"""``python -m ddpcomm.run [OPTIONS] COMMAND [ARGS...]``: compress DDP without editing the script.

Runs COMMAND (``torchrun ... train.py``, ``python train.py`` that spawns its own ranks,
``accelerate launch ...``) so that every ``DistributedDataParallel`` built in any Python
process it starts gets ``ddpcomm.compress_hook`` (see ``ddpcomm.autohook`` for the rules).
The options are also read from the environment, for job templates that cannot change
the command line: ``DDPCOMM_COMPRESSION``, ``DDPCOMM_START_ITER``, ``DDPCOMM_MIN_NUMEL``,
``DDPCOMM_OPTIONS``. A bad spec or option fails here, before any rank starts.

Example::

    python -m ddpcomm.run --compression q4 torchrun --nproc-per-node 8 train.py
    DDPCOMM_COMPRESSION=topk:0.01 python -m ddpcomm.run python train.py
"""

from __future__ import annotations

import argparse
import os
import sys

from ddpcomm import autohook

SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")


def environment(args: argparse.Namespace, base=os.environ) -> dict:
    """The environment COMMAND runs in: the options as variables, the startup hook on
    PYTHONPATH. Raises ValueError for a bad spec or option."""
    env = dict(base)
    for value, name in (
        (args.compression, autohook.ENV_COMPRESSION),
        (args.start_iter, autohook.ENV_START_ITER),
        (args.min_numel, autohook.ENV_MIN_NUMEL),
    ):
        if value is not None:
            env[name] = str(value)
    if args.option:
        env[autohook.ENV_OPTIONS] = ",".join(args.option)
    autohook.config_from_env(env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE]
    env["PYTHONPATH"] = os.pathsep.join([SITE, *paths])
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddpcomm.run",
        description="Run a command so that every DDP model in it compresses its gradients "
        "with ddpcomm, without editing the script.",
        epilog="Example: python -m ddpcomm.run --compression q4 torchrun --nproc-per-node 8 "
        "train.py. Every option can also come from the environment: DDPCOMM_COMPRESSION, "
        "DDPCOMM_START_ITER, DDPCOMM_MIN_NUMEL, DDPCOMM_OPTIONS.",
    )
    parser.add_argument(
        "--compression",
        help="spec string: q8, q4, q2, q1, topk:R, randk:R, ...; append ',adaptive' to send "
        "plain where compression does not pay",
    )
    parser.add_argument("--start-iter", type=int, help="plain all_reduce before this iteration")
    parser.add_argument("--min-numel", type=int, help="buckets smaller than this go plain")
    parser.add_argument(
        "--option",
        action="append",
        metavar="NAME=VALUE",
        help="a method option, e.g. block_size=128 or error_feedback=true (repeatable)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("no command given")
    try:
        env = environment(args)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    try:
        os.execvpe(args.command[0], args.command, env)
    except OSError as exc:
        print(f"ddpcomm.run: cannot run {args.command[0]!r}: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
