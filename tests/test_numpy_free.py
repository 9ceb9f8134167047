"""The library needs no numpy: import, forward, step, sessions, lengths, backward, vjp
and Array all work with numpy blocked, on inputs built from array.array and
memoryview."""
import array
import subprocess
import sys

import mamba
from _util import rand, raw

BLOCKED = r"""
import sys
sys.modules["numpy"] = None          # any `import numpy` now raises ImportError
import array, mamba
from mamba import _weights
for name, cls in [(n, getattr(mamba, c)) for n, c in
                  [("mamba1", "Mamba1Block"), ("mamba2", "Mamba2Block"), ("mamba3", "Mamba3Block")]
                  if hasattr(mamba, c)]:
    blk = cls(mamba.random_weights(name, 32))
    d = blk.d_model
    x = memoryview(array.array("f", [0.01 * (i % 97) for i in range(2 * 5 * d)])).cast("B").cast("f", (2, 5, d))
    y = blk.forward(x)
    st = blk.allocate_state(2)
    blk.forward(x, st)
    blk.step(memoryview(array.array("f", [0.5] * (2 * d))).cast("B").cast("f", (2, d)), st)
    with blk.decode_session(st) as s:
        s.step(mamba.asarray(array.array("f", [0.25] * (2 * d)), (2, 1, d)))
    blk.forward(x, lengths=[5, 2])
    g = blk.backward(x, x)
    yv, pullback = blk.vjp(x)
    assert yv.tolist() == y.tolist() and pullback(x)["x"].tolist() == g["x"].tolist()
    assert len(y.tolist()) == 2 and memoryview(y).shape == (2, 5, d)
assert "numpy" not in sys.modules or sys.modules["numpy"] is None
print("ok")
"""


def test_library_runs_with_numpy_blocked(tmp_path):
    # outside the source checkout, whose uninstalled mamba/ would shadow the package
    res = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True,
                         cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-3000:]


def test_array_surface():
    a = mamba.asarray(array.array("f", range(6)), (2, 3))
    assert a.shape == (2, 3) and a.dtype == "float32" and a.ndim == 2 and a.size == 6
    assert a.nbytes == 24 and len(a) == 2
    assert a.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    m = memoryview(a)
    assert m.format == "f" and m.shape == (2, 3) and m.strides == (12, 4) and not m.readonly
    assert a.reshape(3, 2).tolist() == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    assert a.reshape((6,)).ptr == a.ptr
    assert a.__dlpack_device__() == (1, 0)
    cap = a.__dlpack__()
    assert type(cap).__name__ == "PyCapsule"
    z = mamba.zeros((4,))
    assert z.tolist() == [0.0] * 4 and "float32" in repr(z)


def test_asarray_copies_and_reshapes():
    src = array.array("f", [1.5, -2.0, 3.25, 0.0])
    a = mamba.asarray(src, (2, 2))
    src[0] = 9.0
    assert a.tolist() == [[1.5, -2.0], [3.25, 0.0]]


def test_borrowed_weights_are_zero_copy():
    """On the CPU a block borrows C-contiguous float32 weights: in-place edits are seen."""
    w = mamba.random_weights("mamba1", 16)
    blk = mamba.Mamba1Block(w, backend="cpu")
    x = rand((1, 3, 16), 1)
    y0 = raw(blk.forward(x))
    out = memoryview(w["out_proj.weight"]).cast("B").cast("f")
    out[0] = out[0] * 2
    assert raw(blk.forward(x)) != y0
    out[0] = out[0] / 2
    assert raw(blk.forward(x)) == y0
