"""Adaptive pass-through (ddpcomm/adaptive.py) on 2 spawned gloo ranks.

Timings are injected, never measured: each rank's state gets a fake clock that the two
paths (``collectives.plain_all_reduce`` and ``collectives.all_reduce_mean``, wrapped for
the run) advance by a cost the check chooses per rank, path, bucket and step. So the
checks say which path must win, and no assertion depends on this machine's speed.
"""

from __future__ import annotations

import contextlib
import pickle

import pytest
import torch
import torch.distributed as dist

import ddpcomm
from ddpcomm import adaptive, collectives
from tests import ddp_utils
from tests.cuda_utils import needs_cuda
from tests.spawn_plan import Groups

WORLD = 2
SMALL, LARGE = 300, 5000  # two buckets per step, in different size classes
LATE = 70000  # a third class, in some checks from a later step on
FIRST = 2 * adaptive.PROBE_STEPS  # the step of the first decision


class Bucket:
    """The GradBucket methods the hooks call, over one flat buffer."""

    def __init__(self, index: int, buffer: torch.Tensor, last: bool, params: list) -> None:
        self._index, self._buffer, self._last, self._params = index, buffer, last, params

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list:
        return self._params

    def is_last(self) -> bool:
        return self._last


class Clock:
    """Fake seconds: advanced by ``cost(path, numel, step)`` when a path is entered."""

    def __init__(self, cost) -> None:
        self.now, self.cost, self.step = 0.0, cost, 0

    def __call__(self) -> float:
        return self.now


@contextlib.contextmanager
def timed_paths(clock: Clock):
    plain, compressed = collectives.plain_all_reduce, collectives.all_reduce_mean

    def timed_plain(flat, ctx):
        clock.now += clock.cost("plain", flat.numel(), clock.step)
        return plain(flat, ctx)

    def timed_compressed(flat, compressor, ctx):
        clock.now += clock.cost("compressed", flat.numel(), clock.step)
        return compressed(flat, compressor, ctx)

    collectives.plain_all_reduce, collectives.all_reduce_mean = timed_plain, timed_compressed
    try:
        yield
    finally:
        collectives.plain_all_reduce, collectives.all_reduce_mean = plain, compressed


def run_steps(rank: int, spec: str, cost, steps: int, every: int = 500, late=None) -> dict:
    """``steps`` iterations of two buckets through compress_hook with fake timings (and a
    third of LATE elements from step ``late`` on); per step the paths taken, the outputs'
    bytes, the inputs and the residuals' sums."""
    state = ddpcomm.CompressionState(spec, adaptive=True, adaptive_every=every)
    clock = Clock(cost)
    state.adaptive.clock = clock
    params = [[torch.nn.Parameter(torch.empty(0))] for _ in range(3)]
    record = {"paths": [], "outputs": [], "inputs": 0.0, "residual_after_plain": []}
    with timed_paths(clock):
        for step in range(steps):
            clock.step = step
            paths = []
            sizes = (LARGE, SMALL) if late is None or step < late else (LARGE, SMALL, LATE)
            for index, n in enumerate(sizes):
                g = torch.Generator().manual_seed(100 * step + 10 * index + rank)
                grad = torch.randn(n, generator=g)
                record["inputs"] += grad.double().sum().item()
                before = {k: v.clone() for k, v in state.memory.buffers.items()}
                plain_before = state.stats()["paths"].get("plain", 0)
                bucket = Bucket(index, grad.clone(), index == len(sizes) - 1, params[index])
                out = ddpcomm.compress_hook(state, bucket).wait()
                plain = state.stats()["paths"].get("plain", 0) > plain_before
                paths.append("plain" if plain else "compressed")
                record["outputs"].append(out.double().sum().item())
                record.setdefault("bytes", []).append(out.view(torch.uint8).tolist())
                if plain:
                    record["residual_after_plain"].append(
                        all(torch.equal(before[k], state.memory.buffers[k]) for k in before)
                    )
            record["paths"].append(paths)
    record["residuals"] = sum(b.double().sum().item() for b in state.memory.buffers.values())
    record["decisions"] = dict(state.adaptive.decisions)
    record["stats"] = state.stats()
    return record


