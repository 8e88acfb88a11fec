"""What the collective test modules share: the groups they spawn, their inputs, and a
rank's view of the collectives under test (device tensors over the group under test,
results compared as CPU tensors on the default gloo group)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from ddpcomm import collectives, reference
from ddpcomm.context import ReduceContext, ResidualMemory
from tests.cuda_utils import needs_cuda

BLOCK = 64
N = 10007  # odd: uneven two-phase chunks, a partial last block, several top-k scan blocks
WORLDS = [1, 2, 3, 4]
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
CUDA_ONLY = [pytest.param("cuda", marks=needs_cuda)]
ALGORITHMS = ("all_gather", "two_phase")


def per_group(test):
    """Parametrizes ``test`` over every world size and device (one spawned group each)."""
    test = pytest.mark.parametrize("world", WORLDS)(test)
    return pytest.mark.parametrize("device", DEVICES)(test)


def quantizer(bits: float, algorithm: str = "auto", **options) -> tuple[str, dict]:
    """(spec, options) of a quantizer with the tests' block size."""
    return f"q{bits}", dict(block_size=BLOCK, algorithm=algorithm, **options)


def rank_input(rank: int, n: int, step: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))


class Rank:
    """One rank of a check: the collectives under test run on ``device`` tensors over
    ``group`` (None: the default gloo group) and hand back CPU tensors, which the checks
    compare with the default group."""

    def __init__(self, rank: int, world: int, device: str, group=None) -> None:
        self.rank, self.world, self.device, self.group = rank, world, device, group

    def groups(self):
        """This rank on gloo, then, for CUDA at one rank, on NCCL as well."""
        yield self, ()
        if self.device == "cuda" and self.world == 1:
            nccl = dist.new_group(backend="nccl")
            yield Rank(self.rank, self.world, self.device, nccl), ("nccl",)

    def put(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device, copy=True)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The plain dist.all_reduce (sum) of a device tensor on the group under test."""
        dist.all_reduce(t, group=self.group)
        return t

    def reduce(self, x, c, memory=None, key=0, step=0):
        """all_reduce_mean of a device copy of ``x``: (the result on the CPU, its context)."""
        ctx = ReduceContext(group=self.group, memory=memory or ResidualMemory(), key=key, step=step)
        out = collectives.all_reduce_mean(self.put(x), c, ctx).wait()
        assert out.device.type == self.device
        return out.cpu(), ctx


def gather_rows(t: torch.Tensor, world: int) -> torch.Tensor:
    out = torch.empty(world * t.numel(), dtype=t.dtype)
    dist.all_gather_into_tensor(out, t)
    return out.view(world, -1)


def assert_same_on_every_rank(t: torch.Tensor, world: int) -> None:
    rows = gather_rows(t.contiguous().view(torch.uint8), world)
    assert torch.equal(rows, rows[:1].expand_as(rows)), "ranks disagree"


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

    Each rank's quantization moves x by at most step/2 = m / (2L) (b >= 4), by at most
    max(absmax / 2, |x|) (2-bit: |x| <= m rounds within m / 2, a value above the clipped
    m codes +-m), by at most |x| + m (1-bit: sign times block mean |x|) or by at most the
    block's absmax (q1.5: a kept x and its +-m share a sign and lie in [0, absmax]; a dropped
    one moves by |x|). The result is
    the mean of the dequantized payloads; two-phase re-quantizes that mean, adding its own
    bound on blocks laid out from each chunk's start. The small relative slack covers fp32
    rounding of sums.
    """
    world = len(xs)

    def one(x, block_start_offset=0):
        if bits == 1.5:
            return block_absmax(x, BLOCK)
        if bits == 1:
            # m <= block absmax, so |x - deq| <= |x| + absmax.
            return x.abs() + block_absmax(x, BLOCK)
        if bits == 2:
            return torch.maximum(block_absmax(x, BLOCK) / 2, x.abs())
        return block_absmax(x, BLOCK) / (2 * reference.max_level(bits))

    bound = sum(one(x) for x in xs) / world
    if two_phase:
        mean_bound = torch.stack(xs).mean(0).abs() + bound
        # The re-quantized tensor's blocks start at chunk boundaries, which are block
        # aligned, so block_absmax over the whole tensor gives the same blocks.
        bound = bound + one(mean_bound)
    return bound * (1 + 1e-5) + 1e-30
