"""``python -m ddpcomm.bench collectives``: one gradient bucket reduced by each DDP hook.

Every method is driven the way DDP drives it, ``hook(state, bucket)`` returning a Future
of the mean, on a ``_Bucket``: an object with the GradBucket methods hooks call, whose
buffer is the message and whose gradients are [rows, 1024] views of it (the shape of a
transformer's linear layers, so PowerSGD sees the matrices it sees in training). One
bucket per call rather than a DDP model: the message size is exact, and the time is the
reduction alone, not backward compute overlapped with it.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time

import torch
import torch.distributed as dist

from ddpcomm import adaptive, groups, two_level, wrappers
from ddpcomm.bench import _methods, _ranks
from ddpcomm.bench._util import environment, finish, link_lines, short, table, wall
from ddpcomm.compressors import Quantizer, RandomK, TopK
from ddpcomm.context import LinkRate, ReduceContext, Workspace
from ddpcomm.groups import all_gather_single

DESCRIPTION = """\
Reduces one gradient bucket through each method's DDP hook (torch's allreduce_hook,
fp16_compress_hook, quantization and PowerSGD hooks; ddpcomm's hooks) on spawned gloo
ranks, for each message size and world size, and prints per method: the median time of
the slowest rank, the bytes a rank sends (from the method's wire format) and, with
--link, the bytes its interface really sent, the error against the exact mean, the
speedup over plain all_reduce and the limit of that speedup from bytes alone.

A method followed by ',adaptive' (q8,adaptive) makes untimed calls first, in which
adaptive pass-through times the plain and the compressed path and decides; its row says
which path the decision took ('-> plain', '-> compressed') and its bytes are those sent.
Its case also times plain all_reduce and the fixed method (q8): after each has made its
untimed calls alone, the three take turns call by call, each first in turn. Its speedup
and the summary under the table compare it with those two, timed under the same load,
not with their own rows.

Beside each method's time: the wire-only time of its bytes (the collectives its
algorithm issued, all_reduce or all_gather, on as many plain bytes), its codec time
alone (its hook on torch's fake process group: every compress and decode op, collectives
that only copy), and overlap = time / max(wire-only, codec): 1.00 at the limit, 1 +
smaller/larger when nothing overlaps. The three take turns call by call. cpu ms: the
CPU time one call took in the busiest rank's process, all its threads together (the
codec, gloo's copies and sums, its share of the network stack); cores busy = ranks on
this machine x cpu ms / (its cores x ms): near 1, the cores, not the wire or the
overlap, set the time (ranks sharing a small machine). Last,
ddpcomm.all_reduce of the method (the same bytes outside DDP) and its hook take turns
alone, call by call, for the table that compares them.

--link RATE gives each rank its own network namespace joined by links shaped to RATE
with tc tbf (needs root; without it the run falls back to loopback and says so).

