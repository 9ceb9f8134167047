"""The bits of each profile (identical.*.v1) are pinned by a SHA-256 of a fixed run:
forward, state and decode outputs of every block on inputs built with exact IEEE
arithmetic only (no libm), so the digest is the same on every machine and backend.
The digests were produced by the C reference; any change to any seam changes them
(that is a new profile version, never a silent change). Numpy-free."""
import array
import hashlib

import pytest

import mamba
from _util import raw, time_slice
from blocks import BLOCKS, gpu_backends

DIGESTS = {
    "mamba1": "6201969f265f9eca766435c0188627c343456198553f2ecf2c443d4921ddf718",
    "mamba3": "4c2e4bb8f0c0e4adbe6047891029cd9be8f3d9e6afe19687f7b066e73f80d7c6",
    "mamba2": "c46f75b93155a61b3c89406d71d52cda6db1f3a013f093f942fb634e049d616b",
}


def exact_uniform(n, seed, lo, hi):
    """n float32 values in [lo, hi) from a 32-bit LCG: integer maths and one IEEE
    multiply-add per value, identical on every platform."""
    s = (seed * 2654435761 + 12345) & 0xFFFFFFFF
    out = array.array("f", bytes(4 * n))
    for i in range(n):
        s = (s * 1664525 + 1013904223) & 0xFFFFFFFF
        out[i] = lo + (hi - lo) * ((s >> 8) / 16777216.0)
    return out


def exact_weights(name, d_model):
    """Weights shaped like random_weights(name), filled exactly within each tensor's
    range (the ranges rounded to two digits)."""
    ref = mamba.random_weights(name, d_model, seed=0)
    out = {}
    for i, (k, v) in enumerate(sorted(ref.items())):
        vals = memoryview(v).cast("B").cast("f")
        lo, hi = round(min(vals), 2), round(max(vals), 2)
        if lo == hi:
            hi = lo + 0.01
        out[k] = mamba.asarray(exact_uniform(v.size, i + 1, lo, hi), v.shape)
    return out


def run_digest(name, backend):
    spec = BLOCKS[name]
    blk = spec["cls"](exact_weights(name, spec["d_model"]), backend=backend)
    L = spec["length"]
    x = mamba.asarray(exact_uniform(2 * (L + 3) * blk.d_model, 99, -2.0, 2.0),
                      (2, L + 3, blk.d_model))
    h = hashlib.sha256()
    st = blk.allocate_state(2)
    h.update(raw(blk.forward(time_slice(x, 0, L), st)))
    for p in st.pieces():
        h.update(raw(p))
    for t in range(L, L + 3):
        h.update(raw(blk.step(time_slice(x, t, t + 1), st)))
    for p in st.pieces():
        h.update(raw(p))
    return h.hexdigest()


CASES = [(n, be) for n in BLOCKS for be in ["cpu"] + gpu_backends(n)]


@pytest.mark.parametrize("name,backend", CASES, ids=[f"{n}-{b}" for n, b in CASES])
def test_profile_digest(name, backend):
    got = run_digest(name, backend)
    want = DIGESTS.get(name)
    assert want is not None, f"no recorded digest for {name}; the reference gives {got}"
    assert got == want, f"{name} on {backend}: the bits of {BLOCKS[name]['cls'].profile} changed"


@pytest.mark.parametrize("name", list(BLOCKS))
def test_profile_digest_same_on_every_cpu_isa(name):
    """The baseline, x86-64-v3 and x86-64-v4 copies of the hot code (as many as this CPU
    runs) give the same digest."""
    from mamba import _core
    best = _core._isa(-1)
    try:
        got = {isa: run_digest(name, "cpu") for isa in range(best + 1) if _core._isa(isa) == isa}
    finally:
        _core._isa(best)
    assert len(set(got.values())) == 1, f"{name}: digests differ between ISA copies: {got}"
