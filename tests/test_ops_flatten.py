"""Multi-tensor flatten / flatten_into / unflatten_into on every device: byte-identical to
reference.py (torch's own _flatten_dense_tensors layout) over lists mixing odd sizes, empty
and 0-dim tensors, strided views and narrow dtypes, lists longer than one CUDA launch's
table; opcheck, tracing, fakes, bad inputs."""

from __future__ import annotations

import doctest

import pytest
import torch

from ddpcomm import ops, reference

# Crosses the native op's per-thread grain (256 KiB) and cache-line splits at odd offsets.
ODD = [0, 1, 3, 17, 4095, 4097, 278011]

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def _random(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point or dtype.is_complex:
        # Raw random bits would include NaN payloads that torch.equal treats as unequal.
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)


def _mixed_list(dtype, seed=0, device="cpu"):
    """Odd sizes, 0-element tensors, a 0-dim scalar and several kinds of views (made on
    `device`, so they stay views there)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(shape):
        return _random(shape, dtype, gen).to(device)

    base = rnd((37, 23))
    big = rnd((3, 278011))
    return (
        [rnd((n,)) for n in ODD]
        + [
            rnd(()),  # 0-dim
            rnd((0, 5)),
            base.t(),  # transposed
            base[3:30:4, 1::3],  # strided slice with a storage offset
            base[5],  # contiguous row at an offset
            big[:, 1:],  # non-contiguous rows of a big tensor
            rnd((4, 1)).expand(4, 9),  # stride-0 reads
            base.narrow(1, 2, 7).contiguous().view(7, 37),
        ]
    )


def _cpu(tensors):
    return [t.cpu() for t in tensors]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (on any devices): compares bytes, so -0.0 vs 0.0 or NaN payloads
    would differ."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.cpu().contiguous().reshape(-1), b.cpu().contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flatten_matches_reference(device, dtype):
    tensors = _mixed_list(dtype, device=device)
    got = ops.flatten(tensors)
    assert got.is_contiguous() and got.dim() == 1 and got.device.type == device
    assert _bits_equal(got, reference.flatten(_cpu(tensors)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
def test_flatten_into_out_matches_reference(device, dtype):
    tensors = _mixed_list(dtype, seed=1, device=device)
    total = sum(t.numel() for t in tensors)
    # `out` is a view at an odd offset inside a larger buffer: the bytes around it stay put.
    storage = torch.full((total + 11,), 7, dtype=torch.float64).to(dtype).to(device)
    out = storage[5 : 5 + total]
    assert ops.flatten(tensors, out=out) is out
    assert _bits_equal(out, reference.flatten(_cpu(tensors)))
    assert (storage[:5] == 7).all() and (storage[5 + total :] == 7).all()


def test_flatten_single_huge_and_many_small(device):
    # The two shapes the byte-split exists for; both must equal torch's layout exactly.
    gen = torch.Generator().manual_seed(2)
    huge = [torch.randn(2**20 + 3, generator=gen)]
    small = [
        torch.randn(int(n), generator=gen) for n in torch.randint(0, 700, (1000,), generator=gen)
    ]
    for tensors in (huge, small):
        got = ops.flatten([t.to(device) for t in tensors])
        assert _bits_equal(got, torch._utils._flatten_dense_tensors(tensors))


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.bool, torch.float64],
    ids=str,
)
@pytest.mark.parametrize("count", [1, 40, 1000, 2500])
def test_flatten_long_lists(device, dtype, count):
    # Pieces at every alignment, and (CUDA) lists longer than one launch's table of 1800.
    gen = torch.Generator().manual_seed(count)
    sizes = torch.randint(0, 5000, (count,), generator=gen).tolist()
    tensors = [_random((n,), dtype, gen).to(device) for n in sizes] + _mixed_list(dtype, 7, device)
    got = ops.flatten(tensors)
    assert _bits_equal(got, reference.flatten(_cpu(tensors)))
    back = [torch.zeros_like(t) for t in tensors]
    back[-6] = torch.zeros(37, 23, dtype=dtype, device=device).t()  # a non-contiguous target
    ops.unflatten_into(got, back)
    assert all(_bits_equal(a, b) for a, b in zip(back, tensors, strict=True))


def test_flatten_same_bits_on_one_thread():
    tensors = _mixed_list(torch.float32, seed=3)
    two = ops.flatten(tensors)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = ops.flatten(tensors)
    finally:
        torch.set_num_threads(threads)
    assert _bits_equal(one, two)


def test_flatten_resolves_conjugate_and_negative_views(device):
    z = torch.randn(6, dtype=torch.complex64, device=device)
    views = [z.conj(), torch.randn(3, dtype=torch.complex64, device=device)._neg_view(), z]
    assert views[0].is_conj() and views[1].is_neg()
    assert _bits_equal(ops.flatten(views), reference.flatten(views))


def test_conjugate_destinations_are_refused_by_torch(device):
    # torch's conjugate fallback runs before any kernel and refuses mutable conj lists.
    d = torch.zeros(2, dtype=torch.complex64, device=device).conj()
    with pytest.raises(RuntimeError, match="materialize"):
        ops.unflatten_into(torch.ones(2, dtype=torch.complex64, device=device), [d])
    assert torch.equal(d, torch.zeros(2, dtype=torch.complex64, device=device))


def test_flatten_empty_list_into_empty_out(device):
    out = torch.empty(0, dtype=torch.float16, device=device)
    assert ops.flatten([], out=out) is out
    empties = (torch.empty(0, device=device), torch.empty(0, 3, device=device))
    assert ops.flatten(empties, out=torch.empty(0, device=device)).numel() == 0


def _destinations(dtype, seed, device="cpu"):
    """Writable destinations: contiguous, strided, interleaved columns, 0-element, 0-dim."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(shape):
        return _random(shape, dtype, gen).to(device)

    mat = rnd((41, 13))
    big = rnd((2, 300001))
    return (
        [rnd((n,)) for n in ODD]
        + [
            rnd(()),
            mat[:, 0],  # the columns of one matrix interleave in memory
            mat[:, 1],
            mat[2:40:3, 4:],
            mat.t()[5:],
            big[:, ::2],
            rnd((0,)),
        ]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int16])
