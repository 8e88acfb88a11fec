"""Markdown tables from the benchmark JSON files, for RESULTS.md (no numbers typed by hand).

.venv/bin/python benchmarks/md_tables.py benchmarks/collectives_1gbit.json
.venv/bin/python benchmarks/md_tables.py benchmarks/train_1gbit.json
"""

from __future__ import annotations

import json
import re
import statistics
import sys

from ddpcomm.bench.collectives import METHODS, formula_bytes


def _reason(r: dict, width: int = 110) -> str:
    text = f"{r['status']}: {r.get('reason', '')}".replace("|", "/")
    # Older results kept build-machine paths in C++ aborts; the file name is what matters.
    text = re.sub(r"(?:/[^\s/]+)+/([^\s/]+:\d+)", r"\1", text)
    return text if len(text) <= width else text[: width - 3] + "..."


def collectives(d: dict) -> str:
    rows = d["rows"]
    plain = {
        (r["world"], r["size_mib"]): r
        for r in rows
        if r["method"] == "allreduce" and r["status"] == "ok"
    }
    order = {m: i for i, m in enumerate(METHODS)}
    out = [
        "| N | MiB | method | median ms | compress ms | MB/rank | wire MB | rel. error | "
        "speedup | ideal | status |",
        "|" + "---|" * 11,
    ]
    for r in sorted(rows, key=lambda r: (r["world"], r["size_mib"], order[r["method"]])):
        ok = r["status"] == "ok"
        base = plain.get((r["world"], r["size_mib"]))
        plain_b = formula_bytes("allreduce", [(r["numel"],)], r["world"])
        ideal = plain_b / r["formula_bytes"] if r["formula_bytes"] else float("nan")
        cells = [
            str(r["world"]),
            f"{r['size_mib']:g}",
            r["method"],
            f"{r['median_s'] * 1e3:.1f}" if ok else "-",
            f"{r['compress_s'] * 1e3:.1f}" if "compress_s" in r else "-",
            f"{r['formula_bytes'] / 1e6:.3g}",
            f"{r['wire_bytes'] / 1e6:.3g}" if "wire_bytes" in r else "-",
            f"{r['rel_error']:.1e}" if ok and "rel_error" in r else "-",
            f"**{base['median_s'] / r['median_s']:.2f}x**" if ok and base else "-",
            f"{ideal:.1f}x",
            "ok" if ok else _reason(r),
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def train(d: dict) -> str:
    rows = d["rows"]
    base = next((r for r in rows if r["method"] == "ddp" and r["status"] == "ok"), None)
    out = [
        "| method | median step ms | speedup vs ddp | MB/step (formula) | wire MB/step | "
        "compress ms/step | train loss, last 10 | held-out loss | vs ddp | status |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"| {r['method']} |" + " - |" * 8 + f" {_reason(r)} |")
            continue
        cells = [
            r["method"],
            f"{r['median_step_s'] * 1e3:.0f}",
            f"**{base['median_step_s'] / r['median_step_s']:.2f}x**" if base else "-",
            f"{r['bytes_per_step'] / 1e6:.2f}",
            f"{r['wire_bytes_per_step'] / 1e6:.2f}" if "wire_bytes_per_step" in r else "-",
            f"{r['compress_s_per_step'] * 1e3:.0f}" if "compress_s_per_step" in r else "-",
            f"{statistics.fmean(r['loss'][-10:]):.3f}",
            f"{r['eval_loss']:.3f}",
            f"{(r['eval_loss'] / base['eval_loss'] - 1) * 100:+.2f}%" if base else "-",
            "ok" if r.get("replicas_identical", True) else "replicas differ",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> int:
    for path in sys.argv[1:]:
        with open(path) as f:
            d = json.load(f)
        env = d["environment"]
        print(f"<!-- {path}: {env['date_utc']} UTC, load {env['loadavg_1_5_15']} -->")
        print(collectives(d) if d["command"] == "collectives" else train(d))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
