"""``python -m ddpcomm.run [OPTIONS] COMMAND [ARGS...]``: compress DDP without editing the script.

Runs COMMAND (``torchrun ... train.py``, ``python train.py`` that spawns its own ranks,
``accelerate launch ...``) so that every ``DistributedDataParallel`` built in any Python
process it starts gets ``ddpcomm.compress_hook`` (see ``ddpcomm.autohook`` for the rules).

Settings. The method and its options come from the command line (``--compression``,
``--start-iter``, ``--min-numel``, ``--option``) and from the environment, for job
templates that cannot change the command line (``DDPCOMM_COMPRESSION``,
``DDPCOMM_START_ITER``, ``DDPCOMM_MIN_NUMEL``, ``DDPCOMM_OPTIONS``). All of it is spec
text, read and checked as a spec string given to ``ddpcomm.CompressionState`` is:
``--compression q8,block_size=64`` is ``--compression q8 --option block_size=64``.

- Precedence: per setting, the command line over the environment. The method and each
  option by name: ``DDPCOMM_OPTIONS=block_size=64`` with ``--compression q4`` runs
  ``q4,block_size=64``; ``--option block_size=128`` would replace the 64 alone.
- Contradictions: a setting given twice with different values on the command line
  (``--option start_iter=5 --start-iter 7``), or twice in the environment, is an error
  naming both places; the method is never an ``--option``. An option the environment
  gives that the command line's method does not take is an error, not dropped.
- The launcher prints the resolved spec and where each setting came from, hands COMMAND
  that spec alone in ``DDPCOMM_COMPRESSION`` (the other variables removed), and rank 0
  prints it again at exit with what compression did.

A bad spec or option fails here, before any rank starts. The launcher then runs COMMAND as
its child and exits with its status. Every process that builds a DDP model says so through
a directory named by ``DDPCOMM_RUN_DIR``; when none did (``accelerate launch`` on a machine
without a GPU builds none unless given ``--cpu``), the launcher says so when COMMAND
succeeds, so that a run that compressed nothing never looks like one that did.

Example::

    python -m ddpcomm.run --compression q4 torchrun --nproc-per-node 8 train.py
    DDPCOMM_COMPRESSION=topk:0.01 python -m ddpcomm.run python train.py
    DDPCOMM_OPTIONS=block_size=64 python -m ddpcomm.run --compression q4 python train.py
    # prints: ddpcomm.run: q4,block_size=64 (method from --compression q4, block_size
    # from DDPCOMM_OPTIONS=block_size=64)
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from ddpcomm import autohook

SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
METHOD_FLAGS = f"give --compression or set {autohook.ENV_COMPRESSION}"


def command_line_settings(args: argparse.Namespace) -> dict[str, autohook.Setting]:
    """The settings the command line gives, read by the spec grammar."""
    pieces = []
    if args.compression is not None:
        pieces.append(("spec", f"--compression {args.compression}", args.compression))
    for text in args.option or ():
        pieces.append(("options", f"--option {text}", text))
    for kind, flag, text in (
        ("start_iter", "--start-iter", args.start_iter),
        ("min_numel", "--min-numel", args.min_numel),
    ):
        if text is not None:
            pieces.append((kind, f"{flag} {text}", text))
    return autohook.settings(pieces, "on the command line", "--compression")


def environment(args: argparse.Namespace, base=os.environ) -> tuple[dict, autohook.Resolved]:
    """The environment COMMAND runs in (the resolved spec, the startup hook on
    PYTHONPATH) and the resolved configuration. Raises ValueError or TypeError for a bad
    spec or option, or a contradiction."""
    resolved = autohook.resolve(
        command_line_settings(args), autohook.environment_settings(base), METHOD_FLAGS
    )
    env = {k: v for k, v in base.items() if k not in autohook.ENV_VARIABLES}
    env[autohook.ENV_COMPRESSION] = resolved.spec
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != SITE]
    env["PYTHONPATH"] = os.pathsep.join([SITE, *paths])
    return env, resolved


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ddpcomm.run",
        description="Run a command so that every DDP model in it compresses its gradients "
        "with ddpcomm, without editing the script.",
        epilog="Every setting can also come from the environment: DDPCOMM_COMPRESSION, "
        "DDPCOMM_START_ITER, DDPCOMM_MIN_NUMEL, DDPCOMM_OPTIONS. Per setting (the method, "
        "each option by name) the command line wins over the environment and the rest of "
        "the environment stays; a setting given twice with different values on the "
        "command line, or in the environment, is an error naming both. Example: python -m "
        "ddpcomm.run --compression q4 torchrun --nproc-per-node 8 train.py",
    )
    parser.add_argument(
        "--compression",
        help="spec string: q8, q4, q2, q1.5, q1, topk:R, randk:R, ..., optionally with options "
        "after commas (q8,block_size=64); append ',adaptive' to send plain where "
        "compression does not pay",
    )
    parser.add_argument("--start-iter", help="plain all_reduce before this iteration")
    parser.add_argument("--min-numel", help="buckets smaller than this go plain")
    parser.add_argument(
        "--option",
        action="append",
        metavar="NAME=VALUE",
        help="an option of the method or the hook state, e.g. block_size=128, "
        "error_feedback=true, or hierarchy=auto (multi-node: compress only between nodes, "
        "found from torchrun); a bare NAME means NAME=true (repeatable, or comma-separated)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.error("no command given")
    try:
        env, resolved = environment(args)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    print(f"ddpcomm.run: {resolved.spec} ({resolved.origins})", file=sys.stderr, flush=True)
    reports = tempfile.mkdtemp(prefix="ddpcomm-run-")
    env[autohook.ENV_RUN_DIR] = reports
    try:
        status = _run(args.command, env)
        if status == 0 and not os.listdir(reports):
            print(
                "ddpcomm.run: no DistributedDataParallel model was built in any process "
                f"{args.command[0]!r} started, so nothing was compressed (accelerate, for one, "
                "builds none on a machine without a GPU unless given --cpu or "
                "ACCELERATE_USE_CPU=1)",
                file=sys.stderr,
                flush=True,
            )
    finally:
        shutil.rmtree(reports, ignore_errors=True)
    if status is None:
        return 127
    if status < 0:  # killed by a signal: die of the same one, as a shell reports it
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
        return 128 - status
    return status


def _run(command: list[str], env: dict) -> int | None:
    """Runs ``command`` to its end: its exit status (negative: the signal that ended it),
    or None when it cannot be started. Ctrl-C reaches the command from the terminal (one
    process group), so the launcher ignores it rather than send a second one; SIGTERM and
    SIGHUP, which a job scheduler sends to the launcher alone, are passed on."""
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as exc:
        print(f"ddpcomm.run: cannot run {command[0]!r}: {exc}", file=sys.stderr)
        return None
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    return child.wait()


if __name__ == "__main__":
    sys.exit(main())
