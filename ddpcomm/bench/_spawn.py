"""Spawned gloo process groups on this machine, for benchmarks and the demo."""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(fn, rank, world, store, threads, results, args):
    try:
        torch.set_num_threads(threads)
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


def spawn(fn, world: int, *args, threads: int = 1, timeout: float = 900.0) -> list:
    """Runs ``fn(rank, world, *args)`` in ``world`` gloo ranks; returns results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world, store, threads, results, args))
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
