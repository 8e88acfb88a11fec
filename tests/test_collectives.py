"""collectives.all_reduce_mean for every method: the result of a reduction.

On spawned groups of 1 to 4 ranks (tests/collective_utils.py): device "cpu" reduces CPU
tensors over gloo; device "cuda" reduces CUDA tensors over gloo with every rank on GPU 0,
and at one rank over NCCL too, and proves that CUDA gives the CPU's bits. Each group is
spawned once and runs every check below (tests/spawn_plan.py); each test reads its own.

"Correct" (DESIGN.md §6.3): ``none`` is bitwise the plain all_reduce and casts bitwise the
all_reduce of the cast tensor; quantizers stay within their analytic bound of the exact
mean; top-k and random-k equal the all_reduce of what each rank selected; every rank gets
bitwise the same result; constants reduce exactly. Error feedback, non-finite input,
configuration mismatch and CUDA stream behaviour: test_collectives_reliability.py.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.distributed as dist

import ddpcomm
import ddpcomm.ops as ops
import ddpcomm.reference as ref
from ddpcomm import collectives, compressors
from ddpcomm.compressors import RandomK, TopK, dense_bytes
from ddpcomm.context import LinkRate, ReduceContext, ResidualMemory, Workspace
from tests.collective_utils import (
    ALGORITHMS,
    BLOCK,
    CUDA_ONLY,
    N,
    Rank,
    assert_same_on_every_rank,
    gather_rows,
    per_group,
    quantization_error_bound,
    quantizer,
    rank_input,
)
from tests.spawn_plan import Groups

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
# Tolerance for comparing against a sum the collective adds in its own order (N > 2):
# a few ulps of the output dtype.
RTOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# One step of every method, without error feedback: the result is a function of the inputs.
METHODS = {
    "none": ("none", {}),
    "fp16": ("fp16", {}),
    "bf16": ("bf16", {}),
    **{
        f"q{b}-{a}": quantizer(b, a, error_feedback=False)
        for b in (8, 4, 2, 1.5, 1)
        for a in ALGORITHMS
    },
    "topk": ("topk:0.01", dict(error_feedback=False)),
    "randk": ("randk:0.01", dict(seed=7, error_feedback=False)),
}
QUANTIZERS = [m for m in METHODS if m.startswith("q")]
# q1.5 sends at most half of a block as nonzeros, so a constant block comes back half zero
# (error feedback sends the rest later): every other quantizer is lossless on one.
CONSTANT_EXACT = [m for m in QUANTIZERS if not m.startswith("q1.5")]
SPARSE = ["topk", "randk"]
# Methods whose payload goes out in pieces on gloo: the quantizers' both algorithms, top-k
# and random-k (at two ranks). With error feedback: the residual path is the one run.
PIECES = {
    "q8-two_phase": quantizer(8, "two_phase", error_feedback=True),
    "q2-two_phase-stochastic": quantizer(2, "two_phase", stochastic=True, error_feedback=True),
    "q8-stochastic": quantizer(8, "all_gather", stochastic=True, error_feedback=True),
    "q8": quantizer(8, "all_gather", error_feedback=True),
    "q2": quantizer(2, "all_gather", error_feedback=True),
    "q1": quantizer(1, "all_gather", error_feedback=True),
    "q1.5": quantizer(1.5, "all_gather", error_feedback=True),
    "q1.5-two_phase": quantizer(1.5, "two_phase", error_feedback=True),
    "topk": ("topk:0.05", dict(error_feedback=True)),
    "randk": ("randk:0.05", dict(seed=7, error_feedback=True)),
}


def assert_equal_or_close(got, want, world):
    """Bitwise when at most two terms are added (order cannot matter), else a few ulps."""
    if world <= 2:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    else:
        torch.testing.assert_close(got, want, rtol=RTOL[got.dtype], atol=1e-6)


def cast_reference(r: Rank, c: compressors.CastCompression, x: torch.Tensor) -> torch.Tensor:
    """torch's fp16 hook: cast, divide by N, all_reduce in 16 bits, cast back."""
    return r.all_reduce(r.put(x).to(c.dtype).div_(r.world)).float().cpu()


