"""The CUDA backend: load the kernel module, get its functions, launch, free.

The kernels (backends/kernels/, one source for nvcc and hipcc) are compiled at build
time into mamba_kernels.fatbin beside this file and driven through cuda-python's
driver bindings. This file chooses grids, streams and memory; the arithmetic lives
in the kernels, whose order is fixed by SPEC section 4, so no choice here changes a
bit of the identical mode.

Streams (docs/cuda.md): work is issued on the stream made current by
`mamba.stream(s)`, else on the legacy default stream. DLPack inputs are requested
for that stream, a CUDA-array-interface input's stream is waited on, and a device
output records the stream that wrote it (its __cuda_array_interface__ says so, and
its __dlpack__(stream=c) makes c wait for it).

Memory: weights and decode-session buffers are plain allocations owned by their
block or session; per-call outputs and scratch come from a stream-ordered pool
(allocated and freed on the call's stream, so nothing blocks the host).
"""
import contextlib
import ctypes
import importlib.resources
import math
import threading

from . import _core
from . import _cuda_back1
from . import _cuda_back2
from . import _cuda_back3
from . import _cuda_grad
from . import _cuda_ssd

FATBIN = "mamba_kernels.fatbin"
LEAF = 8192          # dot v1 leaf length (numerics.h MB_DOT_LEAF)
# gemm.cu's tiled kernels, (kernel, BM, BN, threads, blocks a multiprocessor): the
# narrow ones take an N they cover in one tile (the first that does), the residual
# one a call with res; the tail ones (with and without res) the tiles of a wide call
# past its last whole wave
GEMM_WIDE = ("mb_gemm_k", 128, 128, 128, 2)
GEMM_RES = ("mb_gemm_res_k", 128, 128, 128, 2)
GEMM_NARROW = (("mb_gemm_n96_k", 128, 96, 96, 2), ("mb_gemm_n160_k", 64, 160, 160, 2))
GEMM_TAIL = {"mb_gemm_k": ("mb_gemm_tail_k", 32, 64, 64),
             "mb_gemm_res_k": ("mb_gemm_tail_res_k", 32, 64, 64)}
GEMM_STRIP = {"mb_gemm_k": ("mb_gemm_strip_k", 64, 32, 32),
              "mb_gemm_res_k": ("mb_gemm_strip_res_k", 64, 32, 32)}
TAIL_MAX = 0.5  # the tail kernels take a remainder of at most this much of a wave
STRIP_MAX = 0.5  # and columns past the last whole wide tile up to this much of one
GEMV_ROWS, GEMV_MROWS, GEMV_THREADS = 32, 8, 256   # gemm.cu mb_gemv_k: GV_ROWS, GV_MROWS
GEMV_STAGES = 2                                    # gemm.cu: GV_STAGES
GEMV_MAX_M = 64      # rows of X up to which a projection takes the GEMV kernels
STAGE_K = 128                                      # rmsnorm.cu: RN_KC
NORM_ROWS, NORM_THREADS = 32, 128                  # rmsnorm.cu: RN_ROWS, RN_THREADS
NORM_WHOLE_MIN = 4                                 # _norm_whole's fewest rows a block
SCALE_ROWS = 8                                     # rmsnorm.cu: RS_ROWS of mb_rms_scale_k
GUARD_THREADS = 1024                               # finite.cu mb_step_guard_k: one block
GUARD_LOADS = 8                                    # finite.cu: loads in flight a thread
TF32_BM, TF32_BN, TF32_THREADS = 128, 128, 128    # fast.cu mb_fast_gemm_k: TB_M, TB_N
TF32_SMEM = 4 * 3 * (TF32_BM + TF32_BN) * (32 + 4)  # TB_STAGES stages of padded rows
WGMMA_BM, WGMMA_BN, WGMMA_THREADS = 128, 256, 384  # wgmma.cu mb_fast_wgmma_k: WG_BM, WG_BN
WGMMA_STAGES, WGMMA_BK = 4, 32                      # wgmma.cu: WG_STAGES, WG_BK
TMAP_KEEP = 256  # tensor maps kept (_tmap); the cache starts over past that
# the stages, 1 KiB to align them to the swizzle's atoms, a full and an empty barrier a stage
WGMMA_SMEM = WGMMA_STAGES * ((WGMMA_BM + WGMMA_BN) * WGMMA_BK * 4 + 2 * 8) + 1024
FAST_GEMV_ROWS, FAST_THREADS = 8, 256              # fast.cu: rows per block, threads
FAST_NORM_ROWS = FAST_THREADS // 32                # fast.cu FN_ROWS: a warp a row
FAST_GEMV_MAX_M = 8  # fast: the split-K GEMV re-reads X per output row, so past 8
                     # rows the chain GEMV of the identical mode is the faster one
SCAN_CHANNELS = 8    # scan1.cu: channels per block of 16 lanes each
SCAN_P_CHANNELS = 32  # scan1.cu SP_C: fast prefill, channels per block of 4 lanes each
CONV_RUN = 32        # conv.cu: tokens per item of mb_conv_silu_k
THREADS = 256
MAX_NDIM = 8         # copy.cu mb_layout
POOL_KEEP = (1 << 64) - 1  # the pool keeps freed memory for reuse, as torch's allocator does
KERNELS = ("mb_gemm_k", "mb_gemm_res_k", "mb_gemm_n96_k", "mb_gemm_n160_k",
           "mb_gemm_tail_k", "mb_gemm_tail_res_k", "mb_gemm_strip_k", "mb_gemm_strip_res_k",
           "mb_gemv_k", "mb_dot_fold_k",
           "mb_rms_k", "mb_rms_scale_k", "mb_conv_silu_k", "mb_conv_window_k", "mb_conv_step_k",
           "mb_scan1_k", "mb_residual_k", "mb_pack_rows_k", "mb_first_nonfinite_k",
           "mb_step_guard_k", "mb_gather_k",
           "mb_fast_gemm_k", "mb_fast_gemv_k", "mb_fast_rmsnorm_k", "mb_fast_conv_silu_k",
           "mb_fast_conv_step_k", "mb_fast_scan1p_k", "mb_math_k")
# Kernels that pass MB_GRID_WAIT() (vendor.h) in every thread: in a session's graph
# each launches as a programmatic dependent of the kernel before it, so it starts
# (and stages its weights) while that one runs.
WAITS = frozenset((
    "mb_step_guard_k", "mb_rms_k", "mb_rms_scale_k", "mb_gemv_k", "mb_dot_fold_k",
    "mb_conv_step_k", "mb_scan1_k", "mb_fast_rmsnorm_k", "mb_fast_gemv_k",
    "mb_fast_conv_step_k", "mb_ssd_put_k", "mb_m2_fold_k",
    "mb_m2_step_cb_k", "mb_m2_step_y_k",
    "mb_m3_prep_k", "mb_m3_angles_k", "mb_m3_rotate_k", "mb_m3_fold_k", "mb_m3_pending_k",
    "mb_m3_step_k"))
NONE = 0xFFFFFFFFFFFFFFFF  # the guard word of a session with no refused step
LEGACY, PER_THREAD = 1, 2  # stream numbers of the DLPack and array-interface protocols

# DLPack (code, bits, lanes) and array-interface type strings, for refusals by name
_DL_NAMES = {(2, 32, 1): "float32", (2, 64, 1): "float64", (2, 16, 1): "float16",
             (4, 16, 1): "bfloat16", (0, 8, 1): "int8", (0, 16, 1): "int16",
             (0, 32, 1): "int32", (0, 64, 1): "int64", (1, 8, 1): "uint8",
             (1, 16, 1): "uint16", (1, 32, 1): "uint32", (1, 64, 1): "uint64",
             (6, 8, 1): "bool", (5, 64, 1): "complex64", (5, 128, 1): "complex128"}
