"""Many checks in one spawned process group, each reported by its own test.

Spawning ranks costs seconds, so a test module spawns each (world size, device) group
once and runs every check of that group there: ``plan(rank, world, device)`` yields
``(key, check)`` pairs in the same order on every rank, ``run_plan`` calls each ``check()``
and records its value or its traceback, and a test reads the outcome of the keys it owns.
Keys are tuples; a test names them by prefix, so ``("mean", "q8")`` also covers a repeat
keyed ``("mean", "q8", "nccl")``.

A rank stops at its first failure: its peers would otherwise wait on collectives it no
longer issues. The peers then fail too (a closed connection), and the tests of the checks
that never ran say which check failed first.

Values cross back to the parent through a queue: plain Python values, not tensors (a
tensor would travel through shared memory that dies with the rank's process).
"""

from __future__ import annotations

import traceback

import pytest

from tests.dist_utils import run_ranks


def run_plan(rank: int, world: int, plan, *args) -> dict:
    """In a spawned rank: {key: (True, value) or (False, traceback)}, up to a failure."""
    outcomes = {}
    for key, check in plan(rank, world, *args):
        try:
            outcomes[key] = (True, check())
        except Exception:  # noqa: BLE001 - reported by the test that owns the key
            outcomes[key] = (False, traceback.format_exc())
            break
    return outcomes


class Groups:
    """Runs ``plan`` on spawned ranks once per (world, device), when a test first asks."""

    def __init__(self, plan, timeout: float = 900.0, pg_timeout: float | None = None) -> None:
        self.plan = plan
        self.timeout = timeout
        self.pg_timeout = pg_timeout  # the process groups' (None: run_ranks' default)
        self.runs: dict[tuple, list | Exception] = {}

    def values(self, world: int, device: str, *prefix: str) -> list:
        """The values of every check under ``prefix``, on every rank (rank-major); fails
        the calling test with the rank's traceback if one of them failed or never ran."""
        if (world, device) not in self.runs:
            try:
                runs = run_ranks(
                    run_plan,
                    world,
                    self.plan,
                    device,
                    timeout=self.timeout,
                    pg_timeout=self.pg_timeout,
                )
            except RuntimeError as exc:
                runs = exc
            self.runs[world, device] = runs
        runs = self.runs[world, device]
        if isinstance(runs, Exception):
            pytest.fail(
                f"{world} rank(s) on {device} failed outside a check:\n{runs}", pytrace=False
            )
        values, short = [], []
        for rank, outcomes in enumerate(runs):
            mine = [v for k, v in outcomes.items() if k[: len(prefix)] == prefix]
            if not mine or not all(ok for ok, _ in mine):
                short.append(rank)
            values += [value for _, value in mine]
        if short:
            # This test's own failures first, then the ones that may have caused them.
            failures = sorted(
                (
                    (key[: len(prefix)] != prefix, f"rank {rank}, {key}:\n{value}")
                    for rank, outcomes in enumerate(runs)
                    for key, (ok, value) in outcomes.items()
                    if not ok
                ),
                key=lambda f: f[0],
            )
            failures = [text for _, text in failures]
            why = "\n".join(failures) or "the plan has no such check"
            pytest.fail(
                f"{prefix} did not pass on rank(s) {short}; failures:\n{why}", pytrace=False
            )
        return values
