"""The methods the benchmarks compare: torch's own DDP hooks by name, ddpcomm's by spec.

ddpcomm methods are spec strings (``q8``, ``q4``, ``topk:0.01``, ...; ``q8,adaptive`` for
adaptive pass-through) and their states are built in one place, ``_state``. Every method
also has a byte formula, so a row whose hook fails still shows what it would have sent.
"""

from __future__ import annotations

import argparse
import math

import ddpcomm
from ddpcomm import adaptive, compressors, local

# torch's hooks, as PyTorch users run them today.
TORCH = {
    "allreduce": "torch allreduce_hook: DDP's default, fp32 all_reduce then / N",
    "torch-fp16": "torch fp16_compress_hook",
    "torch-qpt": "torch quantization_pertensor_hook (uint8 per tensor, all_gather)",
    "powersgd-r1": "torch powerSGD_hook, rank 1",
    "powersgd-r4": "torch powerSGD_hook, rank 4",
    "bpowersgd-r1": "torch batched_powerSGD_hook, rank 1",
    "bpowersgd-r4": "torch batched_powerSGD_hook, rank 4",
}
DDPCOMM = ["q8", "q4", "q2", "q1", "topk:0.01", "randk:0.01"]
ADAPTIVE = [f"{m},adaptive" for m in DDPCOMM]


def describe(method: str) -> str:
    """A method's legend line in the training tables, with the schedule its state runs."""
    if method in TORCH:
        return TORCH[method]
    if method.startswith(LOCAL):
        o = {"compression": local.COMPRESSION, "start_iter": local.START_ITER}
        o = {**o, "lr_scale": "default", **local_options(method)}
        return (
            f"ddpcomm LocalSteps: local optimizer steps, the parameters' change averaged with "
            f"{o['compression']} every {o['every']} steps after {o['start_iter']} exact ones, "
            f"lr_scale {o['lr_scale']}"
        )
    state = _state(method)[0]
    schedule = ""
    if state.start_iter or state.ramp:
        schedule = f" (plain for {state.start_iter} iterations, then {state.ramp} ramp iterations)"
    return f"ddpcomm compress_hook, {method!r}{schedule}"


def _state(spec: str, group=None, schedule: bool = True):
    """(state, hook) of a ddpcomm spec string: the one place the benchmarks build them.
    ``schedule=False`` drops the method's default warm-up and ramp (a schedule the spec
    writes out stays): the collectives benchmark times the method itself from its first
    call."""
    try:
        options = {}
        if not schedule:
            given = compressors.take_state_options(spec)[1]
            options = {k: 0 for k in ("start_iter", "ramp") if k not in given}
        state = ddpcomm.CompressionState(spec, process_group=group, **options)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"method {spec!r}: {exc}") from None
    return state, ddpcomm.compress_hook


def make_hook(method: str, group, schedule: bool = True):
    """(hook, state, calls before the hook compresses) for a method name or spec; see
    ``_state`` for ``schedule``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as qh

    plain = {
        "allreduce": dh.allreduce_hook,
        "torch-fp16": dh.fp16_compress_hook,
        "torch-qpt": qh.quantization_pertensor_hook,
    }
    if method in plain:
        return plain[method], group, 0
    if "powersgd-r" in method:
        # start_powerSGD_iter=2 is the smallest torch accepts with error feedback and warm
        # start (both on, as by default); two calls before it make compression active.
        rank = int(method.rsplit("r", 1)[1])
        state = ps.PowerSGDState(group, matrix_approximation_rank=rank, start_powerSGD_iter=2)
        hook = ps.powerSGD_hook if method[0] == "p" else ps.batched_powerSGD_hook
        return hook, state, 2
    state, hook = _state(method, group, schedule)
    # Adaptive states time both paths on one bucket size class, then decide.
    first = 0 if state.adaptive is None else adaptive.first_decision()
    return hook, state, state.start_iter + state.ramp + first


LOCAL = "local:"  # ddpcomm.LocalSteps: local:EVERY[,option=value...] (train only)


def local_options(method: str) -> dict:
    """LocalSteps' keyword arguments of ``local:EVERY[,name=value...]``."""
    head, *rest = method.split(",")
    try:
        options = {"every": int(head[len(LOCAL) :])}
        for piece in rest:
            name, _, value = piece.partition("=")
            if name not in ("compression", "start_iter", "lr_scale") or not value:
                raise ValueError(f"unknown option {piece!r}")
            options[name] = int(value) if name == "start_iter" else value
        if "lr_scale" in options and options["lr_scale"] != "sqrt":
            options["lr_scale"] = float(options["lr_scale"])
    except ValueError as exc:
        raise ValueError(
            f"method {method!r}: {exc}; write local:EVERY with compression=, start_iter=, "
            "lr_scale= after commas"
        ) from None
    return options


