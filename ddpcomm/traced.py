"""DDP's python_reducer: a hook called per parameter, traced by compiled autograd.

With ``torch._dynamo.config.optimize_ddp = "python_reducer"`` DDP registers a
post-accumulate-grad hook on every parameter and calls the comm hook as
``hook(state, (param.grad, param))``, ignoring what it returns: the hook must leave the
mean over ranks in ``param.grad`` itself. Under compiled autograd that call is traced into
the backward graph, so ``reduce_param`` uses only what traces: functional collectives
(``torch.distributed._functional_collectives``), ddpcomm's ops (which have fake impls),
tensor ops. No Futures, no host reads, no Python state that changes from step to step (a
changing Python int would make dynamo recompile the backward every step).

What each method does here:

- ``none``, ``fp16``, ``bf16``: an all_reduce of the (cast) gradient, as torch's own hooks.
- ``q8`` ... ``q1``: the algorithm buckets would take (``algorithm="auto"``: all_gather for
  up to 2 ranks, two-phase above), per parameter; error feedback keeps the residuals of
  each parameter in the state.
- ``topk:R``: one all_gather of the (index, value) payloads, summed in rank order, or a
  dense fp32 all_reduce where that sends fewer bytes (as for buckets), with its
  per-parameter residual.

Every rank sums the same payloads in the same order, so the result is bitwise identical
on every rank. What needs a per-step random key (stochastic rounding, approximate top-k,
random-k) or a step counter (``start_iter``) is refused with an error naming the method
and why. Residuals are keyed by the parameter tensor itself: the same key every step, whatever
order the hooks run in.

``state.stats()`` counts this path too (``add_counts``): each parameter's reduction takes
one path and sends the same bytes every step, so the traced hook only adds 1 to a per-parameter
counter tensor (a tensor op, replayed by the compiled graph at every backward; a Python
counter would be read as a constant and recompile the graph every step), and ``stats()``
multiplies. The counters are made in the first backward, so the second compiles the graph
once more (as error feedback's residuals make it do). Host time spent compressing is not
measured here: it happens inside the graph.
"""

from __future__ import annotations

import math
import weakref

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fcol

from ddpcomm import ops
from ddpcomm.compressors import (
    CastCompression,
    Compressor,
    NoCompression,
    Quantizer,
    TopK,
    default_schedule,
    dense_bytes,
)

# torch 2.13 renamed all_gather_tensor to all_gather_single (the old name warns).
_all_gather = getattr(fcol, "all_gather_single", None) or fcol.all_gather_tensor

# Seed of top-k's sampling stream: used only in approximate mode, which is refused here.
_NO_SEED = 0

# What this path sent, per state and parameter: (path, bytes sent, plain all_reduce bytes,
# a 1-element int64 tensor counting the reductions). Weakly keyed by the state (a dict that
# dynamo traces; torch's WeakIdKeyDictionary would break the graph), so a state's counts go
# with it.
_COUNTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hook(state, pair: tuple, name: str) -> torch.Tensor:
    """The python_reducer form of a ddpcomm hook: ``pair`` is ``(grad, param)``;
    ``state`` a ``CompressionState``. Returns the reduced ``grad`` (DDP ignores it)."""
    grad, param = pair
    if grad.layout != torch.strided:
        raise NotImplementedError(
            f"{name}: a {grad.layout} gradient under DDP's python_reducer; ddpcomm reduces "
            "sparse gradients in DDP's bucketed mode only"
        )
    state.compressor.check_tensor(grad, "grad")
    why = unsupported(state)
    if why is not None:
        raise NotImplementedError(
            f"{name}: {state.compressor.spec} cannot run under DDP's python_reducer "
            f"(optimize_ddp='python_reducer', compiled autograd): {why}"
        )
    path, sent, dense = reduce_param(
        state.compressor,
        state.param_residuals,
        grad,
        param,
        state.process_group,
        state.min_numel,
    )
    _count(state, param, path, sent, dense, grad.device)
    return grad


def _count(state, param, path: str, sent: int, dense: int, device) -> None:
    """Counts one reduction of ``param`` (its counter is made at its first)."""
    counts = _COUNTS.get(state)
    if counts is None:
        counts = _COUNTS[state] = {}
    entry = counts.get(param)
    if entry is None:
        # [path, bytes sent, plain bytes, reductions so far, reductions at reset_stats()]
        calls = torch.zeros(1, dtype=torch.int64, device=device)
        entry = counts[param] = [path, sent, dense, calls, 0]
    entry[3].add_(1)


