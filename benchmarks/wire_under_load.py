"""How much a rank's own computing slows its gloo traffic, on this machine.

The collectives bench's overlap ratio (call time over the larger of wire-only and codec
alone) is 1.00 only if a method's wire runs at line rate while its ranks compress and
decode. Two ranks on a shaped link (``ddpcomm.bench.netns``, as ``bench collectives
--link``) all-gather (or all-reduce) PIECES pieces of BYTES each, as the pipelined paths
send them, with work before each piece is issued (its compression: what took MS
milliseconds with both ranks doing only that) and in the callback as it lands (its
decode, LAND_MS, on gloo's thread as the hooks' is): ``none`` (the wire alone), ``cpu``
(a matrix product, no memory traffic) or ``memory`` (a streaming copy, like the codecs'
passes), one torch call each, one torch thread a rank, as the bench runs. Printed per
kind: the median call time, when the first piece landed, and the call time over max(wire
alone, the work alone), the ratio a codec with that much work in this pattern could
reach here. Run as root: ``python benchmarks/wire_under_load.py [--link 1gbit]
[--pieces 8] [--bytes 557056] [--ms 2.5] [--land-ms 0] [--collective all_gather]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

KINDS = ("none", "cpu", "memory")


class _Work:
    """A fixed amount of work of one kind, one torch call (which releases the GIL, as a
    codec's op does): ``run(ms)`` does what took ``ms`` milliseconds when both ranks ran it
    at once with nothing else (as the bench's codec probe runs the codec), so that under
    the network's load it takes longer, as a codec does."""

    def __init__(self, kind: str) -> None:
        import torch
        import torch.distributed as dist

        self.kind = kind
        self.x = torch.randn(16 << 20)
        self.y = self.x.clone()  # its pages touched before the calibration times copies
        self.a, self.w = torch.randn(1 << 16, 96), torch.randn(96, 96)
        self.out = torch.mm(self.a, self.w)
        units = 4 << 20 if kind == "memory" else 1 << 14
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            self._do(units)
            times.append(time.perf_counter() - t0)
        self.per_ms = units / (1e3 * statistics.median(times))

    def _do(self, units: int) -> None:
        import torch

        if self.kind == "memory":  # elements copied
            self.y[:units].copy_(self.x[:units])
        else:  # rows of a product with a 96 x 96 matrix
            torch.mm(self.a[:units], self.w, out=self.out[:units])

    def run(self, ms: float) -> None:
        units = round(ms * self.per_ms)
        limit = self.x.numel() if self.kind == "memory" else self.a.shape[0]
        for at in range(0, units, limit):
            self._do(min(limit, units - at))


def _rank(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=2)
    n, pieces = args.bytes // 4, args.pieces  # float32 elements per piece
    send = torch.zeros(pieces * n)
    recv = torch.zeros(2 * pieces * n)

    def land(work: _Work | None, landed: list, fut) -> None:
        landed.append(time.perf_counter())
        if work is not None:
            work.run(args.land_ms)

    def call(work: _Work | None) -> tuple[float, float]:
        landed = []
        dist.barrier()
        t0 = time.perf_counter()
        futures = []
        for i in range(pieces):
            if work is not None:
                work.run(args.ms)
            mine = send[n * i : n * (i + 1)]
            if args.collective == "all_reduce":
                op = dist.all_reduce(mine, async_op=True)
            else:
                out = recv[2 * n * i : 2 * n * (i + 1)]
                op = dist.all_gather_into_tensor(out, mine, async_op=True)
            futures.append(op.get_future().then(functools.partial(land, work, landed)))
        for f in futures:
            f.wait()
        return time.perf_counter() - t0, min(landed) - t0

    def alone(work: _Work) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        work.run(pieces * (args.ms + args.land_ms))
        return time.perf_counter() - t0

    rows = {}
    for kind in KINDS:
        work = None if kind == "none" else _Work(kind)
        call(work)  # warm-up
        timed = [call(work) for _ in range(args.repeats)]
        rows[kind] = {
            "ms": 1e3 * statistics.median(t for t, _ in timed),
            "first_landed_ms": 1e3 * statistics.median(f for _, f in timed),
            "work_alone_ms": 0.0
            if work is None
            else 1e3 * statistics.median(alone(work) for _ in range(3)),
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
    p.add_argument("--land-ms", type=float, default=0.0, help="work as each piece lands")
    p.add_argument("--collective", choices=("all_gather", "all_reduce"), default="all_gather")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    for name, low in (("pieces", 1), ("bytes", 4), ("ms", 0), ("land_ms", 0), ("repeats", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be at least {low}, got {getattr(args, name)}")
    if args.rank is not None:
        return _rank(args)
    from ddpcomm.bench.netns import Links

    forward = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "rank"]
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
    print(f"{args.pieces} pieces of {args.bytes} bytes, {args.collective} of 2 ranks over "
          f"{args.link}, {args.ms} ms of work before each and {args.land_ms} as it lands; "
          f"medians of {args.repeats} calls")  # fmt: skip
    head = ("work", "call ms", "first piece ms", "work alone ms", "ratio")
    print(f"{head[0]:8s} {head[1]:>8s} {head[2]:>15s} {head[3]:>14s} {head[4]:>6s}")
    for kind, r in rows.items():
        ratio = r["ms"] / max(wire, r["work_alone_ms"])
        print(f"{kind:8s} {r['ms']:8.1f} {r['first_landed_ms']:15.1f} "
              f"{r['work_alone_ms']:14.1f} {ratio:6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
