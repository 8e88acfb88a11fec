"""Quantized all-reduce on spawned gloo groups: equivalence with the exact mean, bitwise
agreement across ranks, exact constants, the error-feedback invariant, non-finite input,
configuration mismatch and collective order under out-of-order completion."""

import math

import pytest
import torch
import torch.distributed as dist

from ddpcomm import collectives, compressors, context, reference
from ddpcomm.context import ReduceContext, ResidualMemory
from tests.dist_utils import run_ranks

BLOCK = 64


def rank_input(rank: int, n: int, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))


def block_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per-element absmax of the element's block."""
    n = x.numel()
    nb = math.ceil(n / block)
    padded = torch.zeros(nb * block)
    padded[:n] = x.abs()
    return padded.view(nb, block).amax(1).repeat_interleave(block)[:n]


def quantization_error_bound(
    xs: list[torch.Tensor], bits: int, two_phase: bool, chunk: int
) -> torch.Tensor:
    """Analytic per-element bound on |result - exact mean| for deterministic rounding.

    Each rank's quantization moves x by at most step/2 = m / (2L) (b >= 2) or by at most
    |x| + m (1-bit: sign times block mean |x|). The result is the mean of the dequantized
    payloads; two-phase re-quantizes that mean, adding its own bound on blocks laid out
    from each chunk's start. The small relative slack covers fp32 rounding of sums.
    """
    world = len(xs)

    def one(x, block_start_offset=0):
        if bits == 1:
            # m <= block absmax, so |x - deq| <= |x| + absmax.
            return x.abs() + block_absmax(x, BLOCK)
        return block_absmax(x, BLOCK) / (2 * reference.max_level(bits))

    bound = sum(one(x) for x in xs) / world
    if two_phase:
        mean_bound = torch.stack(xs).mean(0).abs() + bound
        # The re-quantized tensor's blocks start at chunk boundaries, which are block
        # aligned, so block_absmax over the whole tensor gives the same blocks.
        bound = bound + one(mean_bound)
    return bound * (1 + 1e-5) + 1e-30


def _results_identical(t: torch.Tensor, world: int) -> bool:
    every = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(every, t)
    return all(torch.equal(every[0], e) for e in every)


def _reduce(x, comp, memory=None, key=0, step=0):
    ctx = ReduceContext(memory=memory or ResidualMemory(), key=key, step=step)
    return collectives.all_reduce_mean(x.clone(), comp, ctx).wait(), ctx


def check_equivalence(rank, world):
    n = 5 * BLOCK * world + 13  # uneven chunks, a partial last block
    xs = [rank_input(r, n) for r in range(world)]
    exact = torch.stack(xs).mean(0)

    # none: bitwise the plain all_reduce of x * (1/N), as DDP scales buckets.
    out, _ = _reduce(xs[rank], compressors.NoCompression())
    want = xs[rank] * (1.0 / world)
    dist.all_reduce(want)
    assert torch.equal(out, want)

    for bits in (8, 4, 2, 1):
        for algorithm in ("all_gather", "two_phase"):
            q = compressors.Quantizer(bits, BLOCK, error_feedback=False, algorithm=algorithm)
            out, _ = _reduce(xs[rank], q)
            assert out.dtype == torch.float32 and out.shape == (n,)
            assert _results_identical(out, world), (bits, algorithm)
            bound = quantization_error_bound(
                xs, bits, algorithm == "two_phase", q.chunk_numel(n, world)
            )
            err = (out - exact).abs()
            assert bool((err <= bound).all()), (bits, algorithm, float((err - bound).max()))

    # Dispatch is by isinstance: a subclass of a method runs that method's algorithm.
    class Subclass(compressors.Quantizer):
        __slots__ = ()

    assert torch.equal(
        _reduce(xs[rank], Subclass(4, BLOCK))[0],
        _reduce(xs[rank], compressors.Quantizer(4, BLOCK))[0],
    )

    # fp16 / bf16 buckets come back in their dtype, identical everywhere.
    for dtype in (torch.float16, torch.bfloat16):
        q = compressors.Quantizer(8, BLOCK)
        out, _ = _reduce(xs[rank].to(dtype), q)
        assert out.dtype == dtype and _results_identical(out, world)
        tol = 0.05 * float(exact.abs().max())
        torch.testing.assert_close(out.float(), exact, rtol=0.05, atol=tol)
    return True


