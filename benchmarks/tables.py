"""Prints the tables of saved benchmark results (``--out`` JSON), as the command printed
them after the run, or as markdown for RESULTS.md: tables are printed from results, never
typed.

    python benchmarks/tables.py benchmarks/results/train/1gbit_2ranks.json
    python benchmarks/tables.py --markdown benchmarks/results/*/*.json
    python benchmarks/tables.py benchmarks/results/fidelity/markov.json   # a study

A study file holds several runs of one command (``{"command": "train", "study": NAME,
"runs": [result, ...]}``: the seeds of the fidelity study). Its table gives each spec's
final held-out-loss gap to DDP's default at each seed, taken within each run against that
run's own DDP row, with the mean and range over seeds. A spec measured by several runs at
one seed takes the latest run; a run under one of train's mechanism probes
(``--adam-exact``, ``--exact-params``) is named with it. ``(default)`` marks the spec
that a method runs at today's defaults (``ddpcomm.compressors.default_schedule``).
"""

from __future__ import annotations

import importlib
import json
import statistics
import sys

# train's mechanism probes: a run under one is another experiment, named beside its spec
PROBES = ("adam_exact", "exact_params")


def study_gaps(result: dict) -> dict[str, dict[int, float]]:
    """spec -> seed -> final held-out-loss gap to the same run's DDP (latest run wins)."""
    gaps: dict[str, dict[int, float]] = {}
    for run in sorted(result["runs"], key=lambda r: r["environment"]["date_utc"]):
        rows = [r for r in run["rows"] if r["status"] == "ok"]
        base = next(r["eval_loss"] for r in rows if r["method"] == "ddp")
        args = run["args"]
        probes = "".join(
            f" [--{k.replace('_', '-')} {args[k]}]" for k in PROBES if args.get(k) is not None
        )
        for r in rows:
            if r["method"] != "ddp":
                gap = r["eval_loss"] / base - 1
                gaps.setdefault(r["method"] + probes, {})[args["seed"]] = gap
    return gaps


def default_spec(method: str) -> str:
    """The spec ``method`` runs as at today's defaults, its schedule written out."""
    from ddpcomm import compressors

    start, ramp = compressors.default_schedule(compressors.parse(method))
    return f"{method},start_iter={start},ramp={ramp}" if start or ramp else method


def study_table(result: dict, markdown: bool = False) -> str:
    from ddpcomm.bench._util import table

    gaps = study_gaps(result)
    seeds = sorted({s for by_seed in gaps.values() for s in by_seed})
    defaults = {}
    for method in ("q8", "q4", "q4,error_feedback", "q2", "q1", "topk:0.01", "randk:0.01"):
        defaults[default_spec(method)] = method
    family = ("q8", "q4", "q2", "q1", "topk", "randk")

    def order(spec: str) -> tuple:  # the defaults, then without a schedule, then the rest
        kind = 0 if spec in defaults else 1 if "start_iter=0,ramp=0" in spec else 2
        return kind, next(i for i, f in enumerate(family) if spec.startswith(f)), spec

    body = []
    for spec in sorted(gaps, key=order):
        by_seed = gaps[spec]
        values = list(by_seed.values())
        name = f"{spec} (default)" if spec in defaults and spec != defaults[spec] else spec
        body.append(
            [
                name,
                *[f"{by_seed[s]:+.2%}" if s in by_seed else "-" for s in seeds],
                *[f"{v:+.2%}" for v in (statistics.fmean(values), min(values), max(values))],
            ]
        )
    headers = ["spec", *[f"seed {s}" for s in seeds], "mean", "min", "max"]
    return table(headers, body, markdown)


def main(argv: list[str]) -> int:
    markdown = "--markdown" in argv
    paths = [a for a in argv if a != "--markdown"]
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    for i, path in enumerate(paths):
        with open(path) as f:
            result = json.load(f)
        if len(paths) > 1:
            print(f"{'' if i == 0 else chr(10)}<!-- {path} -->" if markdown else f"== {path}")
        if "runs" in result:
            print(study_table(result, markdown))
            continue
        command = importlib.import_module(f"ddpcomm.bench.{result['command']}")
        text = command.report(result, markdown=markdown)
        if markdown:  # lines around the tables become a list, not one run-on paragraph
            text = "\n".join(ln if ln[:1] in ("", "|") else f"- {ln}" for ln in text.splitlines())
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
