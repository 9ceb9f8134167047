"""Argument checks shared by the blocks: every refusal names the argument and
happens before anything the caller owns is touched."""
from . import _core


def f32(obj, what, name, writable=False):
    return _core.intake(obj, what, name, writable)


def aligned(a, what, name):
    """A device array the kernels use in place (a state piece) starts on a 16-byte
    boundary: they read it four floats at a time, and a misaligned read would end
    the device context."""
    if a.device != "cpu" and a.ptr % 16:
        raise ValueError(f"mamba {what}: {name} on the device must start on a 16-byte "
                         f"boundary (its address is {a.ptr % 16} bytes past one)")


def finite_later(checks, what, in_norm=False):
    """Finite checks of [(array, name, base)] (base: the flat index of the array's
    first element in the buffer called name). Host arrays are checked at once;
    device arrays' checks are queued on their backend's stream (one read-back per
    backend), so work launched before settle() overlaps them. settle() raises for
    the first bad array in list order. in_norm: the one check is of a stateless
    prefill's x, which the backend may search in the norm that reads it."""
    found, queued = [None] * len(checks), {}
    for k, (a, _, _) in enumerate(checks):
        if a.device == "cpu":
            found[k] = _core.first_nonfinite(a)
        else:
            from . import _backends
            queued.setdefault(_backends.owner_of(a), []).append(k)
    waits = [(ks, be.first_nonfinite_later([checks[k][0] for k in ks], in_norm))
             for be, ks in queued.items()]

    def settle():
        while waits:
            ks, wait = waits.pop()
            for k, i in zip(ks, wait()):
                found[k] = i
        for (_, name, base), i in zip(checks, found):
            if i >= 0:
                raise ValueError(f"mamba {what}: {name} holds a non-finite value (NaN or "
                                 f"inf) at flat index {base + i}")
    return settle


def finite(a, what, name):
    finite_later([(a, name, 0)], what)()
    return a


def shape(a, what, name, want, alt=None):
    if a.shape == want or (alt is not None and a.shape == alt):
        return a
    raise ValueError(f"mamba {what}: {name} has shape {a.shape}, expected {want}"
                     + (f" or {alt}" if alt is not None else ""))


def weights(wdict, what, names):
    """The weight dict's values in `names` order; missing and unknown keys refused."""
    if not hasattr(wdict, "keys"):
        raise TypeError(f"mamba {what}: weights must be a dict keyed by {list(names)}")
    missing = [n for n in names if n not in wdict]
    unknown = [n for n in wdict if n not in names]
    if missing or unknown:
        raise ValueError(f"mamba {what}: weights do not match the expected names"
                         + (f"; missing {missing}" if missing else "")
                         + (f"; unknown {unknown}" if unknown else ""))
    return [wdict[n] for n in names]


def tokens(x, what, d_model, step):
    """x as a (B, L, d_model) float32 Array; a step also takes (B, d_model)."""
    a = f32(x, what, "x")
    if step and a.ndim == 2:
        a = a.reshape(a.shape[0], 1, a.shape[1])
    if a.ndim != 3:
        raise ValueError(f"mamba {what}: x must have shape (B, L, d_model)"
                         + (" or (B, d_model)" if step else "") + f", got {a.shape}")
    if a.shape[2] != d_model:
        raise ValueError(f"mamba {what}: x has d_model {a.shape[2]}, expected {d_model}")
    if a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"mamba {what}: x must have B >= 1 and L >= 1, got {a.shape}")
    if step and a.shape[1] != 1:
        raise ValueError(f"mamba {what}: a step takes one token per row (L = 1), got "
                         f"L = {a.shape[1]}; use forward for longer inputs")
    return a


def lengths(lens, what, B, L):
    """Ragged lengths: B integers in [1, L]."""
    try:
        vals = [int(v) for v in lens]
    except TypeError:
        raise ValueError(f"mamba {what}: lengths must be a sequence of {B} integers") from None
    if any(float(v) != float(int(v)) for v in lens):
        raise ValueError(f"mamba {what}: lengths must be integers, got {list(lens)}")
    if len(vals) != B:
        raise ValueError(f"mamba {what}: lengths has {len(vals)} entries, expected B = {B}")
    bad = [v for v in vals if not 1 <= v <= L]
    if bad:
        raise ValueError(f"mamba {what}: lengths must lie in [1, {L}], got {bad}")
    return vals


def real_finite_later(x, what, lens, in_norm=False):
    """finite_later of x over the real positions of each row only (padding is never
    read)."""
    if lens is None:
        return finite_later([(x, "x", 0)], what, in_norm)
    B, L, D = x.shape
    return finite_later([(_core.view_rows(x, b * L * D, n * D), "x", b * L * D)
                         for b, n in enumerate(lens)], what)
