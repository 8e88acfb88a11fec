"""ddpcomm.all_reduce / all_reduce_coalesced on spawned gloo groups, N = 1..4.

Each world size is one spawn running every check (spawning dominates the cost); ranks
assert locally and return their outputs so the parent can check they agree bit for bit.

A note on "bitwise equal to per-tensor dist.all_reduce": gloo's ring sums an element's N
contributions in an order set by the element's position in the buffer, so a flattened
reduction and per-tensor reductions of floats round differently once N >= 3 (with N <= 2
the one addition commutes). The coalesced results are therefore checked bitwise against
dist.all_reduce of the same flat buffer (what torch's own coalesced path reduces), bitwise
per tensor for N <= 2 and for integers at any N, and to float rounding per tensor.
"""

from __future__ import annotations

import doctest
import time

import pytest
import torch
import torch.distributed as dist

from ddpcomm import build_info
from tests.dist_utils import run_ranks

WORLDS = [1, 2, 3, 4]


def _inputs(rank: int, seed: int = 0) -> list[torch.Tensor]:
    """Mixed dtypes, shapes and strides; every rank can rebuild any rank's inputs."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    m = torch.randn(9, 7, generator=g)
    return [
        torch.randn(3, 5, generator=g),
        torch.randn(1000, generator=g).half(),
        m.t(),  # non-contiguous
        torch.randint(-50, 50, (6,), generator=g),
        torch.randn((), generator=g),  # 0-dim
        torch.randn(0, 4, generator=g),  # empty
        torch.randn(257, generator=g).bfloat16(),
        m[::2, 1:],  # non-contiguous, storage offset
        torch.randn(4097, generator=g),
    ]


def _flat_reference(tensors, op):
    """What torch's coalesced path computes: per dtype, flatten, one all_reduce, unflatten."""
    out = [t.clone() for t in tensors]
    for dtype in dict.fromkeys(t.dtype for t in out):
        members = [t for t in out if t.dtype == dtype]
        flat = torch._utils._flatten_dense_tensors(members)
        if op == "mean":
            flat.mul_(1.0 / dist.get_world_size())
        dist.all_reduce(flat)
        for t, v in zip(members, torch._utils._unflatten_dense_tensors(flat, members), strict=True):
            t.copy_(v)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _check_lossless(rank, world):
    import ddpcomm

    # all_reduce, op="sum": exactly dist.all_reduce, contiguous or not, any dtype.
    for t in _inputs(rank):
        ref = t.clone()
        dist.all_reduce(ref)
        ddpcomm.all_reduce(t, op="sum")
        assert _same_bits(t, ref), t.dtype
    # op="mean" / ReduceOp.AVG: scale by 1/N, then sum (DDP's reducer, bit for bit).
    for op in ("mean", dist.ReduceOp.AVG):
        for t in _inputs(rank, seed=1):
            if not t.dtype.is_floating_point:
                continue
            ref = t.clone().mul_(1.0 / world)
            dist.all_reduce(ref)
            ddpcomm.all_reduce(t, op=op)
            assert _same_bits(t, ref), (op, t.dtype)
    # Other ReduceOps pass through for "none".
    t = _inputs(rank, seed=2)[0]
    ref = t.clone()
    dist.all_reduce(ref, op=dist.ReduceOp.MAX)
    ddpcomm.all_reduce(t, op=dist.ReduceOp.MAX)
    assert _same_bits(t, ref)

    # all_reduce_coalesced: one all_reduce per dtype group.
    results = {}
    for op in ("sum", "mean"):
        tensors = _inputs(rank, seed=3)
        float_or_int = [t for t in tensors if t.dtype.is_floating_point or op == "sum"]
        ref_flat = _flat_reference(float_or_int, op)
        ref_each = [t.clone() for t in float_or_int]
        for r in ref_each:
            if op == "mean":
                r.mul_(1.0 / world)
            dist.all_reduce(r)
        calls = []
        real = dist.all_reduce

        def counting(*args, _real=real, _calls=calls, **kwargs):
            _calls.append(args[0].dtype)
            return _real(*args, **kwargs)

        dist.all_reduce = counting
        try:
            ddpcomm.all_reduce_coalesced(float_or_int, op=op)
        finally:
            dist.all_reduce = real
        assert calls == list(dict.fromkeys(t.dtype for t in float_or_int)), calls
        for t, a, b in zip(float_or_int, ref_flat, ref_each, strict=True):
            assert _same_bits(t, a), (op, t.dtype)
            if world <= 2 or not t.dtype.is_floating_point:
                assert _same_bits(t, b), (op, t.dtype)
            else:
                assert torch.allclose(t.double(), b.double(), rtol=1e-2, atol=1e-2), t.dtype
        results[op] = float_or_int

    # Async handles: complete, hand back the very tensors, values as the sync call.
    tensors = _inputs(rank, seed=4)
    expected = _flat_reference(tensors, "sum")
    handle = ddpcomm.all_reduce_coalesced(tensors, op="sum", async_op=True)
    assert handle.wait() is True and handle.is_completed()
    assert all(a is b for a, b in zip(handle.get_future().value(), tensors, strict=True))
    assert all(_same_bits(a, b) for a, b in zip(tensors, expected, strict=True))
    t = torch.full((5, 2), float(rank)).t()
    handle = ddpcomm.all_reduce(t, async_op=True)
    assert handle.get_future().wait()[0] is t
    assert torch.equal(t, torch.full((2, 5), (world - 1) / 2))
    # Empty input lists and all-empty groups issue nothing and complete at once.
    assert ddpcomm.all_reduce_coalesced([], async_op=True).wait()
    assert ddpcomm.all_reduce_coalesced([torch.empty(0)], "q8") is None
    return results


