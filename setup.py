"""Builds ddpcomm._C: the C++ ops always, the CUDA ops when torch has CUDA and nvcc exists.

nvcc's major version must match torch.version.cuda's (torch refuses the build otherwise).
TORCH_CUDA_ARCH_LIST picks the GPU architectures; see _cuda_arch_list for the default."""

import glob
import os
import platform
import shutil
import subprocess

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern):
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _want_cuda():
    if os.environ.get("DDPCOMM_NO_CUDA") == "1":
        return False, "DDPCOMM_NO_CUDA=1"
    if torch.version.cuda is None:
        return False, "torch is a CPU build"
    if CUDA_HOME is None or shutil.which("nvcc", path=os.path.join(CUDA_HOME, "bin")) is None:
        return False, "no CUDA toolkit (nvcc) found"
    return True, f"torch {torch.__version__} with CUDA {torch.version.cuda}"


def _cpu_arch():
    """-march for the C++ ops: x86-64-v3 (AVX2) where the building CPU has it, else
    x86-64-v2 (SSE4.2). The byte and float loops vectorize with either; AVX2 halves their
    instruction count, which matters because quantization is close to memory bound.
    No -ffast-math and no FMA contraction, so results are the same bits on any target.
    DDPCOMM_CPU_ARCH overrides the choice (e.g. "x86-64-v2" for a portable build)."""
    if "DDPCOMM_CPU_ARCH" in os.environ:
        arch = os.environ["DDPCOMM_CPU_ARCH"]
        return [f"-march={arch}"] if arch else []
    if platform.machine() != "x86_64":
        return []
    try:
        with open("/proc/cpuinfo") as f:
            avx2 = " avx2" in f.read()
    except OSError:
        avx2 = False
    return ["-march=x86-64-v3" if avx2 else "-march=x86-64-v2"]


def _cuda_arch_list():
    """The GPU architectures to compile for, when TORCH_CUDA_ARCH_LIST does not say.

    With a GPU visible at build time, None: torch's own choice, the visible cards. Without
    one (a build machine, a container), the architectures torch itself was built for that
    this nvcc can compile (V100 and T4 included where both have them), the newest also as
    PTX so later cards can JIT it. Never a short fixed list: a card without a kernel image
    fails at the first op."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or torch.cuda.is_available():
        return None
    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
    listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True).stdout
    nvcc_can = {a.removeprefix("compute_") for a in listed.split()}
    torch_has = {a.removeprefix("sm_") for a in torch._C._cuda_getArchFlags().split()}
    archs = sorted((int(a[:-1]), int(a[-1])) for a in torch_has & nvcc_can if a.isdigit())
    if not archs:
        return None
    names = [f"{major}.{minor}" for major, minor in archs]
    return ";".join(names[:-1] + [names[-1] + "+PTX"])


cuda, why = _want_cuda()
print(f"ddpcomm: building {'CPU + CUDA' if cuda else 'CPU-only'} ops ({why}), {_cpu_arch()}")

cxx = ["-O3", "-fopenmp", "-ffp-contract=off"] + _cpu_arch()
sources = _sources("csrc/ddpcomm.cpp") + _sources("csrc/cpu/*.cpp")
if cuda:
    archs = _cuda_arch_list()
    if archs is not None:
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    targets = os.environ.get("TORCH_CUDA_ARCH_LIST", "those of the visible GPUs")
    print(f"ddpcomm: CUDA architectures: {targets}")
    ext = CUDAExtension(
        "ddpcomm._C",
        sources + _sources("csrc/cuda/*.cpp") + _sources("csrc/cuda/*.cu"),
        extra_compile_args={
            "cxx": cxx + ["-DDDPCOMM_WITH_CUDA"],
            "nvcc": ["-O3", "--fmad=false", "-DDDPCOMM_WITH_CUDA"],
        },
        extra_link_args=["-fopenmp"],
    )
else:
    ext = CppExtension("ddpcomm._C", sources, extra_compile_args=cxx, extra_link_args=["-fopenmp"])

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
