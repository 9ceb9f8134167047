"""Interop with numpy and torch arrays: zero-copy in and out, strided inputs copied,
reduced-precision dtypes refused by name."""
import numpy as np
import pytest

import mamba
from blocks import BLOCKS, make
from _util import raw, state_bytes


@pytest.fixture(params=list(BLOCKS))
def blk(request):
    return make(request.param, backend="cpu")


def test_output_is_zero_copy_under_numpy(blk):
    x = np.random.default_rng(0).standard_normal((2, 5, blk.d_model), dtype=np.float32)
    y = blk.forward(x)
    a = np.asarray(y)
    assert a.dtype == np.float32 and a.shape == (2, 5, blk.d_model)
    assert a.ctypes.data == y.ptr
    assert np.from_dlpack(y).ctypes.data == y.ptr
    assert y.__dlpack_device__() == (1, 0)
    assert y.tolist() == a.tolist()


def test_strided_input_is_copied_not_refused(blk):
    rng = np.random.default_rng(1)
    big = rng.standard_normal((2, 10, 2 * blk.d_model), dtype=np.float32)
    strided = big[:, ::2, ::2]
    assert not strided.flags.c_contiguous
    assert raw(blk.forward(strided)) == raw(blk.forward(np.ascontiguousarray(strided)))


def test_noncontiguous_state_refused(blk):
    st = blk.allocate_state(2)
    name = st._PIECES[0]
    shape = np.asarray(getattr(st, name)).shape
    fortran = np.zeros(shape, dtype=np.float32, order="F")
    setattr(st, name, fortran)
    with pytest.raises(ValueError, match=f"state.{name} must be C-contiguous"):
        blk.forward(np.zeros((2, 1, blk.d_model), np.float32), st)


def test_numpy_state_updated_in_place(blk):
    st = blk.allocate_state(1)
    for n in st._PIECES:
        setattr(st, n, np.zeros(np.asarray(getattr(st, n)).shape, np.float32))
    ref = blk.allocate_state(1)
    x = np.random.default_rng(2).standard_normal((1, 4, blk.d_model), dtype=np.float32)
    assert raw(blk.forward(x, st)) == raw(blk.forward(x, ref))
    assert state_bytes(st) == state_bytes(ref)


@pytest.mark.parametrize("dtype", [np.float16, np.float64, np.int32])
def test_numpy_dtypes_refused_by_name(blk, dtype):
    x = np.zeros((1, 2, blk.d_model), dtype=dtype)
    with pytest.raises(TypeError, match=f"x has dtype {np.dtype(dtype).name}"):
        blk.forward(x)


def test_bfloat16_refused_by_name(blk):
    torch = pytest.importorskip("torch")
    x = torch.zeros((1, 2, blk.d_model), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="x has dtype bfloat16"):
        blk.forward(x)
