"""``make gpu-check``: everything a machine with a GPU can prove, in one command, one report.

Uses the interpreter it runs under (the machine's own python3: no venv, no installs), builds
ddpcomm in place for the card it finds, then runs, each step with a deadline:

- the CUDA tests, in parallel where pytest-xdist is installed (every ``cuda`` case): the op
  tests (against the CPU bit for bit) spread test by test, the rest (the 1-rank NCCL hooks
  and collectives, the gloo-with-CUDA multi-rank groups, delayed streams) file by file, as
  their module fixtures start rank groups once per file; every pytest process and sanitizer
  runs its CPU ops on one thread, so a dozen of them do not oversubscribe the cores;
- compute-sanitizer memcheck, racecheck and synccheck over the CUDA op tests that run every
  kernel (``SANITIZE_K``: the top-k split and radix-select sizes among them), each over the
  3 pytest workers it follows;
- ``python -m ddpcomm.bench kernels --device cuda`` at 64 and 256 MB, last and alone.

It writes ``benchmarks/results/gpu/<card>.txt``: pass/fail per step, then GB/s and % of a
device-to-device copy per op, with the targets (and ``<card>.txt.json``, the same as
data). ``--only`` runs some steps and keeps the others' last outcomes, for sessions whose
commands are limited to 10 minutes (each step fits in 9). Without a GPU (or without torch) every
step that needs one reports ``skipped: no GPU`` and no report file is written; the exit
status is non-zero only when a step that ran failed.

    python3 .ci/gpu_check.py                        # or: make gpu-check
    python3 .ci/gpu_check.py --only build           # then --only tests,sanitize, --only bench
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
OP_TESTS = [
    "tests/test_ops_sparse.py",
    "tests/test_ops_quantize.py",
    "tests/test_ops_ternary.py",
    "tests/test_ops_flatten.py",
]
SANITIZERS = ("memcheck", "racecheck", "synccheck")
# What each sanitizer runs: every kernel at least once, the top-k split (>= 16384) and
# radix-select sizes among them (each 1M-element case takes seconds under a sanitizer, so
# all 494 op tests would not fit a lease). racecheck, slowest by far, gets the kernels
# that share memory within a block: the top-k select and the block-scaled quantizers.
KERNEL_CASES = (
    "paths or topk_matches_reference or topk_when_the_sample_misses or randk_matches"
    " or randk_strata_match or sparse_accumulate_matches or flatten_matches"
    " or unflatten_into_matches or block_sizes_and_gradient or sum_requantize_and_arbitrary"
)
SANITIZE_K = {
    "memcheck": f"cuda and ({KERNEL_CASES})",
    "synccheck": f"cuda and ({KERNEL_CASES})",
    "racecheck": "cuda and (topk_matches_reference or topk_when_the_sample_misses"
    " or dequantize_sum_requantize_paths or block_sizes_and_gradient)",
}
# Targets (issue: the CUDA path): fraction of a device copy at 256 MB; top-k against torch.
COPY_TARGET = {"quantize:q8": 0.9, "quantize:q4": 0.9, "dequantize_sum:q8": 0.9}
COPY_TARGET["dequantize_sum:q4"] = 0.9
TOPK_TARGET = ("topk_approx:0.01", 10.0)


SUMMARY = re.compile(r"\d+ (passed|failed|error)|ERROR SUMMARY|RACECHECK SUMMARY")


class Step:
    """One line of the report: a name, an outcome, seconds, and what it printed last."""

    logs: str | None = None  # a folder for every step's whole output (--logs)
    cap: float | None = None  # the most seconds any step may take (--step-timeout)

    def __init__(self, name: str) -> None:
        self.name, self.outcome, self.seconds, self.tail = name, "skipped: no GPU", 0.0, ""
        self.summary = ""  # pytest's counts and the sanitizer's summary, or the last line

    def run(self, cmd: list[str], timeout: float, env: dict | None = None) -> bool:
        t0 = time.monotonic()
        timeout = min(timeout, Step.cap or timeout)
        try:
            done = subprocess.run(
                cmd,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            output, ok = done.stdout + done.stderr, done.returncode == 0
            self.outcome = "pass" if ok else f"FAIL (exit {done.returncode})"
        except subprocess.TimeoutExpired as exc:
            output, ok = (exc.stdout or b"").decode(errors="replace"), False
            self.outcome = f"FAIL (over {timeout:.0f} s)"
        self.seconds = time.monotonic() - t0
        if Step.logs:
            with open(os.path.join(Step.logs, re.sub(r"\W+", "_", self.name) + ".log"), "w") as f:
                f.write(" ".join(cmd) + "\n" + output)
        lines = output.strip().splitlines()
        self.tail = "\n".join(lines[-15:])
        counts = [line.strip("= ") for line in lines if SUMMARY.search(line)]
        self.summary = "; ".join(counts[-2:]) or (lines[-1].strip("= ") if lines else "")
        return ok

    def line(self) -> str:
        return f"{self.name:<34} {self.outcome:<22} {self.seconds:7.1f} s  {self.summary}"


def probe() -> dict:
    """What this interpreter's torch sees, without importing ddpcomm."""
    code = (
        "import json, torch\n"
        "d = {'torch': torch.__version__, 'cuda': torch.version.cuda, 'gpu': None}\n"
        "if torch.cuda.is_available():\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    d.update(gpu=p.name, capability=f'{p.major}.{p.minor}',\n"
        "             memory_gb=p.total_memory / 2**30)\n"
        "print(json.dumps(d))\n"
    )
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        return {"torch": None, "gpu": None, "why": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout)