def add_counts(state, stats: dict) -> None:
    """Adds what this path sent for ``state`` to ``stats`` (a ``state.stats()`` dict):
    calls, bytes, paths, and ``iteration`` (the most reductions of any one parameter: each
    is reduced once per backward). Reads the counters (on a GPU: a synchronization, at
    ``stats()`` time only)."""
    counts = _COUNTS.get(state)
    if not counts:
        return
    paths = stats["paths"]
    iterations = 0
    for path, sent, dense, calls, reset in counts.values():
        total = int(calls.item())
        iterations = max(iterations, total)
        k = total - reset
        stats["calls"] += k
        stats["bytes_sent"] += k * sent
        stats["dense_bytes"] += k * dense
        paths[path] = paths.get(path, 0) + k
    stats["iteration"] = max(stats.get("iteration", 0), iterations)
    if "cross_node_bytes" not in stats:  # a flat ratio: recomputed with these bytes
        sent = stats["bytes_sent"]
        stats["compression_ratio"] = stats["dense_bytes"] / sent if sent else math.nan


def reset_counts(state) -> None:
    """``state.reset_stats()`` for this path: counts restart from here (the counters
    themselves live on, inside the compiled graph; ``iteration`` keeps counting)."""
    for entry in _COUNTS.get(state, {}).values():
        entry[4] = int(entry[3].item())


def unsupported(state) -> str | None:
    """Why ``state`` cannot run per parameter under compiled autograd, or None."""
    why = _unsupported_method(state.compressor)
    if why is not None:
        return why
    if getattr(state, "hierarchy", None) is not None:
        return (
            "hierarchy needs the bucketed two-level reduction (reduce-scatter inside nodes), "
            "which the per-parameter traced path does not run; use hierarchy=None"
        )
    if state.start_iter or state.ramp:
        given = f"start_iter={state.start_iter}, ramp={state.ramp}"
        if default_schedule(state.compressor) == (state.start_iter, state.ramp):
            given += " (the method's default schedule)"
        return (
            f"{given} need a step counter, which would recompile the backward graph every "
            "step; give start_iter=0, ramp=0"
        )
    if state.adaptive is not None:
        return (
            "adaptive=True needs a step counter, which would recompile the backward graph "
            "every step; use adaptive=False"
        )
    if getattr(state.compressor, "normalize", 0):
        return (
            f"normalize={state.compressor.normalize} keeps per-element scales per bucket, "
            "which the per-parameter traced path has none of; give normalize=0"
        )
    return None


def _unsupported_method(compressor: Compressor) -> str | None:
    if isinstance(compressor, Quantizer):
        if compressor.stochastic:
            return "stochastic rounding draws from a per-step stream; use stochastic=False"
        return None
    if isinstance(compressor, TopK):
        if compressor.approximate:
            return "approximate selection samples with a per-step seed; use approximate=False"
        return None
    if isinstance(compressor, (NoCompression, CastCompression)):
        return None
    return (
        "its indices are drawn from a per-step seed, which would recompile the backward "
        "graph every step"
    )


def reduce_param(
    compressor: Compressor,
    residuals: dict,
    grad: torch.Tensor,
    param: torch.Tensor,
    group: dist.ProcessGroup | None,
    min_numel: int,
) -> tuple[str, int, int]:
    """Overwrites ``grad`` (``param``'s gradient) with its mean over ``group``'s ranks,
    sent with ``compressor``. ``residuals`` maps parameters to their error-feedback
    residuals. Returns what ``stats()`` counts, as the bucketed path names it: (path,
    bytes this rank sent, bytes a plain all_reduce would have sent)."""
    pg = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(pg)
    flat = grad.reshape(-1)
    n = flat.numel()
    if n == 0:
        return "empty", 0, 0
    dense = dense_bytes(n, world, grad.element_size())
    if not compressor.lossy or n < min_numel:
        # DDP's own python_reducer path: scale, then sum.
        grad.copy_(fcol.all_reduce(grad * (1.0 / world), "sum", pg))
        return "plain", dense, dense
    if isinstance(compressor, CastCompression):
        wire = grad.to(compressor.dtype).div_(world)
        grad.copy_(fcol.all_reduce(wire, "sum", pg))
        return compressor.spec, compressor.wire_bytes(n, world), dense
    if isinstance(compressor, Quantizer):
        mean = _quantized(compressor, flat, residuals, param, pg, world)
        sent = compressor.wire_bytes(n, world, dist.get_rank(pg))
        path = f"q_{compressor.resolve_algorithm(world)}"
    else:
        ef = compressor.error_feedback
        residual = _residual(residuals, param, n, grad.device) if ef else None
        mean = _topk(compressor, flat, residual, pg, world)
        sent = compressor.wire_bytes(n, world)
        path = "topk_dense" if compressor.use_dense(n, world) else "topk_all_gather"
    grad.copy_(mean.view(grad.shape))
    return path, sent, dense