def test_unflatten_into_matches_reference(device, dtype):
    native = _destinations(dtype, seed=4, device=device)
    ref = _destinations(dtype, seed=4)  # the same values, separate storage
    gen = torch.Generator().manual_seed(5)
    flat = _random((sum(t.numel() for t in native),), dtype, gen)
    # Snapshot every base so the elements no destination covers are checked too.
    bases = {id(t._base): t._base for t in native if t._base is not None}
    untouched = {k: b.clone() for k, b in bases.items()}
    ops.unflatten_into(flat.to(device), native)
    reference.unflatten_into(flat, ref)
    for a, b in zip(native, ref, strict=True):
        assert _bits_equal(a, b)
    covered = {k: torch.zeros(b.shape, dtype=torch.bool) for k, b in bases.items()}
    for t in native:
        if t._base is not None:
            # Mark the destination's elements in its base via the same view of a bool base.
            mask = covered[id(t._base)].as_strided(t.shape, t.stride(), t.storage_offset())
            mask.fill_(True)
    for k, b in bases.items():
        assert _bits_equal(b.cpu()[~covered[k]], untouched[k].cpu()[~covered[k]])


def test_round_trip_many_small_and_one_huge(device):
    gen = torch.Generator().manual_seed(6)
    for tensors in (
        [torch.randn(int(n), generator=gen).half() for n in torch.randint(0, 900, (1000,))],
        [torch.randn(2**20 + 3, generator=gen)],
    ):
        tensors = [t.to(device) for t in tensors]
        flat = ops.flatten(tensors)
        back = [torch.empty_like(t) for t in tensors]
        ops.unflatten_into(flat, back)
        assert all(_bits_equal(a, b) for a, b in zip(tensors, back, strict=True))