--nodes N --ranks-per-node L runs N x L ranks as N nodes: with --link each node is one
namespace whose ranks talk over its loopback, and the shaped link joins the nodes. The
default methods are then plain and each method flat and two-level (',hierarchy=L');
the bytes columns are per node, read from the interface counters of the link (bytes
leaving the node) and of the node's loopback (bytes that stayed inside), and a table
compares each two-level method with its flat form."""

COLS = 1024  # columns of every gradient matrix in the bucket
MIB = 2**20
_CALLED = (Quantizer, TopK, RandomK)  # methods with a codec, and ddpcomm.all_reduce rows


def add_parser(sub) -> None:
    p = sub.add_parser(
        "collectives",
        help="one gradient bucket through each DDP hook, every method, sizes x ranks",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sizes",
        type=_positive(float),
        default=[1, 4, 16, 64, 256],
        metavar="LIST",
        help="message sizes in MiB (default 1,4,16,64,256)",
    )
    p.add_argument(
        "--world",
        type=_positive(int),
        default=[2, 4],
        metavar="LIST",
        help="world sizes, each >= 2 (default 2,4)",
    )
    p.add_argument(
        "--methods",
        type=_methods.method_list(),
        metavar="LIST",
        help=_methods.METHODS_HELP + " (default: all, topk and randk at 0.01, each with and "
        "without adaptive; with --nodes: allreduce, none,hierarchy=L, and q8, q4, q1, "
        "topk:0.01 each flat and with ',hierarchy=L')",
    )
    p.add_argument(
        "--link", metavar="RATE", help="shape each rank's link to RATE (1gbit, 10gbit); needs root"
    )
    _ranks.add_node_arguments(p)
    p.add_argument(
        "--iters",
        type=int,
        default=5,
        help="timed calls per case, times 16 MiB / size (at most 8) below 16 MiB, whose "
        "calls take milliseconds and vary by several; the median is reported (default 5)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=5,
        help="untimed calls per case, at least 1 (default 5: a bucket's gloo pieces follow "
        "the link from its 5th call)",
    )
    p.add_argument(
        "--timeout", type=float, help="seconds a case may take (default: from size and link rate)"
    )
    p.add_argument("--out", metavar="PATH", help="write the results as JSON to PATH")
    p.add_argument(
        "--quick", action="store_true", help="1 MiB, 2 ranks, 2 timed calls: checks that it runs"
    )
    p.set_defaults(func=run)


def _positive(kind):
    def parse(text: str):
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not a comma-separated list of {kind.__name__}: {text!r}"
            ) from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"values must be > 0, got {text!r}")
        return values

    return parse


def bucket_shapes(numel: int) -> list[tuple[int, ...]]:
    """[1024, 1024] matrices (4 MiB each), then one [rows, 1024], then a 1-D tail."""
    full, rest = divmod(numel, COLS * COLS)
    rows, tail = divmod(rest, COLS)
    return [(COLS, COLS)] * full + [(rows, COLS)] * (rows > 0) + [(tail,)] * (tail > 0)


def node_methods(local) -> list[str]:
    """The default methods with --nodes: plain and each method, flat and two-level."""
    return ["allreduce"] + [
        m + suffix
        for m in ("none", "q8", "q4", "q1", "topk:0.01")
        for suffix in ("", f",hierarchy={local}")
        if (m, suffix) != ("none", "")  # plain flat is torch's allreduce_hook, DDP's default
    ]


def run(args) -> int:
    if args.quick:
        args.sizes, args.world, args.iters, args.warmup = [1], [2], 2, 1
    if args.iters < 1 or args.warmup < 1:
        raise SystemExit(f"--iters and --warmup must be >= 1, got {args.iters}, {args.warmup}")
    if any(w < 2 for w in args.world):
        raise SystemExit(f"--world: every world size must be >= 2, got {args.world}")
    if args.timeout is not None and not args.timeout > 0:
        raise SystemExit(f"--timeout must be > 0 seconds, got {args.timeout}")
    rate = _ranks.link_rate(args.link)
    nodes_world, per_node = _ranks.nodes_world(args), 1
    if nodes_world:
        args.world, per_node = [nodes_world], args.ranks_per_node
    if args.methods is None:
        every = [*_methods.TORCH, *_methods.DDPCOMM, *_methods.ADAPTIVE]
        args.methods = node_methods(per_node) if nodes_world else every
    env = environment()
    worlds = [_ranks.world_size(0)] if _ranks.under_torchrun() else args.world
    rows = []
    for world in worlds:
        cases = _cases(args, world)

        def timeout(case) -> float:
            # 10x a plain all_reduce's wire time per call (100 MB/s on loopback), + slack;
            # each call is followed by its wire-only collectives, and then the hook and
            # ddpcomm.all_reduce take turns 3 x iters times (their warm-up calls too).
            calls = 2 * (4 * case["iters"] + 2 * case["warmup"] + 3)
            if ",adaptive" in case["row"]["method"]:  # + plain and the fixed method
                calls = 2 * calls + adaptive.first_decision()
            return args.timeout or 60 + 10 * calls * 8 * case["row"]["numel"] / (rate or 100e6)

        common = {"link_check_mb": 8 if args.quick else 64}
        out = _ranks.run_cases(
            "ddpcomm.bench.collectives:run_case",
            cases,
            world,
            env,
            link=args.link,
            common=common,
            timeout=timeout,
            per_node=per_node,
        )
        if out is None:  # a torchrun rank other than 0
            return 0
        rows += out
    result = {"command": "collectives", "environment": env, "rows": rows}
    finish(result, report, args.out)
    return 0


def _cases(args, world: int) -> list[dict]:
    cases = []
    for size in args.sizes:
        numel = int(size * MIB) // 4
        shapes = bucket_shapes(numel)
        for method in args.methods:
            row = {
                "method": method,
                "world": world,
                "size_mib": size,
                "numel": numel,
                "formula_bytes": _methods.formula_bytes(method, shapes, world),
            }
            label = f"{world} ranks, {size:g} MiB, {method}"
            cases.append(
                {
                    "label": label,
                    "row": row,
                    "shapes": shapes,
                    "iters": args.iters * (1 if args.quick else min(8, max(1, int(16 / size)))),
                    "warmup": args.warmup,
                }
            )
    return cases


class _Bucket:
    """The GradBucket methods torch's and ddpcomm's hooks call, over one flat buffer.
    ``parameters()`` are placeholders with the gradients' count: hooks use them only as
    identities (ddpcomm keys its per-model state on them)."""

    def __init__(self, buffer: torch.Tensor, shapes: list[tuple[int, ...]]):
        self._buffer, self._grads, offset = buffer, [], 0
        for shape in shapes:
            self._grads.append(buffer[offset : offset + math.prod(shape)].view(shape))
            offset += math.prod(shape)
        self._params = [torch.nn.Parameter(torch.empty(0)) for _ in shapes]

    def index(self) -> int:
        return 0

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._grads

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return True  # one bucket per step: every call ends an iteration (PowerSGD counts them)

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)


def make_grad(shapes, rank: int, seed: int, device) -> torch.Tensor:
    """Rank ``rank``'s gradient: per-matrix scale x (shared low-rank signal + rank noise).

    Real gradients differ by orders of magnitude between layers, agree partly across
    ranks (same loss, different minibatches), and a linear layer's gradient (a sum of
    per-token outer products) has a fast-decaying spectrum. The signal here is a sum of 8
    rank-1 terms weighted 1, 1/2, 1/4, ...; each rank adds noise of relative size 0.3.
    PowerSGD and the sparsifiers see the structure they exploit in training, not white
    noise that no compressor can shrink.
    """
    parts = []
    for i, shape in enumerate(shapes):
        g_shared = torch.Generator().manual_seed(seed * 1_000_003 + i)
        g_rank = torch.Generator().manual_seed((seed * 1_000_003 + i) * 131 + rank + 1)
        scale = 10 ** (-2 * torch.rand((), generator=g_shared).item())
        if len(shape) == 2:
            weights = 0.5 ** torch.arange(8.0)
            u = torch.randn(shape[0], 8, generator=g_shared) * weights
            t = (u @ torch.randn(8, shape[1], generator=g_shared)) / weights.norm()
        else:
            t = torch.randn(shape, generator=g_shared)
        parts.append(
            t.add_(torch.randn(shape, generator=g_rank), alpha=0.3).mul_(scale).reshape(-1)
        )
    return torch.cat(parts).to(device)


_exact: dict = {}  # rank 0's exact mean of the current size (up to 256 MiB: one at a time)
_fake: list = []  # torch's fake process group, made once per rank process


def _reduce(hook, state, activation, bucket):
    return hook(state, bucket).wait()


def run_case(case: dict, common: dict, device: torch.device) -> dict:
    """One method at one size on every rank: untimed calls, then timed calls, taking
    turns call by call with its wire-only collectives and its codec alone (``_probes``).
    An adaptive method's case also times plain all_reduce and its fixed method in the
    rotation, so that they are compared under the same load."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shapes, seed, result = [tuple(s) for s in case["shapes"]], 1234, dict(case["row"])
    grad = make_grad(shapes, rank, seed, device)
    method = result["method"]
    methods = [method]
    if method.endswith(",adaptive"):
        methods += ["allreduce", method.removesuffix(",adaptive")]
    runs = [
        (*_methods.make_hook(m, dist.group.WORLD, False), _Bucket(grad.clone(), shapes))
        for m in methods
    ]
    # Untimed calls one method after another: an adaptive state times whole steps (here,
    # from one of its calls to the next), so its decision is made with no other calls
    # in between. What the last one sent is what the probes send.
    stats, before = getattr(runs[0][1], "stats", None), None
    for j, run in enumerate(runs):
        for i in range(run[2] + case["warmup"]):
            run[3].buffer().copy_(grad)  # hooks write the mean into the bucket in place
            dist.barrier()
            if j == 0 and i == run[2] + case["warmup"] - 1 and stats:
                before = stats()
            _reduce(*run)
    last = stats and _per_call(stats(), before, 1)
    entries = [
        (m, run[3].buffer().copy_, grad, functools.partial(_reduce, *run))
        for m, run in zip(methods, runs, strict=True)
    ]
    probes, plain = _probes(method, runs[0][1], last, shapes, grad, case["warmup"])
    entries += probes
    ifname, per_node = common.get("ifname"), common.get("per_node", 1)
    st0 = stats and stats()
    times, wire, out, cpu = _take_turns(entries, case["iters"], ifname, device)
    # The slowest rank's time per call is the collective's time.
    split = getattr(entries[len(runs)][3], "steps", None)  # a two-level wire-only's steps
    every = [None] * world
    dist.all_gather_object(every, (times, wire, split, statistics.median(cpu)))
    medians = {}
    for j, (name, *_) in enumerate(entries):
        per_call = [max(ts[j][i] for ts, *_ in every) for i in range(case["iters"])]
        medians[name] = statistics.median(per_call)
        if j == 0:
            result.update(median_s=medians[name], times_s=per_call)
    # The busiest rank's CPU time per call: every thread of its process (the codec, gloo's
    # copies and sums, its share of the network stack), against the cores its machine has.
    result.update(cpu_s=max(e[3] for e in every), local_ranks=_ranks.local_world(world))
    if len(runs) > 1:
        result.update(plain_s=medians["allreduce"], fixed_s=medians[methods[2]])
    result.update({f"{k}_s": medians[k] for k in ("wire", "codec") if k in medians})
    if plain:
        result["codec_s"] = 0.0  # nothing to compress or decode
    if split:  # each step's slowest rank; the barriers between them left out
        steps = [[max(e[2][i][k] for e in every) for k in (0, 1)] for i in range(case["iters"])]
        result.update({key: statistics.median(s[k] for s in steps) for k, key in enumerate(_STEPS)})
        result["wire_s"] = statistics.median(map(sum, steps))
    if ifname:
        result["wire_bytes"] = wire[0] / case["iters"]
        if per_node > 1:  # each node's counters, read by its first rank
            firsts = [e[1] for e in every[::per_node]]
            result["node_wire_bytes"] = [w[0] / case["iters"] for w in firsts]
            result["node_lo_bytes"] = [w[1] / case["iters"] for w in firsts]
    if stats:  # ddpcomm's own accounting, per call
        st1 = stats()
        result.update(_per_call(st1, st0, case["iters"]))
        if "adaptive" in st1:  # the path the decision took for this bucket's size class
            result["adaptive_path"] = st1["adaptive"]["classes"][-1]["decision"]
        if "hierarchy" in st1:
            result["hierarchy"] = st1["hierarchy"]
    # Every rank must hold the same result: compare checksums.
    probe = torch.stack([out.double().sum(), out.double().square().sum()])
    probes = [torch.empty_like(probe) for _ in range(world)]
    dist.all_gather(probes, probe)
    result["ranks_identical"] = all(torch.equal(p, probes[0]) for p in probes)
    if rank == 0:
        key = (tuple(shapes), world)
        if key not in _exact:
            _exact.clear()
            _exact[key] = sum(make_grad(shapes, r, seed, device) for r in range(world)) / world
        exact = _exact[key]
        result["rel_error"] = (out.float().reshape(-1) - exact).norm().item() / max(
            exact.norm().item(), 1e-30
        )
    # ddpcomm.all_reduce and the hook take turns alone, last, three times as many calls: in
    # the rotation above, the entries around them moved their ratio by 2-4% (60 calls each,
    # q8 and q4, 64 MiB, 1 Gbit/s), and 5 calls made it vary by up to 15% between runs.
    call = _call(method, runs[0][1], grad, case["warmup"]) if stats else []  # ddpcomm's
    if call:
        calls = 3 * case["iters"]
        pair = _take_turns([entries[0], *call], calls, None, device)[0]
        dist.all_gather_object(every, pair)
        for key, j in (("call_hook_s", 0), ("call_s", 1)):
            result[key] = statistics.median(max(ts[j][i] for ts in every) for i in range(calls))
    result["status"] = "ok"
    return result


