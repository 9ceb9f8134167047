"""mamba-ssm 2.3.2.post1 as the GPU benchmarks' baseline, loaded from its source
distribution (PyPI ships no wheel for it): the Python package as it is (its Triton
kernels: Mamba-2's SSD, Mamba-3 SISO, the RMSNorm) and its CUDA selective scan
(Mamba-1's kernel), compiled on first use for float32 and this GPU only with the
upstream nvcc flags. The full upstream build compiles every dtype for several
architectures; the kernels timed here are the same source.

    mssm = upstream.load("mamba_ssm-2.3.2.post1.tar.gz", "/tmp/mssm")
    blk = upstream.Block("mamba1", weights, d_model)  # norm + mixer + residual

causal-conv1d is not installed, so upstream's modules take their documented
fallback for the convolution (torch's conv1d); the scan, SSD and projections are
upstream's own.
"""
import glob
import importlib
import os
import sys
import tarfile

import numpy as np
import torch

NVCC_FLAGS = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__",
              "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_OPERATORS__",
              "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_BFLOAT162_OPERATORS__",
              "-U__CUDA_NO_BFLOAT162_CONVERSIONS__", "--expt-relaxed-constexpr",
              "--expt-extended-lambda", "--use_fast_math", "-lineinfo", "--threads", "4"]

# selective_scan.cpp dispatches over fp16/bf16/fp32 inputs and real/complex weights;
# this build instantiates float32 real only, so the dispatch is narrowed to match
FLOAT_ONLY = """
#undef DISPATCH_ITYPE_FLOAT_AND_HALF_AND_BF16
#define DISPATCH_ITYPE_FLOAT_AND_HALF_AND_BF16(ITYPE, NAME, ...) \\
    if (ITYPE == at::ScalarType::Float) { using input_t = float; __VA_ARGS__(); } \\
    else { AT_ERROR(#NAME, " is built for float32 only here"); }
#undef DISPATCH_WTYPE_FLOAT_AND_COMPLEX
#define DISPATCH_WTYPE_FLOAT_AND_COMPLEX(WTYPE, NAME, ...) \\
    if (WTYPE == at::ScalarType::Float) { using weight_t = float; __VA_ARGS__(); } \\
    else { AT_ERROR(#NAME, " is built for float32 only here"); }
"""

INSTANCES = {
    "fwd_f32.cu": ('#include "selective_scan_fwd_kernel.cuh"\n'
                   "template void selective_scan_fwd_cuda<float, float>(SSMParamsBase &, "
                   "cudaStream_t);\n"),
    "bwd_f32.cu": ('#include "selective_scan_bwd_kernel.cuh"\n'
                   "template void selective_scan_bwd_cuda<float, float>(SSMParamsBwd &, "
                   "cudaStream_t);\n"),
}


def _source(path, work):
    """The unpacked source tree (path: the sdist or a tree)."""
    if os.path.isdir(path):
        return path
    with tarfile.open(path) as t:
        top = t.getnames()[0].split("/")[0]
        t.extractall(work)
    return os.path.join(work, top)


def _scan_extension(src, work):
    """Import selective_scan_cuda: a build left in `work` or a fresh float32 one."""
    build = os.path.join(work, "selective_scan_build")
    os.makedirs(build, exist_ok=True)
    if glob.glob(os.path.join(build, "selective_scan_cuda*.so")):
        sys.path.insert(0, build)
        return importlib.import_module("selective_scan_cuda")
    from torch.utils.cpp_extension import load
    cs = os.path.join(src, "csrc", "selective_scan")
    with open(os.path.join(cs, "selective_scan.cpp")) as f:
        cpp = f.read()
    cut = cpp.index("template<typename input_t, typename weight_t>")
    sources = [os.path.join(build, "selective_scan.cpp")]
    with open(sources[0], "w") as f:
        f.write(cpp[:cut] + FLOAT_ONLY + cpp[cut:])
    for name, text in INSTANCES.items():
        sources.append(os.path.join(build, name))
        with open(sources[-1], "w") as f:
            f.write(text)
    major, minor = torch.cuda.get_device_capability()
    arch = f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"
    return load("selective_scan_cuda", sources, extra_cflags=["-O3", "-std=c++17"],
                extra_cuda_cflags=NVCC_FLAGS + [arch], extra_include_paths=[cs],
                build_directory=build, verbose=False)


def load(path, work):
    """mamba_ssm from the sdist or source tree at `path`, built under `work`."""
    os.makedirs(work, exist_ok=True)
    src = _source(path, work)
    sys.modules["selective_scan_cuda"] = _scan_extension(src, work)
    sys.path.insert(0, src)
    return importlib.import_module("mamba_ssm")


class Block(torch.nn.Module):
    """Upstream's mixer behind a block RMSNorm (upstream's Triton RMSNorm) and the
    residual: the same block as ours. Weights of the same name and shape are
    copied from ours (`w`, a dict of float32 buffers); `loaded` lists them."""

    def __init__(self, kind, w, d_model):
        super().__init__()
        from mamba_ssm import Mamba, Mamba2, Mamba3
        from mamba_ssm.ops.triton.layer_norm import RMSNorm
        dev = dict(device="cuda", dtype=torch.float32)
        if kind == "mamba1":
            self.mixer = Mamba(d_model, d_state=16, d_conv=4, expand=2, use_fast_path=False,
                               **dev)
        elif kind == "mamba2":
            self.mixer = Mamba2(d_model, d_state=128, d_conv=4, expand=2, headdim=64,
                                ngroups=1, chunk_size=256, rmsnorm=True,
                                norm_before_gate=False, use_mem_eff_path=False, **dev)
        else:
            self.mixer = Mamba3(d_model, d_state=128, expand=2, headdim=64, chunk_size=64,
                                **dev)
        self.norm = RMSNorm(d_model, eps=1e-5, **dev)
        own = {"mixer." + k: v for k, v in self.mixer.state_dict().items()}
        own["norm.weight"] = self.norm.weight
        self.loaded = []
        block_norm = "norm.weight" if kind == "mamba1" else "block_norm.weight"
        with torch.no_grad():
            for name, a in w.items():
                t = torch.from_numpy(np.asarray(a)).to("cuda")
                key = "norm.weight" if name == block_norm else "mixer." + name
                if key in own and own[key].numel() == t.numel():
                    own[key].copy_(t.reshape(own[key].shape))
                    self.loaded.append(name)

    def forward(self, x):
        return x + self.mixer(self.norm(x))
