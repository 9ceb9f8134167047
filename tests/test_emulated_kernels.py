"""The CUDA kernels without a GPU: backends/kernels/ compiled for the host by g++
(tests/emu: each GPU thread a fiber, a stand-in for cuda.bindings.driver) stands in
for the "cuda" backend while this module runs, driven by the real mamba/_cuda*.py,
and must give the C reference's bits: the identity lanes and profile digests of
every block, the backward of every block, device arrays and decode sessions. A
kernel built with one deliberately wrong expression must be caught, and every kernel
of the library must have run. Skipped only where g++ (or, in a copy of tests/, the
kernel sources) is missing. Numpy-free."""
import array
import gc
import glob
import math
import os
import re
import threading

import pytest

import emu
import mamba
from mamba import _backends, _core, _cuda, _cuda_session, _cuda_ssd
from _util import FAST_BOUND, concat_time, floats, rand, raw, rel_l2, rows, time_slice
from blocks import BLOCKS, make
from test_backward_gpu import GRAD_BLOCKS, _inputs, _pair
from test_profile import DIGESTS, run_digest
from device_lanes import (FAST_NORM_SHAPES, NORM_GEMVS, NORM_SHAPES, REPORTS, SSD_SESSIONS,
                          angle_walks, assert_same, fast_rmsnorm_rows, frees_during_capture,
                          gemm_tails, host, m2_head_groups,
                          input_check_in_norm, math_matches_reference, norm_gemv, poisoned,
                          refusals_after_launch, rmsnorm_rows, scan_exp_ranges,
                          ssd_fold_chain, ssd_session_graph, state_of)



@pytest.fixture(scope="module")
def be():
    """The emulated backend as "cuda", for this module only."""
    if emu.gxx() is None:
        pytest.skip("g++ is not installed: the kernels cannot be compiled for the host")
    if not os.path.isdir(emu.KERNELS):
        pytest.skip("no backends/kernels beside tests/ (a copy of tests/ outside the tree)")
    backend = emu.backend()
    saved = _backends._cache.get("cuda")
    _backends._cache["cuda"] = (backend, backend.description)
    yield backend
    if saved is None:
        del _backends._cache["cuda"]
    else:
        _backends._cache["cuda"] = saved


# ------------------------------------------------------------------ identity lanes
# Each lane: (block, its name) -> [(label, bytes)], run on both backends. The shapes
# are tests/blocks.py's, which cross each block's chunk grid (Mamba-2 Q = 256,
# Mamba-3 Q = 64) in prefill, split and decode.
def lane_forward(blk, name):
    x = rand((2, BLOCKS[name]["length"], blk.d_model), 1)
    st = blk.allocate_state(2)
    out = [("y", raw(blk.forward(x, st)))] + state_of(st)
    out += [(r, host(getattr(blk, r))) for r in REPORTS[name]]
    return out + [("y, stateless", raw(blk.forward(x)))]


def lane_batch(blk, name):
    x = rand((3, BLOCKS[name]["length"], blk.d_model), 2)
    out = [("y", raw(blk.forward(x)))]
    out += [(f"row {b} alone", raw(blk.forward(rows(x, [b])))) for b in range(3)]
    return out + [("rows permuted", raw(blk.forward(rows(x, [2, 0, 1]))))]


def lane_decode(blk, name):
    P, T = BLOCKS[name]["decode"]
    x = rand((2, T, blk.d_model), 3)
    st = blk.allocate_state(2)
    out = [("prefill", raw(blk.forward(time_slice(x, 0, P), st)))]
    out += [(f"step {t}", raw(blk.step(time_slice(x, t, t + 1), st))) for t in range(P, T)]
    return out + state_of(st)


def lane_split(blk, name):
    L = BLOCKS[name]["length"]
    x = rand((2, L, blk.d_model), 4)
    splits = BLOCKS[name]["splits"]
    out = []
    for points in [[p] for p in splits] + [list(splits)]:
        st = blk.allocate_state(2)
        bounds = [0] + points + [L]
        parts = [blk.forward(time_slice(x, a, b), st) for a, b in zip(bounds, bounds[1:])]
        out += [(f"split at {points}", raw(concat_time(parts)))] + state_of(st)
    return out


def lane_session(blk, name):
    P, T = BLOCKS[name]["decode"]
    x = rand((2, T, blk.d_model), 5)
    st = blk.allocate_state(2)
    blk.forward(time_slice(x, 0, P), st)
    with blk.decode_session(st) as sess:
        out = [(f"session step {t}", raw(sess.step(time_slice(x, t, t + 1))))
               for t in range(P, T)]
    return out + state_of(st)


def lane_ragged(blk, name):
    L, D = BLOCKS[name]["length"], blk.d_model
    lens = [L, 3, 1]
    x = rand((3, L, D), 9)
    flat = memoryview(x).cast("B").cast("f")
    for b, n in enumerate(lens):  # padding is never read: poison it
        for i in range((b * L + n) * D, (b + 1) * L * D):
            flat[i] = math.nan
    return [("y", raw(blk.forward(x, lengths=lens)))]


