"""``python -m ddpcomm.bench demo``: the main job, with nothing to configure.

Spawns 2 gloo ranks on the CPU and trains the same small classifier from the same start
with DDP's default all_reduce, torch's own compression hooks and ddpcomm's quantize_hook,
then prints one table: bytes each rank sends per step, median step time, final loss on
held-out data and the largest parameter difference from the default run.
"""

from __future__ import annotations

import re
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, quantization_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpcomm
from ddpcomm.bench._spawn import spawn
from ddpcomm.compressors import dense_bytes

WORLD = 2
STEPS = 300
BATCH = 64
DIM_IN, HIDDEN, CLASSES = 128, 512, 10


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(DIM_IN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def _data(rank: int, step: int):
    """A fixed random teacher labels Gaussian inputs: learnable, generated in-process."""
    g = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(BATCH, DIM_IN, generator=g)
    teacher = torch.Generator().manual_seed(1234)
    w = torch.randn(DIM_IN, CLASSES, generator=teacher)
    return x, (x @ w).argmax(1)


def _methods():
    """(name, state factory, hook, bytes per step from the formula for hooks we can't count)."""
    return [
        ("DDP default", None, None),
        ("torch fp16_compress_hook", lambda: None, default_hooks.fp16_compress_hook),
        (
            "torch quantization_pertensor_hook",
            lambda: dist.group.WORLD,
            quantization_hooks.quantization_pertensor_hook,
        ),
        (
            "torch quantization_perchannel_hook",
            lambda: dist.group.WORLD,
            quantization_hooks.quantization_perchannel_hook,
        ),
        ("ddpcomm q8", lambda: ddpcomm.QuantizeState(bits=8), ddpcomm.quantize_hook),
        ("ddpcomm q4", lambda: ddpcomm.QuantizeState(bits=4), ddpcomm.quantize_hook),
        (
            "ddpcomm q4 + error feedback",
            lambda: ddpcomm.QuantizeState(bits=4, error_feedback=True),
            ddpcomm.quantize_hook,
        ),
    ]


def _formula_bytes(name: str, numel: int, world: int) -> int:
    if name == "DDP default":
        return dense_bytes(numel, world, 4)
    if name == "torch fp16_compress_hook":
        return dense_bytes(numel, world, 2)
    # torch's quantization hooks all_gather one byte per element (plus a few scale
    # floats) from every rank: (N-1) * n bytes sent per rank.
    return (world - 1) * numel


def _root_cause(exc: BaseException) -> str:
    """The innermost 'SomeError: message' of a (possibly nested) callback error."""
    text = str(exc)
    starts = [m.start() for m in re.finditer(r"\b\w+Error: ", text)]
    cause = text[starts[-1] :].splitlines()[0] if starts else repr(exc)
    return cause.split(". Use ")[0][:60]


def _train(rank: int, world: int, state, hook):
    model = _model()
    ddp = DDP(model)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    times = []
    for step in range(STEPS):
        x, y = _data(rank, step)
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    x, y = _data(world + 1, 0)  # held-out batch, the same on every rank
    with torch.no_grad():
        final = float(nn.functional.cross_entropy(model(x), y))
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return params, final, statistics.median(times[10:])


def _worker(rank: int, world: int):
    numel = sum(p.numel() for p in _model().parameters())
    rows, default_params = [], None
    for name, make_state, hook in _methods():
        state = make_state() if make_state else None
        try:
            params, loss, step_s = _train(rank, world, state, hook)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is a table row
            reason = _root_cause(exc)
            rows.append(
                {
                    "method": name,
                    "status": f"failed on gloo: {reason}",
                    "bytes_per_step": _formula_bytes(name, numel, world),
                    "bytes_source": "formula",
                }
            )
            dist.barrier()
            continue
        if default_params is None:
            default_params = params
        if isinstance(state, ddpcomm.CompressionState):
            s = state.stats()
            sent, source = s["bytes_sent"] / s["iteration"], "measured"
        else:
            sent, source = _formula_bytes(name, numel, world), "formula"
        rows.append(
            {
                "method": name,
                "status": "ok",
                "bytes_per_step": sent,
                "bytes_source": source,
                "step_ms": 1e3 * step_s,
                "final_loss": loss,
                "max_param_diff": float((params - default_params).abs().max()),
            }
        )
    return rows, numel


def print_table(rows, numel: int, world: int) -> None:
    print(
        f"\nddpcomm demo: {world} gloo ranks on CPU, MLP with {numel:,} parameters, "
        f"{STEPS} SGD steps, same data and init for every method\n"
    )
    head = (
        f"{'method':<36} {'bytes/step/rank':>16} {'vs default':>10} {'step ms':>8} "
        f"{'final loss':>10} {'max |dp|':>9}"
    )
    print(head)
    print("-" * len(head))
    base = rows[0]["bytes_per_step"]
    for r in rows:
        mark = "*" if r["bytes_source"] == "formula" else " "
        size = f"{r['bytes_per_step'] / 1e6:.3f} MB{mark}"
        ratio = f"{base / r['bytes_per_step']:.2f}x"
        if r["status"] != "ok":
            print(f"{r['method']:<36} {size:>16} {ratio:>10}  {r['status']}")
            continue
        print(
            f"{r['method']:<36} {size:>16} {ratio:>10} {r['step_ms']:>8.2f} "
            f"{r['final_loss']:>10.4f} {r['max_param_diff']:>9.2e}"
        )
    print(
        "\n* bytes from the method's formula (a plain all_reduce sends 2(N-1)/N x its bytes); "
        "ddpcomm rows are counted by state.stats().\n  Loopback has no bandwidth limit, "
        "so step times here show compute overhead, not wire savings:\n  "
        "see `python -m ddpcomm.bench collectives --link 1gbit` for a shaped link."
    )


def run(args) -> int:
    (rows, numel), _ = spawn(_worker, WORLD, timeout=600)
    print_table(rows, numel, WORLD)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="train a small model with DDP's default, torch's hooks and "
        "ddpcomm (2 gloo ranks on CPU)",
    )
    p.set_defaults(func=run)