def expected_path(c, n: int, world: int) -> str:
    if isinstance(c, compressors.Quantizer):
        return f"q_{c.resolve_algorithm(world)}"
    if isinstance(c, TopK):
        return "topk_dense" if c.use_dense(n, world) else "topk_all_gather"
    if isinstance(c, RandomK):
        return "randk_all_reduce"
    return c.spec if c.lossy else "plain"


# --------------------------------------------------------------------------------------
# Checks (run in the spawned ranks)
# --------------------------------------------------------------------------------------


def check_mean(r: Rank, c) -> None:
    """Within the method's bound of the exact mean, the same on every rank, the bytes that
    stats() promises; fp16/bf16 buckets come back in their dtype."""
    xs = [rank_input(i, N) for i in range(r.world)]
    exact = torch.stack(xs).mean(0)
    x = xs[r.rank]
    eight_bit = isinstance(c, compressors.Quantizer) and c.bits == 8
    for dtype in FLOATS if isinstance(c, (TopK, RandomK)) or eight_bit else FLOATS[:1]:
        out, ctx = r.reduce(x.to(dtype), c, key=5, step=2)
        assert out.dtype == dtype and out.shape == (N,)
        assert_same_on_every_rank(out, r.world)
        assert ctx.stats.paths == {expected_path(c, N, r.world): 1}
        assert ctx.stats.bytes_sent == c.wire_bytes(N, r.world, r.rank)
        assert ctx.stats.dense_bytes == dense_bytes(N, r.world, out.element_size())
        if isinstance(c, compressors.NoCompression):
            # Scaled by 1/N before the sum, as DDP's reducer does: bitwise that all_reduce.
            assert torch.equal(out, r.all_reduce(r.put(x).mul_(1.0 / r.world)).cpu())
        elif isinstance(c, compressors.CastCompression):
            assert torch.equal(out, cast_reference(r, c, x))
            # Two roundings per rank (cast, divide), one per addition; plus the absolute
            # error of a float16 subnormal at each.
            u, tiny = (2.0**-11, 2.0**-24) if c.dtype == torch.float16 else (2.0**-8, 1e-30)
            mean_abs = torch.stack(xs).abs().mean(0)
            bound = (r.world + 2) * (u * mean_abs * (1 + 1e-3) + tiny)
            assert bool(((out - exact).abs() <= bound).all())
        elif isinstance(c, compressors.Quantizer) and dtype == torch.float32:
            two_phase = c.resolve_algorithm(r.world) == "two_phase"
            bound = quantization_error_bound(xs, c.bits, two_phase, c.chunk_numel(N, r.world))
            err = (out - exact).abs()
            assert bool((err <= bound).all()), float((err - bound).max())
        elif isinstance(c, compressors.Quantizer):
            tol = 0.05 * float(exact.abs().max())
            torch.testing.assert_close(out.float(), exact, rtol=0.05, atol=tol)
        elif isinstance(c, TopK):
            # Exact mode is a function of the input alone: rebuild every rank's payload here.
            k = c.k(N)
            payload = ops.topk_compress(x.to(dtype), None, k)
            rows = gather_rows(payload, r.world)
            want = ref.sparse_accumulate(rows, N, k, r.world, torch.float32, dtype)
            assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
            # ... and equals a plain all_reduce of each rank's selected (sparse) tensor.
            sparse = torch.zeros(N)
            idx = payload[: 4 * k].view(torch.int32).long()
            sparse[idx] = x.to(dtype).float()[idx]
            dist.all_reduce(sparse)
            assert_equal_or_close(out, (sparse / r.world).to(dtype), r.world)
        else:
            values = ref.randk_compress(x.to(dtype), None, c.k(N), c.seed, 2, 5)
            dist.all_reduce(values)
            want = ref.randk_decompress(values, N, c.seed, 2, 5, r.world, dtype)
            assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    # Dispatch is by isinstance: a subclass of a method runs that method's algorithm.
    sub = copy.copy(c)
    sub.__class__ = type("Subclass", (type(c),), {"__slots__": ()})
    assert torch.equal(r.reduce(x, sub)[0], r.reduce(x, c)[0])


