"""Spawns benchmark ranks (optionally inside shaped network namespaces) under a watchdog.

A benchmark is a list of *cases* run in order by every rank of one gloo process group.
Rank 0 appends JSON events to an event file (``start`` before a case, ``result`` after
it); the parent reads them for progress lines and to know which case was running when
something went wrong. A case that raises on any rank, or makes no progress within its
time limit, ends the whole group: the parent kills every rank (a half-failed collective
leaves the others blocked forever), records that case as failed with the reason, and
starts a fresh group for the cases after it. So one broken method costs one restart,
never the run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from ddpcomm.bench.netns import Links


@dataclass
class Failure:
    case: dict
    reason: str


@dataclass
class Outcome:
    results: list[dict] = field(default_factory=list)
    info: list[dict] = field(default_factory=list)
    failure: Failure | None = None
    # Set when every case has its result but a rank then failed or hung while shutting
    # down: a problem to report, not a case to mark failed.
    teardown_error: str | None = None


def progress(msg: str) -> None:
    """One progress line on stderr (stdout stays for the table)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return ""


_EXC = re.compile(r"\b([A-Z]\w*(?:Error|Exception|Interrupt))(?:: (.*)|\s*$)")
_SECONDARY = re.compile(r"Connection (reset|closed) by peer|Broken pipe")
_CALLBACK = "Got the following error when running the callback: "
_AT_FRAME = re.compile(r"^\s*(\S+\.py)\((\d+)\): (\S+)")
_FILE_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def failure_reason(log: str) -> str | None:
    """The innermost Python exception in a rank's log, with the frame that raised it.

    Exceptions raised inside ``Future.then`` callbacks arrive wrapped ("Got the following
    error when running the callback: ...") with their frames listed after "At:"; plain
    tracebacks list frames before the exception line. None when the log has no exception.
    """
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", ln) for ln in log.splitlines()]
    # A C++ exception that escaped (std::terminate) prints "what(): ..." and no traceback.
    what = [ln.split("what():", 1)[1].strip() for ln in lines if "what():" in ln]
    if what:
        # Build-machine paths ("/__w/pytorch/.../pair.cc:456") say nothing; keep the file.
        return "C++ abort: " + re.sub(r"(?:/[^\s/]+)+/([^\s/]+:\d+)", r"\1", what[-1])
    idx = next((i for i in range(len(lines) - 1, -1, -1) if _EXC.search(lines[i])), None)
    if idx is None:
        return None
    exc_type, msg = _EXC.search(lines[idx]).groups()
    msg = msg or ""
    while _CALLBACK in msg:
        inner = _EXC.search(msg.split(_CALLBACK, 1)[1])
        if inner is None:
            break
        exc_type, msg = inner.groups()
        msg = msg or ""
    where = None
    for ln in lines[idx + 1 :]:
        m = _AT_FRAME.match(ln)
        if m:
            where = m.groups()
            break
    if where is None:
        for ln in reversed(lines[:idx]):
            m = _FILE_FRAME.search(ln)
            if m:
                where = m.groups()
                break
    text = f"{exc_type}: {msg.strip()}" if msg.strip() else exc_type
    if where:
        text += f" [{os.path.basename(where[0])}:{where[1]} {where[2]}]"
    return text


