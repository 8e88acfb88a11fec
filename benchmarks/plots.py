"""Draws RESULTS.md's figures from the committed results (no benchmark is run):

- ``results/adaptive/speedup_vs_link.png``: each method's speedup over the plain
  all_reduce of one 64 MiB bucket on a 1 Gbit/s link, a 10 Gbit/s link and loopback;
- ``results/train/1gbit.png``: bytes on the wire and time per DDP training step;
- ``results/fidelity/loss.png``: each method's training loss against DDP's at seed 0 of
  both corpora, at its defaults and without its schedule;
- ``results/steady_state/by_kind.png``: the reduced gradient's error by parameter kind
  over 1200 steps, and each method's loss gap with AdamW's moments fed the exact mean.

    python benchmarks/plots.py
"""

from __future__ import annotations

import json
import os
import statistics

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
METHODS = ("q8", "q4", "q2", "q1", "topk:0.01", "randk:0.01")
COLORS = dict(zip(METHODS, plt.get_cmap("tab10").colors, strict=False))


def load(path: str) -> dict:
    with open(os.path.join(HERE, path)) as f:
        return json.load(f)


def speedup_vs_link() -> None:
    links = [("1 Gbit/s", "1gbit"), ("10 Gbit/s", "10gbit"), ("loopback", "loopback")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, world in zip(axes, (2, 4), strict=True):
        for method in METHODS:
            ys = []
            for _, name in links:
                rows = load(f"adaptive/collectives_{name}.json")["rows"]
                t = {r["method"]: r["median_s"] for r in rows if _case(r, world)}
                ys.append(t["allreduce"] / t[method])
            ax.plot(range(len(links)), ys, "o-", color=COLORS[method], label=method)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(range(len(links)), [label for label, _ in links])
        ax.set_yscale("log")
        ax.set_title(f"one 64 MiB bucket, {world} ranks")
    axes[0].set_ylabel("speedup over plain all_reduce")
    axes[0].legend(fontsize=8)
    _save(fig, "adaptive/speedup_vs_link.png")


def _case(row: dict, world: int) -> bool:
    return row["world"] == world and row["size_mib"] == 64 and row["status"] == "ok"


def train_steps() -> None:
    fig, (ax_mb, ax_ms) = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.38
    for i, world in enumerate((2, 4)):
        rows = load(f"train/1gbit_{world}ranks.json")["rows"]
        names = [r["method"] for r in rows]
        xs = [j + (i - 0.5) * width for j in range(len(rows))]
        mb = [r.get("wire_bytes_per_step", 0) / 1e6 for r in rows]
        ms = [r["median_step_s"] * 1e3 for r in rows]
        ax_mb.bar(xs, mb, width, label=f"{world} ranks")
        ax_ms.bar(xs, ms, width, label=f"{world} ranks")
    for ax, label in ((ax_mb, "MB on the wire per step and rank"), (ax_ms, "ms per step")):
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("DDP training, 16.8M-parameter GPT, 1 Gbit/s (nocomm: no gradient exchange)")
    _save(fig, "train/1gbit.png")


def fidelity_loss() -> None:
    from tables import default_spec

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, corpus in zip(axes, ("markov", "text"), strict=True):
        runs = [r for r in load(f"fidelity/{corpus}.json")["runs"] if r["args"]["seed"] == 0]
        curves = {}
        for run in sorted(runs, key=lambda r: r["environment"]["date_utc"]):  # latest wins
            base = _smooth(next(r for r in run["rows"] if r["method"] == "ddp")["loss"])
            for r in run["rows"]:
                if r["status"] == "ok" and r["method"] != "ddp":
                    ratio = zip(_smooth(r["loss"]), base, strict=True)
                    curves[r["method"]] = [a / b - 1 for a, b in ratio]
        for method in METHODS:
            spec = default_spec(method)
            if spec in curves:
                ax.plot(curves[spec], color=COLORS[method], label=f"{method} (defaults)")
            bare = f"{method},start_iter=0,ramp=0"
            if bare in curves:
                ax.plot(curves[bare], color=COLORS[method], ls=":", lw=1)
        ax.axhline(0.0, color="gray", lw=0.8)
        ax.set_yscale("symlog", linthresh=0.02)
        ax.set_xlabel("step")
        ax.set_title(f"{corpus}, seed 0 (dotted: no schedule)")
    axes[0].set_ylabel("training loss / DDP's - 1 (25-step mean)")
    axes[1].legend(fontsize=8, loc="lower right")
    _save(fig, "fidelity/loss.png")


def _unscheduled(method: str) -> str:
    """A steady-state method without its (default) schedule written out."""
    return method.replace(",start_iter=100,ramp=200", "").replace(",start_iter=200,ramp=200", "")


def _color(method: str) -> tuple:
    return COLORS[method.split(",")[0]]


def steady_state() -> None:
    """Where the high-ratio methods lose accuracy at steady state: the reduced gradient's
    relative error by parameter kind (second half of the run), and each method's gap to
    DDP with AdamW fed the method's mean in both moments, or the exact mean in one."""
    probe = [r for r in load("steady_state/probe.json")["rows"] if "probe" in r]
    exact = load("steady_state/adam_exact.json")["runs"]
    steady = [r for r in load("steady_state/text_1200.json")["runs"] if r["args"]["seed"] == 0]
    both = {}  # seed 0, as exact: each method's latest run, gaps to that run's DDP
    for run in sorted(steady, key=lambda r: r["environment"]["date_utc"]):
        ddp = next(r for r in run["rows"] if r["method"] == "ddp")
        both.update({r["method"]: dict(r, ddp_loss=ddp["eval_loss"]) for r in run["rows"]})
    kinds = sorted(probe[0]["probe"]["second_half"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    width = 0.8 / len(probe)
    for j, r in enumerate(probe):
        xs = [i + j * width for i in range(len(kinds))]
        ys = [r["probe"]["second_half"][k] for k in kinds]
        hatch = None if "normalize=0" in r["method"] or "normalize" not in r["method"] else "//"
        label = _unscheduled(r["method"])
        axes[0].bar(xs, ys, width, label=label, color=_color(r["method"]), hatch=hatch)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("||reduced - exact mean|| / ||exact mean||")
    axes[0].set_title("gradient error by kind, steps 600-1199")
    axes[0].set_xticks([i + 0.4 for i in range(len(kinds))], kinds, rotation=30, fontsize=8)
    axes[0].set_ylim(top=2000)  # room for the legend above the bars
    axes[0].legend(fontsize=7, loc="upper left", ncols=2)
    methods = [r["method"] for r in exact[0]["rows"] if r["method"] != "ddp"]
    cases = [("both moments: the method's", both)]
    cases += [(f"exact mean in {run['args']['adam_exact']}", {r["method"]: r for r in run["rows"]})
              for run in exact]  # fmt: skip
    width = 0.8 / len(cases)
    for j, (label, rows) in enumerate(cases):
        labeled = False
        for i, m in enumerate(methods):
            x, r = i + j * width, rows[m]
            base = r.get("ddp_loss", rows["ddp"]["eval_loss"])
            if r["status"] != "ok":  # top-k with the exact mean in m: NaN (see RESULTS.md)
                axes[1].text(x, 1, "diverged", rotation=90, ha="center", fontsize=7)
                continue
            y = 100 * (r["eval_loss"] / base - 1)
            axes[1].bar(x, y, width, color=f"C{j}", label=None if labeled else label)
            labeled = True
    short = [_unscheduled(m) for m in methods]
    axes[1].set_xticks([i + 0.4 for i in range(len(methods))], short, rotation=15, fontsize=8)
    axes[1].set_ylabel("held-out loss vs DDP's, % (seed 0, step 1200)")
    axes[1].set_title("AdamW's moments fed the exact mean")
    axes[1].legend(fontsize=7)
    _save(fig, "steady_state/by_kind.png")


def _smooth(xs: list[float], n: int = 25) -> list[float]:
    """The mean of the last ``n`` values at each step (fewer at the start)."""
    return [statistics.fmean(xs[max(0, i - n + 1) : i + 1]) for i in range(len(xs))]


def _save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, path), dpi=90)
    plt.close(fig)
    print(os.path.join("benchmarks/results", path))


if __name__ == "__main__":
    speedup_vs_link()
    train_steps()
    fidelity_loss()
    steady_state()
