"""The HIP backend (AMD GPUs): find the GPU, load its code object, drive the kernels.

The kernels (backends/kernels/, the one source nvcc also compiles) are compiled at
build time by hipcc into one code object per AMD target, mamba_kernels-<gfx>.hsaco
beside this file, and driven through hip-python (`rocm.bindings.hip`, the `hip`
extra). HIP's module API mirrors CUDA's driver API call for call, so everything
after loading (grids, scratch, streams, launches, decode sessions) is the CUDA
backend's class in mamba/_cuda.py, driven through `Driver`, which answers each
CUDA driver call that class makes with its HIP twin. Detection and loading are
HIP's own and live here.

No AMD GPU has run this yet: docs/hip.md says what has been checked and how.
"""
import ctypes
import importlib.resources
import re
import types

from . import _cuda
from ._cuda import CudaError

CODE_OBJECT = re.compile(r"mamba_kernels-(gfx[0-9a-f]+)\.hsaco")
# fast.cu's tensor-core GEMM (TF32 mma) exists for NVIDIA only (so do the other
# tensor-core kernels, which only a backend with tensor_cores looks up)
CUDA_ONLY = ("mb_fast_gemm_k",)
KERNELS = tuple(k for k in _cuda.KERNELS if k not in CUDA_ONLY)


def _import_hip():
    """hip-python's HIP module: rocm-bindings-hip, or an older hip-python release
    (made for an older ROCm) that only has the `hip` namespace."""
    try:
        from rocm.bindings import hip
    except ImportError:
        from hip import hip
    return hip


def code_objects():
    """{target: resource} for the code objects this build installed."""
    out = {}
    for f in importlib.resources.files(__package__).iterdir():
        m = CODE_OBJECT.fullmatch(f.name)
        if m:
            out[m.group(1)] = f
    return out


def _err_name(hip, err):
    res = hip.hipGetErrorName(err)
    name = res[-1] if isinstance(res, tuple) else res
    return name.decode() if isinstance(name, bytes) else str(name)


def probe():
    """(HipBackend or None, reason): never raises."""
    try:
        hip = _import_hip()
    except ImportError as e:
        return None, (f"hip-python is not installed ({e}); install mamba-blocks[hip] "
                      "(the rocm-bindings-hip package)")
    built = code_objects()
    if not built:
        return None, ("this build of mamba has no HIP code objects (hipcc was not found when "
                      "it was built)")
    ok = hip.hipError_t.hipSuccess
    try:
        err = hip.hipInit(0)[0]
        count_err, count = hip.hipGetDeviceCount()
    except Exception as e:  # the bindings raise when libamdhip64 itself is missing
        return None, f"no HIP runtime: {e}"
    if count_err != ok or count == 0:
        return None, ("no AMD GPU (the HIP runtime is installed but sees no device: "
                      f"{_err_name(hip, count_err if count_err != ok else err)})")
    if err != ok:
        return None, f"the HIP runtime did not start: {_err_name(hip, err)}"
    try:
        props = hip.hipGetDeviceProperties(0)
    except Exception as e:  # a runtime older than the bindings lacks the call
        return None, f"the HIP runtime cannot describe device 0: {e}"
    if props[0] != ok:
        return None, f"the HIP runtime cannot describe device 0: {_err_name(hip, props[0])}"
    props = props[1]
    arch = str(props.gcnArchName).split(":")[0]  # "gfx90a:sramecc+:xnack-" -> "gfx90a"
    if arch not in built:
        return None, (f"no code object for this GPU ({props.name}, {arch}); this build has "
                      f"code objects for {', '.join(sorted(built))}")
    try:
        be = HipBackend(hip, built[arch].read_bytes(), str(props.name), arch,
                        props.multiProcessorCount)
    except CudaError as e:
        return None, str(e)
    except Exception as e:  # no AMD GPU has run this code yet: report, never raise
        return None, f"the HIP backend failed to start on {props.name} ({arch}): {e!r}"
    return be, be.description


