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

    rep = x.repeat(world)  # every rank's all_to_all input: its payload once per peer
    a2a_out = torch.empty(world * nb, dtype=torch.uint8)

    chunks = 8
    piece = nb // chunks
    pieces_in = [x[i * piece : (i + 1) * piece] for i in range(chunks)]
    pieces_out = [torch.empty(world * piece, dtype=torch.uint8) for _ in range(chunks)]

    def chunked_all_gather():
        # The same bytes as 8 all_gathers issued back to back without waiting in between:
        # does pipelining help gloo the way its chunked all_reduce does?
        works = [
            dist.all_gather_into_tensor(o, i, async_op=True)
            for i, o in zip(pieces_in, pieces_out, strict=True)
        ]
        for w in works:
            w.wait()

    prims = {
        "all_reduce (fp32, same tensor bytes)": lambda: dist.all_reduce(f),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, x),
        "all_gather (list)": lambda: dist.all_gather(outs, x),
        "all_gather_into_tensor, 8 async chunks": chunked_all_gather,
        "batch_isend_irecv": p2p,
        "all_to_all_single (payload x N)": lambda: dist.all_to_all_single(a2a_out, rep),
    }
    for name, fn in prims.items():
        ts = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        # Bytes each rank sends: a ring all_reduce 2(N-1)/N of the tensor, every other
        # primitive here its payload to each of the N-1 peers.
        sent = 2 * (world - 1) / world * nb if name.startswith("all_reduce") else (world - 1) * nb
        med = statistics.median(ts)
        if rank == 0:
            print(
                f"{mb:8.1f} MB/rank  {name:40s} {med * 1e3:8.1f} ms  "
                f"sends {sent / 1e6:6.1f} MB = {sent / med / 1e6:6.1f} MB/s",
                flush=True,
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
