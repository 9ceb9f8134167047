"""The identity lanes of SPEC section 10 as a library routine, for `python -m mamba
check`: every lane on every usable backend and block, each backend against the C
reference, and against a float64 oracle when one can be loaded. Numpy-free apart from
that oracle. Each lane yields a `Result`; a divergence is a result, not an exception."""
import importlib
import random

import mamba
from . import _backends, _core, lowbit

# Lane shapes per block: d_model, decode (prefill P, total T), split points, length L.
# The decode and split lanes cross each block's chunk grid (Mamba-2 Q = 256, Mamba-3
# Q = 64), before, on and after a boundary.
SHAPES = {
    "mamba1": dict(d_model=32, decode=(5, 14), splits=(1, 3, 7, 20), length=24),
    "mamba2": dict(d_model=32, decode=(250, 262), splits=(3, 255, 256, 300), length=520),
    "mamba3": dict(d_model=64, decode=(60, 70), splits=(1, 63, 64, 65), length=130),
}
RTOL, ATOL = 1e-5, 1e-6  # SPEC 10, against the float64 oracle

# Tests set this to a lane name to corrupt that lane's candidate output by one ulp and
# see the divergence reach the table and the exit code. Not reachable from the CLI.
_FAULT = None


class Result:
    """One row of the check: status is 'ok', 'FAIL' or 'n/a'."""

    def __init__(self, backend, block, lane, status, equal=None, max_ulp=None,
                 rel_err=None, note=""):
        self.backend, self.block, self.lane, self.status = backend, block, lane, status
        self.equal, self.max_ulp, self.rel_err, self.note = equal, max_ulp, rel_err, note

    def __repr__(self):
        return (f"Result({self.backend}, {self.block}, {self.lane!r}, {self.status}, "
                f"equal={self.equal}, max_ulp={self.max_ulp}, rel_err={self.rel_err})")


def block_names():
    """The blocks this build exports, in order."""
    return [n for n in SHAPES if hasattr(mamba, _class_name(n))]


def _class_name(name):
    return f"Mamba{name[-1]}Block"


# ------------------------------------------------------------------ byte helpers
def _rand(shape, seed):
    rng = random.Random(seed)
    a = _core.empty(shape)
    mv = memoryview(a).cast("B").cast("f")
    for i in range(a.size):
        mv[i] = rng.gauss(0.0, 1.0)
    return a


def _bytes(a):
    return bytes(memoryview(a).cast("B"))


def _from_bytes(data, shape):
    a = _core.empty(shape)
    memoryview(a).cast("B")[:] = data
    return a


def _tslice(x, t0, t1):
    """x[:, t0:t1] of a (B, L, D) host array."""
    B, L, D = x.shape
    src = memoryview(x).cast("B")
    out = b"".join(src[4 * (b * L + t0) * D:4 * (b * L + t1) * D] for b in range(B))
    return _from_bytes(out, (B, t1 - t0, D))