class Driver:
    """The CUDA driver API as far as the shared backend class calls it, answered by
    HIP. Most calls have a HIP twin that takes the same arguments and gives the
    same results (_TWINS); the few whose form differs are methods."""

    _TWINS = {
        "cuMemAlloc": "hipMalloc", "cuMemFree": "hipFree",
        "cuMemAllocFromPoolAsync": "hipMallocFromPoolAsync", "cuMemFreeAsync": "hipFreeAsync",
        "cuMemHostAlloc": "hipHostMalloc", "cuMemFreeHost": "hipHostFree",
        "cuMemHostGetDevicePointer": "hipHostGetDevicePointer",
        "cuMemcpyHtoD": "hipMemcpyHtoD", "cuMemcpyHtoDAsync": "hipMemcpyHtoDAsync",
        "cuMemcpyDtoHAsync": "hipMemcpyDtoHAsync", "cuMemcpyDtoDAsync": "hipMemcpyDtoDAsync",
        "cuMemsetD8Async": "hipMemsetD8Async", "cuMemsetD32Async": "hipMemsetD32Async",
        "cuDeviceGetAttribute": "hipDeviceGetAttribute",
        "cuLaunchKernel": "hipModuleLaunchKernel", "cuModuleGetFunction": "hipModuleGetFunction",
        "cuStreamCreate": "hipStreamCreateWithFlags", "cuStreamSynchronize": "hipStreamSynchronize",
        "cuStreamDestroy": "hipStreamDestroy",
        "cuStreamWaitEvent": "hipStreamWaitEvent", "cuStreamBeginCapture": "hipStreamBeginCapture",
        "cuStreamEndCapture": "hipStreamEndCapture",
        "cuEventCreate": "hipEventCreateWithFlags", "cuEventRecord": "hipEventRecord",
        "cuEventDestroy": "hipEventDestroy", "cuEventSynchronize": "hipEventSynchronize",
        "cuGraphInstantiate": "hipGraphInstantiateWithFlags", "cuGraphUpload": "hipGraphUpload",
        "cuGraphLaunch": "hipGraphLaunch", "cuGraphExecDestroy": "hipGraphExecDestroy",
        "cuGraphDestroy": "hipGraphDestroy",
    }
    # HIP's null stream synchronises with the other blocking streams, as CUDA's
    # legacy stream does; hip_runtime_api.h defines hipStreamPerThread as 2.
    CU_STREAM_LEGACY, CU_STREAM_PER_THREAD = 0, 2

    def __init__(self, hip):
        self.hip = hip
        missing = [h for h in self._TWINS.values() if not hasattr(hip, h)]
        if missing:
            raise CudaError(f"this hip-python lacks {', '.join(missing)}; install a newer "
                            "rocm-bindings-hip")
        for cu_name, hip_name in self._TWINS.items():
            setattr(self, cu_name, getattr(hip, hip_name))
        ns = types.SimpleNamespace
        self.CUresult = ns(CUDA_SUCCESS=hip.hipError_t.hipSuccess)
        self.CUevent_flags = ns(CU_EVENT_DISABLE_TIMING=hip.hipEventDisableTiming)
        self.CUstream_flags = ns(CU_STREAM_NON_BLOCKING=hip.hipStreamNonBlocking)
        capture, pointer = hip.hipStreamCaptureMode, hip.hipPointer_attribute
        self.CUstreamCaptureMode = ns(
            CU_STREAM_CAPTURE_MODE_THREAD_LOCAL=capture.hipStreamCaptureModeThreadLocal)
        self.CUpointer_attribute = ns(
            CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL=pointer.HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
        self.CU_MEMHOSTALLOC_DEVICEMAP = hip.hipHostMallocMapped

    @staticmethod
    def CUstream(handle):
        return int(handle)  # HIP calls take a stream as its integer handle

    def cuGetErrorName(self, err):
        return self.hip.hipError_t.hipSuccess, _err_name(self.hip, err).encode()

    CUfunction_attribute = types.SimpleNamespace(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES=0)

    def cuFuncSetAttribute(self, fn, attribute, value):
        # AMD gives a kernel its LDS without an opt-in
        return (self.hip.hipError_t.hipSuccess,)

    def cuPointerGetAttribute(self, attribute, ptr):
        out = ctypes.c_int()  # HIP writes the attribute through a pointer
        return self.hip.hipPointerGetAttribute(ctypes.addressof(out), attribute, ptr)[0], out.value


class HipBackend(_cuda.CudaBackend):
    """Mamba blocks on AMD device 0: the shared GPU backend over HIP. `sms` holds
    the compute units, which the shared grid sizing calls SMs."""
    name = "hip"
    stages = 2  # vendor.h MB_STAGES under hipcc: AMD's 64 KiB of LDS holds two
    gemv_kc = 128  # vendor.h MB_GEMV_KC under hipcc
    smem_optin = 64 * 1024  # AMD's LDS a workgroup
    m1b_group = 8  # back1.cu M1B_G under hipcc, for the same LDS
    tensor_cores = False  # CUDA_ONLY: fast mode's projections take the identical GEMM

    def __init__(self, hip, image, gpu, arch, cus):
        self.cu = Driver(hip)
        self.device_id = 0
        self.sms = cus
        self._enter()
        err, mod = hip.hipModuleLoadData(image)
        if err != hip.hipError_t.hipSuccess:
            raise CudaError(f"the kernel module did not load on {gpu} ({arch}): "
                            f"{_err_name(hip, err)}")
        self.mod = mod
        # no dynamic shared memory opt-in: AMD gives a kernel its 64 KiB of LDS as it is
        self.fn = {k: self._ck(hip.hipModuleGetFunction(mod, k.encode()), k) for k in KERNELS}
        props = hip.hipMemPoolProps()
        props.allocType = hip.hipMemAllocationType.hipMemAllocationTypePinned
        props.location.type = hip.hipMemLocationType.hipMemLocationTypeDevice
        props.location.id = self.device_id
        self.pool = self._ck(hip.hipMemPoolCreate(props), "hipMemPoolCreate")
        keep = ctypes.c_uint64(_cuda.POOL_KEEP)
        self._ck(hip.hipMemPoolSetAttribute(
            self.pool, hip.hipMemPoolAttr.hipMemPoolAttrReleaseThreshold, ctypes.addressof(keep)),
            "hipMemPoolSetAttribute")
        self._setup()
        self.programmatic = False  # HIP has no programmatic dependent launch
        self.description = f"device 0: {gpu} ({arch}, {cus} CUs)"

    def _enter(self):
        self._ck(self.cu.hip.hipSetDevice(self.device_id), "hipSetDevice")

    def stream(self):
        # ROCm's DLPack and array-interface numbering call the default stream 0
        s = super().stream()
        return _cuda._Stream(self.cu, 0, s.owner) if s.number == _cuda.LEGACY else s

    def _launch(self, s, name, *args, **kw):
        if name not in self.fn:
            raise CudaError(f"mamba hip: {name} is built for NVIDIA GPUs only")
        super()._launch(s, name, *args, **kw)
