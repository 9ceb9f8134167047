# cython: language_level=3
"""Buffer intake, mamba.Array and dispatch to the C reference.

Everything here works without numpy: arrays come in through the buffer protocol
and go out as `Array`, which exports the buffer protocol and DLPack.
"""
from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_FORMAT,
                             PyBUF_STRIDES, PyBUF_ND, PyBUF_WRITABLE,
                             PyBUF_C_CONTIGUOUS, PyBUF_ANY_CONTIGUOUS)
from cpython.pycapsule cimport (PyCapsule_New, PyCapsule_IsValid, PyCapsule_GetPointer,
                                PyCapsule_SetName)
from cpython.ref cimport Py_INCREF, Py_DECREF, PyObject
from libc.stdint cimport (int64_t, uint8_t, uint16_t, int8_t, int32_t, uint64_t, uint32_t,
                           uintptr_t)
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memset

cdef extern from "stdlib.h" nogil:
    int posix_memalign(void **memptr, size_t alignment, size_t size)

cdef extern from "Python.h":
    ctypedef int PyGILState_STATE
    PyGILState_STATE PyGILState_Ensure() nogil
    void PyGILState_Release(PyGILState_STATE) nogil
    int PyBuffer_ToContiguous(void *buf, Py_buffer *view, Py_ssize_t len, char order) except -1

cdef extern from "mamba_ref.h" nogil:
    enum: MB_OK, MB_ENOMEM
    ctypedef struct mb_m1_weights:
        int64_t d_model
        const float *norm_w
        const float *in_proj
        const float *conv_w
        const float *conv_b
        const float *x_proj
        const float *dt_proj_w
        const float *dt_proj_b
        const float *A_log
        const float *D
        const float *out_proj
    ctypedef struct mb_m1_state:
        float *conv_window
        float *h
    int mb_m1_forward(const mb_m1_weights *w, int64_t B, int64_t L, const int64_t *lengths,
                      const float *x, const mb_m1_state *state, float *y)
    ctypedef struct mb_m1_grads:
        float *x
        float *norm_w
        float *in_proj
        float *conv_w
        float *conv_b
        float *x_proj
        float *dt_proj_w
        float *dt_proj_b
        float *A_log
        float *D
        float *out_proj
    int mb_m1_backward(const mb_m1_weights *w, int64_t B, int64_t L, const float *x,
                       const float *kept, const float *dy, const mb_m1_grads *grads)
    int64_t mb_m1_kept_floats(int64_t d_model, int64_t B, int64_t L)
    int mb_m1_vjp(const mb_m1_weights *w, int64_t B, int64_t L, const float *x, float *y,
                  float *kept)
    ctypedef struct mb_m2_weights:
        int64_t d_model
        const float *block_norm_w
        const float *in_proj
        const float *conv_w
        const float *conv_b
        const float *dt_bias
        const float *A_log
        const float *D
        const float *norm_w
        const float *out_proj
        float dt_lo
        float dt_hi
    ctypedef struct mb_m2_state:
        float *conv_window
        float *h
        float *buffer_xbc
        float *buffer_dtraw
        int64_t *buffered_tokens
    int mb_m2_forward(const mb_m2_weights *w, int64_t B, int64_t L, const int64_t *lengths,
                      const float *x, const mb_m2_state *state, float *y)
    int mb_m2_h_last(const mb_m2_weights *w, int64_t B, const mb_m2_state *state, float *h_last)
    ctypedef struct mb_m2_grads:
        float *x
        float *block_norm_w
        float *in_proj
        float *conv_w
        float *conv_b
        float *dt_bias
        float *A_log
        float *D
        float *norm_w
        float *out_proj
    int mb_m2_backward(const mb_m2_weights *w, int64_t B, int64_t L, const float *x,
                       const float *kept, const float *dy, const mb_m2_grads *grads)
    int64_t mb_m2_kept_floats(int64_t d_model, int64_t B, int64_t L)
    int mb_m2_vjp(const mb_m2_weights *w, int64_t B, int64_t L, const float *x, float *y,
                  float *kept)
    ctypedef struct mb_m3_weights:
        int64_t d_model
        const float *norm_w
        const float *in_proj
        const float *dt_bias
        const float *B_norm_w
        const float *C_norm_w
        const float *B_bias
        const float *C_bias
        const float *D
        const float *out_proj
    ctypedef struct mb_m3_state:
        float *theta
        float *h
        float *buffer_qrot
        float *buffer_krot
        float *buffer_v
        float *buffer_dt
        float *buffer_sig
        float *buffer_adt
        float *pending_k
        float *pending_v
        int64_t buffered_tokens
        int pending
    ctypedef struct mb_m3_reports:
        float *h_last
        float *k_last
        float *v_last
        float *theta_last
    int mb_m3_forward(const mb_m3_weights *w, int64_t B, int64_t L, const int64_t *lengths,
                      const float *x, mb_m3_state *state, float *y,
                      const mb_m3_reports *reports)
    ctypedef struct mb_m3_grads:
        float *x
        float *norm_w
        float *in_proj
        float *dt_bias
        float *B_norm_w
        float *C_norm_w
        float *B_bias
        float *C_bias
        float *D
        float *out_proj
    int mb_m3_backward(const mb_m3_weights *w, int64_t B, int64_t L, const float *x,
                       const float *kept, const float *dy, const mb_m3_grads *grads)
    int64_t mb_m3_kept_floats(int64_t d_model, int64_t B, int64_t L)
    int mb_m3_vjp(const mb_m3_weights *w, int64_t B, int64_t L, const float *x, float *y,
                  float *kept)
    void mb_gemm(int64_t M, int64_t N, int64_t K, const float *X, int64_t ldx,
                 const float *W, int64_t ldw, float *Y, int64_t ldy)
    void mb_rmsnorm(int64_t M, int64_t n, const float *x, const float *w, float *out)
    int mb_math_eval(int which, int64_t n, const float *x, float *y)
    float mb_dot_eval(int64_t k, const float *a, const float *b)
    int mb_isa_select(int which)


