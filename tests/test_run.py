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

from ddpcomm import autohook, compressors

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
    # A job template's option stays under the command line's method; the command line's
    # start_iter replaces the template's.
    env = {autohook.ENV_OPTIONS: "block_size=64", autohook.ENV_START_ITER: "3"}
    command = [sys.executable, "-m", "ddpcomm.run", "--compression", "q4", "--start-iter", "0"]
    res = _run(*command, sys.executable, SCRIPT, _port(), env=env)
    assert res.returncode == 0, res.stderr
    ranks = _ranks(res.stdout)
    assert sorted(ranks) == [0, 1] and {h for h, _ in ranks.values()} == {"compress_hook"}
    assert ranks == _by_hand("q4,block_size=64")
    assert ranks != _by_hand("q4")  # the option reached the ranks
    startup = (
        "ddpcomm.run: q4,block_size=64,start_iter=0 (method from --compression q4, "
        "block_size from DDPCOMM_OPTIONS=block_size=64, start_iter from --start-iter 0 over "
        "DDPCOMM_START_ITER=3)"
    )
    assert res.stderr.splitlines()[0] == startup, res.stderr
    summary = [line for line in res.stderr.splitlines() if line.startswith("ddpcomm:")]
    assert len(summary) == 1, res.stderr
    assert summary[0].startswith(
        "ddpcomm: q4,block_size=64,start_iter=0: 6 buckets compressed, 0 plain"
    )
    assert "no DistributedDataParallel" not in res.stderr


def test_summary_says_a_run_ended_in_the_warm_up():
    # top-k starts with 200 plain steps by default; the script runs 6.
    command = [sys.executable, "-m", "ddpcomm.run", "--compression", "topk:0.01"]
    res = _run(*command, sys.executable, SCRIPT, _port())
    assert res.returncode == 0, res.stderr
    summary = [line for line in res.stderr.splitlines() if line.startswith("ddpcomm:")]
    assert len(summary) == 1 and summary[0].startswith(
        "ddpcomm: topk:0.01 (by default start_iter=200, ramp=200): 0 buckets compressed "
        "(still in start_iter's plain warm-up: 6 of 200 steps), 6 plain; "
    ), res.stderr


def test_summary_says_every_bucket_was_below_min_numel():
    import ddpcomm

    state = ddpcomm.CompressionState("q8", min_numel=10**6)
    state.iteration = 3
    line = autohook.summary_line([state], "q8,min_numel=1000000")
    assert "0 buckets compressed (every bucket was below min_numel=1000000), 0 plain" in line


def test_a_command_that_builds_no_ddp_model_is_told():
    res = _run(sys.executable, "-m", "ddpcomm.run", "--compression", "q8", sys.executable, "-c", "")
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[1:] == [
        "ddpcomm.run: no DistributedDataParallel model was built in any process "
        f"{sys.executable!r} started, so nothing was compressed (accelerate, for one, builds "
        "none on a machine without a GPU unless given --cpu or ACCELERATE_USE_CPU=1)"
    ]
    # The command's exit status is the launcher's; a failed command gets no such line.
    res = _run(sys.executable, "-m", "ddpcomm.run", "--compression", "q8", "sh", "-c", "exit 3")
    assert res.returncode == 3 and "no DistributedDataParallel" not in res.stderr, res.stderr


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
    # The configuration, with the ramp topk:0.05 takes by default.
    assert summary[0].startswith("ddpcomm: topk:0.05,start_iter=2 (by default ramp=200): ")


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
    "args, env, message",
    [
        (["--compression", "q5"], {}, "unknown compression spec 'q5'"),
        ([], {}, "no compression method: give --compression or set DDPCOMM_COMPRESSION"),
        (
            ["--compression", "q8", "--option", "compression=q4"],
            {},
            "--option compression=q4: the method is not an option; give it with "
            "--compression (it is given by --compression q8)",
        ),
        (
            [],
            {autohook.ENV_COMPRESSION: "q8,start_iter=5", autohook.ENV_START_ITER: "7"},
            "start_iter is given twice in the environment, with different values: "
            "DDPCOMM_COMPRESSION=q8,start_iter=5 and DDPCOMM_START_ITER=7",
        ),
    ],
)
def test_bad_options_fail_before_the_command_runs(tmp_path, args, env, message):
    marker = tmp_path / "ran"
    res = _run(sys.executable, "-m", "ddpcomm.run", *args, "touch", str(marker), env=env)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert not marker.exists()


def _resolve(args: list[str], env: dict) -> tuple[dict, str]:
    """(the command's DDPCOMM_ variables, the resolved spec) of ``python -m ddpcomm.run
    ARGS true`` in the environment ``env``."""
    from ddpcomm import run

    child, resolved = run.environment(run.build_parser().parse_args([*args, "true"]), env)
    return {k: v for k, v in child.items() if k.startswith("DDPCOMM_")}, resolved.spec


