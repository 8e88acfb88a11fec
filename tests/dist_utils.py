"""Spawned gloo process groups for multi-rank tests.

``run_ranks(fn, world, *args)`` starts ``world`` processes, each with a gloo group over a
file store and one thread, runs ``fn(rank, world, *args)`` in every one and returns their
results in rank order. A failure on any rank raises here with that rank's traceback; a
hang becomes a timeout error instead of a stuck test run.
"""

from ddpcomm.bench._spawn import spawn


def run_ranks(fn, world: int, *args, timeout: float = 240.0) -> list:
    return spawn(fn, world, *args, threads=1, timeout=timeout)