# ---------------------------------------------------------------- DLPack structs
cdef extern from *:
    """
    typedef struct { int32_t device_type; int32_t device_id; } mb_DLDevice;
    typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } mb_DLDataType;
    typedef struct {
        void *data; mb_DLDevice device; int32_t ndim; mb_DLDataType dtype;
        int64_t *shape; int64_t *strides; uint64_t byte_offset;
    } mb_DLTensor;
    typedef struct mb_DLManagedTensor {
        mb_DLTensor dl_tensor; void *manager_ctx;
        void (*deleter)(struct mb_DLManagedTensor *self);
    } mb_DLManagedTensor;
    """
    ctypedef struct mb_DLDevice:
        int32_t device_type
        int32_t device_id
    ctypedef struct mb_DLDataType:
        uint8_t code
        uint8_t bits
        uint16_t lanes
    ctypedef struct mb_DLTensor:
        void *data
        mb_DLDevice device
        int32_t ndim
        mb_DLDataType dtype
        int64_t *shape
        int64_t *strides
        uint64_t byte_offset
    ctypedef struct mb_DLManagedTensor:
        mb_DLTensor dl_tensor
        void *manager_ctx
        void (*deleter)(mb_DLManagedTensor *)

DEF MAX_NDIM = 8
cdef int KDLCPU = 1
cdef int KDLCUDA = 2
cdef int KDLROCM = 10


cdef int _dl_device_type(str device):
    return KDLCPU if device == "cpu" else (KDLROCM if device == "hip" else KDLCUDA)


cdef void _dl_deleter(mb_DLManagedTensor *t) noexcept nogil:
    with gil:
        Py_DECREF(<object>t.manager_ctx)
    free(t)

cdef void _dl_capsule_destructor(object cap) noexcept:
    # A capsule still named "dltensor" was never consumed: free it here.
    if PyCapsule_IsValid(cap, b"dltensor"):
        t = <mb_DLManagedTensor *>PyCapsule_GetPointer(cap, b"dltensor")
        t.deleter(t)


