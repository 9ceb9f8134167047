"""Mamba-3 beyond the generic lanes: SPEC 7 executed literally (spec3, bitwise), the
input-state continuation (set_input_states), angles that wrap past 2 pi, the A floor,
the reports, and the Mamba-3 refusals. Values are checked against the float64
step-recurrence oracle (oracle3) by tolerance; what the spec promises as bits is
checked bitwise."""
import numpy as np
import pytest

import mamba
from mamba._oracle64 import oracle3
import spec3
from _util import raw, state_bytes

DM = 64
H = 2 * DM // 64
RTOL, ATOL = 1e-5, 1e-6
TWO_PI32 = float(np.float32(2 * np.pi))


def as64(a):
    if isinstance(a, dict):
        return {k: as64(v) for k, v in a.items()}
    if isinstance(a, tuple):
        return tuple(as64(v) for v in a)
    return np.asarray(a, dtype=np.float64)


def weights(seed, dm=DM):
    """Random weights as writable numpy arrays, on the oracle's sane scale."""
    w = {k: np.array(v) for k, v in mamba.random_weights("mamba3", dm, seed=seed).items()}
    return oracle3.sane(w)


def rows(dm=DM):
    """in_proj row ranges of the per-head and angle inputs."""
    di, h = 2 * dm, 2 * dm // 64
    b = 2 * di + 256
    return dict(dt=slice(b, b + h), A=slice(b + h, b + 2 * h), trap=slice(b + 2 * h, b + 3 * h),
                angle=slice(b + 3 * h, b + 3 * h + 32))


def inputs(B, L, seed, offset=0.0, dm=DM):
    return (np.random.default_rng(seed).standard_normal((B, L, dm)) + offset).astype(np.float32)


def reports(blk):
    return tuple(np.asarray(a) for a in (blk.theta_last_, blk.h_last_, blk.k_last_, blk.v_last_))


def assert_reports_close(got, want):
    """theta (circular), h, k and v against the oracle's final states, each within
    1e-5 of its own scale (float32 rounding of the recurrence, angles included)."""
    th, *rest = got
    wth, *wrest = want
    dth = np.abs((th - wth + np.pi) % (2 * np.pi) - np.pi)
    assert dth.max() <= 1e-5 * 2 * np.pi, f"theta off by {dth.max()}"
    for name, a, b in zip(("h", "k", "v"), rest, wrest):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-5 * np.abs(b).max(), err_msg=name)


def bits(a):
    return np.asarray(a).view(np.uint32)


# ------------------------------------------------------------------ the spec, literally

@pytest.mark.parametrize("given", [False, True], ids=["fresh", "input-states"])
def test_matches_spec_run_literally(given):
    """Two rows (two heads each) over two chunk seals, angles wrapping: output, every
    state piece, buffered_tokens and every report equal a numpy float32 execution of
    SPEC 7, bit for bit; with input states too."""
    w = {k: np.asarray(v) for k, v in mamba.random_weights("mamba3", DM, seed=8).items()}
    w["in_proj.weight"] = w["in_proj.weight"].copy()
    w["in_proj.weight"][rows()["angle"]] *= 8
    B, L = 2, 130
    x = inputs(B, L, 9)
    blk = mamba.Mamba3Block(w, backend="cpu")
    st = blk.allocate_state(B)
    start = None
    if given:
        blk.forward(inputs(B, 20, 10))
        start = reports(blk)
        st.set_input_states(*start)
    y = blk.forward(x, st)
    got_rep = (blk.h_last_, blk.k_last_, blk.v_last_, blk.theta_last_)
    for b in range(B):
        one = None if start is None else tuple(a[b] for a in start)
        want_y, want_state, want_n, want_rep = spec3.row(w, x[b], one)
        assert (bits(y)[b] == bits(want_y)).all(), f"row {b}: y"
        for name, got, want in zip(st._PIECES, st.pieces(), want_state):
            assert (bits(got)[b] == bits(want)).all(), f"row {b}: state.{name}"
        for name, got, want in zip(("h_last_", "k_last_", "v_last_", "theta_last_"), got_rep,
                                   want_rep):
            assert (bits(got)[b] == bits(want)).all(), f"row {b}: {name}"
    assert st.buffered_tokens == want_n and st.pending is False


