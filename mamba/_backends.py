"""Backend selection. The CPU backend (the C reference) is always present; GPU
backends are detected lazily and never make `import mamba` fail."""
import os
import re
from types import SimpleNamespace

from . import _core

NAMES = ("cpu", "cuda", "hip")


class CpuBackend:
    """The C reference: weights are borrowed zero-copy, outputs are host Arrays."""
    name = "cpu"

    def upload_weights(self, w):
        _host_only(w, "a weight")
        return w

    def session_weights(self, block):
        return tuple(_core.copy(a) for a in block._w)

    def empty(self, shape, like=None):
        return _core.empty(shape)

    def zeros(self, shapes, like=None):
        return [_core.zeros(shape) for shape in shapes]

    def copy(self, a):
        _host_only([a], "a state piece")
        return _core.copy(a)

    def copy_into(self, dst, src):
        _host_only([dst, src], "a state piece")
        _core.copy_into(dst, src)

    def m1_forward(self, w, d_model, x, pieces, y, lengths, fast=False, early=None):
        # fast mode runs the identical kernels on the CPU (docs/numerics.md)
        _host_only([x], "x")
        _host_only(pieces, "a state piece")
        _core.m1_forward(w, d_model, x, pieces[0], pieces[1], y, lengths)

    def m1_backward(self, w, d_model, x, dy, gx, gw, fast=False, kept=None):
        _host_only([x], "x")
        _host_only([dy], "grad_output")
        _core.m1_backward(w, d_model, x, dy, gx, tuple(gw), kept)

    def m1_vjp(self, w, d_model, x, y, fast=False):
        return self._vjp("m1", w, d_model, x, y, (),
                         lambda *a, kept: self.m1_backward(w, d_model, *a, kept=kept))

    def m2_forward(self, w, d_model, dt_limit, x, pieces, buffered_tokens, y, lengths,
                   fast=False, early=None):  # early: a device backend's early_front
        _host_only([x], "x")
        _host_only(pieces, "a state piece")
        return _core.m2_forward(w, d_model, dt_limit[0], dt_limit[1], x, tuple(pieces),
                                buffered_tokens, y, lengths)

    def m2_report_inputs(self, w, dt_limit, pieces, counts):
        """Copies of all that the h_last report reads: dt_bias, A_log, dt_limit, h and
        the open rows of the two buffers."""
        return (_core.copy(w[4]), _core.copy(w[5]), dt_limit, _core.copy(pieces[1]),
                _core.copy_leading_rows(pieces[2], counts),
                _core.copy_leading_rows(pieces[3], counts), counts)

    def m2_h_last(self, d_model, inputs):
        dt_bias, A_log, (lo, hi), h, bx, bd, counts = inputs
        out = _core.empty(h.shape)
        _core.m2_h_last(d_model, lo, hi, dt_bias, A_log, h, bx, bd, counts, out)
        return out

    def m2_backward(self, w, d_model, dt_limit, x, dy, gx, gw, fast=False, kept=None):
        _host_only([x], "x")
        _host_only([dy], "grad_output")
        _core.m2_backward(w, d_model, dt_limit[0], dt_limit[1], x, dy, gx, tuple(gw), kept)

    def m2_vjp(self, w, d_model, dt_limit, x, y, fast=False):
        return self._vjp("m2", w, d_model, x, y, dt_limit,
                         lambda *a, kept: self.m2_backward(w, d_model, dt_limit, *a, kept=kept))

    def m3_forward(self, w, d_model, x, pieces, buffered_tokens, pending, y, reports, lengths,
                   fast=False, early=None):
        _host_only([x], "x")
        _host_only(pieces, "a state piece")
        return _core.m3_forward(w, d_model, x, tuple(pieces), buffered_tokens, pending, y,
                                reports, lengths)

    def m3_backward(self, w, d_model, x, dy, gx, gw, fast=False, kept=None):
        _host_only([x], "x")
        _host_only([dy], "grad_output")
        _core.m3_backward(w, d_model, x, dy, gx, tuple(gw), kept)

    def m3_vjp(self, w, d_model, x, y, fast=False):
        return self._vjp("m3", w, d_model, x, y, (),
                         lambda *a, kept: self.m3_backward(w, d_model, *a, kept=kept))

    @staticmethod
    def _vjp(kind, w, d_model, x, y, dt_limit, backward):
        """y = a zero-state prefill of x, its activations kept; returns an object whose
        backward(dy, gx, gw) is backward(xs, dy, gx, gw, kept=kept), xs a copy of x."""
        _host_only([x], "x")
        kept = _core.scratch_empty(_core.kept_floats(kind, d_model, x.shape[0], x.shape[1]))
        _core.vjp(kind, w, d_model, x, y, kept, *dt_limit)
        xs = _core.copy(x)
        return SimpleNamespace(backward=lambda dy, gx, gw: backward(xs, dy, gx, gw, kept=kept))