def _rows(x, idx):
    per = 4 * (x.size // x.shape[0])
    src = memoryview(x).cast("B")
    return _from_bytes(b"".join(src[i * per:(i + 1) * per] for i in idx),
                       (len(idx),) + x.shape[1:])


def _concat_time(parts):
    B, D = parts[0].shape[0], parts[0].shape[2]
    out = b"".join(_bytes(_rows(p, [b])) for b in range(B) for p in parts)
    return _from_bytes(out, (B, sum(p.shape[1] for p in parts), D))


def _state_bytes(st):
    return b"".join(_bytes(p) for p in st.pieces()), tuple(getattr(st, n) for n in st._SCALARS)


def _copy_state(blk, st):
    new = blk.allocate_state(st.pieces()[0].shape[0])
    for n, src in zip(st._PIECES, st.pieces()):
        memoryview(getattr(new, n)).cast("B")[:] = memoryview(src).cast("B")
    for n in st._SCALARS:
        setattr(new, n, getattr(st, n))
    return new


# ------------------------------------------------------------------- comparison
def _key(i):
    """Signed-magnitude float32 bits to an integer line where adjacent floats differ by 1."""
    return i if i >= 0 else -(i & 0x7fffffff)


def compare(want, got):
    """(equal, max ulp) of two float32 byte strings; NaNs are equal to each other
    (SPEC 4.6), a NaN against a number is an infinite distance."""
    if want == got:
        return True, 0
    if len(want) != len(got):
        return False, None
    equal, worst = True, 0
    for a, b in zip(memoryview(want).cast("i"), memoryview(got).cast("i")):
        if a == b:
            continue
        na, nb = a & 0x7fffffff > 0x7f800000, b & 0x7fffffff > 0x7f800000
        if na and nb:
            continue
        equal = False
        worst = float("inf") if na or nb else max(worst, abs(_key(a) - _key(b)))
    return equal, worst


def _fault(lane, got):
    if _FAULT != lane or not got:
        return got
    return bytes([got[0] ^ 1]) + got[1:]


def _bitwise(ctx, lane, pairs, note="", states=()):
    """A Result from (want bytes, got bytes) pairs that must all be equal, and
    (want state, got state) pairs whose pieces and scalars must all be equal."""
    pairs = list(pairs) + [(a[0], b[0]) for a, b in states]
    equal, worst = True, 0
    for want, got in pairs:
        e, u = compare(want, _fault(lane, got))
        equal &= e
        worst = None if u is None or worst is None else max(worst, u)
    if any(a[1] != b[1] for a, b in states):
        equal, note = False, (note + "; " if note else "") + "state scalars differ"
    return Result(*ctx, lane, "ok" if equal else "FAIL", equal, worst, note=note)


# ------------------------------------------------------------------------ lanes
def _make(name, backend, seed=0, weights=None):
    cls = getattr(mamba, _class_name(name))
    w = weights if weights is not None else mamba.random_weights(
        name, SHAPES[name]["d_model"], seed=seed)
    return cls(w, backend=backend)


def _lane_repeat(ctx, blk, s, name, backend):
    x = _rand((2, s["length"], blk.d_model), 1)
    y1 = _bytes(blk.forward(x))
    return [_bitwise(ctx, "repeat", [(y1, _bytes(blk.forward(x)))])]


def _lane_batch(ctx, blk, s, name, backend):
    x = _rand((3, s["length"], blk.d_model), 2)
    y = blk.forward(x)
    rows_y = [_bytes(_rows(y, [b])) for b in range(3)]
    pairs = [(rows_y[b], _bytes(blk.forward(_rows(x, [b])))) for b in range(3)]
    perm = [2, 0, 1]
    pairs.append((b"".join(rows_y[p] for p in perm), _bytes(blk.forward(_rows(x, perm)))))
    differ = rows_y[0] != rows_y[1]
    control = Result(*ctx, "batch negative control", "ok" if differ else "FAIL",
                     note="rows 0 and 1 differ" if differ else "two different rows gave "
                     "the same bytes: the lane could not see a mix-up")
    return [_bitwise(ctx, "batch composition", pairs, "each row alone, and permuted"),
            control]


def _lane_decode(ctx, blk, s, name, backend):
    P, T = s["decode"]
    x = _rand((2, T, blk.d_model), 3)
    full = blk.allocate_state(2)
    y = blk.forward(x, full)
    st = blk.allocate_state(2)
    parts = [blk.forward(_tslice(x, 0, P), st)]
    parts += [blk.step(_tslice(x, t, t + 1), st) for t in range(P, T)]
    return [_bitwise(ctx, "decode == prefill", [(_bytes(y), _bytes(_concat_time(parts)))],
                     f"prefill {P}, steps to {T}", [(_state_bytes(full), _state_bytes(st))])]


def _lane_split(ctx, blk, s, name, backend):
    L = s["length"]
    x = _rand((2, L, blk.d_model), 4)
    full = blk.allocate_state(2)
    y = _bytes(blk.forward(x, full))
    pairs, states = [], []
    for points in [[p] for p in s["splits"]] + [list(s["splits"])]:
        st = blk.allocate_state(2)
        bounds = [0] + points + [L]
        parts = [blk.forward(_tslice(x, a, b), st) for a, b in zip(bounds, bounds[1:])]
        pairs.append((y, _bytes(_concat_time(parts))))
        states.append((_state_bytes(full), _state_bytes(st)))
    return [_bitwise(ctx, "split prefill == one prefill", pairs,
                     f"splits at {list(s['splits'])}, each and all", states)]


def _lane_session(ctx, blk, s, name, backend):
    P, T = s["decode"]
    x = _rand((2, T, blk.d_model), 5)
    st_step = blk.allocate_state(2)
    blk.forward(_tslice(x, 0, P), st_step)
    st_sess = _copy_state(blk, st_step)
    pairs = []
    with blk.decode_session(st_sess) as sess:
        for t in range(P, T):
            xt = _tslice(x, t, t + 1)
            pairs.append((_bytes(blk.step(xt, st_step)), _bytes(sess.step(xt))))
    return [_bitwise(ctx, "session == step", pairs,
                     states=[(_state_bytes(st_step), _state_bytes(st_sess))])]


def _lane_ragged(ctx, blk, s, name, backend):
    L, D = s["length"], blk.d_model
    lens = [L, 3, 1]
    x = _rand((3, L, D), 9)
    flat = memoryview(x).cast("B").cast("f")
    for b, n in enumerate(lens):  # padding is never read: poison it
        for i in range((b * L + n) * D, (b + 1) * L * D):
            flat[i] = float("nan")
    y = blk.forward(x, lengths=lens)
    pairs = []
    for b, n in enumerate(lens):
        row = _rows(y, [b])
        pairs.append((_bytes(blk.forward(_tslice(_rows(x, [b]), 0, n))),
                      _bytes(_tslice(row, 0, n))))
        pad = _bytes(_tslice(row, n, L)) if n < L else b""
        pairs.append((bytes(len(pad)), pad))
    return [_bitwise(ctx, "ragged == rows alone", pairs, f"lengths {lens}, padding +0.0")]


def _lane_lowbit(ctx, blk, s, name, backend):
    w = mamba.random_weights(name, SHAPES[name]["d_model"], seed=0)
    x = _rand((2, 9, blk.d_model), 8)
    out = []
    for fmt in ("bfloat16", "int8"):
        packed = lowbit.pack(w, fmt)
        a = _make(name, backend, weights=packed)
        b = _make(name, backend, weights={k: lowbit.unpack(v) for k, v in packed.items()})
        out.append(_bitwise(ctx, f"lowbit {fmt} == expanded",
                            [(_bytes(b.forward(x)), _bytes(a.forward(x)))]))
    return out


def _lane_reference(ctx, blk, s, name, backend):
    cpu = _make(name, "cpu")
    x = _rand((2, s["length"], blk.d_model), 10)
    sc, sb = cpu.allocate_state(2), blk.allocate_state(2)
    pairs = [(_bytes(cpu.forward(x, sc)), _bytes(blk.forward(x, sb)))]
    return [_bitwise(ctx, "== C reference", pairs, "output and state",
                     [(_state_bytes(sc), _state_bytes(sb))])]


# -------------------------------------------------------------- float64 oracle
def _load_oracle(name):
    """(forward, sane) of the float64 oracle, or (None, reason): it needs numpy."""
    try:
        mod = importlib.import_module(f"mamba._oracle64.oracle{name[-1]}")
    except ImportError:
        return None, "numpy not importable: no float64 comparison"
    return (mod.forward, getattr(mod, "sane", dict)), ""


def _lane_oracle(ctx, blk, s, name, backend):
    lane = "float64 oracle"
    oracle, why = _load_oracle(name)
    if oracle is None:
        return [Result(*ctx, lane, "n/a", note=why)]
    import numpy as np
    forward, sane = oracle
    w = sane(mamba.random_weights(name, SHAPES[name]["d_model"], seed=11))
    b = _make(name, backend, weights=w)
    x = np.random.default_rng(11).standard_normal((2, s["length"], b.d_model)).astype(np.float32)
    y = np.asarray(b.forward(x))
    want = forward({k: np.asarray(v, dtype=np.float64) for k, v in w.items()},
                   x.astype(np.float64))
    # |y - y64| <= atol + rtol |y64|  <=>  |y - y64| / (|y64| + atol / rtol) <= rtol
    rel = float(np.max(np.abs(y - want) / (np.abs(want) + ATOL / RTOL)))
    ok = rel <= RTOL
    return [Result(*ctx, lane, "ok" if ok else "FAIL", rel_err=rel,
                   note=f"rtol {RTOL:g}, atol {ATOL:g}")]


# ------------------------------------------------------------------------- run
# (label, lane): each lane takes (ctx, block, shapes, block name, backend) and returns
# its Results; a label names the lane's rows (or, for a pair, what they share).
_LANES = [("repeat", _lane_repeat), ("batch composition", _lane_batch),
          ("decode == prefill", _lane_decode), ("split prefill == one prefill", _lane_split),
          ("session == step", _lane_session), ("ragged == rows alone", _lane_ragged),
          ("lowbit == expanded", _lane_lowbit), ("== C reference", _lane_reference),
          ("float64 oracle", _lane_oracle)]

def usable_backends():
    return [n for n, (ok, _) in mamba.backends().items() if ok]


def run(backends=None, blocks=None, progress=None):
    """Every lane on every (backend, block); a list of Results. backends and blocks
    default to every usable backend and every block. progress(text) is called before
    each lane group."""
    results = []
    for be in backends or usable_backends():
        obj, why = _backends._get(be)
        for name in blocks or block_names():
            ctx = (be, name)
            if obj is None:
                results.append(Result(*ctx, "all", "n/a", note=why))
                continue
            if not _backends.supports(obj, _backends._op_for(_class_name(name))):
                results.append(Result(*ctx, "all", "n/a",
                                      note="this backend does not implement the block"))
                continue
            s = SHAPES[name]
            try:
                blk = _make(name, be)
            except Exception as e:  # reported like a failed lane, the others still run
                results.append(Result(*ctx, "all", "FAIL", note=f"{type(e).__name__}: {e}"))
                continue
            for label, lane in _LANES:
                if label == "== C reference" and be == "cpu":
                    continue
                if progress:
                    progress(f"{be} {name}: {label}")
                try:
                    results += lane(ctx, blk, s, name, be)
                except Exception as e:  # a crash in one lane is that lane's failure
                    results.append(Result(*ctx, label, "FAIL",
                                          note=f"{type(e).__name__}: {e}"))
    return results


def _fmt(v, kind):
    if v is None:
        return "-"
    if kind == "equal":
        return "yes" if v else "NO"
    if kind == "ulp":
        return "inf" if v == float("inf") else str(v)
    return f"{v:.2e}"


def table(results):
    """The results as a plain-text table."""
    head = ("backend", "block", "lane", "result", "bits equal", "max ulp", "rel err", "note")
    rows = [(r.backend, r.block, r.lane, r.status, _fmt(r.equal, "equal"),
             _fmt(r.max_ulp, "ulp"), _fmt(r.rel_err, "rel"), r.note) for r in results]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in [head] + rows]
    return "\n".join(lines)