def check_constants(r: Rank, c) -> None:
    # Dyadic constants: every sum and mean below is exact in fp32, so any error would be
    # the quantizer's. Constant blocks must round-trip losslessly at every bit width.
    n = 3 * BLOCK * r.world + 5
    x = torch.full((n,), 0.25 * (r.rank + 1))
    exact = torch.full((n,), 0.25 * sum(i + 1 for i in range(r.world)) / r.world)
    assert torch.equal(r.reduce(x, c)[0], exact)


def check_empty_and_tiny(r: Rank, c) -> None:
    out, ctx = r.reduce(torch.empty(0), c)
    assert out.numel() == 0
    # Nothing to send for a method with its own algorithm: no collective at all.
    plain = isinstance(c, (compressors.NoCompression, compressors.CastCompression))
    assert ctx.stats.paths == {expected_path(c, 0, r.world) if plain else "empty": 1}
    one = torch.tensor([float(r.rank + 1)])
    out, _ = r.reduce(one, c)  # one block, one chunk; top-k and random-k: k = 1 = n
    if isinstance(c, compressors.CastCompression):
        assert torch.equal(out, cast_reference(r, c, one))
    else:
        assert out.item() == sum(range(1, r.world + 1)) / r.world


def check_ratio_one(r: Rank, c) -> None:
    # Ratio 1.0 sends everything: the very all_reduce of x that plain DDP would do (sum,
    # then / N, the quotient correctly rounded on every device), bit for bit.
    x = rank_input(r.rank, N)
    want = r.all_reduce(r.put(x)).cpu().div_(r.world)
    assert torch.equal(r.reduce(x, type(c)(1.0))[0], want)


def pieces_reference(r: Rank, c, x: torch.Tensor, key: int) -> torch.Tensor:
    """reference.py's result of one step from zero residuals: each rank's payload, then
    the sum of the gathered payloads in rank order (random-k: dist.all_reduce's sum)."""
    n, zeros = x.numel(), torch.zeros(x.numel())
    if isinstance(c, TopK):
        rows = gather_rows(ref.topk_compress(x, zeros, c.k(n)), r.world)
        return ref.sparse_accumulate(rows, n, c.k(n), r.world, torch.float32, torch.float32)
    if isinstance(c, RandomK):
        values = ref.randk_compress(x, zeros, c.k(n), c.seed, 0, key)
        dist.all_reduce(values)
        return ref.randk_decompress(values, n, c.seed, 0, key, r.world, torch.float32)
    seed = collectives._stream_seed(c.seed, key)
    if c.resolve_algorithm(r.world) == "two_phase":
        return two_phase_reference(r, c, x, seed)
    payload = ref.quantize(x, zeros, c.code, c.block_size, c.stochastic, seed, 0, r.rank * n)
    rows = gather_rows(payload, r.world)
    return ref.dequantize_sum(rows, n, c.code, c.block_size, r.world, torch.float32)


