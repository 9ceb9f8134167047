"""backward on a GPU backend (SPEC 3, 8): every gradient bit for bit the C reference's,
over lengths that cross each block's internal chunking, repeatable, for host arrays
(host gradients) and torch.cuda arrays (device gradients). Marked gpu: skipped where
no GPU is usable, failed when MAMBA_BACKEND=cuda names an unusable one (test_gpu.py).

GRAD_BLOCKS is the registry: one entry per block whose CUDA backward exists."""
import math

import pytest

import mamba
from _util import FAST_BOUND, floats, rand, raw, rel_l2
from blocks import BLOCKS
from test_gpu import be, dev, host_bytes, torch  # noqa: F401 (fixtures)


def _m2_binding_limit(w):
    """A dt_limit around the head's dt at zero input, softplus(dt_bias): the clamp
    holds a good share of the tokens at each bound (test_m2_dt_limit_binds)."""
    sp = math.log1p(math.exp(floats(w["dt_bias"])[0]))
    return dict(dt_limit=(0.8 * sp, 1.25 * sp))


def _m3_stress(w):
    """In place: angles that wrap past 2 pi every few tokens, both ways (the angle
    rows of in_proj x 20 put tanh near +-1; dt_bias -1 makes dt about 0.3), and head
    0's A on its floor wherever dd_A < -9999 (its dd_A row x 20000 spreads dd_A over
    a few 1e4 of either sign); test_m3_stress_wraps_and_floors checks both."""
    dm = len(floats(w["block_norm.weight"]))
    di, H = 2 * dm, dm // 32
    a = 2 * di + 256 + H  # in_proj row of head 0's dd_A
    inp = memoryview(w["in_proj.weight"]).cast("B").cast("f")
    for r, f in [(a, 20000.0)] + [(r, 20.0) for r in range(a + 2 * H, a + 2 * H + 32)]:
        for c in range(r * dm, (r + 1) * dm):
            inp[c] = inp[c] * f
    bias = memoryview(w["dt_bias"]).cast("B").cast("f")
    for h in range(H):
        bias[h] = -1.0
    return w


# block -> d_model, the lengths and batch sizes of the identity lane (the lengths cross
# the backward's chunking: below, on and past a chunk, and several chunks), the shape
# (B, L, d_model) of a call whose B * L folds span more than one 8192-token leaf, and
# optionally ctor: weights -> extra constructor arguments, weights: weights -> the
# weights to use
GRAD_BLOCKS = {
    # the scan's reverse pass keeps a carry every 32 tokens
    "mamba1": dict(d_model=32, lengths=(1, 31, 32, 33, 257), batches=(1, 3),
                   leaves=(2, 4100, 16)),
    # chunks of 256: the dh chain runs over 1, 2 and 3 chunks; one head
    "mamba2": dict(d_model=32, lengths=(1, 255, 256, 257, 513), batches=(1, 3),
                   leaves=(2, 4100, 32), ctor=_m2_binding_limit),
    # chunks of 64: the dh chain runs over 1, 2 and 3 chunks; two heads, one with its
    # A floor binding on some tokens, angles wrapping past 2 pi
    "mamba3": dict(d_model=64, lengths=(1, 63, 64, 65, 129), batches=(1, 3),
                   leaves=(2, 4100, 32), weights=_m3_stress),
}

CASES = [(n, B, L) for n, spec in GRAD_BLOCKS.items() for B in spec["batches"]
         for L in spec["lengths"]]


def _inputs(shape, seed):
    return rand(shape, seed), rand(shape, seed + 1)


def _floats(b):
    return memoryview(b).cast("f")


def assert_same_gradients(got, want, what):
    """Bitwise equality of every gradient; a failure names the gradient, the first
    flat index that differs and both values (with their bit patterns)."""
    assert set(got) == set(want), f"{what}: gradients {sorted(got)} != {sorted(want)}"
    for k in want:
        g = host_bytes(got[k]) if got[k].device != "cpu" else raw(got[k])
        w = raw(want[k])
        assert len(g) == len(w), f"{what}: {k} has {len(g) // 4} values, the CPU's {len(w) // 4}"
        if g != w:
            i = next(j for j in range(0, len(w), 4) if g[j:j + 4] != w[j:j + 4]) // 4
            gv, wv = _floats(g)[i], _floats(w)[i]
            n = sum(g[j:j + 4] != w[j:j + 4] for j in range(0, len(w), 4))
            pytest.fail(f"{what}: gradient {k!r} differs at flat index {i} (of {len(w) // 4}; "
                        f"{n} values differ): GPU {gv!r} (0x{g[4 * i:4 * i + 4][::-1].hex()}) "
                        f"vs CPU {wv!r} (0x{w[4 * i:4 * i + 4][::-1].hex()})")


