"""A process that exits with a ddpcomm callback in flight on gloo exits cleanly.

torch runs a gloo Future's callbacks on the group's worker thread, which needs the GIL
again after the Future a training step waits on is complete; an interpreter already
finalizing kills that thread inside a destructor and the process aborts. ddpcomm's
``futures.then`` waits at exit for its callbacks (tests/scripts/exit_in_flight.py
leaves one 0.3 s from running; with ``Future.then`` instead, rank 0 aborts or never runs
the callback).
"""

from __future__ import annotations

import os
import subprocess
import sys

from ddpcomm import futures
from tests.test_run import ROOT, _port

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "exit_in_flight.py")


def test_exit_waits_for_callbacks_in_flight():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDPCOMM_")}
    env.update(WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=_port(), PYTHONPATH=ROOT)
    procs = [
        subprocess.Popen(
            [sys.executable, SCRIPT],
            env={**env, "RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "callback ran: 2" in outs[0]


def test_exit_wait_is_bounded(monkeypatch):
    never = futures.Future()
    before = len(futures._CALLBACKS)
    futures.then(never, lambda f: None)  # a collective that never finishes
    clock = iter(range(1000))
    monkeypatch.setattr(futures.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(futures.time, "sleep", lambda s: None)
    futures._drain()  # returns once the (fake) clock passes _EXIT_WAIT
    assert len(futures._CALLBACKS) == before + 1  # still pending
    assert next(clock) == 1 + int(futures._EXIT_WAIT)
