"""The HIP backend without an AMD GPU: the code objects hipcc built (one per target
the toolchain reaches, each an AMDGPU ELF for its target, holding every kernel the
loader needs, compiled with denormals kept), the loader's reason for every way it
can be unusable, and the driver calls it shares with the CUDA backend.

Where an AMD GPU is usable, the identity lanes (test_identity.py) run on it."""
import ast
import enum
import os
import re
import shutil
import struct
import subprocess
import sys
import types

import pytest

import mamba
from mamba import _backends, _cuda, _cuda_back1, _cuda_back3, _hip

# EF_AMDGPU_MACH values (the low byte of e_flags) of the default hip_targets
MACH = {"gfx90a": 0x3F, "gfx942": 0x4C, "gfx1100": 0x41}
EM_AMDGPU = 224


def hip_module_or_skip():
    try:
        return _hip._import_hip()
    except ImportError as e:
        pytest.skip(f"hip-python is not installed: {e}")


# ------------------------------------------------------------------ code objects
def read_elf(data):
    """(e_machine, e_flags, {symbol: value}, read(vaddr, n)) of a little-endian ELF64."""
    assert data[:6] == b"\x7fELF\x02\x01", "not a little-endian ELF64 file"
    machine, = struct.unpack_from("<H", data, 18)
    shoff, = struct.unpack_from("<Q", data, 40)
    flags, = struct.unpack_from("<I", data, 48)
    shentsize, shnum = struct.unpack_from("<HH", data, 58)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    syms = {}
    for _, kind, _, _, off, size, link, _, _, entsize in secs:
        if kind in (2, 11):  # SHT_SYMTAB, SHT_DYNSYM
            strings = secs[link][4]
            for j in range(size // entsize):
                name, _, _, _, value, _ = struct.unpack_from("<IBBHQQ", data, off + j * entsize)
                end = data.index(b"\0", strings + name)
                syms[data[strings + name:end].decode()] = value

    def read(vaddr, n):
        for _, kind, _, addr, off, size, *_ in secs:
            if kind != 8 and addr and addr <= vaddr < addr + size:  # not SHT_NOBITS
                return data[off + vaddr - addr:off + vaddr - addr + n]
        raise AssertionError(f"address {vaddr:#x} is in no section")
    return machine, flags, syms, read


def reachable_targets():
    """The default targets the hipcc on this machine can build (as meson asks it)."""
    rocm = os.environ.get("ROCM_PATH") or "/opt/rocm"
    hipcc = shutil.which("hipcc") or shutil.which("hipcc", path=os.path.join(rocm, "bin"))
    if hipcc is None:
        return None
    env = {**os.environ, "HIP_PLATFORM": "amd"}  # as meson runs it (backends/meson.build)
    return {t for t in MACH if subprocess.run(
        [hipcc, "--genco", f"--offload-arch={t}", "-x", "hip", os.devnull, "-o", os.devnull],
        capture_output=True, env=env).returncode == 0}


def test_code_objects_for_every_reachable_target():
    """A build with hipcc installs one code object per target hipcc reaches."""
    reach = reachable_targets()
    if reach is None:
        pytest.skip("no hipcc here, so the build had no HIP compiler to use")
    assert reach, "hipcc is installed but reaches none of " + ", ".join(MACH)
    assert set(_hip.code_objects()) == reach


@pytest.mark.parametrize("target", sorted(MACH))
def test_code_object_holds_every_kernel_for_its_target(target):
    """Each code object is an AMDGPU ELF for its target, holds a kernel descriptor for
    every kernel the loader fetches, and every kernel keeps float32 denormals and
    rounds to nearest even (SPEC 4.1), as the build's flags ask."""
    built = _hip.code_objects()
    if target not in built:
        pytest.skip(f"this build has no {target} code object (built: {sorted(built) or 'none'})")
    machine, flags, syms, read = read_elf(built[target].read_bytes())
    assert machine == EM_AMDGPU and flags & 0xFF == MACH[target]
    missing = [k for k in _hip.KERNELS if k + ".kd" not in syms]
    assert not missing, f"kernels the HIP loader needs are not in the {target} code object"
    for k in _hip.KERNELS:
        # amdhsa kernel descriptor: compute_pgm_rsrc1 at byte 48
        rsrc1, = struct.unpack_from("<I", read(syms[k + ".kd"], 64), 48)
        assert (rsrc1 >> 16) & 3 == 3, f"{k}: float32 denormals are flushed"
        assert (rsrc1 >> 12) & 3 == 0, f"{k}: float32 rounding is not to nearest even"


def test_kernels_fit_amd_lds_without_opt_in():
    """HipBackend sets no dynamic shared memory attribute: an AMD kernel may use up to
    64 KiB of LDS without one. Its ring stages are those hipcc compiled (vendor.h)."""
    be = _hip.HipBackend.__new__(_hip.HipBackend)  # the sizes need no device
    assert max(be.gemv_smem, be.norm_smem, _cuda_back1.chunk_shape(be.m1b_group)[1],
               _cuda_back3.CHUNK_SMEM) <= 64 * 1024
    kernels = os.path.join(os.path.dirname(__file__), "..", "backends", "kernels")
    if not os.path.exists(kernels):
        pytest.skip("tests run outside the source tree: the kernels are not here to compare")
    for f, macro, want in (("vendor.h", "MB_STAGES", be.stages),
                           ("vendor.h", "MB_GEMV_KC", be.gemv_kc),
                           ("back1.cu", "M1B_G", be.m1b_group)):
        m = re.search(r"#if defined\(__HIPCC__\)\s*#define %s (\d+)" % macro,
                      open(os.path.join(kernels, f)).read())
        assert m and int(m.group(1)) == want, f"{f}: {macro} under hipcc"


# ------------------------------------------------------------------ detection
def hip_runtime_loads(hip):
    """Whether the bindings find a HIP runtime that loads (any call loads it)."""
    try:
        hip.hipRuntimeGetVersion()
    except Exception:
        return False
    return True


def test_probe_without_amd_gpu_gives_the_reason():
    """On a machine without an AMD GPU, the reason names the first thing missing."""
    be, why = _hip.probe()
    if be is not None:
        pytest.skip(f"an AMD GPU is usable here: {why}")
    try:
        hip = _hip._import_hip()
    except ImportError:
        assert why.startswith("hip-python is not installed"), why
        return
    if not _hip.code_objects():
        assert why.startswith("this build of mamba has no HIP code objects"), why
    elif hip_runtime_loads(hip):
        assert why.startswith("no AMD GPU (the HIP runtime is installed but sees no device"), why
    else:
        assert why.startswith("no HIP runtime: "), why


def test_requested_hip_raises_the_reason(monkeypatch):
    ok, why = mamba.backends()["hip"]
    if ok:
        pytest.skip("the HIP backend is usable here")
    w = mamba.random_weights("mamba1", 32)
    msg = "backend 'hip' was requested but is not usable: " + re.escape(why)
    with pytest.raises(RuntimeError, match=msg):
        mamba.Mamba1Block(w, backend="hip")
    monkeypatch.setenv("MAMBA_BACKEND", "hip")
    with pytest.raises(RuntimeError, match=msg):
        mamba.Mamba1Block(w)


def test_probe_without_hip_python(monkeypatch):
    for name in ("rocm", "rocm.bindings", "rocm.bindings.hip", "hip", "hip.hip"):
        monkeypatch.setitem(sys.modules, name, None)  # makes the import fail
    be, why = _hip.probe()
    assert be is None and why.startswith("hip-python is not installed (") and \
        "install mamba-blocks[hip]" in why


def test_probe_without_code_objects(monkeypatch):
    hip_module_or_skip()
    monkeypatch.setattr(_hip, "code_objects", dict)
    assert _hip.probe() == (None, "this build of mamba has no HIP code objects (hipcc was not "
                                  "found when it was built)")


def test_probe_without_hip_runtime(tmp_path):
    """The real bindings, pointed at a libamdhip64 that does not load."""
    hip_module_or_skip()
    if not _hip.code_objects():
        pytest.skip("this build has no HIP code objects, which the probe reports first")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libamdhip64.so").write_bytes(b"not a shared library")
    # ROCM_PATH is set after the import: a developer's editable install may rebuild
    # on import, and hipcc reads ROCM_PATH too; the bindings read it at their first call
    code = ("import os, sys; from mamba import _hip; os.environ['ROCM_PATH'] = sys.argv[1]; "
            "print(_hip.probe()[1])")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=600)
    assert r.stdout.startswith("no HIP runtime: ") and "libamdhip64" in r.stdout, \
        r.stdout + r.stderr