def lane_input_states(blk, name):
    """Mamba-3: a sequence started from another one's Input_States (its reports)."""
    x = rand((2, 100, blk.d_model), 6)
    blk.forward(time_slice(x, 0, 30))
    given = [getattr(blk, r) for r in ("theta_last_", "h_last_", "k_last_", "v_last_")]
    st = blk.allocate_state(2)
    st.set_input_states(*given)
    return [("y", raw(blk.forward(time_slice(x, 30, 100), st)))] + state_of(st)


LANES = [lane_forward, lane_batch, lane_decode, lane_split, lane_session, lane_ragged]
LANE_CASES = [(n, lane) for n in BLOCKS for lane in LANES] + [("mamba3", lane_input_states)]


@pytest.mark.parametrize("name,lane", LANE_CASES,
                         ids=[f"{n}-{lane.__name__[5:]}" for n, lane in LANE_CASES])
def test_identity_lane(be, name, lane):
    got = lane(make(name, backend="cuda"), name)
    assert_same(got, lane(make(name, backend="cpu"), name), f"{name} {lane.__name__}")


@pytest.mark.parametrize("lane", [lane_forward, lane_batch, lane_split, lane_ragged],
                         ids=lambda lane: lane.__name__[5:])
def test_mamba3_rows_in_groups(be, lane, monkeypatch):
    """Mamba-3's chunk states taken a group of rows at a time (S_GROUP bounds their
    memory; at the lanes' sizes one group holds every row): here every row a group
    of its own, still the C reference's bits."""
    monkeypatch.setattr(_cuda_ssd, "S_GROUP", 1)
    got = lane(make("mamba3", backend="cuda"), "mamba3")
    assert_same(got, lane(make("mamba3", backend="cpu"), "mamba3"), lane.__name__)


@pytest.mark.parametrize("lane", [lane_forward, lane_split, lane_ragged],
                         ids=lambda lane: lane.__name__[5:])
def test_mamba3_fast_rows_in_groups(be, lane, monkeypatch):
    """Fast Mamba-3's state kernel takes the rows a group at a time too: every row a
    group of its own gives the bits of one group (each block walks its own row's
    chunks, whatever the group), and so does each state split between two blocks
    (the kernel for rows too few to fill the device) against whole states."""
    monkeypatch.setattr(_cuda_ssd.SsdMixin, "m3_state_parts", lambda self, rows: 1)
    one = lane(make("mamba3", backend="cuda", numeric_mode="fast"), "mamba3")
    monkeypatch.setattr(_cuda_ssd.SsdMixin, "m3_state_parts", lambda self, rows: 2)
    monkeypatch.setattr(_cuda_ssd, "S_GROUP", 1)
    got = lane(make("mamba3", backend="cuda", numeric_mode="fast"), "mamba3")
    assert_same(got, one, lane.__name__)


@pytest.mark.parametrize("name", list(_cuda_ssd.SMEM))
def test_ssd_smem_bound_whoever_looks_first(be, name):
    """A chunk kernel that launches with more than 48 KiB of dynamic shared memory
    gets its bound from the first lookup, whichever caller makes it (the backward
    looks mb_m2_y_k up on its own); the emulated driver refuses a launch over the
    bound, as the real one does."""
    fresh = emu.backend()
    fresh._kernels(name)
    assert fresh.cu.smem_bound.get(name, 0) >= _cuda_ssd.SMEM[name]


@pytest.mark.parametrize("mode", ["identical", "fast"])
def test_in_proj_side_stream(be, mode, monkeypatch):
    """Mamba-3's in_proj in three blocks: the second block's GEMM runs on a second
    stream that first waits for the call's stream (the norm), and the call's stream
    waits for it before anything after the projections; the C reference's bits."""
    gpu = make("mamba3", backend="cuda", numeric_mode=mode)
    x = rand((2, BLOCKS["mamba3"]["length"], gpu.d_model), 41)
    log, gemm, wait, launch = [], type(be).gemm, type(be)._wait, type(be)._launch
    monkeypatch.setattr(type(be), "gemm", lambda self, s, *a, **k: log.append(
        ("gemm", int(s))) or gemm(self, s, *a, **k))
    monkeypatch.setattr(type(be), "_wait", lambda self, w, p: log.append(
        ("wait", int(w), int(p))) or wait(self, w, p))
    monkeypatch.setattr(type(be), "_launch", lambda self, s, n, *a, **k: log.append(
        (n, int(s))) or launch(self, s, n, *a, **k))
    got = host(gpu.forward(be.copy(x)))
    s = int(be.stream().cu)
    side = [e[1] for e in log if e[0] == "gemm" and e[1] != s]
    assert len(side) == 1, log
    k = log.index(("gemm", side[0]))
    assert ("wait", side[0], s) in log[:k], "the side stream does not wait for the norm"
    join = log.index(("wait", s, side[0]))
    assert join > k and [e for e in log[k + 1:join] if e[0] == "gemm"] == [("gemm", s)]
    assert all(e[1] == s for e in log[join:] if len(e) == 2), "work on the side after the join"
    if mode == "identical":
        assert got == raw(make("mamba3", backend="cpu").forward(x))


