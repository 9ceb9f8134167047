"""The CUDA backend's own promises: device arrays in and out (zero-copy with torch),
the same bits as the C reference, refusals of device inputs, stream ordering with
torch, and the loader's reasons when no GPU is usable. The cross-backend identity
lanes (test_identity.py) also run on every usable GPU backend.

Device tests are marked gpu and skip where no GPU is usable, except when
MAMBA_BACKEND=cuda asks for one: then they fail."""
import math
import os
import re
import subprocess
import sys

import pytest

import mamba
from mamba import _backends, _core
from _util import rand, raw, state_bytes, time_slice
from blocks import BLOCKS, make
from device_lanes import (FAST_NORM_SHAPES, NORM_GEMVS, NORM_SHAPES, SSD_SESSIONS,
                          angle_walks, fast_rmsnorm_rows, frees_during_capture, gemm_tails,
                          m2_head_groups, input_check_in_norm, math_matches_reference, norm_gemv,
                          refusals_after_launch, rmsnorm_rows, scan_exp_ranges,
                          ssd_fold_chain, ssd_session_graph)

D = 32  # d_model of the small device checks


def cuda_or_skip():
    ok, why = mamba.backends()["cuda"]
    if not ok:
        if os.environ.get("MAMBA_BACKEND") == "cuda":
            pytest.fail(f"MAMBA_BACKEND=cuda but the CUDA backend is unusable: {why}")
        pytest.skip(f"no usable CUDA backend: {why}")
    return _backends._get("cuda")[0]


@pytest.fixture
def be():
    return cuda_or_skip()


@pytest.fixture
def torch(be):
    t = pytest.importorskip("torch")
    if not t.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    return t


def dev(torch, a):
    """A host float32 buffer as a torch.cuda tensor (a copy)."""
    return torch.frombuffer(bytearray(raw(a)), dtype=torch.float32).reshape(
        memoryview(a).shape).cuda()


def host_bytes(t):
    """The bytes of a CUDA tensor or device mamba.Array."""
    import torch
    if isinstance(t, mamba.Array):
        t = torch.from_dlpack(t)
    return t.cpu().contiguous().numpy().tobytes() if hasattr(t, "numpy") else bytes(t)


# ------------------------------------------------------------------ no GPU here
def test_cuda_probe_gives_a_reason():
    ok, why = mamba.backends()["cuda"]
    assert isinstance(why, str) and why
    if ok:
        assert "device 0" in why and "sm_" in why
    else:
        with pytest.raises(RuntimeError, match="backend 'cuda' was requested but is not "
                                               "usable: " + re.escape(why)):
            mamba.Mamba1Block(mamba.random_weights("mamba1", D), backend="cuda")


def test_auto_without_gpu_is_cpu():
    if mamba.backends()["cuda"][0] or mamba.backends()["hip"][0]:
        pytest.skip("a GPU backend is usable here")
    env = os.environ.pop("MAMBA_BACKEND", None)
    try:
        assert make("mamba1").vendor_used() == "cpu"
    finally:
        if env is not None:
            os.environ["MAMBA_BACKEND"] = env


def test_device_input_without_cuda_backend_is_refused():
    if mamba.backends()["cuda"][0]:
        pytest.skip("the CUDA backend is usable here")

    class FakeCuda:  # a CUDA array as torch would describe it; never dereferenced
        __cuda_array_interface__ = {"shape": (1, 1, D), "typestr": "<f4", "data": (4096, False),
                                    "version": 3, "strides": None}
    with pytest.raises(ValueError, match="x lives on a CUDA device, but the CUDA backend "
                                         "is not usable"):
        make("mamba1", backend="cpu").forward(FakeCuda())


def test_requested_cuda_without_gpu_fails_not_skips(tmp_path):
    """With MAMBA_BACKEND=cuda and no usable GPU, the GPU tests fail."""
    if mamba.backends()["cuda"][0]:
        pytest.skip("the CUDA backend is usable here")
    env = dict(os.environ, MAMBA_BACKEND="cuda")
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.join(here, "test_gpu.py"), "-k", "device_out"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stdout[-2000:]
    assert "MAMBA_BACKEND=cuda but the CUDA backend is unusable" in r.stdout
    assert "skipped" not in r.stdout.splitlines()[-1]


