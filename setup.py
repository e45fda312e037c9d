"""Builds neo's compiled kernels; package metadata lives in pyproject.toml.

- CPU extension ``neo.ops._cpu_kernels``: the ISPC kernels in ``ops_cpu/*.ispc`` compiled for
  several x86 targets in one go (run-time dispatch) and linked with the C++ driver. Built when
  ISPC is found through ``$ISPC`` or ``PATH``; otherwise skipped with a notice, and CPU decode
  attention falls back to the numba kernel.
- CUDA extension ``neo.ops._cuda_kernels``: ``ops_cuda/*.cu`` + the binding. Built when torch has
  CUDA and the CUDA toolkit is found (``NEO_BUILD_CUDA=0`` skips it, ``=1`` requires it).
"""

import glob
import os
import shutil
import subprocess
import sys

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))
ISPC_TARGETS = os.environ.get("NEO_ISPC_TARGETS", "sse4-i32x4,avx2-i32x8,avx512skx-x16,avx512spr-x16")
CXX_FLAGS = ["-O3", "-std=c++17", "-fvisibility=hidden"]
# Link the shared C++ runtime that torch's own libraries load. A toolchain configured to link
# libstdc++ statically gives an extension a private copy of it, and an error raised in the
# extension (a c10 error formats its message with that copy's streams) then crashes the process
# instead of reaching Python.
LINK_FLAGS = ["-l:libstdc++.so.6"]


def notice(message: str) -> None:
    print(f"\n*** neo build: {message}\n", file=sys.stderr, flush=True)


def find_ispc() -> str | None:
    candidate = os.environ.get("ISPC") or shutil.which("ispc")
    if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
        return candidate
    if os.environ.get("ISPC"):
        notice(f"$ISPC={os.environ['ISPC']} is not an executable file")
    return None


def ispc_object_names(stem: str) -> list[str]:
    """The objects ispc writes for a multi-target build: a dispatcher plus one per target."""
    names = [f"{stem}.o"]
    for target in ISPC_TARGETS.split(","):
        isa = target.split("-")[0].replace(".", "_")
        names.append(f"{stem}_{isa}.o")
    return names


class BuildExtension(cpp_extension.BuildExtension):
    """torch's ninja-driven build, with the ISPC sources compiled first for the CPU extension."""

    def build_extensions(self):
        for extension in self.extensions:
            if getattr(extension, "ispc_sources", None):
                self._compile_ispc(extension)
        super().build_extensions()

    def _compile_ispc(self, extension) -> None:
        output_dir = os.path.abspath(os.path.join(self.build_temp, "ispc"))
        os.makedirs(output_dir, exist_ok=True)
        for source in extension.ispc_sources:
            stem = os.path.join(output_dir, os.path.splitext(os.path.basename(source))[0])
            command = [extension.ispc, source, "-O3", "--pic", "--opt=disable-assertions",
                       f"--target={ISPC_TARGETS}", "-o", f"{stem}.o", "-h", f"{stem}_ispc.h"]
            print(" ".join(command), flush=True)
            subprocess.check_call(command)
            extension.extra_objects += [obj for obj in ispc_object_names(stem) if os.path.exists(obj)]
        extension.include_dirs.append(output_dir)


def cpu_extension():
    ispc = find_ispc()
    if ispc is None:
        notice("ISPC was not found ($ISPC or PATH), so the ISPC CPU attention kernel is NOT "
               "built. CPU decode attention will use the numba kernel. Install ISPC and "
               "reinstall to build it.")
        return None
    version = subprocess.run([ispc, "--version"], capture_output=True, text=True).stdout.strip()
    notice(f"building the ISPC CPU kernels with {ispc} ({version}) for {ISPC_TARGETS}")
    extension = cpp_extension.CppExtension(
        "neo.ops._cpu_kernels",
        sorted(glob.glob(os.path.join("ops_cpu", "*.cpp"))),
        extra_compile_args={"cxx": CXX_FLAGS + ["-fopenmp"]},
        extra_link_args=LINK_FLAGS + ["-fopenmp"],
    )
    extension.ispc = ispc
    extension.ispc_sources = sorted(glob.glob(os.path.join(ROOT, "ops_cpu", "*.ispc")))
    return extension


def cuda_extension():
    wanted = os.environ.get("NEO_BUILD_CUDA")
    if wanted == "0":
        return None
    sources = sorted(glob.glob(os.path.join("ops_cuda", "*.cu")) + glob.glob(os.path.join("ops_cuda", "*.cpp")))
    available = torch_has_cuda() and cpp_extension.CUDA_HOME is not None and sources
    if not available:
        if wanted == "1":
            raise RuntimeError("NEO_BUILD_CUDA=1 but torch has no CUDA, CUDA_HOME is not set, or "
                               "ops_cuda/ has no sources")
        notice("CUDA is not available to this torch build: the CUDA kernels are not built.")
        return None
    arch_flags = os.environ.get("NEO_CUDA_ARCH", "-gencode=arch=compute_90a,code=sm_90a").split()
    # The binding includes torch's headers: its C++ standard is left to torch (C++17 up to 2.12,
    # C++20 from 2.13 on). The kernel sources include only CUDA headers and build as C++17;
    # .ci/compile_cuda.sh compiles them with the same nvcc flags.
    host_flags = [flag for flag in CXX_FLAGS if not flag.startswith("-std=")]
    return cpp_extension.CUDAExtension(
        "neo.ops._cuda_kernels",
        sources,
        extra_compile_args={
            "cxx": host_flags,
            "nvcc": ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"] + arch_flags,
        },
        extra_link_args=LINK_FLAGS,
    )


def torch_has_cuda() -> bool:
    import torch

    return torch.version.cuda is not None


extensions = [extension for extension in (cpu_extension(), cuda_extension()) if extension]

setup(
    ext_modules=extensions,
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