_CAI_NAMES = {"f4": "float32", "f8": "float64", "f2": "float16", "i1": "int8", "i2": "int16",
              "i4": "int32", "i8": "int64", "u1": "uint8", "u2": "uint16", "u4": "uint32",
              "u8": "uint64", "b1": "bool", "c8": "complex64", "c16": "complex128"}


class CudaError(RuntimeError):
    pass


# ------------------------------------------------------------------ caller streams
_current = threading.local()
_param_blocks = threading.local()


def _stream_number(s):
    """The protocol number (1 legacy, 2 per-thread, else the CUstream handle) of a
    framework's stream object or raw handle."""
    if s is None:
        return LEGACY
    if hasattr(s, "__cuda_stream__"):          # the CUDA stream protocol (cuda.core, ...)
        handle = int(s.__cuda_stream__()[1])
    elif hasattr(s, "cuda_stream"):            # torch.cuda.Stream, torch.cuda.ExternalStream
        handle = int(s.cuda_stream)
    elif hasattr(s, "ptr") and not isinstance(s, (int, bool)):  # cupy.cuda.Stream
        handle = int(s.ptr)
    elif isinstance(s, int) and not isinstance(s, bool):
        handle = s
    else:
        try:                                   # cuda.bindings CUstream
            handle = int(s.getPtr())
        except (AttributeError, TypeError):
            raise TypeError("mamba.stream: stream must be a CUDA stream (torch.cuda.Stream, "
                            "a CuPy stream, an object with __cuda_stream__, a CUstream or an "
                            f"integer handle), got {type(s).__name__}") from None
    if handle < 0:
        raise ValueError(f"mamba.stream: a stream handle is not negative, got {handle}")
    return LEGACY if handle == 0 else handle


@contextlib.contextmanager
def stream(s):
    """Issue the CUDA work of every mamba call in this thread on stream `s` (a
    torch.cuda.Stream, CuPy stream, object with __cuda_stream__, CUstream or integer
    handle; None or 0 is the legacy default stream), for example
    ``with mamba.stream(torch.cuda.current_stream()):``. The stream object is kept
    alive while memory mamba allocated on it is in use."""
    entry = (_stream_number(s), s)
    prev = getattr(_current, "entry", None)
    _current.entry = entry
    try:
        yield
    finally:
        _current.entry = prev


_handles = {}  # (driver, protocol number) -> CUstream, made once: a decode step makes few calls


class _Stream:
    """The current stream: its driver handle, protocol number and owning object."""
    __slots__ = ("cu", "number", "owner")

    def __init__(self, cu, number, owner):
        self.number, self.owner = number, owner
        self.cu = _handles.get((id(cu), number))
        if self.cu is None:
            self.cu = _handles[(id(cu), number)] = cu.CUstream(
                cu.CU_STREAM_LEGACY if number == LEGACY else
                cu.CU_STREAM_PER_THREAD if number == PER_THREAD else number)