# ------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
def test_device_in_device_out(be, torch):
    """torch.cuda in -> device mamba.Array out, zero-copy into torch, CPU bits."""
    cpu, gpu = make("mamba1", d_model=D, backend="cpu"), make("mamba1", d_model=D, backend="cuda")
    x = rand((3, 17, D), 1)
    st_c, st_g = cpu.allocate_state(3), cpu.allocate_state(3)
    st_d = mamba.Mamba1State(dev(torch, st_g.conv_window), dev(torch, st_g.h))
    y_c = cpu.forward(x, st_c)
    y = gpu.forward(dev(torch, x), st_d)
    assert isinstance(y, mamba.Array) and y.device == "cuda" and y.shape == (3, 17, D)
    yt = torch.from_dlpack(y)
    assert yt.is_cuda and yt.data_ptr() == y.ptr, "from_dlpack must not copy"
    assert y.__cuda_array_interface__["data"][0] == y.ptr
    assert host_bytes(yt) == raw(y_c)
    assert host_bytes(st_d.conv_window) == raw(st_c.conv_window)
    assert host_bytes(st_d.h) == raw(st_c.h)
    # host in -> host out on the same block, same bits
    y_h = gpu.forward(x)
    assert y_h.device == "cpu" and raw(y_h) == raw(cpu.forward(x))


@pytest.mark.gpu
def test_device_weights_and_session(be, torch):
    """Weights given as CUDA tensors, decode session steps on device inputs."""
    w = mamba.random_weights("mamba1", D, seed=3)
    cpu = mamba.Mamba1Block(w, backend="cpu")
    gpu = mamba.Mamba1Block({k: dev(torch, v) for k, v in w.items()}, backend="cuda")
    x = rand((2, 9, D), 2)
    st_c, st_g = cpu.allocate_state(2), gpu.allocate_state(2)
    cpu.forward(time_slice(x, 0, 4), st_c)
    gpu.forward(time_slice(x, 0, 4), st_g)
    assert state_bytes(st_g) == state_bytes(st_c)
    with gpu.decode_session(st_g) as sess:
        for t in range(4, 9):
            xt = time_slice(x, t, t + 1)
            y = sess.step(dev(torch, xt))
            assert y.device == "cuda"
            assert host_bytes(y) == raw(cpu.step(xt, st_c)), f"token {t}"
    assert state_bytes(st_g) == state_bytes(st_c)


@pytest.mark.gpu
@pytest.mark.parametrize("name,P,T", [("mamba2", 506, 518), ("mamba3", 124, 134)])
def test_ssd_device_in_device_out(be, torch, name, P, T):
    """Mamba-2/3: device x and device state, through a chunk boundary by decode
    steps in a session; outputs, state and reports (h_last_ after every step, read
    on another stream) equal the C reference's."""
    if not _backends.supports(be, _backends._op_for(f"Mamba{name[-1]}Block")):
        pytest.skip(f"{name} is not enabled on the CUDA backend (MAMBA_CUDA_SSD=1 enables it)")
    cpu, gpu = make(name, backend="cpu"), make(name, backend="cuda")
    x = rand((2, T, cpu.d_model), 11)
    st_c, st_g = cpu.allocate_state(2), cpu.allocate_state(2)
    st_d = type(st_g)(*[dev(torch, p) for p in st_g.pieces()])
    y = gpu.forward(dev(torch, time_slice(x, 0, P)), st_d)
    assert y.device == "cuda"
    assert host_bytes(y) == raw(cpu.forward(time_slice(x, 0, P), st_c))
    reports = ("h_last_",) if name == "mamba2" else ("h_last_", "k_last_", "v_last_", "theta_last_")
    for r in reports:
        assert host_bytes(getattr(gpu, r)) == raw(getattr(cpu, r)), r
    side = torch.cuda.Stream()
    with gpu.decode_session(st_d) as sess:
        for t in range(P, T):
            xt = time_slice(x, t, t + 1)
            yt = sess.step(dev(torch, xt))
            assert yt.device == "cuda"
            assert host_bytes(yt) == raw(cpu.step(xt, st_c)), f"token {t}"
            with torch.cuda.stream(side), mamba.stream(side):  # read on another stream
                assert host_bytes(gpu.h_last_) == raw(cpu.h_last_), f"h_last_ after {t}"
    for n, p in zip(st_c._PIECES, st_c.pieces()):
        assert host_bytes(getattr(st_d, n)) == raw(p), n
    for n in st_c._SCALARS:
        assert getattr(st_d, n) == getattr(st_c, n), n


