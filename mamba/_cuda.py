"""The CUDA backend: load the kernel module, get its functions, launch, free.

The kernels (backends/kernels/, one source for nvcc and hipcc) are compiled at build
time into mamba_kernels.fatbin beside this file and driven through cuda-python's
driver bindings. This file chooses grids and scratch; the arithmetic lives in the
kernels, whose order is fixed by SPEC section 4, so no choice here changes a bit.

Streams: every launch and copy is issued on the legacy default stream of device 0's
primary context (the context and stream torch uses by default). Device inputs taken
through DLPack are requested with stream=1, so the producer orders its pending
work before ours; a CUDA-array-interface input's "stream" is waited on. Device
outputs say stream 1 in __cuda_array_interface__, and their __dlpack__(stream=s)
makes s wait for our work. Work on a framework's side stream is therefore ordered
by the protocols; raw pointers handed around otherwise are the caller's to order.
Device inputs must stay alive until the work that reads them has run.
"""
import ctypes
import importlib.resources

from . import _core

FATBIN = "mamba_kernels.fatbin"
LEAF = 8192          # dot v1 leaf length (numerics.h MB_DOT_LEAF)
GEMM_TILE = 128      # gemm.cu: BM = BN
GEMM_THREADS = 256
GEMV_M, GEMV_ROWS, GEMV_THREADS = 8, 32, 128  # gemm.cu: mb_gemv_k for M <= GEMV_M
SCAN_LANES = 4       # scan1.cu: lanes per channel
THREADS = 256
MAX_NDIM = 8         # copy.cu mb_layout
KERNELS = ("mb_gemm_k", "mb_gemv_k", "mb_dot_fold_k", "mb_rmsnorm_k", "mb_conv_silu_k", "mb_conv_window_k",
           "mb_scan1_k", "mb_residual_k", "mb_pack_rows_k", "mb_first_nonfinite_k",
           "mb_gather_k")

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
    """Device bytes from cuMemAlloc, freed when the last Array over them dies."""

    def __init__(self, be, nbytes):
        self.be = be
        self.ptr = int(be._ck(be.cu.cuMemAlloc(max(nbytes, 4)), "cuMemAlloc"))

    def __del__(self):
        try:
            self.be._enter()
            self.be.cu.cuMemFree(self.ptr)
        except Exception:  # interpreter shutdown: the driver may already be gone
            pass


