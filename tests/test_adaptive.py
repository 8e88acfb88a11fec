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
FIRST = adaptive.first_decision(2)  # the step of the first decision
ROUND = adaptive.SAMPLES * 3  # steps in a round over two classes
SECOND = FIRST + ROUND + adaptive.SLACK  # the quick round's decision, after a change
LATE_STEP = SECOND + 2  # the step the third class first appears in "late"
CHANGE = SECOND  # the step the link gets fast in "changing"
EVERY = 6  # adaptive_every in "changing"


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
    """Fake seconds: advanced by ``cost(path, numel, step)`` when a path is entered, and by
    ``gap`` between a step's buckets (the backward pass between them)."""

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


def run_steps(
    rank: int, spec: str, cost, steps: int, every: int = 500, late=None, gap: float = 0.0
) -> dict:
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
                clock.now += gap if index else 0.0
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
        for step in range(40):
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
    slow_plain = constant(2.0, 1.0)
    yield ("slow-compression",), lambda: run_steps(rank, "q8,adaptive", constant(1, 2), FIRST + 4)
    yield ("slow-plain",), lambda: run_steps(rank, "q8,adaptive", slow_plain, SECOND + 2)
    yield (
        ("late",),
        lambda: run_steps(rank, "q8,adaptive", slow_plain, LATE_STEP + 24, late=LATE_STEP),
    )

    def differing(path, numel, step):
        # Rank 0 finds compression fast for both classes; rank 1 finds it slow for the
        # small class only. The slowest rank decides: small plain, large compressed.
        if path == "plain":
            return 1.0
        return 0.5 if rank == 0 or numel == LARGE else 1.5

    yield ("differing",), lambda: run_steps(rank, "q4,adaptive", differing, SECOND + 2, gap=0.25)

    def changing(path, numel, step):
        # Compression pays until step CHANGE, then the link gets fast and it no longer does.
        if path == "plain":
            return 1.0 if step < CHANGE else 0.2
        return 0.5

    yield ("changing",), lambda: run_steps(rank, "q8,adaptive", changing, SECOND + 40, EVERY)
    # q1 keeps residuals (error feedback on); topk too, with another residual layout.
    # Without the methods' default warm-up and ramp: compressed from the first decision.
    q1, topk = "q1,adaptive,start_iter=0,ramp=0", "topk:0.05,adaptive,start_iter=0,ramp=0"
    yield ("ef", "q1"), lambda: run_steps(rank, q1, constant(1.0, 0.5), 30, every=4)
    yield ("ef", "topk"), lambda: run_steps(rank, topk, constant(1, 0.5), 30, 4)

    def real_clock_ddp():
        state = ddpcomm.CompressionState("q8,adaptive", adaptive_every=4)
        model, _ = ddp_utils.train(rank, ddp_utils.DEEP, state, ddpcomm.compress_hook, steps=40)
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


P, C = "plain", "compressed"


def round_paths(large: str, small: str) -> list[list[str]]:
    """A round's paths ([LARGE, SMALL] per step) from the base (large, small): the base,
    then SMALL flipped, then LARGE flipped (classes in size order), SAMPLES times."""
    flip = {P: C, C: P}
    cycle = [[large, small], [large, flip[small]], [flip[large], small]]
    return cycle * adaptive.SAMPLES


def test_warm_up_then_a_round_that_flips_one_class_at_a_time():
    r = per_rank("slow-plain")[0]
    paths = r["paths"]
    assert paths[:2] == [[P, P], [C, C]]  # each path's first call, untimed
    assert paths[2 : 2 + ROUND] == round_paths(P, P)  # undecided classes go plain
    assert paths[2 + ROUND] == [P, P]  # the slack step before the decision
    # Both classes changed to compressed: a second round at once checks them together.
    assert paths[FIRST : FIRST + ROUND] == round_paths(C, C)
    assert paths[SECOND:] == [[C, C]] * 2
    assert r["stats"]["adaptive"]["decisions"] == 2


def test_plain_chosen_when_compression_is_slow():
    for r in per_rank("slow-compression"):
        assert r["decisions"] == {cls(LARGE): P, cls(SMALL): P}
        # Nothing changed: no second round, the next one 500 steps on.
        assert r["paths"][FIRST:] == [[P, P]] * 4
        assert r["stats"]["adaptive"]["next_round_iteration"] == FIRST + 500


def test_compressed_chosen_when_plain_is_slow():
    for r in per_rank("slow-plain"):
        assert r["decisions"] == {cls(LARGE): C, cls(SMALL): C}


def test_a_class_first_seen_late_starts_a_round_at_once():
    r = per_rank("late")[0]
    paths = r["paths"]
    assert paths[LATE_STEP - 1] == [C, C]
    assert paths[LATE_STEP] == [C, C, P]  # undecided: plain
    # The next step starts a round over the three classes (small, large, late), base first.
    cycle = [[C, C, P], [C, P, P], [P, C, P], [C, C, C]]
    start, length = LATE_STEP + 1, 4 * adaptive.SAMPLES
    assert paths[start : start + length] == cycle * adaptive.SAMPLES
    # Decided after the slack step: a change, so a second round starts, base first.
    assert paths[start + length + adaptive.SLACK] == [C, C, C]
    assert r["decisions"] == {c: C for c in (cls(LARGE), cls(SMALL), cls(LATE))}
    assert r["stats"]["adaptive"]["probing"]