def cls(numel: int) -> int:
    return adaptive.size_class(numel)


def constant(plain: float, compressed: float):
    return lambda path, numel, step: plain if path == "plain" else compressed


def check_cuda_without_host_sync() -> dict:
    """One rank on NCCL: CUDA events time both paths and are read only once complete;
    no hook call synchronises with the host, probe and decisions included."""
    torch.cuda.set_device(0)
    nccl = dist.new_group(backend="nccl")
    state = ddpcomm.CompressionState("q8,adaptive", process_group=nccl, adaptive_every=4)
    params = [[torch.nn.Parameter(torch.empty(0))] for _ in range(2)]
    grads = [torch.randn(n, device="cuda") for n in (LARGE, SMALL)]
    bad = []
    try:
        for step in range(3 * FIRST):
            for index, grad in enumerate(grads):
                bucket = Bucket(index, grad.clone(), index == 1, params[index])
                if step > 1:  # the first calls allocate buffers
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    ddpcomm.compress_hook(state, bucket).wait()
                except RuntimeError as exc:
                    bad.append(f"step {step}: {exc}")
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        rows = state.stats()["adaptive"]["classes"]
    finally:
        dist.destroy_process_group(nccl)
    return {"bad": bad, "rows": rows, "decisions": state.adaptive.rounds}


def plan(rank: int, world: int, device: str):
    if device == "cuda":
        yield ("cuda",), check_cuda_without_host_sync
        return
    yield ("slow-compression",), lambda: run_steps(rank, "q8,adaptive", constant(1.0, 2.0), 12)
    yield ("slow-plain",), lambda: run_steps(rank, "q8,adaptive", constant(2.0, 1.0), 12)
    yield ("late",), lambda: run_steps(rank, "q8,adaptive", constant(2.0, 1.0), 18, late=7)

    def differing(path, numel, step):
        # Rank 0 finds compression fast for both classes; rank 1 finds it slow for the
        # small class only. The slowest rank decides: small plain, large compressed.
        if path == "plain":
            return 1.0
        return 0.5 if rank == 0 or numel == LARGE else 1.5

    yield ("differing",), lambda: run_steps(rank, "q4,adaptive", differing, 12)

    def changing(path, numel, step):
        # Compression pays until step 20, then the link gets fast and it no longer does.
        if path == "plain":
            return 1.0 if step < 20 else 0.2
        return 0.5

    yield ("changing",), lambda: run_steps(rank, "q8,adaptive", changing, 34, every=6)
    # q1 keeps residuals (error feedback on); topk too, with another residual layout.
    yield ("ef", "q1"), lambda: run_steps(rank, "q1,adaptive", constant(1.0, 0.5), 14, every=4)
    yield ("ef", "topk"), lambda: run_steps(rank, "topk:0.05,adaptive", constant(1, 0.5), 14, 4)

    def real_clock_ddp():
        state = ddpcomm.CompressionState("q8,adaptive", adaptive_every=4)
        model, _ = ddp_utils.train(
            rank, ddp_utils.DEEP, state, ddpcomm.compress_hook, steps=2 * FIRST
        )
        flat = ddp_utils.flat_params(model)
        return {
            "params_identical": ddp_utils.identical_across_ranks(flat, world),
            "decisions": dict(state.adaptive.decisions),
        }

    yield ("ddp",), real_clock_ddp

    def mismatch():
        state = ddpcomm.CompressionState("q8", adaptive=rank == 0)
        bucket = Bucket(0, torch.ones(64), True, [torch.nn.Parameter(torch.empty(0))])
        try:
            ddpcomm.compress_hook(state, bucket).wait()
        except ValueError as exc:
            return str(exc)
        return "no error"

    yield ("mismatch",), mismatch


GROUPS = Groups(plan)


def per_rank(*key) -> list[dict]:
    return GROUPS.values(WORLD, "cpu", *key)


def steady_paths(record: dict) -> list[list[str]]:
    return record["paths"][FIRST:]


def test_plain_chosen_when_compression_is_slow():
    for r in per_rank("slow-compression"):
        assert r["decisions"] == {cls(LARGE): "plain", cls(SMALL): "plain"}
        assert steady_paths(r) == [["plain", "plain"]] * (12 - FIRST)