@pytest.mark.parametrize(
    "args, env, exc, message",
    [
        (
            ["--compression", "q8", "--option", "block_size=100"],
            {},
            ValueError,
            "block_size must be a power of two in [32, 65536], got 100 (in "
            "'q8,block_size=100': method from --compression q8, block_size from --option "
            "block_size=100)",
        ),
        (
            ["--compression", "q8", "--start-iter", "1.5"],
            {},
            TypeError,
            "start_iter must be an int, got 1.5 (in 'q8,start_iter=1.5'",
        ),
        (["--compression", "q8", "--start-iter", "-1"], {}, ValueError, "start_iter must be >= 0"),
        # The command line contradicts itself: an error naming both places.
        (
            ["--compression", "q8", "--option", "start_iter=5", "--start-iter", "7"],
            {},
            ValueError,
            "start_iter is given twice on the command line, with different values: "
            "--option start_iter=5 and --start-iter 7; give it once",
        ),
        (
            ["--compression", "q8,block_size=64", "--option", "block_size=128"],
            {},
            ValueError,
            "block_size is given twice on the command line, with different values: "
            "--compression q8,block_size=64 and --option block_size=128",
        ),
        (
            ["--compression", "q8", "--option", "seed=1", "--option", "seed=2"],
            {},
            ValueError,
            "seed is given twice on the command line, with different values: "
            "--option seed=1 and --option seed=2",
        ),
        (
            ["--compression", "q8"],
            {autohook.ENV_OPTIONS: "compression=q4"},
            ValueError,
            "DDPCOMM_OPTIONS=compression=q4: the method is not an option; give it with "
            "DDPCOMM_COMPRESSION",
        ),
        # The spec's message for an unknown option, naming where it was written.
        (
            ["--compression", "q8", "--option", "blocksize=128"],
            {},
            compressors.UnknownOptionError,
            "--option blocksize=128 (method from --compression q8): unknown option "
            "'blocksize' for 'q8'; Quantizer takes block_size, stochastic, error_feedback, "
            "algorithm, seed, normalize; the hook states take start_iter",
        ),
        (
            ["--compression", "q8", "--option", "blocksize"],
            {},
            ValueError,
            "unknown option 'blocksize' for 'q8'",
        ),
        (
            ["--compression", "q8", "--option", "process_group=x"],
            {},
            ValueError,
            "unknown option 'process_group' for 'q8'",
        ),
        # An environment option the command line's method does not take is not dropped.
        (
            ["--compression", "topk:0.01"],
            {autohook.ENV_OPTIONS: "block_size=64"},
            ValueError,
            "DDPCOMM_OPTIONS=block_size=64 (method from --compression topk:0.01): unknown "
            "option 'block_size' for 'topk:0.01'; TopK takes approximate",
        ),
        (
            ["--compression", "fp16", "--option", "seed=1"],
            {},
            ValueError,
            "unknown option 'seed' for 'fp16'; it takes no options",
        ),
        (
            ["--compression", "q8,ramp=5"],
            {},
            ValueError,
            "ramp needs a method with a milder stage to step through",
        ),
        (
            ["--compression", "q4", "--start-iter", "5,ramp=3"],
            {},
            ValueError,
            "--start-iter 5,ramp=3: expected one value for start_iter, got '5,ramp=3'",
        ),
        (["--compression", "q8", "--option", ""], {}, ValueError, "--option : malformed option ''"),
    ],
)
def test_bad_settings_name_where_they_were_given(args, env, exc, message):
    with pytest.raises(exc) as info:
        _resolve(args, env)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "args, env, spec",
    [
        # Per option: a template's block_size stays; the command line's method wins.
        (["--compression", "q4"], {"DDPCOMM_OPTIONS": "block_size=64"}, "q4,block_size=64"),
        (
            ["--option", "block_size=128"],
            {"DDPCOMM_COMPRESSION": "q8", "DDPCOMM_OPTIONS": "block_size=64,seed=2"},
            "q8,block_size=128,seed=2",
        ),
        (
            ["--compression", "q2", "--start-iter", "3"],
            {"DDPCOMM_COMPRESSION": "q8,block_size=64", "DDPCOMM_START_ITER": "7"},
            "q2,block_size=64,start_iter=3",
        ),
        # One value parser: the spec's (case-insensitive strings, dtype names, bare flags).
        (
            ["--compression", "q8", "--option", "algorithm=ALL_GATHER,error_feedback"],
            {},
            "q8,algorithm=all_gather,error_feedback=true",
        ),
        (["--option", "value_dtype=float16"], {"DDPCOMM_COMPRESSION": "topk:0.1"}, None),
        # The same value twice is no contradiction; empty variables count as unset.
        (
            ["--compression", "q8,start_iter=5", "--start-iter", "5"],
            {"DDPCOMM_OPTIONS": "", "DDPCOMM_MIN_NUMEL": " "},
            "q8,start_iter=5",
        ),
    ],
)
def test_command_line_over_environment_per_setting(args, env, spec):
    import torch

    import ddpcomm

    child, resolved = _resolve(args, {**env, "PATH": "/bin"})
    if spec is None:
        assert ddpcomm.CompressionState(resolved).compressor.value_dtype == torch.float16
    else:
        assert resolved == spec
    # The command gets the resolved spec alone, and reads back the same configuration.
    assert child == {autohook.ENV_COMPRESSION: resolved}
    assert autohook.config_from_env(child) == {"compression": resolved}


def test_environment_alone():
    env = {autohook.ENV_COMPRESSION: "Q4 ,Seed=3", autohook.ENV_MIN_NUMEL: "10"}
    assert autohook.config_from_env(env) == {"compression": "q4,seed=3,min_numel=10"}
    with pytest.raises(ValueError, match="DDPCOMM_COMPRESSION is not set"):
        autohook.config_from_env({autohook.ENV_OPTIONS: "seed=3"})
    twice = {autohook.ENV_COMPRESSION: "q8", autohook.ENV_OPTIONS: "seed=3,seed=4"}
    with pytest.raises(ValueError, match="DDPCOMM_OPTIONS=seed=3,seed=4 gives option 'seed' twice"):
        autohook.config_from_env(twice)
