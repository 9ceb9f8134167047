"""Promises specific to the Mamba-2 block: the C reference equals SPEC section 6 run
literally (bitwise), h_last_ and upstream's initial_states, the dt_limit clamp, and
the refusals of its own arguments. The generic lanes (identity, oracle, refusals)
run for it through tests/blocks.py."""
import math

import numpy as np
import pytest

import mamba
from mamba._oracle64 import oracle2
import spec2
from _util import state_bytes

RTOL, ATOL = 1e-5, 1e-6


def bits(a):
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32)).view(np.uint32)


def as64(w):
    return {k: np.asarray(v, dtype=np.float64) for k, v in w.items()}


def setup(dm, seed, **kw):
    w = mamba.random_weights("mamba2", dm, seed=seed)
    return w, mamba.Mamba2Block(w, backend="cpu", **kw)


def straddling_limit(w, x):
    """A dt_limit (lo, hi) with pre-clamp dt values below lo and above hi."""
    dt = oracle2.dt_preclamp(as64(w), x.astype(np.float64))
    lo, hi = (float(np.float32(v)) for v in np.quantile(dt, [0.3, 0.7]))
    assert (dt < lo).any() and (dt > hi).any(), "the limit must clamp on both sides"
    return lo, hi


@pytest.mark.parametrize("clamped", [False, True], ids=["no-limit", "dt-limit"])
def test_matches_spec_run_literally(clamped):
    """Two rows (two heads each) from nonzero h over a chunk boundary: output, every
    state piece and h_last_ equal a numpy float32 execution of SPEC 6, bit for bit."""
    dm, L, B = 64, 300, 2
    w = mamba.random_weights("mamba2", dm, seed=5)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((B, L, dm)).astype(np.float32)
    limit = straddling_limit(w, x) if clamped else (0.0, math.inf)
    blk = mamba.Mamba2Block(w, backend="cpu", dt_limit=limit)
    st = blk.allocate_state(B)
    h0 = (0.1 * rng.standard_normal(np.asarray(st.h).shape)).astype(np.float32)
    np.asarray(st.h)[...] = h0
    y = blk.forward(x, st)
    wn = {k: np.asarray(v) for k, v in w.items()}
    for b in range(B):
        want_y, want_state, want_hl = spec2.row(wn, x[b], h0[b], blk.dt_limit)
        assert (bits(y)[b] == bits(want_y)).all(), f"row {b}: y"
        for name, got, want in zip(st._PIECES, st.pieces(), want_state):
            assert (bits(got)[b] == bits(want)).all(), f"row {b}: state.{name}"
        assert st.buffered_tokens == want_state[4]
        assert (bits(blk.h_last_)[b] == bits(want_hl)).all(), f"row {b}: h_last_"


def test_h_last_as_initial_states_continues_exactly():
    """On a chunk boundary h_last_ is the resumption state: fed back as h of a fresh
    state (upstream initial_states, with the conv window carried alongside), it
    continues like one long prefill, bit for bit."""
    w, blk = setup(32, 7)
    x = np.random.default_rng(7).standard_normal((1, 520, 32)).astype(np.float32)
    y_full = np.asarray(blk.forward(x))
    st = blk.allocate_state(1)
    blk.forward(x[:, :512], st)
    assert st.buffered_tokens == 0
    assert (bits(blk.h_last_) == bits(st.h)).all()
    fresh = blk.allocate_state(1)
    np.asarray(fresh.h)[...] = np.asarray(blk.h_last_)
    np.asarray(fresh.conv_window)[...] = np.asarray(st.conv_window)
    y_tail = np.asarray(blk.forward(x[:, 512:], fresh))
    assert (bits(y_tail) == bits(y_full[:, 512:])).all()


def test_h_last_is_a_report_and_split_invariant():
    """Mid-chunk, h_last_ folds the open chunk (so it differs from state.h) and has
    the same bits after one prefill and after prefill + decode steps."""
    w, blk = setup(32, 8)
    x = np.random.default_rng(8).standard_normal((2, 262, 32)).astype(np.float32)
    st = blk.allocate_state(2)
    blk.forward(x, st)
    once = bits(blk.h_last_).copy()
    assert (once != bits(st.h)).any()
    st2 = blk.allocate_state(2)
    blk.forward(x[:, :250], st2)
    for t in range(250, 262):
        blk.step(x[:, t:t + 1], st2)
    assert (bits(blk.h_last_) == once).all()


def test_h_last_is_the_report_of_its_call():
    """h_last_ is evaluated when read, yet it reports the call that made it: editing
    the state and the weights in place afterwards does not change it."""
    x = np.random.default_rng(13).standard_normal((2, 270, 32)).astype(np.float32)
    runs = []
    for edit in (False, True):
        w, blk = setup(32, 13)
        st = blk.allocate_state(2)
        blk.forward(x, st)
        blk.forward(x, st)  # 540 tokens: 28 rows of the third chunk open
        if edit:
            for p in st.pieces():
                np.asarray(p)[...] = 0.5
            np.asarray(w["dt_bias"])[...] = 3.0
            np.asarray(w["A_log"])[...] = 0.0
        runs.append(bits(blk.h_last_))
    assert (runs[0] == runs[1]).all()