# ------------------------------------------------------------------- mamba.Array
cdef class Array:
    """A float32 N-d array, C-contiguous, on the host or on a GPU.

    Host arrays export the buffer protocol (``memoryview(a)``, zero-copy under
    ``numpy.asarray``) and DLPack. Device arrays export DLPack and
    ``__cuda_array_interface__``.
    """
    cdef readonly tuple shape
    cdef readonly Py_ssize_t size
    cdef readonly str device
    cdef readonly int device_id
    cdef uintptr_t _ptr
    cdef bint _readonly
    cdef object _owner           # keeps borrowed or device memory alive
    cdef object _stream          # device arrays: the stream that writes them (CAI numbering)
    cdef bint _own_host          # _ptr was allocated here
    cdef bint _has_view
    cdef Py_buffer _view
    cdef Py_ssize_t _shape[MAX_NDIM]
    cdef Py_ssize_t _strides[MAX_NDIM]
    cdef int64_t _shape64[MAX_NDIM]
    cdef int64_t _strides64[MAX_NDIM]

    def __cinit__(self):
        self._has_view = False
        self._own_host = False
        self._ptr = 0
        self.device = "cpu"
        self.device_id = 0

    def __dealloc__(self):
        if self._has_view:
            PyBuffer_Release(&self._view)
            self._has_view = False
        if self._own_host and self._ptr:
            free(<void *>self._ptr)

    def __init__(self, *args, **kwargs):
        raise TypeError("mamba.Array is made by mamba.zeros, mamba.asarray or a block")

    cdef void _set_shape(self, tuple shape) except *:
        cdef Py_ssize_t n = 1, i, nd = len(shape)
        if nd > MAX_NDIM:
            raise ValueError(f"mamba.Array: at most {MAX_NDIM} dimensions, got {nd}")
        for i in range(nd):
            if shape[i] < 0:
                raise ValueError(f"mamba.Array: negative dimension in {shape}")
            self._shape[i] = shape[i]
            self._shape64[i] = shape[i]
            n *= shape[i]
        cdef Py_ssize_t s = 4
        for i in range(nd - 1, -1, -1):
            self._strides[i] = s
            self._strides64[i] = s // 4
            s *= self._shape[i]
        self.shape = tuple(int(d) for d in shape)
        self.size = n

    property dtype:
        def __get__(self):
            return "float32"

    property ndim:
        def __get__(self):
            return len(self.shape)

    property nbytes:
        def __get__(self):
            return 4 * self.size

    property ptr:
        """Address of the first element (host or device)."""
        def __get__(self):
            return int(self._ptr)

    property writable:
        def __get__(self):
            return not self._readonly

    def __len__(self):
        if not self.shape:
            raise TypeError("len() of a 0-d mamba.Array")
        return self.shape[0]

    def __repr__(self):
        where = "" if self.device == "cpu" else f", device='{self.device}:{self.device_id}'"
        return f"mamba.Array(shape={self.shape}, dtype=float32{where})"

    cdef void _require_host(self, str what) except *:
        if self.device != "cpu":
            raise ValueError(f"mamba.Array.{what}: the array lives on {self.device}; "
                             "copy it to the host first (Array.to_host())")

    def __getbuffer__(self, Py_buffer *buf, int flags):
        self._require_host("buffer export")
        if (flags & PyBUF_WRITABLE) and self._readonly:
            raise BufferError("mamba.Array is read-only")
        buf.buf = <void *>self._ptr
        buf.obj = self
        buf.len = 4 * self.size
        buf.readonly = self._readonly
        buf.itemsize = 4
        if flags & PyBUF_FORMAT:
            buf.format = b"f"
        else:
            buf.format = NULL
        buf.ndim = len(self.shape)
        buf.shape = self._shape if (flags & PyBUF_ND) else NULL
        buf.strides = self._strides if (flags & PyBUF_STRIDES) == PyBUF_STRIDES else NULL
        buf.suboffsets = NULL
        buf.internal = NULL

    def __releasebuffer__(self, Py_buffer *buf):
        pass

    def tolist(self):
        """Nested Python lists of floats (host arrays)."""
        self._require_host("tolist")
        cdef float *p = <float *>self._ptr
        flat = [p[i] for i in range(self.size)]
        if not self.shape:
            return flat[0]
        return _nest(flat, self.shape)

    def tobytes(self):
        self._require_host("tobytes")
        return (<char *>self._ptr)[:4 * self.size]

    def reshape(self, *shape):
        """A view with a new shape and the same elements (no copy)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(d) for d in shape)
        n = 1
        for d in shape:
            n *= d
        if n != self.size:
            raise ValueError(f"mamba.Array.reshape: cannot view {self.shape} as {shape}")
        cdef Array out = Array.__new__(Array)
        out._set_shape(shape)
        out._ptr = self._ptr
        out._readonly = self._readonly
        out._owner = self
        out._stream = self._stream
        out.device = self.device
        out.device_id = self.device_id
        return out

    def __dlpack_device__(self):
        return (_dl_device_type(self.device), self.device_id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if copy:
            raise BufferError("mamba.Array.__dlpack__: copy=True is not supported")
        if self.device != "cpu" and stream is not None and stream != -1:
            _sync_device_stream(self, stream)
        cdef mb_DLManagedTensor *t = <mb_DLManagedTensor *>malloc(sizeof(mb_DLManagedTensor))
        if t == NULL:
            raise MemoryError()
        t.dl_tensor.data = <void *>self._ptr
        t.dl_tensor.device.device_type = _dl_device_type(self.device)
        t.dl_tensor.device.device_id = self.device_id
        t.dl_tensor.ndim = len(self.shape)
        t.dl_tensor.dtype.code = 2   # kDLFloat
        t.dl_tensor.dtype.bits = 32
        t.dl_tensor.dtype.lanes = 1
        t.dl_tensor.shape = self._shape64
        t.dl_tensor.strides = self._strides64
        t.dl_tensor.byte_offset = 0
        Py_INCREF(self)
        t.manager_ctx = <void *>self
        t.deleter = _dl_deleter
        return PyCapsule_New(t, b"dltensor", _dl_capsule_destructor)

    property __cuda_array_interface__:
        def __get__(self):
            if self.device != "cuda":
                raise AttributeError("__cuda_array_interface__: host array")
            return {"shape": self.shape, "typestr": "<f4", "data": (int(self._ptr), self._readonly),
                    "version": 3, "strides": None, "stream": self._stream}

    property stream:
        """The CUDA stream a device array is written on, numbered as in
        ``__cuda_array_interface__`` (1: the legacy default stream); None on the host."""
        def __get__(self):
            return self._stream if self.device != "cpu" else None


def _nest(flat, shape):
    if len(shape) == 1:
        return flat
    step = len(flat) // shape[0] if shape[0] else 0
    return [_nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def _sync_device_stream(arr, stream):
    from . import _backends as backends
    backends.sync_for_consumer(arr, stream)


cdef Array _alloc(tuple shape, bint zero):
    cdef Array a = Array.__new__(Array)
    a._set_shape(shape)
    cdef void *p = NULL
    cdef size_t nbytes = 4 * a.size
    if posix_memalign(&p, 64, nbytes if nbytes else 64) != 0:
        raise MemoryError(f"mamba: cannot allocate {nbytes} bytes")
    if zero:
        memset(p, 0, nbytes)
    a._ptr = <uintptr_t>p
    a._own_host = True
    return a


def empty(shape):
    """An uninitialised host float32 Array."""
    return _alloc(tuple(int(d) for d in shape), False)


cdef extern from "scratch.h" nogil:
    float *mb_scratch_take(size_t n)
    void mb_scratch_give(float *p)


cdef class _ScratchBlock:
    """A block of the C reference's scratch cache, handed back when this dies."""
    cdef float *p

    def __dealloc__(self):
        mb_scratch_give(self.p)