def _take_turns(entries: list[tuple], iters: int, ifname: str | None, device):
    """Calls the entries in turn, each first in turn, ``iters`` times each: (seconds per
    entry and call, the bytes the first one sent through ``ifname`` and the namespace's
    loopback, its last output, the CPU seconds this process used in each of the first
    one's calls)."""
    times, wire, out, cpu = [[] for _ in entries], [0, 0], None, []
    for i in range(iters):
        for j in range(len(entries)):
            j = (i + j) % len(entries)
            _, reset, arg, call = entries[j]
            if reset is not None:
                reset(arg)
            if j == 0 and ifname:
                dist.barrier()  # every rank's sends of the entry before have left
                start = _counters(ifname)
            dist.barrier()
            used = time.process_time()
            value, seconds = wall(call, device)
            times[j].append(seconds)
            if j == 0:
                cpu.append(time.process_time() - used)
                out = value[0] if isinstance(value, (list, tuple)) else value
                if ifname:
                    dist.barrier()  # every rank's sends of this call have left
                    now = _counters(ifname)
                    wire = [w + b - a for w, a, b in zip(wire, start, now, strict=True)]
    return times, wire, out, cpu


def _per_call(now: dict, then: dict, calls: int) -> dict:
    """ddpcomm's counts between two ``stats()``, per call."""
    out = {"paths": {k: v - then["paths"].get(k, 0) for k, v in now["paths"].items()}}
    out["paths"] = {k: v for k, v in out["paths"].items() if v}
    out["measured_bytes"] = (now["bytes_sent"] - then["bytes_sent"]) / calls
    out["compress_s"] = (now["compress_seconds"] - then["compress_seconds"]) / calls
    for key in ("intra_node_bytes", "intra_node_shared_bytes", "cross_node_bytes"):
        if key in now:
            out[key] = (now[key] - then.get(key, 0)) / calls
    return out


