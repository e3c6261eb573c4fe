"""Build of SparseBalance's C++ (and, where CUDA exists, CUDA) extensions.

    python setup.py build_ext --inplace          # what `make build` runs

Extensions:
  sparsebalance._C       CPU kernels (csrc/cpu), always built; OpenMP, -O3. The kernels
                         and their binding are separate files, compiled in parallel.
  sparsebalance._C_cuda  CUDA kernels (csrc/cuda), only when torch has CUDA and
                         nvcc is found, unless SPARSEBALANCE_SKIP_CUDA_BUILD=1.

Environment switches:
  SPARSEBALANCE_CPU_ARCH      -march value for the CPU kernels (default "native";
                              use e.g. "x86-64-v3" for portable images, "" for none).
  SPARSEBALANCE_SKIP_CUDA_BUILD=1   never build the CUDA extension.
  TORCH_CUDA_ARCH_LIST        CUDA architectures (default "8.0;9.0").
  MAX_JOBS                    parallel compile jobs (torch's ninja builder reads it).
"""

import os

from setuptools import find_packages, setup
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_extension():
    arch = os.environ.get("SPARSEBALANCE_CPU_ARCH", "native")
    # -ffp-contract=fast: fuse multiply-adds in the micro-kernels (ISO C++ mode turns it off).
    cflags = ["-O3", "-fopenmp", "-ffp-contract=fast"]
    if arch:
        cflags.append(f"-march={arch}")
    return cpp_extension.CppExtension(
        "sparsebalance._C",
        ["csrc/cpu/sparse_attention_cpu.cpp", "csrc/cpu/bindings.cpp"],
        include_dirs=[os.path.join(HERE, "csrc", "cpu")],
        extra_compile_args=cflags,
        extra_link_args=["-fopenmp"],
    )


def cuda_extension():
    if os.environ.get("SPARSEBALANCE_SKIP_CUDA_BUILD", "0") == "1":
        return None
    import torch

    if torch.version.cuda is None or cpp_extension.CUDA_HOME is None:
        return None
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    # Kernels in the .cu (CUDA headers only: nvcc never parses torch's headers), torch
    # binding in the .cpp (host compiler), as flash-attention splits them.
    return cpp_extension.CUDAExtension(
        "sparsebalance._C_cuda",
        ["csrc/cuda/sparse_attention_cuda.cpp", "csrc/cuda/sparse_attention_kernels.cu"],
        include_dirs=[os.path.join(HERE, "csrc", "cuda")],
        extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3", "--use_fast_math"]},
    )


ext_modules = [e for e in (cpu_extension(), cuda_extension()) if e is not None]

setup(
    name="sparsebalance",
    version="0.1.0",
    packages=find_packages(include=["sparsebalance", "sparsebalance.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
