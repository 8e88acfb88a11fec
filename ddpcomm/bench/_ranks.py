"""Runs benchmark cases on every rank of a fresh gloo group, or in-process under torchrun.

``run_cases(target, cases, world, env)`` runs ``target(case, common, device)`` (named as
"module:function") for each case, in order, on every rank, and returns one row per case.
The ranks are ``python -m ddpcomm.bench._ranks`` processes, started under
``ip netns exec`` when the command was given ``--link``: one namespace per rank, or with
``--nodes`` one per node, whose ranks talk over the namespace's own loopback and leave it
only to reach other nodes, through the shaped link. Rank 0 appends JSON events to a
file (``start`` before a case, ``result`` after it, ``note`` for progress), which the
parent reads for progress lines and to know which case was running when something went
wrong. A case that raises on any rank, or makes no progress within its time limit, ends
the group: the parent kills every rank (a half-failed collective leaves the others
blocked forever), records the case as failed with a one-line reason, and starts a fresh
group for the cases after it; a method that failed is not tried again at later sizes.
Under torchrun every rank runs the cases in-process (NCCL on GPUs) and torchrun owns the
processes, so a case that raises becomes a failed row there.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist

from ddpcomm.bench import netns
from ddpcomm.bench._util import progress, short, wall


def under_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (which then owns the ranks)."""
    return "LOCAL_RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ


