"""backward(x, grad_output) (SPEC 8): every gradient against float64 torch autograd of an
independent transcription of the upstream maths (rtol 1e-5, atol 1e-6), central finite
differences of our own forward on sampled cells, and bitwise repeatability."""
import numpy as np
import pytest

import mamba
from blocks import BLOCKS

torch = pytest.importorskip("torch")

RTOL, ATOL = 1e-5, 1e-6

# block -> module with forward(weights: dict of float64 tensors, x: tensor) -> y,
# written from the upstream maths with torch ops (autograd differentiates it)
REFS = {}
# block -> (B, L, d_model) cases; L spans each block's chunk boundaries
CASES = {}


def _load_refs():
    import importlib
    for name, mod in (("mamba1", "torch_ref1"), ("mamba2", "torch_ref2"), ("mamba3", "torch_ref3")):
        try:
            REFS[name] = importlib.import_module(mod)
        except ImportError:
            pass
        else:
            CASES[name] = REFS[name].CASES


_load_refs()
PARAMS = [(n, c) for n in REFS if n in BLOCKS for c in CASES[n]]


def _inputs(name, shape, seed):
    B, L, dm = shape
    w = REFS[name].weights(dm, seed) if hasattr(REFS[name], "weights") else \
        mamba.random_weights(name, dm, seed=seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, L, dm)).astype(np.float32)
    dy = rng.standard_normal((B, L, dm)).astype(np.float32)
    return w, x, dy


@pytest.mark.parametrize("name,shape", PARAMS, ids=[f"{n}-{c}" for n, c in PARAMS])
def test_gradients_match_float64_autograd(name, shape):
    w, x, dy = _inputs(name, shape, sum(shape))
    blk = BLOCKS[name]["cls"](w, backend="cpu")
    got = blk.backward(x, dy)
    tw = {k: torch.tensor(np.asarray(v, dtype=np.float64), requires_grad=True) for k, v in w.items()}
    tx = torch.tensor(x.astype(np.float64), requires_grad=True)
    y = REFS[name].forward(tw, tx)
    y.backward(torch.from_numpy(dy.astype(np.float64)))
    assert set(got) == {"x"} | set(w)
    np.testing.assert_allclose(np.asarray(got["x"]), tx.grad.numpy(), rtol=RTOL, atol=ATOL,
                               err_msg="x")
    for k in w:
        np.testing.assert_allclose(np.asarray(got[k]), tw[k].grad.numpy().reshape(np.asarray(got[k]).shape),
                                   rtol=RTOL, atol=ATOL, err_msg=k)


@pytest.mark.parametrize("name", [n for n in REFS if n in BLOCKS])
def test_gradients_match_finite_differences(name):
    """Central differences of our own float32 forward, on sampled weight cells."""
    B, L, dm = CASES[name][0]
    w, x, dy = _inputs(name, (B, L, dm), 7)
    blk = BLOCKS[name]["cls"](w, backend="cpu")
    g = blk.backward(x, dy)
    rng = np.random.default_rng(0)

    def loss(wd, xx):
        return float(np.dot(np.asarray(BLOCKS[name]["cls"](wd, backend="cpu").forward(xx), np.float64).ravel(),
                            dy.astype(np.float64).ravel()))

    for k in list(w)[:]:
        base = np.asarray(w[k], dtype=np.float32)
        for idx in rng.choice(base.size, size=min(2, base.size), replace=False):
            eps = 1e-2 * max(1.0, abs(float(base.flat[idx])))
            plus, minus = base.copy(), base.copy()
            plus.flat[idx] += eps
            minus.flat[idx] -= eps
            fd = (loss({**w, k: plus}, x) - loss({**w, k: minus}, x)) / (
                float(plus.flat[idx]) - float(minus.flat[idx]))
            an = float(np.asarray(g[k]).flat[idx])
            assert abs(fd - an) <= 2e-2 * max(1.0, abs(an)), (k, idx, fd, an)


@pytest.mark.parametrize("name", [n for n in BLOCKS])
def test_backward_repeats_bitwise(name):
    B, L, dm = (2, 9, BLOCKS[name]["d_model"])
    w = mamba.random_weights(name, dm, seed=3)
    blk = BLOCKS[name]["cls"](w, backend="cpu")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, L, dm)).astype(np.float32)
    dy = rng.standard_normal((B, L, dm)).astype(np.float32)
    a, b = blk.backward(x, dy), blk.backward(x, dy)
    for k in a:
        assert np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes(), k