def _block(name, dm, seed, **kw):
    """make(), with the registry's weights and constructor arguments."""
    w = GRAD_BLOCKS[name].get("weights", lambda w: w)(mamba.random_weights(name, dm, seed=seed))
    return BLOCKS[name]["cls"](w, **GRAD_BLOCKS[name].get("ctor", lambda w: {})(w), **kw)


def _pair(name, dm, seed=0, **kw):
    return _block(name, dm, seed, backend="cpu", **kw), _block(name, dm, seed, backend="cuda", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("name,B,L", CASES, ids=[f"{n}-B{B}-L{L}" for n, B, L in CASES])
def test_backward_equals_cpu(be, name, B, L):
    """Host arrays in, host gradients out, the C reference's bits; a second call
    gives the same bits."""
    dm = GRAD_BLOCKS[name]["d_model"]
    cpu, gpu = _pair(name, dm, seed=B + L)
    x, dy = _inputs((B, L, dm), 7 * L + B)
    want = cpu.backward(x, dy)
    got = gpu.backward(x, dy)
    assert all(g.device == "cpu" for g in got.values())
    assert_same_gradients(got, want, f"{name} B={B} L={L}")
    assert_same_gradients(gpu.backward(x, dy), got, f"{name} B={B} L={L}, second call")


VJP_CASES = [(n, B, L) for n, spec in GRAD_BLOCKS.items()
             for B, L in ((1, spec["lengths"][-2]), (3, spec["lengths"][-1]))]


@pytest.mark.gpu
@pytest.mark.parametrize("name,B,L", VJP_CASES, ids=[f"{n}-B{B}-L{L}" for n, B, L in VJP_CASES])
def test_vjp_equals_forward_and_backward(be, name, B, L):
    """vjp's y is forward's, bit for bit, and its pullback gives backward's bits (the C
    reference's) on every call, whether the backend kept the forward's activations
    (Mamba-2) or recomputes; the caller's x may change after vjp."""
    dm = GRAD_BLOCKS[name]["d_model"]
    cpu, gpu = _pair(name, dm, seed=B + L)
    x, dy = _inputs((B, L, dm), 5 * L + B)
    want_y, want = raw(cpu.forward(x)), cpu.backward(x, dy)
    xb = bytearray(raw(x))
    y, pullback = gpu.vjp(memoryview(xb).cast("f", memoryview(x).shape))
    xb[:] = bytes(len(xb))  # the pullback holds its own copy of x
    assert raw(y) == want_y
    for call in ("first", "second"):
        assert_same_gradients(pullback(dy), want, f"{name} B={B} L={L}, pullback's {call} call")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GRAD_BLOCKS))
def test_vjp_device_arrays_and_streams(be, torch, name):
    """A torch.cuda x gives a device y and a pullback whose device gradients have the
    CPU's bits, with the vjp on a side stream and the pullback on the default one."""
    dm = GRAD_BLOCKS[name]["d_model"]
    cpu, gpu = _pair(name, dm, seed=6)
    x, dy = _inputs((2, 40, dm), 31)
    want_y, want = raw(cpu.forward(x)), cpu.backward(x, dy)
    xt, dyt = dev(torch, x), dev(torch, dy)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), mamba.stream(side):
        y, pullback = gpu.vjp(xt)
        xt.zero_()  # after the vjp, in the same stream's order: the pullback holds a copy
    got = pullback(dyt)
    torch.cuda.synchronize()
    assert y.device == "cuda" and host_bytes(y) == want_y
    assert all(g.device == "cuda" for g in got.values())
    assert_same_gradients(got, want, f"{name} vjp, device arrays")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GRAD_BLOCKS))
def test_backward_device_arrays(be, torch, name):
    """torch.cuda x and grad_output give device gradients (torch reads them zero-copy)
    with the CPU's bits; a device x with a host grad_output too."""
    dm = GRAD_BLOCKS[name]["d_model"]
    cpu, gpu = _pair(name, dm, seed=5)
    x, dy = _inputs((3, 33, dm), 21)
    want = cpu.backward(x, dy)
    for dy_in in (dev(torch, dy), dy):
        got = gpu.backward(dev(torch, x), dy_in)
        for k, g in got.items():
            assert isinstance(g, mamba.Array) and g.device == "cuda", k
            assert torch.from_dlpack(g).data_ptr() == g.ptr, f"{k}: from_dlpack must not copy"
        assert_same_gradients(got, want, f"{name} device x, {type(dy_in).__name__} dy")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GRAD_BLOCKS))