class FakeHip:
    """hip-python as the probe sees it, for one AMD GPU (or none)."""
    hipError_t = enum.IntEnum("hipError_t", {"hipSuccess": 0, "hipErrorInvalidDevice": 101,
                                             "hipErrorNoDevice": 100,
                                             "hipErrorInvalidImage": 200})

    def __init__(self, count=1, arch="gfx90a:sramecc+:xnack-"):
        self.count, self.arch = count, arch
        self.images = []

    def hipGetErrorName(self, err):
        return self.hipError_t.hipSuccess, err.name.encode()

    def hipInit(self, flags):
        return (self.hipError_t.hipSuccess if self.count else self.hipError_t.hipErrorNoDevice,)

    def hipGetDeviceCount(self):
        if not self.count:
            return self.hipError_t.hipErrorNoDevice, 0
        return self.hipError_t.hipSuccess, self.count

    def hipGetDeviceProperties(self, device):
        props = types.SimpleNamespace(name="AMD Instinct MI210", gcnArchName=self.arch,
                                      multiProcessorCount=104)
        return self.hipError_t.hipSuccess, props

    def hipSetDevice(self, device):
        return (self.hipError_t.hipSuccess,)

    def hipModuleLoadData(self, image):
        self.images.append(image)
        return self.hipError_t.hipErrorInvalidImage, None