def _quantized(q: Quantizer, flat, residuals: dict, param, pg, world: int) -> torch.Tensor:
    """collectives' two quantized algorithms, per parameter and in program order: the
    collectives of a traced backward are issued in the order they are traced, the same on
    every rank, so two-phase needs no sequencer here."""
    n, bits, block = flat.numel(), q.code, q.block_size
    if q.resolve_algorithm(world) == "all_gather":
        residual = _residual(residuals, param, n, flat.device) if q.error_feedback else None
        payload = ops.quantize(flat, residual, bits, block)
        gathered = _all_gather(payload, 0, pg)
        mean = ops.dequantize_sum(
            gathered.view(world, payload.numel()), n, bits, block, world, flat.dtype
        )
    else:
        # Phase 1: each rank sums and re-quantizes its chunk of every rank's payload;
        # phase 2: the re-quantized chunks are all-gathered. One residual buffer holds
        # the sender's residual (n) and this rank's owner residual (its chunk).
        rank = dist.get_rank(pg)
        chunk = q.chunk_numel(n, world)
        splits = q.two_phase_splits(n, world)
        owned = max(0, min(n, (rank + 1) * chunk) - rank * chunk)
        both = _residual(residuals, param, n + owned, flat.device) if q.error_feedback else None
        residual = None if both is None else both[:n]
        payload = ops.quantize(flat, residual, bits, block)
        received = fcol.all_to_all_single(payload, [splits[rank]] * world, splits, pg)
        reduced = ops.dequantize_sum_requantize(
            received.view(world, splits[rank]),
            None if both is None else both[n:],
            owned,
            bits,
            block,
            world,
        )
        pad = (chunk // block) * q.record_bytes - reduced.numel()  # short trailing chunks
        gathered = _all_gather(torch.cat([reduced, reduced.new_zeros(pad)]), 0, pg)
        mean = ops.dequantize(gathered[: q.payload_bytes(n)], n, bits, block, flat.dtype)
        residual = both
    if residual is not None:
        # Every rank sees every block magnitude in `gathered`, so all agree on a reset.
        magnitudes = ops.magnitudes(gathered, q.record_bytes, bits)
        _reset_unless(residual, magnitudes)
    return mean


def _topk(c: TopK, flat, residual, pg, world: int) -> torch.Tensor:
    """collectives._topk's two paths, per parameter: the payloads all-gathered and summed
    in rank order, or (when they would outweigh it) a dense fp32 all_reduce."""
    n, k, vdtype = flat.numel(), c.k(flat.numel()), c.value_dtype
    payload = ops.topk_compress(flat, residual, k, False, _NO_SEED, 0, vdtype)
    if c.use_dense(n, world):
        mine = ops.sparse_accumulate(
            payload.view(1, -1), n, k, 1, vdtype, torch.float32, check=False
        )
        total = fcol.all_reduce(mine, "sum", pg)
        if residual is not None:
            _reset_unless(residual, total)
        return total.div(ops.divisor(world, total)).to(flat.dtype)
    rows = _all_gather(payload, 0, pg).view(world, -1)
    mean = ops.sparse_accumulate(rows, n, k, world, vdtype, flat.dtype, check=False)
    if residual is not None:
        _reset_unless(residual, rows[:, 4 * k :].contiguous().view(vdtype))
    return mean


def _residual(residuals: dict, param: torch.Tensor, n: int, device) -> torch.Tensor:
    buf = residuals.get(param)
    if buf is None:
        buf = residuals[param] = torch.zeros(n, dtype=torch.float32, device=device)
    return buf


def _reset_unless(residual: torch.Tensor, sent: torch.Tensor) -> None:
    """Zeroes the residual when any rank sent a non-finite value (every rank sees every
    payload, so all agree), without reading the verdict on the host."""
    residual.masked_fill_(torch.isfinite(sent).all().logical_not(), 0.0)
