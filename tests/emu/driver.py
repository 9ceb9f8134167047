"""A stand-in for cuda.bindings.driver over the host emulation of the kernels
(tests/emu): device memory is host memory, a stream does its work as it is issued,
and a captured graph records the work to replay it at each launch. It answers the
calls mamba/_cuda*.py make, in cuda-python's form (a tuple led by the error code)."""
import ctypes
import enum
import itertools
import types


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_LAUNCH_FAILED = 719
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901


OK = (CUresult.CUDA_SUCCESS,)
SMEM_DEFAULT = 48 * 1024  # dynamic shared memory a kernel may launch with unless raised


class _Names:
    """Enum members the backend only hands back to the driver: their names."""

    def __getattr__(self, name):
        return name


class _Kernel(ctypes.Structure):  # table.h mb_emu_kernel
    _fields_ = [("name", ctypes.c_char_p), ("run", ctypes.c_void_p), ("nargs", ctypes.c_int),
                ("sizes", ctypes.POINTER(ctypes.c_size_t))]


class Driver:
    CUresult = CUresult
    CUdevice_attribute = CUfunction_attribute = CUmemAllocationType = _Names()
    CUmemLocationType = CUmemPool_attribute = CUpointer_attribute = _Names()
    CUevent_flags = CUstreamCaptureMode = CUlaunchAttributeID = _Names()
    CUstream_flags = types.SimpleNamespace(CU_STREAM_NON_BLOCKING=1)
    CU_STREAM_LEGACY, CU_STREAM_PER_THREAD = 1, 2
    CU_MEMHOSTALLOC_DEVICEMAP = 2
    CUstream = staticmethod(int)
    cuuint64_t = staticmethod(int)
    ATTRIBUTES = {"CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR": 9,
                  "CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR": 0,
                  "CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT": 2}  # small grids: less to run

    def __init__(self, lib_path):
        self.lib = lib = ctypes.CDLL(lib_path)
        n = ctypes.c_size_t.in_dll(lib, "mb_emu_nkernels").value
        self.kernels = {k.name.decode(): k for k in (_Kernel * n).in_dll(lib, "mb_emu_kernels")}
        lib.mb_emu_launch.restype = ctypes.c_char_p
        lib.mb_emu_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_uint] * 4 + [
            ctypes.c_size_t]
        self.mem = {}        # address -> the buffer behind it
        self.capture = {}    # stream -> the work recorded on it since cuStreamBeginCapture
        self.invalidated = False  # an unsafe call came during the captures in progress
        self.launched = set()
        self.smem_bound = {}  # kernel -> its dynamic shared memory bound, where raised
        self.dependents = 0  # programmatic dependent launches
        self.error = b""
        self._streams = itertools.count(16)  # clear of the legacy and per-thread numbers
        self.destroyed_streams = []

    @staticmethod
    def CUmemPoolProps():
        return types.SimpleNamespace(location=types.SimpleNamespace())

    def _issue(self, stream, work):
        """Run work now, or record it when its stream is capturing a graph. Work on
        the legacy stream during a capture is unsafe (it synchronizes with others)."""
        rec = self.capture.get(int(stream))
        if rec is None:
            if int(stream) == self.CU_STREAM_LEGACY:
                return self._unsafe(work)
            return work()
        if self.invalidated:
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,)
        rec.append(work)
        return OK

    def _unsafe(self, work):
        """A call the driver refuses during a (thread-local) capture, invalidating it:
        synchronous allocation, freeing, copies and waits, as on a GPU."""
        if not self.capture:
            return work()
        self.invalidated = True
        return (CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,)

    # ------------------------------------------------------------ device, module
    def cuInit(self, flags):
        return OK

    def cuDeviceGetCount(self):
        return OK + (1,)

    def cuDeviceGet(self, i):
        return OK + (0,)

    def cuDeviceGetName(self, n, dev):
        return OK + (b"host emulation\0",)

    def cuDeviceGetAttribute(self, attr, dev):
        return OK + (self.ATTRIBUTES[attr],)

    def cuDevicePrimaryCtxRetain(self, dev):
        return OK + (1,)

    def cuCtxSetCurrent(self, ctx):
        return OK

    def cuModuleLoadData(self, image):
        return OK + (1,)

    def cuModuleGetFunction(self, mod, name):
        # as the driver does for a kernel the module lacks (wgmma.cu's is sm_90a-only)
        if name.decode() not in self.kernels:
            return (CUresult.CUDA_ERROR_NOT_FOUND, None)
        return OK + (name.decode(),)

    def cuFuncSetAttribute(self, fn, attr, value):
        if attr == "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES":
            self.smem_bound[fn] = value
        return OK

    def cuGetErrorName(self, err):
        return OK + (CUresult(err).name.encode() + self.error,)

    def cuPointerGetAttribute(self, attr, ptr):
        return OK + (0,)

    # ------------------------------------------------------------ memory
    def _alloc(self, n):
        buf = ctypes.create_string_buffer(int(n))
        ctypes.memset(buf, 0xFF, int(n))  # NaN bits: an unwritten output shows
        self.mem[ctypes.addressof(buf)] = buf
        return OK + (ctypes.addressof(buf),)

    def _free(self, p):
        del self.mem[int(p)]
        return OK

    def cuMemAlloc(self, n):
        return self._unsafe(lambda: self._alloc(n))

    def cuMemAllocFromPoolAsync(self, n, pool, stream):
        if int(stream) == self.CU_STREAM_LEGACY:
            return self._unsafe(lambda: self._alloc(n))
        return self._alloc(n)

    def cuMemHostAlloc(self, n, flags):
        return self._unsafe(lambda: self._alloc(n))

    def cuMemHostGetDevicePointer(self, p, flags):
        return OK + (p,)

    def cuMemFree(self, p):
        return self._unsafe(lambda: self._free(p))

    def cuMemFreeHost(self, p):
        return self._unsafe(lambda: self._free(p))

    def cuMemFreeAsync(self, p, stream):
        return self._issue(stream, lambda: self._free(p))

    def cuMemPoolCreate(self, props):
        return OK + (1,)

    def cuMemPoolSetAttribute(self, pool, attr, value):
        return OK

    def _copy(self, dst, src, n, stream=None):
        def work():
            ctypes.memmove(int(dst), int(src), int(n))
            return OK
        return work() if stream is None else self._issue(stream, work)

    def cuMemcpyHtoD(self, dst, src, n):
        return self._unsafe(lambda: self._copy(dst, src, n))

    def cuMemcpyHtoDAsync(self, dst, src, n, stream):
        return self._copy(dst, src, n, stream)

    def cuMemcpyDtoHAsync(self, dst, src, n, stream):
        return self._copy(dst, src, n, stream)

    def cuMemcpyDtoDAsync(self, dst, src, n, stream):
        return self._copy(dst, src, n, stream)

    def cuMemsetD8Async(self, p, value, n, stream):
        def work():
            ctypes.memset(int(p), value, int(n))
            return OK
        return self._issue(stream, work)

    def cuMemsetD32Async(self, p, value, n, stream):
        def work():
            ctypes.memmove(int(p), int(value).to_bytes(4, "little") * int(n), 4 * int(n))
            return OK
        return self._issue(stream, work)

    # ------------------------------------------------------------ streams, events, graphs
    def cuStreamCreate(self, flags):
        return OK + (next(self._streams),)

    def cuStreamDestroy(self, stream):
        self.destroyed_streams.append(int(stream))
        return self._unsafe(lambda: OK)

    def cuStreamSynchronize(self, stream):
        return self._unsafe(lambda: OK)

    def cuEventCreate(self, flags):
        return OK + (0,)

    def cuEventRecord(self, event, stream):
        return OK

    def cuEventSynchronize(self, event):
        return self._unsafe(lambda: OK)

    def cuStreamWaitEvent(self, stream, event, flags):
        return OK

    def cuEventDestroy(self, event):
        return OK

    def cuStreamBeginCapture(self, stream, mode):
        self.capture[int(stream)] = []
        return OK

    def cuStreamEndCapture(self, stream):
        graph = self.capture.pop(int(stream))
        if self.invalidated:
            self.invalidated = bool(self.capture)
            return (CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, None)
        return OK + (graph,)

    def cuGraphInstantiate(self, graph, flags):
        return OK + (tuple(graph),)

    def cuGraphUpload(self, graph_exec, stream):
        return OK

    def cuGraphLaunch(self, graph_exec, stream):
        def work():
            for w in graph_exec:
                res = w()
                if res[0] != CUresult.CUDA_SUCCESS:
                    return res
            return OK
        return self._issue(stream, work)

    def cuGraphExecDestroy(self, graph_exec):
        return OK

    def cuGraphDestroy(self, graph):
        return OK

    # ------------------------------------------------------------ launch
    @staticmethod
    def CUlaunchConfig():
        return types.SimpleNamespace()

    @staticmethod
    def CUlaunchAttribute():
        return types.SimpleNamespace(value=types.SimpleNamespace())

    def cuLaunchKernelEx(self, cfg, fn, params, extra):
        """A programmatic dependent launch (the only attribute the backend sets) is
        checked: it follows a kernel in its capture, and every thread of the kernel
        passes MB_GRID_WAIT() (vendor.h)."""
        (attr,) = cfg.attrs[:cfg.numAttrs]
        assert attr.id == "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION"
        assert attr.value.programmaticStreamSerializationAllowed == 1
        self.dependents += 1
        rec = self.capture.get(int(cfg.hStream))
        if not rec or not getattr(rec[-1], "kernel", False):
            self.error = f": {fn} launched as a programmatic dependent of no kernel".encode()
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        return self.cuLaunchKernel(fn, cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX,
                                   cfg.blockDimY, cfg.blockDimZ, cfg.sharedMemBytes,
                                   cfg.hStream, params, extra, waits=True)

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra,
                       waits=False):
        k = self.kernels.get(fn)
        if k is None:
            self.error = f": {fn} is not in the emulation library".encode()
            return (CUresult.CUDA_ERROR_NOT_FOUND,)
        assert by == bz == 1, "the backend launches 1-D blocks"
        if smem > max(SMEM_DEFAULT, self.smem_bound.get(fn, 0)):  # as the driver refuses it
            self.error = (f": {fn} launched with {smem} bytes of dynamic shared memory, "
                          f"its bound {self.smem_bound.get(fn, SMEM_DEFAULT)}").encode()
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        # copy every parameter: a captured launch runs after the caller's values are gone
        ptrs = (ctypes.c_void_p * k.nargs).from_address(params)
        vals = [ctypes.create_string_buffer(ctypes.string_at(ptrs[i], k.sizes[i]), k.sizes[i])
                for i in range(k.nargs)]
        args = (ctypes.c_void_p * k.nargs)(*[ctypes.addressof(v) for v in vals])
        self.launched.add(fn)

        def work(vals=vals):
            counted = ctypes.c_ulonglong.in_dll(self.lib, "mb_emu_grid_waits")
            before = counted.value
            err = self.lib.mb_emu_launch(k.run, args, gx, gy, gz, bx, smem)
            if err is None and waits and counted.value - before != gx * gy * gz * bx:
                err = (f"launched as a programmatic dependent, {counted.value - before} of "
                       f"its {gx * gy * gz * bx} threads passed MB_GRID_WAIT()").encode()
            if err is None:
                return OK
            self.error = f": {fn}: {err.decode()}".encode()
            return (CUresult.CUDA_ERROR_LAUNCH_FAILED,)
        work.kernel = True
        return self._issue(stream, work)