def test_decisions_identical_when_local_timings_differ():
    r0, r1 = per_rank("differing")
    # Each rank alone would decide differently for the small class; together they agree.
    assert r0["decisions"] == r1["decisions"] == {cls(LARGE): C, cls(SMALL): P}
    assert r0["paths"] == r1["paths"]
    assert r0["paths"][-1] == [C, P]


@pytest.mark.parametrize("key", ["slow-compression", "slow-plain", "differing", "changing"])
def test_results_bitwise_identical_across_ranks(key):
    r0, r1 = per_rank(key)
    assert r0["bytes"] == r1["bytes"]


def test_reevaluation_follows_a_change():
    r = per_rank("changing")[0]
    paths = r["paths"]
    # Rounds from steps 2 (decided at FIRST: compressed), FIRST (decided at SECOND: no
    # change), SECOND + EVERY (plain got fast at SECOND: decided plain) and at once again
    # (no change).
    third = SECOND + EVERY
    fourth = third + ROUND + adaptive.SLACK
    last = fourth + ROUND + adaptive.SLACK
    assert paths[SECOND:third] == [[C, C]] * EVERY
    assert paths[third : third + ROUND] == round_paths(C, C)
    assert paths[fourth : fourth + ROUND] == round_paths(P, P)
    assert paths[last:] == [[P, P]] * (SECOND + 40 - last)
    assert r["decisions"] == {cls(LARGE): P, cls(SMALL): P}
    assert r["stats"]["adaptive"]["decisions"] == 4
    assert r["stats"]["adaptive"]["next_round_iteration"] == last + EVERY


@pytest.mark.parametrize("method", ["q1", "topk"])
def test_error_feedback_invariant_across_path_changes(method):
    records = per_rank("ef", method)
    # Both paths were taken, and a plain step never touched the residuals.
    taken = {p for r in records for step in r["paths"] for p in step}
    assert taken == {P, C}
    assert all(all(r["residual_after_plain"]) and r["residual_after_plain"] for r in records)
    # N * sum(outputs) + sum(residuals) = sum(inputs), summed over ranks.
    outputs = records[0]["outputs"]
    assert records[1]["outputs"] == outputs
    total_in = sum(r["inputs"] for r in records)
    total_res = sum(r["residuals"] for r in records)
    assert WORLD * sum(outputs) + total_res == pytest.approx(total_in, abs=1e-3)


def test_stats_show_paths_and_step_time_estimates():
    r = per_rank("differing")[0]
    st = r["stats"]["adaptive"]
    assert st["every"] == 500 and st["decisions"] == 2 and not st["probing"]
    assert st["next_round_iteration"] == SECOND + 500
    # Every step after the rounds: large compressed (0.5) + 0.25 between buckets + small
    # plain (1.0) on this rank.
    assert st["step_ms"] == 1750.0
    assert st["buckets"] == {P: 42, C: 30}
    rows = {tuple(row["numel"]): row for row in st["classes"]}
    small, large = rows[(256, 511)], rows[(4096, 8191)]
    assert small["decision"] == P and large["decision"] == C
    # The second round's step spans, slowest rank (rank 1 compresses the small one at 1.5).
    assert small["estimated_step_ms"] == {P: 1750.0, C: 2250.0}
    assert large["estimated_step_ms"] == {P: 2250.0, C: 1750.0}
    assert small["buckets"] == {P: 25, C: 11}


def test_real_clock_ddp_training_stays_identical_across_ranks():
    r0, r1 = per_rank("ddp")
    assert r0["params_identical"] and r1["params_identical"]
    assert r0["decisions"] == r1["decisions"] and r0["decisions"]


def test_a_step_with_a_failed_bucket_is_not_timed():
    """A step's buckets are checked once they have completed: one that failed leaves the
    step untimed, and a step is not timed before all of them have completed."""
    ok, bad, pending = torch.futures.Future(), torch.futures.Future(), torch.futures.Future()
    ok.set_result(torch.zeros(1))
    bad.set_exception(RuntimeError("collective failed"))
    step = adaptive._Step(5, adaptive.BASE, 0.0)
    step.futures = [ok, pending]
    assert step.failed() is None
    pending.set_result(torch.zeros(1))
    assert step.failed() is False
    step.futures = [ok, bad]
    assert step.failed() is True


def test_ranks_disagreeing_on_adaptive_fail_with_a_clear_error():
    for message in per_rank("mismatch"):
        assert "adaptive" in message and "disagree" in message


@needs_cuda
def test_cuda_times_with_events_and_never_syncs():
    (r,) = GROUPS.values(1, "cuda", "cuda")
    assert r["bad"] == []
    assert r["decisions"] >= 2
    for row in r["rows"]:
        assert row["decision"] in (P, C)
        assert all(v > 0 for v in row["estimated_step_ms"].values()), row


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
        ("q8", {"adaptive": True, "adaptive_every": 0}, ValueError, "adaptive_every must be >="),
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
    state.adaptive.next_round = 15
    sd = state.state_dict()
    again = ddpcomm.CompressionState("q8,adaptive", adaptive_every=7)
    again.load_state_dict(sd)
    assert again.adaptive.decisions == state.adaptive.decisions
    assert again.adaptive.next_round == 15
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