def scratch_empty(int64_t n):
    """An uninitialised host float32 Array of n values from the scratch cache (a vjp's
    kept activations: a training loop reuses the block, not fresh pages)."""
    cdef _ScratchBlock b = _ScratchBlock.__new__(_ScratchBlock)
    b.p = mb_scratch_take(n)
    if b.p == NULL:
        raise MemoryError(f"mamba: cannot allocate {4 * n} bytes")
    cdef Array a = Array.__new__(Array)
    a._set_shape((n,))
    a._ptr = <uintptr_t>b.p
    a._owner = b
    return a


def zeros(shape):
    """A zero-filled host float32 Array."""
    return _alloc(tuple(int(d) for d in shape), True)


cdef class _DLHolder:
    """Owns a consumed DLPack tensor: its producer's deleter runs when this dies."""
    cdef mb_DLManagedTensor *t

    def __dealloc__(self):
        if self.t != NULL and self.t.deleter != NULL:
            self.t.deleter(self.t)


def dlpack_import(capsule):
    """Consume a DLPack capsule: (owner, ptr, (device_type, device_id), shape,
    strides in elements or None, (code, bits, lanes)). The memory stays valid
    while owner lives."""
    if not PyCapsule_IsValid(capsule, b"dltensor"):
        raise TypeError("not an unconsumed DLPack capsule")
    cdef mb_DLManagedTensor *t = <mb_DLManagedTensor *>PyCapsule_GetPointer(capsule, b"dltensor")
    PyCapsule_SetName(capsule, b"used_dltensor")
    cdef _DLHolder owner = _DLHolder.__new__(_DLHolder)
    owner.t = t
    cdef mb_DLTensor *d = &t.dl_tensor
    shape = tuple(d.shape[i] for i in range(d.ndim))
    strides = None if d.strides == NULL else tuple(d.strides[i] for i in range(d.ndim))
    return (owner, <uintptr_t>d.data + d.byte_offset, (d.device.device_type, d.device.device_id),
            shape, strides, (d.dtype.code, d.dtype.bits, d.dtype.lanes))


def wrap_device(tuple shape, uintptr_t ptr, str device, int device_id, owner, bint readonly=False,
                stream=1):
    """An Array over device memory kept alive by `owner` (used by GPU backends),
    written on `stream` (CUDA-array-interface numbering, 1: legacy default)."""
    cdef Array a = Array.__new__(Array)
    a._set_shape(shape)
    a._ptr = ptr
    a._owner = owner
    a._stream = stream
    a.device = device
    a.device_id = device_id
    a._readonly = readonly
    return a


# ----------------------------------------------------------------------- intake
_FORMAT_NAMES = {
    "d": "float64", "e": "float16", "b": "int8", "B": "uint8", "h": "int16",
    "H": "uint16", "i": "int32", "I": "uint32", "l": "int64", "L": "uint64",
    "q": "int64", "Q": "uint64", "?": "bool", "Zf": "complex64", "Zd": "complex128",
}


cdef str _dtype_name(obj, str fmt):
    dt = getattr(obj, "dtype", None)
    if dt is not None:
        name = str(dt)
        return name[6:] if name.startswith("torch.") else name
    core = fmt.lstrip("@=<>!")
    return _FORMAT_NAMES.get(core, f"format {fmt!r}")


cdef bint _is_f32(str fmt):
    import sys
    if fmt in ("f", "@f", "=f"):
        return True
    if fmt == "<f":
        return sys.byteorder == "little"
    if fmt == ">f":
        return sys.byteorder == "big"
    return False


def _refuse_dtype(what, name, dname):
    extra = ""
    if dname in ("bfloat16", "float16"):
        extra = " (reduced-precision profiles are not supported)"
    elif dname == "float64":
        extra = " (refused rather than silently rounded to float32)"
    raise TypeError(f"mamba {what}: {name} has dtype {dname}; only float32 is accepted" + extra)


def intake(obj, str what, str name, bint writable=False):
    """`obj` as a C-contiguous float32 host Array.

    A C-contiguous float32 buffer is borrowed zero-copy; a strided one is copied
    (unless writable is asked: state buffers are updated in place, never copied).
    Anything but float32 is refused by its dtype name.
    """
    if isinstance(obj, Array):
        if (<Array>obj).device != "cpu":
            return obj
        if writable and (<Array>obj)._readonly:
            raise ValueError(f"mamba {what}: {name} must be writable")
        return obj
    cdef Py_buffer probe
    try:
        PyObject_GetBuffer(obj, &probe, PyBUF_FORMAT | PyBUF_STRIDES)
    except (TypeError, BufferError):
        if getattr(obj, "dtype", None) is not None and _dtype_name(obj, "") != "float32":
            _refuse_dtype(what, name, _dtype_name(obj, ""))
        if hasattr(obj, "__dlpack__") or hasattr(obj, "__cuda_array_interface__"):
            from . import _backends as backends
            return backends.intake_foreign(obj, what, name, writable)
        raise TypeError(
            f"mamba {what}: {name} is a {type(obj).__name__}, which does not export the "
            "buffer protocol; pass a float32 array (numpy, array.array('f'), memoryview, "
            "mamba.Array)") from None
    cdef str fmt = (<bytes>probe.format).decode() if probe.format != NULL else "B"
    cdef bint ro = probe.readonly
    cdef int nd = probe.ndim
    shape = tuple(probe.shape[i] for i in range(nd)) if probe.shape != NULL else (probe.len,)
    cdef bint contiguous = PyBuffer_IsContiguous(&probe, b'C')
    PyBuffer_Release(&probe)
    if not _is_f32(fmt) or probe.itemsize != 4:
        _refuse_dtype(what, name, _dtype_name(obj, fmt))
    if writable:
        if ro:
            raise ValueError(f"mamba {what}: {name} must be writable (it is updated in place)")
        if not contiguous:
            raise ValueError(f"mamba {what}: {name} must be C-contiguous (it is updated in "
                             "place, so it cannot be copied)")
    cdef Array a = Array.__new__(Array)
    a._set_shape(shape)
    if contiguous:
        PyObject_GetBuffer(obj, &a._view,
                           PyBUF_FORMAT | PyBUF_C_CONTIGUOUS | (PyBUF_WRITABLE if writable else 0))
        a._has_view = True
        a._ptr = <uintptr_t>a._view.buf
        a._readonly = a._view.readonly
        return a
    # strided: copy to C order (bytes move untouched, so no bit can change)
    cdef Array c = _alloc(shape, False)
    PyObject_GetBuffer(obj, &probe, PyBUF_FORMAT | PyBUF_STRIDES)
    try:
        PyBuffer_ToContiguous(<void *>c._ptr, &probe, 4 * c.size, b'C')
    finally:
        PyBuffer_Release(&probe)
    return c


