"""How much a rank's own computing slows its gloo traffic, on this machine.

The collectives bench's overlap ratio (call time over the larger of wire-only and codec
alone) is 1.00 only if a method's wire runs at line rate while its ranks compress and
decode. Two ranks on a shaped link (``ddpcomm.bench.netns``, as ``bench collectives
--link``) all-gather PIECES pieces of BYTES each, as the quantizers' pipelined path sends
them, with MS milliseconds of work before each piece is issued: ``none`` (the wire alone),
``cpu`` (small matrix products, no memory traffic) or ``memory`` (256 KiB copies, a
streaming pass like the codecs'). Each rank runs one torch thread, as the bench does.
Printed per kind: the median call time, when the first piece landed, and the call time
over max(wire alone, the work alone), the ratio a codec with that much work in this
pattern could reach at best here. Run as root: ``python benchmarks/wire_under_load.py
[--link 1gbit] [--pieces 8] [--bytes 557056] [--ms 2.5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

KINDS = ("none", "cpu", "memory")


def _work(kind: str, ms: float, x, y, a) -> None:
    import torch

    end = time.perf_counter() + ms / 1e3
    chunk, at = 1 << 16, 0
    while time.perf_counter() < end:
        if kind == "cpu":
            torch.mm(a, a)
        else:
            y[at : at + chunk].copy_(x[at : at + chunk])
            at = (at + chunk) % (x.numel() - chunk)


def _rank(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=2)
    n, pieces = args.bytes, args.pieces
    send = torch.zeros(pieces * n, dtype=torch.uint8)
    recv = torch.zeros(2 * pieces * n, dtype=torch.uint8)
    x, a = torch.randn(16 << 20), torch.randn(96, 96)
    y = torch.empty_like(x)

    def call(kind: str) -> tuple[float, float]:
        landed = []
        dist.barrier()
        t0 = time.perf_counter()
        futures = []
        for i in range(pieces):
            if kind != "none":
                _work(kind, args.ms, x, y, a)
            out, mine = recv[2 * n * i : 2 * n * (i + 1)], send[n * i : n * (i + 1)]
            work = dist.all_gather_into_tensor(out, mine, async_op=True)
            futures.append(work.get_future().then(lambda f: landed.append(time.perf_counter())))
        for f in futures:
            f.wait()
        return time.perf_counter() - t0, min(landed) - t0

    def alone(kind: str) -> float:
        t0 = time.perf_counter()
        for _ in range(pieces):
            _work(kind, args.ms, x, y, a)
        return time.perf_counter() - t0

    rows = {}
    for kind in KINDS:
        call(kind)  # warm-up
        timed = [call(kind) for _ in range(args.repeats)]
        rows[kind] = {
            "ms": 1e3 * statistics.median(t for t, _ in timed),
            "first_landed_ms": 1e3 * statistics.median(f for _, f in timed),
            "work_alone_ms": 0.0 if kind == "none" else 1e3 * alone(kind),
        }
    if args.rank == 0:
        print(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--link", default="1gbit")
    p.add_argument("--pieces", type=int, default=8)
    p.add_argument("--bytes", type=int, default=557056, help="per piece and rank")
    p.add_argument("--ms", type=float, default=2.5, help="work before each piece")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        return _rank(args)
    from ddpcomm.bench.netns import Links

    forward = [f"--{k}={v}" for k, v in vars(args).items() if k != "rank"]
    with Links(2, args.link) as links:
        env = dict(os.environ, MASTER_ADDR=links.address(0), MASTER_PORT="29561")
        env["GLOO_SOCKET_IFNAME"] = links.ifname
        procs = [
            subprocess.Popen(
                [*links.prefix_command(r), sys.executable, __file__, *forward, f"--rank={r}"],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        out = [proc.communicate()[0] for proc in procs]
        if any(proc.returncode for proc in procs):
            sys.exit(f"a rank failed: exit codes {[proc.returncode for proc in procs]}")
    rows = json.loads(out[0].strip().splitlines()[-1])
    wire = rows["none"]["ms"]
    print(f"{args.pieces} pieces of {args.bytes} bytes all-gathered by 2 ranks over {args.link}, "
          f"{args.ms} ms of work before each; medians of {args.repeats} calls")  # fmt: skip
    head = ("work", "call ms", "first piece ms", "work alone ms", "ratio")
    print(f"{head[0]:8s} {head[1]:>8s} {head[2]:>15s} {head[3]:>14s} {head[4]:>6s}")
    for kind, r in rows.items():
        ratio = r["ms"] / max(wire, r["work_alone_ms"])
        print(f"{kind:8s} {r['ms']:8.1f} {r['first_landed_ms']:15.1f} "
              f"{r['work_alone_ms']:14.1f} {ratio:6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