def check(method: str, allowed: tuple[str, ...] = ()) -> str:
    """``method`` if the benchmarks know it (argparse type: a clear error otherwise)."""
    if method in TORCH or method in allowed:
        return method
    if method.startswith(LOCAL) and LOCAL in allowed:
        try:
            local_options(method)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return method
    try:
        _state(method)
    except ValueError as exc:
        known = ", ".join([*allowed, *TORCH, *DDPCOMM])
        raise argparse.ArgumentTypeError(
            f"{exc}; choose from {known} (any ratio works for topk:R and randk:R)"
        ) from None
    return method


def _is_method(name: str, allowed: tuple[str, ...]) -> bool:
    try:
        check(name, allowed)
    except argparse.ArgumentTypeError:
        return False
    return True


def method_list(allowed: tuple[str, ...] = ()):
    """argparse type of ``--methods``: a comma-separated list of known methods. An option
    joins the method before it: ``q8,q8,adaptive`` is q8, then q8 with adaptive."""

    def parse(text: str) -> list[str]:
        # Spec options ride on commas too ("q1,ramp=200,topk:0.01"): a piece that is an
        # option (name=value, or a bare name that is no method) belongs to the method before.
        names: list[str] = []
        for piece in filter(None, (m.strip() for m in text.split(","))):
            name = piece.partition("=")[0]
            is_option = "=" in piece or (name.isidentifier() and not _is_method(name, allowed))
            if names and is_option:
                names[-1] += "," + piece
            else:
                names.append(piece)
        names = [check(m, allowed) for m in names]
        if not names:
            raise argparse.ArgumentTypeError("give at least one method")
        return names

    return parse


METHODS_HELP = (
    "comma-separated methods: torch's allreduce (DDP's default), torch-fp16, torch-qpt "
    "(quantization_pertensor_hook), powersgd-r1, powersgd-r4, bpowersgd-r1, bpowersgd-r4 "
    "(batched); ddpcomm's q8, q4, q2, q1.5, q1, topk:R, randk:R (R: the density), each with "
    "options after commas (q1,start_iter=50,ramp=100,topk:0.01; q8,adaptive for adaptive "
    "pass-through)"
)


def _ring(world: int, nbytes: float) -> float:
    return 2 * (world - 1) / world * nbytes


def formula_bytes(method: str, shapes: list[tuple[int, ...]], world: int) -> int:
    """Bytes one rank sends for one bucket of tensors ``shapes``, from the method's wire
    format, as a ring schedule sends them."""
    numel = sum(math.prod(s) for s in shapes)
    if method in ("allreduce", "ddp"):
        return round(_ring(world, 4 * numel))
    if method == "torch-fp16":
        return round(_ring(world, 2 * numel))
    if method == "torch-qpt":
        # all_gathers of (scale, zero point) as 2 fp32, then of one uint8 per element.
        return (world - 1) * (8 + numel)
    if method.startswith("powersgd-r"):
        # torch's _should_compress: a matrix is compressed when (m + n) r * 2 < m n; the
        # rest goes in one uncompressed all_reduce. P then Q are all_reduced.
        r, elems = int(method.rsplit("r", 1)[1]), 0
        for s in shapes:
            m, n = (s[0], math.prod(s[1:])) if len(s) > 1 else (0, 0)
            elems += (m + n) * r if (m + n) * r * 2 < m * n else math.prod(s)
        return round(_ring(world, 4 * elems))
    if method.startswith("bpowersgd-r"):
        side = math.ceil(math.sqrt(numel))  # the bucket, zero-padded to a square matrix
        return round(_ring(world, 4 * 2 * side * int(method.rsplit("r", 1)[1])))
    if method == "nocomm":
        return 0
    if method.startswith(LOCAL):
        o = local_options(method)
        spec = o.get("compression", local.COMPRESSION)
        return _state(spec)[0].compressor.wire_bytes(numel, world) // o["every"]
    return _state(method)[0].compressor.wire_bytes(numel, world)