def run_group(
    module: str,
    world: int,
    links: Links | None,
    cases: list[dict],
    common: dict,
    case_timeout,
    threads: int,
) -> Outcome:
    """Runs ``cases`` on ``world`` fresh ranks of ``python -m module`` until all are done
    or one fails. ``case_timeout(case)`` gives the seconds a case may take."""
    outcome = Outcome()
    with tempfile.TemporaryDirectory(prefix="ddpcomm-bench-") as tmp:
        events_path = os.path.join(tmp, "events.jsonl")
        config_path = os.path.join(tmp, "config.json")
        with open(config_path, "w") as f:
            json.dump({"cases": cases, "common": common, "events": events_path}, f)
        open(events_path, "w").close()

        if links is None:
            addr, ifname = "127.0.0.1", "lo"
        else:
            addr, ifname = links.address(0), links.ifname
        # A fresh port per group: the previous group's store socket may sit in TIME_WAIT.
        port = _free_port()
        procs, logs = [], []
        for rank in range(world):
            env = dict(os.environ)
            env.update(
                MASTER_ADDR=addr,
                MASTER_PORT=str(port),
                WORLD_SIZE=str(world),
                RANK=str(rank),
                GLOO_SOCKET_IFNAME=ifname,
                OMP_NUM_THREADS=str(threads),
                DDPCOMM_BENCH_CONFIG=config_path,
            )
            prefix = [] if links is None else links.prefix_command(rank)
            log = os.path.join(tmp, f"rank{rank}.log")
            logs.append(log)
            with open(log, "w") as out:
                procs.append(
                    subprocess.Popen(
                        [*prefix, sys.executable, "-m", module],
                        env=env,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        try:
            outcome = _watch(procs, logs, events_path, cases, case_timeout)
        finally:
            # Each rank leads its own session, so this also ends anything it started.
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:  # exited between poll() and kill
                        pass
            for p in procs:
                p.wait()
    return outcome


def _read_events(path: str, offset: int) -> tuple[list[dict], int]:
    with open(path) as f:
        f.seek(offset)
        data = f.read()
    # Only whole lines: rank 0 may be midway through writing the last one.
    end = data.rfind("\n") + 1
    events = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return events, offset + end


def _watch(procs, logs, events_path, cases, case_timeout) -> Outcome:
    outcome = Outcome()
    offset, current = 0, None
    # Process start, imports and rendezvous count against the first case.
    deadline = time.monotonic() + case_timeout(cases[0]) + 120
    while True:
        # Poll before reading: once every rank has exited, all its events are on disk.
        codes = [p.poll() for p in procs]
        events, offset = _read_events(events_path, offset)
        for ev in events:
            if ev["event"] == "start":
                current = cases[ev["index"]]
                deadline = time.monotonic() + case_timeout(current)
                progress(ev["label"])
            elif ev["event"] == "result":
                outcome.results.append(ev["result"])
                current = None
            elif ev["event"] == "note":
                progress(ev["label"])
                if current is not None:  # a heartbeat: the case is making progress
                    deadline = time.monotonic() + case_timeout(current)
            elif ev["event"] == "info":
                outcome.info.append(ev["info"])
        if all(c == 0 for c in codes):
            return outcome
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        done = len(outcome.results)
        failed_case = current if current is not None else cases[min(done, len(cases) - 1)]
        if bad:
            # Give the other ranks a moment to fail too: the first rank to raise may only
            # be reporting a peer's death, and the root cause is in the peer's log.
            time.sleep(2)
            # The first rank with a Python exception names the cause; a rank that died
            # without one (a C++ abort) only says it exited.
            reasons = [(r, failure_reason(_tail(logs[r], 200))) for r in range(len(procs))]
            found = [(r, why) for r, why in reasons if why]
            # A rank that only saw its peer vanish is a symptom; prefer the peer's cause.
            primary = [(r, why) for r, why in found if not _SECONDARY.search(why)]
            found = primary or found
            if found:
                reason = f"{found[0][1]} (rank {found[0][0]})"
            else:
                codes = {r: procs[r].poll() for r in bad}
                reason = f"ranks exited without a Python exception: exit codes {codes}"
            for r in bad[:1]:
                print(f"--- rank {r} log (tail) ---\n{_tail(logs[r])}", file=sys.stderr)
            return _fail(outcome, failed_case, reason, done == len(cases))
        if time.monotonic() > deadline:
            limit = case_timeout(failed_case)
            reason = f"timeout: no progress in {limit:.0f} s"
            return _fail(outcome, failed_case, reason, done == len(cases))
        time.sleep(0.2)


def _fail(outcome: Outcome, case: dict, reason: str, all_done: bool) -> Outcome:
    if all_done:
        outcome.teardown_error = reason
        progress(f"warning: a rank failed after the last case finished: {reason}")
    else:
        outcome.failure = Failure(case, reason)
        progress(f"failed: {reason}")
    return outcome


class EventWriter:
    """Rank 0's side of the event file (other ranks write nothing)."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.path = path if rank == 0 else None

    def _write(self, obj: dict) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(obj) + "\n")

    def start(self, index: int, label: str) -> None:
        self._write({"event": "start", "index": index, "label": label})

    def note(self, label: str) -> None:
        self._write({"event": "note", "label": label})

    def info(self, info: dict) -> None:
        self._write({"event": "info", "info": info})

    def result(self, result: dict) -> None:
        self._write({"event": "result", "result": result})