def _host_only(arrays, what):
    for a in arrays:
        if a.device != "cpu":
            raise ValueError(f"mamba: {what} lives on {a.device}:{a.device_id}, but the block "
                             "runs on the cpu backend; pass host arrays or build the block "
                             "with backend='cuda'")


_CPU = CpuBackend()


def _probe(name):
    """(backend or None, reason) for a GPU backend name."""
    if name == "cuda":
        try:
            from . import _cuda
        except ImportError as e:
            return None, f"the CUDA backend is not available: {e}"
        return _cuda.probe()
    if name == "hip":
        try:
            from . import _hip
        except ImportError as e:
            return None, f"the HIP backend is not available: {e}"
        return _hip.probe()
    return _CPU, "always available"


_cache = {}


def _get(name):
    if name not in _cache:
        _cache[name] = _probe(name)
    return _cache[name]


def backends():
    """{name: (usable, reason)} for every backend."""
    out = {}
    for n in NAMES:
        be, why = _get(n)
        out[n] = (be is not None, why)
    return out


def resolve(requested, what="mamba"):
    """The backend object for `requested` ('auto', 'cpu', 'cuda', 'hip').

    'auto' takes MAMBA_BACKEND when set, else the first usable GPU, else the CPU.
    An explicitly requested backend that is unusable raises."""
    if requested == "auto":
        requested = os.environ.get("MAMBA_BACKEND", "auto") or "auto"
    op = _op_for(what)
    if requested == "auto":
        for n in ("cuda", "hip"):
            be, _ = _get(n)
            if be is not None and supports(be, op):
                return be
        return _CPU
    if requested not in NAMES:
        raise ValueError(f"mamba {what}: backend must be 'auto', 'cpu', 'cuda' or 'hip', got "
                         f"{requested!r}")
    be, why = _get(requested)
    if be is None:
        raise RuntimeError(f"mamba {what}: backend {requested!r} was requested but is not "
                           f"usable: {why}")
    if not supports(be, op):
        raise RuntimeError(f"mamba {what}: backend {requested!r} was requested but does not "
                           "implement this block yet")
    return be


def _op_for(what):
    """The backend method a block class needs ('Mamba2Block' -> 'm2_forward')."""
    m = re.match(r"Mamba(\d)Block", what)
    return f"m{m.group(1)}_forward" if m else None


def supports(be, op):
    return op is None or hasattr(be, op)


def _foreign_device(obj):
    if hasattr(obj, "__dlpack_device__"):
        kind, _ = obj.__dlpack_device__()
        # kDLCUDA, kDLCUDAManaged; kDLROCM
        return "cuda" if kind in (2, 13) else "hip" if kind == 10 else None
    return "cuda" if hasattr(obj, "__cuda_array_interface__") else None


def intake_foreign(obj, what, name, writable=False):
    """Arrays that speak only DLPack or the CUDA array interface: GPU ones (torch.cuda
    tensors, CuPy arrays) go to their vendor's backend, which borrows them on the device."""
    dev = _foreign_device(obj)
    if dev is not None:
        be, why = _get(dev)
        if be is None:
            raise ValueError(f"mamba {what}: {name} lives on a {dev.upper()} device, but the "
                             f"{dev.upper()} backend is not usable: {why}")
        return be.intake(obj, what, name, writable)
    raise TypeError(f"mamba {what}: {name} is a {type(obj).__name__} without the buffer "
                    "protocol; pass a float32 host array or a CUDA array")


def owner_of(arr):
    """The backend that holds a device Array."""
    return _get(arr.device)[0]


def sync_for_consumer(arr, stream):
    """Order a consumer's stream after the work that wrote a device Array (DLPack)."""
    owner_of(arr).sync_for_consumer(arr, stream)
