"""Builds ddpcomm._C: the C++ ops always, the CUDA ops when torch has CUDA and nvcc exists."""

import glob
import os
import platform
import shutil

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
    """x86-64-v2 (SSE4.2, every x86 server CPU since 2009) lets the byte and float loops
    vectorize with min/max and rounding instructions; DDPCOMM_CPU_ARCH overrides it
    (e.g. "native"), an empty value keeps the compiler's default."""
    arch = os.environ.get("DDPCOMM_CPU_ARCH", "x86-64-v2" if platform.machine() == "x86_64" else "")
    return [f"-march={arch}"] if arch else []


cuda, why = _want_cuda()
print(f"ddpcomm: building {'CPU + CUDA' if cuda else 'CPU-only'} ops ({why})")

cxx = ["-O3", "-fopenmp", "-ffp-contract=off"] + _cpu_arch()
sources = _sources("csrc/ddpcomm.cpp") + _sources("csrc/cpu/*.cpp")
if cuda:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    ext = CUDAExtension(
        "ddpcomm._C",
        sources + _sources("csrc/cuda/*.cpp") + _sources("csrc/cuda/*.cu"),
        extra_compile_args={"cxx": cxx + ["-DDDPCOMM_WITH_CUDA"],
                            "nvcc": ["-O3", "--fmad=false", "-DDDPCOMM_WITH_CUDA"]},
        extra_link_args=["-fopenmp"],
    )
else:
    ext = CppExtension("ddpcomm._C", sources, extra_compile_args=cxx, extra_link_args=["-fopenmp"])

setup(ext_modules=[ext], cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)})