def test_compressed_chosen_when_plain_is_slow():
    for r in per_rank("slow-plain"):
        assert r["decisions"] == {cls(LARGE): "compressed", cls(SMALL): "compressed"}
        assert steady_paths(r) == [["compressed", "compressed"]] * (12 - FIRST)


def test_a_class_first_seen_late_is_decided_soon():
    r = per_rank("late")[0]
    # Step 7 times LATE's compressed path once (a warm-up), so the decision at step 8
    # cannot decide it; it is probed (alternating) and decided at 16, not 500 steps on.
    assert r["decisions"] == {c: "compressed" for c in (cls(LARGE), cls(SMALL), cls(LATE))}
    assert [p[2] for p in r["paths"][8:16]] == ["plain", "compressed"] * 4
    assert r["paths"][16:] == [["compressed"] * 3] * 2
    assert r["stats"]["adaptive"]["next_decision_iteration"] == 16 + 500


def test_probe_alternates_paths_before_the_first_decision():
    r = per_rank("slow-plain")[0]
    assert r["paths"][:FIRST] == [["plain"] * 2, ["compressed"] * 2] * adaptive.PROBE_STEPS


def test_decisions_identical_when_local_timings_differ():
    r0, r1 = per_rank("differing")
    # Each rank alone would decide differently for the small class; together they agree.
    assert r0["decisions"] == r1["decisions"] == {cls(LARGE): "compressed", cls(SMALL): "plain"}
    assert r0["paths"] == r1["paths"]
    assert r0["paths"][-1] == ["compressed", "plain"]


@pytest.mark.parametrize("key", ["slow-compression", "slow-plain", "differing", "changing"])
def test_results_bitwise_identical_across_ranks(key):
    r0, r1 = per_rank(key)
    assert r0["bytes"] == r1["bytes"]


def test_reevaluation_follows_a_change():
    r = per_rank("changing")[0]
    big, small = cls(LARGE), cls(SMALL)
    paths = r["paths"]
    assert paths[FIRST] == ["compressed", "compressed"]  # plain 1.0 vs compressed 0.5
    # Decisions at 8, 14, 20, 26, 32, each after 2 steps of the losing path. The change at
    # step 20 reaches the window of compressed samples by the decision at 26.
    assert paths[12:14] == [["plain", "plain"]] * 2  # re-probe before step 14
    assert paths[14] == ["compressed", "compressed"]
    assert paths[26] == ["plain", "plain"]
    assert paths[30:32] == [["compressed", "compressed"]] * 2  # the new loser re-probed
    assert paths[33] == ["plain", "plain"]
    assert r["decisions"] == {big: "plain", small: "plain"}
    assert r["stats"]["adaptive"]["decisions"] == 5


@pytest.mark.parametrize("method", ["q1", "topk"])
def test_error_feedback_invariant_across_path_changes(method):
    records = per_rank("ef", method)
    # Both paths were taken, and a plain step never touched the residuals.
    taken = {p for r in records for step in r["paths"] for p in step}
    assert taken == {"plain", "compressed"}
    assert all(all(r["residual_after_plain"]) and r["residual_after_plain"] for r in records)
    # N * sum(outputs) + sum(residuals) = sum(inputs), summed over ranks.
    outputs = records[0]["outputs"]
    assert records[1]["outputs"] == outputs
    total_in = sum(r["inputs"] for r in records)
    total_res = sum(r["residuals"] for r in records)
    assert WORLD * sum(outputs) + total_res == pytest.approx(total_in, abs=1e-3)


def test_stats_show_paths_estimates_and_decisions():
    r = per_rank("differing")[0]
    st = r["stats"]["adaptive"]
    assert st["every"] == 500 and st["decisions"] == 1
    assert st["next_decision_iteration"] == FIRST + 500
    assert st["buckets"] == {"plain": 12, "compressed": 12}
    rows = {tuple(row["numel"]): row for row in st["classes"]}
    small = rows[(256, 511)]
    assert small["decision"] == "plain"
    assert small["estimated_ms"] == {"plain": 1000.0, "compressed": 1500.0}
    assert small["buckets"] == {"plain": 4 + 4, "compressed": 4}
    assert rows[(4096, 8191)]["decision"] == "compressed"
    assert rows[(4096, 8191)]["measured_ms"]["compressed"] == 500.0


