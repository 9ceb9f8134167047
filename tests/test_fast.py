"""numeric_mode="fast" (SPEC 3): accuracy, never bits. Every output's relative L2
error against the float64 oracle is at most 2e-3, on every usable backend and for every
block, for prefill (the tensor-core path), a short prefill (the decode kernels), steps
and a decode session. The mixer's part of the output (y - x) is held to the same bound,
which is far stricter than y's: the residual x is exact. Every gradient of backward
is held to the bound against float64 autograd of the torch transcriptions."""
import numpy as np
import pytest

import mamba
from mamba import _backends
from mamba._oracle64 import oracle1, oracle2, oracle3
from _util import FAST_BOUND
from blocks import BLOCKS, gpu_backends

DM = 256
ORACLES = {"mamba1": oracle1.forward, "mamba2": oracle2.forward, "mamba3": oracle3.forward}
SANE = {"mamba3": oracle3.sane}  # the weights test_oracle compares Mamba-3 on
CASES = [(name, be) for name in BLOCKS for be in ["cpu"] + gpu_backends(name)]
BACKENDS = ["cpu"] + gpu_backends("mamba1")


def rel(got, want):
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def check(y, x, want, what):
    y = np.asarray(y, dtype=np.float64)
    assert np.isfinite(y).all(), what
    assert rel(y, want) <= FAST_BOUND, what
    e = rel(y - x, want - x)
    assert e <= FAST_BOUND, f"{what}: mixer error {e:.2e}"


def weights(name):
    w = mamba.random_weights(name, DM, seed=5)
    return SANE.get(name, dict)(w)


def oracle(name, w, x):
    return ORACLES[name]({k: np.asarray(v, np.float64) for k, v in w.items()},
                         x.astype(np.float64))


@pytest.mark.parametrize("name,backend", CASES)
@pytest.mark.parametrize("B,L", [(2, 80), (1, 30), (1, 300)])  # 300: past Mamba-2's chunk
def test_fast_forward_within_bound(name, backend, B, L):
    w = weights(name)
    blk = BLOCKS[name]["cls"](w, numeric_mode="fast", backend=backend)
    assert blk.numeric_mode_used() == "fast"
    x = np.random.default_rng(L).standard_normal((B, L, DM)).astype(np.float32)
    y = blk.forward(x)
    check(y, x, oracle(name, w, x), f"{name} forward {backend} {(B, L)}")
    if backend != "cpu":  # the fast kernels ran, not the identical ones
        assert bytes(memoryview(y)) != bytes(memoryview(BLOCKS[name]["cls"](
            w, backend=backend).forward(x)))


@pytest.mark.parametrize("name,backend", CASES)
def test_fast_ragged_within_bound(name, backend):
    """A ragged batch (lengths; the padding NaN, never read): each row within the
    bound of its own float64 oracle, past a Mamba-2 chunk and under one."""
    w = weights(name)
    blk = BLOCKS[name]["cls"](w, numeric_mode="fast", backend=backend)
    lens, L = [300, 70, 2], 300
    x = np.random.default_rng(4).standard_normal((3, L, DM)).astype(np.float32)
    xp = x.copy()
    for b, n in enumerate(lens):
        xp[b, n:] = np.nan
    y = np.asarray(blk.forward(xp, lengths=lens))
    for b, n in enumerate(lens):
        row = np.ascontiguousarray(x[b:b + 1, :n])
        check(y[b:b + 1, :n], row, oracle(name, w, row), f"{name} ragged row {b} {backend}")


@pytest.mark.parametrize("name,backend", CASES)
def test_fast_decode_within_bound(name, backend):
    """Prefill 40 tokens, then 8 steps and 8 session steps (through Mamba-3's chunk
    boundary at 64 when the prefill is 60), against the oracle's one prefill."""
    B, P = 2, 60 if name == "mamba3" else 40
    T = P + 16
    w = weights(name)
    blk = BLOCKS[name]["cls"](w, numeric_mode="fast", backend=backend)
    x = np.random.default_rng(7).standard_normal((B, T, DM)).astype(np.float32)
    want = oracle(name, w, x)
    st = blk.allocate_state(B)
    ys = [np.asarray(blk.forward(np.ascontiguousarray(x[:, :P]), st))]
    for t in range(P, P + 8):
        ys.append(np.asarray(blk.step(np.ascontiguousarray(x[:, t:t + 1]), st)))
    with blk.decode_session(st) as sess:
        for t in range(P + 8, T):
            ys.append(np.asarray(sess.step(np.ascontiguousarray(x[:, t:t + 1]))))
    y = np.concatenate(ys, axis=1)
    check(y[:, P:P + 8], x[:, P:P + 8], want[:, P:P + 8], f"{name} steps {backend}")
    check(y[:, P + 8:], x[:, P + 8:], want[:, P + 8:], f"{name} session {backend}")


@pytest.mark.parametrize("name,backend", CASES)
def test_fast_split_prefill_within_bound(name, backend):
    """A prefill of 40 tokens, then one of 260 that completes the chunks begun in
    the state (Mamba-3's first chunk folds rows from the state and new ones; Mamba-2's
    256-token chunk is passed) and steps on what it leaves: each part within the
    bound of the oracle's one prefill of all 304 tokens."""
    B, P, Q, T = 2, 40, 300, 304
    w = weights(name)
    blk = BLOCKS[name]["cls"](w, numeric_mode="fast", backend=backend)
    x = np.random.default_rng(9).standard_normal((B, T, DM)).astype(np.float32)
    want = oracle(name, w, x)
    st = blk.allocate_state(B)
    y = np.asarray(blk.forward(np.ascontiguousarray(x[:, :P]), st))
    check(y, x[:, :P], want[:, :P], f"{name} first prefill {backend}")
    y = np.asarray(blk.forward(np.ascontiguousarray(x[:, P:Q]), st))
    check(y, x[:, P:Q], want[:, P:Q], f"{name} continued prefill {backend}")
    ys = [np.asarray(blk.step(np.ascontiguousarray(x[:, t:t + 1]), st)) for t in range(Q, T)]
    check(np.concatenate(ys, axis=1), x[:, Q:], want[:, Q:], f"{name} steps after {backend}")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b == "cuda"])
