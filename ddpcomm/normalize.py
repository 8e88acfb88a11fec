"""Quantizing in units of each element's own scale: a quantizer's ``normalize=K`` in DDP hooks.

A 1-bit code sends one magnitude per block: sign x block mean ``|x|``. Every element of a
block then arrives with the same size, so an AdamW step, which divides each element by
its own running RMS, sees the block's scale in every element and loses the per-element
adaptivity it exists for: an element whose gradients are small next to its block's is
pushed by noise as large as the block's typical gradient (benchmarks/RESULTS.md, "Steady
state with AdamW", measures what that costs).
A 2-bit code sends three levels of one block magnitude m (-m, 0, m; m is 1.5x the block's
mean |x|, at most its largest): the same loss, to a lesser degree (both measured there).

With ``normalize=K`` each element is divided by a scale every rank shares before it is
compressed, and the mean is multiplied back after: the code's error in each element is
then proportional to that element's own size, and so is what AdamW sees. The scale is
each element's gradient RMS, as an exponential average over steps (``BETA``) kept by each
rank of its own gradients and shared every K compressed steps: the ranks average the
base-2 logarithms of their RMS through an 8-bit quantized all-reduce (8.1 bits per
element every K steps, 0.125 at K = 64; ``stats()`` counts them as path ``"scale"``).
Error feedback runs in the scaled units; when a refresh changes the scale, the residuals
are rescaled with it, so the error-feedback invariant keeps holding in gradient units.

Per-element state (the local average and the shared scale, float32: with the error-feedback
residual 12 bytes per element) lives in the state's ``ResidualMemory`` beside the residuals:
carried per parameter across DDP's bucket rebuild, saved and restored with the state. A
non-finite step zeroes the local average with the residuals and keeps the last shared scale.
Deterministic and identical on every rank: the shared scale is the output of a collective
every rank decodes alike.
"""

from __future__ import annotations

import torch

from ddpcomm import collectives, layout
from ddpcomm.compressors import Quantizer
from ddpcomm.context import ReduceContext

BETA = 0.8  # the local average's decay per step: a horizon of about 5 steps
LOG2_FLOOR = -40.0  # RMS below 2^-40 counts as 2^-40 (log2 of zero is -inf)
RELATIVE_FLOOR = 1e-3  # no element is scaled up by more than 1000x the bucket's mean scale
SCALE_BITS = 8  # the log2 RMS travel as q8 (block-wise absmax, no error feedback)
PART = "scale:"  # the refresh's buffers and residual kinds, beside the bucket's own


def observe(flat: torch.Tensor, ctx: ReduceContext) -> torch.Tensor:
    """Adds this step's local gradient to the local average (plain steps too, so the
    first compressed step starts from a formed average), and returns that average."""
    local = ctx.residual("rms_local", flat.numel(), flat.device)
    with ctx.stats.timer():  # ops.quantize's average arithmetic, where it has a scale
        return local.mul_(BETA).addcmul_(flat, flat, value=1 - BETA)


class Scaling:
    """A bucket in units of the shared scale, range by range: ``args(e0, e1)`` are the
    arguments that make ops.quantize code elements [e0, e1) of the bucket divided by their
    scale (adding them to the local average first, unless this step's refresh already did);
    ``scale[e0:e1]`` is what the codec's mean of them is multiplied by on the way back (the
    dequantize ops' ``scale``). The quantizers take them for each piece as it is quantized
    and as it lands, so that these passes run while other pieces are on the wire; every
    element goes down once and up once, and each is elementwise, so the pieces give the bits
    of one pass over the bucket."""

    __slots__ = ("local", "scale", "observing")

    def __init__(self, local, scale, observing: bool) -> None:
        self.local, self.scale, self.observing = local, scale, observing

    def args(self, e0: int, e1: int) -> dict:
        average = self.local[e0:e1] if self.observing else None
        return {"scale": self.scale[e0:e1], "average": average, "beta": BETA}