def probe():
    """(CudaBackend or None, reason): never raises."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as e:
        return None, (f"cuda-python is not installed ({e}); install mamba-blocks[cuda] "
                      "(the cuda-bindings package)")
    try:
        image = importlib.resources.files(__package__).joinpath(FATBIN).read_bytes()
    except OSError:
        return None, ("this build of mamba has no CUDA kernels (nvcc was not found when it "
                      "was built)")
    try:
        err = cu.cuInit(0)[0]
    except Exception as e:  # the bindings raise when libcuda itself is missing
        return None, f"no CUDA driver: {e}"
    if err == cu.CUresult.CUDA_ERROR_NO_DEVICE:
        return None, "no CUDA device (the driver is installed but sees no GPU)"
    if err != cu.CUresult.CUDA_SUCCESS:
        return None, f"the CUDA driver did not start: {_err_name(cu, err)}"
    err, count = cu.cuDeviceGetCount()
    if err != cu.CUresult.CUDA_SUCCESS or count == 0:
        return None, "no CUDA device (the driver is installed but sees no GPU)"
    try:
        be = CudaBackend(cu, image)
    except CudaError as e:
        return None, str(e)
    return be, be.description


def _err_name(cu, err):
    res = cu.cuGetErrorName(err)
    return res[1].decode() if res[0] == cu.CUresult.CUDA_SUCCESS else str(err)


def _cdiv(a, b):
    return -(-a // b)


class _Mem:
    """Long-lived device bytes (weights, session buffers): cuMemAlloc, freed when the
    last Array over them dies (cuMemFree waits for the work that may use them)."""

    def __init__(self, be, nbytes):
        self.be = be
        self.ptr = int(be._ck(be.cu.cuMemAlloc(max(nbytes, 4)), "cuMemAlloc"))

    def __del__(self):
        be, ptr = self.be, self.ptr
        be.release(lambda: (be._enter(), be.cu.cuMemFree(ptr)))


class _SideStream:
    """A thread's second stream (CudaBackend.side_stream), destroyed with the thread's
    local data; work queued on it still completes."""

    def __init__(self, be):
        self.be = be
        self.cu = be._ck(be.cu.cuStreamCreate(int(be.cu.CUstream_flags.CU_STREAM_NON_BLOCKING)),
                         "cuStreamCreate")

    def __del__(self):
        be, s = self.be, self.cu
        be.release(lambda: (be._enter(), be.cu.cuStreamDestroy(s)))


class _InputCheck:
    """A prefill's input check left to its norm (CudaBackend.first_nonfinite_later):
    a, the array (None once a norm took it); slot, the read-back slot whose device
    word takes the answer."""

    def __init__(self, a, slot):
        self.a, self.slot = a, slot


class _PoolMem:
    """One call's output from the stream-ordered pool: allocated and freed on the
    stream that writes it (as torch's caching allocator does), holding that stream's
    owner so the stream outlives the memory."""

    def __init__(self, be, nbytes, s):
        self.be, self.s = be, s
        self.ptr = int(be._ck(be.cu.cuMemAllocFromPoolAsync(max(nbytes, 4), be.pool, s.cu),
                              "cuMemAllocFromPoolAsync"))

    def __del__(self):
        be, ptr, s = self.be, self.ptr, self.s
        be.release(lambda: be.cu.cuMemFreeAsync(ptr, s.cu))


class _Scratch:
    """Stream-ordered scratch for one call: taken from the pool and returned on the
    call's stream, so the frees wait for the kernels that use it and nothing blocks
    the host."""

    def __init__(self, be, s):
        self.be, self.s, self.ptrs = be, s, []

    def __call__(self, nfloats):
        be = self.be
        p = int(be._ck(be.cu.cuMemAllocFromPoolAsync(max(4 * nfloats, 4), be.pool, self.s.cu),
                       "cuMemAllocFromPoolAsync"))
        self.ptrs.append(p)
        return p

    def upload(self, data, nbytes):
        p = self((nbytes + 3) // 4)
        self.be._ck(self.be.cu.cuMemcpyHtoDAsync(p, data, nbytes, self.s.cu), "cuMemcpyHtoDAsync")
        return p

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.ptrs:
            self.be.cu.cuMemFreeAsync(p, self.s.cu)
        return False


class _Layout(ctypes.Structure):
    _fields_ = [("ndim", ctypes.c_int64), ("shape", ctypes.c_int64 * MAX_NDIM),
                ("strides", ctypes.c_int64 * MAX_NDIM)]


class _M1Buffers:
    """Scratch of one Mamba-1 call over M packed tokens (see CudaBackend._m1_launch):
    the front's (the norm's and in_proj's) first, the rest taken by rest()."""

    def __init__(self, be, alloc, M, dm, ragged):
        di = 2 * dm
        self.alloc, self.M, self.di, self.XR = alloc, M, di, _cdiv(dm, 16) + 32
        self.xs = alloc(M * dm) if ragged else 0
        self.r, self.xn, self.xz = alloc(M), alloc(M * dm), alloc(M * 2 * di)
        parts = max(be._parts(M, 2 * di, dm), be._parts(M, self.XR, di),
                    be._parts(M, di, self.XR - 32), be._parts(M, dm, di))
        self.parts = alloc(parts) if parts else 0
        self.queued = False  # the front is queued (CudaBackend.early_front)

    def rest(self):
        alloc, M, di = self.alloc, self.M, self.di
        self.u, self.dtp, self.yi, self.xdbl = (alloc(M * di), alloc(M * di), alloc(M * di),
                                                alloc(M * self.XR))
        return self


class _TensorMap(ctypes.Structure):
    """A CUtensorMap's 128 bytes, as a kernel parameter (wgmma.cu mb_tmap)."""
    _fields_ = [("words", ctypes.c_uint64 * 16)]


def _ptr(a):
    return a.ptr if isinstance(a, _core.Array) else a


def _params(n):
    """This thread's kernel parameter block for n 8-byte parameters: the words and
    the array of their addresses that cuLaunchKernel takes (made once: building them
    for every launch cost a launch 9 us of Python)."""
    blocks = _param_blocks.__dict__.setdefault("by_count", {})
    if n not in blocks:
        words = (ctypes.c_uint64 * n)()
        base = ctypes.addressof(words)
        blocks[n] = words, (ctypes.c_void_p * n)(*range(base, base + 8 * n, 8))
    return blocks[n]


class CudaBackend(_cuda_ssd.SsdMixin, _cuda_grad.GradMixin, _cuda_back1.Back1Mixin,
                  _cuda_back2.Back2Mixin, _cuda_back3.Back3Mixin):
    """Mamba blocks on device 0. Weights are uploaded once per block; host inputs
    give host outputs, device inputs give device outputs."""
    name = "cuda"
    stages = 4  # the cp.async rings' stages: vendor.h MB_STAGES for this vendor
    gemv_kc = 256  # terms per stage of mb_gemv_k: vendor.h MB_GEMV_KC
    tensor_cores = True  # fast.cu's TF32 GEMM is in the module (NVIDIA only)
    wgmma = False  # wgmma.cu's TF32 GEMM is in the module (its sm_90a code, on a Hopper GPU)
    smem_optin = 160 * 1024  # the most dynamic shared memory a kernel here asks for (sm_80: 163 KiB)

    @property
    def gemv_smem(self):
        """Bytes of dynamic shared memory of mb_gemv_k (gemm.cu)."""
        return 4 * GEMV_STAGES * (GEMV_ROWS + GEMV_MROWS) * (self.gemv_kc + 4)

    def gemv_norm_smem(self, M, K):
        """Bytes of dynamic shared memory of mb_gemv_k normalizing M rows of K terms
        itself (gemm.cu: the weights' ring, then a block's rows whole, then the norm's
        weight); 0 where that is more than a kernel may ask for, or K spans leaves."""
        n = (GEMV_STAGES * GEMV_ROWS * (self.gemv_kc + 4) + min(M, GEMV_MROWS) * (_cdiv(K, 32) * 32 + 4)
             + _cdiv(K, 4) * 4)
        return 4 * n if K <= LEAF and M <= GEMV_MAX_M and 4 * n <= self.smem_optin else 0

    def norm_in_gemv(self, fast, M, K):
        """Whether an RMSNorm of M rows of K feeding a projection runs inside its
        GEMV (identical mode, where gemv_norm_smem allows)."""
        return not fast and self.gemv_norm_smem(M, K) > 0

    @property
    def norm_smem(self):
        """Bytes of dynamic shared memory of mb_rms_k (rmsnorm.cu)."""
        return 4 * self.stages * NORM_ROWS * (STAGE_K + 4)

    def __init__(self, cu, image):
        self.cu = cu
        self.device_id = 0
        self.dev = self._ck(cu.cuDeviceGet(0), "cuDeviceGet")
        name = self._ck(cu.cuDeviceGetName(128, self.dev), "cuDeviceGetName")
        name = name.split(b"\0")[0].decode(errors="replace")
        attr = cu.CUdevice_attribute
        major = self._attr(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = self._attr(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        self.sms = self._attr(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.ctx = self._ck(cu.cuDevicePrimaryCtxRetain(self.dev), "cuDevicePrimaryCtxRetain")
        self._enter()
        err, mod = cu.cuModuleLoadData(image)
        if err == cu.CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU:
            raise CudaError(f"the kernels have no binary for this GPU ({name}, sm_{major}{minor}; "
                            "built for sm_80, sm_90a and compute_90 PTX)")
        if err != cu.CUresult.CUDA_SUCCESS:
            raise CudaError(f"the kernel module did not load on {name}: {_err_name(cu, err)}")
        self.mod = mod
        self.fn = {k: self._ck(cu.cuModuleGetFunction(mod, k.encode()), k) for k in KERNELS}
        big = {"mb_gemv_k": self.smem_optin, "mb_rms_k": self.norm_smem, "mb_fast_gemm_k": TF32_SMEM}
        for k, smem in big.items():
            self._allow_smem(k, smem)
        err, fn = cu.cuModuleGetFunction(mod, b"mb_fast_wgmma_k")
        if err == cu.CUresult.CUDA_SUCCESS:
            self.fn["mb_fast_wgmma_k"], self.wgmma = fn, True
            self._allow_smem("mb_fast_wgmma_k", WGMMA_SMEM)
        props = cu.CUmemPoolProps()
        props.allocType = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = self.device_id
        self.pool = self._ck(cu.cuMemPoolCreate(props), "cuMemPoolCreate")
        self._ck(cu.cuMemPoolSetAttribute(self.pool, cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                                          cu.cuuint64_t(POOL_KEEP)), "cuMemPoolSetAttribute")
        self._setup()
        self.programmatic = major >= 9  # programmatic dependent launch
        self.description = f"device 0: {name} (sm_{major}{minor}, {self.sms} SMs)"

    def _setup(self):
        """The host state of a backend, on either vendor."""
        self._offsets = {}
        self._capture = None
        self._capturing, self._released = 0, []
        self._readbacks, self._lock = [], threading.Lock()
        self._chain = None  # the capturing stream whose last node is a kernel
        self._dependents = False
        self._guard = threading.local()  # step_guard: per thread, as each capture is
        self._tmaps = {}  # _tmap's encoded maps

    # ------------------------------------------------------------ driver plumbing
    def _ck(self, res, what):
        err = res[0]
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise CudaError(f"mamba {self.name}: {what} failed: {_err_name(self.cu, err)}")
        return res[1] if len(res) == 2 else res[1:]

    def _attr(self, a):
        return self._ck(self.cu.cuDeviceGetAttribute(a, self.dev), "cuDeviceGetAttribute")

    def _enter(self):
        self._ck(self.cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def stream(self):
        """The stream this thread's calls run on (mamba.stream, else legacy)."""
        number, owner = getattr(_current, "entry", None) or (LEGACY, None)
        return _Stream(self.cu, number, owner)

    @staticmethod
    def kname(stem, fast):
        """The kernel mb_<stem>, or fast mode's twin mb_fast_<stem> (fast.cu, modes.h's
        instantiations, vendor.h MB_KERNEL_PAIR)."""
        return ("mb_fast_" if fast else "mb_") + stem

    def _kernels(self, *names, smem=None):
        """Look the named kernels up in the module on first use (those outside
        KERNELS, which __init__ loads); smem: {name: bytes of dynamic shared memory}
        of those that launch with more than the default allows, besides the SSD
        kernels' (_cuda_ssd.SMEM), whichever caller looks them up first."""
        for n in names:
            if n not in self.fn:
                self.fn[n] = self._ck(self.cu.cuModuleGetFunction(self.mod, n.encode()), n)
                self._allow_smem(n, (smem or {}).get(n, _cuda_ssd.SMEM.get(n, 0)))

    def _allow_smem(self, name, smem):
        """Let kernel `name` launch with smem bytes of dynamic shared memory."""
        if smem > 48 * 1024:
            cu = self.cu
            self._ck(cu.cuFuncSetAttribute(
                self.fn[name], cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem), f"cuFuncSetAttribute({name})")

    def _launch(self, s, name, grid, block, *args, smem=0):
        """Every kernel parameter is 8 bytes (a pointer or an int64) or a ctypes struct.
        During a capture, a kernel of WAITS right after another kernel launches as its
        programmatic dependent (sm_90)."""
        try:  # ints and arrays: this thread's words for n parameters (the driver copies them)
            words, params = _params(len(args))
            words[:] = [a & 0xFFFFFFFFFFFFFFFF if type(a) is int else a.ptr for a in args]
        except AttributeError:  # a struct among them
            vals = [a if isinstance(a, ctypes.Structure) else
                    ctypes.c_uint64(_ptr(a) & 0xFFFFFFFFFFFFFFFF) for a in args]
            params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        if self._chain is not None and self._chain == int(s) and name in WAITS:
            self._launch_dependent(s, name, (gx, gy, gz), block, smem, params)
        else:
            self._ck(self.cu.cuLaunchKernel(self.fn[name], gx, gy, gz, block, 1, 1, smem, s,
                                            ctypes.addressof(params), 0), name)
        if self._capturing and self._dependents:  # never on HIP, whose streams need no int()
            self._chain = int(s)

    def _launch_dependent(self, s, name, grid, block, smem, params):
        """The launch of a programmatic dependent (only where self.programmatic)."""
        cu = self.cu
        cfg, attr = cu.CUlaunchConfig(), cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block, 1, 1
        cfg.sharedMemBytes, cfg.hStream = smem, s
        cfg.attrs, cfg.numAttrs = [attr], 1
        self._ck(cu.cuLaunchKernelEx(cfg, self.fn[name], ctypes.addressof(params), 0), name)

    def _fill32(self, s, p, value, n):
        """n 32-bit words at p set to value, on stream s (a node of its own in a
        capture: the next kernel does not launch as a programmatic dependent)."""
        self._ck(self.cu.cuMemsetD32Async(p, value, n, s), "cuMemsetD32Async")
        self._chain = None

    def _grid(self, n, threads=THREADS):
        """Blocks for a grid-stride loop over n items."""
        return max(1, min(_cdiv(n, threads), 32 * self.sms))

    def _sync(self, s):
        self._ck(self.cu.cuStreamSynchronize(s.cu), "cuStreamSynchronize")

    def _stream_of(self, number):
        return _Stream(self.cu, number, None).cu

    def side_stream(self, s, M, K):
        """This thread's second stream, made to wait for the work queued so far on s,
        for a projection of M rows of K terms that the next one on s does not need:
        the two grids then share the multiprocessors, each filling the other's last
        wave. None where that gains nothing or is not safe: a few rows (the GEMV),
        K past one leaf (the two would share the leaf scratch), a graph capture."""
        if M <= GEMV_MAX_M or K > LEAF or self._capturing:
            return None
        side = getattr(self._guard, "side", None)
        if side is None:
            side = self._guard.side = _SideStream(self)
        self._wait(side.cu, s)
        return side.cu

    def _wait(self, waiter, producer):
        """Make stream `waiter` wait for the work queued so far on `producer`."""
        cu = self.cu
        ev = self._ck(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        try:
            self._ck(cu.cuEventRecord(ev, producer), "cuEventRecord")
            self._ck(cu.cuStreamWaitEvent(waiter, ev, 0), "cuStreamWaitEvent")
        finally:
            cu.cuEventDestroy(ev)

    # ------------------------------------------------------------ arrays
    def new(self, shape):
        """A long-lived device array (weights, session state)."""
        mem = _Mem(self, 4 * math.prod(shape))
        return _core.wrap_device(tuple(shape), mem.ptr, self.name, self.device_id, mem)

    def empty(self, shape, like=None):
        """A call's output: on the device (from the pool, on the current stream) when
        `like` is a device array, else on the host."""
        self._enter()
        if like is not None and like.device == self.name:
            s = self.stream()
            mem = _PoolMem(self, 4 * math.prod(shape), s)
            return _core.wrap_device(tuple(shape), mem.ptr, self.name, self.device_id, mem,
                                     stream=s.number)
        return _core.empty(shape)

    def zeros(self, shapes, like=None):
        """Arrays of these shapes filled with +0, on the device (one pool allocation
        and one fill on the current stream: a zero state has up to ten pieces) when
        `like` is a device array, else on the host."""
        if like is None or like.device != self.name:
            return [_core.zeros(shape) for shape in shapes]
        self._enter()
        s, offs, end = self.stream(), [], 0
        for shape in shapes:
            offs.append(end)
            end += -(-4 * math.prod(shape) // 256) * 256
        mem = _PoolMem(self, end, s)
        self._fill32(s.cu, mem.ptr, 0, end // 4)
        return [_core.wrap_device(tuple(shape), mem.ptr + off, self.name, self.device_id, mem,
                                  stream=s.number) for shape, off in zip(shapes, offs)]

    def copy(self, a):
        """A long-lived device copy of a host or device array, complete on return so
        that any stream may use it."""
        self._enter()
        out = self.new(a.shape)
        self.copy_into(out, a)
        self._sync(self.stream())
        return out

    def copy_into(self, dst, src):
        if dst.size != src.size:
            raise ValueError("mamba: copy_into size mismatch")
        self._enter()
        cu, n, s = self.cu, 4 * src.size, self.stream()
        if dst.device == "cpu" and src.device == "cpu":
            _core.copy_into(dst, src)
        elif dst.device == "cpu":
            self._ck(cu.cuMemcpyDtoHAsync(dst.ptr, src.ptr, n, s.cu), "cuMemcpyDtoHAsync")
            self._sync(s)
        elif src.device == "cpu":
            self._ck(cu.cuMemcpyHtoDAsync(dst.ptr, src.ptr, n, s.cu), "cuMemcpyHtoDAsync")
        else:
            self._ck(cu.cuMemcpyDtoDAsync(dst.ptr, src.ptr, n, s.cu), "cuMemcpyDtoDAsync")

    def upload_weights(self, w):
        return tuple(self.copy(a) for a in w)

    def session_weights(self, block):
        # the block's device copies: refresh_weights replaces them, never edits them
        return block._dev_w

    def first_nonfinite_later(self, arrays, in_norm=False):
        """Queue the search for the first NaN or +-inf of each device array on the
        current stream; returns wait(), which blocks until the answers (flat
        indices, -1 for none) are on the host, not for work queued after this call,
        so a caller may launch its kernels before it waits. in_norm: the one array
        is a stateless prefill's x, whose norm (the next one this thread launches
        over exactly its elements) searches it as it reads it, one pass over x fewer;
        wait() runs the search itself if no norm took it."""
        self._enter()
        s, cu, n = self.stream(), self.cu, len(arrays)
        assert n == 1 or not in_norm
        host, event, _, words = slot = self._readback_slot(n)
        self._ck(cu.cuMemsetD8Async(words.ptr, 0xFF, 8 * n, s.cu), "cuMemsetD8Async")
        check = _InputCheck(arrays[0], slot) if in_norm else None
        if check is None:
            self._search(s.cu, arrays, slot)
        else:
            self._guard.input = check

        def wait():
            try:
                if check is not None and check.a is not None:  # no norm took it
                    self._guard.input = None
                    self._search(self.stream().cu, arrays, slot)
                self._ck(cu.cuEventSynchronize(event), "cuEventSynchronize")
                return [-1 if v == NONE else v for v in (ctypes.c_uint64 * n).from_address(host)]
            finally:
                self._readbacks.append(slot)
        return wait

    def _search(self, s, arrays, slot):
        """mb_first_nonfinite_k over each array into the slot's words, then their
        read-back."""
        for i, a in enumerate(arrays):
            self._launch(s, "mb_first_nonfinite_k", (self._grid(a.size),), THREADS, a.size, a,
                         slot[3].ptr + 8 * i)
        self._read_back(s, slot, len(arrays))

    def _read_back(self, s, slot, n):
        host, event, _, words = slot
        self._ck(self.cu.cuMemcpyDtoHAsync(host, words.ptr, 8 * n, s), "cuMemcpyDtoHAsync")
        self._ck(self.cu.cuEventRecord(event, s), "cuEventRecord")

    def _input_check(self, x, M, n, ldx):
        """The first_nonfinite_later(in_norm=True) search that a norm of M rows of n
        at x (rows ldx apart) takes over (its _InputCheck), or None: only a norm over
        exactly the checked elements, contiguous, takes one."""
        check = getattr(self._guard, "input", None)
        if check is None or ldx != n or _ptr(x) != check.a.ptr or M * n != check.a.size:
            return None
        self._guard.input, check.a = None, None
        return check

    def _readback_slot(self, n):
        """(pinned host words, event, their count >= n, device words as a _Mem),
        reused (a read-back into pageable memory would wait for the whole stream; the
        device words outlive the calls whose norms write them)."""
        with self._lock:
            for k, slot in enumerate(self._readbacks):
                if slot[2] >= n:
                    return self._readbacks.pop(k)
        words, cu = max(n, 64), self.cu
        host = int(self._ck(cu.cuMemHostAlloc(8 * words, 0), "cuMemHostAlloc"))
        event = self._ck(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        return host, event, words, _Mem(self, 8 * words)

    def sync_for_consumer(self, arr, consumer):
        """DLPack export: the consumer's stream waits for the stream that wrote arr."""
        if consumer is None or consumer == -1 or consumer == arr.stream:
            return
        self._enter()
        self._wait(self._stream_of(consumer), self._stream_of(arr.stream))

    # ------------------------------------------------------------ intake
    def intake(self, obj, what, name, writable):
        """A CUDA array from a foreign framework as a device Array, borrowed when it
        is C-contiguous (copied otherwise, unless it must be written in place)."""
        self._enter()
        s = self.stream()
        if hasattr(obj, "__dlpack__"):
            owner, ptr, (_, dev_id), shape, strides, dt = _core.dlpack_import(
                obj.__dlpack__(stream=s.number))
            dname = _DL_NAMES.get(tuple(dt), f"DLPack type {tuple(dt)}")
            readonly = False
        else:
            cai = obj.__cuda_array_interface__
            shape, (ptr, readonly) = tuple(cai["shape"]), cai["data"]
            dname = _CAI_NAMES.get(cai["typestr"][1:], cai["typestr"])
            strides = cai.get("strides")
            if strides is not None:
                strides = tuple(st // 4 for st in strides)
            producer = cai.get("stream")
            if producer is not None and producer != s.number:
                self._wait(s.cu, self._stream_of(producer))
            owner = obj
            dev_id = self._ck(self.cu.cuPointerGetAttribute(
                self.cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr),
                "cuPointerGetAttribute") if ptr else self.device_id
        if dname != "float32":
            _core._refuse_dtype(what, name, dname)
        if dev_id != self.device_id:
            raise ValueError(f"mamba {what}: {name} is on {self.name}:{dev_id}, but the "
                             f"{self.name.upper()} backend runs on {self.name}:{self.device_id}")
        if writable and readonly:
            raise ValueError(f"mamba {what}: {name} must be writable (it is updated in place)")
        a = _core.wrap_device(shape, ptr, self.name, dev_id, owner, readonly, stream=s.number)
        if _is_c_contiguous(shape, strides):
            return a
        if writable:
            raise ValueError(f"mamba {what}: {name} must be C-contiguous (it is updated in "
                             "place, so it cannot be copied)")
        if len(shape) > MAX_NDIM:
            raise ValueError(f"mamba {what}: {name} has more than {MAX_NDIM} dimensions")
        return self.gather(s, a, shape, strides)

    def gather(self, s, a, shape, strides):
        """A new C-order device array of `shape` taking a's elements at `strides`
        (elements), on stream s."""
        lay = _Layout(len(shape))
        for i, (d, st) in enumerate(zip(shape, strides)):
            lay.shape[i], lay.strides[i] = d, st
        out = self.empty(shape, like=a)
        self._launch(s.cu, "mb_gather_k", (self._grid(out.size),), THREADS, out.size, lay, a, out)
        return out

    # ------------------------------------------------------------ op launchers
    @staticmethod
    def _parts(M, N, K):
        """Floats of leaf scratch an identical projection needs (0 for K <= 8192)."""
        P = _cdiv(K, LEAF)
        return P * M * N if P > 1 else 0

    def gemm(self, s, M, N, K, X, ldx, W, ldw, Y, ldy, parts=0, fast=False, res=0, guard=0,
             conv=None, norm=0, check=None):
        """Y = X . W^T, plus res (the residual, Y's layout, ld ldy) when given; guard
        (a session's, GEMV paths only) makes a refused step's Y NaN. conv: a one-token
        call's conv step on Y's columns [c0, c0 + C), (c0, C, window, w, bias, u, ldu,
        guard) as mb_conv_step_k takes them: in the GEMV's epilogue (one kernel fewer
        a step), else right after. norm: the weight of an RMSNorm of X's rows that the
        identical GEMV applies first (only where gemv_norm_smem(M, K) is not 0); X is
        left as it was. check: a session step's check (step_guard's arguments) that
        such a GEMV runs on X, the step's whole input in at most GEMV_MROWS rows.

        identical: dot v1; K > 8192 runs one grid slice per leaf into `parts`, then
        folds. A few rows (decode) take the GEMV kernel: the same chains, more
        blocks; a narrow N a tile that covers it. fast: TF32 tensor cores (where the
        backend has them, else the identical GEMM): wgmma.cu's on Hopper where X and W
        are rows of 16-byte units, else fast.cu's; up to 8 rows the split-K GEMV, up
        to 64 the chain GEMV."""
        if M == 0 or N == 0:
            return
        assert not (conv and (res or guard))
        assert not norm or self.norm_in_gemv(fast, M, K)
        assert not check or (norm and M <= GEMV_MROWS and check[0] == M * K == M * ldx)
        epi, host = (0,) * 7, 0
        if conv and (M <= FAST_GEMV_MAX_M if fast else M <= GEMV_MAX_M and K <= LEAF):
            epi, guard, conv = conv[:7], conv[7], None
        if check:
            assert guard in (0, check[2])
            guard, host = check[2], check[3]
        if fast and M <= FAST_GEMV_MAX_M:
            self._launch(s, "mb_fast_gemv_k", (_cdiv(N, FAST_GEMV_ROWS),), FAST_THREADS,
                         M, N, K, X, ldx, W, ldw, Y, ldy, res, ldy, guard, *epi)
        elif (fast and M > GEMV_MAX_M and self.wgmma and K > 0  # TMA: rows of 16-byte units
              and K % 4 == ldx % 4 == ldw % 4 == 0 and (_ptr(X) | _ptr(W)) % 16 == 0):
            assert not guard
            self._launch(s, "mb_fast_wgmma_k", (_cdiv(M, WGMMA_BM) * _cdiv(N, WGMMA_BN),),
                         WGMMA_THREADS, M, N, K, self._tmap(X, M, K, ldx, WGMMA_BM),
                         self._tmap(W, N, K, ldw, WGMMA_BN), Y, ldy, res, ldy, smem=WGMMA_SMEM)
        elif fast and M > GEMV_MAX_M and self.tensor_cores:
            assert not guard
            self._launch(s, "mb_fast_gemm_k", (_cdiv(N, TF32_BN), _cdiv(M, TF32_BM)),
                         TF32_THREADS, M, N, K, X, ldx, W, ldw, Y, ldy, res, ldy,
                         smem=TF32_SMEM)
        else:
            self._gemm_chains(s, M, N, K, X, ldx, W, ldw, Y, ldy, parts, res, guard, epi, norm,
                              host)
        if conv:
            c0, C, window, w, bias, u, ldu, cguard = conv
            self._launch(s, self.kname("conv_step_k", fast),
                         (self._grid(M * C),), THREADS, M, C, _ptr(Y) + 4 * c0, ldy, window, w,
                         bias, u, ldu, cguard)

    def _tmap(self, a, rows, K, ld, box):
        """The TMA tensor map of a rows x K float32 matrix at a (ld floats apart) read
        as TF32 (rounded to nearest as it is copied), in boxes of box rows x 32 terms with
        the 128-byte swizzle (wgmma.cu). A map is a pure function of these, kept for the
        next call that asks for the same (weights keep their addresses, and the pool
        mostly hands a repeated call's scratch the same ones): encoding one costs tens
        of microseconds of host time, which a lone call's device would wait through."""
        key = (_ptr(a), rows, K, ld, box)
        tm = self._tmaps.get(key)
        if tm is None:
            if len(self._tmaps) >= TMAP_KEEP:
                self._tmaps.clear()
            tm = self._tmaps[key] = self._encode_tmap(*key)
        return tm

    def _encode_tmap(self, ptr, rows, K, ld, box):
        cu = self.cu
        u64, u32 = cu.cuuint64_t, cu.cuuint32_t
        tm = self._ck(cu.cuTensorMapEncodeTiled(
            cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_TFLOAT32, 2, ptr, [u64(K), u64(rows)],
            [u64(4 * ld)], [u32(32), u32(box)], [u32(1), u32(1)],
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
        out = _TensorMap()
        ctypes.memmove(ctypes.addressof(out), tm.getPtr(), ctypes.sizeof(out))
        return out

    def _gemm_chains(self, s, M, N, K, X, ldx, W, ldw, Y, ldy, parts, res, guard, epi, norm=0,
                     host=0):
        """gemm's dot-v1 paths; epi: the GEMV's conv epilogue (zeros: none); norm: as
        gemm's; host: the check's host words (gemm's check)."""
        P, nw = _cdiv(K, LEAF), N  # nw: the columns of the main launch
        if M <= GEMV_MAX_M:
            name, threads = "mb_gemv_k", GEMV_THREADS
            smem = self.gemv_norm_smem(M, K) if norm else self.gemv_smem
            grid = (_cdiv(N, GEMV_ROWS), _cdiv(M, GEMV_MROWS), P)
            tail = (norm, res, ldy, guard, host) + epi
        else:
            assert not guard
            narrow = [g for g in GEMM_NARROW if N <= g[2]]
            name, bm, bn, threads, per_sm = (GEMM_RES if res else narrow[0] if narrow else
                                             GEMM_WIDE)
            rects, small = [], P == 1 and name in GEMM_TAIL  # the small tiles' rectangles
            if small and N > bn and 0 < N % bn <= bn * STRIP_MAX:
                nw = N - N % bn
                self._gemm_tail(s, GEMM_STRIP[name], [(0, M, nw, N)], K, X, ldx, W, ldw, Y, ldy,
                                res)
            tiles, wave = _cdiv(M, bm) * _cdiv(nw, bn), per_sm * self.sms
            left = tiles % wave
            if small and tiles > wave and left <= TAIL_MAX * wave:
                r, c = divmod(tiles - left, _cdiv(nw, bn))  # the tail's first tile
                rects += [(r * bm, min(M, (r + 1) * bm), c * bn, nw), ((r + 1) * bm, M, 0, nw)] \
                    if c else [(r * bm, M, 0, nw)]
                tiles -= left
            if rects:
                self._gemm_tail(s, GEMM_TAIL[name], rects, K, X, ldx, W, ldw, Y, ldy, res)
            smem, grid, tail = 0, (tiles, 1, P), (res, ldy)
        if P == 1:
            self._launch(s, name, grid, threads, M, nw, K, X, ldx, W, ldw, Y, ldy, 0, *tail,
                         smem=smem)
            return
        self._launch(s, name, grid, threads, M, N, K, X, ldx, W, ldw, parts, N, M * N,
                     *((0,) * len(tail)), smem=smem)
        self._launch(s, "mb_dot_fold_k", (self._grid(M * N),), THREADS, P, M, N, parts, M * N,
                     Y, ldy, res, ldy, guard)

    def _gemm_tail(self, s, kernel, rects, K, X, ldx, W, ldw, Y, ldy, res):
        """Rectangles (m0, m1, n0, n1) of a one-leaf wide call's output in the smaller
        tiles of kernel (GEMM_TAIL's: the tiles past its last whole wave; GEMM_STRIP's:
        a narrow last column of tiles)."""
        name, tbm, tbn, threads = kernel
        X, W, Y, res = _ptr(X), _ptr(W), _ptr(Y), _ptr(res)
        for m0, m1, n0, n1 in rects:
            if m1 <= m0 or n1 <= n0:
                continue
            at = 4 * (m0 * ldy + n0)
            self._launch(s, name, (_cdiv(m1 - m0, tbm) * _cdiv(n1 - n0, tbn), 1, 1), threads,
                         m1 - m0, n1 - n0, K, X + 4 * m0 * ldx, ldx, W + 4 * n0 * ldw, ldw,
                         Y + at, ldy, 0, res + at if res else 0, ldy)

    def _rmsnorm(self, s, fast, M, n, x, w, out, r, ldx=None):
        """out = RMSNorm rows of x (M, n, rows ldx apart, n by default); r: M floats of
        scratch (identical). The first norm of a session step's capture also runs the
        step's guard (step_guard), and a prefill's norm of x its input check
        (first_nonfinite_later)."""
        ldx = ldx or n
        per = 0 if fast else self._norm_whole(M, n)
        blocks, threads = ((min(_cdiv(M, FAST_NORM_ROWS), 8 * self.sms), FAST_THREADS) if fast
                           else (min(_cdiv(M, per or NORM_ROWS), 16 * self.sms), NORM_THREADS))
        check = self._step_check(s, blocks, threads)
        ic = self._input_check(x, M, n, ldx)
        first = ic.slot[3].ptr if ic else 0
        if fast:
            self._launch(s, "mb_fast_rmsnorm_k", (blocks,), threads, M, n, x, ldx, w, out, n,
                         *check, first)
        else:
            self._launch(s, "mb_rms_k", (blocks,), threads, M, n, x, ldx, r, w,
                         out if per else 0, n, per, *check, first if per else 0,
                         smem=self.norm_smem)
            if not per:
                self._launch(s, "mb_rms_scale_k", (min(_cdiv(M, SCALE_ROWS), 32 * self.sms),),
                             THREADS, M, n, x, ldx, r, w, out, n, first)
        if ic:
            self._read_back(s, ic.slot, 1)

    def _norm_gemm(self, s, fast, M, K, X, norm_w, xn, r, N, W, Y, parts, conv=None, keep=False):
        """A block's RMSNorm of X's M rows of K into xn (r: M floats of scratch), then
        Y = xn . W^T with gemm's conv: in one decode GEMV where it can and xn is not
        to be kept (it is then not written), which also runs a session step's check
        (step_guard) when it holds the whole step in each block."""
        check = self.step_guard(None)
        fuse = not keep and self.norm_in_gemv(fast, M, K)
        if fuse and check is not None:
            fuse = M <= GEMV_MROWS and check[0] == M * K and _ptr(check[1]) == _ptr(X)
        if not fuse:
            self.step_guard(check)
            self._rmsnorm(s, fast, M, K, X, norm_w, xn, r)
            self.gemm(s, M, N, K, xn, K, W, K, Y, N, parts, fast, conv=conv)
            return
        self.gemm(s, M, N, K, X, K, W, K, Y, N, parts, fast, conv=conv, norm=norm_w, check=check)

    def step_guard(self, args):
        """Have the next norm this thread launches (the first of a session step's
        capture) check the step's input first: args are mb_step_guard_k's (n, x,
        guard word, host words). A norm of one block whose threads take the input in
        one round of loads runs the check itself (one kernel fewer a step); else the
        guard kernel runs before it. Returns the check no norm took (None clears)."""
        left, self._guard.args = getattr(self._guard, "args", None), args
        return left

    def _step_check(self, s, blocks, threads):
        """The check arguments the norm kernels take (zeros: none) for a norm of
        `blocks` blocks of `threads` (step_guard); launches the guard kernel instead
        where the norm cannot take it."""
        args = self.step_guard(None)
        if args is None:
            return (0, 0, 0, 0)
        if blocks == 1 and args[0] <= threads * GUARD_LOADS:
            return args
        self._launch(s, "mb_step_guard_k", (1,), GUARD_THREADS, *args)
        return (0, 0, 0, 0)

    def _norm_whole(self, M, n):
        """The rows a block of mb_rms_k holds whole, with w, and so scales itself (x
        read once), else 0: rows of one leaf (rmsnorm.cu: each padded to 4 mod 32
        floats), up to RN_ROWS of them, and at least NORM_WHOLE_MIN (or all M): a block
        walks one chain a row, so with fewer the chains, not memory, would bound it.
        At 0 the ring streams the rows and mb_rms_scale_k scales them."""
        if n > LEAF:
            return 0
        per = min(M, NORM_ROWS, (self.norm_smem // 4 - _cdiv(n, 4) * 4) // (_cdiv(n, 32) * 32 + 4))
        return per if per >= min(M, NORM_WHOLE_MIN) else 0

    def _uniform_offsets(self, B, L):
        """Row offsets of B rows of L tokens (B + 1 int64) on the device, kept; the
        upload completes before any stream can use them."""
        if (B, L) not in self._offsets:
            host = (ctypes.c_int64 * (B + 1))(*[b * L for b in range(B + 1)])
            mem = _Mem(self, 8 * (B + 1))
            self._ck(self.cu.cuMemcpyHtoD(mem.ptr, ctypes.addressof(host), 8 * (B + 1)),
                     "cuMemcpyHtoD")
            self._offsets[(B, L)] = mem
        return self._offsets[(B, L)].ptr

    def _on_device(self, sc, a, writeback=None, copy=False):
        """Device address of a host or device array; a host one is uploaded to scratch
        (and, when writeback is a list, queued to be copied back after the call), a
        device one copied there when copy is set."""
        if a.device == self.name:
            if not copy:
                return a.ptr
            p = sc(a.size)
            self._ck(self.cu.cuMemcpyDtoDAsync(p, a.ptr, 4 * a.size, sc.s.cu), "cuMemcpyDtoDAsync")
            return p
        p = sc.upload(a.ptr, 4 * a.size)
        if writeback is not None:
            writeback.append((a, p))
        return p

    def _out(self, sc, a, back):
        """Device address for a call's output a: a itself on the device, else scratch
        that _finish copies into the host array."""
        if a.device == self.name:
            return a.ptr
        p = sc(a.size)
        back.append((a, p))
        return p

    def _finish(self, s, back):
        for host, p in back:
            self._ck(self.cu.cuMemcpyDtoHAsync(host.ptr, p, 4 * host.size, s.cu),
                     "cuMemcpyDtoHAsync")
        if back:
            self._sync(s)

    def _m1_launch(self, s, fast, w, dm, B, L, off, M, xd, cw, h, yd, b, ragged, guard=0):
        """The launches of one Mamba-1 call on stream s: x (xd, padded (B, L, dm)) to
        y (yd), state (cw, h) updated in place, scratch b (_M1Buffers). A decode call
        (L = 1) moves the conv window in the conv step (in in_proj's GEMV where it
        can); guard is a session's guard word (finite.cu)."""
        di, R = 2 * dm, _cdiv(dm, 16)
        XR = R + 32
        conv_w, conv_b, x_proj, dt_w = w[2:6]
        out_proj = w[9]
        xs = xd
        if ragged:
            xs = b.xs
            self._launch(s, "mb_pack_rows_k", (self._grid(B * L * dm),), THREADS,
                         B, L, dm, off, xd, xs)
        if not b.queued:
            self._m1_front(s, fast, w, dm, M, xs, b,
                           (0, di, cw, conv_w, conv_b, b.u, di, guard) if L == 1 else None)
        rows = min(B, 65535)
        if L > 1:
            self._launch(s, self.kname("conv_silu_k", fast),
                         (self._grid(_cdiv(L, CONV_RUN) * di), rows),
                         THREADS, B, off, di, b.xz, 2 * di, cw, conv_w, conv_b, b.u, di)
            self._launch(s, "mb_conv_window_k", (self._grid(B * di),), THREADS,
                         B, off, di, b.xz, 2 * di, cw)
        self.gemm(s, M, XR, di, b.u, di, x_proj, di, b.xdbl, XR, b.parts, fast)
        self.gemm(s, M, di, R, b.xdbl, XR, dt_w, R, b.dtp, di, b.parts, fast)
        self._m1_scan(s, fast, w[6:9], B, L, off, di, R, b.dtp, b.u, b.xz, b.xdbl, h, b.yi, guard)
        self._back(s, B, L, dm, di, M, off, b.yi, out_proj, xd, b.xn, yd, b.parts, fast, guard)

    def _m1_scan(self, s, fast, vecs, B, L, off, di, R, dtp, u, xz, xdbl, h, yi, guard=0):
        """The selective scan of a Mamba-1 call from dt_proj's output dtp: yi (the
        gated output), state h updated in place; vecs: (dt_proj's bias, A_log, D)."""
        dt_b, A_log, D = vecs
        # a fast prefill wide enough to give each multiprocessor about 12 warps of the
        # four-states-a-lane scan (each walks its tokens' chain alone) takes it, other
        # fast calls the identical scan (scan1.cu)
        wide = fast and L > 1 and B * di >= 96 * self.sms
        ch, lanes, name = ((SCAN_P_CHANNELS, 4, "mb_fast_scan1p_k") if wide else
                           (SCAN_CHANNELS, 16, "mb_scan1_k"))
        self._launch(s, name, (_cdiv(di, ch), min(B, 65535)),
                     lanes * ch, B, off, di, R, dtp, dt_b, u, xz, xdbl, A_log, D, h, yi, guard)

    def _back(self, s, B, L, dm, di, M, off, yg, out_proj, xd, xn, yd, parts, fast, guard=0,
              gnorm=None):
        """out_proj of every block and the residual into the padded output (NaN where
        a session's guard refused the step): a few one-token rows add the residual in
        the GEMV's epilogue, a call without padding or guard in the GEMM's (packed and
        padded rows agree there), others in mb_residual_k; xn: M * dm scratch.
        gnorm: (w, r), Mamba-2's gated RMSNorm of yg first: in the identical GEMV
        where it fits (yg is then left as it was), else in place (r: M floats)."""
        norm = 0
        if gnorm is not None:
            if self.norm_in_gemv(fast, M, di):
                norm = gnorm[0]
            else:
                self._rmsnorm(s, fast, M, di, yg, gnorm[0], yg, gnorm[1])
        if (L == 1 and M <= GEMV_MAX_M) or (M == B * L and not guard):
            self.gemm(s, M, dm, di, yg, di, out_proj, di, yd, dm, parts, fast, xd, guard, norm=norm)
            return
        self.gemm(s, M, dm, di, yg, di, out_proj, di, xn, dm, parts, fast, norm=norm)
        self._launch(s, "mb_residual_k", (self._grid(B * L * dm),), THREADS,
                     B, L, dm, off, xd, xn, yd, guard)

    def _m1_front(self, s, fast, w, dm, M, xs, b, step=None):
        """A Mamba-1 call's block norm and in_proj into b (_M1Buffers); step: a
        one-token call's conv step (gemm's conv)."""
        self._norm_gemm(s, fast, M, dm, xs, w[0], b.xn, b.r, 4 * dm, w[1], b.xz, b.parts, step)

    def early_front(self, kind, w, dm, x, fast):
        """A stateless prefill's front (the norm and in_proj) queued now, before the
        host sets up the rest of the call, which the device of a lone call would
        otherwise wait through (blocks._Block._early); the forward given it (early=)
        goes on from there. None for host inputs."""
        if x.device == "cpu":
            return None
        if kind != "m1":
            return self._early_front(kind, w, dm, x, fast) if _cuda_ssd.enabled() else None
        if x.shape[1] == 1:  # a one-token prefill's conv step is in in_proj's epilogue
            return None
        M = x.shape[0] * x.shape[1]
        self._enter()
        s = self.stream()
        sc = _Scratch(self, s)
        try:
            b = _M1Buffers(self, sc, M, dm, False)
            self._m1_front(s.cu, fast, w, dm, M, x.ptr, b)
            b.queued = True
            return _cuda_ssd._Early(sc, (x.ptr, b))
        except BaseException:
            sc.__exit__()
            raise

    def m1_forward(self, w, d_model, x, pieces, y, lengths, fast=False, early=None):
        self._enter()
        s = self.stream()
        dm, B, L = d_model, x.shape[0], x.shape[1]
        back = []
        with (early.sc if early is not None else _Scratch(self, s)) as sc:
            front = early.take() if early is not None else None
            if lengths is None:
                off, M = self._uniform_offsets(B, L), B * L
            else:
                off = [0]
                for n in lengths:
                    off.append(off[-1] + n)
                host = (ctypes.c_int64 * (B + 1))(*off)
                off, M = sc.upload(ctypes.addressof(host), 8 * (B + 1)), off[-1]
            xd, bufs = front or (self._on_device(sc, x), None)
            cw = self._on_device(sc, pieces[0], back)
            h = self._on_device(sc, pieces[1], back)
            yd = self._out(sc, y, back)
            bufs = (bufs or _M1Buffers(self, sc, M, dm, lengths is not None)).rest()
            self._m1_launch(s.cu, fast, w, dm, B, L, off, M, xd, cw, h, yd, bufs,
                            lengths is not None)
            self._finish(s, back)

    def m1_session(self, w, d_model, pieces, fast):
        from . import _cuda_session  # it imports this module
        return _cuda_session.M1Session(self, w, d_model, pieces, fast)

    def _capture_stream(self):
        """A private stream for graph capture (the legacy stream cannot capture)."""
        if self._capture is None:
            self._capture = self._ck(self.cu.cuStreamCreate(
                int(self.cu.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")
        return self._capture

    def release(self, free):
        """Run free() (a cuMemFree and the like) now, or after the graph capture in
        progress: a synchronous driver call during a capture invalidates it, and the
        garbage collector may drop an array at any point of a capture's body."""
        if self._capturing:
            self._released.append(free)
            return
        try:
            free()
        except Exception:  # interpreter shutdown: the driver may already be gone
            pass

    @contextlib.contextmanager
    def capturing(self, dependents=True):
        """The span of a graph capture, with the frees it held back run at its end;
        dependents: the kernels of WAITS launch as programmatic dependents."""
        self._capturing += 1
        self._chain = None
        self._dependents = dependents and self.programmatic
        try:
            yield self._capture_stream()
        finally:
            self._capturing -= 1
            self._chain = None
            if not self._capturing:
                held, self._released = self._released, []
                for free in held:
                    self.release(free)

    # ------------------------------------------------------------ test hooks
    def _gemm(self, X, W, M, N, K, fast=False, norm=None, res=None):
        """Y = X . W^T on the device for host X (M, K), W (N, K); a host Y (tests).
        norm: a host RMSNorm weight (K,) that the GEMV applies to X's rows first; res:
        a host (M, N) added as the residual."""
        self._enter()
        s = self.stream()
        Y = _core.empty((M, N))
        with _Scratch(self, s) as sc:
            xd, wd, yd = self._on_device(sc, X), self._on_device(sc, W), sc(M * N)
            nd = self._on_device(sc, norm) if norm is not None else 0
            rd = self._on_device(sc, res) if res is not None else 0
            parts = sc(self._parts(M, N, K)) if self._parts(M, N, K) else 0
            self.gemm(s.cu, M, N, K, xd, K, wd, K, yd, N, parts, fast, res=rd, norm=nd)
            self._finish(s, [(Y, yd)])
        return Y

    def _math(self, name, X):
        """numerics.h's scalar function name (as _core._math names it) of each element
        of host X on the device; a host result (tests)."""
        self._enter()
        s = self.stream()
        Y = _core.empty(X.shape)
        with _Scratch(self, s) as sc:
            xd, yd = self._on_device(sc, X), sc(X.size)
            self._launch(s.cu, "mb_math_k", (self._grid(X.size),), THREADS, _core._MATH[name],
                         X.size, xd, yd)
            self._finish(s, [(Y, yd)])
        return Y

    def _rmsnorm_rows(self, X, W, M, n, in_place=False, fast=False):
        """RMSNorm of M rows of n of host X with weight W on the device; a host result
        (tests). in_place: the output overwrites the rows."""
        self._enter()
        s = self.stream()
        Y = _core.empty((M, n))
        with _Scratch(self, s) as sc:
            xd, wd, r = self._on_device(sc, X), self._on_device(sc, W), sc(M)
            yd = xd if in_place else sc(M * n)
            self._rmsnorm(s.cu, fast, M, n, xd, wd, yd, r)
            self._finish(s, [(Y, yd)])
        return Y


def _is_c_contiguous(shape, strides):
    if strides is None:
        return True
    want = 1
    for d, s in zip(reversed(shape), reversed(strides)):
        if d != 1 and s != want:
            return False
        want *= d
    return True
