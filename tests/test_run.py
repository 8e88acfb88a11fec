"""``python -m ddpcomm.run``: an ordinary DDP script that never imports ddpcomm gets the
hook under mp.spawn and torchrun, with the same results as registering it by hand."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from ddpcomm import autohook

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "plain_ddp.py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _run(*command: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("DDPCOMM_")}
    full.update(env or {})
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, full.get("PYTHONPATH")]))
    return subprocess.run(command, env=full, capture_output=True, text=True, timeout=180)


def _ranks(out: str) -> dict[int, tuple[str, str]]:
    # Ranks print concurrently, so lines may run together: fixed-width fields.
    found = re.findall(r"rank (\d) hook=(\w+) params=(\w{16})", out)
    return {int(r): (hook, digest) for r, hook, digest in found}


def _by_hand(spec: str) -> dict:
    res = _run(sys.executable, SCRIPT, _port(), env={"DDPCOMM_BY_HAND": "1", "HAND_SPEC": spec})
    assert res.returncode == 0, res.stderr
    return _ranks(res.stdout)


def test_mp_spawn_script_gets_the_hook():
    res = _run(
        sys.executable, "-m", "ddpcomm.run", "--compression", "q4", sys.executable, SCRIPT, _port()
    )
    assert res.returncode == 0, res.stderr
    ranks = _ranks(res.stdout)
    assert sorted(ranks) == [0, 1] and {h for h, _ in ranks.values()} == {"compress_hook"}
    assert ranks == _by_hand("q4")
    summary = [line for line in res.stderr.splitlines() if line.startswith("ddpcomm:")]
    assert len(summary) == 1 and summary[0].startswith("ddpcomm: q4: 6 buckets compressed, 0 plain")


@pytest.mark.skipif(
    shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None, reason="no torchrun"
)
def test_torchrun_from_the_environment():
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [torchrun, "--standalone", "--nproc-per-node", "2", SCRIPT]
    env = {autohook.ENV_COMPRESSION: "topk:0.05", autohook.ENV_START_ITER: "2"}
    res = _run(sys.executable, "-m", "ddpcomm.run", *command, env=env)
    assert res.returncode == 0, res.stderr
    ranks = _ranks(res.stdout)
    assert {h for h, _ in ranks.values()} == {"compress_hook"} and sorted(ranks) == [0, 1]
    summary = [line for line in res.stderr.splitlines() if line.startswith("ddpcomm:")]
    assert len(summary) == 1 and "4 buckets compressed, 2 plain" in summary[0], res.stderr


def test_script_with_its_own_hook_keeps_it_with_a_warning():
    res = _run(
        sys.executable,
        "-m",
        "ddpcomm.run",
        "--compression",
        "q8",
        sys.executable,
        SCRIPT,
        _port(),
        env={"OWN_HOOK": "1"},
    )
    assert res.returncode == 0, res.stderr
    assert {h for h, _ in _ranks(res.stdout).values()} == {"allreduce_hook"}
    assert "the script registers its own comm hook (allreduce_hook)" in res.stderr
    assert "ddpcomm:" not in res.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compression", "q5"], "unknown compression spec 'q5'"),
        (
            ["--compression", "q8", "--option", "block_size=100"],
            "block_size must be a power of two",
        ),
        (["--compression", "q8", "--option", "blocksize"], "expected name=value"),
        (["--compression", "q8", "--start-iter", "-1"], "start_iter must be >= 0"),
        ([], "DDPCOMM_COMPRESSION is not set"),
    ],
)
def test_bad_options_fail_before_the_command_runs(tmp_path, args, message):
    marker = tmp_path / "ran"
    res = _run(sys.executable, "-m", "ddpcomm.run", *args, "touch", str(marker))
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not marker.exists()


def test_option_values():
    import torch

    got = autohook.parse_options("block_size=128, error_feedback=true,value_dtype=float16,x=1.5")
    assert got == {
        "block_size": 128,
        "error_feedback": True,
        "value_dtype": torch.float16,
        "x": 1.5,
    }
    assert autohook.config_from_env(
        {autohook.ENV_COMPRESSION: "q4", autohook.ENV_MIN_NUMEL: "10"}
    ) == {
        "compression": "q4",
        "min_numel": 10,
    }
