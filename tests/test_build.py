"""What the build promises: portable CPU kernels with runtime dispatch that give the same bits
as the baseline ones, a package that requires the torch it was built against, and a library
that shares torch's C++ runtime.

The op tests (test_ops_*.py) hold the kernels the library picked at load to the reference;
here a subprocess runs every CPU kernel family forced to the x86-64 baseline
(DDPCOMM_CPU_DISPATCH=baseline) and its outputs must equal this process's bit for bit; so
must the x86-64-v3 ones as they run where pdep and pext are microcode (slow-bmi2); where
qemu-user is installed, again on an emulated CPU without AVX.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import ddpcomm
from ddpcomm import ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QEMU = shutil.which("qemu-x86_64")


def floats(n: int, seed: int) -> torch.Tensor:
    """n float32 values, from 2**-10 to 16 in magnitude, made from an integer hash of
    (seed, index) with integer ops only: the same bits on every CPU (torch.randn's are not,
    its kernels differ by CPU capability)."""
    h = (torch.arange(n, dtype=torch.int64) + seed * n) * -7046029254386353131
    h = (h ^ (h >> 29)) * -4658895280553007687
    h = h ^ (h >> 32)
    bits = (h & 1) << 31 | ((h >> 1) % 14 + 117) << 23 | (h >> 8) & 0x7FFFFF
    return bits.to(torch.int32).view(torch.float32)


def kernel_digests() -> dict[str, str]:
    """A digest of each CPU kernel's outputs (and updated residuals) on fixed inputs: odd
    sizes across blocks, vectors and parallel chunks; every dtype, bit width and mode."""
    n = 278011
    seeds = iter(range(1000))
    out = {}

    def put(name, *tensors):
        h = hashlib.sha256()
        for t in tensors:
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()[:16]

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = floats(n, next(seeds)).to(dtype)
        x[123] = float("nan")  # a non-finite block: canonical NaN on every path
        for bits in (1, 2, 4, 8, ops.SPARSE_BITS):
            for stochastic in (False, True) if bits != ops.SPARSE_BITS else (False,):
                residual = floats(n, next(seeds)) * 0.1
                p = ops.quantize(x, residual, bits, 256, stochastic, seed=3, step=5)
                rows = torch.stack([p, ops.quantize(x.flip(0), None, bits, 256)])
                total = ops.dequantize_sum(rows, n, bits, 256, 2, dtype)
                owner = torch.zeros(n)
                again = ops.dequantize_sum_requantize(rows, owner, n, bits, 256, 2, stochastic, 1)
                put(f"q{bits}-{dtype}-{stochastic}", p, residual, total, again, owner)
        for approximate in (False, True):
            k = n // 100
            residual = floats(n, next(seeds)) * 0.1
            p = ops.topk_compress(x, residual, k, approximate, seed=1, step=2)
            rows = torch.stack([p, ops.topk_compress(x.flip(0), None, k)])
            total = ops.sparse_accumulate(rows, n, k, 2, torch.float32, dtype)
            put(f"topk-{dtype}-{approximate}", p, residual, total)
        residual = floats(n, next(seeds)) * 0.1
        values = ops.randk_compress(x, residual, n // 100, 4, 5, 6)
        put(f"randk-{dtype}", values, residual, ops.randk_decompress(values, n, 4, 5, 6, 2, dtype))
    x, average = floats(n, next(seeds)) * 10, floats(n, next(seeds)).abs()
    residual = floats(n, next(seeds)) * 0.1
    scale = floats(n, next(seeds)).abs() + 0.01
    p = ops.quantize(x, residual, 2, 256, scale=scale, average=average, beta=0.95)
    put("scale", p, residual, average)
    return out


def test_build_info_says_what_runs():
    info = ddpcomm.build_info()
    assert info["torch_built"] == torch.__version__.split("+")[0]
    assert info["cpu_kernels"] in ("x86-64-v3", "x86-64", "as built"), info
    assert info["cpu_dispatch"], info


def _digests_elsewhere(*prefix: str, env: dict | None = None) -> tuple[dict, dict]:
    """build_info() and kernel_digests() of a Python started as ``prefix python``."""
    code = (
        "import json, ddpcomm; from tests.test_build import kernel_digests; "
        "print(json.dumps([ddpcomm.build_info(), kernel_digests()]))"
    )
    res = subprocess.run(
        [*prefix, sys.executable, "-c", code],
        env={**os.environ, **(env or {}), "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    return tuple(json.loads(res.stdout.splitlines()[-1]))


dispatching = pytest.mark.skipif(
    ddpcomm.build_info()["cpu_kernels"] == "as built",
    reason="a DDPCOMM_CPU_ARCH build (or not x86-64): one set of kernels, nothing to dispatch",
)


@dispatching
def test_baseline_kernels_give_the_same_bits():
    info, baseline = _digests_elsewhere(env={"DDPCOMM_CPU_DISPATCH": "baseline"})
    assert (info["cpu_kernels"], info["cpu_dispatch"]) == (
        "x86-64",
        "DDPCOMM_CPU_DISPATCH=baseline",
    )
    assert kernel_digests() == baseline


@dispatching
def test_kernels_without_pdep_give_the_same_bits():
    # The x86-64-v3 kernels as they run where pdep and pext are microcode (AMD before Zen 3).
    if ddpcomm.build_info()["cpu_kernels"] != "x86-64-v3":
        pytest.skip("this CPU lacks x86-64-v3")
    info, tables = _digests_elsewhere(env={"DDPCOMM_CPU_DISPATCH": "slow-bmi2"})
    assert (info["cpu_kernels"], info["cpu_dispatch"]) == (
        "x86-64-v3",
        "DDPCOMM_CPU_DISPATCH=slow-bmi2",
    )
    assert kernel_digests() == tables


@dispatching
@pytest.mark.skipif(QEMU is None, reason="no qemu-x86_64 (Debian: apt-get install qemu-user)")
def test_loads_and_gives_the_same_bits_on_a_cpu_without_avx():
    # Nehalem (2008): SSE4.2, no AVX. Emulated, the library loads (no AVX2 code runs at
    # load), picks the x86-64 kernels itself and gives the bits this CPU's kernels give.
    # About 20 s: qemu emulates every instruction.
    info, old_cpu = _digests_elsewhere(QEMU, "-cpu", "Nehalem")
    assert (info["cpu_kernels"], info["cpu_dispatch"]) == (
        "x86-64",
        "the CPU lacks x86-64-v3 (AVX2, FMA, BMI2)",
    )
    assert kernel_digests() == old_cpu


def test_package_requires_the_torch_it_was_built_against():
    try:
        requires = importlib.metadata.requires("ddpcomm")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ddpcomm is not installed (built in place only)")
    assert requires == [f"torch=={ddpcomm.build_info()['torch_built']}"]


@pytest.mark.skipif(
    sys.platform != "linux" or shutil.which("nm") is None, reason="needs Linux and nm"
)
def test_the_library_uses_the_cpp_runtime_torch_loaded():
    """A static libstdc++ copied into _C (a compiler whose libstdc++ is an archive does this)
    turns every error ddpcomm's C++ checks raise into a crash of the process; setup.py links
    torch's libstdc++ and refuses such a library."""
    library = ddpcomm._C.__file__
    defined = subprocess.run(
        ["nm", "-D", "--defined-only", library], capture_output=True, text=True
    )
    assert defined.returncode == 0, defined.stderr
    assert " __cxa_throw" not in defined.stdout, f"{library} carries its own C++ runtime"
    needed = subprocess.run(["readelf", "-d", library], capture_output=True, text=True).stdout
    assert "[libstdc++.so.6]" in needed
    with pytest.raises(RuntimeError, match="sparse_accumulate: payloads row 0 holds index 5"):
        payload = torch.tensor([5, 1], dtype=torch.int32).view(torch.uint8)  # index 5, value
        ops.sparse_accumulate(payload[None], 4, 1, 1, torch.float32, torch.float32)