def _counters(ifname: str) -> list[int]:
    """Bytes sent so far through the link and through the namespace's loopback."""
    return [_ranks.tx_bytes(ifname), _ranks.tx_bytes("lo")]


# A method's collectives, by the path its stats() names: an all-gather (in pieces on
# gloo, as the method sends it: one large gloo all_gather moves ~75 MB/s on a 1 Gbit/s
# link, 2 MiB pieces in flight at once 117, an all_reduce 119), or an all_reduce, whose
# ring sends the same bytes in the same pattern as the two-phase quantizer's all_to_all
# and all_gather, and as random-k's and the dense paths' own all_reduce.
_GATHERS = ("q_all_gather", "topk_all_gather")


def _probes(method, state, last, shapes, grad, warmup) -> tuple[list[tuple], bool]:
    """The timed entries beside a method, each ``(name, reset, arg, call)``: ``wire`` (the
    collectives its last untimed call issued, on as many plain bytes) and ``codec`` (its
    own hook on torch's fake process group, whose collectives only copy: every compress
    and decode op, nothing on the wire); and whether it has no codec at all (a plain
    path). torch's lossy hooks get no codec entry."""
    world, device = dist.get_world_size(), grad.device
    if last is None:  # torch's hooks: their wire format says their bytes
        kind = "all_gather" if method == "torch-qpt" else "all_reduce"
        wire = _plain(kind, _methods.formula_bytes(method, shapes, world), dist.group.WORLD, device)
        return [("wire", None, None, wire)], method == "allreduce"
    path = next(p for p in last["paths"] if p != "two_level")
    kind = "all_gather" if path in _GATHERS else "all_reduce"
    if "two_level" in last["paths"]:
        local = state.stats()["hierarchy"]["local_size"]
        wire = _two_level(kind, last["cross_node_bytes"], grad.numel(), local, device)
    else:
        wire = _plain(kind, last["measured_bytes"], dist.group.WORLD, device)
    entries = [("wire", None, None, wire)]
    plain = path in ("plain", "empty")
    if plain or not isinstance(state.compressor, _CALLED):
        return entries, plain
    if not _fake:
        import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"

        _fake.append(dist.new_group(backend="fake"))
    run = (
        *_methods.make_hook(method.removesuffix(",adaptive"), _fake[0], False),
        _Bucket(grad.clone(), shapes),
    )
    for _ in range(run[2] + warmup):
        run[3].buffer().copy_(grad)
        _reduce(*run)

    def reset(g: torch.Tensor) -> None:
        run[3].buffer().copy_(g)
        _mirror(state, run[1])

    codec = ("codec", reset, grad, functools.partial(_reduce, *run))
    return [*entries, codec], False


