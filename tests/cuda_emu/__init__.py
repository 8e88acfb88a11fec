"""csrc/cuda's quantizer, sparsification and flatten kernels compiled for the CPU, and ctypes
bindings that run them.

The kernel files run under a host emulation of CUDA CTAs (include/cuda_runtime.h states what
it checks and what it cannot). :func:`load` rewrites their launches and ``__shared__``
declarations for it (:func:`rewrite`), compiles them with g++ into build/cuda-emu/ under a
hash of every input (later runs reuse the library), and returns an :class:`Emulator`, whose
methods take the arguments of ddpcomm.ops' quantizer, sparse and flatten ops and return (or
write) what the CUDA ops would.

A failed build raises :class:`BuildError` with the compiler's output: tests fail, never skip.

>>> import torch
>>> from ddpcomm import ops
>>> emu = load()
>>> emu.quantize(torch.ones(32), None, 8, 32).equal(ops.quantize(torch.ones(32), None, 8, 32))
True
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from ddpcomm import ops

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CSRC = ROOT / "csrc"
CACHE = ROOT / "build" / "cuda-emu"
KERNEL_FILES = (
    "ternary_kernels.cu",
    "quantize_kernels.cu",
    "sparse_kernels.cu",
    "flatten_kernels.cu",
)
# Host float arithmetic as the device's under nvcc --fmad=false: no contraction, no fast math.
FLAGS = ("-std=c++20", "-O1", "-ffp-contract=off", "-fno-fast-math")
WARNINGS = ("-Wall", "-Wextra", "-Wno-unknown-pragmas")  # #pragma unroll is nvcc's
# -fvisibility=hidden: two libraries loaded at once (one with a planted bug) keep their own
# emulator state; only driver.cpp's entry points are exported.
LINK = ("-fPIC", "-shared", "-fvisibility=hidden")
SCHEDULE_SEED = 1  # every call starts from it, so a failure repeats when its test runs alone
_FLOAT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # launchers.h FloatType


class BuildError(RuntimeError):
    """The kernel files could not be rewritten or compiled."""


class EmulationError(RuntimeError):
    """A launch failed: an emulator check (a barrier, a warp mask, ...) or a launch status."""


# ------------------------------------------------------------------------------------------
# Rewriting
# ------------------------------------------------------------------------------------------

_GLOBAL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")
# kernel<template args, one level of nesting><<<config>>>(
_LAUNCH = re.compile(
    r"((?:\w+::)*(\w+))\s*(<(?:[^<>;{}]|<[^<>;{}]*>)*>)?\s*<<<(.*?)>>>\s*\(", re.DOTALL
)
_SHARED = re.compile(r"__shared__\s+[\w:]+\s+(\w+)\s*(?:\[[^\];]*\]\s*)*;")


def _line(text: str, at: int) -> int:
    return text.count("\n", 0, at) + 1


def rewrite(text: str, path: Path) -> str:
    """Kernel source for the emulator: ``k<<<grid, block, smem, stream>>>(args)`` becomes
    ``::emu::launch(k, grid, block, smem, stream)(args)``, and every ``__shared__``
    declaration is followed, on its line, by the call that lets the emulator fill it with
    garbage and count it. Lines keep their numbers, and ``#line`` names ``path``, so compiler
    messages point into it. Any other form raises :class:`BuildError`."""
    kernels = set(_GLOBAL.findall(text))

    def launch(m: re.Match) -> str:
        if m.group(2) not in kernels:
            raise BuildError(
                f"{path}:{_line(text, m.start())}: launch of {m.group(2)!r}, which is not a "
                f"__global__ function of this file ({sorted(kernels)})"
            )
        call = f"::emu::launch({m.group(1)}{m.group(3) or ''}, {m.group(4)})("
        return call + "\n" * m.group(0).count("\n")

    def shared(m: re.Match) -> str:
        return f"{m.group(0)} ::emu::shared_declared(&{m.group(1)}, sizeof({m.group(1)}));"

    out = _LAUNCH.sub(launch, text)
    out, shared_done = _SHARED.subn(shared, out)
    code = re.sub(r"//[^\n]*", "", out)  # comments may name either
    left = code.find("<<<")
    if left >= 0:
        line = _line(code, left)
        raise BuildError(
            f"{path}:{line}: a launch of a form that rewrite() does not know (it knows "
            f"{_LAUNCH.pattern!r}): {code.splitlines()[line - 1].strip()!r}"
        )
    if code.count("__shared__") != shared_done:
        raise BuildError(
            f"{path}: {code.count('__shared__') - shared_done} __shared__ declarations of a "
            f"form that rewrite() does not know (it knows {_SHARED.pattern!r})"
        )
    return f'#line 1 "{path}"\n{out}'


def _patched(name: str, text: str, patches) -> str:
    for file, old, new in patches:
        if file == name:
            if text.count(old) != 1:
                raise BuildError(f"patch of {name}: {old!r} occurs {text.count(old)} times")
            text = text.replace(old, new)
    return text


# ------------------------------------------------------------------------------------------
# Building
# ------------------------------------------------------------------------------------------


def _inputs() -> list[Path]:
    """Every file the build reads besides the kernel files."""
    emu = [*sorted((HERE / "include").glob("*.h")), HERE / "emu.cpp", HERE / "driver.cpp"]
    headers = sorted([*CSRC.glob("*.h"), *(CSRC / "cuda").glob("*.h"), *CSRC.glob("cuda/*.cuh")])
    return emu + headers


def build(patches: tuple[tuple[str, str, str], ...] = ()) -> Path:
    """The emulated kernels' shared library, compiled unless build/cuda-emu/ holds it.

    ``patches``: (kernel file, old, new) edits to make first; each ``old`` must occur
    exactly once in its file. Two processes may build at once: each compiles in its own
    directory and renames the library into place.
    """
    gxx = shutil.which("g++")
    if gxx is None:
        raise BuildError("g++ not found on PATH: the emulated CUDA kernels need it")
    sources = {}
    for name in KERNEL_FILES:
        path = CSRC / "cuda" / name
        sources[name] = rewrite(_patched(name, path.read_text(), patches), path)
    version = subprocess.run([gxx, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256("\0".join([version, *FLAGS, *WARNINGS, *LINK, *sources.values()]).encode())
    for p in _inputs():
        h.update(p.read_bytes())
    lib = CACHE / f"emu-{h.hexdigest()[:20]}.so"
    if lib.exists():
        return lib
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="tmp-") as tmp:
        files = []
        for name, text in sources.items():
            files.append(Path(tmp) / (name + ".cpp"))
            files[-1].write_text(text)
        out = Path(tmp) / "emu.so"
        include = ["-I", HERE / "include", "-I", CSRC, "-I", CSRC / "cuda"]
        cmd = [gxx, *FLAGS, *WARNINGS, *LINK, *include, "-o", out]
        cmd += [*files, HERE / "emu.cpp", HERE / "driver.cpp"]
        r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
        if r.returncode != 0:
            raise BuildError(f"g++ failed ({' '.join(map(str, cmd))}):\n{r.stdout}{r.stderr}")
        os.replace(out, lib)
    return lib


# ------------------------------------------------------------------------------------------
# Bindings
# ------------------------------------------------------------------------------------------


def _c(arg) -> ctypes.c_void_p | ctypes.c_int64:
    """driver.cpp's arguments are pointers and int64s."""
    if arg is None:
        return ctypes.c_void_p(None)
    if isinstance(arg, torch.Tensor):
        assert arg.device.type == "cpu" and arg.is_contiguous()
        return ctypes.c_void_p(arg.data_ptr())
    if isinstance(arg, torch.dtype):
        return ctypes.c_int64(_FLOAT_TYPES[arg])
    return ctypes.c_int64(arg)