cdef extern from "Python.h":
    int PyBuffer_IsContiguous(Py_buffer *view, char order)


def first_nonfinite(Array a):
    """Flat index of the first NaN or +-inf in a host array, or -1."""
    cdef const uint32_t *p = <const uint32_t *>a._ptr
    cdef Py_ssize_t i, n = a.size, bad = -1
    with nogil:
        for i in range(n):
            if (p[i] & 0x7f800000u) == 0x7f800000u:
                bad = i
                break
    return bad


def copy(Array a):
    """A fresh host copy of a host array."""
    cdef Array c = _alloc(a.shape, False)
    memcpy(<void *>c._ptr, <void *>a._ptr, 4 * a.size)
    return c


def copy_into(Array dst, Array src):
    """Copy src's bytes into dst (same size, host)."""
    if dst.size != src.size:
        raise ValueError("mamba: copy_into size mismatch")
    memcpy(<void *>dst._ptr, <void *>src._ptr, 4 * src.size)


# ------------------------------------------------------------------- dispatch
cdef inline const float *_cp(Array a):
    return <const float *>a._ptr


cdef inline float *_mp(Array a):
    return <float *>a._ptr


cdef int64_t *_lengths(object lengths, Py_ssize_t B) except? NULL:
    if lengths is None:
        return NULL
    cdef int64_t *p = <int64_t *>malloc(B * sizeof(int64_t))
    if p == NULL:
        raise MemoryError()
    for i in range(B):
        p[i] = lengths[i]
    return p


cdef void _check_rc(int rc) except *:
    if rc == MB_ENOMEM:
        raise MemoryError("mamba: the C reference could not allocate its scratch memory")
    if rc != MB_OK:
        raise RuntimeError(f"mamba: C reference error {rc}")


cdef mb_m1_weights _m1_weights(tuple w, int64_t d_model) except *:
    cdef mb_m1_weights wt
    wt.d_model = d_model
    wt.norm_w = _cp(w[0]); wt.in_proj = _cp(w[1]); wt.conv_w = _cp(w[2])
    wt.conv_b = _cp(w[3]); wt.x_proj = _cp(w[4]); wt.dt_proj_w = _cp(w[5])
    wt.dt_proj_b = _cp(w[6]); wt.A_log = _cp(w[7]); wt.D = _cp(w[8]); wt.out_proj = _cp(w[9])
    return wt


def m1_forward(tuple w, int64_t d_model, Array x, Array conv_window, Array h, Array y,
               lengths=None):
    cdef mb_m1_weights wt = _m1_weights(w, d_model)
    cdef mb_m1_state st
    st.conv_window = _mp(conv_window)
    st.h = _mp(h)
    cdef int64_t B = x.shape[0], L = x.shape[1]
    cdef int64_t *lp = _lengths(lengths, B)
    cdef int rc
    cdef const float *xp = _cp(x)
    cdef float *yp = _mp(y)
    with nogil:
        rc = mb_m1_forward(&wt, B, L, lp, xp, &st, yp)
    free(lp)
    _check_rc(rc)


def m1_backward(tuple w, int64_t d_model, Array x, Array dy, Array gx, tuple gw,
                Array kept=None):
    """Run mb_m1_backward: gradients of x into gx and of each weight into gw (weight
    order); kept, m1_vjp's for these w and x, spares recomputing the activations."""
    cdef mb_m1_weights wt = _m1_weights(w, d_model)
    cdef mb_m1_grads g
    g.x = _mp(gx)
    g.norm_w = _mp(gw[0]); g.in_proj = _mp(gw[1]); g.conv_w = _mp(gw[2])
    g.conv_b = _mp(gw[3]); g.x_proj = _mp(gw[4]); g.dt_proj_w = _mp(gw[5])
    g.dt_proj_b = _mp(gw[6]); g.A_log = _mp(gw[7]); g.D = _mp(gw[8]); g.out_proj = _mp(gw[9])
    cdef int64_t B = x.shape[0], L = x.shape[1]
    cdef int rc
    cdef const float *xp = _cp(x)
    cdef const float *kp = NULL if kept is None else _cp(kept)
    cdef const float *dp = _cp(dy)
    with nogil:
        rc = mb_m1_backward(&wt, B, L, xp, kp, dp, &g)
    _check_rc(rc)


