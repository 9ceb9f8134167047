"""The CUDA kernels on the CPU: backends/kernels/ compiled by g++ (build.py) behind a
stand-in for cuda.bindings.driver (driver.py), driven by the real CUDA backend
(mamba/_cuda*.py). See docs/cuda.md, "Checking kernels without a GPU"."""
from mamba import _cuda

from .build import KERNELS, build, gxx
from .driver import Driver


class EmulatedBackend(_cuda.CudaBackend):
    stages = 2  # vendor.h's MB_STAGES under the HIP spelling the emulation compiles
    gemv_kc = 128  # vendor.h's MB_GEMV_KC under that spelling
    m1b_group = 8  # back1.cu's M1B_G under that spelling
    tensor_cores = True  # fast.cu's TF32 GEMM on builtins.h's emulated mma


def backend(defines=()):
    """A CUDA backend over a fresh emulation library (defines: extra -D macros)."""
    return EmulatedBackend(Driver(build(defines)), b"")