def _mirror(real, probe) -> None:
    """The codec probe's state takes the real state's iteration and per-element state
    (residuals, normalize's scales and averages) before each timed call, so that it encodes
    what the real call encodes: on the fake group, whose collectives copy a rank's own input
    into their output, normalize would share this rank's own scale, not the ranks' mean (on
    the bench's gradient, repeated call after call, one formed from a single step made every
    value q1.5 encodes lie within 8% of 1/sqrt(0.2) = 2.24 in magnitude, that code's
    hardest case, and its codec alone took longer than the whole real call)."""
    probe.iteration = real.iteration
    for key, buf in real.memory.buffers.items():
        mine = probe.memory.buffers.get(key)
        if mine is not None and mine.shape == buf.shape:
            mine.copy_(buf)


def _call(method: str, state, grad: torch.Tensor, warmup: int) -> list[tuple]:
    """``ddpcomm.all_reduce`` of the method on a copy of the bucket (``call``), timed in
    turn with its hook: the same bytes outside DDP. Spec strings there carry no residual,
    so a method with error feedback runs without it (one pass fewer than its hook)."""
    if "adaptive" in method.split(",") or not isinstance(state.compressor, _CALLED):
        return []
    out = grad.clone()
    try:
        wrappers.all_reduce(out, method)  # also refuses the hooks' schedule options
    except ValueError:
        return []
    for _ in range(LinkRate.FIRST + warmup):  # until its pieces follow the agreed rate
        wrappers.all_reduce(out.copy_(grad), method)
    return [("call", out.copy_, grad, functools.partial(wrappers.all_reduce, out, method))]


