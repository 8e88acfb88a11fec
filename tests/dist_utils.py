"""Spawned gloo process groups for multi-rank tests.

``run_ranks(fn, world, *args)`` starts ``world`` processes, each with a gloo group over a
file store and one thread, runs ``fn(rank, world, *args)`` in every one and returns their
results in rank order. A failure on any rank raises here with that rank's traceback; a
hang becomes a timeout error instead of a stuck test run.

``pg_timeout`` (seconds) gives the process group a short timeout, so a test of a failure
(a mismatch, a dead rank) fails fast instead of hanging when it regresses. With
``allow_exit=True`` a rank that ends without reporting (``os._exit``, killed) gets
``EXITED`` as its result instead of failing the run.
"""

import datetime
import faulthandler
import os
import queue
import signal
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

EXITED = "<exited without a result>"


def run_ranks(
    fn,
    world: int,
    *args,
    timeout: float = 240.0,
    pg_timeout: float | None = None,
    allow_exit: bool = False,
) -> list:
    return _spawn(fn, world, args, timeout, pg_timeout or 120.0, allow_exit)


def run_checks(rank: int, world: int, checks) -> dict:
    """In a spawned rank: ``{check.__name__: check(rank, world)}`` for every check in
    order, a check that raises recorded as ``{"error": traceback}`` (its test reports it)."""
    out = {}
    for check in checks:
        try:
            out[check.__name__] = check(rank, world)
        except Exception:  # noqa: BLE001 - reported by the test of that check
            out[check.__name__] = {"error": traceback.format_exc()}
    return out


def _entry(fn, rank, world, store, pg_timeout, results, args):
    # A rank the parent gives up on prints every thread's stack first (to the test's
    # captured stderr), so a hang says where it was.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))
    # No destroy_process_group: after a failure test the group may be unusable and its
    # teardown could wait on a peer that is gone. Flush the result, then exit at once.
    results.close()
    results.join_thread()
    os._exit(0)


def _spawn(fn, world, args, timeout, pg_timeout, allow_exit) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, store, pg_timeout, results, args))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out, error = {}, None
        try:
            while len(out) < world:
                try:
                    rank, ok, value = results.get(timeout=1.0)
                except queue.Empty:
                    timeout -= 1.0
                    if timeout <= 0:
                        error = f"ranks timed out; results from {sorted(out)} only"
                        _dump_stacks(procs, out)
                        break
                    if allow_exit:
                        for r, p in enumerate(procs):
                            if r not in out and not p.is_alive() and results.empty():
                                out[r] = EXITED
                    continue
                if not ok:
                    error = f"rank {rank} failed:\n{value}"
                    break
                out[rank] = value
        finally:
            for p in procs:
                p.join(timeout=0.5 if error else 10)
                if p.is_alive():
                    p.kill()
                    p.join()
    if error:
        raise RuntimeError(error)
    return [out[r] for r in range(world)]


def _dump_stacks(procs, reported) -> None:
    """Asks every rank that has not reported to print its threads' stacks (SIGUSR1,
    registered in ``_entry``), and gives them a moment to write before they are killed."""
    for r, p in enumerate(procs):
        if r not in reported and p.is_alive():
            os.kill(p.pid, signal.SIGUSR1)
    time.sleep(2.0)
