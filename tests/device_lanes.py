"""Scenarios every CUDA-driven backend must pass with the C reference's bits, written
once and collected twice: by test_gpu.py on a real GPU and by
test_emulated_kernels.py on the host emulation of the kernels. `be` is the backend
registered as "cuda" while they run. Numpy-free."""
import array
import math
import struct

import pytest

import mamba
from mamba import _backends, _core, _cuda, _cuda_ssd
from _util import FAST_BOUND, floats, rand, raw, rel_l2, time_slice
from blocks import BLOCKS, make

REPORTS = {"mamba1": (), "mamba2": ("h_last_",),
           "mamba3": ("h_last_", "k_last_", "v_last_", "theta_last_")}


def host(a):
    """The bytes of a host or device Array."""
    if a.device == "cpu":
        return raw(a)
    h = _core.empty(a.shape)
    _backends.owner_of(a).copy_into(h, a)
    return raw(h)


def state_of(st):
    return [(f"state.{n}", host(p)) for n, p in zip(st._PIECES, st.pieces())] + [
        (f"state.{n}", repr(getattr(st, n)).encode()) for n in st._SCALARS]


def reports_of(blk, name, label):
    return [(f"{r} {label}", host(getattr(blk, r))) for r in REPORTS[name]]


def assert_same(got, want, what):
    """got, want: lists of (label, bytes); a failure names the first differing value."""
    assert [k for k, _ in got] == [k for k, _ in want], what
    for (k, g), (_, w) in zip(got, want):
        if g == w:
            continue
        if len(g) != len(w) or len(g) % 4:
            pytest.fail(f"{what}: {k}: this backend {g[:40]!r}, C reference {w[:40]!r}")
        i = next(j for j in range(0, len(w), 4) if g[j:j + 4] != w[j:j + 4])
        gv, wv = memoryview(g[i:i + 4]).cast("f")[0], memoryview(w[i:i + 4]).cast("f")[0]
        pytest.fail(f"{what}: {k} differs at flat index {i // 4}: this backend {gv!r} "
                    f"(0x{g[i:i + 4][::-1].hex()}), C reference {wv!r} "
                    f"(0x{w[i:i + 4][::-1].hex()})")


def poisoned(x, i):
    """A copy of x with a NaN at flat index i."""
    bad = mamba.asarray(memoryview(bytearray(raw(x))).cast("f"), memoryview(x).shape)
    memoryview(bad).cast("B").cast("f")[i] = math.nan
    return bad


# numerics.h's scalar functions (probe.c's vexp and vsilu are the CPU's vector forms)
MATH = [n for n in _core._MATH if not n.startswith("v")]
EXP_LO = -87.33654022216797  # numerics.h MB_EXP_LO, the low end of exp_core's domain


def math_inputs(stride):
    """float32 inputs whose bit patterns are every stride-th of the 2^32, the special
    values, and the points where exp's reduction steps (x = (k - 1/2) ln 2, where
    its floor changes) with their neighbours."""
    bits = array.array("I", range(0, 1 << 32, stride))
    bits.extend([0, 0x80000000, 1, 0x80000001, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000,
                 0x7FC00000, 0x00800000, 0x807FFFFF])
    for k in range(-130, 131):
        b = struct.unpack("<I", struct.pack("<f", (k - 0.5) * math.log(2.0)))[0]
        bits.extend([b - 1, b, b + 1])
    return array.array("f", bits.tobytes())


def math_matches_reference(be, stride):
    """Each scalar function of numerics.h gives the C reference's bits on the device
    (probe.c against math.cu; any NaN equals any NaN) over math_inputs(stride); exp's
    core over the part of them in its domain [MB_EXP_LO, 0]."""
    xs = math_inputs(stride)
    core = array.array("f", (v for v in xs if EXP_LO <= v <= 0.0))
    for name in MATH:
        x = core if name == "exp_core" else xs
        got = raw(be._math(name, mamba.asarray(x)))
        want = raw(_core._math(name, x))
        if got == want:
            continue
        g, w = array.array("f", got), array.array("f", want)
        bad = [i for i in range(len(x)) if got[4 * i:4 * i + 4] != want[4 * i:4 * i + 4]
               and not (math.isnan(g[i]) and math.isnan(w[i]))]
        assert not bad, (f"{name}({x[bad[0]]!r}): this backend {g[bad[0]]!r}, C reference "
                         f"{w[bad[0]]!r} ({len(bad)} inputs differ)")