def _plain(kind: str, nbytes: float, group, device):
    """A plain all_gather or all_reduce on ``group`` that sends ``nbytes`` per rank."""
    n = dist.get_world_size(group)
    if kind == "all_reduce":
        t = torch.zeros(max(1, round(nbytes * n / (2 * (n - 1)) / 4)), device=device)
        return functools.partial(dist.all_reduce, t, group=group)
    size = max(1, round(nbytes / (n - 1)))
    send = torch.zeros(size, dtype=torch.uint8, device=device)
    recv = send.new_empty(n * size)
    piece = size if dist.get_backend(group) != "gloo" else 2 * MIB

    def gather():
        works = [
            all_gather_single(
                recv[n * b : n * (b + piece)], send[b : b + piece], group=group, async_op=True
            )
            for b in range(0, size, piece)
        ]
        for w in works:
            w.wait()

    return gather


def _two_level(kind: str, cross_bytes: float, numel: int, local: int, device):
    """A two-level reduction's steps on its own groups, nothing compressed: inside the
    node as the method runs it (through shared memory, or gloo's all_to_all of the bucket),
    ``kind`` of ``cross_bytes`` across nodes, then inside the node again (the shards read
    back, or all-gathered). A barrier after each step makes each one's time its own:
    ``run.steps`` collects (inside, across) seconds per call, whose sum (the barriers left
    out) is the wire-only time."""
    topo = groups.topology(dist.group.WORLD, local, device)
    shard = math.ceil(numel / local)
    flat = torch.zeros(shard * local, device=device)
    cross = _plain(kind, cross_bytes, topo.cross, device)
    if topo.shared and flat.device.type == "cpu":  # inside nodes through shared memory
        node = two_level.SharedNode(flat, ReduceContext(workspace=Workspace()), topo)
        steps = (
            lambda: (node.write().wait(), node.sum()),
            lambda: (node.publish().wait(), node.read()),
        )
    else:
        received, mine = torch.empty_like(flat), torch.zeros(shard, device=device)
        steps = (
            lambda: dist.all_to_all_single(received, flat, group=topo.intra),
            lambda: all_gather_single(flat, mine, group=topo.gather),
        )

    def step(fn) -> float:
        _, seconds = wall(fn, device)
        dist.barrier()
        return seconds

    def run():
        inside = step(steps[0])
        across = step(cross)
        inside += step(steps[1])
        run.steps.append((inside, across))

    run.steps = []
    return run