@pytest.mark.gpu
@pytest.mark.parametrize("name,B", SSD_SESSIONS)
def test_ssd_session_graph(be, name, B):
    ssd_session_graph(be, name, B)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(BLOCKS))
def test_frees_during_capture(be, name, monkeypatch):
    frees_during_capture(be, name, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(BLOCKS))
def test_refusals_after_launch(be, name):
    refusals_after_launch(be, name)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["identical", "fast"])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_input_check_in_norm(be, name, mode, monkeypatch):
    input_check_in_norm(be, name, mode, monkeypatch)


@pytest.mark.gpu
def test_device_ragged_and_strided(be, torch):
    gpu, cpu = make("mamba1", d_model=D, backend="cuda"), make("mamba1", d_model=D, backend="cpu")
    x = rand((3, 11, D), 4)
    lens = [11, 4, 1]
    xt = dev(torch, x)
    for b, n in enumerate(lens):
        xt[b, n:] = float("nan")  # padding is never read
    assert host_bytes(gpu.forward(xt, lengths=lens)) == raw(cpu.forward(x, lengths=lens))
    strided = dev(torch, x).transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    assert host_bytes(gpu.forward(strided)) == raw(cpu.forward(x))


@pytest.mark.gpu
def test_cuda_array_interface_input(be, torch):
    gpu, cpu = make("mamba1", d_model=D, backend="cuda"), make("mamba1", d_model=D, backend="cpu")
    x = rand((2, 5, D), 5)
    t = dev(torch, x)

    class CaiOnly:
        def __init__(self, t):
            self.t = t
            self.__cuda_array_interface__ = t.__cuda_array_interface__
    assert host_bytes(gpu.forward(CaiOnly(t))) == raw(cpu.forward(x))


@pytest.mark.gpu
@pytest.mark.parametrize("M,K", [(2, 8192), (2, 8193), (2, 3 * 8192 + 5), (2, 4 * 8192),
                                 (2, 5 * 8192 - 1), (20, 3 * 8192 + 5), (130, 8193),
                                 (130, 3 * 8192 + 5)])
def test_gemm_leaves_match_reference(be, M, K):
    """dot v1's leaves and pairwise tree (K > 8192) give the C reference's bits, on
    the GEMV (M <= 64) and the tiled path."""
    N = 20
    X, W = rand((M, K), 10 + K % 7), rand((N, K), 20 + K % 5)
    assert raw(be._gemm(X, W, M, N, K)) == raw(_core._gemm(X, W, M, N, K))


@pytest.mark.gpu
@pytest.mark.parametrize("M,n", NORM_SHAPES)
def test_rmsnorm_rows(be, M, n):
    rmsnorm_rows(be, M, n)


@pytest.mark.gpu
@pytest.mark.parametrize("M,n", FAST_NORM_SHAPES)
def test_fast_rmsnorm_rows(be, M, n):
    fast_rmsnorm_rows(be, M, n)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", NORM_GEMVS)
def test_norm_gemv(be, M, N, K):
    norm_gemv(be, M, N, K)


@pytest.mark.gpu
def test_scan_exp_ranges(be):
    scan_exp_ranges(be)


