"""Compile backends/kernels/mamba_kernels.cu with g++ into a host library (tests/emu),
cached under the temp dir by a digest of every input."""
import glob
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
KERNELS = os.path.join(ROOT, "backends", "kernels")
REFERENCE = os.path.join(ROOT, "reference")
# The reference's float semantics (meson.build): no contraction, no fast-math (errno
# and traps dropped, which changes no bit). With those, the optimisation level changes
# no bit either, and -O1 compiles in seconds. __HIPCC__ takes vendor.h's spelling
# without inline PTX.
FLAGS = ["-std=c++17", "-O1", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math",
         "-fno-math-errno", "-fno-trapping-math", "-D__HIPCC__", "-Wl,-z,defs",
         "-include", "builtins.h"]
OWN = ("builtins.h", "fibers.cpp", "table.h", "build.py")


def gxx():
    return shutil.which("g++")


def _run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-4000:]}")
    return r.stdout


def build(defines=()):
    """Path of the emulation library, built if needed; defines: extra -D macros (the
    deliberately broken variants)."""
    cmd = [gxx()] + FLAGS + [f"-D{d}" for d in defines]
    digest = hashlib.sha256(" ".join(cmd).encode())
    inputs = glob.glob(os.path.join(KERNELS, "*")) + glob.glob(os.path.join(REFERENCE, "*.h"))
    for p in sorted(inputs + [os.path.join(HERE, f) for f in OWN]):
        with open(p, "rb") as f:
            digest.update(os.path.basename(p).encode() + f.read())
    out = os.path.join(tempfile.gettempdir(), "mamba-emu", digest.hexdigest()[:16])
    lib = os.path.join(out, "libemu.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(os.path.join(out, "hip"), exist_ok=True)
    with open(os.path.join(out, "hip", "hip_runtime.h"), "w") as f:
        f.write("/* builtins.h is included first (-include) */\n")
    cmd += ["-I", out, "-I", HERE, "-I", KERNELS, "-I", REFERENCE]
    # the kernels are the functions builtins.h's __global__ marks
    pre = _run(cmd + ["-E", "-x", "c++", os.path.join(KERNELS, "mamba_kernels.cu")])
    with open(os.path.join(out, "kernels.inc"), "w") as f:
        f.writelines(f"MB_EMU_KERNEL({n})\n"
                     for n in re.findall(r"__attribute__\(\(used\)\)\s+void\s+(\w+)\s*\(", pre))
    with open(os.path.join(out, "emu.cpp"), "w") as f:
        f.write('#include "mamba_kernels.cu"\n#include "table.h"\n')
    tmp = f"{lib}.{os.getpid()}"
    _run(cmd + ["-o", tmp, os.path.join(out, "emu.cpp"), os.path.join(HERE, "fibers.cpp")])
    os.replace(tmp, lib)  # whole, even with another session building the same
    return lib
