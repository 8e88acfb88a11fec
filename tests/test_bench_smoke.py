"""Smoke tests of the benchmark suite: `--quick` runs on loopback, byte formulas, link
namespaces (when root), argument errors. They check results, never wall-clock times."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from ddpcomm.bench import collectives, netns, train
from ddpcomm.bench._launch import failure_reason


def _cli(module, argv: list[str]):
    parser = argparse.ArgumentParser()
    module.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_collectives_quick_q8(tmp_path, capsys):
    out = tmp_path / "c.json"
    assert (
        _cli(
            collectives, ["collectives", "--quick", "--methods", "allreduce,q8", "--json", str(out)]
        )
        == 0
    )
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"allreduce", "q8"}
    for r in rows.values():
        assert r["status"] == "ok", r
        assert r["ranks_identical"]
        assert r["median_s"] > 0 and len(r["times_s"]) == 2
    n = rows["q8"]["numel"]
    assert n == 2**20 // 4
    # ddpcomm's own count of bytes handed to collectives equals the table's formula.
    assert rows["q8"]["measured_bytes"] == rows["q8"]["formula_bytes"]
    assert rows["q8"]["formula_bytes"] == (n // 256) * (4 + 256)  # all_gather at N=2
    assert rows["allreduce"]["formula_bytes"] == 4 * n
    # Plain is exact up to fp32 summation order; q8 within a fraction of a percent.
    assert rows["allreduce"]["rel_error"] < 1e-6
    assert 0 < rows["q8"]["rel_error"] < 0.02
    table = capsys.readouterr().out
    assert "q8" in table and "speedup" in table


def test_train_quick_q8(tmp_path):
    out, png = tmp_path / "t.json", tmp_path / "t.png"
    assert (
        _cli(train, ["train", "--quick", "--methods", "q8", "--json", str(out), "--plot", str(png)])
        == 0
    )
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "ok", row
    assert row["replicas_identical"]
    assert len(row["loss"]) == 12 and all(0 < x < 10 for x in row["loss"])
    assert row["bytes_per_step"] > 0 and row["compress_s_per_step"] >= 0
    assert 0 < row["eval_loss"] < 10
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_formula_bytes():
    shapes = collectives.bucket_shapes(3 * 2**20 + 5 * 1024 + 7)
    assert shapes == [(1024, 1024)] * 3 + [(5, 1024), (7,)]
    n = 1024 * 1024
    assert collectives.formula_bytes("allreduce", [(1024, 1024)], 4) == 6 * n  # 2*3/4*4n
    assert collectives.formula_bytes("torch-fp16", [(1024, 1024)], 2) == 2 * n
    assert collectives.formula_bytes("torch-qpt", [(1024, 1024)], 4) == 3 * (n + 8)
    # PowerSGD rank 4 on a 1024x1024 matrix: P and Q, 2048*4 elements, ring at N=2.
    assert collectives.formula_bytes("powersgd-r4", [(1024, 1024)], 2) == 4 * 2048 * 4
    # A 1-D tensor is never compressed by PowerSGD.
    assert collectives.formula_bytes("powersgd-r1", [(1000,)], 2) == 4000
    assert collectives.formula_bytes("bpowersgd-r1", [(1024, 1024)], 2) == 4 * 2 * 1024


def test_failure_reason_parses_callbacks_and_aborts():
    log = textwrap.dedent("""\
        [rank1]: RuntimeError: Got the following error when running the callback: \
