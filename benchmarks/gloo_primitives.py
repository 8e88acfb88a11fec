"""Times gloo's primitives for the same bytes per rank, over a shaped link or loopback.

Used to explain where ddpcomm's collective time goes beyond bytes/rate: the quantized
all-gather path rides on ``all_gather_into_tensor``, whose gloo implementation costs
far more per byte than ``all_reduce`` on CPU. Run as root:

    .venv/bin/python benchmarks/gloo_primitives.py --link 1gbit --mbytes 17 34
    .venv/bin/python benchmarks/gloo_primitives.py --mbytes 17 34        # loopback
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def _time_primitives(mb: float, iters: int) -> None:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    nb = int(mb * 1e6) // 4 * 4
    x = torch.ones(nb, dtype=torch.uint8)
    out = torch.empty(world * nb, dtype=torch.uint8)
    f = torch.ones(nb // 4)
    outs = [torch.empty(nb, dtype=torch.uint8) for _ in range(world)]

    def p2p():
        # Every rank sends its payload to every other rank: an all-gather by hand.
        ops = []
        for peer in range(world):
            if peer != rank:
                ops.append(dist.P2POp(dist.isend, x, peer))
                ops.append(dist.P2POp(dist.irecv, outs[peer], peer))
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    prims = {
        "all_reduce (fp32, same bytes)": lambda: dist.all_reduce(f),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, x),
        "all_gather (list)": lambda: dist.all_gather(outs, x),
        "batch_isend_irecv": p2p,
    }
    for name, fn in prims.items():
        ts = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        if rank == 0:
            print(
                f"{mb:8.1f} MB/rank  {name:32s} {statistics.median(ts) * 1e3:8.1f} ms", flush=True
            )


def rank_main(mbytes: list[float], iters: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for mb in mbytes:
        _time_primitives(mb, iters)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--link", default=None)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--mbytes", type=float, nargs="+", default=[17.0])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_main:
        rank_main(args.mbytes, args.iters)
        return 0
    from ddpcomm.bench import netns

    links, note = netns.open_links(args.world, args.link)
    with links if links is not None else open(os.devnull):
        print(links.describe() if links else note, flush=True)
        procs = []
        for r in range(args.world):
            env = dict(
                os.environ,
                RANK=str(r),
                WORLD_SIZE=str(args.world),
                MASTER_PORT="29611",
                MASTER_ADDR=links.address(0) if links else "127.0.0.1",
                GLOO_SOCKET_IFNAME=links.ifname if links else "lo",
            )
            prefix = links.prefix_command(r) if links else []
            cmd = [
                *prefix,
                sys.executable,
                __file__,
                "--rank-main",
                "--iters",
                str(args.iters),
                "--mbytes",
                *map(str, args.mbytes),
            ]
            procs.append(subprocess.Popen(cmd, env=env))
        return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