@pytest.mark.gpu
def test_angle_walks(be):
    angle_walks(be)


@pytest.mark.gpu
def test_gemm_tails(be, monkeypatch):
    gemm_tails(be, monkeypatch)


@pytest.mark.gpu
def test_m2_head_groups(be):
    m2_head_groups(be)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["mamba2", "mamba3"])
def test_ssd_fold_chain(be, name, monkeypatch):
    ssd_fold_chain(be, name, monkeypatch)


@pytest.mark.gpu
def test_math_matches_reference(be):
    """numerics.h on the device: every 257th float32 bit pattern (16.7 million inputs)
    and the special points, each function."""
    math_matches_reference(be, 257)


@pytest.mark.gpu
def test_gemm_tiles_match_reference(be):
    """Edges of the GEMM's 128 x 128 tile and of the narrow tiles (N up to 96 and 160), both
    also with two leaves (K > 8192), of the GEMV's 32-column and 8-row blocks and of its
    M <= 64 range, and a K that is not a multiple of the k step."""
    for M, N, K in [(1, 1, 1), (129, 257, 13), (200, 100, 1031), (8, 33, 300), (9, 40, 129),
                    (64, 50, 700), (65, 50, 700), (3, 97, 2050), (130, 160, 300),
                    (65, 161, 9), (200, 300, 8200), (70, 130, 8200)]:
        X, W = rand((M, K), M), rand((N, K), N)
        assert raw(be._gemm(X, W, M, N, K)) == raw(_core._gemm(X, W, M, N, K)), (M, N, K)


# ------------------------------------------------------------------ refusals
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_device_dtype_refused_by_name(be, torch, dtype):
    gpu = make("mamba1", d_model=D, backend="cuda")
    st = gpu.allocate_state(1)
    gpu.forward(rand((1, 2, D), 6), st)
    before = state_bytes(st)
    with pytest.raises(TypeError, match=f"x has dtype {dtype}; only float32"):
        gpu.forward(torch.zeros((1, 2, D), dtype=getattr(torch, dtype), device="cuda"), st)
    assert state_bytes(st) == before


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_device_nonfinite_refused_with_index(be, torch, bad):
    gpu = make("mamba1", d_model=D, backend="cuda")
    cw, h = torch.zeros((2, 2 * D, 4), device="cuda"), torch.zeros((2, 2 * D, 16), device="cuda")
    st = mamba.Mamba1State(cw, h)
    gpu.forward(dev(torch, rand((2, 3, D), 7)), st)
    before = (host_bytes(cw), host_bytes(h))
    x = dev(torch, rand((2, 3, D), 8))
    idx = 2 * D + 7
    x.view(-1)[idx] = bad
    x.view(-1)[idx + 40] = bad  # a later one is not the first
    with pytest.raises(ValueError, match=f"x holds a non-finite value .* flat index {idx}$"):
        gpu.forward(x, st)
    with pytest.raises(ValueError, match=f"x holds a non-finite value .* flat index {idx}$"):
        gpu.forward(x, lengths=[3, 3])
    h.view(-1)[5] = bad
    with pytest.raises(ValueError, match="state.h holds a non-finite value .* flat index 5$"):
        gpu.forward(dev(torch, rand((2, 3, D), 8)), st)
    assert host_bytes(cw) == before[0]


@pytest.mark.gpu
def test_device_state_must_be_contiguous(be, torch):
    gpu = make("mamba1", d_model=D, backend="cuda")
    h = torch.zeros((2, 16, 2 * D), device="cuda").transpose(1, 2)
    st = mamba.Mamba1State(torch.zeros((2, 2 * D, 4), device="cuda"), h)
    with pytest.raises(ValueError, match="state.h must be C-contiguous"):
        gpu.forward(rand((2, 1, D), 9), st)


@pytest.mark.gpu
def test_device_input_refused_by_cpu_block(be, torch):
    cpu = make("mamba1", d_model=D, backend="cpu")
    with pytest.raises(ValueError, match="x lives on cuda:0, but the block runs on the cpu"):
        cpu.forward(dev(torch, rand((1, 2, D), 1)))