# ------------------------------------------------------------------ input states

def test_set_input_states_matches_reference():
    w = weights(1)
    blk = mamba.Mamba3Block(w)
    x = inputs(2, 150, 2)
    st = blk.allocate_state(2)
    blk.forward(x[:, :60], st)
    given = reports(blk)
    cont = blk.allocate_state(2)
    cont.set_input_states(*given)
    assert cont.buffered_tokens == 0 and cont.pending is True
    assert raw(cont.pending_k) == raw(given[2].astype(np.float32))
    y = np.asarray(blk.forward(x[:, 60:], cont))
    assert cont.pending is False and cont.buffered_tokens == (90 - 1) % 64 + 1
    assert not np.asarray(cont.pending_k).any() and not np.asarray(cont.pending_v).any()
    # upstream's Input_States maths: the recurrence started from the given states
    want, fin = oracle3.forward(as64(w), as64(x[:, 60:]), input_states=as64(given),
                                reports=True)
    np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)
    assert_reports_close(reports(blk), fin)
    # and the continuation of the whole sequence
    np.testing.assert_allclose(y, oracle3.forward(as64(w), as64(x))[:, 60:], rtol=RTOL,
                               atol=ATOL)
    # the fold matters: without it (pending dropped) the outputs are wrong
    plain = blk.allocate_state(2)
    plain.set_input_states(*given)
    plain.pending = False
    assert not np.allclose(np.asarray(blk.forward(x[:, 60:], plain)), want, rtol=RTOL,
                           atol=ATOL)


def test_input_states_decode_equals_prefill():
    """After set_input_states, steps, a decode session and one prefill give the same
    bits."""
    blk = mamba.Mamba3Block(weights(3))
    x = inputs(2, 70, 4)
    st = blk.allocate_state(2)
    blk.forward(x[:, :40], st)
    given = reports(blk)
    a, b, c = blk.allocate_state(2), blk.allocate_state(2), blk.allocate_state(2)
    for s in (a, b, c):
        s.set_input_states(*given)
    y = np.asarray(blk.forward(x[:, 40:], a))
    with blk.decode_session(c) as sess:
        for t in range(40, 70):
            want = raw(np.ascontiguousarray(y[:, t - 40:t - 39]))
            assert raw(blk.step(x[:, t:t + 1], b)) == want, t
            assert raw(sess.step(x[:, t:t + 1])) == want, t
    assert state_bytes(a) == state_bytes(b) == state_bytes(c)


def test_set_input_states_accepts_aliased_pieces():
    """The state's own pieces may be passed back (e.g. theta, h of the same state)."""
    blk = mamba.Mamba3Block(weights(5))
    st = blk.allocate_state(1)
    blk.forward(inputs(1, 10, 6), st)
    theta, h = np.array(st.theta), np.array(st.h)
    kb, vb = np.asarray(st.buffer_krot)[:, 0], np.asarray(st.buffer_v)[:, 0]
    k, v = kb.copy(), vb.copy()
    st.set_input_states(st.theta, st.h, kb, vb)
    assert raw(st.theta) == raw(theta) and raw(st.h) == raw(h)
    assert raw(st.pending_k) == raw(k) and raw(st.pending_v) == raw(v)
    assert not np.asarray(st.buffer_krot).any()


# ------------------------------------------------------------------ angles, A floor

