"""What every command shares: the machine description, JSON, tables, progress lines and
the two clocks (``torch.utils.benchmark`` for kernels, a wall clock for work that spans
ranks, where a barrier must come before every timed call)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from torch.utils.benchmark import Timer


def environment() -> dict:
    """What the numbers were measured on, including how busy the machine was."""
    import ddpcomm

    root = os.path.dirname(os.path.dirname(os.path.abspath(ddpcomm.__file__)))
    try:  # the code measured, when it runs from a git checkout
        git = ["git", "-C", root, "describe", "--always", "--dirty"]
        commit = subprocess.run(git, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "ddpcomm_commit": commit or None,
        "host_cpus": os.cpu_count(),
        "loadavg_1_5_15": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ddpcomm_build": ddpcomm.build_info(),
    }


def machine_line(env: dict) -> str:
    load = ", ".join(f"{x:.1f}" for x in env["loadavg_1_5_15"])
    commit = f", ddpcomm {env['ddpcomm_commit']}" if env.get("ddpcomm_commit") else ""
    return (
        f"{env['host_cpus']} cpus, load {load} (1/5/15 min) at start, torch {env['torch']}{commit}"
    )


def link_lines(env: dict) -> list[str]:
    """The machine, each world size's link and its measured rate, one line each."""
    lines = [f"machine: {machine_line(env)}"]
    lines += [f"link, {w} ranks: {link}" for w, link in env.get("links", {}).items()]
    lines += [
        f"link check, {c['world']} ranks: {check_line(c)}" for c in env.get("link_checks", [])
    ]
    return lines


def check_line(c: dict) -> str:
    """One link check: its size, its two ranks and its rate."""
    where = " (inside a node)" if c.get("inside_node") else ""
    return (
        f"{c['link_check_MiB']} MiB from rank 0 to {c.get('to_rank', 1)}{where} at "
        f"{c['link_check_MBps']:.1f} MB/s"
    )


def finish(result: dict, report, out: str | None) -> None:
    """Writes ``result`` as JSON to ``out`` (first: the measurements survive a failed
    print), then prints its table, ``report(result)``."""
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    print(report(result), flush=True)
    if out:
        progress(f"results written to {out}")


def progress(msg: str) -> None:
    """One progress line on stderr; stdout is kept for the tables."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def short(text: str, width: int = 120) -> str:
    """One table cell per failure; the JSON has the whole reason."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def table(headers: list[str], rows: list[list[str]], markdown: bool = False) -> str:
    """A fixed-width (or markdown) table. Columns that are "-" in every row are left out
    (a loopback run has no wire bytes); text columns are aligned left, numbers right."""
    keep = [i for i in range(len(headers)) if i == 0 or any(r[i] != "-" for r in rows)]
    headers = [headers[i] for i in keep]
    rows = [[r[i] for i in keep] for r in rows]
    if markdown:
        lines = [headers, ["---"] * len(headers), *rows]
        return "\n".join("| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in lines)
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    text = [any(r[i][:1].isalpha() for r in rows) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if t else c.rjust(w) for c, w, t in zip(cells, widths, text, strict=True)
        ).rstrip()

    head = line(headers)
    return "\n".join([head, "-" * len(head), *map(line, rows)])


def kernel_times(fns: dict[str, Callable], rounds: int, min_run_time: float) -> dict[str, float]:
    """Median seconds per call of each function, by ``torch.utils.benchmark.Timer``
    (which synchronizes the GPU), on this process's thread count.

    The functions are measured round-robin, ``rounds`` times each, and the median of the
    rounds is kept: load from other processes then lands on all of them alike, so ratios
    taken between them (an op against a copy of the same bytes) hold up on a busy machine.
    """
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            timer = Timer("fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
            times[name].append(timer.blocked_autorange(min_run_time=min_run_time).median)
    return {name: statistics.median(ts) for name, ts in times.items()}


def wall(fn: Callable, device: torch.device | None = None):
    """(fn(), seconds): wall clock around one call, the GPU synchronized on both sides.

    For timings across ranks, which need a barrier before every call and the slowest
    rank's time, and for training steps.
    """
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0
