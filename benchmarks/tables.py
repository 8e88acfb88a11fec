"""Prints the table of saved benchmark results (``--out`` JSON), as the command printed it
after the run, or as markdown for RESULTS.md: tables are printed from results, never typed.

    python benchmarks/tables.py benchmarks/train_1gbit_2ranks.json
    python benchmarks/tables.py --markdown benchmarks/*.json
    python benchmarks/tables.py --gaps benchmarks/train_fidelity_*.json   # loss gap by seed
"""

from __future__ import annotations

import importlib
import json
import sys


def main(argv: list[str]) -> int:
    markdown = "--markdown" in argv
    paths = [a for a in argv if a not in ("--markdown", "--gaps")]
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    if "--gaps" in argv:
        from ddpcomm.bench import train

        results = []
        for path in paths:
            with open(path) as f:
                results.append(json.load(f))
        print(train.gaps_by_seed(results, markdown))
        return 0
    for i, path in enumerate(paths):
        with open(path) as f:
            result = json.load(f)
        command = importlib.import_module(f"ddpcomm.bench.{result['command']}")
        if len(paths) > 1:
            print(f"{'' if i == 0 else chr(10)}<!-- {path} -->" if markdown else f"== {path}")
        text = command.report(result, markdown=markdown)
        if markdown:  # lines around the tables become a list, not one run-on paragraph
            text = "\n".join(ln if ln[:1] in ("", "|") else f"- {ln}" for ln in text.splitlines())
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