def test_angles_wrap_past_two_pi():
    w = weights(3)
    w["in_proj.weight"][rows()["angle"]] *= 20  # tanh near +-1: steps of about pi * dt
    w["dt_bias"][:] = -1.0                      # dt about 0.3
    x = inputs(2, 130, 5)
    t = oracle3.project(as64(w), as64(x))
    turns = np.floor(np.cumsum(t["ang"][:, :, None, :] * t["dt"][..., None], axis=1)
                     / (2 * np.pi))
    assert turns.max() >= 3 and turns.min() <= -3, "the angles must wrap both ways"
    blk = mamba.Mamba3Block(w)
    y = np.asarray(blk.forward(x))
    want, fin = oracle3.forward(as64(w), as64(x), reports=True)
    np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)
    assert_reports_close(reports(blk), fin)
    th = np.asarray(blk.theta_last_)
    assert th.min() >= -1e-6 and th.max() <= TWO_PI32, "theta is reduced every token"


def test_A_floor_binds():
    w = weights(4)
    w["in_proj.weight"][rows()["A"].start] = -20000.0 / DM  # head 0: dd_A about -1.8e4
    w["out_proj.weight"] /= 8                               # no decay: keep the mixer sane
    x = inputs(2, 130, 6, offset=3.0)
    t = oracle3.project(as64(w), as64(x))
    heavy = np.where(t["dd_A"] >= 0, 1 + t["dd_A"], 1 / (1 - t["dd_A"]))
    assert (t["dd_A"][..., 0] < -9999).all() and (-heavy[..., 0] > -1e-4).all()
    assert (-heavy[..., 1] < -1e-4).all(), "head 1 is a control the floor leaves alone"
    blk = mamba.Mamba3Block(w)
    y = np.asarray(blk.forward(x))
    want, fin = oracle3.forward(as64(w), as64(x), reports=True)
    np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)
    assert_reports_close(reports(blk), fin)
    assert not np.allclose(y, oracle3.forward(as64(w), as64(x), a_floor=0.0), rtol=RTOL,
                           atol=ATOL), "the floor must change the result"


# ------------------------------------------------------------------ reports

@pytest.mark.parametrize("L", [1, 63, 64, 65, 130])
def test_reports_match_oracle(L):
    w = weights(L)
    blk = mamba.Mamba3Block(w)
    x = inputs(3, L, L)
    blk.forward(x)
    _, fin = oracle3.forward(as64(w), as64(x), reports=True)
    assert_reports_close(reports(blk), fin)
    first = [raw(a) for a in reports(blk)]
    blk.forward(x, blk.allocate_state(3))
    assert [raw(a) for a in reports(blk)] == first, "a carried fresh state reports the same"


def test_ragged_reports_are_each_rows_own():
    w = weights(7)
    blk = mamba.Mamba3Block(w)
    x = inputs(3, 130, 8)
    lengths = [130, 64, 1]
    blk.forward(x, lengths=lengths)
    got = reports(blk)
    for b, n in enumerate(lengths):
        blk.forward(x[b:b + 1, :n])
        alone = reports(blk)
        for a, r in zip(got, alone):
            assert raw(np.ascontiguousarray(a[b:b + 1])) == raw(r), (b, n)


def test_reports_after_steps_equal_reports_after_prefill():
    """Reports are a function of the prefix: decoding to t reports the same bits as
    a prefill of t tokens, across the chunk boundary at 64."""
    blk = mamba.Mamba3Block(weights(9))
    x = inputs(2, 70, 10)
    st = blk.allocate_state(2)
    blk.forward(x[:, :60], st)
    for t in range(60, 70):
        blk.step(x[:, t:t + 1], st)
        stepped = [raw(a) for a in reports(blk)]
        blk.forward(x[:, :t + 1])
        assert stepped == [raw(a) for a in reports(blk)], t


# ------------------------------------------------------------------ refusals

def test_d_model_must_be_multiple_of_32():
    with pytest.raises(ValueError, match="d_model must be a multiple of 32 .* got 48"):
        mamba.Mamba3Block(mamba.random_weights("mamba3", 64) | {
            "block_norm.weight": np.ones(48, np.float32)})