# ------------------------------------------------------------------ streams
@pytest.mark.gpu
def test_stream_order_with_torch_side_streams(be, torch):
    """An input written late on a torch side stream is read only after it is written
    (DLPack producer sync), and a torch side stream reading the output waits for
    our work (DLPack consumer sync). Without either, the bits would differ."""
    dm = 256
    cpu, gpu = make("mamba1", d_model=dm, backend="cpu"), make("mamba1", d_model=dm, backend="cuda")
    x = rand((4, 256, dm), 11)
    src = dev(torch, x)
    side = torch.cuda.Stream()
    want = raw(cpu.forward(x))
    xt = torch.zeros_like(src)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of spinning before the write
        xt.copy_(src)
        y = gpu.forward(xt)  # DLPack intake with the side stream current
    with torch.cuda.stream(side):
        got = torch.from_dlpack(y).clone()  # consumer on the side stream
    side.synchronize()
    assert got.cpu().numpy().tobytes() == want


def test_stream_refused_by_type():
    with pytest.raises(TypeError, match="mamba.stream: stream must be a CUDA stream .* got str"):
        with mamba.stream("legacy"):
            pass
    with pytest.raises(ValueError, match="mamba.stream: a stream handle is not negative"):
        with mamba.stream(-3):
            pass


@pytest.mark.gpu
def test_m3_in_proj_side_stream(be, torch):
    """Mamba-3's in_proj runs its x block's GEMM on a second stream and joins back. At
    2048 rows the z and x GEMMs (64 blocks each) share the GPU: the bits are the
    CPU's on the legacy stream and under mamba.stream of a torch stream, whose
    consumer is then ordered after the whole call."""
    dm = 256
    cpu, gpu = make("mamba3", d_model=dm, backend="cpu"), make("mamba3", d_model=dm, backend="cuda")
    x = rand((2, 1024, dm), 13)
    want = raw(cpu.forward(x))
    assert torch.from_dlpack(gpu.forward(dev(torch, x))).cpu().numpy().tobytes() == want
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), mamba.stream(side):
        got = torch.from_dlpack(gpu.forward(dev(torch, x))).clone()
    side.synchronize()
    assert got.cpu().numpy().tobytes() == want


@pytest.mark.gpu
def test_caller_stream(be, torch):
    """Under mamba.stream(side) the work runs on a torch side stream. A forward's
    output says which stream wrote it and a consumer on that stream is ordered. A
    session step (no host wait) is ordered after the side stream's late write of
    its input while the legacy default stream does not wait for it; closing the
    session on the legacy stream is ordered after the side stream's steps."""
    dm = 256
    cpu, gpu = make("mamba1", d_model=dm, backend="cpu"), make("mamba1", d_model=dm, backend="cuda")
    x = rand((2, 64, dm), 12)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), mamba.stream(side):
        y = gpu.forward(dev(torch, x))
        got = torch.from_dlpack(y).clone()
    assert y.stream == side.cuda_stream == y.__cuda_array_interface__["stream"]
    side.synchronize()
    assert got.cpu().numpy().tobytes() == raw(cpu.forward(x))

    st_c, st_g = cpu.allocate_state(2), gpu.allocate_state(2)
    cpu.forward(time_slice(x, 0, 3), st_c)
    gpu.forward(time_slice(x, 0, 3), st_g)
    outs = []
    with gpu.decode_session(st_g) as sess:
        src = dev(torch, time_slice(x, 3, 4))
        xt = torch.zeros_like(src)
        torch.cuda.synchronize()
        with torch.cuda.stream(side), mamba.stream(side):
            torch.cuda._sleep(200_000_000)  # about 0.1 s before the side stream writes x
            xt.copy_(src)
            outs.append(torch.from_dlpack(sess.step(xt)).clone())
            torch.cuda.default_stream().synchronize()
            assert not side.query(), "the step must be queued on the side stream"
            for t in range(4, 6):
                outs.append(torch.from_dlpack(sess.step(dev(torch, time_slice(x, t, t + 1)))).clone())
    side.synchronize()
    for t, o in zip(range(3, 6), outs):
        assert o.cpu().numpy().tobytes() == raw(cpu.step(time_slice(x, t, t + 1), st_c)), t
    assert state_bytes(st_g) == state_bytes(st_c)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 10, 70])