class _Scratch:
    """Stream-ordered scratch for one call: allocated and freed on the stream, so
    the frees wait for the kernels that use it and nothing blocks the host."""

    def __init__(self, be):
        self.be, self.ptrs = be, []

    def __call__(self, nfloats):
        be = self.be
        p = int(be._ck(be.cu.cuMemAllocAsync(max(4 * nfloats, 4), be.stream), "cuMemAllocAsync"))
        self.ptrs.append(p)
        return p

    def upload(self, data, nbytes):
        p = self((nbytes + 3) // 4)
        self.be._ck(self.be.cu.cuMemcpyHtoDAsync(p, data, nbytes, self.be.stream),
                    "cuMemcpyHtoDAsync")
        return p

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.ptrs:
            self.be.cu.cuMemFreeAsync(p, self.be.stream)
        return False


class _Layout(ctypes.Structure):
    _fields_ = [("ndim", ctypes.c_int64), ("shape", ctypes.c_int64 * MAX_NDIM),
                ("strides", ctypes.c_int64 * MAX_NDIM)]


def _ptr(a):
    return a.ptr if isinstance(a, _core.Array) else a


class CudaBackend:
    """Mamba blocks on device 0. Weights are uploaded once per block; host inputs
    give host outputs, device inputs give device outputs."""
    name = "cuda"

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
        self.stream = cu.CUstream(cu.CU_STREAM_LEGACY)
        self._enter()
        err, mod = cu.cuModuleLoadData(image)
        if err == cu.CUresult.CUDA_ERROR_NO_BINARY_FOR_GPU:
            raise CudaError(f"the kernels have no binary for this GPU ({name}, sm_{major}{minor}; "
                            "built for sm_80, sm_90 and compute_90 PTX)")
        if err != cu.CUresult.CUDA_SUCCESS:
            raise CudaError(f"the kernel module did not load on {name}: {_err_name(cu, err)}")
        self.mod = mod
        self.fn = {k: self._ck(cu.cuModuleGetFunction(mod, k.encode()), k) for k in KERNELS}
        self._offsets = {}
        self.description = f"device 0: {name} (sm_{major}{minor}, {self.sms} SMs)"

    # ------------------------------------------------------------ driver plumbing
    def _ck(self, res, what):
        err = res[0]
        if err != self.cu.CUresult.CUDA_SUCCESS:
            raise CudaError(f"mamba cuda: {what} failed: {_err_name(self.cu, err)}")
        return res[1] if len(res) == 2 else res[1:]

    def _attr(self, a):
        return self._ck(self.cu.cuDeviceGetAttribute(a, self.dev), "cuDeviceGetAttribute")

    def _enter(self):
        self._ck(self.cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def _launch(self, name, grid, block, *args):
        """Every kernel parameter is 8 bytes (a pointer or an int64) or a ctypes struct."""
        vals = [a if isinstance(a, ctypes.Structure) else
                ctypes.c_uint64(_ptr(a) & 0xFFFFFFFFFFFFFFFF) for a in args]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        self._ck(self.cu.cuLaunchKernel(self.fn[name], gx, gy, gz, block, 1, 1, 0, self.stream,
                                        ctypes.addressof(params), 0), name)

    def _grid(self, n, threads=THREADS):
        """Blocks for a grid-stride loop over n items."""
        return max(1, min(_cdiv(n, threads), 32 * self.sms))

    def _sync(self):
        self._ck(self.cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def _order_after(self, stream):
        """Make our stream wait for the work queued so far on `stream`."""
        self._wait(self.stream, self.cu.CUstream(stream))

    def _wait(self, waiter, producer):
        cu = self.cu
        ev = self._ck(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        try:
            self._ck(cu.cuEventRecord(ev, producer), "cuEventRecord")
            self._ck(cu.cuStreamWaitEvent(waiter, ev, 0), "cuStreamWaitEvent")
        finally:
            cu.cuEventDestroy(ev)

    # ------------------------------------------------------------ arrays
    def new(self, shape):
        n = 1
        for d in shape:
            n *= d
        mem = _Mem(self, 4 * n)
        return _core.wrap_device(tuple(shape), mem.ptr, "cuda", self.device_id, mem)

    def empty(self, shape, like=None):
        self._enter()
        if like is not None and like.device == "cuda":
            return self.new(shape)
        return _core.empty(shape)

    def copy(self, a):
        """A device copy of a host or device array."""
        self._enter()
        out = self.new(a.shape)
        self.copy_into(out, a)
        return out

    def copy_into(self, dst, src):
        if dst.size != src.size:
            raise ValueError("mamba: copy_into size mismatch")
        self._enter()
        cu, n = self.cu, 4 * src.size
        if dst.device == "cpu" and src.device == "cpu":
            _core.copy_into(dst, src)
        elif dst.device == "cpu":
            self._ck(cu.cuMemcpyDtoHAsync(dst.ptr, src.ptr, n, self.stream), "cuMemcpyDtoHAsync")
            self._sync()
        elif src.device == "cpu":
            self._ck(cu.cuMemcpyHtoDAsync(dst.ptr, src.ptr, n, self.stream), "cuMemcpyHtoDAsync")
        else:
            self._ck(cu.cuMemcpyDtoDAsync(dst.ptr, src.ptr, n, self.stream), "cuMemcpyDtoDAsync")

    def upload_weights(self, w):
        return tuple(self.copy(a) for a in w)

    def session_weights(self, block):
        # the block's device copies: refresh_weights replaces them, never edits them
        return block._dev_w

    def first_nonfinite(self, a):
        """Flat index of the first NaN or +-inf of a device array, or -1."""
        self._enter()
        out = ctypes.c_uint64()
        with _Scratch(self) as sc:
            first = sc(2)
            self._ck(self.cu.cuMemsetD8Async(first, 0xFF, 8, self.stream), "cuMemsetD8Async")
            self._launch("mb_first_nonfinite_k", (self._grid(a.size),), THREADS, a.size, a, first)
            self._ck(self.cu.cuMemcpyDtoHAsync(ctypes.addressof(out), first, 8, self.stream),
                     "cuMemcpyDtoHAsync")
        self._sync()
        return -1 if out.value == 0xFFFFFFFFFFFFFFFF else out.value

    def sync_for_consumer(self, stream):
        """DLPack export: the consumer's stream waits for our work (1 is ours)."""
        if stream is None or stream in (-1, int(self.cu.CU_STREAM_LEGACY)):
            return
        self._enter()
        self._wait(self.cu.CUstream(stream), self.stream)

    # ------------------------------------------------------------ intake
    def intake(self, obj, what, name, writable):
        """A CUDA array from a foreign framework as a device Array, borrowed when it
        is C-contiguous (copied otherwise, unless it must be written in place)."""
        self._enter()
        if hasattr(obj, "__dlpack__"):
            owner, ptr, (_, dev_id), shape, strides, dt = _core.dlpack_import(
                obj.__dlpack__(stream=int(self.cu.CU_STREAM_LEGACY)))
            dname = _DL_NAMES.get(tuple(dt), f"DLPack type {tuple(dt)}")
            readonly = False
        else:
            cai = obj.__cuda_array_interface__
            shape, (ptr, readonly) = tuple(cai["shape"]), cai["data"]
            dname = _CAI_NAMES.get(cai["typestr"][1:], cai["typestr"])
            strides = cai.get("strides")
            if strides is not None:
                strides = tuple(s // 4 for s in strides)
            if cai.get("stream") is not None:
                self._order_after(cai["stream"])
            owner = obj
            dev_id = self._ck(self.cu.cuPointerGetAttribute(
                self.cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr),
                "cuPointerGetAttribute") if ptr else self.device_id
        if dname != "float32":
            _core._refuse_dtype(what, name, dname)
        if dev_id != self.device_id:
            raise ValueError(f"mamba {what}: {name} is on cuda:{dev_id}, but the CUDA backend "
                             f"runs on cuda:{self.device_id}")
        if writable and readonly:
            raise ValueError(f"mamba {what}: {name} must be writable (it is updated in place)")
        a = _core.wrap_device(shape, ptr, "cuda", dev_id, owner, readonly)
        if _is_c_contiguous(shape, strides):
            return a
        if writable:
            raise ValueError(f"mamba {what}: {name} must be C-contiguous (it is updated in "
                             "place, so it cannot be copied)")
        if len(shape) > MAX_NDIM:
            raise ValueError(f"mamba {what}: {name} has more than {MAX_NDIM} dimensions")
        lay = _Layout(len(shape))
        for i, (d, s) in enumerate(zip(shape, strides)):
            lay.shape[i], lay.strides[i] = d, s
        out = self.new(shape)
        self._launch("mb_gather_k", (self._grid(out.size),), THREADS, out.size, lay, a, out)
        return out

    # ------------------------------------------------------------ op launchers
    def gemm(self, sc, M, N, K, X, ldx, W, ldw, Y, ldy):
        """Y = X . W^T under dot v1; K > 8192 runs one grid slice per leaf, then folds.
        A few rows (decode) take the GEMV kernel: the same chains, more blocks."""
        if M == 0 or N == 0:
            return
        P = max(1, _cdiv(K, LEAF))
        if M <= GEMV_M:
            name, grid, threads = "mb_gemv_k", (_cdiv(N, GEMV_ROWS), 1, P), GEMV_THREADS
        else:
            name, threads = "mb_gemm_k", GEMM_THREADS
            grid = (_cdiv(N, GEMM_TILE), _cdiv(M, GEMM_TILE), P)
        if P == 1:
            self._launch(name, grid, threads, M, N, K, X, ldx, W, ldw, Y, ldy, 0)
            return
        parts = sc(P * M * N)
        self._launch(name, grid, threads, M, N, K, X, ldx, W, ldw, parts, N, M * N)
        self._launch("mb_dot_fold_k", (self._grid(M * N),), THREADS, P, M, N, parts, M * N, Y, ldy)

    def _offsets_for(self, sc, B, L, lengths):
        """Row offsets (B + 1 int64) on the device; the uniform ones are kept."""
        if lengths is None and (B, L) in self._offsets:
            return self._offsets[(B, L)][0], B * L
        off = [0]
        for b in range(B):
            off.append(off[-1] + (lengths[b] if lengths is not None else L))
        host = (ctypes.c_int64 * (B + 1))(*off)
        if lengths is not None:
            return sc.upload(ctypes.addressof(host), 8 * (B + 1)), off[-1]
        mem = _Mem(self, 8 * (B + 1))
        self._ck(self.cu.cuMemcpyHtoDAsync(mem.ptr, ctypes.addressof(host), 8 * (B + 1),
                                           self.stream), "cuMemcpyHtoDAsync")
        self._offsets[(B, L)] = (mem.ptr, mem)
        return mem.ptr, off[-1]

    def _on_device(self, sc, a, writeback=None):
        """Device address of a host or device array; a host one is uploaded to scratch
        (and, when writeback is a list, queued to be copied back after the call)."""
        if a.device == "cuda":
            return a.ptr
        p = sc.upload(a.ptr, 4 * a.size)
        if writeback is not None:
            writeback.append((a, p))
        return p

    def _finish(self, back):
        for host, p in back:
            self._ck(self.cu.cuMemcpyDtoHAsync(host.ptr, p, 4 * host.size, self.stream),
                     "cuMemcpyDtoHAsync")
        if back:
            self._sync()

    def m1_forward(self, w, d_model, x, pieces, y, lengths):
        self._enter()
        dm, B, L = d_model, x.shape[0], x.shape[1]
        di, NS = 2 * dm, 16
        R = _cdiv(dm, 16)
        XR = R + 2 * NS
        norm_w, in_proj, conv_w, conv_b, x_proj, dt_w, dt_b, A_log, D, out_proj = w
        back = []
        with _Scratch(self) as sc:
            off, M = self._offsets_for(sc, B, L, lengths)
            xd = self._on_device(sc, x)
            cw = self._on_device(sc, pieces[0], back)
            h = self._on_device(sc, pieces[1], back)
            yd = y.ptr if y.device == "cuda" else sc(B * L * dm)
            xs = xd
            if lengths is not None:
                xs = sc(M * dm)
                self._launch("mb_pack_rows_k", (self._grid(B * L * dm),), THREADS,
                             B, L, dm, off, xd, xs)
            xn, xz, u = sc(M * dm), sc(M * 2 * di), sc(M * di)
            dtp, yi, xdbl = sc(M * di), sc(M * di), sc(M * XR)
            self._launch("mb_rmsnorm_k", (min(M, 64 * self.sms),), 128, M, dm, xs, dm, norm_w,
                         xn, dm)
            self.gemm(sc, M, 2 * di, dm, xn, dm, in_proj, dm, xz, 2 * di)
            rows = min(B, 65535)
            self._launch("mb_conv_silu_k", (self._grid(L * di), rows), THREADS,
                         B, off, di, xz, 2 * di, cw, conv_w, conv_b, u, di)
            self._launch("mb_conv_window_k", (self._grid(B * di),), THREADS,
                         B, off, di, xz, 2 * di, cw)
            self.gemm(sc, M, XR, di, u, di, x_proj, di, xdbl, XR)
            self.gemm(sc, M, di, R, xdbl, XR, dt_w, R, dtp, di)
            self._launch("mb_scan1_k", (_cdiv(SCAN_LANES * di, 128), rows), 128,
                         B, off, di, R, dtp, dt_b, u, xz, xdbl, A_log, D, h, yi)
            self.gemm(sc, M, dm, di, yi, di, out_proj, di, xn, dm)
            self._launch("mb_residual_k", (self._grid(B * L * dm),), THREADS,
                         B, L, dm, off, xd, xn, yd)
            if y.device == "cpu":
                back.append((y, yd))
            self._finish(back)

    # ------------------------------------------------------------ test hooks
    def _gemm(self, X, W, M, N, K):
        """Y = X . W^T on the device for host X (M, K), W (N, K); a host Y (tests)."""
        self._enter()
        Y = _core.empty((M, N))
        with _Scratch(self) as sc:
            xd, wd, yd = self._on_device(sc, X), self._on_device(sc, W), sc(M * N)
            self.gemm(sc, M, N, K, xd, K, wd, K, yd, N)
            self._finish([(Y, yd)])
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