def report(result: dict, markdown: bool = False) -> str:
    """The table of a collectives result (as printed after a run)."""
    env, rows = result["environment"], result["rows"]
    lines, nodes = link_lines(env), env.get("nodes")
    order = {m: i for i, m in enumerate([*_methods.TORCH, "none", *_methods.DDPCOMM])}

    def position(method: str) -> tuple[int, str]:  # q8,adaptive right after q8
        base = method.split(",")[0]
        return order.get(base, len(order)), method

    rows = sorted(rows, key=lambda r: (r["world"], r["size_mib"], position(r["method"])))
    plain = {
        (r["world"], r["size_mib"]): r
        for r in rows
        if r["method"] == "allreduce" and r["status"] == "ok"
    }
    headers = [
        "method",
        "nodes x ranks" if nodes else "ranks",
        "MiB",
        "ms",
        "wire-only ms",
        "codec ms",
        "overlap",
        "cpu ms",
        "cores busy",
        "MB sent/rank",
        "MB across/node" if nodes else "MB on wire/rank",
        "MB in node",
        "error vs exact mean",
        "speedup vs allreduce",
        "limit from bytes",
        "status",
    ]
    body = []
    for r in rows:
        ok, base = r["status"] == "ok", plain.get((r["world"], r["size_mib"]))
        sent = r.get("measured_bytes", r["formula_bytes"])  # adaptive: the decided path's
        limit = sent and _methods.formula_bytes("allreduce", [(r["numel"],)], r["world"]) / sent
        wire = r.get("wire_bytes")
        if nodes:  # bytes that left each node, against plain all_reduce's
            wire = _mean(r.get("node_wire_bytes"))
            limit = wire and base and _mean(base.get("node_wire_bytes")) / wire
        limit_s = "codec_s" in r and max(r.get("wire_s", 0), r["codec_s"])
        busy = "cpu_s" in r and r["local_ranks"] * r["cpu_s"] / (env["host_cpus"] * r["median_s"])
        status = "ok" if r.get("ranks_identical", True) else "ok, but ranks differ"
        body.append(
            [
                r["method"] + (f" -> {r['adaptive_path']}" if "adaptive_path" in r else ""),
                f"{nodes['nodes']}x{nodes['ranks_per_node']}" if nodes else str(r["world"]),
                f"{r['size_mib']:g}",
                f"{r['median_s'] * 1e3:.1f}" if ok else "-",
                f"{r['wire_s'] * 1e3:.1f}" if "wire_s" in r else "-",
                f"{r['codec_s'] * 1e3:.1f}" if "codec_s" in r else "-",
                f"{r['median_s'] / limit_s:.2f}" if ok and limit_s else "-",
                f"{r['cpu_s'] * 1e3:.1f}" if ok and "cpu_s" in r else "-",
                f"{busy:.2f}" if ok and busy else "-",
                _mb(sent),
                _mb(wire) if wire is not None else "-",
                _mb(_mean(r["node_lo_bytes"])) if "node_lo_bytes" in r else "-",
                f"{r['rel_error']:.1e}" if "rel_error" in r else "-",
                f"{r.get('plain_s', base and base['median_s']) / r['median_s']:.2f}x"
                if ok and (base or "plain_s" in r)
                else "-",
                f"{limit:.1f}x" if limit else "-",
                status if ok else f"{r['status']}: {short(r.get('reason', ''))}",
            ]
        )
    lines += ["", table(headers, body, markdown)]
    lines += _two_level_table(rows, markdown)
    lines += _call_table(rows, markdown)
    lines += _adaptive_summary(rows, plain)
    lines += [f"warning: {w}" for w in env.get("warnings", [])]
    return "\n".join(lines)


def _mean(values: list[float] | None) -> float | None:
    return statistics.fmean(values) if values else None


_STEPS = ("wire_inside_s", "wire_across_s")