def test_session_graph_device_inputs(be, torch, B):
    """A session's graph over device inputs and outputs gives the CPU step's bits, for
    one GEMV row block, several (B 10) and past the GEMV range (B 70: the residual
    kernel instead of the fused epilogue)."""
    cpu, gpu = make("mamba1", d_model=D, backend="cpu"), make("mamba1", d_model=D, backend="cuda")
    x = rand((B, 6, D), 20 + B)
    st_c, st_g = cpu.allocate_state(B), gpu.allocate_state(B)
    cpu.forward(time_slice(x, 0, 2), st_c)
    gpu.forward(time_slice(x, 0, 2), st_g)
    with gpu.decode_session(st_g) as sess:
        for t in range(2, 6):
            xt = time_slice(x, t, t + 1)
            y = sess.step(dev(torch, xt))
            assert y.device == "cuda" and y.shape == (B, 1, D)
            assert host_bytes(y) == raw(cpu.step(xt, st_c)), t
    assert state_bytes(st_g) == state_bytes(st_c)


@pytest.mark.gpu
def test_session_refuses_device_nonfinite_without_waiting(be, torch):
    """A non-finite device input to a session step is found on the device: the step
    returns at once, it and the steps queued after it give NaN and leave the state,
    and sync_state raises (after copying the state) naming the step and the index.
    A host input is refused at once. The session then goes on as before."""
    cpu, gpu = make("mamba1", d_model=D, backend="cpu"), make("mamba1", d_model=D, backend="cuda")
    x = rand((2, 8, D), 30)
    st_c, st_g = cpu.allocate_state(2), gpu.allocate_state(2)
    cpu.forward(time_slice(x, 0, 2), st_c)
    gpu.forward(time_slice(x, 0, 2), st_g)
    idx = D + 5
    with gpu.decode_session(st_g) as sess:
        x2 = time_slice(x, 2, 3)
        assert host_bytes(sess.step(dev(torch, x2))) == raw(cpu.step(x2, st_c))
        good = cpu.allocate_state(2)
        for n, p in zip(good._PIECES, st_c.pieces()):
            memoryview(getattr(good, n)).cast("B")[:] = memoryview(p).cast("B")
        bad, after = dev(torch, time_slice(x, 3, 4)), dev(torch, time_slice(x, 4, 5))
        bad.view(-1)[idx] = float("nan")
        bad.view(-1)[idx + 3] = float("inf")
        torch.cuda._sleep(100_000_000)  # the GPU runs the next steps after the host issued them
        y_bad = sess.step(bad)
        y_after = sess.step(after)
        with pytest.raises(ValueError, match=f"x of step 2 of this session held a non-finite "
                                             f"value .* flat index {idx};"):
            sess.sync_state()
        assert all(math.isnan(v) for v in torch.from_dlpack(y_bad).view(-1).tolist())
        assert all(math.isnan(v) for v in torch.from_dlpack(y_after).view(-1).tolist())
        assert state_bytes(st_g) == state_bytes(good), "refused steps must leave the state"
        hbad = rand((2, 1, D), 31)
        memoryview(hbad).cast("B").cast("f")[7] = float("-inf")
        with pytest.raises(ValueError, match="DecodeSession.step: x holds a non-finite value "
                                             r"\(NaN or inf\) at flat index 7$"):
            sess.step(hbad)
        for t in range(3, 6):
            xt = time_slice(x, t, t + 1)
            assert host_bytes(sess.step(dev(torch, xt))) == raw(cpu.step(xt, st_c)), t
    assert state_bytes(st_g) == state_bytes(st_c)
