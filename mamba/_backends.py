"""Backend selection. The CPU backend (the C reference) is always present; GPU
backends are detected lazily and never make `import mamba` fail."""
import os

from . import _core

NAMES = ("cpu", "cuda", "hip")


class CpuBackend:
    """The C reference: weights are borrowed zero-copy, outputs are host Arrays."""
    name = "cpu"

    def upload_weights(self, w):
        return w

    def session_weights(self, block):
        return tuple(_core.copy(a) for a in block._w)

    def empty(self, shape, like=None):
        return _core.empty(shape)

    def copy(self, a):
        return _core.copy(a)

    def copy_into(self, dst, src):
        _core.copy_into(dst, src)

    def m1_forward(self, w, d_model, x, pieces, y, lengths):
        _core.m1_forward(w, d_model, x, pieces[0], pieces[1], y, lengths)

    def m2_forward(self, w, d_model, dt_limit, x, pieces, buffered_tokens, y, h_last, lengths):
        return _core.m2_forward(w, d_model, dt_limit[0], dt_limit[1], x, tuple(pieces),
                                buffered_tokens, y, h_last, lengths)

    def m3_forward(self, w, d_model, x, pieces, buffered_tokens, pending, y, reports, lengths):
        return _core.m3_forward(w, d_model, x, tuple(pieces), buffered_tokens, pending, y,
                                reports, lengths)


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
    if requested == "auto":
        for n in ("cuda", "hip"):
            be, _ = _get(n)
            if be is not None:
                return be
        return _CPU
    if requested not in NAMES:
        raise ValueError(f"mamba {what}: backend must be 'auto', 'cpu', 'cuda' or 'hip', got "
                         f"{requested!r}")
    be, why = _get(requested)
    if be is None:
        raise RuntimeError(f"mamba {what}: backend {requested!r} was requested but is not "
                           f"usable: {why}")
    return be


def intake_foreign(obj, what, name):
    """Arrays that only speak DLPack / CUDA array interface (e.g. torch tensors)."""
    raise TypeError(f"mamba {what}: {name} is a {type(obj).__name__} without the buffer "
                    "protocol; pass a float32 host array or use a GPU backend")


def sync_for_consumer(arr, stream):
    pass