cdef int64_t *_counts(object counts, Py_ssize_t B) except? NULL:
    cdef int64_t *c = <int64_t *>malloc(B * sizeof(int64_t))
    if c == NULL:
        raise MemoryError()
    for i in range(B):
        c[i] = counts[i]
    return c


cdef mb_m2_weights _m2_weights(tuple w, int64_t d_model, float dt_lo, float dt_hi) except *:
    cdef mb_m2_weights wt
    wt.d_model = d_model
    wt.block_norm_w = _cp(w[0]); wt.in_proj = _cp(w[1]); wt.conv_w = _cp(w[2])
    wt.conv_b = _cp(w[3]); wt.dt_bias = _cp(w[4]); wt.A_log = _cp(w[5]); wt.D = _cp(w[6])
    wt.norm_w = _cp(w[7]); wt.out_proj = _cp(w[8])
    wt.dt_lo = dt_lo
    wt.dt_hi = dt_hi
    return wt


def m2_forward(tuple w, int64_t d_model, float dt_lo, float dt_hi, Array x, tuple p,
               int64_t buffered_tokens, Array y, lengths=None):
    """Run mb_m2_forward (every row starts from buffered_tokens); returns each row's new
    buffered_tokens as a tuple."""
    cdef mb_m2_weights wt = _m2_weights(w, d_model, dt_lo, dt_hi)
    cdef int64_t B = x.shape[0], L = x.shape[1]
    cdef int64_t *lp = _lengths(lengths, B)
    cdef int64_t *counts
    try:
        counts = _counts((buffered_tokens,) * B, B)
    except BaseException:
        free(lp)
        raise
    cdef mb_m2_state st
    st.conv_window = _mp(p[0]); st.h = _mp(p[1]); st.buffer_xbc = _mp(p[2])
    st.buffer_dtraw = _mp(p[3])
    st.buffered_tokens = counts
    cdef int rc
    cdef const float *xp = _cp(x)
    cdef float *yp = _mp(y)
    with nogil:
        rc = mb_m2_forward(&wt, B, L, lp, xp, &st, yp)
    free(lp)
    out = tuple(counts[i] for i in range(B))
    free(counts)
    _check_rc(rc)
    return out


def m2_h_last(int64_t d_model, float dt_lo, float dt_hi, Array dt_bias, Array A_log, Array h,
              Array buffer_xbc, Array buffer_dtraw, tuple counts, Array out):
    """Run mb_m2_h_last: the report of a state (h, buffers, per-row counts) into out."""
    cdef mb_m2_weights wt
    memset(&wt, 0, sizeof(wt))
    wt.d_model = d_model
    wt.dt_bias = _cp(dt_bias); wt.A_log = _cp(A_log)
    wt.dt_lo = dt_lo
    wt.dt_hi = dt_hi
    cdef int64_t B = h.shape[0]
    cdef int64_t *c = _counts(counts, B)
    cdef mb_m2_state st
    st.conv_window = NULL; st.h = _mp(h); st.buffer_xbc = _mp(buffer_xbc)
    st.buffer_dtraw = _mp(buffer_dtraw)
    st.buffered_tokens = c
    cdef int rc
    cdef float *op = _mp(out)
    with nogil:
        rc = mb_m2_h_last(&wt, B, &st, op)
    free(c)
    _check_rc(rc)


def m2_backward(tuple w, int64_t d_model, float dt_lo, float dt_hi, Array x, Array dy,
                Array gx, tuple gw, Array kept=None):
    """Run mb_m2_backward: gradients of x into gx and of each weight into gw (weight
    order); kept, m2_vjp's for these w and x, spares running the forward again."""
    cdef mb_m2_weights wt = _m2_weights(w, d_model, dt_lo, dt_hi)
    cdef mb_m2_grads g
    g.x = _mp(gx)
    g.block_norm_w = _mp(gw[0]); g.in_proj = _mp(gw[1]); g.conv_w = _mp(gw[2])
    g.conv_b = _mp(gw[3]); g.dt_bias = _mp(gw[4]); g.A_log = _mp(gw[5]); g.D = _mp(gw[6])
    g.norm_w = _mp(gw[7]); g.out_proj = _mp(gw[8])
    cdef int64_t B = x.shape[0], L = x.shape[1]
    cdef int rc
    cdef const float *xp = _cp(x)
    cdef const float *kp = NULL if kept is None else _cp(kept)
    cdef const float *dp = _cp(dy)
    with nogil:
        rc = mb_m2_backward(&wt, B, L, xp, kp, dp, &g)
    _check_rc(rc)


def copy_leading_rows(Array a, tuple counts):
    """A new array shaped like a (B, R, ...) whose [b, :counts[b]] equal a's; the rest
    is left uninitialised (for copies of which only those rows are read)."""
    cdef Array c = _alloc(a.shape, False)
    cdef Py_ssize_t B = a.shape[0], per_b = a.size // B if B else 0
    cdef Py_ssize_t per_row = per_b // a.shape[1] if a.shape[1] else 0
    cdef Py_ssize_t b, n
    for b in range(B):
        n = counts[b]
        memcpy(<char *>c._ptr + 4 * b * per_b, <char *>a._ptr + 4 * b * per_b, 4 * n * per_row)
    return c


