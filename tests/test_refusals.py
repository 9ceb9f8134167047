"""Every refusal of SPEC section 9: a clear exception naming the argument, and
nothing the caller owns modified. Numpy-free."""
import array
import math

import pytest

import mamba
from _util import rand, raw, state_bytes
from blocks import BLOCKS, make

NAMES = list(BLOCKS)


@pytest.fixture(params=NAMES)
def blk(request):
    return make(request.param, backend="cpu")


def f64(shape):
    n = math.prod(shape)
    return memoryview(array.array("d", [0.5] * n)).cast("B").cast("d", shape)


def u16(shape):
    n = math.prod(shape)
    return memoryview(bytearray(2 * n)).cast("H", shape)


def used_state(blk, B=2):
    st = blk.allocate_state(B)
    blk.forward(rand((B, 3, blk.d_model), 11), st)
    return st


@pytest.mark.parametrize("maker,dname", [(f64, "float64"), (u16, "uint16")])
def test_dtype_refused_by_name(blk, maker, dname):
    st = used_state(blk)
    before = state_bytes(st)
    with pytest.raises(TypeError, match=f"x has dtype {dname}"):
        blk.forward(maker((2, 3, blk.d_model)), st)
    assert state_bytes(st) == before


def test_non_buffer_refused(blk):
    with pytest.raises(TypeError, match="x is a list"):
        blk.forward([[[0.0] * blk.d_model]])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_input_names_index(blk, bad):
    x = rand((2, 3, blk.d_model), 12)
    idx = blk.d_model + 5
    memoryview(x).cast("B").cast("f")[idx] = bad
    st = used_state(blk)
    before = state_bytes(st)
    with pytest.raises(ValueError, match=f"x holds a non-finite value .* flat index {idx}$"):
        blk.forward(x, st)
    with pytest.raises(ValueError, match=f"flat index {idx}$"):
        blk.step(_token_with(x, blk, idx), st)
    assert state_bytes(st) == before


def _token_with(x, blk, idx):
    """A (2, 1, d) token holding the bad value at flat index idx."""
    t = rand((2, 1, blk.d_model), 13)
    memoryview(t).cast("B").cast("f")[idx] = memoryview(x).cast("B").cast("f")[idx]
    return t


def test_nonfinite_weight_refused_at_construction(blk):
    name = type(blk)
    w = mamba.random_weights(_key(blk), blk.d_model)
    wname = name._W_NAMES[1]
    memoryview(w[wname]).cast("B").cast("f")[7] = math.nan
    with pytest.raises(ValueError, match=f"{wname} holds a non-finite value .* flat index 7$"):
        name(w)


def test_nonfinite_state_refused(blk):
    st = used_state(blk)
    piece = st._PIECES[-1] if st._PIECES[-1] != "pending_v" else "h"
    memoryview(getattr(st, piece)).cast("B").cast("f")[3] = math.inf
    before = state_bytes(st)
    with pytest.raises(ValueError, match=f"state.{piece} holds a non-finite value .* index 3$"):
        blk.forward(rand((2, 2, blk.d_model), 14), st)
    assert state_bytes(st) == before


def _key(blk):
    return [k for k, v in BLOCKS.items() if v["cls"] is type(blk)][0]


def test_weight_dict_keys(blk):
    cls = type(blk)
    w = mamba.random_weights(_key(blk), blk.d_model)
    first = cls._W_NAMES[2]
    del w[first]
    w["bogus.weight"] = w[cls._W_NAMES[0]]
    with pytest.raises(ValueError, match=rf"missing \['{first}'\]; unknown \['bogus.weight'\]"):
        cls(w)
    with pytest.raises(TypeError, match="weights must be a dict"):
        cls([1, 2])


def test_weight_shape_names_expected(blk):
    cls = type(blk)
    w = mamba.random_weights(_key(blk), blk.d_model)
    last = cls._W_NAMES[-1]
    w[last] = rand((3, 3), 1)
    with pytest.raises(ValueError, match=f"{last} has shape \\(3, 3\\), expected"):
        cls(w)


def test_weight_dtype_refused(blk):
    cls = type(blk)
    w = mamba.random_weights(_key(blk), blk.d_model)
    name = cls._W_NAMES[0]
    w[name] = f64((blk.d_model,))
    with pytest.raises(TypeError, match=f"{name} has dtype float64"):
        cls(w)