def _two_level_table(rows: list[dict], markdown: bool) -> list[str]:
    """Each two-level method (',hierarchy=...') against its flat form in the same run
    (plain two-level against torch's allreduce): speedup, bytes across nodes per node,
    error against the exact mean, as ratios; and the two-level wire-only time's steps
    inside the nodes and across them."""
    done = {(r["world"], r["size_mib"], r["method"]): r for r in rows if r["status"] == "ok"}
    body = []
    for (world, size, method), r in done.items():
        flat = ",".join(p for p in method.split(",") if not p.startswith("hierarchy="))
        if flat == method:
            continue
        f = done.get((world, size, flat)) or done.get((world, size, "allreduce"))
        if f is None or (f["method"] == "allreduce" and flat != "none"):
            continue
        across = [_mean(x.get("node_wire_bytes")) for x in (r, f)]
        errors = [x.get("rel_error", 0) for x in (r, f)]
        body.append(
            [
                method,
                f["method"],
                f"{size:g}",
                f"{f['median_s'] / r['median_s']:.2f}x",
                f"{across[0] / across[1]:.2f}x" if all(across) else "-",
                f"{errors[0] / errors[1]:.2f}x" if errors[1] > 1e-6 else "-",
                *(f"{r[k] * 1e3:.1f}" if k in r else "-" for k in _STEPS),
            ]
        )
    if not body:
        return []
    headers = ["two-level", "flat", "MiB", "speedup", "bytes across/node", "error"]
    headers += ["wire-only ms inside nodes", "across"]
    return ["", "two-level against flat, same run:", "", table(headers, body, markdown)]


def _call_table(rows: list[dict], markdown: bool) -> list[str]:
    """Each method through ``ddpcomm.all_reduce`` against its hook, the two taking turns
    alone (results from before that pair: the hook's time in the rotation)."""
    body = []
    for r in rows:
        if r["status"] == "ok" and "call_s" in r:
            hook = r.get("call_hook_s", r["median_s"])
            body.append(
                [
                    r["method"],
                    str(r["world"]),
                    f"{r['size_mib']:g}",
                    f"{hook * 1e3:.1f}",
                    f"{r['call_s'] * 1e3:.1f}",
                    f"{r['call_s'] / hook:.3f}",
                ]
            )
    if not body:
        return []
    headers = ["method", "ranks", "MiB", "hook ms", "ddpcomm.all_reduce ms", "ratio"]
    note = "ddpcomm.all_reduce against the hook, same bytes, taking turns (no error feedback):"
    return ["", note, "", table(headers, body, markdown)]


def _adaptive_summary(rows: list[dict], plain: dict) -> list[str]:
    """How each adaptive row's decision and time compare with plain and its fixed method,
    timed call by call with it in its case (in results from before that: their own rows);
    a path within 5% of the other counts as either."""
    done = {(r["world"], r["size_mib"], r["method"]): r for r in rows if r["status"] == "ok"}
    found = {"cells": 0, "faster": 0, "slower": 0, "tie": 0, "over_plain": 0, "over_best": 0}
    for (world, size, method), r in done.items():
        fixed = done.get((world, size, method.removesuffix(",adaptive")))
        base = plain.get((world, size))
        if not method.endswith(",adaptive") or fixed is None or base is None:
            continue
        t = r["median_s"]
        t_plain, t_fixed = r.get("plain_s", base["median_s"]), r.get("fixed_s", fixed["median_s"])
        found["cells"] += 1
        if abs(t_plain - t_fixed) <= 0.05 * min(t_plain, t_fixed):
            found["tie"] += 1
        else:
            best = "compressed" if t_fixed < t_plain else "plain"
            found["faster" if r.get("adaptive_path") == best else "slower"] += 1
        found["over_plain"] += t > 1.03 * t_plain
        found["over_best"] += t > 1.05 * min(t_plain, t_fixed)
    if not found["cells"]:
        return []
    return [
        "",
        f"adaptive, {found['cells']} cells: took the faster of plain and its method in "
        f"{found['faster']}, the slower in {found['slower']}, either (within 5%) in "
        f"{found['tie']}; ran more than 3% slower than plain in {found['over_plain']} and "
        f"more than 5% slower than the faster in {found['over_best']} (each against plain "
        "and its method timed call by call with it)",
    ]


def _mb(b: float) -> str:
    return f"{b / 1e6:.3f}" if b < 1e6 else f"{b / 1e6:.1f}"