IndexError: invalid index of a 0-dim tensor

        At:
          /x/quantization_hooks.py(92): quantize_and_allgather
        """)
    assert failure_reason(log) == (
        "IndexError: invalid index of a 0-dim tensor "
        "[quantization_hooks.py:92 quantize_and_allgather]"
    )
    abort = "terminate called\n  what():  [enforce fail at /__w/gloo/tcp/pair.cc:456] size\n"
    assert failure_reason(abort) == "C++ abort: [enforce fail at pair.cc:456] size"
    assert failure_reason("all fine\n") is None


@pytest.mark.parametrize("bad", ["1gigabit", "fast", "", "-1gbit"])
def test_bad_link_rate_names_the_argument(bad):
    with pytest.raises(ValueError, match="--link"):
        netns.parse_rate(bad)


def test_bad_cli_arguments_are_named(capsys):
    with pytest.raises(SystemExit):
        _cli(collectives, ["collectives", "--methods", "q3"])
    assert "--methods" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--world"):
        _cli(collectives, ["collectives", "--world", "1"])
    with pytest.raises(SystemExit, match="--warmup-steps"):
        _cli(train, ["train", "--steps", "3", "--warmup-steps", "3"])


def test_rates():
    assert netns.parse_rate("1gbit") == 1e9
    assert netns.parse_rate("500mbit") == 5e8
    assert netns.parse_rate("125MBps") == 1e9


needs_root = pytest.mark.skipif(
    netns.unavailable_reason() is not None,
    reason=f"no namespaces here: {netns.unavailable_reason()}",
)


@needs_root
@pytest.mark.parametrize("world", [2, 3])
def test_links_are_created_shaped_and_removed(world):
    with netns.Links(world, "1gbit") as links:
        names = set(netns.list_namespaces())
        assert set(links.namespaces) <= names
        assert (links.hub in names) == (world > 2)
        qdisc = subprocess.run(
            [*links.prefix_command(0), "tc", "qdisc", "show", "dev", links.ifname],
            capture_output=True,
            text=True,
        ).stdout
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc
        if shutil.which("ping"):  # the last rank reaches rank 0 through the link
            ping = subprocess.run(
                [*links.prefix_command(world - 1), "ping", "-c", "1", "-W", "2", links.address(0)],
                capture_output=True,
            )
            assert ping.returncode == 0
    left = set(netns.list_namespaces())
    assert not left & {*links.namespaces, links.hub}


@needs_root
def test_links_removed_on_sigterm_and_stale_ones_reaped():
    code = textwrap.dedent("""\
        import sys, time
        from ddpcomm.bench import netns
        with netns.Links(2, "1gbit") as links:
            print(" ".join(links.namespaces), flush=True)
            time.sleep(60)
        """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    names = proc.stdout.readline().split()
    assert len(names) == 2 and set(names) <= set(netns.list_namespaces())
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert not set(names) & set(netns.list_namespaces())

    # SIGKILL leaves them behind; the next run removes them (their pid is dead).
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    names = proc.stdout.readline().split()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert set(names) <= set(netns.list_namespaces())
    removed = netns.remove_stale()
    assert set(names) <= set(removed)
    assert not set(names) & set(netns.list_namespaces())


def test_collectives_under_torchrun(tmp_path):
    # Under torchrun every rank runs the cases in-process (gloo here, NCCL on GPUs).
    out = tmp_path / "tr.json"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed next to this python")
    proc = subprocess.run(
        [
            torchrun,
            "--nproc_per_node",
            "2",
            "-m",
            "ddpcomm.bench",
            "collectives",
            "--quick",
            "--methods",
            "allreduce,q8",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["allreduce", "q8"]
    assert all(r["status"] == "ok" and r["world"] == 2 and r["ranks_identical"] for r in rows)


def test_open_links_without_root_falls_back_loudly(monkeypatch, capsys):
    monkeypatch.setattr(netns, "unavailable_reason", lambda: "creating namespaces needs root")
    links, note = netns.open_links(2, "1gbit")
    assert links is None and "fallback" in note and "needs root" in note
    assert "falling back to loopback" in capsys.readouterr().err


_FAKE_WORKER = """
import os
import time
import torch.distributed as dist
from ddpcomm.bench import _worker

def run_case(case, common, device):
    if case["kind"] == "hang":
        time.sleep(600)
    if case["kind"] == "raise" and dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()
    return {"kind": case["kind"]}

if __name__ == "__main__":
    _worker.run(run_case)
    if os.environ.get("FAKE_TEARDOWN_FAIL") and os.environ["RANK"] == "1":
        os._exit(3)
"""


@pytest.mark.parametrize(
    "kind, reason",
    [("raise", "ValueError: boom on rank 1"), ("hang", "timeout: no progress in 3 s")],
)
def test_watchdog_turns_failures_into_rows(tmp_path, monkeypatch, kind, reason):
    from ddpcomm.bench._launch import run_group

    (tmp_path / "fake_bench_worker.py").write_text(_FAKE_WORKER)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cases = [{"kind": k, "label": k} for k in ("ok", kind, "after")]
    outcome = run_group("fake_bench_worker", 2, None, cases, {"pg_timeout": 60}, lambda c: 3, 1)
    assert outcome.results == [{"kind": "ok"}]
    assert outcome.failure.case["kind"] == kind
    assert reason in outcome.failure.reason


def test_failure_after_the_last_case_is_reported_not_pinned_on_it(tmp_path, monkeypatch):
    from ddpcomm.bench._launch import run_group

    (tmp_path / "fake_bench_worker.py").write_text(_FAKE_WORKER)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("FAKE_TEARDOWN_FAIL", "1")
    cases = [{"kind": "ok", "label": "ok"}]
    outcome = run_group("fake_bench_worker", 2, None, cases, {"pg_timeout": 60}, lambda c: 30, 1)
    assert outcome.results == [{"kind": "ok"}]
    assert outcome.failure is None
    assert "exit codes {1: 3}" in outcome.teardown_error