def test_unflatten_into_empty_list(device):
    ops.unflatten_into(torch.empty(0, device=device), [])


def test_opcheck(device):
    from torch.library import opcheck

    def rnd(*shape):
        return torch.randn(shape, device=device)

    lists = [
        [rnd(3, 4), rnd(0), rnd(5)],
        [rnd(2, 3).t(), rnd(), rnd(7).half().float()],
    ]
    for tensors in lists:
        total = sum(t.numel() for t in tensors)
        opcheck(torch.ops.ddpcomm.flatten.default, (tensors,))
        opcheck(torch.ops.ddpcomm.flatten_into.default, (tensors, rnd(total)))
        opcheck(torch.ops.ddpcomm.unflatten_into.default, (rnd(total), tensors))


def test_traces_under_compile(device):
    def step(a, b, out):
        ops.flatten([a, b], out=out)
        out.mul_(2)
        ops.unflatten_into(out, [a, b])
        return a, b

    a, b = torch.randn(3, 2, device=device), torch.randn(5, device=device)
    out = torch.empty(11, device=device)
    ea, eb = a * 2, b * 2
    got_a, got_b = torch.compile(step, backend="aot_eager", fullgraph=True)(a, b, out)
    assert torch.equal(got_a, ea) and torch.equal(got_b, eb)


def test_fake_tensors_give_the_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        flat = ops.flatten(
            [torch.empty(3, 4, dtype=torch.bfloat16), torch.empty(5, dtype=torch.bfloat16)]
        )
    assert flat.shape == (17,) and flat.dtype == torch.bfloat16


# --------------------------------------------------------------------------------------
# Bad inputs: the error type and a message naming the argument, inputs left untouched.
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "exc", "match"),
    [
        (
            lambda: ops.flatten([torch.ones(2), 3]),
            TypeError,
            r"tensors\[1\] must be a torch.Tensor",
        ),
        (lambda: ops.flatten(torch.ones(2, 2)), TypeError, "tensors must be a list or tuple"),
        (lambda: ops.flatten({torch.ones(1)}), TypeError, "tensors must be a list or tuple"),
        (lambda: ops.flatten([]), ValueError, "tensors must not be empty"),
        (
            lambda: ops.flatten([torch.ones(2), torch.ones(2, dtype=torch.float16)]),
            TypeError,
            r"tensors\[1\] has dtype Half but tensors\[0\] has Float",
        ),
        (lambda: ops.flatten([torch.ones(2)], out=torch.empty(3)), ValueError, "out must have 2"),
        (lambda: ops.flatten([torch.ones(2)], out=[0.0, 0.0]), TypeError, "out must be a torch"),
        (
            lambda: ops.flatten([torch.ones(2)], out=torch.empty(2, dtype=torch.float64)),
            TypeError,
            r"tensors\[0\] has dtype Float but out has Double",
        ),
        (
            lambda: ops.flatten([torch.ones(4)], out=torch.empty(2, 2)),
            ValueError,
            "out must be 1-D",
        ),
        (
            lambda: ops.flatten([torch.ones(4)], out=torch.empty(8)[::2]),
            ValueError,
            "out must be contiguous",
        ),
        (
            lambda: ops.flatten([torch.ones(2), torch.ones(2, device="meta")]),
            ValueError,
            r"tensors\[1\] is on meta but tensors\[0\] is on cpu",
        ),
        (
            lambda: ops.unflatten_into(torch.empty(3, device="meta"), [torch.ones(3)]),
            ValueError,
            r"tensors\[0\] is on cpu but flat is on meta",
        ),
        (
            lambda: ops.unflatten_into([1.0], [torch.ones(1)]),
            TypeError,
            "flat must be a torch.Tensor",
        ),
        (
            lambda: ops.unflatten_into(torch.ones(1), ["x"]),
            TypeError,
            r"tensors\[0\] must be a torch",
        ),
        # Sparse tensors: ddpcomm's error, not the dispatcher's "no SparseCPU kernel".
        (
            lambda: ops.flatten([torch.ones(2), torch.ones(3).to_sparse()]),
            TypeError,
            r"flatten: tensors\[1\] must be a strided \(dense\) tensor, got layout Sparse",
        ),
        (
            lambda: ops.flatten([torch.eye(3).to_sparse_csr()], out=torch.empty(9)),
            TypeError,
            r"tensors\[0\] must be a strided \(dense\) tensor, got layout SparseCsr",
        ),
        (
            lambda: ops.flatten([torch.ones(3)], out=torch.zeros(3).to_sparse()),
            TypeError,
            "flatten_into: out must be a strided",
        ),
        (
            lambda: ops.unflatten_into(torch.ones(3).to_sparse(), [torch.ones(3)]),
            TypeError,
            "unflatten_into: flat must be a strided",
        ),
        (
            lambda: ops.unflatten_into(torch.ones(3), [torch.zeros(3).to_sparse()]),
            TypeError,
            r"unflatten_into: tensors\[0\] must be a strided",
        ),
    ],
)
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_flatten_into_refuses_out_overlapping_an_input(device):
    buf = torch.arange(8.0, device=device)
    before = buf.clone()
    with pytest.raises(ValueError, match=r"tensors\[1\] shares memory with out"):
        ops.flatten([torch.ones(2, device=device), buf[3:5]], out=buf[4:8])
    with pytest.raises(ValueError, match="shares memory with out"):
        ops.flatten([buf[:3]], out=buf[:3])
    assert torch.equal(buf, before)


