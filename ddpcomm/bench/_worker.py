"""What every benchmark rank does before and after its cases: join the process group,
report link counters, run the cases, leave.

Ranks started by ``_launch.run_group`` find their configuration in the file named by
``DDPCOMM_BENCH_CONFIG`` and their rank in the usual torch.distributed variables.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ddpcomm.bench._launch import EventWriter


def load_config() -> dict:
    path = os.environ.get("DDPCOMM_BENCH_CONFIG")
    if not path:
        raise RuntimeError(
            "DDPCOMM_BENCH_CONFIG is not set: this module is started by "
            "`python -m ddpcomm.bench`, not by hand"
        )
    with open(path) as f:
        return json.load(f)


def init_group(common: dict) -> tuple[int, int, torch.device]:
    """Joins the default group: NCCL on a GPU when launched by torchrun, gloo otherwise.

    The group timeout bounds every collective, so a peer that never arrives turns into
    an exception on this rank (the parent's watchdog is the second line of defence).
    """
    timeout = datetime.timedelta(seconds=float(common["pg_timeout"]))
    use_cuda = common.get("backend") == "nccl"
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    threads = common.get("threads")
    if threads:
        torch.set_num_threads(int(threads))
    return dist.get_rank(), dist.get_world_size(), device


def tx_bytes(ifname: str | None) -> int | None:
    """Bytes this network namespace has sent through ``ifname`` (None: not tracked).

    /proc/self/net/dev shows the counters of the namespace the process runs in, which
    under ``ip netns exec`` is the rank's own: its veth carries exactly its traffic.
    """
    if not ifname:
        return None
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                return int(rest.split()[8])
    raise RuntimeError(f"interface {ifname} not found in /proc/self/net/dev")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def link_check(device: torch.device, mbytes: int, ev: EventWriter) -> float | None:
    """Measured rank 0 -> rank 1 throughput in MB/s (10^6 bytes): one big point-to-point
    send, timed on the receiver, median of three. Checks the shaping is what was asked."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        return None
    t = torch.ones(mbytes * 2**20 // 4, device=device)
    rates = []
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
        sync(device)
        dt = time.perf_counter() - t0
        rates.append(t.numel() * 4 / dt / 1e6 if rank == 1 else 0.0)
    # Rank 1 measured; everyone learns its median.
    med = torch.tensor([sorted(rates)[1]], dtype=torch.float64)
    dist.broadcast(med, 1)
    ev.note(f"link check: {mbytes} MiB rank 0 -> rank 1 at {med.item():.1f} MB/s")
    return med.item()


_events: EventWriter | None = None


def note(label: str) -> None:
    """A progress line from rank 0 (also a heartbeat: the watchdog restarts its clock)."""
    if _events is not None:
        _events.note(label)


def under_torchrun() -> bool:
    """Whether this process is a rank started by torchrun (which then owns the ranks)."""
    return "LOCAL_RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ


def run_inline(cases: list[dict], common: dict, run_case) -> tuple[int, int, list[dict]]:
    """Every torchrun rank runs the cases in-process: NCCL on GPUs, gloo otherwise.

    No watchdog restarts here: torchrun owns the processes. A case that raises becomes a
    failed row on the ranks that saw it (never dropped); a hang ends at the group timeout.
    """
    import traceback

    from ddpcomm.bench._launch import failure_reason, progress

    common = dict(common, backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world, device = init_group(common)
    rows = []
    for case in cases:
        case = dict(case, world=world)
        if rank == 0:
            progress(case["label"])
        try:
            rows.append(run_case(case, common, device))
        except Exception as exc:
            reason = failure_reason(traceback.format_exc()) or f"{type(exc).__name__}: {exc}"
            keep = ("method", "world", "size_mib", "numel", "formula_bytes")
            rows.append(
                {**{k: case[k] for k in keep if k in case}, "status": "failed", "reason": reason}
            )
    return rank, world, rows


def run(run_case: Callable[[dict, dict, torch.device], dict]) -> None:
    """Entry point of a spawned rank: every case in order, results to rank 0's events."""
    cfg = load_config()
    common = cfg["common"]
    rank, world, device = init_group(common)
    global _events
    ev = _events = EventWriter(cfg["events"], rank)
    if common.get("link_check_mb"):
        rate = link_check(device, int(common["link_check_mb"]), ev)
        if rank == 0:
            ev.info({"link_check_MBps": rate, "link_check_MiB": common["link_check_mb"]})
    for i, case in enumerate(cfg["cases"]):
        ev.start(i, case["label"])
        result = run_case(case, common, device)
        ev.result(result)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
