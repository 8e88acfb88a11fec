"""Smoke tests of the benchmark CLI as a user runs it: ``python -m ddpcomm.bench <command>
--quick`` in a subprocess, on loopback, from an empty working directory. They check what
each command prints and writes, never wall-clock times."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import ddpcomm
from ddpcomm.bench import _ranks

# The ddpcomm these tests imported, whatever the subprocess's working directory.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ddpcomm.__file__)))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
COMMANDS = ["demo", "kernels", "sparse", "coalesced", "collectives", "train", "fsdp"]


@pytest.fixture
def cwd(tmp_path):
    """An empty working directory; each test checks that it stays empty."""
    path = tmp_path / "cwd"
    path.mkdir()
    return path


def bench(cwd, *argv: str, timeout: float = 180) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "ddpcomm.bench", *argv],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not os.listdir(cwd), f"written to the working directory: {os.listdir(cwd)}"
    return proc


# Runs several command lines in one interpreter (runpy is what `python -m` does), for
# the checks that need no ranks: one torch import instead of one per command line.
_BATCH = """
import contextlib, io, json, runpy, sys
results = []
for argv in json.loads(sys.argv[1]):
    sys.argv, out, err = ["python -m ddpcomm.bench", *argv], io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_module("ddpcomm.bench", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
            print(exc.code if isinstance(exc.code, str) else "", file=err)
    results.append((code, out.getvalue(), err.getvalue()))
print(json.dumps(results))
"""


def batch(cwd, *argvs: list[str]) -> list[tuple[int, str, str]]:
    proc = subprocess.run(
        [sys.executable, "-c", _BATCH, json.dumps(argvs)],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_help_is_written_for_users(cwd):
    results = batch(cwd, ["--help"], *[[c, "--help"] for c in COMMANDS])
    for (code, out, _), argv in zip(results, [["--help"], *COMMANDS], strict=True):
        assert code == 0, argv
        assert "``" not in out and "ddpcomm/bench" not in out, out  # no docstring markup
        assert all(line == line.rstrip() for line in out.splitlines())
    top = results[0][1]
    assert all(f"    {c}" in top for c in COMMANDS) and "--quick" in top
    for _, out, _ in results[1:]:
        assert "--quick" in out and "--out" in out


def test_bad_arguments_name_the_argument(cwd):
    results = batch(
        cwd,
        ["collectives", "--methods", "q3"],
        ["collectives", "--world", "1"],
        ["collectives", "--link", "fast"],
        ["collectives", "--nodes", "1"],
        ["train", "--steps", "3", "--warmup-steps", "3"],
        ["kernels", "--ops", "quantize:q3"],
        ["fsdp", "--train-methods", "allreduce"],
        ["train", "--exact-params", "("],
        ["train", "--exact-params", "no_such_parameter"],
    )
    args = [
        "--methods",
        "--world",
        "--link",
        "--nodes",
        "--warmup-steps",
        "--ops",
        "--train-methods",
        "--exact-params",
        "--exact-params",
    ]
    for (code, _, err), arg in zip(results, args, strict=True):
        assert code != 0 and arg in err, err


def test_collectives_quick(cwd, tmp_path):
    out = tmp_path / "c.json"
    methods = "allreduce,q8,q8,adaptive"  # the flag joins the method before it
    proc = bench(cwd, "collectives", "--quick", "--methods", methods, "--out", str(out))
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"allreduce", "q8", "q8,adaptive"}
    for r in rows.values():
        assert r["status"] == "ok" and r["ranks_identical"], r
        assert r["median_s"] > 0 and len(r["times_s"]) == 2
    # The adaptive row timed plain and q8 in turn with it.
    assert rows["q8,adaptive"]["plain_s"] > 0 and rows["q8,adaptive"]["fixed_s"] > 0
    n = rows["q8"]["numel"]
    assert n == 2**20 // 4
    # ddpcomm's own count of bytes handed to collectives equals the table's formula.
    assert rows["q8"]["measured_bytes"] == rows["q8"]["formula_bytes"] == (n // 256) * (4 + 256)
    assert rows["allreduce"]["formula_bytes"] == 4 * n  # 2(N-1)/N * 4n at N = 2
    assert rows["allreduce"]["rel_error"] < 1e-6 and 0 < rows["q8"]["rel_error"] < 0.02
    assert "speedup vs allreduce" in proc.stdout and "limit from bytes" in proc.stdout
    # Beside each time: its bytes on plain collectives, and its codec alone (plain: none).
    assert all(r["wire_s"] > 0 for r in rows.values())
    assert rows["allreduce"]["codec_s"] == 0 and rows["q8"]["codec_s"] > 0
    assert "wire-only ms" in proc.stdout and "overlap" in proc.stdout
    # The CPU its process used per call, against the machine's cores.
    assert all(r["cpu_s"] > 0 and r["local_ranks"] == r["world"] for r in rows.values())
    assert "cores busy" in proc.stdout
    # ddpcomm.all_reduce of q8 against its hook, the two taking turns (3x the calls).
    assert rows["q8"]["call_s"] > 0 and rows["q8"]["call_hook_s"] > 0
    assert "ddpcomm.all_reduce against the hook" in proc.stdout
    # Adaptive: decided after its probe calls; its bytes are those of the path it took.
    adaptive = rows["q8,adaptive"]
    path = adaptive["adaptive_path"]
    bytes_of = {"plain": rows["allreduce"]["formula_bytes"], "compressed": (n // 256) * (4 + 256)}
    assert adaptive["measured_bytes"] == bytes_of[path]
    assert f"q8,adaptive -> {path}" in proc.stdout


def test_collectives_nodes_quick(cwd, tmp_path):
    # 2 nodes of 2 ranks. As root: a namespace per node, whose ranks talk over its own
    # loopback, joined by a shaped link; elsewhere loopback, with torchrun's LOCAL_* set.
    out = tmp_path / "n.json"
    link = ["--link", "1gbit"] if netns.unavailable_reason() is None else []
    methods = "allreduce,none,hierarchy=2,q8,q8,hierarchy=auto"
    argv = ["--quick", "--nodes", "2", "--ranks-per-node", "2", *link, "--methods", methods]
    proc = bench(cwd, "collectives", *argv, "--out", str(out))
    result = json.loads(out.read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert result["environment"]["nodes"] == {"nodes": 2, "ranks_per_node": 2}
    for r in rows.values():
        assert r["status"] == "ok" and r["ranks_identical"] and r["world"] == 4, r
    auto = rows["q8,hierarchy=auto"]
    assert auto["hierarchy"]["local_size"] == 2 and "LOCAL_WORLD_SIZE=2" in auto["hierarchy"]["why"]
    assert auto["rel_error"] < rows["q8"]["rel_error"]  # node means are quantized, not ranks'
    assert auto["codec_s"] > 0 and auto["wire_inside_s"] > 0 and auto["wire_across_s"] > 0
    assert "two-level against flat" in proc.stdout
    if not link:
        return
    # The interface counters: the link carries what ddpcomm counts across nodes, so no
    # intra-node byte takes the shaped link; the node's loopback only the barriers of the
    # steps inside, which go through shared memory (the ranks share this host).
    n, per_node = 2**20 // 4, 2
    for method in ("none,hierarchy=2", "q8,hierarchy=auto"):
        r = rows[method]
        assert r["intra_node_shared_bytes"] == r["intra_node_bytes"] > 0, r
        for across, inside in zip(r["node_wire_bytes"], r["node_lo_bytes"], strict=True):
            assert 1 <= across / (per_node * r["cross_node_bytes"]) < 1.1, (method, across)
            assert inside < 0.01 * per_node * r["intra_node_bytes"], (method, inside)
    # Flat ring all_reduce: 2(P-1)/P * 4n bytes leave each node, one ring link's worth.
    for across in rows["allreduce"]["node_wire_bytes"]:
        assert 1 <= across / (1.5 * 4 * n) < 1.1, across
    assert max(auto["node_wire_bytes"]) < 0.6 * min(rows["q8"]["node_wire_bytes"])
    assert "MB across/node" in proc.stdout and "MB in node" in proc.stdout


def test_demo_quick_reports_a_failed_peer_in_one_line(cwd, tmp_path):
    out, png = tmp_path / "d.json", tmp_path / "d.png"
    proc = bench(cwd, "demo", "--quick", "--out", str(out), "--plot", str(png))
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert [m for m, r in rows.items() if r["status"] != "ok"] == ["torch-qpt"]
    # torch's quantization hook indexes gloo's all_gather result the way NCCL returns it.
    assert rows["torch-qpt"]["reason"].startswith("IndexError")
    assert "quantization_hooks.py" in rows["torch-qpt"]["reason"]
    (failure,) = [line for line in proc.stderr.splitlines() if "failed" in line]
    assert "IndexError" in failure and "Traceback" not in proc.stderr, proc.stderr
    assert len([line for line in proc.stdout.splitlines() if "IndexError" in line]) == 1
    q8, ddp = rows["q8"], rows["ddp"]
    assert q8["replicas_identical"] and 0.25 < q8["bytes_per_step"] / ddp["bytes_per_step"] < 0.26
    assert 0 < q8["max_param_diff"] < 0.1 and abs(q8["eval_loss"] / ddp["eval_loss"] - 1) < 0.01
    header = next(line for line in proc.stdout.splitlines() if line.startswith("method"))
    for column in ("MB/step", "bytes vs DDP", "ms/step", "held-out loss", "max param diff vs DDP"):
        assert column in header
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_failure_reason_unwraps_a_callback_error_that_aborted():
    # Under load a hook's callback error can end a rank as a C++ abort instead of a Python
    # traceback; the reason is the Python exception either way.
    log = (
        "terminate called after throwing an instance of 'c10::Error'\n"
        "  what():  Got the following error when running the callback: IndexError: invalid "
        "index of a 0-dim tensor. Use `tensor.item()` in Python\n"
        "\n"
        "At:\n"
        "  /x/ddp_comm_hooks/quantization_hooks.py(96): quantize_and_allgather\n"
    )
    reason = _ranks.failure_reason(log)
    assert reason == (
        "IndexError: invalid index of a 0-dim tensor [quantization_hooks.py:96 "
        "quantize_and_allgather]"
    )
    other = "terminate called\n  what():  [/a/b/pair.cc:456] Connection closed by peer\n"
    assert _ranks.failure_reason(other) == "C++ abort: [pair.cc:456] Connection closed by peer"


def test_adaptive_summary_counts_decisions_against_the_same_run():
    from ddpcomm.bench import collectives

    def row(method, ms, path=None):
        r = {"world": 2, "size_mib": 1, "method": method, "status": "ok", "median_s": ms / 1e3}
        return r if path is None else {**r, "adaptive_path": path}

    rows = [
        row("allreduce", 10.0),
        row("q8", 5.0),
        row("q8,adaptive", 5.1, "compressed"),  # the faster path, within 5% of it
        row("q4", 20.0),
        row("q4,adaptive", 10.5, "plain"),  # the faster path, 5% over plain: > 3%
        row("q1", 10.2),
        row("q1,adaptive", 12.0, "compressed"),  # a tie, but 20% slower than either
    ]
    plain = {(2, 1): rows[0]}
    (line,) = collectives._adaptive_summary(rows, plain)[1:]
    assert "3 cells: took the faster of plain and its method in 2, the slower in 0" in line
    assert "either (within 5%) in 1; ran more than 3% slower than plain in 2" in line
    assert "more than 5% slower than the faster in 1" in line


def test_two_level_table_compares_each_method_with_its_flat_form():
    from ddpcomm.bench import collectives

    def row(method, ms, across, error, **steps):
        return {"world": 4, "size_mib": 64, "method": method, "status": "ok", "median_s": ms,
                "node_wire_bytes": [across, across], "rel_error": error, **steps}  # fmt: skip

    rows = [
        row("allreduce", 8.0, 100.0, 1e-8),
        row("none,hierarchy=2", 4.0, 50.0, 1e-8),  # against allreduce; no error ratio
        row("q8", 2.0, 30.0, 0.01),
        row("q8,hierarchy=2", 1.0, 15.0, 0.005, wire_inside_s=0.5, wire_across_s=0.25),
        row("q4,hierarchy=2", 1.0, 8.0, 0.05),  # no flat q4: no line
    ]
    lines = collectives._two_level_table(rows, markdown=False)[-1].splitlines()[2:]
    assert [line.split() for line in lines] == [
        ["none,hierarchy=2", "allreduce", "64", "2.00x", "0.50x", "-", "-", "-"],
        ["q8,hierarchy=2", "q8", "64", "2.00x", "0.50x", "0.50x", "500.0", "250.0"],
    ]


def test_train_quick_on_text(cwd, tmp_path):
    out = tmp_path / "t.json"
    # --adam-exact v: q8's AdamW keeps its second moment from the exact mean (SplitAdam).
    argv = ["--quick", "--data", "text", "--methods", "ddp,q8", "--adam-exact", "v"]
    bench(cwd, "train", *argv, "--out", str(out))
    result = json.loads(out.read_text())
    assert "English text" in result["environment"]["model"]
    for r in result["rows"]:
        assert r["status"] == "ok" and r["replicas_identical"], r
        # Held out after 2, 6 and 12 steps, below the uniform loss over 128 characters.
        assert [s for s, _ in r["eval_losses"]] == [2, 6, 12]
        assert 0 < r["eval_loss"] < 4.86


def test_exact_params_replace_the_methods_mean_with_the_exact_one(cwd, tmp_path):
    # Every parameter exact: q1 trains as DDP does, to the bit (at 2 ranks halving is
    # exact, so DDP's x/2 + y/2 is the probe's (x + y) / 2); only the attention exact:
    # q1's error reaches the rest.
    out = tmp_path / "t.json"
    for pattern, same in ((".", True), ("[.](qkv|proj)[.]", False)):
        argv = ["--quick", "--methods", "ddp,q1,start_iter=0,ramp=0", "--exact-params", pattern]
        bench(cwd, "train", *argv, "--out", str(out))
        ddp, q1 = json.loads(out.read_text())["rows"]
        assert q1["status"] == "ok" and q1["replicas_identical"], q1
        assert (q1["loss"] == ddp["loss"]) == same, (pattern, q1["loss"], ddp["loss"])


def test_train_quick(cwd, tmp_path):
    out = tmp_path / "t.json"
    argv = ["--quick", "--methods", "ddp,q8", "--probe-every", "5", "--out", str(out)]
    bench(cwd, "train", *argv)
    ddp, q8 = json.loads(out.read_text())["rows"]
    for r in (ddp, q8):
        assert r["status"] == "ok" and r["replicas_identical"], r
        assert len(r["loss"]) == 12 and all(0 < x < 10 for x in r["loss"])
        assert 0 < r["eval_loss"] < 10 and r["bytes_per_step"] > 0
    assert q8["compress_s_per_step"] >= 0 and q8["max_param_diff"] > 0
    # Where its weights ended, against DDP's, by parameter kind.
    kinds = {"token embedding", "position embedding", "attention", "mlp", "layer norm", "head"}
    assert set(q8["drift"]) == kinds and all(0 < d < 1 for d in q8["drift"].values())
    assert "drift" not in ddp
    # --probe-every 5: steps 0, 5, 10; q8's mean against the exact one, by kind.
    assert q8["probe"]["steps"] == [0, 5, 10] and "probe" not in ddp
    for half in ("first_half", "second_half"):
        assert set(q8["probe"][half]) == kinds
        # Small layer-norm gradients share blocks with larger ones: coarser relative steps.
        assert all(0 < e < 0.5 for e in q8["probe"][half].values()), q8["probe"]
        assert q8["probe"][half]["mlp"] < 0.05, q8["probe"]


def test_train_accumulation_and_scheduled_spec(cwd, tmp_path):
    # Spec options ride on --methods' commas; one exchange per step under --accum.
    out = tmp_path / "t.json"
    bench(
        cwd, "train", "--quick", "--accum", "2", "--lr-decay", "cosine",
        "--methods", "ddp,q1,start_iter=2,ramp=4,block_size=64", "--out", str(out),
    )  # fmt: skip
    ddp, q1 = json.loads(out.read_text())["rows"]
    assert q1["method"] == "q1,start_iter=2,ramp=4,block_size=64"
    for r in (ddp, q1):
        assert r["status"] == "ok" and r["replicas_identical"], r
    # 10 timed steps: 4 ramp iterations (q8, q4, q2) and 6 at q1, one bucket exchange each.
    assert q1["paths"]["q_all_gather"] == 10, q1["paths"]
    # Past the ramp, each step sends q1's payload of the model's gradients once.
    q1_bytes = ddpcomm.compressors.parse("q1", block_size=64).wire_bytes(q1["params"], 2)
    assert q1["bytes_per_step_settled"] == q1_bytes < q1["bytes_per_step"]
    assert "bytes_per_step_settled" not in ddp


def test_fsdp_quick(cwd, tmp_path):
    out = tmp_path / "f.json"
    proc = bench(cwd, "fsdp", "--quick", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert all(r["status"] == "ok" and r["world"] == 2 for r in rows), rows
    rs = {r["method"]: r for r in rows if r["part"] == "rs"}
    trained = {r["method"]: r for r in rows if r["part"] == "train"}
    assert list(rs) == ["plain", "q8", "q4", "q1", "topk:0.01"]
    assert list(trained) == ["nocomm", "plain", "q8"]
    n = 2**20 // 4  # one chunk of n / 2 elements goes to the other rank
    assert rs["plain"]["bytes"] == 4 * n // 2 and rs["plain"]["rel_error"] < 1e-6
    # ddpcomm's own count is q8's wire format: a 4-byte scale per 256 one-byte codes.
    assert rs["q8"]["bytes"] == (n // 2 // 256) * (4 + 256) and 0 < rs["q8"]["rel_error"] < 0.02
    assert all(r["median_s"] > 0 and len(r["times_s"]) == 2 for r in rs.values())
    for r in trained.values():
        assert len(r["loss"]) == 8 and 0 < r["eval_loss"] < 10 and r["median_step_s"] > 0
    nocomm, plain, q8 = (trained[m]["rs_bytes_per_step"] for m in ("nocomm", "plain", "q8"))
    assert nocomm == 0 and 0 < q8 < plain / 3
    assert abs(trained["q8"]["eval_loss"] / trained["plain"]["eval_loss"] - 1) < 0.01
    for column in ("speedup vs plain", "limit from bytes", "held-out loss", "loss vs plain"):
        assert column in proc.stdout


@pytest.mark.parametrize("command", ["kernels", "sparse", "coalesced"])
def test_single_process_commands_quick(cwd, tmp_path, command):
    out = tmp_path / "k.json"
    proc = bench(cwd, command, "--quick", "--out", str(out))
    result = json.loads(out.read_text())
    kernel_rows = result["flatten"] if command == "coalesced" else result["rows"]
    assert kernel_rows and all(r["gbps"] > 0 and r["copy_gbps"] > 0 for r in kernel_rows)
    assert {r["size_mb"] for r in kernel_rows} == {4}  # --quick: one small size
    assert "% of copy" in proc.stdout
    if command == "kernels":
        assert all(r["speedup_vs_reference"] for r in kernel_rows if "hook_path" not in r["op"])
    if command == "sparse":
        assert 0.9 < result["quality"][0]["mass_mean"] <= 1
        assert [b["world"] for b in result["bytes"]] == [2, 3, 4]
    if command == "coalesced":
        (row,) = result["rows"]
        assert row["status"] == "ok" and set(row["ms"]) == {
            "per_tensor",
            "torch_flatten",
            "ddpcomm",
        }


def test_collectives_under_torchrun(cwd, tmp_path):
    # Under torchrun every rank runs the cases in-process (gloo here, NCCL on GPUs).
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed next to this python")
    out = tmp_path / "tr.json"
    argv = ["--nproc_per_node", "2", "-m", "ddpcomm.bench", "collectives", "--quick"]
    proc = subprocess.run(
        [torchrun, *argv, "--methods", "allreduce,q8", "--out", str(out)],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["allreduce", "q8"]
    assert all(r["status"] == "ok" and r["world"] == 2 and r["ranks_identical"] for r in rows)
    assert not os.listdir(cwd)


# -- network namespaces (root only) ----------------------------------------------------

from ddpcomm.bench import netns  # noqa: E402 - the public module behind --link

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
    assert not set(netns.list_namespaces()) & {*links.namespaces, links.hub}


@needs_root
def test_links_removed_on_sigterm_and_stale_ones_reaped():
    code = textwrap.dedent("""\
        import time
        from ddpcomm.bench import netns
        with netns.Links(2, "1gbit") as links:
            print(" ".join(links.namespaces), flush=True)
            time.sleep(60)
        """)

    def start():
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV
        )
        names = proc.stdout.readline().split()
        assert len(names) == 2 and set(names) <= set(netns.list_namespaces())
        return proc, names

    proc, names = start()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert not set(names) & set(netns.list_namespaces())
    # SIGKILL leaves them behind; the next run removes them (their pid is dead).
    proc, names = start()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert set(names) <= set(netns.list_namespaces())
    assert set(names) <= set(netns.remove_stale())
    assert not set(names) & set(netns.list_namespaces())


@needs_root
@pytest.mark.parametrize("collective", ["all_gather", "all_reduce"])
def test_wire_under_load_prints_a_ratio_per_kind_of_work(collective):
    """benchmarks/wire_under_load.py, tiny: two ranks on a shaped link, a row per kind of
    work, the wire alone at ratio 1, and its namespaces gone after it."""
    script = os.path.join(ROOT, "benchmarks", "wire_under_load.py")
    args = ["--pieces=2", "--bytes=65536", "--ms=0.5", "--land-ms=0.2", "--repeats=1"]
    before = set(netns.list_namespaces())
    out = subprocess.run(
        [sys.executable, script, *args, f"--collective={collective}"],
        capture_output=True, text=True, env=ENV, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()[2:]}
    assert sorted(rows) == ["cpu", "memory", "none"] and rows["none"][-1] == "1.00", out.stdout
    assert all(float(r[-1]) > 0 for r in rows.values()) and collective in out.stdout
    assert set(netns.list_namespaces()) <= before


@pytest.mark.parametrize("exact", ["m", "v"])
def test_split_adam_is_adamw_when_both_moments_take_one_gradient(exact):
    from ddpcomm.bench._probes import SplitAdam

    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(64))
    b = torch.nn.Parameter(a.detach().clone())
    ref = torch.optim.AdamW([a], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0, foreach=False)
    split = SplitAdam([b], lr=1e-2, exact=exact)
    for _ in range(5):
        g = torch.randn(64)
        a.grad, b.grad, b.exact_grad = g.clone(), g.clone(), g.clone()
        ref.step()
        split.step()
        assert torch.equal(a, b)
    # A different exact gradient moves the weights elsewhere: the moment really reads it.
    b.exact_grad = 2 * b.grad
    split.step()
    ref.step()
    assert not torch.equal(a, b)
    with pytest.raises(ValueError, match="exact"):
        SplitAdam([b], lr=1e-2, exact="w")