def has(module: str) -> bool:
    return subprocess.run([PY, "-c", f"import {module}"], capture_output=True).returncode == 0


def pytest(files: list[str], workers: int = 0, dist: str = "load", k: str = "cuda") -> list[str]:
    """pytest over the CUDA cases, each test's outcome on its own line (a step cut off at
    its deadline still names what failed); a test that hangs fails alone where
    pytest-timeout is installed, instead of taking its step's whole deadline."""
    cmd = [PY, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-k", k, *files]
    cmd += ["--timeout", "300"] if has("pytest_timeout") else []
    return cmd + (["-n", str(workers), "--dist", dist] if workers and has("xdist") else [])


def other_tests() -> list[str]:
    names = sorted(os.listdir(os.path.join(ROOT, "tests")))
    files = [f"tests/{n}" for n in names if n.startswith("test_") and n.endswith(".py")]
    return [f for f in files if f not in OP_TESTS]


def kernels_table(path: str) -> list[str]:
    """The bench's rows at 256 MB (and 64), as % of a device copy, with the targets."""
    rows = json.load(open(path))["rows"]
    lines = [f"{'op':<26}{'MB':>6}{'GB/s':>9}{'% of copy':>11}{'x torch':>9}  target"]
    for r in rows:
        target = ""
        if r["op"] in COPY_TARGET and r["size_mb"] == 256:
            want = COPY_TARGET[r["op"]]
            met = r["pct_of_copy"] >= 100 * want
            target = f">= {100 * want:.0f}% of copy: {'met' if met else 'MISSED'}"
        if r["op"] == TOPK_TARGET[0] and r.get("speedup_vs_torch"):
            met = r["speedup_vs_torch"] >= TOPK_TARGET[1]
            target = f">= {TOPK_TARGET[1]:g}x torch.topk: {'met' if met else 'MISSED'}"
        torch_x = r.get("speedup_vs_torch")
        lines.append(
            f"{r['op']:<26}{r['size_mb']:>6}{r['gbps']:>9.1f}{r['pct_of_copy']:>10.0f}%"
            f"{torch_x if torch_x is None else round(torch_x, 1)!s:>9}  {target}"
        )
    return lines


STEPS = ("build", "tests", "sanitize", "bench")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="report path (default benchmarks/results/gpu/<card>.txt)")
    parser.add_argument(
        "--only",
        default=",".join(STEPS),
        help="comma-separated steps to run, of build, tests, sanitize, bench (default all); "
        "the others keep their last outcome in the report, so a session whose commands are "
        "limited to 10 minutes can run them in turn",
    )
    parser.add_argument("--step-timeout", type=float, help="cap every step's deadline (seconds)")
    parser.add_argument("--logs", help="write each step's whole output to this folder")
    parser.add_argument("--bench-sizes", default="64,256", help="MB the bench times (64,256)")
    args = parser.parse_args(argv)
    Step.cap, Step.logs = args.step_timeout, args.logs
    if args.logs:
        os.makedirs(args.logs, exist_ok=True)
    only = set(args.only.split(","))
    if not only <= set(STEPS):
        parser.error(f"--only takes {', '.join(STEPS)}; got {args.only!r}")

    info = probe()
    gpu = info.get("gpu")
    steps = {
        "build": [Step("build in place")],
        "tests": [Step("CUDA op tests"), Step("CUDA hook and group tests")],
        "sanitize": [Step(f"compute-sanitizer {tool}") for tool in SANITIZERS],
        "bench": [Step("kernels bench")],
    }
    (build,), (bench,) = steps["build"], steps["bench"]
    table: list[str] | None = None
    build_cmd = [PY, "setup.py", "-q", "build_ext", "--inplace"]
    if info.get("torch") is None:
        for step in sum(steps.values(), []):
            step.outcome = "skipped: no torch"
    elif gpu is None:
        # Without a GPU the build is still worth checking: the CPU ops, as CI builds them.
        if "build" in only:
            build.run(build_cmd, 540)
    else:
        if "build" in only:
            env = {"TORCH_CUDA_ARCH_LIST": info["capability"], "MAX_JOBS": str(os.cpu_count())}
            build.run(build_cmd, 540, env)
        if build.outcome.startswith("FAIL"):
            for step in sum(list(steps.values())[1:], []):
                step.outcome = "skipped: build failed"
        else:
            with concurrent.futures.ThreadPoolExecutor(5) as pool:
                jobs = []
                one_thread = {"OMP_NUM_THREADS": "1"}
                ops_step, others_step = steps["tests"]
                if "tests" in only:
                    for step, cmd in (
                        (ops_step, pytest(OP_TESTS, 8, "load")),
                        (others_step, pytest(other_tests(), 4, "loadfile")),
                    ):
                        jobs.append(pool.submit(step.run, cmd, 540, one_thread))
                for tool, step in zip(SANITIZERS, steps["sanitize"], strict=True):
                    if "sanitize" in only:
                        cmd = ["compute-sanitizer", "--tool", tool, "--target-processes", "all"]
                        cmd += ["--error-exitcode", "1"]
                        cmd += pytest(OP_TESTS, 3, "load", SANITIZE_K[tool])
                        jobs.append(pool.submit(step.run, cmd, 540, one_thread))
                for job in jobs:
                    job.result()
            if "bench" in only:  # alone, after the rest: the GPU and its memory are the bench's
                with tempfile.TemporaryDirectory() as tmp:
                    out = os.path.join(tmp, "kernels.json")
                    cmd = [PY, "-m", "ddpcomm.bench", "kernels", "--device", "cuda", "--ops", "all"]
                    bench.run(cmd + ["--sizes", args.bench_sizes, "--out", out], 300)
                    table = kernels_table(out) if os.path.exists(out) else []
    for name, group in steps.items():
        if name not in only and info.get("torch") is not None:
            for step in group:
                step.outcome = "not run (--only)"
    record = {s.name: vars(s) for s in sum(steps.values(), []) if s.outcome != "not run (--only)"}

    path = None
    if gpu is not None:
        card = re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-").lower()
        path = args.out or os.path.join(ROOT, "benchmarks", "results", "gpu", f"{card}.txt")
        previous = {}
        if os.path.exists(path + ".json"):  # the steps of earlier --only runs on this card
            with open(path + ".json") as f:
                previous = json.load(f)
        names = {s.name for s in sum(steps.values(), [])}  # a renamed step's record is dropped
        kept = {k: v for k, v in previous.get("steps", {}).items() if k in names}
        record = {**kept, **record}
        table = previous.get("table", []) if table is None else table
        for step in sum(steps.values(), []):
            if step.name in record:
                vars(step).update(record[step.name])
    lines = [
        f"ddpcomm GPU check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"card: {gpu or 'none'}"
        + (f" (sm {info['capability']}, {info['memory_gb']:.0f} GiB)" if gpu else ""),
        f"torch {info.get('torch')} (CUDA {info.get('cuda')}), python {sys.version.split()[0]}",
        "",
        *[s.line() for s in sum(steps.values(), [])],
    ]
    failures = [s for s in sum(steps.values(), []) if s.outcome.startswith("FAIL")]
    for s in failures:
        lines += ["", f"--- {s.name}: last lines", s.tail]
    if table:
        lines += ["", "kernels (GB/s of bytes read and written; % of a device-to-device copy)"]
        lines += table
    report = "\n".join(lines) + "\n"
    print(report, end="")
    if path is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(report)
        with open(path + ".json", "w") as f:
            json.dump({"steps": record, "table": table}, f, indent=1)
        print(f"report: {os.path.relpath(path, ROOT)}")
    # The exit status is this run's: steps kept from earlier runs do not fail it.
    ran = [s for s in failures if any(s in steps[name] for name in only)]
    return 1 if ran else 0


if __name__ == "__main__":
    sys.exit(main())