def gemm_tails(be, monkeypatch):
    """A wide call whose tiles pass its last whole wave by at most half a wave runs
    those tiles as small ones (gemm.cu mb_gemm_tail_k, mb_gemm_tail_res_k) with the
    C reference's bits: a tail that starts inside a tile row and one of whole rows,
    with and without the residual; so do the columns past its last whole tile where
    they fill at most half of one, as a strip of 64 x 32 tiles (mb_gemm_strip_k,
    mb_gemm_strip_res_k). The shapes follow the backend's wave."""
    calls = []  # (kernel, rectangles) of each _gemm_tail
    real = be._gemm_tail
    monkeypatch.setattr(be, "_gemm_tail", lambda *a: calls.append((a[1][0], a[2])) or real(*a))
    _, bm, bn, _, per_sm = _cuda.GEMM_WIDE
    assert (bm, bn) == (128, 128)  # the shapes below are written for this tile
    wave = per_sm * be.sms

    def check(M, N, K):
        del calls[:]
        X, W, R = rand((M, K), 70), rand((N, K), 71), rand((M, N), 72)
        want = _core._gemm(X, W, M, N, K)
        assert raw(be._gemm(X, W, M, N, K)) == raw(want), (M, N, K)
        summed = array.array("f", (r + w for r, w in zip(floats(R), floats(want))))
        assert raw(be._gemm(X, W, M, N, K, res=R)) == summed.tobytes(), (M, N, K, "res")
        return {k: r for k, r in calls}
    cols = next(c for c in range(2, wave + 2) if (wave + 1) % c == 0)
    # wave + 1 tiles: the tail starts inside the last tile row, then at a row's start;
    # K: whole k-tiles of the tail kernels (32 terms, rows 16-byte aligned) and a
    # partial one, or a partial one alone
    for shape in ((128 * ((wave + 1) // cols) - 7, 128 * cols - 9, 76), (128 * (wave + 1) - 3, 200, 13)):
        assert set(check(*shape)) == {"mb_gemm_tail_k", "mb_gemm_tail_res_k"}, shape
    # columns past the last whole tile, at most half of one: a strip beside the wide
    # tiles (with the wave's tail too in the second shape); past half, the wide tiles
    # alone
    got = check(300, 512 + 40, 29)
    assert got["mb_gemm_strip_k"] == got["mb_gemm_strip_res_k"] == [(0, 300, 512, 552)]
    M = 128 * (wave // 6 + 1) - 5  # 6 whole column tiles: 1 to 6 past the wave
    got = check(M, 768 + 64, 33)
    assert got["mb_gemm_strip_k"] == got["mb_gemm_strip_res_k"] == [(0, M, 768, 832)]
    assert got["mb_gemm_tail_k"] and got["mb_gemm_tail_res_k"]
    assert not {"mb_gemm_strip_k", "mb_gemm_strip_res_k"} & set(check(200, 256 + 65, 9))


def m2_head_groups(be):
    """Mamba-2 with more heads than a block of mb_m2_prep_k takes (ssd2.cu: 8), its
    last group partial: a stateful prefill past a chunk boundary, a continuation that
    leaves rows open and the h_last report folding them give the C reference's bits."""
    x = rand((2, 262, 320), 60)
    got = []
    for backend in ("cpu", "cuda"):
        blk = make("mamba2", d_model=320, backend=backend)
        assert blk.d_inner // 64 == 10
        st = blk.allocate_state(2)
        out = [("y", host(blk.forward(time_slice(x, 0, 257), st)))]
        out += [("y, continued", host(blk.forward(time_slice(x, 257, 262), st)))]
        got.append(out + state_of(st) + reports_of(blk, "mamba2", "after"))
    assert_same(got[1], got[0], "mamba2, 10 heads")


def ssd_fold_chain(be, name, monkeypatch):
    """Identical SSD prefills whose chunk folds and state pass run in one kernel
    (mb_m2_fold_chain_k, mb_m3_fold_chain_k: the chain threshold at one), in two
    (the fold kernel, then mb_ssd_chain_k: the threshold past any launch) and, for
    Mamba-3, in one a row (each row a group of its own): rows of several chunks, a
    prefill continued from a state whose first chunk is partly buffered, and a ragged
    batch all give the C reference's bits, each way launching the kernels it names."""
    L, D = BLOCKS[name]["length"], BLOCKS[name]["d_model"]
    x = rand((3, L, D), 61)

    def run(backend):
        blk = make(name, backend=backend)
        st = blk.allocate_state(3)
        out = [("y", host(blk.forward(time_slice(x, 0, L // 2 + 1), st)))]
        out += [("y, continued", host(blk.forward(time_slice(x, L // 2 + 1, L), st)))]
        out += state_of(st) + reports_of(blk, name, "after")
        return out + [("y, ragged", host(blk.forward(x, lengths=[L, 3, L - 5])))]

    want = run("cpu")
    names, launch = [], type(be)._launch
    monkeypatch.setattr(type(be), "_launch", lambda self, s, n, *a, **k: names.append(n) or
                        launch(self, s, n, *a, **k))
    fused = "mb_m2_fold_chain_k" if name == "mamba2" else "mb_m3_fold_chain_k"
    for low, group in ((1, _cuda_ssd.S_GROUP), (1 << 30, _cuda_ssd.S_GROUP), (1, 1)):
        monkeypatch.setattr(_cuda_ssd, "CHAIN_MIN", low)
        monkeypatch.setattr(_cuda_ssd, "S_GROUP", group)
        names.clear()
        what = f"{name}, chain threshold {low}, S_GROUP {group}"
        assert_same(run("cuda"), want, what)
        assert (fused in names, "mb_ssd_chain_k" in names) == (low == 1, low != 1), what


SSD_SESSIONS = [("mamba2", 1), ("mamba2", 3), ("mamba3", 1), ("mamba3", 3)]


def ssd_session_graph(be, name, B):
    """Mamba-2 and Mamba-3 sessions as one graph per step (ssd_step.cu): steps across
    the chunk grid on device and host inputs, the reports after every step, a step
    refused on the device in the middle (NaN outputs, state kept, raised by the next
    call, then on as before), sync_state, and load_state of an edited state (a
    different count of buffered tokens): all the C reference's bits."""
    P, T = BLOCKS[name]["decode"]
    cpu, gpu = make(name, backend="cpu"), make(name, backend="cuda")
    D = cpu.d_model
    x = rand((B, T + 1, D), 40 + B)
    st_c, st_g = cpu.allocate_state(B), gpu.allocate_state(B)
    cpu.forward(time_slice(x, 0, P), st_c)
    gpu.forward(time_slice(x, 0, P), st_g)
    bad_at, load_at = P + 3, T - 4
    got, want = [], []
    with gpu.decode_session(st_g) as sess:
        for t in range(P, T):
            xt = time_slice(x, t, t + 1)
            if t == bad_at:
                y_bad = sess.step(be.copy(poisoned(xt, B * D - 2)))
                assert all(math.isnan(v) for v in memoryview(host(y_bad)).cast("f"))
                with pytest.raises(ValueError, match=f"x of step {t - P + 1} of this session "
                                                     f"held a non-finite value .* index {B * D - 2};"):
                    sess.step(xt)
            if t == load_at:  # the caller's state one token further on, loaded
                sess.sync_state()
                assert_same(state_of(st_g), state_of(st_c), f"{name} synced before token {t}")
                xo = time_slice(x, T, T + 1)
                cpu.step(xo, st_c)
                for n, p in zip(st_c._PIECES, st_c.pieces()):
                    memoryview(getattr(st_g, n)).cast("B")[:] = memoryview(p).cast("B")
                for n in st_c._SCALARS:
                    setattr(st_g, n, getattr(st_c, n))
                sess.load_state()
            y = sess.step(be.copy(xt) if t % 2 else xt)
            got += [(f"step {t}", host(y))] + reports_of(gpu, name, t)
            want += [(f"step {t}", raw(cpu.step(xt, st_c)))] + reports_of(cpu, name, t)
    assert_same(got + state_of(st_g), want + state_of(st_c), f"{name} session B {B}")


def frees_during_capture(be, name, monkeypatch):
    """Device arrays dropped while a session's step is being captured (the garbage
    collector may drop one at any point) are freed after the capture, not inside it,
    where a synchronous free would invalidate the graph: the session still gives
    the C reference's bits, and the memory is freed."""
    cpu, gpu = make(name, backend="cpu"), make(name, backend="cuda")
    x = rand((2, 4, cpu.d_model), 12)
    doomed = [be.copy(x), be.new((3,)), gpu.forward(be.copy(x))]  # a step has 3 launches or more
    dropped = []
    launch = type(be)._launch

    def dropping(self, s, *args, **kw):
        if s == self._capture and doomed:  # a launch into the capture stream
            dropped.append(doomed.pop().shape)  # its last reference: freed here
        return launch(self, s, *args, **kw)
    monkeypatch.setattr(type(be), "_launch", dropping)
    st_c, st_g = cpu.allocate_state(2), gpu.allocate_state(2)
    got, want = [], []
    with gpu.decode_session(st_g) as sess:
        for t in range(4):
            xt = time_slice(x, t, t + 1)
            got += [(f"step {t}", host(sess.step(be.copy(xt))))] + reports_of(gpu, name, t)
            want += [(f"step {t}", raw(cpu.step(xt, st_c)))] + reports_of(cpu, name, t)
    assert len(dropped) == 3, "every array was dropped during a capture"
    assert not be._released, "frees held back during a capture were run after it"
    assert_same(got + state_of(st_g), want + state_of(st_c), f"{name} frees in capture")


def refusals_after_launch(be, name):
    """A device call that writes nothing the caller owns is launched before its
    finite check answers: a refused one still raises with the first bad index,
    leaves the block's reports as the last accepted call left them, and a ragged
    call reads no padding; a call with a state is refused before it runs."""
    cpu, gpu = make(name, backend="cpu"), make(name, backend="cuda")
    L, D = BLOCKS[name]["length"], cpu.d_model
    x = rand((2, L, D), 40)
    gpu.forward(be.copy(x))
    before = reports_of(gpu, name, "before")
    i = (L + 3) * D + 5  # row 1, token 3
    with pytest.raises(ValueError, match=f"x holds a non-finite value .* flat index {i}$"):
        gpu.forward(be.copy(poisoned(x, i)))
    assert reports_of(gpu, name, "before") == before, "a refused call changed the reports"
    with pytest.raises(ValueError, match=f"x holds a non-finite value .* flat index {i}$"):
        gpu.forward(be.copy(poisoned(x, i)), lengths=[L, 4])
    pad = poisoned(x, (L + 5) * D)  # row 1's padding past length 4
    assert host(gpu.forward(be.copy(pad), lengths=[L, 4])) == \
        raw(cpu.forward(pad, lengths=[L, 4]))
    with pytest.raises(ValueError, match=f"grad_output holds a non-finite value .* flat "
                                         f"index {i}$"):
        gpu.backward(be.copy(x), be.copy(poisoned(x, i)))
    st = gpu.allocate_state(2)
    gpu.forward(be.copy(time_slice(x, 0, 2)), st)
    kept = state_of(st)
    with pytest.raises(ValueError, match="x holds a non-finite value"):
        gpu.forward(be.copy(poisoned(time_slice(x, 2, 4), 7)), st)
    assert state_of(st) == kept, "a refused call changed the state"


def input_check_in_norm(be, name, mode, monkeypatch):
    """A stateless device prefill searches x for non-finite values in the norm that
    reads it (no search kernel of its own), on each norm path (fast; identical's
    rows scaled whole or by mb_rms_scale_k): the first bad index of several in
    different rows and blocks is the one named. Where no norm takes the search (a
    prefill of one token may be normed in in_proj's GEMV; here forced), the settle
    runs it. A clean call afterwards gives the bits it gave before (identical: the
    C reference's)."""
    cpu = make(name, backend="cpu", numeric_mode=mode)
    gpu = make(name, backend="cuda", numeric_mode=mode)
    L, D = BLOCKS[name]["length"], cpu.d_model
    x = rand((3, L, D), 42)
    i = (L + 3) * D + 5  # row 1, token 3; an inf after it in its row and a NaN in row 2
    bad = poisoned(poisoned(x, i), 2 * L * D + 1)
    memoryview(bad).cast("B").cast("f")[i + 7] = math.inf
    want = host(gpu.forward(be.copy(x)))
    if mode == "identical":
        assert want == raw(cpu.forward(x))
    names, launch = [], type(be)._launch
    monkeypatch.setattr(type(be), "_launch", lambda self, s, n, *a, **k: names.append(n) or
                        launch(self, s, n, *a, **k))
    take = be._input_check
    paths = [("norm", True)] + ([("norm", False)] if mode == "identical" else []) + [
        ("settle", True)]
    for where, whole in paths:
        monkeypatch.setattr(be, "_norm_whole", (lambda M, n: 0) if not whole else
                            type(be)._norm_whole.__get__(be))
        monkeypatch.setattr(be, "_input_check", take if where == "norm" else
                            lambda *a: None)
        names.clear()
        with pytest.raises(ValueError, match=f"x holds a non-finite value .* flat index {i}$"):
            gpu.forward(be.copy(bad))
        assert ("mb_first_nonfinite_k" in names) == (where == "settle"), (where, whole)
        if not whole:
            assert "mb_rms_scale_k" in names
        assert host(gpu.forward(be.copy(x))) == want, (where, whole)
    one = time_slice(x, 0, 1)
    monkeypatch.setattr(be, "_input_check", take)
    monkeypatch.setattr(be, "_norm_whole", type(be)._norm_whole.__get__(be))
    with pytest.raises(ValueError, match=f"x holds a non-finite value .* flat index {D + 2}$"):
        gpu.forward(be.copy(poisoned(one, D + 2)))
    assert host(gpu.forward(be.copy(one))) == host(gpu.forward(be.copy(one)))


# (5, 176): rows held whole, walked in groups of 48 terms (chain.h's 32-term step,
# then its last 16)
NORM_SHAPES = [(1, 2048), (5, 64), (40, 64), (33, 384), (40, 1000), (3, 9000), (37, 1001),
               (600, 1000), (40, 4000), (9, 4001), (7, 24), (6, 13), (5, 176)]
# (M, N, K) of the GEMV normalizing its rows itself: a row, a block's 8 rows and
# one more, K a stage, not a multiple of 4, past a stage, Mamba-2's out_proj, K 48
# (the norm's sum of squares takes the chain's 32-term step and its last 16)
NORM_GEMVS = [(1, 40, 2048), (8, 33, 13), (9, 70, 1031), (64, 32, 256), (3, 1024, 2048),
              (2, 40, 48)]


def rmsnorm_rows(be, M, n):
    """The device RMSNorm (rows held whole and scaled by mb_rms_k, all of them in one
    block or a few a block, or streamed through its ring with and without mb_dot's
    tree past 8192 terms, then mb_rms_scale_k: rows of 4k floats or not, fewer rows
    than a block's 8, more than a grid's; rows held whole shorter than their four
    copy groups) gives the C reference's bits, also written over its input."""
    per = {(m, k): be._norm_whole(m, k) for m, k in NORM_SHAPES}
    assert {0, 1} <= {min(p, 1) for p in per.values()}, "the shapes take both paths"
    assert any(k <= 8192 and not p for (m, k), p in per.items()), "the ring without the tree"
    assert any(0 < p < m for (m, k), p in per.items()), "whole rows in several blocks"
    X, W = rand((M, n), 50), rand((n,), 51)
    want = raw(_core._rmsnorm(X, W, M, n))
    assert raw(be._rmsnorm_rows(X, W, M, n)) == want
    assert raw(be._rmsnorm_rows(X, W, M, n, in_place=True)) == want


# (M, n) of fast mode's norm: 16-byte loads (n % 4 == 0) or not, rows past a grid
FAST_NORM_SHAPES = [(1, 2048), (9, 13), (33, 386), (70, 64), (2000, 24)]


def fast_rmsnorm_rows(be, M, n):
    """Fast mode's device RMSNorm (a warp a row, 16-byte loads where n allows) stays
    within fast mode's bound of the float64 norm, and gives the same bits when
    written over its input."""
    X, W = rand((M, n), 52), rand((n,), 53)
    xs, ws = floats(X), floats(W)
    want = []
    for m in range(M):
        row = xs[m * n:(m + 1) * n]
        r = 1.0 / math.sqrt(sum(v * v for v in row) / n + 1e-5)
        want += [v * r * w for v, w in zip(row, ws)]
    got = be._rmsnorm_rows(X, W, M, n, fast=True)
    assert rel_l2(floats(got), want) <= FAST_BOUND, (M, n)
    assert raw(be._rmsnorm_rows(X, W, M, n, in_place=True, fast=True)) == raw(got), (M, n)


def norm_gemv(be, M, N, K):
    """The decode GEMV that RMSNorms its rows of X first gives the C reference's norm
    then GEMM, bit for bit, and leaves X as it was."""
    assert be.gemv_norm_smem(M, K), "the shape takes the GEMV's norm"
    X, W, nw = rand((M, K), 52), rand((N, K), 53), rand((K,), 54)
    xs = raw(X)
    want = raw(_core._gemm(_core._rmsnorm(X, nw, M, K), W, M, N, K))
    assert raw(be._gemm(X, W, M, N, K, norm=nw)) == want
    assert raw(X) == xs


def angle_walks(be):
    """Mamba-3's angle walk takes mb_mod2pi_near for a batch of 64 tokens of an angle
    only when the angle starts it in [-0.25, 6.5] and every increment ta * dt is under
    6 in magnitude; otherwise mb_mod2pi. A state whose angles start at 100, -3, 7 and
    just past the range sends those walks' first batches the long way, and dt_bias 2
    makes dt about 2.1, so that |ta| * dt (|ta| <= pi) passes 6 on a few tokens: some
    batches of the other walks take each path (a build with either path's result
    changed fails here). 150 tokens: two whole batches and a partial one. A forward
    from the state, a stateless one and backward keep the C reference's bits."""
    w = mamba.random_weights("mamba3", 32, seed=9)
    memoryview(w["dt_bias"]).cast("B").cast("f")[0] = 2.0
    cpu = BLOCKS["mamba3"]["cls"](w, backend="cpu")
    gpu = BLOCKS["mamba3"]["cls"](w, backend="cuda")
    x = rand((2, 150, 32), 62)
    st_c = cpu.allocate_state(2)
    th = memoryview(st_c.theta).cast("B").cast("f")
    for i, v in enumerate((100.0, -3.0, 7.0, -0.0, -0.25, 6.5, -0.2500001, 6.5000005)):
        th[5 * i] = v
    st_g = type(st_c)(*[be.copy(p) for p in st_c.pieces()])
    assert raw(gpu.forward(x, st_g)) == raw(cpu.forward(x, st_c))
    assert state_of(st_g) == state_of(st_c)
    assert raw(gpu.forward(x)) == raw(cpu.forward(x))
    dy = rand((2, 150, 32), 63)
    got, want = gpu.backward(x, dy), cpu.backward(x, dy)
    assert all(raw(got[k]) == raw(want[k]) for k in want)


def scan_exp_ranges(be):
    """Mamba-1's scan takes exp's core only for groups of 16 tokens whose every delta * A
    lies in [MB_EXP_LO, 0]. With dt_proj's weight zero, delta is softplus(dt_proj's
    bias) on every token: 0.69 on the first block's 8 channels (delta * A >= -11: the
    core) and 10 on channel 9 (delta * A down to -160: exp in full for the second
    block). Forward, a split into prefill and steps, and backward keep the C
    reference's bits on both paths."""
    w = mamba.random_weights("mamba1", 32, seed=8)
    assert max(floats(w["A_log"])) > math.log(8.8), "some A * 10 is below exp's range"
    for name, value in (("dt_proj.weight", 0.0), ("dt_proj.bias", 0.0)):
        v = memoryview(w[name]).cast("B").cast("f")
        for i in range(len(v)):
            v[i] = value
    memoryview(w["dt_proj.bias"]).cast("B").cast("f")[9] = 10.0
    cpu = BLOCKS["mamba1"]["cls"](w, backend="cpu")
    gpu = BLOCKS["mamba1"]["cls"](w, backend="cuda")
    x = rand((2, 53, 32), 60)
    assert raw(gpu.forward(x)) == raw(cpu.forward(x))
    st_c, st_g = cpu.allocate_state(2), gpu.allocate_state(2)
    for p in [time_slice(x, 0, 37)] + [time_slice(x, t, t + 1) for t in range(37, 40)]:
        assert raw(gpu.forward(p, st_g)) == raw(cpu.forward(p, st_c))
    assert state_of(st_g) == state_of(st_c)
    dy = rand((2, 53, 32), 61)
    got, want = gpu.backward(x, dy), cpu.backward(x, dy)
    assert all(raw(got[k]) == raw(want[k]) for k in want)