def _garbage(n: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An output buffer of 0xCD bytes: what a kernel leaves unwritten shows."""
    return torch.full((n * dtype.itemsize,), 0xCD, dtype=torch.uint8).view(dtype)


class Emulator:
    """ddpcomm.ops' quantizer, sparse and flatten ops as the CUDA kernels compute them, on CPU
    tensors."""

    def __init__(self, path: Path):
        self._lib = ctypes.CDLL(str(path))
        self._lib.emu_failure.restype = ctypes.c_char_p

    def _run(self, name: str, *args) -> None:
        self._lib.emu_reset(ctypes.c_uint64(SCHEDULE_SEED))
        status = getattr(self._lib, name)(*map(_c, args))
        failure = self._lib.emu_failure().decode()
        if status != 0 or failure:
            raise EmulationError(f"{name}: {failure or f'launch status {status}'}")

    def quantize(
        self, x, residual, bits, block_size, stochastic=False, seed=0, step=0, rng_offset=0
    ) -> torch.Tensor:
        x = x.contiguous()
        out = _garbage(ops.payload_bytes(x.numel(), bits, block_size))
        rng = (stochastic, seed, step, rng_offset)
        self._run("emu_quantize", x, x.dtype, residual, x.numel(), bits, block_size, *rng, out)
        return out

    def dequantize_sum(
        self, payloads, numel, bits, block_size, divisor, dtype, scale=None
    ) -> torch.Tensor:
        p = payloads.contiguous()
        out = _garbage(numel, dtype)
        args = (numel, bits, block_size, divisor, scale, out, dtype)
        self._run("emu_dequantize_sum", p, *p.shape, *args)
        return out

    def dequantize_sum_requantize(
        self,
        payloads,
        residual,
        numel,
        bits,
        block_size,
        divisor,
        stochastic=False,
        seed=0,
        step=0,
        rng_offset=0,
    ) -> torch.Tensor:
        p = payloads.contiguous()
        out = _garbage(ops.payload_bytes(numel, bits, block_size))
        args = (residual, numel, bits, block_size, divisor, stochastic, seed, step, rng_offset)
        self._run("emu_dequantize_sum_requantize", p, *p.shape, *args, out)
        return out

    def topk_compress(
        self, x, residual, k, approximate=False, seed=0, step=0, value_dtype=None
    ) -> torch.Tensor:
        x = x.contiguous()
        vdtype = torch.float32 if value_dtype is None else value_dtype
        out = _garbage(ops.topk_payload_bytes(k, vdtype))
        args = (x.numel(), k, approximate, seed, step, vdtype, out)
        self._run("emu_topk_compress", x, x.dtype, residual, *args)
        return out

    def sparse_accumulate(
        self, payloads, numel, k, divisor, value_dtype, dtype, check=True
    ) -> torch.Tensor:
        """With ``check``, a bad row raises the binding's (csrc/cuda/sparse.cpp) RuntimeError
        from the kernel's verdict, before anything is accumulated."""
        p = payloads.contiguous()
        rows = p.shape[0]
        out = _garbage(numel, dtype)
        bad = torch.full((max(rows, 1),), 2**31 - 1, dtype=torch.int32) if check else None
        args = (k, numel, value_dtype, divisor, out, dtype, bad)
        self._run("emu_sparse_accumulate", p, *p.shape, *args)
        for r in range(rows if check else 0):
            if bad[r] != 2**31 - 1:
                j = int(bad[r])
                idx = int(p[r, 4 * j : 4 * j + 4].clone().view(torch.int32))
                raise RuntimeError(
                    f"sparse_accumulate: payloads row {r} holds index {idx} at position {j}: "
                    f"indices must be strictly increasing and in [0, numel={numel})"
                )
        return out

    def randk_compress(
        self, x, residual, k, seed, step, bucket, out=None, start=0, end=None
    ) -> torch.Tensor:
        """Into ``out`` when given, else into garbage, as the op does: values outside strata
        [start, end) are left as they are."""
        x = x.contiguous()
        out = _garbage(k, torch.float32) if out is None else out
        strata = (start, k if end is None else end)
        args = (x.numel(), k, *strata, seed, step, bucket, out)
        self._run("emu_randk_compress", x, x.dtype, residual, *args)
        return out

    def randk_decompress(
        self, values, numel, seed, step, bucket, divisor, dtype, out=None, start=0, end=None
    ) -> torch.Tensor:
        """Into ``out`` when given, else into garbage, as the op does: elements outside
        strata [start, end) are left as they are."""
        v = values.float().contiguous()
        out = _garbage(numel, dtype) if out is None else out
        strata = (start, v.numel() if end is None else end)
        args = (numel, v.numel(), *strata, seed, step, bucket, divisor, out, dtype)
        self._run("emu_randk_decompress", v, *args)
        return out

    def flatten(self, tensors, out=None) -> torch.Tensor:
        """flatten into garbage, or flatten_into ``out`` when given (and returned)."""
        if out is None:
            out = _garbage(sum(t.numel() for t in tensors), tensors[0].dtype)
        self._copy_list(out, tensors, to_flat=True)
        return out

    def unflatten_into(self, flat, tensors) -> None:
        self._copy_list(flat, tensors, to_flat=False)

    def _copy_list(self, flat, tensors, to_flat: bool) -> None:
        """csrc/cuda/flatten.cpp's copy_list: the entries that are one run of bytes
        (csrc/flatten.h is_byte_copyable) in one launcher call, then the others by torch's
        strided copy."""
        offsets = [0]
        for t in tensors:
            offsets.append(offsets[-1] + t.numel() * t.element_size())
        runs = [
            t.numel() > 0 and t.is_contiguous() and not (t.is_conj() or t.is_neg()) for t in tensors
        ]
        ptrs = torch.tensor(
            [t.data_ptr() if r else 0 for t, r in zip(tensors, runs, strict=True)],
            dtype=torch.int64,
        )
        if offsets[-1] > 0:
            args = (len(tensors), ptrs, torch.tensor(offsets), to_flat)
            self._run("emu_multi_tensor_copy", flat, *args)
        for t, r, offset in zip(tensors, runs, offsets[:-1], strict=True):
            if t.numel() == 0 or r:
                continue
            piece = flat.narrow(0, offset // t.element_size(), t.numel()).view(t.shape)
            if to_flat:
                piece.copy_(t)
            else:
                t.copy_(piece)


@functools.cache
def load(patches: tuple[tuple[str, str, str], ...] = ()) -> Emulator:
    """The emulated kernels, built (or found in build/cuda-emu/) with ``patches`` made."""
    return Emulator(build(patches))