def test_side_stream_per_thread(be):
    """Each thread gets a side stream of its own, destroyed when the thread's data
    goes (its queued work still runs)."""
    gpu = make("mamba3", backend="cuda")
    x = be.copy(rand((2, BLOCKS["mamba3"]["length"], gpu.d_model), 42))
    sides, want = [], host(gpu.forward(x))

    def call():
        assert host(gpu.forward(x)) == want
        sides.append(int(be._guard.side.cu))
    for _ in range(2):
        t = threading.Thread(target=call)
        t.start()
        t.join()
    gc.collect()
    assert len(set(sides)) == 2 and int(be._guard.side.cu) not in sides
    assert set(sides) <= set(be.cu.destroyed_streams)


@pytest.mark.parametrize("mode", ["identical", "fast"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_early_front(be, name, mode, monkeypatch):
    """A stateless prefill of device x queues its front (norm and in_proj) before the
    host sets up the rest of the call, and the forward goes on from it: the bits and
    the kernels (none run twice) of a forward that makes its own front (identical
    mode: the C reference's bits). An error between the two returns the front's
    scratch to the pool, and the input check's read-back words to the backend."""
    gpu = make(name, backend="cuda", numeric_mode=mode)
    x = rand((2, BLOCKS[name]["length"], gpu.d_model), 31)
    start, taken = type(be).early_front, []

    def spy(self, *a):
        taken.append(start(self, *a))
        return taken[-1]
    names, launch = [], type(be)._launch
    monkeypatch.setattr(type(be), "_launch", lambda self, s, n, *a, **k: names.append(n) or
                        launch(self, s, n, *a, **k))
    monkeypatch.setattr(type(be), "early_front", spy)
    xd = be.copy(x)
    names.clear()
    got = host(gpu.forward(xd))
    early_names = sorted(names)
    assert len(taken) == 1 and taken[0] is not None and taken[0].front is None, "not taken"
    monkeypatch.setattr(type(be), "early_front", lambda self, *a: None)
    names.clear()
    assert got == host(gpu.forward(xd))
    assert early_names == sorted(names), "the early front changed the kernels launched"
    if mode == "identical":
        assert got == raw(make(name, backend="cpu").forward(x))
    monkeypatch.setattr(type(be), "early_front", spy)
    xd = be.copy(x)

    def big():  # live device allocations past the check's 512-byte read-back words
        return sorted(a for a, buf in be.cu.mem.items() if len(buf) > 4096)
    before, slots = big(), len(be._readbacks)

    def failing(self, shape, like=None):
        raise MemoryError("no memory for y")
    monkeypatch.setattr(type(be), "empty", failing)
    with pytest.raises(MemoryError, match="no memory for y"):
        gpu.forward(xd)
    be._sync(be.stream())  # the stream-ordered frees
    assert taken[-1] is not None and big() == before
    assert len(be._readbacks) == slots, "the input check's read-back words were not returned"


@pytest.mark.parametrize("name", list(BLOCKS))
def test_profile_digest(be, name):
    assert run_digest(name, "cuda") == DIGESTS[name]


# ------------------------------------------------------------------ backward
# test_backward_gpu.py's lanes, collected here too, where `be` is the emulated backend:
# lengths below, on and past each block's backward chunk (Mamba-1 32, Mamba-2 256,
# Mamba-3 64) and several chunks, batches of 1 and 3, a repeated call; B * L past one
# 8192-token fold leaf
from test_backward_gpu import (test_backward_equals_cpu, test_backward_fast_mode,  # noqa: E402,F401
                               test_backward_folds_past_one_leaf,
                               test_vjp_equals_forward_and_backward)


@pytest.mark.parametrize("name", list(GRAD_BLOCKS))
def test_backward_device_arrays(be, name):
    """Device x and grad_output give device gradients with the CPU's bits."""
    dm = GRAD_BLOCKS[name]["d_model"]
    cpu, gpu = _pair(name, dm, seed=5)
    x, dy = _inputs((2, 33, dm), 21)
    got = gpu.backward(be.copy(x), be.copy(dy))
    assert all(g.device == "cuda" for g in got.values())
    want = cpu.backward(x, dy)
    assert_same([(k, host(got[k])) for k in want], [(k, raw(v)) for k, v in want.items()],
                 f"{name} device arrays")


# ------------------------------------------------------------------ device arrays
@pytest.mark.parametrize("name", list(BLOCKS))
def test_device_state_and_session(be, name):
    """Device x and state: a prefill, then session steps on device inputs across a
    chunk boundary; outputs, reports after every call and state are the C
    reference's."""
    P, T = BLOCKS[name]["decode"]
    cpu, gpu = make(name, backend="cpu"), make(name, backend="cuda")
    x = rand((2, T, cpu.d_model), 11)
    st_c = cpu.allocate_state(2)
    st_d = type(st_c)(*[be.copy(p) for p in st_c.pieces()])
    y = gpu.forward(be.copy(time_slice(x, 0, P)), st_d)
    assert y.device == "cuda"
    got = [("prefill", host(y))] + [(r, host(getattr(gpu, r))) for r in REPORTS[name]]
    want = [("prefill", raw(cpu.forward(time_slice(x, 0, P), st_c)))]
    want += [(r, raw(getattr(cpu, r))) for r in REPORTS[name]]
    with gpu.decode_session(st_d) as sess:
        for t in range(P, T):
            xt = time_slice(x, t, t + 1)
            got.append((f"step {t}", host(sess.step(be.copy(xt)))))
            want.append((f"step {t}", raw(cpu.step(xt, st_c))))
            got += [(f"{r} {t}", host(getattr(gpu, r))) for r in REPORTS[name]]
            want += [(f"{r} {t}", raw(getattr(cpu, r))) for r in REPORTS[name]]
    assert_same(got + state_of(st_d), want + state_of(st_c), f"{name} on device")


def test_programmatic_kernels_wait():
    """The kernels a session launches as programmatic dependents (_cuda.WAITS) are
    those whose source passes MB_GRID_WAIT() (the emulated driver checks that every
    thread of such a launch does)."""
    def bodies(src, pattern):
        for head in re.finditer(pattern, src):
            i, depth = src.index("{", head.end()), 0
            for j in range(i, len(src)):
                depth += {"{": 1, "}": -1}.get(src[j], 0)
                if not depth:
                    yield head.group(1), src[i:j]
                    break

    src = "".join(open(p).read() for p in glob.glob(os.path.join(emu.KERNELS, "*.cu")))
    waits = {n for n, body in bodies(src, r"MB_KERNEL[^;{]*?\b(mb_\w+_k)\s*\(")
             if "MB_GRID_WAIT()" in body}
    assert waits == set(_cuda.WAITS)


def test_dependent_launch_checks_fail(be, monkeypatch):
    """The emulated driver's checks of a programmatic dependent launch can fail: a
    kernel that does not wait (mb_first_nonfinite_k, here taken for one of WAITS) is
    refused when its graph runs, and one that follows a memset at its launch."""
    monkeypatch.setattr(_cuda, "WAITS", _cuda.WAITS | {"mb_first_nonfinite_k"})
    cu, a, first = be.cu, be.new((64,)), be.new((2,))

    def capture(body):
        with be.capturing() as cs:
            mode = cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            be._ck(cu.cuStreamBeginCapture(cs, mode), "cuStreamBeginCapture")
            try:
                body(cs)
            finally:
                graph = cu.cuStreamEndCapture(cs)[1]
        return be._ck(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate"), cs

    def twice(cs):
        for _ in range(2):
            be._launch(cs, "mb_first_nonfinite_k", (1,), 32, a.size, a, first.ptr)
    exe, cs = capture(twice)
    with pytest.raises(_cuda.CudaError, match=r"0 of its 32 threads passed MB_GRID_WAIT"):
        be._ck(cu.cuGraphLaunch(exe, cs), "cuGraphLaunch")

    def after_memset(cs):
        be._launch(cs, "mb_first_nonfinite_k", (1,), 32, a.size, a, first.ptr)
        be._fill32(cs, first.ptr, 0, 4)
        be._chain = int(cs)  # as if the memset had not cut the chain
        be._launch(cs, "mb_first_nonfinite_k", (1,), 32, a.size, a, first.ptr)
    with pytest.raises(_cuda.CudaError, match="programmatic dependent of no kernel"):
        capture(after_memset)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_session_launches_dependents(be, name):
    """A session's graph launches its kernels after the first as programmatic
    dependents (which the emulated driver checks) when it has at most
    DEPENDENT_ROWS rows, and plainly past that."""
    blk = make(name, backend="cuda")
    for B, chained in ((2, True), (_cuda_session.DEPENDENT_ROWS + 1, False)):
        before = be.cu.dependents
        with blk.decode_session(blk.allocate_state(B)) as sess:
            sess.step(rand((B, 1, blk.d_model), 3))
        assert (be.cu.dependents > before) == chained


@pytest.mark.parametrize("name,B", SSD_SESSIONS)
def test_ssd_session_graph(be, name, B):
    ssd_session_graph(be, name, B)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_frees_during_capture(be, name, monkeypatch):
    frees_during_capture(be, name, monkeypatch)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_refusals_after_launch(be, name):
    refusals_after_launch(be, name)


@pytest.mark.parametrize("mode", ["identical", "fast"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_input_check_in_norm(be, name, mode, monkeypatch):
    input_check_in_norm(be, name, mode, monkeypatch)


def test_m2_session_folds_twice(be):
    """A Mamba-2 session whose chunk fills twice, two rows: each fold leaves the
    buffers zeroed by the row's last output block, found by a per-row counter that
    must be back at 0 for the second fold (a state loaded mid-session brings the
    count to 254 again): the C reference's bits."""
    cpu, gpu = make("mamba2", backend="cpu"), make("mamba2", backend="cuda")
    x = rand((2, 514, cpu.d_model), 7)
    st_c, st_g = cpu.allocate_state(2), gpu.allocate_state(2)
    cpu.forward(time_slice(x, 0, 254), st_c)
    gpu.forward(time_slice(x, 0, 254), st_g)
    got, want = [], []
    with gpu.decode_session(st_g) as sess:
        for lo, hi in ((254, 258), (510, 514)):
            if lo == 510:  # the caller's state after 510 tokens, loaded
                sess.sync_state()
                st_c = cpu.allocate_state(2)
                cpu.forward(time_slice(x, 0, 510), st_c)
                for n, q in zip(st_c._PIECES, st_c.pieces()):
                    memoryview(getattr(st_g, n)).cast("B")[:] = memoryview(q).cast("B")
                for n in st_c._SCALARS:
                    setattr(st_g, n, getattr(st_c, n))
                sess.load_state()
            for t in range(lo, hi):
                xt = time_slice(x, t, t + 1)
                got.append((f"step {t}", host(sess.step(be.copy(xt)))))
                want.append((f"step {t}", raw(cpu.step(xt, st_c))))
    assert_same(got + state_of(st_g), want + state_of(st_c), "mamba2 session, two folds")


def test_m3_session_input_states(be):
    """A Mamba-3 session whose first step consumes Input_States (its own graph, the
    step's device x checked before the launch): the C reference's bits."""
    cpu, gpu = make("mamba3", backend="cpu"), make("mamba3", backend="cuda")
    x = rand((2, 40, cpu.d_model), 6)
    cpu.forward(time_slice(x, 0, 30))
    given = [getattr(cpu, r) for r in ("theta_last_", "h_last_", "k_last_", "v_last_")]
    st_c, st_g = cpu.allocate_state(2), gpu.allocate_state(2)
    st_c.set_input_states(*given)
    st_g.set_input_states(*given)
    got, want = [], []
    with gpu.decode_session(st_g) as sess:
        bad = poisoned(time_slice(x, 30, 31), 3)
        with pytest.raises(ValueError, match="DecodeSession.step: x holds a non-finite value "
                                             r"\(NaN or inf\) at flat index 3$"):
            sess.step(be.copy(bad))
        for t in range(30, 36):
            xt = time_slice(x, t, t + 1)
            got.append((f"step {t}", host(sess.step(be.copy(xt)))))
            want.append((f"step {t}", raw(cpu.step(xt, st_c))))
            got += [(f"{r} {t}", host(getattr(gpu, r))) for r in REPORTS["mamba3"]]
            want += [(f"{r} {t}", raw(getattr(cpu, r))) for r in REPORTS["mamba3"]]
    assert_same(got + state_of(st_g), want + state_of(st_c), "mamba3 Input_States session")


def test_device_refusals_and_strided_input(be):
    """A non-finite device input is found on the device, by the forward and by a
    Mamba-1 session's graph (NaN outputs, state kept, the step named); a strided
    device input is gathered."""
    D = BLOCKS["mamba1"]["d_model"]
    cpu, gpu = make("mamba1", backend="cpu"), make("mamba1", backend="cuda")
    x = rand((2, 6, D), 30)
    bad = rand((2, 1, D), 31)
    memoryview(bad).cast("B").cast("f")[D + 5] = math.inf
    with pytest.raises(ValueError, match=f"flat index {D + 5}$"):
        gpu.forward(be.copy(bad))
    st_c, st_g = cpu.allocate_state(2), gpu.allocate_state(2)
    cpu.forward(time_slice(x, 0, 2), st_c)
    gpu.forward(time_slice(x, 0, 2), st_g)
    with gpu.decode_session(st_g) as sess:
        y_bad = sess.step(be.copy(bad))
        with pytest.raises(ValueError, match=f"x of step 1 of this session held a non-finite "
                                             f"value .* flat index {D + 5};"):
            sess.sync_state()
        assert all(math.isnan(v) for v in memoryview(host(y_bad)).cast("f"))
        for t in range(2, 6):
            xt = time_slice(x, t, t + 1)
            assert host(sess.step(be.copy(xt))) == raw(cpu.step(xt, st_c)), t
    assert state_of(st_g) == state_of(st_c)

    class Transposed:  # x as a (B, L, D) view of a device (L, B, D) array
        def __init__(self, dev):
            self.dev = dev
            self.__cuda_array_interface__ = {
                "shape": (2, 6, D), "typestr": "<f4", "data": (dev.ptr, False), "version": 3,
                "strides": (4 * D, 8 * D, 4)}
    xt = b"".join(raw(time_slice(rows(x, [b]), t, t + 1)) for t in range(6) for b in range(2))
    xt = mamba.asarray(memoryview(xt).cast("f"), (6, 2, D))
    assert host(gpu.forward(Transposed(be.copy(xt)))) == raw(cpu.forward(x))


@pytest.mark.parametrize("name", list(BLOCKS))
@pytest.mark.parametrize("B", [1, 3, 12, 40])
def test_session_guard_in_or_before_the_norm(be, monkeypatch, name, B):
    """A session step's input check runs inside in_proj's GEMV when that normalizes
    the step's rows itself, in each block (B 1, 3); inside the block norm when the
    norm is one block taking the input in one round of loads (B 12), else as its own
    kernel just before it (B 40: two norm blocks); either way a bad device x is
    refused with its index and the next step has the C reference's bits."""
    D = BLOCKS[name]["d_model"]
    cpu, gpu = make(name, backend="cpu"), make(name, backend="cuda")
    x = rand((B, 3, D), 40)
    bad = rand((B, 1, D), 41)
    idx = B * D - 3
    memoryview(bad).cast("B").cast("f")[idx] = math.nan
    st_c, st_g = cpu.allocate_state(B), gpu.allocate_state(B)
    cpu.forward(time_slice(x, 0, 2), st_c)
    gpu.forward(time_slice(x, 0, 2), st_g)
    names, launch = [], type(be)._launch
    monkeypatch.setattr(type(be), "_launch", lambda self, s, name, *a, **k: names.append(name)
                        or launch(self, s, name, *a, **k))
    with gpu.decode_session(st_g) as sess:
        if B <= 3:
            assert names[0] == "mb_gemv_k" and not {"mb_rms_k", "mb_step_guard_k"} & set(names)
        else:
            want = ["mb_rms_k", "mb_gemv_k"] if B == 12 else ["mb_step_guard_k", "mb_rms_k"]
            assert names[:2] == want, names[:2]
        sess.step(be.copy(bad))
        with pytest.raises(ValueError, match=f"held a non-finite value .* flat index {idx};"):
            sess.sync_state()
        xt = time_slice(x, 2, 3)
        assert host(sess.step(be.copy(xt))) == raw(cpu.step(xt, st_c))
    assert state_of(st_g) == state_of(st_c)


@pytest.mark.parametrize("M,N,K", [(2, 20, 8193), (2, 20, 3 * 8192 + 5), (20, 20, 2 * 8192),
                                   (130, 20, 8193), (129, 257, 13), (65, 50, 700),
                                   (9, 40, 129), (65, 161, 9), (70, 130, 21), (65, 161, 8200),
                                   (65, 130, 8200)])
def test_gemm(be, M, N, K):
    """The GEMV (M <= 64) and tiled paths (wide and narrow), their tile edges and dot
    v1's leaves."""
    X, W = rand((M, K), M), rand((N, K), N)
    assert raw(be._gemm(X, W, M, N, K)) == raw(_core._gemm(X, W, M, N, K))


@pytest.mark.parametrize("M,N,K", [(129, 257, 13), (300, 520, 9)])
def test_gemm_residual(be, monkeypatch, M, N, K):
    """The wide tiled GEMM with the residual (whole tiles add it in a pass of their
    own, edge tiles per output): one float32 addition to the C reference's product."""
    X, W, R = rand((M, K), M), rand((N, K), N), rand((M, N), K)
    names, launch = [], type(be)._launch
    monkeypatch.setattr(type(be), "_launch", lambda self, s, n, *a, **k: names.append(n) or
                        launch(self, s, n, *a, **k))
    monkeypatch.setattr(_cuda, "TAIL_MAX", 0.0)  # every tile a wide one
    want = array.array("f", (r + y for r, y in zip(floats(R), floats(_core._gemm(X, W, M, N, K)))))
    assert raw(be._gemm(X, W, M, N, K, res=R)) == want.tobytes()
    assert "mb_gemm_res_k" in names, names


def _fold_on_device(be, fold, a, b, P):
    """fold(s, sc, a, b, out) (a g_colfold or g_fold_flat) on the host floats a and b
    (None: no b) uploaded; the P results back on the host."""
    be._enter()
    s = be.stream()
    out = _core.empty((P,))
    with _cuda._Scratch(be, s) as sc:
        ad, bd = (be._on_device(sc, mamba.asarray(array.array("f", x), (len(x),)))
                  if x is not None else 0 for x in (a, b))
        od = sc(P)
        fold(s.cu, sc, ad, bd, od)
        be._finish(s, [(out, od)])
    return raw(out)


def _dot_v1(terms):
    """dot v1 of the (a, b) pairs by the C reference's GEMM (a plain sum is fma(a, 1,
    .); a skipped term is (0, 0), which leaves a chain seeded with +0 as it is)."""
    K = max(1, len(terms))
    x = array.array("f", [t[0] for t in terms] or [0.0])
    w = array.array("f", [t[1] for t in terms] or [0.0])
    return raw(_core._gemm(mamba.asarray(x, (1, K)), mamba.asarray(w, (1, K)), 1, 1, K))


# (B, L, n, lda, ldb or None, shift): leaves cut inside rows, rows shorter than a
# stage, shifted taps (masked terms), n not a multiple of 32, plain sums
COLFOLDS = [(3, 5000, 40, 45, 41, 2), (2, 20, 33, 33, None, 0), (1, 8200, 5, 7, 9, 3),
            (4, 3, 3, 3, 3, 1), (2, 4500, 2, 2, None, 0)]
# (rows, cols, lda, ldb or None, G, ga, gb): a per-head vector (cols 1), g_D's rows
# of whole float4s (16-byte copies), runs of 6 (leaves and stages cut inside rows),
# rows packed at their width
FLATFOLDS = [(9000, 1, 37, 37, 35, 1, 1), (300, 64, 200, 204, 3, 64, 68),
             (3000, 6, 10, 7, 2, 6, 6), (5000, 4, 4, None, 1, 0, 0), (7, 5, 9, None, 33, 1, 0)]


@pytest.mark.parametrize("grid", [None, 1, 3])
@pytest.mark.parametrize("case", COLFOLDS + FLATFOLDS, ids=str)
def test_token_folds(be, case, grid, monkeypatch):
    """mb_colfold_k / mb_fold_flat_k (with mb_dot_fold_k past a leaf) against dot v1,
    whatever the grid (a warp walks several (column group, leaf) items)."""
    if grid is not None:
        monkeypatch.setattr(be, "_fold_grid", lambda n, P: grid)
    if len(case) == 6:
        B, L, n, lda, ldb, shift = case
        K = B * L
        a = floats(rand((K * lda,), 60))
        b = floats(rand((K * ldb,), 61)) if ldb else None
        got = _fold_on_device(be, lambda s, sc, ad, bd, od: be.g_colfold(
            s, sc, B, L, n, ad, lda, od, 1, bd, ldb or 0, shift), a, b, n)
        want = b"".join(_dot_v1([(a[k * lda + c], b[(k - shift) * ldb + c] if b else 1.0)
                                 if k % L >= shift else (0.0, 0.0) for k in range(K)])
                        for c in range(n))
    else:
        rows, cols, lda, ldb, G, ga, gb = case
        a = floats(rand(((G - 1) * ga + rows * lda,), 62))
        b = floats(rand(((G - 1) * gb + rows * ldb,), 63)) if ldb else None
        got = _fold_on_device(be, lambda s, sc, ad, bd, od: be.g_fold_flat(
            s, sc, rows, cols, ad, lda, od, bd, ldb or 0, G, ga, gb), a, b, G)
        want = b"".join(_dot_v1([(a[g * ga + r * lda + c], b[g * gb + r * ldb + c] if b else 1.0)
                                 for r in range(rows) for c in range(cols)]) for g in range(G))
    assert got == want


@pytest.mark.parametrize("M,n", NORM_SHAPES)
def test_rmsnorm_rows(be, M, n):
    rmsnorm_rows(be, M, n)


@pytest.mark.parametrize("M,n", FAST_NORM_SHAPES)
def test_fast_rmsnorm_rows(be, M, n):
    fast_rmsnorm_rows(be, M, n)


@pytest.mark.parametrize("M,N,K", NORM_GEMVS)
def test_norm_gemv(be, M, N, K):
    norm_gemv(be, M, N, K)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_fast_mode_is_close(be, name):
    """numeric_mode="fast" (its own kernels: shuffle reductions, hardware exp) stays
    within fast mode's error bound of the identical results, for a prefill of a few
    tokens (the split-K GEMV), a prefill that continues it (a chunk's rows before r0),
    decode steps and a prefill past the GEMV's rows (the TF32 GEMM on the emulated
    tensor cores) and past a Mamba-2 chunk (its fast fold's and output's stages over
    256 rows). The continuations seal Mamba-3 chunks that began in the state (the
    second one's rows stored by the first), each leaves its reports, and the steps
    read the state they leave."""
    cpu = make(name, backend="cpu")
    fast = make(name, backend="cuda", numeric_mode="fast")
    x = rand((2, 144, cpu.d_model), 12)
    st_c, st_f = cpu.allocate_state(2), fast.allocate_state(2)
    pairs = []
    for a, b in ((0, 4), (4, 82), (82, 142)):  # each continues the last chunk
        pairs.append((cpu.forward(time_slice(x, a, b), st_c),
                      fast.forward(time_slice(x, a, b), st_f)))
        pairs += [(getattr(cpu, r), getattr(fast, r)) for r in REPORTS[name]]
    long = rand((2, 300, cpu.d_model), 13)
    pairs.append((cpu.forward(long), fast.forward(long)))
    pairs.append((cpu.forward(long, lengths=[300, 37]), fast.forward(long, lengths=[300, 37])))
    pairs += [(cpu.step(time_slice(x, t, t + 1), st_c), fast.step(time_slice(x, t, t + 1), st_f))
              for t in (142, 143)]
    for want, got in pairs:
        err = rel_l2(floats(got), floats(want))
        assert err <= FAST_BOUND, f"{name} fast mode: relative L2 error {err:.2e}"


@pytest.mark.parametrize("name", list(BLOCKS))
def test_fast_mode_without_tensor_cores(be, name, monkeypatch):
    """HIP's fast mode: without tensor cores the fast projections take the identical
    GEMM and the SSD its identical kernels, so the backward gives the C reference's
    bits and the forward stays within fast mode's bound (the two lanes above)."""
    monkeypatch.setattr(be, "tensor_cores", False)
    test_backward_fast_mode(be, name)
    test_fast_mode_is_close(be, name)


def test_session_guard_stays_on_its_thread(be):
    """A capture's pending step check (step_guard) belongs to the capturing thread: a
    norm another thread launches meanwhile neither takes it nor runs the check."""
    import threading
    args = (4, 0, 0, 0)
    assert be.step_guard(args) is None
    seen = []
    t = threading.Thread(target=lambda: seen.append(be._step_check(0, 1, 128)))
    t.start()
    t.join()
    assert seen == [(0, 0, 0, 0)]
    assert be.step_guard(None) == args


@pytest.mark.parametrize("mode,B", [("identical", 65), ("fast", 9)])
def test_step_conv_after_a_wider_projection(be, mode, B):
    """A one-token call's conv step runs in in_proj's GEMV epilogue only on the GEMV
    paths (64 rows identical, 8 fast); past them the projection runs whole and the
    conv step kernel after it: the C reference's bits (identical), fast mode's
    bound (fast)."""
    cpu, gpu = make("mamba1", backend="cpu"), make("mamba1", backend="cuda", numeric_mode=mode)
    x = rand((B, 3, cpu.d_model), 50)
    st_c, st_g = cpu.allocate_state(B), gpu.allocate_state(B)
    cpu.forward(time_slice(x, 0, 2), st_c)
    gpu.forward(time_slice(x, 0, 2), st_g)
    want = cpu.step(time_slice(x, 2, 3), st_c)
    got = gpu.step(time_slice(x, 2, 3), st_g)
    if mode == "identical":
        assert raw(got) == raw(want) and state_of(st_g) == state_of(st_c)
        return
    err = rel_l2(floats(got), floats(want))
    assert err <= FAST_BOUND, f"fast step: relative L2 error {err:.2e}"


# ------------------------------------------------------------------ the checker itself
def test_sabotaged_kernel_is_caught(be, monkeypatch):
    """conv.cu built with the reference's MB_SABOTAGE_CONV_REVERSED (the conv taps
    reversed, one expression): the emulated Mamba-1 forward no longer equals the C
    reference, where the kernels as written do."""
    bad = emu.backend(("MB_SABOTAGE_CONV_REVERSED",))
    want = lane_forward(make("mamba1", backend="cpu"), "mamba1")
    assert lane_forward(make("mamba1", backend="cuda"), "mamba1") == want
    monkeypatch.setitem(_backends._cache, "cuda", (bad, bad.description))
    assert lane_forward(make("mamba1", backend="cuda"), "mamba1") != want


def test_copies_land_at_their_wait(be):
    """The emulated cp.async lands a copy only at a wait that covers its group: built
    to leave one group more in flight at every wait, the GEMV's ring (K over several
    stages) reads stages not yet landed and misses the C reference's bits."""
    M, N, K = 3, 40, 1031
    X, W = rand((M, K), 70), rand((N, K), 71)
    want = raw(_core._gemm(X, W, M, N, K))
    assert raw(be._gemm(X, W, M, N, K)) == want
    assert raw(emu.backend(("MB_EMU_WAIT_SLACK=1",))._gemm(X, W, M, N, K)) != want


def test_scan_exp_ranges(be):
    scan_exp_ranges(be)


def test_angle_walks(be):
    angle_walks(be)


def test_gemm_tails(be, monkeypatch):
    gemm_tails(be, monkeypatch)


def test_m2_head_groups(be):
    m2_head_groups(be)


@pytest.mark.parametrize("name", ["mamba2", "mamba3"])
def test_ssd_fold_chain(be, name, monkeypatch):
    ssd_fold_chain(be, name, monkeypatch)


def test_math_matches_reference(be):
    """math.cu, over every 1048573rd float32 bit pattern and the special points (the
    host build takes numerics.h's C forms; the GPU test covers the device's own)."""
    math_matches_reference(be, 1048573)


def test_every_kernel_ran(be, request):
    """Every kernel in the library was launched by this module's tests, which run
    before this one."""
    ran = [i for i in request.session.items if i.module is request.module]
    if len(ran) < len(request.node.parent.collect()):
        pytest.skip("only part of this module ran")
    assert set(be.cu.kernels) - be.cu.launched == set(), "kernels no test here launched"


def test_state_pass_over_many_chunks(be):
    """Mamba-3's state passes over more chunks than one run of loads (9 of 64 tokens
    in a row: SSD_CHAIN_RUN is 8), forward with a state and backward: the C
    reference's bits."""
    cpu, gpu = make("mamba3", backend="cpu"), make("mamba3", backend="cuda")
    x = rand((1, 9 * 64 + 5, cpu.d_model), 90)
    st_c, st_g = cpu.allocate_state(1), gpu.allocate_state(1)
    assert raw(gpu.forward(x, st_g)) == raw(cpu.forward(x, st_c))
    assert state_of(st_g) == state_of(st_c)
    dy = rand((1, 9 * 64 + 5, cpu.d_model), 91)
    got, want = gpu.backward(x, dy), cpu.backward(x, dy)
    assert all(raw(got[k]) == raw(want[k]) for k in want)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_misaligned_device_state_is_refused(be, name):
    """A device state piece that does not start on a 16-byte boundary (a view one float
    into a buffer) is refused, naming it, before anything runs: the kernels read state
    four floats at a time."""
    class View:  # a device array one float into its buffer
        def __init__(self, dev, shape):
            self.dev = dev
            self.__cuda_array_interface__ = {"shape": shape, "typestr": "<f4", "version": 3,
                                             "data": (dev.ptr + 4, False), "strides": None}
    gpu = make(name, backend="cuda")
    st = gpu.allocate_state(1)
    first = st._PIECES[0]
    shape = tuple(getattr(st, first).shape)
    buf = be.copy(mamba.asarray(array.array("f", [0.0] * (1 + math.prod(shape))),
                                (1 + math.prod(shape),)))
    pieces = [View(buf, shape) if n == first else be.copy(p)
              for n, p in zip(st._PIECES, st.pieces())]
    x = be.copy(rand((1, 1, gpu.d_model), 80))
    with pytest.raises(ValueError, match=f"state.{first} on the device must start on a "
                                         "16-byte boundary"):
        gpu.forward(x, type(st)(*pieces))
    assert floats(host(buf)) == [0.0] * (1 + math.prod(shape))