cdef mb_m3_weights _m3_weights(tuple w, int64_t d_model) except *:
    cdef mb_m3_weights wt
    wt.d_model = d_model
    wt.norm_w = _cp(w[0]); wt.in_proj = _cp(w[1]); wt.dt_bias = _cp(w[2])
    wt.B_norm_w = _cp(w[3]); wt.C_norm_w = _cp(w[4]); wt.B_bias = _cp(w[5])
    wt.C_bias = _cp(w[6]); wt.D = _cp(w[7]); wt.out_proj = _cp(w[8])
    return wt


def m3_forward(tuple w, int64_t d_model, Array x, tuple p, int64_t buffered_tokens,
               bint pending, Array y, tuple reports, lengths=None):
    """Run mb_m3_forward; returns the new buffered_tokens."""
    cdef mb_m3_weights wt = _m3_weights(w, d_model)
    cdef mb_m3_state st
    st.theta = _mp(p[0]); st.h = _mp(p[1]); st.buffer_qrot = _mp(p[2])
    st.buffer_krot = _mp(p[3]); st.buffer_v = _mp(p[4]); st.buffer_dt = _mp(p[5])
    st.buffer_sig = _mp(p[6]); st.buffer_adt = _mp(p[7]); st.pending_k = _mp(p[8])
    st.pending_v = _mp(p[9])
    st.buffered_tokens = buffered_tokens
    st.pending = pending
    cdef mb_m3_reports rp
    rp.h_last = _mp(reports[0]); rp.k_last = _mp(reports[1])
    rp.v_last = _mp(reports[2]); rp.theta_last = _mp(reports[3])
    cdef int64_t B = x.shape[0], L = x.shape[1]
    cdef int64_t *lp = _lengths(lengths, B)
    cdef int rc
    cdef const float *xp = _cp(x)
    cdef float *yp = _mp(y)
    with nogil:
        rc = mb_m3_forward(&wt, B, L, lp, xp, &st, yp, &rp)
    free(lp)
    _check_rc(rc)
    return st.buffered_tokens


def m3_backward(tuple w, int64_t d_model, Array x, Array dy, Array gx, tuple gw,
                Array kept=None):
    """Run mb_m3_backward: gradients of x into gx and of each weight into gw (weight
    order); kept, m3_vjp's for these w and x, spares recomputing the projections."""
    cdef mb_m3_weights wt = _m3_weights(w, d_model)
    cdef mb_m3_grads g
    g.x = _mp(gx)
    g.norm_w = _mp(gw[0]); g.in_proj = _mp(gw[1]); g.dt_bias = _mp(gw[2])
    g.B_norm_w = _mp(gw[3]); g.C_norm_w = _mp(gw[4]); g.B_bias = _mp(gw[5])
    g.C_bias = _mp(gw[6]); g.D = _mp(gw[7]); g.out_proj = _mp(gw[8])
    cdef int64_t B = x.shape[0], L = x.shape[1]
    cdef int rc
    cdef const float *xp = _cp(x)
    cdef const float *kp = NULL if kept is None else _cp(kept)
    cdef const float *dp = _cp(dy)
    with nogil:
        rc = mb_m3_backward(&wt, B, L, xp, kp, dp, &g)
    _check_rc(rc)


def kept_floats(str kind, int64_t d_model, int64_t B, int64_t L):
    """Floats of the activations a vjp of block kind ('m1', 'm2', 'm3') keeps for B
    rows of L tokens."""
    if kind == "m1":
        return mb_m1_kept_floats(d_model, B, L)
    if kind == "m2":
        return mb_m2_kept_floats(d_model, B, L)
    return mb_m3_kept_floats(d_model, B, L)


def vjp(str kind, tuple w, int64_t d_model, Array x, Array y, Array kept,
        float dt_lo=0.0, float dt_hi=0.0):
    """Run mb_<kind>_vjp: a zero-state prefill of x into y, its activations into kept
    (dt_lo, dt_hi: Mamba-2's dt_limit)."""
    cdef mb_m1_weights w1
    cdef mb_m2_weights w2
    cdef mb_m3_weights w3
    cdef int which = 1 if kind == "m1" else 2 if kind == "m2" else 3
    if which == 1:
        w1 = _m1_weights(w, d_model)
    elif which == 2:
        w2 = _m2_weights(w, d_model, dt_lo, dt_hi)
    else:
        w3 = _m3_weights(w, d_model)
    cdef int64_t B = x.shape[0], L = x.shape[1]
    cdef int rc
    cdef const float *xp = _cp(x)
    cdef float *yp = _mp(y)
    cdef float *kp = _mp(kept)
    with nogil:
        if which == 1:
            rc = mb_m1_vjp(&w1, B, L, xp, yp, kp)
        elif which == 2:
            rc = mb_m2_vjp(&w2, B, L, xp, yp, kp)
        else:
            rc = mb_m3_vjp(&w3, B, L, xp, yp, kp)
    _check_rc(rc)


# ------------------------------------------------------------ low-bit weights
cdef extern from "mamba_ref.h" nogil:
    int64_t mb_bf16_pack(int64_t n, const float *x, uint16_t *out)
    void mb_bf16_unpack(int64_t n, const uint16_t *bits, float *out)
    void mb_i8_pack(int64_t rows, int64_t cols, const float *x, int8_t *codes, int32_t *exps)
    int64_t mb_i8_unpack(int64_t rows, int64_t cols, const int8_t *codes,
                         const int32_t *exps, float *out)