def world_size(default: int) -> int:
    """torchrun's world size under torchrun, else ``default`` (the ranks to spawn)."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun() else default


def local_world(world: int) -> int:
    """Ranks on this machine: torchrun's LOCAL_WORLD_SIZE under torchrun, else ``world``
    (every rank spawned here)."""
    return int(os.environ["LOCAL_WORLD_SIZE"]) if under_torchrun() else world


def add_node_arguments(p) -> None:
    """``--nodes`` and ``--ranks-per-node``: the ranks as nodes (see ``nodes_world``)."""
    p.add_argument(
        "--nodes",
        type=int,
        metavar="N",
        help="N nodes of --ranks-per-node ranks (replaces --world): with --link each node "
        "is a network namespace whose ranks talk over its own loopback, and nodes are "
        "joined by the shaped link; ranks get LOCAL_RANK and LOCAL_WORLD_SIZE as from "
        "torchrun, numbered node by node",
    )
    p.add_argument(
        "--ranks-per-node", type=int, default=2, metavar="L", help="ranks per node (default 2)"
    )


def nodes_world(args) -> int | None:
    """N x L ranks for ``--nodes N --ranks-per-node L`` (None without --nodes); exits
    naming the argument when they make no sense."""
    if args.nodes is None:
        return None
    if args.nodes < 2 or args.ranks_per_node < 1:
        raise SystemExit(
            f"--nodes must be >= 2 and --ranks-per-node >= 1, got {args.nodes}, "
            f"{args.ranks_per_node}"
        )
    if under_torchrun():
        raise SystemExit("--nodes cannot be used under torchrun: its nodes are the nodes")
    return args.nodes * args.ranks_per_node


def link_rate(link: str | None) -> float | None:
    """Bytes per second of a ``--link`` rate (None: loopback); exits naming --link if bad."""
    try:
        return None if link is None else netns.parse_rate(link) / 8
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def run_cases(
    target: str,
    cases: list[dict],
    world: int,
    env: dict,
    *,
    link: str | None = None,
    common: dict | None = None,
    timeout=lambda case: 600.0,
    per_node: int = 1,
) -> list[dict] | None:
    """Rows of every case, in order (None on torchrun ranks other than 0).

    ``per_node`` > 1 makes nodes of that many consecutive ranks: one namespace per node
    with ``link`` (otherwise one per rank), LOCAL_RANK and LOCAL_WORLD_SIZE as torchrun
    sets them, and the link check from rank 0 to the first rank of the next node.

    Each case is a dict with a ``label`` (the progress line) and a ``row`` (the fields a
    failed case's row keeps). ``timeout(case)`` is the seconds a case may go without
    progress. ``env`` (the result's environment) receives the link description, the
    link check and warnings.
    """
    common = dict(common or {}, target=target)
    common.setdefault("pg_timeout", max(map(timeout, cases)))
    if under_torchrun():
        if link is not None:
            raise SystemExit(
                "--link cannot be used under torchrun: its ranks already run on a network"
            )
        return _inline(cases, common, env)
    links, note = netns.open_links(world // per_node, link)
    rows: list[dict] = []
    failed: dict[str, str] = {}
    with links or contextlib.nullcontext(), tempfile.TemporaryDirectory(prefix="ddpcomm-") as tmp:
        env["link"] = links.describe() if links else note
        if per_node > 1:
            where = "its namespace's loopback, unshaped" if links else "loopback"
            env["link"] = (
                f"{world // per_node} nodes of {per_node} ranks (inside a node over {where}); "
                + env["link"]
            )
            env["nodes"] = {"nodes": world // per_node, "ranks_per_node": per_node}
        env.setdefault("links", {})[str(world)] = env["link"]
        progress(f"{world} ranks, {env['link']}")
        common.setdefault("threads", max(1, (os.cpu_count() or 1) // world))
        common.update(
            per_node=per_node,
            workdir=tmp,
            ifname=links.ifname if links else None,
            link_check_mb=common.get("link_check_mb", 0) if links else 0,
        )
        while cases:
            results, info, error, teardown = _group(world, links, cases, common, timeout, tmp)
            common["link_check_mb"] = 0  # once per world size is enough
            env.setdefault("link_checks", []).extend(dict(i, world=world) for i in info)
            rows += results
            if teardown:
                env.setdefault("warnings", []).append(f"{world} ranks: {teardown}")
            if error is None:
                break
            case, cases = cases[len(results)], cases[len(results) + 1 :]
            reason, log = error
            rows.append(dict(case["row"], status="failed", reason=reason, log=log))
            failed[case["row"].get("method")] = f"failed in '{case['label']}': {reason}"
            # A method that failed is not tried at later sizes: its failure (an exception
            # in a hook, a hang) does not depend on size, and each retry costs a group.
            for c in [c for c in cases if c["row"].get("method") in failed]:
                rows.append(dict(c["row"], status="not run", reason=failed[c["row"]["method"]]))
            cases = [c for c in cases if c["row"].get("method") not in failed]
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _group(world, links, cases, common, timeout, tmp):
    """Runs ``cases`` on fresh ranks until all are done or one fails.

    Returns (results, link checks, (reason, log) of the failed case or None, a problem
    after the last case or None).
    """
    events = os.path.join(tmp, "events.jsonl")
    config = os.path.join(tmp, "config.json")
    with open(config, "w") as f:
        json.dump({"cases": cases, "common": common, "events": events}, f)
    open(events, "w").close()
    addr, ifname = (links.address(0), links.ifname) if links else ("127.0.0.1", "lo")
    port = _free_port()  # a fresh port per group: the last one's may sit in TIME_WAIT
    procs, logs = [], []
    per_node = common.get("per_node", 1)
    for rank in range(world):
        logs.append(os.path.join(tmp, f"rank{rank}.log"))
        env = dict(
            os.environ,
            MASTER_ADDR=addr,
            MASTER_PORT=str(port),
            WORLD_SIZE=str(world),
            RANK=str(rank),
            GLOO_SOCKET_IFNAME=ifname,
            OMP_NUM_THREADS=str(common["threads"]),
            DDPCOMM_BENCH_CONFIG=config,
        )
        if per_node > 1:  # as torchrun tells a rank where it is (hierarchy="auto" reads it)
            env.update(LOCAL_RANK=str(rank % per_node), LOCAL_WORLD_SIZE=str(per_node))
        prefix = links.prefix_command(rank // per_node) if links else []
        with open(logs[-1], "w") as out:
            procs.append(
                subprocess.Popen(
                    [*prefix, sys.executable, "-m", "ddpcomm.bench._ranks"],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    try:
        return _watch(procs, logs, events, cases, timeout)
    finally:
        for p in procs:  # each rank leads its own session: this ends what it started too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _watch(procs, logs, events_path, cases, timeout):
    results, info, offset, current = [], [], 0, cases[0]
    deadline = time.monotonic() + timeout(cases[0]) + 120  # start, imports, rendezvous
    while True:
        codes = [p.poll() for p in procs]  # before reading: exited ranks' events are on disk
        with open(events_path) as f:
            f.seek(offset)
            data = f.read()
        end = data.rfind("\n") + 1  # whole lines only: rank 0 may be writing the last one
        offset += end
        for ev in map(json.loads, data[:end].splitlines()):
            if ev["event"] == "result":
                results.append(ev["result"])
            elif ev["event"] == "info":
                info.append(ev["info"])
            else:  # "start" or "note": a progress line, and the case's clock restarts
                current = cases[ev["index"]] if ev["event"] == "start" else current
                deadline = time.monotonic() + timeout(current)
                progress(ev["label"])
        if all(c == 0 for c in codes):
            return results, info, None, None
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            # The first rank to fail may only report its peer's death; give the peer a
            # moment to write the root cause, then prefer it.
            time.sleep(2)
            found = [(r, failure_reason(_tail(logs[r], 200))) for r in range(len(procs))]
            found = [(r, why) for r, why in found if why]
            found = [f for f in found if not _SECONDARY.search(f[1])] or found
            if found:
                reason = f"{found[0][1]} (rank {found[0][0]})"
            else:
                exits = {r: procs[r].poll() for r in bad}
                reason = f"ranks exited without a Python exception: exit codes {exits}"
            log = _tail(logs[found[0][0] if found else bad[0]], 30)
        elif time.monotonic() > deadline:
            reason, log = f"timeout: no progress in {timeout(current):.0f} s", ""
        else:
            time.sleep(0.2)
            continue
        if len(results) == len(cases):  # every case is done: a problem, not a failed case
            progress(f"warning: a rank failed after the last case: {reason}")
            return results, info, None, f"a rank failed after its last case: {reason}"
        progress(f"failed: {short(reason, 160)}")
        return results, info, (reason, log), None


def _tail(path: str, lines: int) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:]).rstrip()


_EXC = re.compile(r"\b([A-Z]\w*(?:Error|Exception|Interrupt))(?:: (.*)|\s*$)")
_SECONDARY = re.compile(r"Connection (reset|closed) by peer|Broken pipe")
_CALLBACK = "Got the following error when running the callback: "
_AT_FRAME = re.compile(r"^\s*(\S+\.py)\((\d+)\): (\S+)")
_FILE_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def failure_reason(log: str) -> str | None:
    """The innermost Python exception in a rank's log, with the frame that raised it.

    Exceptions raised inside ``Future.then`` callbacks arrive wrapped ("Got the following
    error when running the callback: ...") with their frames listed after "At:"; plain
    tracebacks list frames before the exception line. A C++ exception that escaped prints
    "what(): ...". None when the log has no exception.
    """
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", ln) for ln in log.splitlines()]
    what = [ln.split("what():", 1)[1].strip() for ln in lines if "what():" in ln]
    # A callback's Python exception that ended the process as a C++ abort is read as the
    # Python exception it wraps (below); any other abort is reported as itself, with
    # build-machine paths ("/__w/pytorch/.../pair.cc:456") cut to the file.
    if what and _CALLBACK not in what[-1]:
        return "C++ abort: " + re.sub(r"(?:/[^\s/]+)+/([^\s/]+:\d+)", r"\1", what[-1])
    idx = next((i for i in range(len(lines) - 1, -1, -1) if _EXC.search(lines[i])), None)
    if idx is None:
        return None
    exc_type, msg = _EXC.search(lines[idx]).groups()
    while msg and _CALLBACK in msg:
        inner = _EXC.search(msg.split(_CALLBACK, 1)[1])
        if inner is None:
            break
        exc_type, msg = inner.groups()
    frames = [m.groups() for m in map(_AT_FRAME.match, lines[idx + 1 :]) if m]
    frames += [m.groups() for m in map(_FILE_FRAME.search, reversed(lines[:idx])) if m]
    msg = (msg or "").strip().split(". ")[0]  # the first sentence: torch appends advice
    text = f"{exc_type}: {msg}" if msg else exc_type
    if frames:
        path, line, func = frames[0]
        text += f" [{os.path.basename(path)}:{line} {func}]"
    return text


# -- the rank side -----------------------------------------------------------------------

_events: str | None = None  # rank 0's event file (None elsewhere and under torchrun)


def _event(kind: str, **fields) -> None:
    if _events is not None:
        with open(_events, "a") as f:
            f.write(json.dumps({"event": kind, **fields}) + "\n")


def note(label: str) -> None:
    """A progress line from rank 0; also a heartbeat that restarts the watchdog's clock."""
    if _events is not None:
        _event("note", label=label)
    elif under_torchrun() and dist.get_rank() == 0:
        progress(label)


class StepLog:
    """A training case's steps: losses and times, a non-finite loss raised, and a
    progress note (the watchdog's heartbeat) at least every 5 s and at the last step."""

    def __init__(self, method: str, steps: int) -> None:
        self.method, self.steps = method, steps
        self.losses: list[float] = []
        self.times: list[float] = []
        self._noted = time.perf_counter()

    def add(self, i: int, loss: float, seconds: float) -> None:
        self.losses.append(loss)
        self.times.append(seconds)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {i}")
        if time.perf_counter() - self._noted > 5 or i + 1 == self.steps:
            self._noted = time.perf_counter()
            step = f"step {i + 1}/{self.steps}"
            note(f"  {self.method}: {step}, loss {loss:.3f}, {seconds * 1e3:.0f} ms")


def init_group(common: dict) -> torch.device:
    """Joins the default group: NCCL on a GPU when torchrun started this rank, gloo
    otherwise. The group timeout turns a peer that never arrives into an exception."""
    cuda = under_torchrun() and torch.cuda.is_available()
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=float(common["pg_timeout"]))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    if common.get("threads"):
        torch.set_num_threads(int(common["threads"]))
    return device


def tx_bytes(ifname: str | None) -> int | None:
    """Bytes this network namespace has sent through ``ifname`` (None: not tracked).
    Under ``ip netns exec`` the counters are the namespace's own: exactly the rank's
    traffic, or with nodes its node's (``lo``: what stayed inside the node)."""
    if not ifname:
        return None
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                return int(rest.split()[8])
    raise RuntimeError(f"interface {ifname} not found in /proc/self/net/dev")


def _link_check(mib: int, peer: int) -> float:
    """Rank 0 -> rank ``peer`` (1, or the next node's first rank) throughput in MB/s: one
    large send, timed on the receiver, median of three. Shows that the shaping is what was
    asked."""
    rank = dist.get_rank()
    t = torch.ones(mib * 2**20 // 4)
    rates = []
    for _ in range(3):
        dist.barrier()
        op = (lambda: dist.send(t, peer)) if rank == 0 else (lambda: dist.recv(t, 0))
        _, seconds = wall(op if rank in (0, peer) else lambda: None)
        rates.append(t.numel() * 4 / seconds / 1e6)
    median = torch.tensor([sorted(rates)[1]], dtype=torch.float64)
    dist.broadcast(median, peer)
    note(f"link check: {mib} MiB rank 0 -> rank {peer} at {median.item():.1f} MB/s")
    return median.item()


def _destroy_group() -> None:
    # A DDP model's reference cycles keep the gloo group alive past destroy_process_group
    # until a collection; freed at interpreter exit instead, its worker threads can abort
    # the process (pytorch/pytorch#190489).
    gc.collect()
    dist.destroy_process_group()


def _target(name: str):
    module, _, func = name.partition(":")
    return getattr(importlib.import_module(module), func)


def _inline(cases: list[dict], common: dict, env: dict) -> list[dict] | None:
    device = init_group(common)
    rank, world = dist.get_rank(), dist.get_world_size()
    env["link"] = f"torchrun, {dist.get_backend()}, {world} ranks"
    run_case, rows = _target(common["target"]), []
    with tempfile.TemporaryDirectory(prefix="ddpcomm-") as tmp:
        for case in cases:
            note(case["label"])
            try:
                rows.append(run_case(case, dict(common, workdir=tmp), device))
            except Exception:
                reason = failure_reason(traceback.format_exc()) or "unknown error"
                rows.append(dict(case["row"], status="failed", reason=reason))
    _destroy_group()
    return rows if rank == 0 else None


def _main() -> None:
    """A spawned rank: every case in order, results to rank 0's event file."""
    global _events
    with open(os.environ["DDPCOMM_BENCH_CONFIG"]) as f:
        cfg = json.load(f)
    common = cfg["common"]
    run_case = _target(common["target"])
    device = init_group(common)
    _events = cfg["events"] if dist.get_rank() == 0 else None
    per_node, mib = common.get("per_node", 1), int(common.get("link_check_mb", 0))
    # Across the link; with nodes also inside one (the path the node's own steps take).
    peers = [per_node, 1] if per_node > 1 else [1]
    for peer in peers if mib else []:
        rate = _link_check(mib, peer)
        info = {"link_check_MBps": rate, "link_check_MiB": mib, "to_rank": peer}
        _event("info", info=dict(info, inside_node=peer < per_node))
    for i, case in enumerate(cfg["cases"]):
        _event("start", index=i, label=case["label"])
        _event("result", result=run_case(case, common, device))
    dist.barrier()
    _destroy_group()


if __name__ == "__main__":
    # Run the imported module's copy, whose _events the cases' note() calls see.
    from ddpcomm.bench import _ranks

    _ranks._main()
