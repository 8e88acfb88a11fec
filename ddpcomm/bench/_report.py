"""Tables on the terminal and JSON for machines, shared by the benchmark commands."""

from __future__ import annotations

import json
import os
import platform
import time

import torch


def environment() -> dict:
    """What the numbers were measured on, including how busy the machine was."""
    import ddpcomm

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "host_cpus": os.cpu_count(),
        "loadavg_1_5_15": load,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "ddpcomm_build": ddpcomm.build_info(),
    }


def write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def _line(cells: list[str], widths: list[int]) -> str:
    # First column (the method) left-aligned, numbers right-aligned.
    return "  ".join(
        c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    )


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = _line(headers, widths)
    return "\n".join([line, "-" * len(line)] + [_line(r, widths) for r in rows])


def short(reason: str, width: int = 110) -> str:
    """The table keeps one line per row; --json has the full reason."""
    return reason if len(reason) <= width else reason[: width - 3] + "..."


def _mb(b) -> str:
    return "-" if b is None else f"{b / 1e6:.3f}" if b < 1e6 else f"{b / 1e6:.1f}"


def print_collectives(rows: list[dict], env: dict) -> None:
    print(f"cpus: {env['host_cpus']}   load at start: {env['loadavg_1_5_15']}")
    for world, link in env.get("links", {"": env["link"]}).items():
        print(f"link{f' (world {world})' if world else ''}: {link}")
    for c in env.get("link_checks", []):
        print(
            f"link check (world {c['world']}): {c['link_check_MiB']} MiB rank 0 -> 1 "
            f"at {c['link_check_MBps']:.1f} MB/s"
        )
    plain = {
        (r["world"], r["size_mib"]): r
        for r in rows
        if r["method"] == "allreduce" and r.get("status") == "ok"
    }
    headers = [
        "method",
        "world",
        "MiB",
        "median ms",
        "compress ms",
        "MB/rank",
        "wire MB",
        "rel err",
        "speedup",
        "ideal",
        "status",
    ]
    body = []
    from ddpcomm.bench.collectives import METHODS

    order = {m: i for i, m in enumerate(METHODS)}
    for r in sorted(rows, key=lambda r: (r["world"], r["size_mib"], order[r["method"]])):
        base = plain.get((r["world"], r["size_mib"]))
        ok = r.get("status") == "ok"
        ideal = (
            f"{base['formula_bytes'] / r['formula_bytes']:.1f}x"
            if base and r["formula_bytes"]
            else "-"
        )
        if base is None:  # plain failed or not run: ideal from its formula is still known
            from ddpcomm.bench.collectives import formula_bytes as fb

            plain_b = fb("allreduce", [(r["numel"],)], r["world"])
            ideal = f"{plain_b / r['formula_bytes']:.1f}x" if r["formula_bytes"] else "-"
        speed = f"{base['median_s'] / r['median_s']:.2f}x" if ok and base else "-"
        status = "ok" if ok else f"{r['status']}: {short(r.get('reason', ''))}"
        if ok and not r.get("ranks_identical", True):
            status = "ok (ranks differ)"
        body.append(
            [
                r["method"],
                str(r["world"]),
                f"{r['size_mib']:g}",
                f"{r['median_s'] * 1e3:.1f}" if ok else "-",
                f"{r['compress_s'] * 1e3:.1f}" if "compress_s" in r else "-",
                _mb(r["formula_bytes"]),
                _mb(r.get("wire_bytes")),
                f"{r['rel_error']:.2e}" if ok and "rel_error" in r else "-",
                speed,
                ideal,
                status,
            ]
        )
    print(table(headers, body))
    for w in env.get("warnings", []):
        print(f"warning: {w}")