def scaling(flat: torch.Tensor, c: Quantizer, ctx: ReduceContext, done: int) -> Scaling:
    """The bucket's Scaling for this compressed step (``done``: compressed steps before
    it), refreshing the shared scale first at every K-th: the refresh needs the whole
    local average, so that step adds the gradient to it here, not range by range."""
    # 1 (gradient units) where no scale was shared yet: ResidualMemory.FILL.
    scale = ctx.memory.get(ctx.part + "scale", ctx.key, flat.numel(), flat.device, ctx.signature)
    refresh = done % c.normalize == 0
    if refresh:
        local = observe(flat, ctx)
        _refresh(scale, local, c, ctx)
    else:
        local = ctx.residual("rms_local", flat.numel(), flat.device)
    return Scaling(local, scale, observing=not refresh)


def effective_scale(shared: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The scale an element is divided by, from the RMS the ranks shared: at least
    ``RELATIVE_FLOOR`` of the bucket's mean (elements that had no gradient yet); 1 where the
    whole bucket has none (gradient units: after a non-finite step). In ``out`` when given
    (``shared`` itself works)."""
    floor = RELATIVE_FLOOR * shared.mean()
    scale = torch.clamp_min(shared, floor, out=out)
    # With a positive floor every element is positive already: on the CPU, skip the pass.
    if scale.is_cuda or not bool(floor > 0):
        scale = scale.masked_fill_(~(scale > 0), 1.0)
    return scale


def _refresh(scale: torch.Tensor, local: torch.Tensor, c: Quantizer, ctx: ReduceContext) -> None:
    """The scale from every rank's local average: 2 ^ mean of log2 RMS, floored
    (``effective_scale``). The residuals, in units of the old scale, are rescaled to the
    new one. The state keeps the scale alone, not the RMS before its floor: 4 bytes per
    element, and a bucket rebuilt around other parameters keeps each element's units. The
    one bucket-sized temporary is a workspace buffer on the CPU, where a fresh 64 MiB
    allocation costs some 16K page faults (a refresh at 1 thread took 257 ms with its
    allocations, 115 without); on a GPU it and the 8-bit code's payloads come from the
    caching allocator, whose memory workspace buffers would hold between refreshes (3
    bytes per element at 2 ranks)."""
    n, device = local.numel(), local.device
    sub = ReduceContext(
        ctx.pg, ctx.memory, ctx.key, ctx.step, ctx.signature, ctx.stats.overhead("scale"),
        None if local.is_cuda else ctx.workspace, part=PART,
    )  # fmt: skip
    tmp = sub.buffer("tmp", 4 * n, device).view(torch.float32)
    logs = torch.sqrt(local, out=tmp).clamp_min_(2.0**LOG2_FLOOR).log2_()
    code = Quantizer(SCALE_BITS, error_feedback=False, algorithm=c.algorithm)
    new = collectives.all_reduce_mean(logs, code, sub).wait().exp2_()
    # A non-finite step's RMS (its outputs are non-finite, its residuals reset): no scale
    # for those elements until the next refresh, rather than NaN for K steps.
    fresh = effective_scale(new.nan_to_num_(0.0, 0.0, 0.0), out=new)
    _rescale_residuals(scale.div_(fresh), c, ctx)  # old / new, in the scale's own tensor
    scale.copy_(fresh)


def _rescale_residuals(ratio: torch.Tensor, c: Quantizer, ctx) -> None:
    """Residuals held in units of the old scale -> units of the new (``ratio``: old /
    new): the same gradient mass."""
    memory, key = ctx.memory, ctx.key
    whole = memory.buffers.get((ctx.part + "q", key))
    if whole is not None and whole.numel() == ratio.numel():
        whole.mul_(ratio)
    owner = memory.buffers.get((ctx.part + "q_owner", key))
    if owner is not None:
        start = layout.owner_chunk_start(c, ctx.pg)(ratio.numel())
        owner.mul_(ratio[start : start + owner.numel()])


def refuse(compressor, where: str) -> None:
    """ValueError when ``compressor`` normalizes and ``where`` (a reduction that keeps
    no per-element scales across steps) would have to run it."""
    k = getattr(compressor, "normalize", 0)
    if k:
        raise ValueError(
            f"normalize={k} is for flat DDP comm hooks: {where} keeps no per-element scale "
            "across steps; give normalize=0 (its default there)"
        )
