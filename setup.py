"""Builds ddpcomm._C: the C++ ops always, the CUDA ops when torch has CUDA and nvcc exists.

nvcc's major version must match torch.version.cuda's (torch refuses the build otherwise).
TORCH_CUDA_ARCH_LIST picks the GPU architectures; see _cuda_arch_list for the default."""

import glob
import os
import platform
import shutil
import subprocess
import sys
import sysconfig

import torch
from setuptools import setup
from torch.utils.cpp_extension import (
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
    get_cxx_compiler,
)

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


def _cpu_build():
    """The C++ ops' CPU flags, extra sources and a description, portable unless asked.

    Default on x86-64: the baseline x86-64 for every file (a wheel runs on any x86-64
    CPU), and the vector-heavy families (quantize, top-k, random-k) compiled a second
    time for x86-64-v3 (AVX2) from csrc/cpu/avx2/, picked at load where the CPU has it
    (csrc/cpu/dispatch.h). DDPCOMM_CPU_ARCH=native (or another -march value) instead
    builds every file once for that target, with no dispatch: for the building machine
    only. No -ffast-math and no FMA contraction, so every variant gives the same bits."""
    arch = os.environ.get("DDPCOMM_CPU_ARCH")
    if arch:
        return [f"-march={arch}", "-DDDPCOMM_CPU_DISPATCH=0"], [], f"-march={arch}, no dispatch"
    if platform.machine() != "x86_64":
        return ["-DDDPCOMM_CPU_DISPATCH=0"], [], f"{platform.machine()}, no dispatch"
    # -march=x86-64 spelled out: some compilers default to a later level (x86-64-v2).
    flags = ["-march=x86-64", "-DDDPCOMM_CPU_DISPATCH=1"]
    return flags, _sources("csrc/cpu/avx2/*.cpp"), "x86-64, and x86-64-v3 kernels picked at load"


def _shared_cxx_runtime():
    """The libstdc++ this Python's torch loaded, linked by its path ahead of the compiler's.

    _C must use the C++ runtime torch uses. A compiler whose libstdc++ is a static archive
    (a GCC installed beside the system's, under /opt, was seen doing this on a GPU machine)
    would copy a second runtime into _C, and the errors ddpcomm's C++ checks raise would
    then cross two runtimes and kill the process instead of raising. Named first, the
    shared library resolves every runtime symbol; an archive after it adds nothing."""
    if platform.system() != "Linux":
        return []
    with open("/proc/self/maps") as maps:
        loaded = sorted({line.split()[-1] for line in maps if "/libstdc++.so" in line})
    return loaded[:1]


def _check_one_cxx_runtime(library):
    """Refuses a built _C that defines the C++ runtime's own throw (see _shared_cxx_runtime)."""
    nm = shutil.which("nm")
    if nm is None or platform.system() != "Linux":
        return
    symbols = subprocess.run([nm, "-D", "--defined-only", library], capture_output=True, text=True)
    if " __cxa_throw" in symbols.stdout:
        os.remove(library)
        raise SystemExit(
            f"ddpcomm: {get_cxx_compiler()} linked a static libstdc++ into {library}: its errors "
            "would crash the process instead of raising. Build with a compiler whose libstdc++ "
            "is a shared library (set CXX and CC, e.g. to the system's g++ and gcc)."
        )


class BuildExt(BuildExtension.with_options(use_ninja=True)):
    """torch's ninja build. pip's editable install (`make`, `pip install -e .`) builds the
    extension in place too, but setuptools hands it a throwaway temp dir: the objects and
    ninja's record are kept where `setup.py build_ext --inplace` looks instead, so the
    next rebuild compiles only what changed, not everything again."""

    def finalize_options(self):
        super().finalize_options()
        if self.editable_mode:
            plat = f"{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
            self.build_temp = os.path.join(ROOT, "build", f"temp.{plat}")

    def build_extension(self, ext):
        super().build_extension(ext)
        _check_one_cxx_runtime(self.get_ext_fullpath(ext.name))


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
cpu_flags, cpu_variants, cpu_what = _cpu_build()
print(f"ddpcomm: building {'CPU + CUDA' if cuda else 'CPU-only'} ops ({why}); CPU: {cpu_what}")

# -g0 drops the debug info that Python's own CFLAGS ask for (-g) and -s the symbol table at
# link: the library goes from 11 MB to 0.6 MB. The dynamic symbols Python and torch need stay.
cxx = ["-O3", "-g0", "-fopenmp", "-ffp-contract=off"] + cpu_flags
link = ["-fopenmp", "-s"] + _shared_cxx_runtime()
sources = _sources("csrc/ddpcomm.cpp") + _sources("csrc/cpu/*.cpp") + cpu_variants
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
        extra_link_args=link,
    )
else:
    ext = CppExtension("ddpcomm._C", sources, extra_compile_args=cxx, extra_link_args=link)

# The compiled library loads only with the torch it was built against (torch's C++ ABI
# changes between releases), so the package requires exactly that version: pyproject.toml
# declares its dependencies dynamic, and they are set here. "2.13.0" also admits local
# builds of that release (2.13.0+cpu, +cu128).
torch_release = torch.__version__.split("+")[0]
setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
    install_requires=[f"torch=={torch_release}"],
)
