"""Experiment: ddpcomm's 2-rank quantized all-reduce with its all_gather split in chunks.

gloo moves one large all_gather between two ranks at ~80 MB/s on a 119 MB/s link, but
the same bytes as 8 back-to-back async all_gathers at line rate
(benchmarks/gloo_primitives.py). This measures what that would buy ddpcomm end to end,
by swapping ``ddpcomm.collectives._all_gather_single`` for a chunked version in the
benchmark ranks only. It changes nothing in ddpcomm; run as root:

    .venv/bin/python benchmarks/chunked_allgather.py --link 1gbit --sizes 64
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch


class _Done:
    """Work-like handle of a collective that has already completed."""

    def __init__(self, output: torch.Tensor) -> None:
        self._fut = torch.futures.Future()
        self._fut.set_result([output])

    def get_future(self):
        return self._fut

    def wait(self) -> bool:
        return True


def chunked_all_gather(chunks: int):
    import torch.distributed as dist

    def all_gather_single(output, input, group=None, async_op=False):
        world = dist.get_world_size(group)
        n = input.numel()
        bounds = [n * i // chunks for i in range(chunks + 1)]
        out = output.view(world, n)
        works, copies = [], []
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            # Each chunk gathers into its own buffer (all_gather needs a contiguous
            # output); the copies into the [world, n] layout run once all have arrived.
            buf = torch.empty(world * (hi - lo), dtype=input.dtype, device=input.device)
            works.append(dist.all_gather_into_tensor(buf, input[lo:hi], group=group, async_op=True))
            copies.append((buf, lo, hi))
        for w in works:
            w.wait()
        for buf, lo, hi in copies:
            out[:, lo:hi].copy_(buf.view(world, hi - lo))
        # Waiting here makes the call synchronous: fine for timing one bucket per call
        # (the benchmark waits for the hook's future anyway), not for overlapping buckets.
        return _Done(output) if async_op else None

    return all_gather_single


def worker() -> None:
    from ddpcomm import collectives
    from ddpcomm.bench import _worker, _worker_collectives

    def run_case(case, common, device):
        original = collectives._all_gather_single
        if case["chunks"] > 1:
            collectives._all_gather_single = chunked_all_gather(case["chunks"])
        try:
            return dict(_worker_collectives.run_case(case, common, device), chunks=case["chunks"])
        finally:
            collectives._all_gather_single = original

    _worker.run(run_case)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--link", default="1gbit")
    p.add_argument("--sizes", type=float, nargs="+", default=[64.0])
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--chunks", type=int, default=8)
    args = p.parse_args()

    from ddpcomm.bench import netns
    from ddpcomm.bench._launch import run_group
    from ddpcomm.bench.collectives import MIB, bucket_shapes, formula_bytes

    cases = []
    for size in args.sizes:
        numel = int(size * MIB) // 4
        shapes = bucket_shapes(numel)
        for method, chunks in [
            ("allreduce", 1),
            ("q8", 1),
            ("q8", args.chunks),
            ("q4", 1),
            ("q4", args.chunks),
        ]:
            cases.append(
                {
                    "method": method,
                    "chunks": chunks,
                    "world": 2,
                    "size_mib": size,
                    "numel": numel,
                    "shapes": shapes,
                    "iters": args.iters,
                    "warmup": 1,
                    "formula_bytes": formula_bytes(method, shapes, 2),
                    "label": f"{size:g} MiB {method} chunks={chunks}",
                }
            )
    links, note = netns.open_links(2, args.link)
    with links:
        print(links.describe(), flush=True)
        outcome = run_group(
            "benchmarks.chunked_allgather",
            2,
            links,
            cases,
            {"pg_timeout": 300, "threads": 1, "ifname": links.ifname},
            lambda c: 300,
            1,
        )
    if outcome.failure:
        print(f"failed: {outcome.failure.case['label']}: {outcome.failure.reason}")
    plain = {r["size_mib"]: r["median_s"] for r in outcome.results if r["method"] == "allreduce"}
    for r in outcome.results:
        print(
            f"{r['size_mib']:6g} MiB  {r['method']:9s} chunks {r['chunks']}  "
            f"{r['median_s'] * 1e3:7.1f} ms  compress {r.get('compress_s', 0) * 1e3:5.1f} ms  "
            f"{plain[r['size_mib']] / r['median_s']:5.2f}x  rel err {r['rel_error']:.2e}  "
            f"ranks identical {r['ranks_identical']}  "
            f"(times {', '.join(f'{t * 1e3:.0f}' for t in r['times_s'])}; "
            f"median of {len(r['times_s'])}: {statistics.median(r['times_s']) * 1e3:.1f})"
        )
    return 1 if outcome.failure else 0


if __name__ == "__main__":
    if os.environ.get("DDPCOMM_BENCH_CONFIG"):  # a rank started by run_group
        worker()
    else:
        sys.exit(main())
