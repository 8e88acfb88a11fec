"""Compression for DDP scripts that were never edited: what ``python -m ddpcomm.run`` installs.

The launcher puts ``ddpcomm/_site`` on ``PYTHONPATH``; its ``sitecustomize`` (in every
Python process the command starts: torchrun's workers, ``mp.spawn`` children,
accelerate's and Lightning's) wraps ``DistributedDataParallel.__init__`` to call
:func:`attach`, so that every DDP model gets ``ddpcomm.compress_hook`` with a
``CompressionState`` built from the environment:

- ``DDPCOMM_COMPRESSION``: the spec string (``q8``, ``q4``, ``topk:0.01``,
  ``q8,block_size=64``, ...), required;
- ``DDPCOMM_START_ITER``, ``DDPCOMM_MIN_NUMEL``: the state's own options;
- ``DDPCOMM_OPTIONS``: more options, ``name=value`` separated by commas
  (``block_size=128,error_feedback=true``).

All of it is spec text, read by ``compressors.split_spec`` and checked by building a
``CompressionState``, as a spec string given to the API is. A setting given twice with
different values (``DDPCOMM_COMPRESSION=q8,start_iter=5`` and ``DDPCOMM_START_ITER=7``) is
an error naming both variables, never a silent choice. The launcher merges its command
line over these variables (see ``ddpcomm.run``) and hands its command the result as one
spec in ``DDPCOMM_COMPRESSION``.

Rules. The hook is registered at the model's first forward, so a script that registers
its own comm hook right after building DDP keeps it: ddpcomm then warns once that it is
not installing its own. DDP's ``mixed_precision`` occupies the hook slot, so such a model
is reported and left alone. At exit, rank 0 prints one ``ddpcomm:`` line per process with
the configuration and what compression did (and why nothing was, where nothing was: still
in the plain warm-up of ``start_iter``, or every bucket below ``min_numel``). A process that
builds a DDP model leaves a file in ``DDPCOMM_RUN_DIR`` (set by the launcher), which tells
the launcher whether any process built one.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import sys
import threading
import warnings
from typing import NamedTuple

from ddpcomm import compressors

ENV_COMPRESSION = "DDPCOMM_COMPRESSION"
ENV_START_ITER = "DDPCOMM_START_ITER"
ENV_MIN_NUMEL = "DDPCOMM_MIN_NUMEL"
ENV_OPTIONS = "DDPCOMM_OPTIONS"
ENV_VARIABLES = (ENV_COMPRESSION, ENV_OPTIONS, ENV_START_ITER, ENV_MIN_NUMEL)
# Not a setting: the launcher's directory for "this process built a DDP model" files.
ENV_RUN_DIR = "DDPCOMM_RUN_DIR"

_STATES: list = []  # the states installed on global rank 0, for the exit summary
_LOCK = threading.Lock()
_CONFIG: dict | None = None  # from the environment, read at the first DDP model

# Pieces of settings: (kind, place, text). kind "spec" is a spec string (the method and
# its options), "options" is option text (name=value,...), any other kind is the name of
# the one option whose value the text is. place is the piece as the user wrote it.
Piece = tuple[str, str, str]


class Setting(NamedTuple):
    value: object
    place: str  # where it was given, as written: "--option block_size=64"


class Resolved(NamedTuple):
    spec: str  # the one spec string every process builds its CompressionState from
    origins: str  # where each of its settings came from, for the startup line


def settings(pieces: list[Piece], source: str, method_place: str) -> dict[str, Setting]:
    """The settings one source gives (``source``: "on the command line", "in the
    environment"), by name; the method's is ``"compression"``. Every piece is read by the
    spec grammar. A setting given twice with different values is a ValueError naming both
    places; the method must come from ``method_place`` (a spec), never as an option."""
    found: dict[str, Setting] = {}
    for kind, place, text in pieces:
        if kind == "spec":
            method, items = compressors.split_spec(text, where=place)
            items = {"compression": method.lower(), **items}
        else:
            items = compressors.split_options(
                text if kind == "options" else f"{kind}={text}", place
            )
            if kind != "options" and list(items) != [kind]:
                raise ValueError(f"{place}: expected one value for {kind}, got {text!r}")
            if "compression" in items:
                given = found.get("compression")
                also = f" (it is given by {given.place})" if given else ""
                raise ValueError(
                    f"{place}: the method is not an option; give it with {method_place}{also}"
                )
        for name, value in items.items():
            seen = found.setdefault(name, Setting(value, place))
            if type(seen.value) is not type(value) or seen.value != value:
                raise ValueError(
                    f"{name} is given twice {source}, with different values: {seen.place} "
                    f"and {place}; give it once"
                )
    return found


def environment_settings(environ=os.environ) -> dict[str, Setting]:
    """The settings of the ``DDPCOMM_*`` variables (an empty variable counts as unset)."""
    pieces = []
    for kind, name in (
        ("spec", ENV_COMPRESSION),
        ("options", ENV_OPTIONS),
        ("start_iter", ENV_START_ITER),
        ("min_numel", ENV_MIN_NUMEL),
    ):
        text = environ.get(name, "")
        if text.strip():
            pieces.append((kind, f"{name}={text}", text))
    return settings(pieces, "in the environment", ENV_COMPRESSION)


def resolve(
    command_line: dict[str, Setting], environment: dict[str, Setting], method_flags: str
) -> Resolved:
    """One configuration from two sources: per setting (the method, and each option by
    name), the command line's over the environment's; the rest of the environment's stays.

    Every option must be one the method takes (an option the environment gives for
    another method than the one the command line picks is an error naming both, not
    dropped), and the result must build a ``CompressionState``: a bad value raises here,
    with where each setting came from. ``method_flags`` says where the method can be
    given, for the error when it is given nowhere.
    """
    merged = {**environment, **command_line}
    method = merged.pop("compression", None)
    if method is None:
        raise ValueError(f"no compression method: {method_flags}; e.g. {ENV_COMPRESSION}=q8")
    for name, s in merged.items():
        where = s.place if s.place == method.place else f"{s.place} (method from {method.place})"
        compressors.check_option(method.value, name, where)
    spec = compressors.join_spec(method.value, {k: s.value for k, s in merged.items()})
    origins = []
    for name, s in {"compression": method, **merged}.items():
        over = environment.get(name) if name in command_line else None
        origins.append(
            f"{'method' if name == 'compression' else name} from {s.place}"
            + (f" over {over.place}" if over is not None else "")
        )
    origins = ", ".join(origins)
    from ddpcomm.hooks import CompressionState

    try:
        CompressionState(spec)  # validates every value
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{exc} (in {spec!r}: {origins})") from None
    return Resolved(spec, origins)


def config_from_env(environ=os.environ) -> dict:
    """The ``CompressionState`` arguments the environment asks for (checked by building
    one: a bad spec or option raises here, before any rank starts)."""
    resolved = resolve({}, environment_settings(environ), f"{ENV_COMPRESSION} is not set")
    return {"compression": resolved.spec}


def attach(ddp) -> None:
    """Arranges for ``ddp`` (a new DistributedDataParallel) to get the hook at its first
    forward; called by the startup hook for every DDP model."""
    global _CONFIG
    with _LOCK:
        if _CONFIG is None:
            _report_ddp()
            _CONFIG = config_from_env()
            atexit.register(_summary)
            # mp.spawn children leave through os._exit, which skips atexit;
            # multiprocessing's own exit function still runs its finalizers.
            multiprocessing.util.Finalize(None, _summary, exitpriority=100)
    if ddp.mixed_precision is not None:
        warnings.warn(
            "ddpcomm.run: this DDP model uses mixed_precision, whose upcast hook takes DDP's "
            "comm-hook slot; its gradients are not compressed",
            stacklevel=3,
        )
        return
    handle = None

    def register_at_first_forward(module, inputs):
        handle.remove()
        _register(module, _CONFIG)

    handle = ddp.register_forward_pre_hook(register_at_first_forward)


def _report_ddp() -> None:
    """Tells the launcher that this process built a DDP model (a file named by its pid)."""
    where = os.environ.get(ENV_RUN_DIR)
    if where:
        try:
            open(os.path.join(where, f"ddp.{os.getpid()}"), "w").close()
        except OSError:  # the launcher is gone, or the directory with it: nothing to tell
            pass


def _register(ddp, config: dict) -> None:
    import ddpcomm

    if ddp._comm_hooks:
        hook = getattr(ddp._comm_hooks[0][0], "__qualname__", repr(ddp._comm_hooks[0][0]))
        warnings.warn(
            f"ddpcomm.run: the script registers its own comm hook ({hook}); ddpcomm does not "
            "install one on this model (run the script without ddpcomm.run, or remove its "
            "register_comm_hook call)",
            stacklevel=3,
        )
        return
    import torch.distributed as dist

    state = ddpcomm.CompressionState(process_group=ddp.process_group, **config)
    ddp.register_comm_hook(state, ddpcomm.compress_hook)
    if dist.get_rank() == 0:  # global rank 0 prints the summary (groups may be gone by then)
        with _LOCK:
            _STATES.append(state)


def summary_line(states, spec: str | None = None) -> str:
    """One line: the configuration (``spec``, the resolved spec the states were built from,
    with the warm-up and ramp they took by default), buckets compressed / plain, bytes
    sent vs plain, compression time."""
    method = spec or ", ".join(sorted({s.compressor.spec for s in states}))
    given = compressors.split_spec(spec)[1] if spec else {}
    first = states[0]  # the states of one process share its configuration
    defaults = [
        f"{name}={getattr(first, name)}"
        for name in ("start_iter", "ramp")
        if name not in given and getattr(first, name)
    ]
    if defaults:
        method += f" (by default {', '.join(defaults)})"
    stats = [s.stats() for s in states]
    plain = sum(st["paths"].get("plain", 0) for st in stats)
    buckets = sum(st["calls"] for st in stats)
    sent = sum(st["bytes_sent"] for st in stats)
    dense = sum(st["dense_bytes"] for st in stats)
    seconds = sum(st["compress_seconds"] for st in stats)
    ratio = f"{dense / sent:.2f}x less" if sent else "nothing sent"
    why = _why_plain(first, max(st["iteration"] for st in stats)) if buckets == plain else ""
    return (
        f"ddpcomm: {method}: {buckets - plain} buckets compressed{why}, {plain} plain; "
        f"{sent / 1e6:.2f} MB sent vs {dense / 1e6:.2f} MB plain ({ratio}); "
        f"{_across_nodes(stats)}{seconds:.3f} s compressing"
    )


def _across_nodes(stats: list[dict]) -> str:
    """Under a hierarchy: the bytes that crossed nodes against a flat all_reduce's, or ""."""
    cross = sum(st.get("cross_node_bytes", 0) for st in stats)
    flat = sum(st.get("cross_node_dense_bytes", 0) for st in stats)
    if not flat:
        return ""
    ratio = f"{flat / cross:.2f}x less" if cross else "nothing sent"
    return f"across nodes {cross / 1e6:.2f} MB vs {flat / 1e6:.2f} MB flat ({ratio}); "


def _why_plain(state, steps: int) -> str:
    """Why no bucket was compressed in ``steps`` steps, as a parenthesis, or ""."""
    if 0 < state.start_iter and steps <= state.start_iter:
        if steps < state.start_iter:
            return f" (still in start_iter's plain warm-up: {steps} of {state.start_iter} steps)"
        return f" (all {steps} steps were start_iter's plain warm-up)"
    if state.min_numel > 0:
        return f" (every bucket was below min_numel={state.min_numel})"
    return ""


def _summary() -> None:
    with _LOCK:
        states, _STATES[:] = list(_STATES), []
    if states:
        print(summary_line(states, _CONFIG["compression"]), file=sys.stderr, flush=True)
