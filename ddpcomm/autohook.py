"""Compression for DDP scripts that were never edited: what ``python -m ddpcomm.run`` installs.

The launcher puts ``ddpcomm/_site`` on ``PYTHONPATH``; its ``sitecustomize`` (in every
Python process the command starts: torchrun's workers, ``mp.spawn`` children,
accelerate's and Lightning's) wraps ``DistributedDataParallel.__init__`` to call
:func:`attach`, so that every DDP model gets ``ddpcomm.compress_hook`` with a
``CompressionState`` built from the environment:

- ``DDPCOMM_COMPRESSION``: the spec string (``q8``, ``q4``, ``topk:0.01``, ...), required;
- ``DDPCOMM_START_ITER``, ``DDPCOMM_MIN_NUMEL``: the state's own options;
- ``DDPCOMM_OPTIONS``: the method's options, ``name=value`` separated by commas
  (``block_size=128,error_feedback=true``).

Rules. The hook is registered at the model's first forward, so a script that registers
its own comm hook right after building DDP keeps it: ddpcomm then warns once that it is
not installing its own. DDP's ``mixed_precision`` occupies the hook slot, so such a model
is reported and left alone. At exit, rank 0 prints one ``ddpcomm:`` line per process with
what compression did.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import sys
import threading
import warnings

ENV_COMPRESSION = "DDPCOMM_COMPRESSION"
ENV_START_ITER = "DDPCOMM_START_ITER"
ENV_MIN_NUMEL = "DDPCOMM_MIN_NUMEL"
ENV_OPTIONS = "DDPCOMM_OPTIONS"

_STATES: list = []  # the states installed on global rank 0, for the exit summary
_LOCK = threading.Lock()
_CONFIG: dict | None = None  # from the environment, read at the first DDP model


def _value(text: str):
    """An option value from text: bool, int, float, a torch dtype name, or the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(low)
        except ValueError:
            pass
    if low in ("float32", "float16", "bfloat16"):
        import torch

        return getattr(torch, low)
    return text.strip()


def parse_options(text: str) -> dict:
    """``"block_size=128,error_feedback=true"`` -> ``{"block_size": 128, ...}``."""
    options = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise ValueError(f"{ENV_OPTIONS}: expected name=value, got {item!r}")
        options[name.strip()] = _value(value)
    return options


def config_from_env(environ=os.environ) -> dict:
    """The ``CompressionState`` arguments the environment asks for (checked by building
    one: a bad spec or option raises here, before any rank starts)."""
    spec = environ.get(ENV_COMPRESSION)
    if not spec:
        raise ValueError(f"{ENV_COMPRESSION} is not set; e.g. {ENV_COMPRESSION}=q8")
    config = {"compression": spec, **parse_options(environ.get(ENV_OPTIONS, ""))}
    for env, arg in ((ENV_START_ITER, "start_iter"), (ENV_MIN_NUMEL, "min_numel")):
        if environ.get(env):
            try:
                config[arg] = int(environ[env])
            except ValueError:
                raise ValueError(f"{env} must be an int, got {environ[env]!r}") from None
    from ddpcomm.hooks import CompressionState

    CompressionState(**config)  # validates every argument
    return config


def attach(ddp) -> None:
    """Arranges for ``ddp`` (a new DistributedDataParallel) to get the hook at its first
    forward; called by the startup hook for every DDP model."""
    global _CONFIG
    with _LOCK:
        if _CONFIG is None:
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


def summary_line(states) -> str:
    """One line: method, buckets compressed / plain, bytes sent vs plain, compression time."""
    method = ", ".join(sorted({s.compressor.spec for s in states}))
    stats = [s.stats() for s in states]
    plain = sum(st["paths"].get("plain", 0) for st in stats)
    buckets = sum(st["calls"] for st in stats)
    sent = sum(st["bytes_sent"] for st in stats)
    dense = sum(st["dense_bytes"] for st in stats)
    seconds = sum(st["compress_seconds"] for st in stats)
    ratio = f"{dense / sent:.2f}x less" if sent else "nothing sent"
    return (
        f"ddpcomm: {method}: {buckets - plain} buckets compressed, {plain} plain; "
        f"{sent / 1e6:.2f} MB sent vs {dense / 1e6:.2f} MB plain ({ratio}); "
        f"{seconds:.3f} s compressing"
    )


def _summary() -> None:
    with _LOCK:
        states, _STATES[:] = list(_STATES), []
    if states:
        print(summary_line(states), file=sys.stderr, flush=True)