def test_flatten_one_dtype_and_one_device_per_call(device):
    a = torch.zeros(3, device=device)
    with pytest.raises(TypeError, match="one call handles one dtype"):
        ops.flatten([a, a.half()])
    other = torch.zeros(3, device="meta" if device == "cpu" else "cpu")
    with pytest.raises(ValueError, match="one call handles one device"):
        ops.flatten([a, other])


def _assert_unflatten_refused(flat, tensors, exc, match):
    before = [t.clone() for t in tensors]
    with pytest.raises(exc, match=match):
        ops.unflatten_into(flat, tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before, strict=True))


def test_unflatten_into_bad_destinations_leave_them_untouched(device):
    def z(*shape, **kw):
        return torch.zeros(*shape, device=device, **kw)

    def o(*shape, **kw):
        return torch.ones(*shape, device=device, **kw)

    m = z(4, 4)
    _assert_unflatten_refused(
        o(5), [z(2), m.view(-1)[3:7]], ValueError, "flat must have 6 elements"
    )
    _assert_unflatten_refused(
        o(6),
        [m[0, :3], m.view(-1)[2:5]],
        ValueError,
        r"tensors\[0\] and tensors\[1\] share",
    )
    _assert_unflatten_refused(
        o(8),
        [z(2), z(1, 3).expand(2, 3)],
        ValueError,
        r"tensors\[1\] has elements that share memory",
    )
    _assert_unflatten_refused(
        m.view(-1)[:6], [m[2], m[1, :2]], ValueError, r"tensors\[1\] shares memory with flat"
    )
    _assert_unflatten_refused(
        o(3, dtype=torch.float16),
        [z(3)],
        TypeError,
        r"tensors\[0\] has dtype Float but flat has Half",
    )
    _assert_unflatten_refused(o(2, 2), [z(4)], ValueError, "flat must be 1-D")


def test_docstring_examples_run():
    for fn in (ops.flatten, ops.unflatten_into, ops.quantize, ops.topk_compress):
        for test in doctest.DocTestFinder().find(fn):
            result = doctest.DocTestRunner().run(test)
            assert result.failed == 0, f"{fn.__name__} docstring example failed"