def _float_groups(rank, seed):
    """The float inputs of one rank, flattened per dtype as all_reduce_coalesced does."""
    floats = [t for t in _inputs(rank, seed) if t.dtype.is_floating_point]
    groups = {}
    for t in floats:
        groups.setdefault(t.dtype, []).append(t)
    return floats, [torch._utils._flatten_dense_tensors(ts) for ts in groups.values()]


def _quantizer_step(flats, bits, block=256):
    """Per element, the mean over ranks of its block's quantization step absmax / L.

    The result is within one such step of the exact mean: at most half a step from each
    rank's phase-1 quantization (averaged), at most half a step from re-quantizing the
    reduced block in the two-phase algorithm (whose absmax is at most the mean absmax).
    """
    lmax = (1 << (bits - 1)) - 1
    steps = []
    for x in flats:
        x = x.double()
        padded = torch.cat([x, x.new_zeros(-x.numel() % block)]).view(-1, block)
        steps.append((padded.abs().amax(1) / lmax).repeat_interleave(block)[: x.numel()])
    return torch.stack(steps).mean(0)


def _check_lossy(rank, world):
    import ddpcomm
    from ddpcomm import compressors

    outputs = {}
    every = [_float_groups(r, 5)[1] for r in range(world)]  # [rank][group] flat inputs
    for spec in ("fp16", "bf16", "q8", "q4"):
        for op in ("mean", "sum"):
            floats, _ = _float_groups(rank, 5)
            ddpcomm.all_reduce_coalesced(floats, compression=spec, op=op)
            scale = world if op == "sum" else 1
            for g, got in enumerate(_float_groups_of(floats)):
                flats = [every[r][g] for r in range(world)]
                exact = torch.stack([f.double() for f in flats]).mean(0) * scale
                err = (got.double() - exact).abs()
                out_eps = {torch.float32: 2.0**-24, torch.float16: 2.0**-11}.get(got.dtype, 2.0**-8)
                if spec in ("fp16", "bf16"):
                    # x/N rounded once per rank, N-1 additions, the cast back, the * N: each
                    # at most eps of the largest |x| among the ranks, plus subnormal steps.
                    eps = max(2.0**-11 if spec == "fp16" else 2.0**-8, out_eps)
                    peak = torch.stack([f.double().abs() for f in flats]).amax(0)
                    bound = (world + 2) * eps * peak * scale + 1e-7 * scale
                else:
                    bound = scale * _quantizer_step(flats, int(spec[1:]))
                    # fp32 accumulation, then the output dtype's rounding (and the * N).
                    bound = bound + 2 * out_eps * exact.abs() + 1e-6
                assert bool((err <= bound).all()), (spec, op, g, float((err - bound).max()))
            outputs[(spec, op)] = floats
    # Constant tensors reduce exactly with every quantizer, error feedback or not.
    for spec in ("q8", "q4", "q2", "q1"):
        t = torch.full((3000,), 0.75 * (rank + 1))
        ddpcomm.all_reduce(t, compression=spec)
        assert torch.equal(t, torch.full((3000,), 0.75 * (world + 1) / 2)), spec
        outputs[(spec, "const")] = [t]
    # Async lossy calls give what the sync ones give (deterministic rounding).
    sync, _ = _float_groups(rank, 6)
    ddpcomm.all_reduce_coalesced(sync, compression="q4")
    tensors, _ = _float_groups(rank, 6)
    handle = ddpcomm.all_reduce_coalesced(tensors, compression="q4", async_op=True)
    assert handle.wait() and handle.get_future().value() == tensors
    assert all(_same_bits(a, b) for a, b in zip(tensors, sync, strict=True))
    # A compressor object works; so does a lossy all_reduce of a non-contiguous tensor.
    q = compressors.parse("q8", block_size=64)
    t = torch.full((8, 4), float(rank)).t()
    ddpcomm.all_reduce(t, compression=q, op="sum")
    assert torch.equal(t, torch.full((4, 8), float(world * (world - 1) // 2)))
    return outputs


def _float_groups_of(tensors):
    groups = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return [torch._utils._flatten_dense_tensors(ts) for ts in groups.values()]


def _wire(outputs: dict) -> dict:
    """Tensors as (dtype, shape, bytes): what crosses the result queue after the rank exits
    (torch would send a shared-memory handle that dies with the process)."""
    return {
        k: [(str(t.dtype), tuple(t.shape), _bits(t).numpy().tobytes()) for t in ts]
        for k, ts in outputs.items()
    }


def _rank_body(rank, world):
    torch.manual_seed(0)
    return {
        "lossless": _wire(_check_lossless(rank, world)),
        "lossy": _wire(_check_lossy(rank, world)),
    }


def _assert_ranks_identical(results):
    for other in results[1:]:
        for part in ("lossless", "lossy"):
            for key, tensors in results[0][part].items():
                assert tensors == other[part][key], (part, key)


@pytest.mark.parametrize("world", WORLDS)
def test_wrappers_on_gloo(world):
    _assert_ranks_identical(run_ranks(_rank_body, world))


# --------------------------------------------------------------------------------------
# Repeated calls: checked through the store once per signature and group, then at calls
# 1, 2, 4, 8, ... (the failures this leaves are tested in tests/test_agreement.py)
# --------------------------------------------------------------------------------------


def _repeated_body(rank, world):
    import ddpcomm
    from ddpcomm import agreement

    g = dist.new_group(list(range(world)))
    mean = 0.75 * (world + 1) / 2  # of 0.75 * (rank + 1): exact in every method below
    for _ in range(70 // 3 + 1):
        t = torch.full((1000,), 0.75 * (rank + 1))
        ddpcomm.all_reduce(t, "q8", group=g)
        assert torch.equal(t, torch.full_like(t, mean))
        ts = [torch.full((3,), 0.75 * (rank + 1)), torch.full((4,), rank + 1, dtype=torch.int32)]
        ddpcomm.all_reduce_coalesced(ts, "none", op="sum", group=g)
        assert torch.equal(ts[0], torch.full((3,), mean * world))
        assert torch.equal(ts[1], torch.full((4,), world * (world + 1) // 2, dtype=torch.int32))
        t = torch.full((10,), 0.75 * (rank + 1), dtype=torch.float16)
        ddpcomm.all_reduce(t, "fp16", group=g, async_op=True).wait()
        assert torch.equal(t, torch.full_like(t, mean))
    ch = agreement.channel(g)
    # 72 calls of 3 kinds: checked when new (calls 1-3) and at calls 4, 8, 16, 32, 64.
    assert (ch.steps, ch.seq, len(ch.agreed)) == (72, 8, 3), (ch.steps, ch.seq)

    # Per group: a signature agreed on g is checked again on another group, and a
    # mismatch there is refused on every rank.
    g2 = dist.new_group(list(range(world)))
    odd = rank == world - 1
    with pytest.raises(ValueError, match="ranks disagree.*compression:"):
        ddpcomm.all_reduce(torch.ones(1000), "q4" if odd else "q8", group=g2)

    # No false alarm from a rank that runs ahead: lossy calls of empty tensors send
    # nothing, so rank 0 reaches each scheduled check (and opens it) while the others
    # still repeat earlier calls; they must not join it before their own step gets there.
    g4 = dist.new_group(list(range(world)))
    if rank:
        time.sleep(0.3)
    for _ in range(200):
        ddpcomm.all_reduce(torch.ones(0), "q8", group=g4)
    assert agreement.channel(g4).seq == 8  # steps 1, 2, 4, ..., 128

    # A signature evicted from the cache is new again, alike on every rank.
    g3 = dist.new_group(list(range(world)))
    size, agreement.CACHE_SIZE = agreement.CACHE_SIZE, 2
    try:
        for n in (100, 200, 300) * 3:
            ddpcomm.all_reduce(torch.ones(n), "q8", group=g3)
    finally:
        agreement.CACHE_SIZE = size
    assert agreement.channel(g3).seq == 9


@pytest.mark.parametrize("world", [2, 3])
def test_repeated_calls_are_checked_once_per_signature(world):
    run_ranks(_repeated_body, world)


# --------------------------------------------------------------------------------------
# Steady state: lossy calls reuse the group's buffers and learn the link, as hooks do
# (context.WorkspacePool says why: page faults and gloo piece sizes)
# --------------------------------------------------------------------------------------


def _workspace_body(rank, world):
    import ddpcomm
    from ddpcomm import compressors, wrappers
    from ddpcomm.context import LinkRate, WorkspacePool

    g = dist.new_group(list(range(world)))
    # The all-gather algorithm at any N: its pieces follow the link (context.LinkRate).
    q8 = compressors.Quantizer(8, algorithm="all_gather", error_feedback=False)
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(rank))
    want = x.clone()
    ddpcomm.all_reduce(want, q8, group=g)
    pool = wrappers._POOLS[g]
    first = pool.allocations
    assert first >= 2  # its payload and gather buffers
    calls = LinkRate.FIRST + 2
    for _ in range(calls - 1):
        t = x.clone()
        ddpcomm.all_reduce(t, q8, group=g)
        assert torch.equal(t, want)
    assert pool.allocations == first  # no buffer allocated after the first call
    ((links, buffers),) = pool._entries.values()
    link = links[0]  # job 0's
    assert link.calls == calls and link.as_dict()["agreed_MB_per_s"] is not None
    # Async calls of one signature in flight together: each gets its own buffers.
    a, b = x.clone(), x.clone()
    handles = [ddpcomm.all_reduce(t, q8, group=g, async_op=True) for t in (a, b)]
    assert all(h.wait() for h in handles)
    assert torch.equal(a, want) and torch.equal(b, want)
    steady = pool.allocations
    t = x.clone()
    ddpcomm.all_reduce(t, q8, group=g)
    assert pool.allocations == steady and torch.equal(t, want)
    # Coalesced: one job per dtype, each with its own key in the call's Workspace.
    tensors = [torch.ones(5000), torch.ones(3000, dtype=torch.float16), torch.ones(7000)]
    ddpcomm.all_reduce_coalesced(tensors, "q4", group=g)
    steady = pool.allocations
    for _ in range(3):
        ddpcomm.all_reduce_coalesced(tensors, "q4", group=g)
    assert pool.allocations == steady
    assert all(bool((t == 1).all()) for t in tensors)

    # Bounded: LinkRates of the last SIGNATURES signatures, buffers up to BYTES beyond the
    # latest signature's. Each size below is a new signature.
    bounds = WorkspacePool.SIGNATURES, WorkspacePool.BYTES
    WorkspacePool.SIGNATURES, WorkspacePool.BYTES = 3, 100_000
    try:
        g2 = dist.new_group(list(range(world)))
        for n in (1000, 20_000, 40_000, 60_000, 80_000, 20_000):
            ddpcomm.all_reduce(torch.ones(n), q8, group=g2)
            pool2 = wrappers._POOLS[g2]
            assert len(pool2._entries) <= 3
            latest = next(reversed(pool2._entries.values()))[1]
            assert pool2.nbytes() <= 100_000 + sum(b.numel() for b in latest.values())
        # 20_000 was evicted after 3 newer signatures: its LinkRate started over.
        assert next(reversed(pool2._entries.values()))[0][0].calls == 1
    finally:
        WorkspacePool.SIGNATURES, WorkspacePool.BYTES = bounds
    return [link.calls, link.as_dict()["agreed_MB_per_s"]]


@pytest.mark.parametrize("world", [2, 3])
def test_steady_state_calls_reuse_buffers_and_learn_the_link(world):
    results = run_ranks(_workspace_body, world)
    assert all(r == results[0] for r in results), results  # one agreed rate everywhere


# --------------------------------------------------------------------------------------
# Bad inputs, the hook parity and the docstring examples: one 2-rank spawn
# --------------------------------------------------------------------------------------


def _refused(call, exc, match, *watched):
    before = [t.clone() for t in watched]
    with pytest.raises(exc, match=match):
        call()
    assert all(_same_bits(a, b) for a, b in zip(watched, before, strict=True)), match


def _check_bad_inputs(rank, world):
    import ddpcomm
    from ddpcomm import compressors

    x, y = torch.randn(4), torch.arange(3)
    _refused(lambda: ddpcomm.all_reduce(3.0), TypeError, "tensor must be a torch.Tensor")
    _refused(lambda: ddpcomm.all_reduce_coalesced([x, "g"]), TypeError, r"tensors\[1\] must be", x)
    _refused(lambda: ddpcomm.all_reduce_coalesced(x), TypeError, "list or tuple", x)
    _refused(
        lambda: ddpcomm.all_reduce_coalesced([x, torch.ones(2, device="meta")]),
        ValueError,
        r"tensors\[1\] is on meta but tensors\[0\] is on cpu",
        x,
    )
    _refused(
        lambda: ddpcomm.all_reduce_coalesced([x, y], "q8"),
        TypeError,
        r"tensors\[1\] has dtype torch.int64",
        x,
        y,
    )
    _refused(lambda: ddpcomm.all_reduce(y, "fp16"), TypeError, "torch.int64", y)
    _refused(lambda: ddpcomm.all_reduce(y), TypeError, "op='mean' needs a floating", y)
    _refused(lambda: ddpcomm.all_reduce(x, op="max"), ValueError, "op must be 'sum', 'mean'", x)
    _refused(lambda: ddpcomm.all_reduce(x, op=3), TypeError, "op must be", x)
    _refused(
        lambda: ddpcomm.all_reduce_coalesced([x], "q4", op=dist.ReduceOp.MAX),
        ValueError,
        "not supported by lossy compression",
        x,
    )
    _refused(lambda: ddpcomm.all_reduce(x, "q3"), ValueError, "unknown compression spec", x)
    _refused(
        lambda: ddpcomm.all_reduce(x, compressors.parse("q2")), ValueError, "error_feedback on", x
    )
    _refused(lambda: ddpcomm.all_reduce(x, compression=8), TypeError, "compression must be", x)
    _refused(lambda: ddpcomm.all_reduce(x, async_op="yes"), TypeError, "async_op must be", x)
    _refused(lambda: ddpcomm.all_reduce(x, group="world"), TypeError, "group must be", x)
    # Entries sharing memory cannot both be written back: refused at the write-back,
    # after the (matching) collective on every rank, before any entry is written.
    _refused(
        lambda: ddpcomm.all_reduce_coalesced([x, x[1:3]], op="sum"),
        ValueError,
        r"tensors\[0\] and tensors\[1\] share memory",
        x,
    )
    # A lossy call where one rank's tensor is empty: a clear error on every rank (the size
    # check runs before the empty rank could return), not a hang.
    z = torch.ones(0 if rank == 0 else 300)
    _refused(lambda: ddpcomm.all_reduce(z, "q8"), ValueError, "ranks disagree", z)
    # No refused call left a collective unmatched: the ranks are still in step.
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    assert t.item() == world * (world - 1) / 2


def _check_hook_parity(rank, world):
    """DDP with ddpcomm.allreduce_hook gives the gradients all_reduce_coalesced gives."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpcomm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    local = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    local.load_state_dict(model.state_dict())
    ddp = DDP(model, bucket_cap_mb=0.0005)
    ddp.register_comm_hook(None, ddpcomm.allreduce_hook)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank))
    ddp(x).square().sum().backward()
    local(x).square().sum().backward()
    grads = [p.grad for p in local.parameters()]
    ddpcomm.all_reduce_coalesced(grads)
    for p, g in zip(ddp.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g) if world <= 2 else torch.allclose(p.grad, g)


def _check_parameters(rank, world):
    """Parameters that require grad are reduced in place (as dist.all_reduce does), with
    or without compression, sync or async, and keep requiring grad."""
    import ddpcomm

    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 2)
    for spec in ("none", "q8"):
        for async_op in (False, True):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(rank + 1))
            params = list(model.parameters())
            # Constant blocks on every rank: exact under q8 too.
            handle = ddpcomm.all_reduce_coalesced(params, spec, op="sum", async_op=async_op)
            if async_op:
                handle.wait()
            handle = ddpcomm.all_reduce(model.weight, spec, async_op=async_op)  # mean
            if async_op:
                handle.wait()
            total = world * (world + 1) / 2
            assert torch.equal(model.bias, torch.full((2,), total)), spec
            assert torch.equal(model.weight, torch.full((2, 3), total)), spec
            assert all(p.requires_grad and p.is_leaf for p in params)


def _check_groups_not_kept_alive(rank, world):
    import gc
    import weakref

    import ddpcomm

    # Per-group bookkeeping (call counts, verified configs, two-phase sequencers) must not
    # keep a destroyed process group alive.
    group = dist.new_group(list(range(world)))
    ddpcomm.all_reduce(torch.ones(512), "q8", group=group)
    two_phase = ddpcomm.compressors.Quantizer(8, algorithm="two_phase", error_feedback=False)
    ddpcomm.all_reduce(torch.ones(512), two_phase, group=group)
    ref = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    assert ref() is None


def _run_docstrings(rank, world):
    import ddpcomm

    for fn in (ddpcomm.all_reduce, ddpcomm.all_reduce_coalesced):
        for test in doctest.DocTestFinder().find(fn):
            assert doctest.DocTestRunner().run(test).failed == 0, fn.__name__


def _misc_body(rank, world):
    _check_bad_inputs(rank, world)
    _check_hook_parity(rank, world)
    _check_parameters(rank, world)
    _check_groups_not_kept_alive(rank, world)
    _run_docstrings(rank, world)


def test_bad_inputs_hook_parity_and_examples():
    run_ranks(_misc_body, 2)


def test_needs_an_initialized_group():
    import ddpcomm

    with pytest.raises(RuntimeError, match="init_process_group"):
        ddpcomm.all_reduce(torch.ones(2))


@pytest.mark.skipif(
    not torch.cuda.is_available() or not build_info()["cuda"],
    reason="needs a GPU and ddpcomm built with its CUDA ops",
)
def test_nccl_single_rank(tmp_path):
    """The NCCL path with CUDA tensors; one rank, so every reduction is the identity."""
    import ddpcomm

    dist.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        t = torch.randn(1000, device="cuda", generator=g)
        ref = t.clone()
        ddpcomm.all_reduce(t, op="sum")
        assert torch.equal(t, ref)
        tensors = [
            torch.randn(3, 4, device="cuda", generator=g),
            torch.randn(5, device="cuda", generator=g).half(),
            torch.randn(6, 7, device="cuda", generator=g).t(),
        ]
        refs = [x.clone() for x in tensors]
        handle = ddpcomm.all_reduce_coalesced(tensors, async_op=True)  # mean of one rank
        assert handle.wait() and handle.get_future().value() == tensors
        assert all(torch.equal(a, b) for a, b in zip(tensors, refs, strict=True))
        c = torch.full((3000,), 0.5, device="cuda")
        ddpcomm.all_reduce_coalesced([c], compression="q8")
        assert torch.equal(c, torch.full_like(c, 0.5))
    finally:
        dist.destroy_process_group()
