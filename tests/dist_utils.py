"""Spawned gloo process groups for multi-rank tests.

``run_ranks(fn, world, *args)`` starts ``world`` processes, each with a gloo group over a
file store and one thread, runs ``fn(rank, world, *args)`` in every one and returns their
results in rank order. A failure on any rank raises here with that rank's traceback; a
hang becomes a timeout error instead of a stuck test run.
"""

import datetime
import os
import queue
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(fn, rank, world, store, results, args):
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=120),
        )
        try:
            out = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world: int, *args, timeout: float = 240.0) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, store, results, args))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        out, error = {}, None
        try:
            for _ in range(world):
                rank, ok, value = results.get(timeout=timeout)
                if not ok:
                    error = f"rank {rank} failed:\n{value}"
                    break
                out[rank] = value
        except queue.Empty:
            error = f"ranks timed out after {timeout:.0f}s"
        finally:
            for p in procs:
                p.join(timeout=0.5 if error else 10)
                if p.is_alive():
                    p.kill()
                    p.join()
    if error:
        raise RuntimeError(error)
    return [out[r] for r in range(world)]