def bf16_pack(Array x, uint16_t[::1] out):
    """Round x to bfloat16 bits into out; the first index that overflowed to inf, or -1."""
    if out.shape[0] != x.size:
        raise ValueError("bf16_pack: out has the wrong length")
    cdef const float *xp = _cp(x)
    cdef uint16_t *op = &out[0] if x.size else NULL
    cdef int64_t n = x.size, r
    with nogil:
        r = mb_bf16_pack(n, xp, op)
    return r


def bf16_unpack(const uint16_t[::1] bits, Array out):
    if bits.shape[0] != out.size:
        raise ValueError("bf16_unpack: out has the wrong length")
    cdef const uint16_t *bp = &bits[0] if out.size else NULL
    cdef float *op = _mp(out)
    cdef int64_t n = out.size
    with nogil:
        mb_bf16_unpack(n, bp, op)


def i8_pack(Array x, int64_t rows, int64_t cols, int8_t[::1] codes, int32_t[::1] exps):
    if x.size != rows * cols or codes.shape[0] != x.size or exps.shape[0] != rows:
        raise ValueError("i8_pack: sizes do not match rows, cols")
    cdef const float *xp = _cp(x)
    cdef int8_t *cp = &codes[0] if x.size else NULL
    cdef int32_t *ep = &exps[0] if rows else NULL
    with nogil:
        mb_i8_pack(rows, cols, xp, cp, ep)


def i8_unpack(const int8_t[::1] codes, const int32_t[::1] exps, int64_t rows, int64_t cols,
              Array out=None):
    """Write code * 2^e into out (None: validate only); the first bad flat index, or -1."""
    if codes.shape[0] != rows * cols or exps.shape[0] != rows or (
            out is not None and out.size != rows * cols):
        raise ValueError("i8_unpack: sizes do not match rows, cols")
    cdef float *op = _mp(out) if out is not None else NULL
    cdef const int8_t *cp = &codes[0] if rows * cols else NULL
    cdef const int32_t *ep = &exps[0] if rows else NULL
    cdef int64_t r
    with nogil:
        r = mb_i8_unpack(rows, cols, cp, ep, op)
    return r


# ---------------------------------------------------------------- test hooks
_MATH = {"exp": 0, "log1p": 1, "softplus": 2, "sigmoid": 3, "silu": 4, "sqrt": 5,
         "rsqrt": 6, "tanh": 7, "sin": 8, "cos": 9, "mod2pi": 10, "vexp": 11, "vsilu": 12,
         "exp_core": 13, "mod2pi_near": 14}


def _math(str name, x):
    """Evaluate one numerics.h function elementwise (tests)."""
    cdef Array a = intake(x, "_math", "x")
    cdef Array out = _alloc(a.shape, False)
    cdef int which = _MATH[name]
    cdef const float *ip = _cp(a)
    cdef float *op = _mp(out)
    cdef int64_t n = a.size
    with nogil:
        mb_math_eval(which, n, ip, op)
    return out


def _dot(a, b):
    """dot v1 of two float32 vectors (tests)."""
    cdef Array x = intake(a, "_dot", "a"), y = intake(b, "_dot", "b")
    if x.size != y.size:
        raise ValueError("_dot: lengths differ")
    return mb_dot_eval(x.size, _cp(x), _cp(y))


def _gemm(X, W, int64_t M, int64_t N, int64_t K):
    """Y = X . W^T under dot v1 (tests); X is (M, K), W is (N, K)."""
    cdef Array x = intake(X, "_gemm", "X"), w = intake(W, "_gemm", "W")
    if x.size != M * K or w.size != N * K:
        raise ValueError("_gemm: sizes do not match M, N, K")
    cdef Array y = _alloc((M, N), False)
    cdef const float *xp = _cp(x)
    cdef const float *wp = _cp(w)
    cdef float *yp = _mp(y)
    with nogil:
        mb_gemm(M, N, K, xp, K, wp, K, yp, N)
    return y


def _rmsnorm(X, Wt, int64_t M, int64_t n):
    """RMSNorm of the M rows of n of X with weight Wt (tests)."""
    cdef Array x = intake(X, "_rmsnorm", "X"), w = intake(Wt, "_rmsnorm", "W")
    if x.size != M * n or w.size != n:
        raise ValueError("_rmsnorm: sizes do not match M, n")
    cdef Array y = _alloc((M, n), False)
    cdef const float *xp = _cp(x)
    cdef const float *wp = _cp(w)
    cdef float *yp = _mp(y)
    with nogil:
        mb_rmsnorm(M, n, xp, wp, yp)
    return y


def _isa(int which=-1):
    """Select the ISA of the CPU hot loops (-1 best, 0 baseline, 1 x86-64-v3, 2 x86-64-v4;
    a level this CPU lacks gives its best); returns the one in use."""
    return mb_isa_select(which)


def view_rows(Array a, Py_ssize_t start, Py_ssize_t n):
    """A 1-D view of elements [start, start + n) of an array (host or device)."""
    if start < 0 or n < 0 or start + n > a.size:
        raise ValueError("view_rows: out of range")
    cdef Array v = Array.__new__(Array)
    v._set_shape((n,))
    v._ptr = a._ptr + 4 * start
    v._readonly = a._readonly
    v._owner = a
    v.device = a.device
    v.device_id = a.device_id
    return v
