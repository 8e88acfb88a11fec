"""Native flatten / flatten_into / unflatten_into against reference.py, opcheck, bad inputs."""

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


def _mixed_list(dtype, seed=0):
    """Odd sizes, 0-element tensors, a 0-dim scalar and several kinds of views."""
    gen = torch.Generator().manual_seed(seed)
    base = _random((37, 23), dtype, gen)
    big = _random((3, 278011), dtype, gen)
    return (
        [_random((n,), dtype, gen) for n in ODD]
        + [
            _random((), dtype, gen),  # 0-dim
            _random((0, 5), dtype, gen),
            base.t(),  # transposed
            base[3:30:4, 1::3],  # strided slice with a storage offset
            base[5],  # contiguous row at an offset
            big[:, 1:],  # non-contiguous rows of a big tensor
            _random((4, 1), dtype, gen).expand(4, 9),  # stride-0 reads
            base.narrow(1, 2, 7).contiguous().view(7, 37),
        ]
    )


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality: compares bytes, so -0.0 vs 0.0 or NaN payloads would differ."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flatten_matches_reference(dtype):
    tensors = _mixed_list(dtype)
    got = ops.flatten(tensors)
    assert got.is_contiguous() and got.dim() == 1
    assert _bits_equal(got, reference.flatten(tensors))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
def test_flatten_into_out_matches_reference(dtype):
    tensors = _mixed_list(dtype, seed=1)
    total = sum(t.numel() for t in tensors)
    # `out` is a view at an odd offset inside a larger buffer: the bytes around it stay put.
    storage = torch.full((total + 11,), 7, dtype=torch.float64).to(dtype)
    out = storage[5 : 5 + total]
    assert ops.flatten(tensors, out=out) is out
    assert _bits_equal(out, reference.flatten(tensors))
    assert (storage[:5] == 7).all() and (storage[5 + total :] == 7).all()


def test_flatten_single_huge_and_many_small():
    # The two shapes the byte-split exists for; both must equal torch's layout exactly.
    gen = torch.Generator().manual_seed(2)
    huge = [torch.randn(2**20 + 3, generator=gen)]
    small = [
        torch.randn(int(n), generator=gen) for n in torch.randint(0, 700, (1000,), generator=gen)
    ]
    for tensors in (huge, small):
        assert _bits_equal(ops.flatten(tensors), torch._utils._flatten_dense_tensors(tensors))


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


def test_flatten_resolves_conjugate_and_negative_views():
    z = torch.randn(6, dtype=torch.complex64)
    views = [z.conj(), torch.randn(3, dtype=torch.complex64)._neg_view(), z]
    assert views[0].is_conj() and views[1].is_neg()
    assert _bits_equal(ops.flatten(views), reference.flatten(views))


def test_conjugate_destinations_are_refused_by_torch():
    # torch's conjugate fallback runs before any kernel and refuses mutable conj lists.
    d = torch.zeros(2, dtype=torch.complex64).conj()
    with pytest.raises(RuntimeError, match="materialize"):
        ops.unflatten_into(torch.ones(2, dtype=torch.complex64), [d])
    assert torch.equal(d, torch.zeros(2, dtype=torch.complex64))


def test_flatten_empty_list_into_empty_out():
    out = torch.empty(0, dtype=torch.float16)
    assert ops.flatten([], out=out) is out
    assert ops.flatten((torch.empty(0), torch.empty(0, 3)), out=torch.empty(0)).numel() == 0


def _destinations(dtype, seed):
    """Writable destinations: contiguous, strided, interleaved columns, 0-element, 0-dim."""
    gen = torch.Generator().manual_seed(seed)
    mat = _random((41, 13), dtype, gen)
    big = _random((2, 300001), dtype, gen)
    return (
        [_random((n,), dtype, gen) for n in ODD]
        + [
            _random((), dtype, gen),
            mat[:, 0],  # the columns of one matrix interleave in memory
            mat[:, 1],
            mat[2:40:3, 4:],
            mat.t()[5:],
            big[:, ::2],
            _random((0,), dtype, gen),
        ]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int16])