def bare_driver(hip):
    """Just what HipBackend uses before its kernels load."""
    return types.SimpleNamespace(
        hip=hip, CUresult=types.SimpleNamespace(CUDA_SUCCESS=hip.hipError_t.hipSuccess))


@pytest.fixture
def built(monkeypatch):
    """A build with one code object, for gfx90a."""
    class Resource:
        def read_bytes(self):
            return b"gfx90a code object"
    monkeypatch.setattr(_hip, "code_objects", lambda: {"gfx90a": Resource()})


def test_probe_no_device(monkeypatch, built):
    monkeypatch.setattr(_hip, "_import_hip", lambda: FakeHip(count=0))
    assert _hip.probe() == (None, "no AMD GPU (the HIP runtime is installed but sees no "
                                  "device: hipErrorNoDevice)")


def test_probe_runtime_that_does_not_load(monkeypatch, built):
    fake = FakeHip()

    def no_library(flags):
        raise RuntimeError("failed to dlopen 'libamdhip64.so'")
    fake.hipInit = no_library
    monkeypatch.setattr(_hip, "_import_hip", lambda: fake)
    assert _hip.probe() == (None, "no HIP runtime: failed to dlopen 'libamdhip64.so'")


def old_runtime(device):
    raise RuntimeError("failed to dlsym 'hipGetDevicePropertiesR0600'")


@pytest.mark.parametrize("patch, reason", [
    ({"hipInit": lambda flags: (FakeHip.hipError_t.hipErrorInvalidDevice,)},
     "the HIP runtime did not start: hipErrorInvalidDevice"),
    ({"hipGetDeviceProperties": old_runtime},
     "the HIP runtime cannot describe device 0: failed to dlsym 'hipGetDevicePropertiesR0600'"),
    ({"hipGetDeviceProperties": lambda device: (FakeHip.hipError_t.hipErrorInvalidDevice, None)},
     "the HIP runtime cannot describe device 0: hipErrorInvalidDevice"),
])
def test_probe_runtime_that_fails(monkeypatch, built, patch, reason):
    fake = FakeHip()
    for name, fn in patch.items():
        setattr(fake, name, fn)
    monkeypatch.setattr(_hip, "_import_hip", lambda: fake)
    assert _hip.probe() == (None, reason)


def test_probe_gpu_without_code_object(monkeypatch, built):
    """A GPU whose target the build has no code object for, named with its target."""
    monkeypatch.setattr(_hip, "_import_hip", lambda: FakeHip(arch="gfx908:sramecc+:xnack-"))
    assert _hip.probe() == (None, "no code object for this GPU (AMD Instinct MI210, gfx908); "
                                  "this build has code objects for gfx90a")


