"""Identity lanes (SPEC 10), bitwise, on every block and every usable backend; a GPU
result is also compared with the C reference. Numpy-free."""
import pytest

from _util import rand, raw, time_slice, rows, concat_time, state_bytes, copy_state
from blocks import BLOCKS, make, gpu_backends

CASES = [(b, be) for b in BLOCKS for be in ["cpu"] + gpu_backends(b)]


@pytest.fixture(params=CASES, ids=[f"{b}-{be}" for b, be in CASES])
def case(request):
    name, backend = request.param
    spec = BLOCKS[name]
    blk = make(name, backend=backend)
    ref = blk if backend == "cpu" else make(name, backend="cpu")
    return name, spec, blk, ref


def same_as_cpu(blk, ref, out, x, state_before=None):
    """A GPU output equals the C reference's on the same input and state."""
    if blk is ref:
        return
    st = copy_state(ref, state_before) if state_before is not None else None
    assert raw(ref.forward(x, st)) == raw(out)


def test_repeat(case):
    name, spec, blk, ref = case
    x = rand((2, spec["length"], blk.d_model), 1)
    y1 = blk.forward(x)
    assert raw(blk.forward(x)) == raw(y1)
    same_as_cpu(blk, ref, y1, x)


def test_batch_composition(case):
    name, spec, blk, ref = case
    L = spec["length"]
    x = rand((3, L, blk.d_model), 2)
    y = blk.forward(x)
    rows_y = [raw(rows(y, [b])) for b in range(3)]
    assert rows_y[0] != rows_y[1], "negative control: different rows must differ"
    for b in range(3):
        assert raw(blk.forward(rows(x, [b]))) == rows_y[b]
    perm = [2, 0, 1]
    yp = blk.forward(rows(x, perm))
    assert [raw(rows(yp, [i])) for i in range(3)] == [rows_y[p] for p in perm]
    same_as_cpu(blk, ref, y, x)


def test_decode_equals_prefill(case):
    name, spec, blk, ref = case
    P, T = spec["decode"]
    x = rand((2, T, blk.d_model), 3)
    full_state = blk.allocate_state(2)
    y = blk.forward(x, full_state)
    st = blk.allocate_state(2)
    assert raw(blk.forward(time_slice(x, 0, P), st)) == raw(time_slice(y, 0, P))
    for t in range(P, T):
        yt = blk.step(time_slice(x, t, t + 1), st)
        assert raw(yt) == raw(time_slice(y, t, t + 1)), f"token {t}"
    assert state_bytes(st) == state_bytes(full_state)
    same_as_cpu(blk, ref, y, x)


@pytest.mark.parametrize("where", ["each", "all"])
def test_split_prefill(case, where):
    name, spec, blk, ref = case
    L = spec["length"]
    x = rand((2, L, blk.d_model), 4)
    full_state = blk.allocate_state(2)
    y = blk.forward(x, full_state)
    cuts = [[s] for s in spec["splits"]] if where == "each" else [list(spec["splits"])]
    for points in cuts:
        st = blk.allocate_state(2)
        bounds = [0] + points + [L]
        parts = [blk.forward(time_slice(x, a, b), st) for a, b in zip(bounds, bounds[1:])]
        assert raw(concat_time(parts)) == raw(y), f"split at {points}"
        assert state_bytes(st) == state_bytes(full_state)


def test_session_equals_step(case):
    name, spec, blk, ref = case
    P, T = spec["decode"]
    x = rand((2, T, blk.d_model), 5)
    st_step = blk.allocate_state(2)
    blk.forward(time_slice(x, 0, P), st_step)
    st_sess = copy_state(blk, st_step)
    outs = []
    with blk.decode_session(st_sess) as sess:
        for t in range(P, T):
            xt = time_slice(x, t, t + 1)
            a = blk.step(xt, st_step)
            b = sess.step(xt)
            assert raw(a) == raw(b), f"token {t}"
            outs.append(b)
    assert state_bytes(st_sess) == state_bytes(st_step)


def test_session_sync_and_load(case):
    name, spec, blk, ref = case
    x = rand((1, 4, blk.d_model), 6)
    st = blk.allocate_state(1)
    sess = blk.decode_session(st)
    before = state_bytes(st)
    sess.step(time_slice(x, 0, 1))
    assert state_bytes(st) == before, "the caller's state is stale until sync"
    sess.sync_state()
    synced = state_bytes(st)
    assert synced != before
    # edits to the state arrays reach the session only through load_state
    other = blk.allocate_state(1)
    blk.step(time_slice(x, 0, 1), other)
    y_ref = blk.step(time_slice(x, 1, 2), copy_state(blk, other))
    for n, src in zip(other._PIECES, other.pieces()):
        memoryview(getattr(st, n)).cast("B")[:] = memoryview(src).cast("B")
    for n in other._SCALARS:
        setattr(st, n, getattr(other, n))
    sess.load_state()
    assert raw(sess.step(time_slice(x, 1, 2))) == raw(y_ref)
    sess.close()
    sess.close()
    assert not sess.is_open


def test_step_takes_2d_tokens(case):
    name, spec, blk, ref = case
    x = rand((2, 1, blk.d_model), 7)
    s1, s2 = blk.allocate_state(2), blk.allocate_state(2)
    flat = rows(x, [0, 1]).reshape(2, blk.d_model)
    assert raw(blk.step(x, s1)) == raw(blk.step(flat, s2))


def test_state_round_trips_bytes(case):
    """A state saved as bytes and restored continues exactly."""
    name, spec, blk, ref = case
    x = rand((1, 9, blk.d_model), 8)
    st = blk.allocate_state(1)
    blk.forward(time_slice(x, 0, 5), st)
    saved = [bytes(raw(p)) for p in st.pieces()]
    scalars = {n: getattr(st, n) for n in st._SCALARS}
    y_a = blk.forward(time_slice(x, 5, 9), st)
    restored = blk.allocate_state(1)
    for n, b in zip(restored._PIECES, saved):
        memoryview(getattr(restored, n)).cast("B")[:] = b
    for n, v in scalars.items():
        setattr(restored, n, v)
    assert raw(blk.forward(time_slice(x, 5, 9), restored)) == raw(y_a)


def test_ragged_rows_equal_rows_alone(case):
    name, spec, blk, ref = case
    L = spec["length"]
    lens = [L, 3, 1]
    x = rand((3, L, blk.d_model), 9)
    flat = memoryview(x).cast("B").cast("f")
    D = blk.d_model
    for b, n in enumerate(lens):  # padding is never read: poison it
        for i in range((b * L + n) * D, (b + 1) * L * D):
            flat[i] = float("nan")
    y = blk.forward(x, lengths=lens)
    for b, n in enumerate(lens):
        alone = blk.forward(time_slice(rows(x, [b]), 0, n))
        assert raw(time_slice(rows(y, [b]), 0, n)) == raw(alone), f"row {b}"
        pad = raw(time_slice(rows(y, [b]), n, L)) if n < L else b""
        assert pad == bytes(len(pad)), f"row {b} padding is not +0.0"
