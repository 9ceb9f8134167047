"""Numpy-free helpers for building inputs and comparing bytes."""
import array
import math
import random

import mamba

FAST_BOUND = 2e-3  # SPEC 3: fast mode's relative L2 error against float64


def rand(shape, seed, scale=1.0):
    """A mamba.Array of N(0, scale^2) values from a fixed seed."""
    rng = random.Random(seed)
    n = 1
    for d in shape:
        n *= d
    buf = array.array("f", (rng.gauss(0.0, scale) for _ in range(n)))
    return mamba.asarray(buf, shape)


def raw(a):
    """The bytes of a float32 buffer."""
    return bytes(memoryview(a).cast("B"))


def floats(a):
    return memoryview(a).cast("B").cast("f").tolist()


def rel_l2(got, want):
    """||got - want|| / ||want|| over two equal-length sequences of floats."""
    return math.sqrt(sum((a - b) ** 2 for a, b in zip(got, want)) / sum(b * b for b in want))


def time_slice(x, t0, t1):
    """x[:, t0:t1] of a (B, L, D) buffer, as a new Array."""
    B, L, D = memoryview(x).shape
    src = memoryview(x).cast("B")
    out = bytearray()
    for b in range(B):
        out += src[4 * (b * L + t0) * D:4 * (b * L + t1) * D]
    return mamba.asarray(memoryview(out).cast("f"), (B, t1 - t0, D))


def rows(x, idx):
    """x[idx] of a (B, ...) buffer along the first axis, as a new Array."""
    shape = memoryview(x).shape
    per = 4
    for d in shape[1:]:
        per *= d
    src = memoryview(x).cast("B")
    out = bytearray()
    for i in idx:
        out += src[i * per:(i + 1) * per]
    return mamba.asarray(memoryview(out).cast("f"), (len(idx),) + tuple(shape[1:]))


def concat_time(parts):
    """Concatenate (B, Li, D) buffers along time."""
    shapes = [memoryview(p).shape for p in parts]
    B, D = shapes[0][0], shapes[0][2]
    out = bytearray()
    for b in range(B):
        for p, s in zip(parts, shapes):
            L = s[1]
            out += memoryview(p).cast("B")[4 * b * L * D:4 * (b + 1) * L * D]
    total = sum(s[1] for s in shapes)
    return mamba.asarray(memoryview(out).cast("f"), (B, total, D))


def state_bytes(state):
    return tuple(raw(p) for p in state.pieces()) + tuple(
        getattr(state, n) for n in state._SCALARS)


def copy_state(block, state):
    """A deep copy of a state (fresh arrays, same bytes)."""
    B = memoryview(state.pieces()[0]).shape[0]
    new = block.allocate_state(B)
    for n, src in zip(state._PIECES, state.pieces()):
        memoryview(getattr(new, n)).cast("B")[:] = memoryview(src).cast("B")
    for n in state._SCALARS:
        setattr(new, n, getattr(state, n))
    return new