def test_real_clock_ddp_training_stays_identical_across_ranks():
    r0, r1 = per_rank("ddp")
    assert r0["params_identical"] and r1["params_identical"]
    assert r0["decisions"] == r1["decisions"] and r0["decisions"]


def test_ranks_disagreeing_on_adaptive_fail_with_a_clear_error():
    for message in per_rank("mismatch"):
        assert "adaptive" in message and "disagree" in message


@needs_cuda
def test_cuda_times_with_events_and_never_syncs():
    (r,) = GROUPS.values(1, "cuda", "cuda")
    assert r["bad"] == []
    assert r["decisions"] >= 3  # at steps 8, 12, 16 and 20
    for row in r["rows"]:
        assert row["decision"] in ("plain", "compressed")
        assert all(v is not None and v > 0 for v in row["measured_ms"].values()), row


# -- no process group ------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, kwargs",
    [
        ("q8,adaptive", {}),
        (" q4 , ADAPTIVE ", {}),
        ("topk:0.01,adaptive", {}),
        ("q8", {"adaptive": True}),
    ],
)
def test_adaptive_in_spec_strings_and_arguments(spec, kwargs):
    state = ddpcomm.CompressionState(spec, **kwargs)
    assert state.adaptive is not None and state.adaptive.every == adaptive.DEFAULT_EVERY
    assert ddpcomm.CompressionState(spec.split(",")[0]).adaptive is None


def test_named_states_take_adaptive():
    assert ddpcomm.QuantizeState(bits=4, adaptive=True).adaptive is not None
    assert ddpcomm.TopKState(ratio=0.1, adaptive=True, adaptive_every=9).adaptive.every == 9
    assert ddpcomm.RandomKState(adaptive=True).adaptive is not None
    assert ddpcomm.QuantizeState().adaptive is None  # off by default


@pytest.mark.parametrize(
    "spec, kwargs, exc, match",
    [
        ("q8,adaptiv", {}, ValueError, "unknown option 'adaptiv'"),
        ("q8,adaptive,adaptive", {}, ValueError, "option .adaptive. twice"),
        ("none,adaptive", {}, ValueError, "adaptive needs a compressing method"),
        ("q8", {"adaptive": 1}, TypeError, "adaptive must be a bool"),
        ("q8", {"adaptive": True, "adaptive_every": 2}, ValueError, "adaptive_every must be >="),
        ("q8", {"adaptive_every": 10.0}, TypeError, "adaptive_every must be an int"),
    ],
)
def test_bad_adaptive_arguments(spec, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ddpcomm.CompressionState(spec, **kwargs)


def test_adaptive_is_not_a_method_option():
    with pytest.raises(ValueError, match="settings of the hook state"):
        ddpcomm.parse_compression("q8,adaptive")


def test_state_dict_keeps_decisions():
    state = ddpcomm.CompressionState("q8,adaptive", adaptive_every=7)
    state.adaptive.decisions = {9: "plain", 13: "compressed"}
    state.adaptive.next_decision = 15
    sd = state.state_dict()
    again = ddpcomm.CompressionState("q8,adaptive", adaptive_every=7)
    again.load_state_dict(sd)
    assert again.adaptive.decisions == state.adaptive.decisions
    assert again.adaptive.next_decision == 15
    pickled = pickle.loads(pickle.dumps(state))
    assert pickled.adaptive.decisions == state.adaptive.decisions
    assert pickled.adaptive.every == 7
    broken = dict(sd, adaptive=dict(sd["adaptive"], decisions={9: "fast"}))
    with pytest.raises(ValueError, match="unknown paths"):
        again.load_state_dict(broken)
    with pytest.raises(ValueError, match=r"malformed state_dict\['adaptive'\]"):
        again.load_state_dict(dict(sd, adaptive={"every": 7}))
    with pytest.raises(ValueError, match="adaptive=True, this state has adaptive=False"):
        ddpcomm.CompressionState("q8").load_state_dict(sd)
    with pytest.raises(ValueError, match="adaptive_every=7, this state has 500"):
        ddpcomm.CompressionState("q8,adaptive").load_state_dict(sd)
