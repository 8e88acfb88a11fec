"""Top-k and random-k all-reduce on spawned gloo groups: exactness against plain
dist.all_reduce of what each rank selected, rank agreement, the dense switch, error
feedback and non-finite buckets."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ddpcomm.ops as ops
import ddpcomm.reference as ref
from ddpcomm import collectives
from ddpcomm.compressors import RandomK, TopK, parse
from ddpcomm.context import ReduceContext, ResidualMemory
from tests.dist_utils import run_ranks

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
N = 10007  # odd, several scan blocks
# Tolerance for comparing against a sum the collective adds in its own order (N > 2):
# a few ulps of the output dtype.
RTOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def gen(n, dtype, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def ctx(key=0, step=0, memory=None):
    return ReduceContext(memory=memory or ResidualMemory(), key=key, step=step)


def gather_rows(t: torch.Tensor, world: int) -> torch.Tensor:
    out = torch.empty(world * t.numel(), dtype=t.dtype)
    dist.all_gather_into_tensor(out, t)
    return out.view(world, -1)


def assert_same_on_every_rank(t: torch.Tensor, world: int):
    rows = gather_rows(t.contiguous().view(torch.uint8), world)
    assert torch.equal(rows, rows[:1].expand_as(rows)), "ranks disagree"


def assert_equal_or_close(got, want, world):
    """Bitwise when at most two terms are added (order cannot matter), else a few ulps."""
    if world <= 2:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    else:
        torch.testing.assert_close(got, want, rtol=RTOL[got.dtype], atol=1e-6)


class ForceSparse(TopK):
    """Top-k that never takes the dense switch, to compare the two paths."""

    __slots__ = ()

    def use_dense(self, numel, world):
        return False


def check_topk(rank, world):
    for dtype in FLOATS:
        x = gen(N, dtype, 10 * rank + 1)
        c = TopK(0.01, error_feedback=False)
        k = c.k(N)
        cx = ctx(key=3, step=1)
        out = collectives.all_reduce_mean(x.clone(), c, cx).wait()
        # One rank: the gathered payload (k pairs) outweighs a dense all_reduce (0 bytes).
        path = "topk_dense" if world == 1 else "topk_all_gather"
        assert out.dtype == dtype and cx.stats.paths == {path: 1}
        assert cx.stats.bytes_sent == c.wire_bytes(N, world)
        assert_same_on_every_rank(out, world)
        # Exact mode is a function of the input alone: rebuild every rank's payload here.
        payload = ops.topk_compress(x, None, k)
        rows = gather_rows(payload, world)
        want = ref.sparse_accumulate(rows, N, k, world, torch.float32, dtype)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
        # ... and equals a plain all_reduce of each rank's selected (sparse) tensor.
        sparse = torch.zeros(N)
        idx = payload[: 4 * k].view(torch.int32).long()
        sparse[idx] = x.float()[idx]
        dist.all_reduce(sparse)
        assert_equal_or_close(out, (sparse / world).to(dtype), world)


def check_empty_and_tiny(rank, world):
    for c in (TopK(0.01), RandomK(0.01)):
        cx = ctx()
        assert collectives.all_reduce_mean(torch.empty(0), c, cx).wait().numel() == 0
        assert cx.stats.paths == {"empty": 1}
        one = torch.tensor([float(rank + 1)])
        out = collectives.all_reduce_mean(one, c, ctx()).wait()  # k = 1 = n
        assert out.item() == sum(range(1, world + 1)) / world
    # Ratio 1.0 sends everything: the very all_reduce of x that plain DDP would do (sum,
    # then / N), bit for bit.
    x = gen(N, torch.float32, rank + 7)
    want = x.clone()
    dist.all_reduce(want)
    want /= world
    for c in (TopK(1.0), RandomK(1.0)):
        out = collectives.all_reduce_mean(x.clone(), c, ctx()).wait()
        assert torch.equal(out, want), c


def check_dense_switch(rank, world):
    for dtype in (torch.float32, torch.bfloat16):
        x = gen(N, dtype, 10 * rank + 2)
        c = TopK(0.6, error_feedback=False)
        assert c.use_dense(N, world)
        dense_ctx, sparse_ctx = ctx(), ctx()
        dense = collectives.all_reduce_mean(x.clone(), c, dense_ctx).wait()
        sparse = collectives._topk(
            x.clone(), ForceSparse(0.6, error_feedback=False), sparse_ctx
        ).wait()
        assert dense_ctx.stats.paths == {"topk_dense": 1}
        assert sparse_ctx.stats.paths == {"topk_all_gather": 1}
        assert dense_ctx.stats.bytes_sent < sparse_ctx.stats.bytes_sent or world == 1
        assert_same_on_every_rank(dense, world)
        assert_equal_or_close(dense, sparse, world)


def check_randk(rank, world):
    for dtype in FLOATS:
        x = gen(N, dtype, 10 * rank + 3)
        c = RandomK(0.01, seed=7, error_feedback=False)
        cx = ctx(key=5, step=2)
        out = collectives.all_reduce_mean(x.clone(), c, cx).wait()
        assert cx.stats.paths == {"randk_all_reduce": 1}
        assert_same_on_every_rank(out, world)
        values = ref.randk_compress(x, None, c.k(N), 7, 2, 5)
        dist.all_reduce(values)
        want = ref.randk_decompress(values, N, 7, 2, 5, world, dtype)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def check_error_feedback(rank, world):
    """N * sum(outputs) + sum over ranks(residual) == sum over ranks and steps(inputs)."""
    for spec, options, kind in [
        ("topk:0.05", {}, "topk"),
        ("topk:0.05", {"approximate": True, "value_dtype": torch.bfloat16}, "topk"),
        ("randk:0.05", {"seed": 1}, "randk"),
    ]:
        c = parse(spec, **options)
        memory = ResidualMemory()
        sum_in = torch.zeros(N, dtype=torch.float64)
        sum_out = torch.zeros(N, dtype=torch.float64)
        for step in range(6):
            x = gen(N, torch.float32, 1000 * step + rank)
            sum_in += x.double()
            out = collectives.all_reduce_mean(x.clone(), c, ctx(0, step, memory)).wait()
            assert_same_on_every_rank(out, world)
            sum_out += out.double()
        residual = memory.buffers[(kind, 0)].double()
        lhs = world * sum_out + residual
        dist.all_reduce(lhs)  # world * sum_out is the same on every rank: scale it back
        lhs = lhs - (world - 1) * world * sum_out
        dist.all_reduce(sum_in)
        # Only the fp32 rounding of each step's mean separates the two sides.
        torch.testing.assert_close(lhs, sum_in, rtol=1e-5, atol=1e-4)
        assert float(residual.abs().sum()) > 0  # the test is not vacuous


def check_non_finite(rank, world):
    for spec in ("topk:0.01", "topk:0.5", "randk:0.01"):
        for bad in (float("nan"), float("inf")):
            c = parse(spec, approximate=True) if spec == "topk:0.01" else parse(spec)
            memory = ResidualMemory()
            collectives.all_reduce_mean(gen(N, torch.float32, rank), c, ctx(0, 0, memory)).wait()
            x = gen(N, torch.float32, rank + 50)
            if rank == world - 1:
                x[4321] = bad
            out = collectives.all_reduce_mean(x, c, ctx(0, 1, memory)).wait()
            assert not bool(torch.isfinite(out).all()), (spec, bad)
            for buf in memory.buffers.values():
                assert bool(torch.isfinite(buf).all()) and not bool(buf.any())
            out = collectives.all_reduce_mean(
                gen(N, torch.float32, rank), c, ctx(0, 2, memory)
            ).wait()
            assert bool(torch.isfinite(out).all())


def check_wrapper(rank, world):
    """ddpcomm.all_reduce outside DDP: exact top-k is a function of the inputs alone."""
    import ddpcomm

    x = gen(N, torch.float32, 10 * rank + 4)
    y = x.clone()
    ddpcomm.all_reduce(y, compression="topk:0.01")
    k = parse("topk:0.01").k(N)
    rows = gather_rows(ops.topk_compress(x, None, k), world)
    want = ref.sparse_accumulate(rows, N, k, world, torch.float32, torch.float32)
    assert torch.equal(y, want)
    z = x.clone()
    ddpcomm.all_reduce(z, compression="randk:0.01")
    assert_same_on_every_rank(z, world)
    assert int(torch.count_nonzero(z)) <= k


def worker(rank, world):
    check_wrapper(rank, world)
    check_empty_and_tiny(rank, world)
    check_topk(rank, world)
    check_dense_switch(rank, world)
    check_randk(rank, world)
    check_error_feedback(rank, world)
    check_non_finite(rank, world)
    return True


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sparse_collectives(world):
    assert run_ranks(worker, world) == [True] * world


def test_wire_bytes_and_dense_switch_rule():
    n = 1 << 20
    topk, randk = parse("topk:0.01"), parse("randk:0.01")
    k = topk.k(n)
    for world in (2, 3, 4):
        assert topk.wire_bytes(n, world) == (world - 1) * k * 8
        assert randk.wire_bytes(n, world) == 2 * (world - 1) * k * 4 // world
    # N * k * 8 > 2(N-1)/N * 4n  <=>  ratio > (N-1) / N^2 at fp32 values.
    assert not parse("topk:0.24").use_dense(n, 2) and parse("topk:0.26").use_dense(n, 2)
    assert parse("topk:0.3", value_dtype=torch.float16).use_dense(n, 2) is False