def test_h_last_of_ragged_rows_equals_rows_alone():
    w, blk = setup(32, 9)
    x = np.random.default_rng(9).standard_normal((3, 300, 32)).astype(np.float32)
    lens = [300, 256, 17]
    blk.forward(x, lengths=lens)
    ragged = bits(blk.h_last_).copy()
    for b, n in enumerate(lens):
        blk.forward(x[b:b + 1, :n])
        assert (ragged[b] == bits(blk.h_last_)[0]).all(), f"row {b}"


def test_initial_states_match_oracle():
    """A nonzero h on a fresh state is upstream's initial_states (float64 oracle)."""
    w, blk = setup(64, 10)
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 300, 64)).astype(np.float32)
    st = blk.allocate_state(2)
    h0 = (0.2 * rng.standard_normal(np.asarray(st.h).shape)).astype(np.float32)
    np.asarray(st.h)[...] = h0
    y = np.asarray(blk.forward(x, st))
    want, want_h = oracle2.forward(as64(w), x.astype(np.float64), h0=h0.astype(np.float64),
                                   return_state=True)
    np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(blk.h_last_), want_h, rtol=RTOL, atol=ATOL)
    # the initial state matters at this tolerance
    assert not np.allclose(y, oracle2.forward(as64(w), x.astype(np.float64)), rtol=RTOL, atol=ATOL)


def test_dt_limit_clamps_as_the_oracle():
    w = mamba.random_weights("mamba2", 32, seed=11)
    x = np.random.default_rng(11).standard_normal((2, 300, 32)).astype(np.float32)
    lo, hi = straddling_limit(w, x)
    blk = mamba.Mamba2Block(w, backend="cpu", dt_limit=(lo, hi))
    y = np.asarray(blk.forward(x))
    want = oracle2.forward(as64(w), x.astype(np.float64), dt_limit=(lo, hi))
    np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)
    unclamped = oracle2.forward(as64(w), x.astype(np.float64))
    assert not np.allclose(y, unclamped, rtol=RTOL, atol=ATOL), "the clamp must matter"


# ---------------------------------------------------------------- refusals

def test_d_model_not_multiple_of_32_refused():
    w = mamba.random_weights("mamba2", 32)
    w["block_norm.weight"] = np.ones(48, np.float32)
    with pytest.raises(ValueError, match="d_model must be a multiple of 32.*got 48"):
        mamba.Mamba2Block(w)


@pytest.mark.parametrize("lim", [(1.0, 0.5), (math.nan, 1.0), (0.0, math.nan),
                                 (-math.inf, 1.0), (math.inf, math.inf), (1e39, math.inf)])
def test_bad_dt_limit_refused(lim):
    w = mamba.random_weights("mamba2", 32)
    with pytest.raises(ValueError, match=r"dt_limit must be \(lo, hi\) with lo finite"):
        mamba.Mamba2Block(w, dt_limit=lim)


@pytest.mark.parametrize("lim", [(1.0,), (0.0, 1.0, 2.0), "ab", None, ("a", "b")])
def test_malformed_dt_limit_refused(lim):
    w = mamba.random_weights("mamba2", 32)
    with pytest.raises(ValueError, match="dt_limit must be a pair of floats"):
        mamba.Mamba2Block(w, dt_limit=lim)


def test_dt_limit_kept_as_float32():
    w = mamba.random_weights("mamba2", 32)
    blk = mamba.Mamba2Block(w, dt_limit=(0.1, 1e39))
    assert blk.dt_limit == (float(np.float32(0.1)), math.inf)


def used_state(blk, B=2, L=3):
    st = blk.allocate_state(B)
    blk.forward(np.random.default_rng(12).standard_normal((B, L, blk.d_model)).astype(np.float32), st)
    return st


@pytest.mark.parametrize("n", [-1, 256, 1000, 1.5, "3", True, None])
def test_buffered_tokens_out_of_range_refused(n):
    w, blk = setup(32, 0)
    st = used_state(blk)
    before = state_bytes(st)
    st.buffered_tokens = n
    x = np.zeros((2, 1, 32), np.float32)
    with pytest.raises(ValueError, match=r"state.buffered_tokens must be an integer in \[0, 256\)"):
        blk.forward(x, st)
    with pytest.raises(ValueError, match=r"state.buffered_tokens must be an integer in \[0, 256\)"):
        blk.step(x, st)
    with pytest.raises(ValueError, match=r"state.buffered_tokens must be an integer in \[0, 256\)"):
        blk.decode_session(st)
    st.buffered_tokens = 3
    assert state_bytes(st) == before


@pytest.mark.parametrize("piece,shape", [("conv_window", (2, 320, 3)), ("h", (2, 1, 128, 64)),
                                         ("buffer_xbc", (2, 255, 320)), ("buffer_dtraw", (2, 256))])
def test_bad_state_shape_refused(piece, shape):
    w, blk = setup(32, 0)
    st = used_state(blk)
    before = state_bytes(st)
    good = getattr(st, piece)
    setattr(st, piece, np.zeros(shape, np.float32))
    want = tuple(np.asarray(good).shape)
    with pytest.raises(ValueError, match=rf"state.{piece} has shape .*expected {re_tuple(want)}"):
        blk.forward(np.zeros((2, 4, 32), np.float32), st)
    setattr(st, piece, good)
    assert state_bytes(st) == before


def re_tuple(t):
    return r"\(" + r", ".join(str(v) for v in t) + r"\)"