def test_backward_folds_past_one_leaf(be, name):
    """B * L > 8192: the weight gradients' folds over the tokens join leaves."""
    B, L, dm = GRAD_BLOCKS[name]["leaves"]
    cpu, gpu = _pair(name, dm, seed=3)
    x, dy = _inputs((B, L, dm), 3)
    assert_same_gradients(gpu.backward(x, dy), cpu.backward(x, dy), f"{name} B={B} L={L}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GRAD_BLOCKS))
def test_backward_fast_mode(be, name):
    """numeric_mode="fast" (test_fast.py holds its gradients to fast mode's bound
    against float64 autograd): without tensor cores the backward is the identical
    path, the C reference's bits; with them its norms, projections and Mamba-3's
    chunk products ran on the tensor cores, and every gradient (x's less dy, its
    exact residual part) lies within fast mode's bound of the C reference's. L
    crosses Mamba-3's 64-token chunk."""
    dm = GRAD_BLOCKS[name]["d_model"]
    cpu = _block(name, dm, 9, backend="cpu")
    fast = _block(name, dm, 9, backend="cuda", numeric_mode="fast")
    x, dy = _inputs((2, 70, dm), 9)
    got, want = fast.backward(x, dy), cpu.backward(x, dy)
    if not be.tensor_cores:
        assert_same_gradients(got, want, f"{name} fast mode")
        return
    assert any(raw(got[k]) != raw(want[k]) for k in want), f"{name}: no TF32 product"
    d = floats(dy)
    for k in want:
        g, w = floats(got[k]), floats(want[k])
        if k == "x":
            g, w = [a - b for a, b in zip(g, d)], [a - b for a, b in zip(w, d)]
        err = rel_l2(g, w)
        assert err <= FAST_BOUND, f"{name} fast gradient {k}: relative L2 error {err:.2e}"


@pytest.mark.gpu
def test_m1_scan_windows_change_no_bit(be):
    """The Mamba-1 scan backward's window buffers hold runs of whole chunks; the
    smallest window (one chunk) gives the bits of the default (one window here)."""
    dm = GRAD_BLOCKS["mamba1"]["d_model"]
    cpu, gpu = _pair("mamba1", dm, seed=4)
    x, dy = _inputs((3, 70, dm), 4)
    saved = be.m1_window_bytes
    be.m1_window_bytes = 1
    try:
        got = gpu.backward(x, dy)
    finally:
        be.m1_window_bytes = saved
    assert_same_gradients(got, cpu.backward(x, dy), "mamba1, one chunk per window")


def test_m2_dt_limit_binds():
    """The registry's dt_limit holds tokens at each bound (CPU): lifting either bound
    changes dt_bias' gradient."""
    blk = _block("mamba2", 32, 3 + 257, backend="cpu")
    lo, hi = blk.dt_limit
    x, dy = _inputs((3, 257, 32), 7 * 257 + 3)
    w = dict(zip(blk._W_NAMES, blk._w))
    g = raw(blk.backward(x, dy)["dt_bias"])
    for lim in ((lo, math.inf), (0.0, hi)):
        other = mamba.Mamba2Block(w, dt_limit=lim, backend="cpu").backward(x, dy)
        assert raw(other["dt_bias"]) != g, f"dt_limit {(lo, hi)}: lifting to {lim} changes nothing"


def test_m3_stress_wraps_and_floors():
    """The registry's Mamba-3 weights (CPU, float64 projections): in the largest case of
    the lane, head 0's A floor binds on some tokens and not on others, head 1's nowhere,
    and every head's angles wrap past 2 pi both ways."""
    np = pytest.importorskip("numpy")
    from mamba._oracle64 import oracle3
    B, L = max(GRAD_BLOCKS["mamba3"]["batches"]), max(GRAD_BLOCKS["mamba3"]["lengths"])
    blk = _block("mamba3", GRAD_BLOCKS["mamba3"]["d_model"], B + L, backend="cpu")
    w = {k: np.asarray(v, np.float64) for k, v in zip(blk._W_NAMES, blk._w)}
    x, _ = _inputs((B, L, blk.d_model), 7 * L + B)
    t = oracle3.project(w, np.asarray(x, np.float64))
    floored = t["dd_A"] < -9999
    assert floored[..., 0].any() and not floored[..., 0].all(), "head 0: the floor binds somewhere"
    assert not floored[..., 1:].any(), "the other heads are a control"
    turns = np.floor(np.cumsum(t["ang"][:, :, None, :] * t["dt"][..., None], axis=1) / (2 * np.pi))
    assert (turns.max(axis=(1, 3)) >= 2).all() and (turns.min(axis=(1, 3)) <= -2).all(), \
        "the angles must wrap past 2 pi both ways in every row and head"


def test_registry_names_known_blocks():
    assert set(GRAD_BLOCKS) <= set(BLOCKS)