def test_unflatten_into_matches_reference(dtype):
    native = _destinations(dtype, seed=4)
    ref = _destinations(dtype, seed=4)  # the same values, separate storage
    gen = torch.Generator().manual_seed(5)
    flat = _random((sum(t.numel() for t in native),), dtype, gen)
    # Snapshot every base so the elements no destination covers are checked too.
    bases = {id(t._base): t._base for t in native if t._base is not None}
    untouched = {k: b.clone() for k, b in bases.items()}
    ops.unflatten_into(flat, native)
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
        assert _bits_equal(b[~covered[k]], untouched[k][~covered[k]])


def test_round_trip_many_small_and_one_huge():
    gen = torch.Generator().manual_seed(6)
    for tensors in (
        [torch.randn(int(n), generator=gen).half() for n in torch.randint(0, 900, (1000,))],
        [torch.randn(2**20 + 3, generator=gen)],
    ):
        flat = ops.flatten(tensors)
        back = [torch.empty_like(t) for t in tensors]
        ops.unflatten_into(flat, back)
        assert all(_bits_equal(a, b) for a, b in zip(tensors, back, strict=True))


def test_unflatten_into_empty_list():
    ops.unflatten_into(torch.empty(0), [])


def test_opcheck():
    from torch.library import opcheck

    lists = [
        [torch.randn(3, 4), torch.randn(0), torch.randn(5)],
        [torch.randn(2, 3).t(), torch.randn(()), torch.randn(7).half().float()],
    ]
    for tensors in lists:
        total = sum(t.numel() for t in tensors)
        opcheck(torch.ops.ddpcomm.flatten.default, (tensors,))
        opcheck(torch.ops.ddpcomm.flatten_into.default, (tensors, torch.empty(total)))
        opcheck(torch.ops.ddpcomm.unflatten_into.default, (torch.randn(total), tensors))


def test_traces_under_compile():
    def step(a, b, out):
        ops.flatten([a, b], out=out)
        out.mul_(2)
        ops.unflatten_into(out, [a, b])
        return a, b

    a, b, out = torch.randn(3, 2), torch.randn(5), torch.empty(11)
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
    ],
)
def test_bad_arguments(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_flatten_into_refuses_out_overlapping_an_input():
    buf = torch.arange(8.0)
    before = buf.clone()
    with pytest.raises(ValueError, match=r"tensors\[1\] shares memory with out"):
        ops.flatten([torch.ones(2), buf[3:5]], out=buf[4:8])
    assert torch.equal(buf, before)


def _assert_unflatten_refused(flat, tensors, exc, match):
    before = [t.clone() for t in tensors]
    with pytest.raises(exc, match=match):
        ops.unflatten_into(flat, tensors)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before, strict=True))


def test_unflatten_into_bad_destinations_leave_them_untouched():
    m = torch.zeros(4, 4)
    _assert_unflatten_refused(
        torch.ones(5), [torch.zeros(2), m.view(-1)[3:7]], ValueError, "flat must have 6 elements"
    )
    _assert_unflatten_refused(
        torch.ones(6),
        [m[0, :3], m.view(-1)[2:5]],
        ValueError,
        r"tensors\[0\] and tensors\[1\] share",
    )
    _assert_unflatten_refused(
        torch.ones(8),
        [torch.zeros(2), torch.zeros(1, 3).expand(2, 3)],
        ValueError,
        r"tensors\[1\] has elements that share memory",
    )
    _assert_unflatten_refused(
        m.view(-1)[:6], [m[2], m[1, :2]], ValueError, r"tensors\[1\] shares memory with flat"
    )
    _assert_unflatten_refused(
        torch.ones(3, dtype=torch.float16),
        [torch.zeros(3)],
        TypeError,
        r"tensors\[0\] has dtype Float but flat has Half",
    )
    _assert_unflatten_refused(torch.ones(2, 2), [torch.zeros(4)], ValueError, "flat must be 1-D")


def test_docstring_examples_run():
    for fn in (ops.flatten, ops.unflatten_into):
        for test in doctest.DocTestFinder().find(fn):
            result = doctest.DocTestRunner().run(test)
            assert result.failed == 0, f"{fn.__name__} docstring example failed"