def test_fast_gemm_within_bound(backend):
    """The TF32 GEMM and the split-K GEMV at tile and alignment edges."""
    from mamba import _backends
    be = _backends._get("cuda")[0]
    rng = np.random.default_rng(3)
    for M, N, K in [(1, 1, 1), (129, 257, 13), (200, 100, 1031), (130, 96, 2048),
                    (3, 40, 129), (64, 33, 300), (65, 8, 4), (300, 520, 132)]:
        X = rng.standard_normal((M, K)).astype(np.float32)
        W = rng.standard_normal((N, K)).astype(np.float32)
        Y = np.asarray(be._gemm(mamba.asarray(X), mamba.asarray(W), M, N, K, fast=True))
        assert rel(Y, X.astype(np.float64) @ W.astype(np.float64).T) <= FAST_BOUND, (M, N, K)


def tf32(a):
    """a rounded to TF32 (10 mantissa bits) to nearest, ties away from zero."""
    b = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((b + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b == "cuda"])
def test_fast_wgmma_rounds_operands(backend):
    """On Hopper, fast mode's projections take wgmma.cu's kernel: its result equals
    the exact product of the operands rounded to TF32 to nearest, up to fp32
    accumulation (about 5e-6 at K 2048; truncated operands, which wgmma alone would
    read, miss by about 5e-4), at tile edges, past K's 32-term slices and with the
    residual (added to the product's bits); repeated calls give the same bits."""
    be = _backends._get("cuda")[0]
    if "sm_90" not in be.description:
        pytest.skip("wgmma.cu's kernel runs on sm_90 (Hopper) only")
    assert be.wgmma, "the module's sm_90a code lacks mb_fast_wgmma_k"
    rng = np.random.default_rng(9)
    for M, N, K in [(65, 8, 4), (300, 520, 132), (1000, 256, 2048), (129, 300, 36)]:
        X = rng.standard_normal((M, K)).astype(np.float32)
        W = rng.standard_normal((N, K)).astype(np.float32)
        R = rng.standard_normal((M, N)).astype(np.float32)
        exact = tf32(X).astype(np.float64) @ tf32(W).astype(np.float64).T
        for res in (None, R):
            Y = np.asarray(be._gemm(mamba.asarray(X), mamba.asarray(W), M, N, K, fast=True,
                                    res=None if res is None else mamba.asarray(res)))
            want = exact + (0 if res is None else R)
            assert rel(Y, want) <= 5e-5, (M, N, K, res is None)
            if res is None:
                Y0 = Y
            else:  # the residual is one float32 addition to the product's bits
                assert Y.tobytes() == (R + Y0).tobytes(), (M, N, K)
            again = be._gemm(mamba.asarray(X), mamba.asarray(W), M, N, K, fast=True,
                             res=None if res is None else mamba.asarray(res))
            assert bytes(memoryview(again)) == Y.tobytes(), (M, N, K)
    assert be._tmaps, "the wgmma GEMM encoded no tensor maps"
    for key, tm in list(be._tmaps.items()):  # a kept map is the one encoding it again gives
        assert bytes(tm) == bytes(be._encode_tmap(*key)), key


@pytest.mark.parametrize("name,backend", CASES)
def test_fast_backward_within_bound(name, backend):
    """Every gradient (x's, and each weight's less its identical part where the
    backward adds dy to x's) against float64 autograd; repeated calls give the same
    bits; on the GPU the fast kernels ran."""
    torch = pytest.importorskip("torch")
    ref = __import__("torch_ref" + name[-1])
    B, L = 2, 80
    w = ref.weights(DM, 11)
    blk = BLOCKS[name]["cls"](w, numeric_mode="fast", backend=backend)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((B, L, DM)).astype(np.float32)
    dy = rng.standard_normal((B, L, DM)).astype(np.float32)
    got = blk.backward(x, dy)
    tw = {k: torch.tensor(np.asarray(v, np.float64), requires_grad=True) for k, v in w.items()}
    tx = torch.tensor(x.astype(np.float64), requires_grad=True)
    ref.forward(tw, tx).backward(torch.from_numpy(dy.astype(np.float64)))
    want = {"x": tx.grad.numpy() - dy} | {k: t.grad.numpy() for k, t in tw.items()}
    for k, g in got.items():
        g = np.asarray(g, np.float64).reshape(want[k].shape) - (dy if k == "x" else 0)
        assert np.isfinite(g).all(), f"{name} {backend} {k}"
        e = rel(g, want[k])
        assert e <= FAST_BOUND, f"{name} {backend} gradient {k}: relative L2 error {e:.2e}"
    again = blk.backward(x, dy)
    assert all(bytes(memoryview(again[k])) == bytes(memoryview(got[k])) for k in got)
    if backend != "cpu" and _backends._get(backend)[0].tensor_cores:
        same = BLOCKS[name]["cls"](w, backend=backend).backward(x, dy)
        assert any(bytes(memoryview(same[k])) != bytes(memoryview(got[k])) for k in got)