@pytest.mark.parametrize("name", [n for n in BLOCKS])
def test_backward_refusals(name):
    dm = BLOCKS[name]["d_model"]
    blk = BLOCKS[name]["cls"](mamba.random_weights(name, dm), backend="cpu")
    x = np.zeros((1, 3, dm), np.float32)
    dy = np.zeros((1, 3, dm), np.float32)
    bad = dy.copy()
    bad[0, 1, 2] = np.nan
    with pytest.raises(ValueError, match=f"grad_output holds a non-finite value .* flat index {dm + 2}"):
        blk.backward(x, bad)
    with pytest.raises(ValueError, match="grad_output has shape"):
        blk.backward(x, dy[:, :2])
    with pytest.raises(TypeError, match="grad_output has dtype float64"):
        blk.backward(x, dy.astype(np.float64))


def _small(name):
    dm = BLOCKS[name]["d_model"]
    blk = BLOCKS[name]["cls"](mamba.random_weights(name, dm, seed=2), backend="cpu")
    rng = np.random.default_rng(0)
    L = BLOCKS[name]["decode"][1]  # crosses the block's chunk grid
    x = rng.standard_normal((2, L, dm)).astype(np.float32)
    dy = rng.standard_normal((2, L, dm)).astype(np.float32)
    return blk, x, dy


@pytest.mark.parametrize("name", [n for n in BLOCKS])
def test_backward_same_bits_on_every_isa(name):
    from mamba import _core
    blk, x, dy = _small(name)
    best = _core._isa(-1)
    try:
        got = []
        for isa in range(best + 1):  # baseline, x86-64-v3, x86-64-v4: those this CPU runs
            if _core._isa(isa) == isa:  # backward, and a vjp's forward and pullback
                y, pullback = blk.vjp(x)
                got.append({k: np.asarray(v).tobytes() for k, v in blk.backward(x, dy).items()})
                got.append({k: np.asarray(v).tobytes() for k, v in pullback(dy).items()})
                got[-1]["y"] = got[-2]["y"] = np.asarray(y).tobytes()
    finally:
        _core._isa(best)
    if len(got) < 4:
        pytest.skip("this CPU runs only the baseline copy")
    assert all(g == got[0] for g in got[1:])


@pytest.mark.parametrize("name", [n for n in BLOCKS])
def test_backward_x_gradient_of_a_row_is_the_row_alone(name):
    """Each row's x gradient depends on that row only (weight gradients fold the batch)."""
    blk, x, dy = _small(name)
    both = np.asarray(blk.backward(x, dy)["x"])
    for b in range(2):
        alone = np.asarray(blk.backward(x[b:b + 1], dy[b:b + 1])["x"])
        assert alone[0].tobytes() == both[b].tobytes()
    other = np.asarray(blk.backward(x[::-1].copy(), dy[::-1].copy())["x"])
    assert other[0].tobytes() != both[0].tobytes()  # negative control


def _reports(blk):
    names = [n for n in ("h_last_", "k_last_", "v_last_", "theta_last_") if hasattr(type(blk), n)]
    return {n: np.asarray(getattr(blk, n)).tobytes() for n in names}


@pytest.mark.parametrize("name", [n for n in BLOCKS])
def test_vjp_is_forward_then_backward(name):
    """vjp(x): forward(x)'s bits and a pullback that gives backward(x, dy)'s bits on
    every call, from its own copy of x; the block's reports stay those of the call
    before."""
    blk, x, dy = _small(name)
    y_want, g_want = np.asarray(blk.forward(x)).tobytes(), blk.backward(x, dy)
    blk.forward(x[:1, :5])
    reports = _reports(blk)
    xc = x.copy()
    y, pullback = blk.vjp(xc)
    xc[:] = 0.0
    assert isinstance(pullback, mamba.Pullback)
    assert np.asarray(y).tobytes() == y_want
    assert _reports(blk) == reports
    for _ in range(2):
        got = pullback(dy)
        assert set(got) == set(g_want)
        for k in g_want:
            assert np.asarray(got[k]).tobytes() == np.asarray(g_want[k]).tobytes(), k


@pytest.mark.parametrize("name", [n for n in BLOCKS])
def test_vjp_refusals(name):
    """Non-finite x at vjp, and a pullback's bad grad_output or closed pullback, are
    refused naming what is wrong."""
    dm = BLOCKS[name]["d_model"]
    blk = BLOCKS[name]["cls"](mamba.random_weights(name, dm), backend="cpu")
    x = np.zeros((1, 3, dm), np.float32)
    bad = x.copy()
    bad[0, 2, 1] = np.inf
    with pytest.raises(ValueError, match=f"vjp: x holds a non-finite value .* flat index {2 * dm + 1}"):
        blk.vjp(bad)
    _, pullback = blk.vjp(x)
    with pytest.raises(ValueError, match="pullback: grad_output holds a non-finite value"):
        pullback(bad)
    with pytest.raises(ValueError, match="pullback: grad_output has shape"):
        pullback(x[:, :2])
    with pytest.raises(TypeError, match="grad_output has dtype float64"):
        pullback(x.astype(np.float64))
    pullback.close()
    with pytest.raises(ValueError, match="pullback is closed"):
        pullback(x)
