"""``make gpu-check`` (.ci/gpu_check.py): runs here and skips what needs a GPU; on a GPU
machine (faked here) it runs every step and writes the report with the targets judged."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, ".ci", "gpu_check.py")


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_every_gpu_step_is_skipped():
    done = subprocess.run(
        [sys.executable, SCRIPT, "--only", "tests,sanitize,bench"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if "skipped: no GPU" in line]
    assert len(lines) == 6, done.stdout
    assert "build in place                     not run (--only)" in done.stdout
    assert "report:" not in done.stdout  # no report without a GPU


@pytest.mark.parametrize("pct, speedup, verdict", [(95.0, 12.0, "met"), (60.0, 3.0, "MISSED")])
def test_on_a_gpu_every_step_runs_and_the_report_judges_the_targets(
    tmp_path, monkeypatch, pct, speedup, verdict
):
    gpu_check = _module()
    card = {"torch": "2.11", "cuda": "13.0", "gpu": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(gpu_check, "probe", lambda: {**card, "capability": "9.0", "memory_gb": 79})
    commands = []

    def run(step, cmd, timeout, env=None):
        commands.append((step.name, cmd, env))
        if "--out" in cmd:  # the bench: a result as it would write one
            rows = [
                {"op": op, "size_mb": 256, "gbps": 1.0, "pct_of_copy": pct, "speedup_vs_torch": x}
                for op, x in (("quantize:q8", None), ("topk_approx:0.01", speedup))
            ]
            with open(cmd[cmd.index("--out") + 1], "w") as f:
                json.dump({"rows": rows}, f)
        step.outcome = "pass"
        return True

    monkeypatch.setattr(gpu_check.Step, "run", run)
    out = tmp_path / "report.txt"
    assert gpu_check.main(["--out", str(out), "--only", "build"]) == 0
    assert "not run (--only)" in out.read_text()
    # A later call runs the rest; the report keeps the build's outcome from the first.
    assert gpu_check.main(["--out", str(out), "--only", "tests,sanitize,bench"]) == 0
    report = out.read_text()
    assert "not run" not in report
    assert "card: NVIDIA H100 80GB HBM3 (sm 9.0" in report
    assert report.count(" pass ") == 7
    assert f">= 90% of copy: {verdict}" in report and f">= 10x torch.topk: {verdict}" in report
    by_step = {name: (cmd, env) for name, cmd, env in commands}
    assert by_step["build in place"][1]["TORCH_CUDA_ARCH_LIST"] == "9.0"
    op_tests, op_env = by_step["CUDA op tests"]
    others = by_step["CUDA hook and group tests"][0]
    assert "-k" in op_tests and "cuda" in op_tests and "tests/test_ops_quantize.py" in op_tests
    assert "tests/test_collectives.py" in others and "tests/test_ops_quantize.py" not in others
    assert op_env["OMP_NUM_THREADS"] == "1"  # a dozen processes on the cores, one thread each
    for tool in ("memcheck", "racecheck", "synccheck"):
        cmd = by_step[f"compute-sanitizer {tool}"][0]
        assert cmd[:3] == ["compute-sanitizer", "--tool", tool]
        assert "tests/test_ops_sparse.py" in cmd and "tests/test_ops_quantize.py" in cmd
        assert cmd[cmd.index("-k") + 1] == gpu_check.SANITIZE_K[tool]
    bench = by_step["kernels bench"][0]
    assert "--device" in bench and "cuda" in bench and "64,256" in bench


def test_a_step_failed_earlier_is_reported_but_does_not_fail_a_later_run(tmp_path, monkeypatch):
    gpu_check = _module()
    card = {"torch": "2.11", "cuda": "13.0", "gpu": "NVIDIA H100 80GB HBM3"}
    monkeypatch.setattr(gpu_check, "probe", lambda: {**card, "capability": "9.0", "memory_gb": 79})

    def run(step, cmd, timeout, env=None):
        ok = step.name != "compute-sanitizer racecheck"
        step.outcome = "pass" if ok else "FAIL (exit 1)"
        return ok

    monkeypatch.setattr(gpu_check.Step, "run", run)
    out = tmp_path / "report.txt"
    assert gpu_check.main(["--out", str(out), "--only", "sanitize"]) == 1
    assert gpu_check.main(["--out", str(out), "--only", "build"]) == 0
    (line,) = [x for x in out.read_text().splitlines() if x.startswith("compute-sanitizer race")]
    assert "FAIL (exit 1)" in line