def two_phase_reference(r: Rank, c, x: torch.Tensor, seed: int) -> torch.Tensor:
    """The two-phase algorithm on reference.py's ops from zero residuals, with the RNG
    counter ranges of collectives.py: every rank quantizes the whole tensor, each chunk's
    owner sums its chunk of every payload and re-quantizes, every rank decodes them all."""
    n, world, bits, block, rec = x.numel(), r.world, c.code, c.block_size, c.record_bytes
    chunk = c.chunk_numel(n, world)
    stride = 2 * world * chunk
    payload = ref.quantize(x, torch.zeros(n), bits, block, c.stochastic, seed, 0, r.rank * stride)
    rows, reduced = gather_rows(payload, world), []
    for d in range(world):
        e0, e1 = min(n, d * chunk), min(n, (d + 1) * chunk)
        if e1 > e0:
            b0 = d * chunk // block * rec
            part = rows[:, b0 : b0 + -(-(e1 - e0) // block) * rec]
            offset = d * stride + world * chunk + d * chunk
            reduced.append(
                ref.dequantize_sum_requantize(
                    part, torch.zeros(e1 - e0), e1 - e0, bits, block, world, c.stochastic,
                    seed, 0, offset,
                )
            )  # fmt: skip
    return ref.dequantize(torch.cat(reduced), n, bits, block, torch.float32)


def payload_bytes(c, n: int) -> int:
    """The bytes one rank's payload takes: what a single piece would send."""
    if isinstance(c, TopK):
        return 8 * c.k(n)
    if isinstance(c, RandomK):
        return 4 * c.k(n)
    return c.record_bytes * -(-n // c.block_size)


def check_pieces(r: Rank, c) -> None:
    # On gloo the payload goes out as several collectives, each decoded as it lands: the
    # result must be reference.py's bit for bit however many pieces, at sizes that split
    # unevenly and at a bucket smaller than one piece.
    saved = collectives._GLOO_PIECE_BYTES
    for n in (5, 40 * BLOCK + 3):
        x = rank_input(r.rank, n)
        want = pieces_reference(r, c, x, key=3)
        payload = payload_bytes(c, n)
        for pieces in (1, 3, 7, 13):
            collectives._GLOO_PIECE_BYTES = max(1, payload // pieces)
            try:
                got, ctx = r.reduce(x, c, key=3)
            finally:
                collectives._GLOO_PIECE_BYTES = saved
            assert ctx.stats.paths == {expected_path(c, n, r.world): 1}
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (n, pieces)
    # The pieces really are several: 41 records of 3-record pieces make 13, and a small
    # payload of a large bucket is cut by the bucket's size (at most 16 pieces).
    collectives._GLOO_PIECE_BYTES = 3 * 100
    try:
        assert len(collectives._pieces(41, 100, 0, dist.group.WORLD)) == 13
    finally:
        collectives._GLOO_PIECE_BYTES = saved
    bucket = collectives._GLOO_PIECE_BUCKET_BYTES
    assert len(collectives._pieces(41, 100, 4 * bucket, dist.group.WORLD)) == 4
    assert len(collectives._pieces(41, 100, 100 * bucket, dist.group.WORLD)) == 16


class ForceSparse(TopK):
    """Top-k that never takes the dense switch, to compare the two paths."""

    __slots__ = ()

    def use_dense(self, numel, world):
        return False


def check_link_pieces(r: Rank, c) -> None:
    # With a Workspace the gloo pieces follow the payload rate the ranks agreed on: ranks
    # that measured different rates all take the fastest one's pieces, from the same call
    # on, and every call still gives reference.py's bits. The rates are set, not measured
    # (rank 0 measures 3 units per second, the others 5; a unit is a 41st of the payload,
    # and a piece carries one second of wire), and the call counts are LinkRate's.
    if isinstance(c, TopK):
        c = ForceSparse(c.ratio, error_feedback=c.error_feedback)
    n = 40 * BLOCK + 3 if isinstance(c, compressors.Quantizer) else 41 * 200
    x, key = rank_input(r.rank, n), 3
    want = pieces_reference(r, c, x, key=key)
    payload = payload_bytes(c, n)
    unit = payload // 41
    records = 41 if isinstance(c, compressors.Quantizer) else payload
    limits = ("_GLOO_PIECE_BYTES", "_GLOO_MIN_PIECE_BYTES", "_LINK_PIECE_SECONDS")
    saved = [getattr(collectives, name) for name in limits], LinkRate.start
    rate = float((3 + 2 * min(r.rank, 1)) * unit)

    def start(link, *args):
        timing = saved[1](link, *args)
        link._best = rate
        return timing

    for name, value in zip(limits, (payload, 1, 1.0), strict=True):
        setattr(collectives, name, value)
    LinkRate.start = start
    workspace, counts = Workspace(), []
    try:
        for _ in range(LinkRate.FIRST + 2):
            ctx = ReduceContext(
                group=r.group, memory=ResidualMemory(), key=key, workspace=workspace
            )
            got = collectives.all_reduce_mean(r.put(x), c, ctx).wait().cpu()
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            counts.append(workspace.link(key).pieces)
    finally:
        for name, value in zip(limits, saved[0], strict=True):
            setattr(collectives, name, value)
        LinkRate.start = saved[1]
    if dist.get_backend(r.group) != "gloo":  # NCCL sends one piece and times no link
        assert counts == [0] * (LinkRate.FIRST + 2), counts
        return
    fastest = (3 + 2 * min(r.world - 1, 1)) * unit
    assert counts == [1] * LinkRate.FIRST + [min(records, payload // fastest)] * 2, counts
    assert workspace.link(key).as_dict() == {
        "pieces": counts[-1],
        "agreed_MB_per_s": fastest / 1e6,
    }
    assert_same_on_every_rank(torch.tensor(counts), r.world)


def check_randk_pipelined(r: Rank, c) -> None:
    # At two ranks on gloo random-k compresses, sends and decodes its strata in pieces, each
    # decoded as it lands (collectives._randk_pipelined; CPU tensors). Step after step, with
    # error feedback, the result and the residual are those of the bucket in one piece, bit
    # for bit: for finite input, for a non-finite entry in one piece of the last rank (NaN
    # at every sent index, as the whole call makes it, and the residual reset), and for
    # finite values whose sum overflows to Inf in one piece (Inf there only).
    n = 41 * 200 + 7
    payload = payload_bytes(c, n)
    limits = ("_GLOO_PIECE_BYTES", "_GLOO_PIECE_BUCKET_BYTES")
    saved = [getattr(collectives, name) for name in limits]
    compress, starts = ops.randk_compress, []

    def counting(*args, **kwargs):
        starts.append(kwargs.get("start", 0))
        return compress(*args, **kwargs)

    whole_memory, pieces_memory = ResidualMemory(), ResidualMemory()
    for step in range(4):
        x = rank_input(r.rank, n, step)
        if step == 1 and r.rank == r.world - 1:
            x[n // 2] = float("nan")
        if step == 2:
            x[: n // 5] = 3e38  # sums of two ranks overflow
        outs = []
        for memory, piece in ((whole_memory, 10 * payload), (pieces_memory, payload // 5)):
            for name, value in zip(limits, (piece, 1 << 60), strict=True):
                setattr(collectives, name, value)
            ops.randk_compress = counting
            try:
                outs.append(r.reduce(x, c, memory, key=3, step=step)[0])
            finally:
                ops.randk_compress = compress
                for name, value in zip(limits, saved, strict=True):
                    setattr(collectives, name, value)
        whole, pieces = outs
        assert torch.equal(whole.view(torch.uint8), pieces.view(torch.uint8)), step
        for key, buf in whole_memory.buffers.items():
            assert torch.equal(pieces_memory.buffers[key].view(torch.uint8), buf.view(torch.uint8))
        assert bool(whole.isnan().any()) == (step == 1)
        assert bool(whole.isinf().any()) == (step == 2 and r.world > 1)
    pipelined = r.world == 2 and r.device == "cpu"
    assert any(starts) == pipelined, starts


def check_dense_switch(r: Rank, c) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        x = rank_input(r.rank, N).to(dtype)
        assert c.use_dense(N, r.world)
        dense, dense_ctx = r.reduce(x, c)
        sparse, sparse_ctx = r.reduce(x, ForceSparse(c.ratio, error_feedback=False))
        assert dense_ctx.stats.paths == {"topk_dense": 1}
        assert sparse_ctx.stats.paths == {"topk_all_gather": 1}
        assert dense_ctx.stats.bytes_sent < sparse_ctx.stats.bytes_sent or r.world == 1
        assert_same_on_every_rank(dense, r.world)
        assert_equal_or_close(dense, sparse, r.world)


def check_wrapper(r: Rank, c) -> None:
    """ddpcomm.all_reduce outside DDP: exact top-k is a function of the inputs alone."""
    x = rank_input(r.rank, N, 4)
    y = r.put(x)
    ddpcomm.all_reduce(y, compression=c.spec, group=r.group)
    y, k = y.cpu(), c.k(N)
    if isinstance(c, TopK):
        rows = gather_rows(ops.topk_compress(x, None, k), r.world)
        assert torch.equal(y, ref.sparse_accumulate(rows, N, k, r.world, *[torch.float32] * 2))
    else:
        assert_same_on_every_rank(y, r.world)
        assert int(torch.count_nonzero(y)) <= k


# --------------------------------------------------------------------------------------
# CUDA gives the CPU's bits: gloo with 2 ranks sharing one GPU, NCCL with 1
# --------------------------------------------------------------------------------------

STEPS = 3
# (spec, options): every bit width, both algorithms, error feedback, stochastic rounding;
# top-k (exact, approximate with fp16 values) and random-k with error feedback.
CONFIGS = [
    ("q8", dict(algorithm="all_gather")),
    ("q8", dict(algorithm="two_phase", error_feedback=True)),
    ("q4", dict(algorithm="two_phase", stochastic=True, error_feedback=True, seed=3)),
    ("q2", dict(block_size=64)),
    ("q1", dict(block_size=1024, algorithm="all_gather")),
    ("q1.5", dict()),
    ("q1.5", dict(block_size=64, algorithm="two_phase")),
    ("topk:0.05", dict()),
    ("topk:0.05", dict(approximate=True, value_dtype=torch.float16)),
    ("randk:0.05", dict(seed=5)),
]


def _compare_devices(rank: int, cuda_group, cpu_group) -> list[str]:
    """Runs every config on CUDA tensors over cuda_group and on CPU tensors over cpu_group;
    returns a description of every mismatch (empty when bitwise equal)."""
    torch.cuda.set_device(0)
    bad = []
    n = 3 * 4096 + 77  # several blocks and chunks, a partial last block
    for spec, opts in CONFIGS:
        comp = compressors.parse(spec, **opts)
        mem_cpu, mem_gpu = ResidualMemory(), ResidualMemory()
        for step in range(STEPS):
            x = rank_input(rank, n, step)
            ctx_cpu = ReduceContext(group=cpu_group, memory=mem_cpu, key=0, step=step)
            ctx_gpu = ReduceContext(group=cuda_group, memory=mem_gpu, key=0, step=step)
            want = collectives.all_reduce_mean(x.clone(), comp, ctx_cpu).wait()
            got = collectives.all_reduce_mean(x.cuda(), comp, ctx_gpu).wait()
            # Read on the caller's stream right after wait(), no synchronize (DESIGN.md §8).
            if not got.is_cuda or not torch.equal(got.cpu(), want):
                bad.append(f"{spec} {opts} step {step}: result differs")
            for key, buf in mem_cpu.buffers.items():
                other = mem_gpu.buffers.get(key)
                if other is None or not torch.equal(other.cpu(), buf):
                    bad.append(f"{spec} {opts} step {step}: residual {key} differs")
    return bad


def check_gloo(rank, world):
    return _compare_devices(rank, None, None)


def check_nccl(rank, world):
    nccl = dist.new_group(backend="nccl")
    try:
        return _compare_devices(rank, nccl, None)
    finally:
        dist.destroy_process_group(nccl)


def check_coalesced(rank, world):
    # all_reduce_coalesced flattens with the native flatten ops (CUDA ones here): CUDA
    # tensors must end bitwise where the same call leaves CPU tensors.
    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(rank)
    shapes = [(3, 5), (1000,), (7, 11, 13), (1,), (4097,)]
    bad = []
    for compression in ("none", "q8", "q4", "fp16"):
        cpu = [torch.randn(s, generator=g) for s in shapes]
        cpu.append(torch.randn(9, 6, generator=g).t())  # a strided entry
        gpu = [t.cuda() for t in cpu]
        ddpcomm.all_reduce_coalesced(cpu, compression=compression)
        ddpcomm.all_reduce_coalesced(gpu, compression=compression)
        if not all(torch.equal(a, b.cpu()) for a, b in zip(cpu, gpu, strict=True)):
            bad.append(compression)
    return bad


# --------------------------------------------------------------------------------------
# The plan every rank of a group runs, and the tests reading it
# --------------------------------------------------------------------------------------

# (check, the methods it runs for, function), in the order every rank runs them.
CHECKS = [
    ("mean", METHODS, check_mean),
    ("constants", {m: METHODS[m] for m in CONSTANT_EXACT}, check_constants),
    ("empty_and_tiny", METHODS, check_empty_and_tiny),
    ("ratio_one", {m: METHODS[m] for m in SPARSE}, check_ratio_one),
    ("pieces", PIECES, check_pieces),
    ("link_pieces", {m: PIECES[m] for m in ("q8", "topk")}, check_link_pieces),
    ("randk_pipelined", {"randk": PIECES["randk"]}, check_randk_pipelined),
    ("dense_switch", {"topk:0.6": ("topk:0.6", dict(error_feedback=False))}, check_dense_switch),
    ("wrapper", {m: METHODS[m] for m in SPARSE}, check_wrapper),
]


def run_check(check, r: Rank, spec: str, options: dict) -> None:
    check(r, compressors.parse(spec, **options))


def nothing_differs(compare, *args) -> None:
    bad = compare(*args)
    assert bad == [], f"CUDA differs from CPU: {bad}"


def plan(rank: int, world: int, device: str):
    if device == "cuda":
        torch.cuda.set_device(0)
    for r, suffix in Rank(rank, world, device).groups():
        for name, methods, check in CHECKS:
            for method, (spec, options) in methods.items():
                key = (name, method, *suffix)
                yield key, functools.partial(run_check, check, r, spec, options)
    if device == "cuda" and world == 1:
        yield ("cuda_matches_cpu", "nccl"), functools.partial(nothing_differs, check_nccl, 0, 1)
    if device == "cuda" and world == 2:
        compare = functools.partial(nothing_differs, check_gloo, rank, world)
        yield ("cuda_matches_cpu", "gloo"), compare
        yield ("coalesced_matches_cpu",), functools.partial(check_coalesced, rank, world)


@pytest.fixture(scope="module")
def groups():
    return Groups(plan)


@per_group
@pytest.mark.parametrize("method", METHODS)
def test_mean_within_method_bound(groups, method, world, device):
    """none and casts: bitwise their definition; quantizers: within the analytic bound;
    top-k and random-k: the all_reduce of what each rank selected. Every rank gets the same
    bits, stats() counts the method's wire bytes, a subclass runs its base's algorithm."""
    groups.values(world, device, "mean", method)


@per_group
@pytest.mark.parametrize("method", CONSTANT_EXACT)
def test_constants_reduce_exactly(groups, method, world, device):
    groups.values(world, device, "constants", method)


@per_group
@pytest.mark.parametrize("method", METHODS)
def test_empty_and_one_element(groups, method, world, device):
    groups.values(world, device, "empty_and_tiny", method)


@per_group
@pytest.mark.parametrize("method", SPARSE)
def test_ratio_one_is_the_plain_all_reduce(groups, method, world, device):
    groups.values(world, device, "ratio_one", method)


@per_group
@pytest.mark.parametrize("method", PIECES)
def test_pieces_give_the_reference_bits(groups, method, world, device):
    groups.values(world, device, "pieces", method)


def test_link_rate_counts_only_time_on_the_wire(monkeypatch):
    """A piece is on the wire from the later of its issue and the previous landing until
    it lands: queued pieces count once, time before an issue (compressing) not at all, and
    the best call since the last agreement is the rank's rate."""
    link, now = LinkRate(), [0.0]
    monkeypatch.setattr("ddpcomm.context.time.perf_counter", lambda: now[0])

    def call(payload, events):
        timing = link.start(payload, len(events) // 2)
        for t, kind, i in sorted(events):
            now[0] = t
            (timing.issued if kind == "issued" else timing.landed)(i)

    # Wire-bound: three pieces queued behind each other, 3 s on the wire: 100 bytes/s.
    call(300, [(0, "issued", 0), (0.5, "issued", 1), (1, "issued", 2)]
         + [(1, "landed", 0), (2, "landed", 1), (3, "landed", 2)])  # fmt: skip
    link.start(0, 0)
    assert link._best == 100.0
    # Compute-bound: 4 s of compressing between two 1 s pieces: 200 bytes/s, not 400/6.
    call(400, [(10, "issued", 0), (11, "landed", 0), (15, "issued", 1), (16, "landed", 1)])
    link.start(0, 0)
    assert link._best == 200.0
    # A slower call (50 bytes/s) leaves the best one.
    call(100, [(20, "issued", 0), (22, "landed", 0)])
    link.start(0, 0)
    assert link._best == 200.0


@per_group
def test_randk_pipelined_gives_the_whole_bucket_bits(groups, world, device):
    groups.values(world, device, "randk_pipelined", "randk")


@per_group
@pytest.mark.parametrize("method", ["q8", "topk"])
def test_pieces_follow_the_agreed_link_rate(groups, method, world, device):
    groups.values(world, device, "link_pieces", method)


@per_group
def test_topk_dense_switch_same_numbers_fewer_bytes(groups, world, device):
    groups.values(world, device, "dense_switch", "topk:0.6")


@per_group
@pytest.mark.parametrize("method", SPARSE)
def test_ddpcomm_all_reduce(groups, method, world, device):
    groups.values(world, device, "wrapper", method)


@pytest.mark.parametrize("device", CUDA_ONLY)
@pytest.mark.parametrize("world, backend", [(2, "gloo"), (1, "nccl")])
def test_cuda_gives_the_cpu_bits(groups, world, backend, device):
    """The CUDA ops give the CPU ops' bits and the algorithms are deterministic, so a
    compressed all-reduce of CUDA tensors gives bitwise the result (and error-feedback
    residuals) of the same all-reduce of CPU tensors, step after step."""
    groups.values(world, device, "cuda_matches_cpu", backend)


@pytest.mark.parametrize("device", CUDA_ONLY)
def test_all_reduce_coalesced_cuda_gives_the_cpu_bits(groups, device):
    for rank, bad in enumerate(groups.values(2, device, "coalesced_matches_cpu")):
        assert bad == [], f"rank {rank}: CUDA differs from CPU for {bad}"


def test_divisor_travels_as_a_device_tensor_off_the_cpu():
    # torch's CUDA division by a Python number multiplies by its reciprocal (on an H100,
    # 33% of 1M random quotients by 3 differed from the CPU's in the last bit);
    # by a 0-dim tensor on the device it divides, as the CPU and the kernels do.
    assert ops.divisor(3, torch.ones(2)) == 3
    like = torch.ones(2, device="meta", dtype=torch.float16)
    d = ops.divisor(3, like)
    assert (d.device.type, d.dtype, d.dim()) == ("meta", torch.float32, 0)
    assert (like / d).dtype == torch.float16


def test_wire_bytes_and_dense_switch_rule():
    n = 1 << 20
    topk, randk = compressors.parse("topk:0.01"), compressors.parse("randk:0.01")
    k = topk.k(n)
    for world in (2, 3, 4):
        assert topk.wire_bytes(n, world) == (world - 1) * k * 8
        assert randk.wire_bytes(n, world) == 2 * (world - 1) * k * 4 // world
    # N * k * 8 > 2(N-1)/N * 4n  <=>  ratio > (N-1) / N^2 at fp32 values.
    parse = compressors.parse
    assert not parse("topk:0.24").use_dense(n, 2) and parse("topk:0.26").use_dense(n, 2)
    assert parse("topk:0.3", value_dtype=torch.float16).use_dense(n, 2) is False