def test_probe_loads_the_code_object_of_the_gpu(monkeypatch, built):
    """The GPU's own code object is the one handed to the runtime; its refusal is
    the reason."""
    fake = FakeHip()
    monkeypatch.setattr(_hip, "_import_hip", lambda: fake)
    monkeypatch.setattr(_hip, "Driver", bare_driver)
    assert _hip.probe() == (None, "the kernel module did not load on AMD Instinct MI210 "
                                  "(gfx90a): hipErrorInvalidImage")
    assert fake.images == [b"gfx90a code object"]


def test_probe_bindings_without_a_needed_call(monkeypatch, built):
    """An hip-python that lacks a call the backend makes is named as the reason."""
    monkeypatch.setattr(_hip, "_import_hip", lambda: FakeHip())
    be, why = _hip.probe()
    assert be is None and why.startswith("this hip-python lacks hipMalloc, hipFree, ") and \
        why.endswith("; install a newer rocm-bindings-hip")


def test_probe_reports_an_unexpected_failure(monkeypatch, built):
    """The start-up code has never met an AMD GPU: whatever it raises is reported."""
    fake = FakeHip()

    def broken(image):
        raise TypeError("unexpected image type")
    fake.hipModuleLoadData = broken
    monkeypatch.setattr(_hip, "_import_hip", lambda: fake)
    monkeypatch.setattr(_hip, "Driver", bare_driver)
    assert _hip.probe() == (None, "the HIP backend failed to start on AMD Instinct MI210 "
                                  "(gfx90a): TypeError('unexpected image type')")


def test_requested_hip_raises_the_probe_reason(monkeypatch, built):
    monkeypatch.setattr(_hip, "_import_hip", lambda: FakeHip(arch="gfx1030"))
    monkeypatch.setattr(_backends, "_cache", {})
    with pytest.raises(RuntimeError, match=re.escape(
            "backend 'hip' was requested but is not usable: no code object for this GPU "
            "(AMD Instinct MI210, gfx1030); this build has code objects for gfx90a")):
        mamba.Mamba1Block(mamba.random_weights("mamba1", 32), backend="hip")
    assert mamba.backends()["hip"][0] is False


# ------------------------------------------------------------------ shared driver calls
def cuda_calls_reached_on_hip():
    """Every `cu.X[.Y]` chain in mamba/_cuda.py outside what HIP does itself (the
    probe, and the CudaBackend methods HipBackend replaces without calling them), the
    programmatic dependent launch (HipBackend sets programmatic False) and the TMA
    tensor maps of the wgmma GEMM (HipBackend's wgmma is False)."""
    own = {("probe",), ("CudaBackend", "__init__"), ("CudaBackend", "_enter"),
           ("CudaBackend", "_launch_dependent"), ("CudaBackend", "_encode_tmap")}
    tree = ast.parse(open(_cuda.__file__).read())
    calls = set()

    def visit(node, scope):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            scope = scope + (node.name,)
            if scope in own:
                return
        if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None),
                                                              ast.Attribute):
            m = re.search(r"(?:^|\.)cu\.([A-Za-z_][\w.]*)$", ast.unparse(node))
            if m:
                calls.add(m.group(1))
        for child in ast.iter_child_nodes(node):
            child.parent = node
            visit(child, scope)
    visit(tree, ())
    return calls


def test_driver_answers_every_cuda_call_hip_reaches():
    """The shared backend class runs on HIP through _hip.Driver: each CUDA driver name
    it uses there must have its HIP answer in the installed bindings."""
    drv = _hip.Driver(hip_module_or_skip())
    calls = cuda_calls_reached_on_hip()
    assert "cuLaunchKernel" in calls and "CUresult.CUDA_SUCCESS" in calls
    missing = []
    for chain in sorted(calls):
        obj = drv
        for part in chain.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            missing.append(chain)
    assert not missing, "mamba/_hip.py Driver lacks the HIP twin of " + ", ".join(missing)


def init_attributes(path, cls):
    """The `self.X` a class's __init__ assigns."""
    tree = ast.parse(open(path).read())
    init = next(f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls
                for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
    return {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def test_hip_backend_sets_the_state_the_shared_methods_use():
    """HipBackend.__init__ replaces CudaBackend's: it must set the same state, save
    the CUDA device handle and context (HIP selects its device with hipSetDevice)."""
    cuda = init_attributes(_cuda.__file__, "CudaBackend")
    hip = init_attributes(_hip.__file__, "HipBackend")
    assert cuda - hip == {"dev", "ctx"}