@pytest.mark.parametrize("n", [-1, 65, 2.5, "3", True, None])
def test_buffered_tokens_range(n):
    blk = mamba.Mamba3Block(weights(11))
    st = blk.allocate_state(1)
    blk.forward(inputs(1, 5, 12), st)
    st.buffered_tokens = n
    before = state_bytes(st)
    for call in (lambda: blk.forward(inputs(1, 2, 13), st),
                 lambda: blk.step(inputs(1, 1, 14), st),
                 lambda: blk.decode_session(st)):
        with pytest.raises(ValueError, match=r"buffered_tokens must be an integer in \[0, 64\]"):
            call()
        assert state_bytes(st) == before


def test_buffered_tokens_64_is_a_full_open_chunk():
    blk = mamba.Mamba3Block(weights(11))
    x = inputs(1, 66, 15)
    st = blk.allocate_state(1)
    blk.forward(x[:, :64], st)
    assert st.buffered_tokens == 64
    y = blk.forward(x[:, 64:], st)
    assert st.buffered_tokens == 2
    assert raw(y) == raw(np.asarray(blk.forward(x))[:, 64:])


@pytest.mark.parametrize("pending,n,msg", [
    ("yes", 0, "pending must be True or False"),
    (True, 3, "pending needs buffered_tokens == 0"),
])
def test_pending_refusals(pending, n, msg):
    blk = mamba.Mamba3Block(weights(11))
    st = blk.allocate_state(1)
    blk.forward(inputs(1, 3, 16), st)
    st.pending, st.buffered_tokens = pending, n
    before = state_bytes(st)
    with pytest.raises(ValueError, match=msg):
        blk.forward(inputs(1, 2, 17), st)
    assert state_bytes(st) == before


@pytest.mark.parametrize("piece,shape", [
    ("theta", (1, H, 16)), ("h", (1, H, 128, 64)), ("buffer_qrot", (1, 32, H, 128)),
    ("buffer_v", (1, 64, H, 128)), ("buffer_adt", (1, H, 64)), ("pending_k", (1, H, 64)),
])
def test_state_piece_shapes(piece, shape):
    blk = mamba.Mamba3Block(weights(11))
    st = blk.allocate_state(1)
    setattr(st, piece, np.zeros(shape, np.float32))
    before = state_bytes(st)
    with pytest.raises(ValueError, match=f"state.{piece} has shape"):
        blk.forward(inputs(1, 2, 18), st)
    assert state_bytes(st) == before


def _used(blk):
    st = blk.allocate_state(1)
    blk.forward(inputs(1, 5, 19), st)
    return st, reports(blk)


@pytest.mark.parametrize("which,bad,err,msg", [
    (1, np.zeros((1, H, 64, 64), np.float32), ValueError, "h has shape"),
    (2, np.zeros((1, 1, H, 128), np.float32), ValueError, "k has shape"),
    (0, np.zeros((1, H, 32), np.float64), TypeError, "theta has dtype float64"),
    (3, np.full((1, H, 64), np.nan, np.float32), ValueError, "v holds a non-finite value"),
])
def test_set_input_states_refusals(which, bad, err, msg):
    blk = mamba.Mamba3Block(weights(11))
    st, rep = _used(blk)
    args = list(rep)
    args[which] = bad
    before = state_bytes(st)
    with pytest.raises(err, match=msg):
        st.set_input_states(*args)
    assert state_bytes(st) == before


def test_set_input_states_refused_while_session_open():
    blk = mamba.Mamba3Block(weights(11))
    st, rep = _used(blk)
    before = state_bytes(st)
    with blk.decode_session(st):
        with pytest.raises(ValueError, match="owned by an open decode session"):
            st.set_input_states(*rep)
        assert state_bytes(st) == before
    st.set_input_states(*rep)
    assert st.pending is True