def test_x_shapes(blk):
    d = blk.d_model
    st = used_state(blk)
    before = state_bytes(st)
    with pytest.raises(ValueError, match=f"x has d_model {d + 1}, expected {d}"):
        blk.forward(rand((2, 3, d + 1), 1), st)
    with pytest.raises(ValueError, match=r"x must have shape \(B, L, d_model\)"):
        blk.forward(rand((3, d), 1))
    with pytest.raises(ValueError, match="one token per row"):
        blk.step(rand((2, 2, d), 1), st)
    with pytest.raises(ValueError, match=r"state.\w+ has shape \(2, .*expected \(3,"):
        blk.forward(rand((3, 2, d), 1), st)
    with pytest.raises(ValueError, match="B >= 1 and L >= 1"):
        blk.forward(mamba.zeros((2, 0, d)))
    assert state_bytes(st) == before


def test_state_must_be_writable_and_typed(blk):
    st = used_state(blk)
    name = st._PIECES[0]
    good = getattr(st, name)
    setattr(st, name, memoryview(bytes(raw(good))).cast("f", memoryview(good).shape))
    with pytest.raises(ValueError, match=f"state.{name} must be writable"):
        blk.forward(rand((2, 1, blk.d_model), 1), st)
    setattr(st, name, f64(memoryview(good).shape))
    with pytest.raises(TypeError, match=f"state.{name} has dtype float64"):
        blk.forward(rand((2, 1, blk.d_model), 1), st)
    with pytest.raises(TypeError, match="state must be a"):
        blk.forward(rand((2, 1, blk.d_model), 1), object())
    with pytest.raises(ValueError, match="state is required"):
        blk.step(rand((2, 1, blk.d_model), 1), None)


def test_state_owned_by_session_refused(blk):
    st = used_state(blk)
    sess = blk.decode_session(st)
    with pytest.raises(ValueError, match="owned by an open decode session"):
        blk.step(rand((2, 1, blk.d_model), 1), st)
    with pytest.raises(ValueError, match="owned by an open decode session"):
        blk.decode_session(st)
    sess.close()
    blk.step(rand((2, 1, blk.d_model), 1), st)
    with pytest.raises(ValueError, match="session is closed"):
        sess.step(rand((2, 1, blk.d_model), 1))


def test_session_batch_mismatch(blk):
    with blk.decode_session(blk.allocate_state(2)) as sess:
        with pytest.raises(ValueError, match="holds 2 rows, x has B = 3"):
            sess.step(rand((3, 1, blk.d_model), 1))


@pytest.mark.parametrize("lengths,msg", [
    ([3], "lengths has 1 entries, expected B = 2"),
    ([0, 3], r"lengths must lie in \[1, 3\], got \[0\]"),
    ([3, 4], r"lengths must lie in \[1, 3\], got \[4\]"),
    ([1.5, 2], "lengths must be integers"),
    (5, "lengths must be a sequence of 2 integers"),
])
def test_lengths_malformed(blk, lengths, msg):
    with pytest.raises(ValueError, match=msg):
        blk.forward(rand((2, 3, blk.d_model), 1), lengths=lengths)


def test_lengths_with_state_refused(blk):
    st = used_state(blk)
    before = state_bytes(st)
    with pytest.raises(ValueError, match="lengths cannot be combined with a carried state"):
        blk.forward(rand((2, 3, blk.d_model), 1), st, lengths=[1, 2])
    assert state_bytes(st) == before


def test_constructor_options(blk):
    cls = type(blk)
    w = mamba.random_weights(_key(blk), blk.d_model)
    with pytest.raises(ValueError, match="numeric_mode must be one of"):
        cls(w, numeric_mode="deterministic")
    with pytest.raises(ValueError, match="backend must be 'auto', 'cpu', 'cuda' or 'hip'"):
        cls(w, backend="tpu")
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        blk.allocate_state(0)


@pytest.mark.parametrize("name", ["cuda", "hip"])
def test_unusable_backend_raises(name):
    ok, why = mamba.backends()[name]
    if ok:
        make("mamba1", backend=name)  # usable: constructing must work
        return
    with pytest.raises(RuntimeError, match=f"backend '{name}' was requested but is not usable"):
        make("mamba1", backend=name)