def check_pieces(rank, world):
    # On gloo the all-gather algorithm sends large payloads as several all_gathers; the
    # result must not depend on how many: force many small pieces, compare bitwise.
    n = 40 * BLOCK + 3
    x = rank_input(rank, n)
    for bits, stochastic in ((8, True), (8, False), (1, False)):
        q = compressors.Quantizer(
            bits, BLOCK, stochastic=stochastic, error_feedback=True, algorithm="all_gather"
        )
        whole, _ = _reduce(x, q)
        saved = collectives._GLOO_PIECE_BYTES
        collectives._GLOO_PIECE_BYTES = 3 * (4 + BLOCK * bits // 8)
        try:
            assert len(collectives._pieces(41, 4 + BLOCK * bits // 8, dist.group.WORLD)) == 13
            pieces, _ = _reduce(x, q)
        finally:
            collectives._GLOO_PIECE_BYTES = saved
        assert torch.equal(whole, pieces), (bits, stochastic)
    return True


def check_constants(rank, world):
    # Dyadic constants: every sum and mean below is exact in fp32, so any error would be
    # the quantizer's. Constant blocks must round-trip losslessly at every bit width.
    n = 3 * BLOCK * world + 5
    x = torch.full((n,), 0.25 * (rank + 1))
    exact = torch.full((n,), 0.25 * sum(r + 1 for r in range(world)) / world)
    for bits in (8, 4, 2, 1):
        for algorithm in ("all_gather", "two_phase"):
            q = compressors.Quantizer(bits, BLOCK, algorithm=algorithm)
            out, _ = _reduce(x, q)
            assert torch.equal(out, exact), (bits, algorithm)
    return True


def check_error_feedback_invariant(rank, world):
    # N * sum_t out_t + sum over ranks of residuals = sum_t sum over ranks of x_t.
    n, steps = 4 * BLOCK * world + 29, 5
    for algorithm in ("all_gather", "two_phase"):
        q = compressors.Quantizer(2, BLOCK, error_feedback=True, algorithm=algorithm)
        memory = ResidualMemory()
        total_out = torch.zeros(n, dtype=torch.float64)
        total_in = torch.zeros(n, dtype=torch.float64)
        for step in range(steps):
            xs = [rank_input(r, n, step) for r in range(world)]
            total_in += torch.stack(xs).double().sum(0)
            out, _ = _reduce(xs[rank], q, memory, key=7, step=step)
            total_out += out.double()
        residual = memory.buffers[("q", 7)].double().clone()
        owner = memory.buffers.get(("q_owner", 7))
        if owner is not None:
            chunk = q.chunk_numel(n, world)
            residual[rank * chunk : rank * chunk + owner.numel()] += owner.double()
        dist.all_reduce(residual)
        lhs = world * total_out + residual
        scale = float(total_in.abs().max())
        assert float((lhs - total_in).abs().max()) <= 1e-5 * scale, algorithm
        # The invariant is not trivially true: without the residuals it fails.
        assert float((world * total_out - total_in).abs().max()) > 1e-3 * scale
    return True


def check_non_finite(rank, world):
    n = 4 * BLOCK * world
    bad_rank = world - 1
    for bits in (8, 1):
        for algorithm in ("all_gather", "two_phase"):
            q = compressors.Quantizer(bits, BLOCK, error_feedback=True, algorithm=algorithm)
            memory = ResidualMemory()
            _reduce(rank_input(rank, n), q, memory, key=3)  # a finite step fills the residual
            x = rank_input(rank, n, 1)
            if rank == bad_rank:
                x[5] = float("nan")
                x[n - 2] = float("inf")
            out, _ = _reduce(x, q, memory, key=3)
            assert not bool(out[5].isfinite()) and not bool(out[n - 2].isfinite())
            assert _results_identical(out.nan_to_num(1.0, 2.0, 3.0), world)
            for buf in memory.buffers.values():
                assert bool((buf == 0).all()), "residual must be reset after a non-finite step"
            out, _ = _reduce(rank_input(rank, n, 2), q, memory, key=3)
            assert bool(out.isfinite().all())
    return True


def check_config_mismatch(rank, world):
    messages = []
    for config, numel in (((f"q{8 >> rank}",), 10), (("q8",), 10 + rank)):
        try:
            context.verify_config(config, numel, None, "cpu")
        except ValueError as exc:
            messages.append(str(exc))
    context.verify_config(("q8",), 10, None, "cpu")  # agreement passes
    return messages


def check_out_of_order_completion(rank, world):
    # Many buckets in flight at once, waited for in reverse order: gloo completes them in
    # different orders on different ranks, and phase 2 must still pair by bucket.
    sizes = [BLOCK * world * k + (7 * k) % 50 for k in range(1, 16)]
    q = compressors.Quantizer(4, BLOCK, algorithm="two_phase", error_feedback=True)
    memory = ResidualMemory()
    xs = [rank_input(rank, s, k) for k, s in enumerate(sizes)]
    futs = [
        collectives.all_reduce_mean(x.clone(), q, ReduceContext(memory=memory, key=k))
        for k, x in enumerate(xs)
    ]
    outs = [f.wait() for f in reversed(futs)][::-1]
    for k, (s, out) in enumerate(zip(sizes, outs, strict=True)):
        assert out.numel() == s
        everyone = [rank_input(r, s, k) for r in range(world)]
        bound = quantization_error_bound(everyone, 4, True, q.chunk_numel(s, world))
        assert bool(((out - torch.stack(everyone).mean(0)).abs() <= bound).all()), k
        assert _results_identical(out, world)
    return True


def all_checks(rank, world):
    check_equivalence(rank, world)
    check_pieces(rank, world)
    check_constants(rank, world)
    check_error_feedback_invariant(rank, world)
    check_non_finite(rank, world)
    check_out_of_order_completion(rank, world)
    return check_config_mismatch(rank, world)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_quantized_all_reduce(world):
    messages = run_ranks(all_checks, world)
    for rank, msgs in enumerate(messages):
        if world == 1:
            assert msgs == []
        else:
            assert len(msgs) == 2, f"rank {rank} did not see every mismatch: {msgs}"
            assert all("ranks disagree on the compression configuration" in m for m in msgs)
