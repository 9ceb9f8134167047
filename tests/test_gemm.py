"""dot v1 (SPEC 4.4): the vectorised, threaded projection routine equals, bit for bit,
the literal scalar chain (mb_dot) for every output, on both CPU instruction sets."""
import array
import random
import threading
import time

import pytest

from mamba import _core
import mamba


def mixed(n, seed):
    """Values of mixed sign and magnitude, so any change of order shows in the bits."""
    rng = random.Random(seed)
    return array.array("f", (rng.choice((-1, 1)) * rng.uniform(0.5, 2.0) * 2.0 ** rng.randint(-12, 12)
                             for _ in range(n)))


def literal(X, W, M, N, K):
    out = []
    for m in range(M):
        for n in range(N):
            out.append(_core._dot(memoryview(X)[m * K:(m + 1) * K], memoryview(W)[n * K:(n + 1) * K]))
    return array.array("f", out).tobytes()


SHAPES = [(1, 1, 1), (3, 17, 127), (17, 5, 128), (1, 33, 129), (5, 3, 300), (19, 7, 1000),
          (33, 65, 64), (2, 9, 8193), (1, 3, 20000), (100, 70, 300)]


@pytest.mark.parametrize("isa", [0, 1, 2])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_gemm_equals_literal_dot_v1(M, N, K, isa):
    X, W = mixed(M * K, K), mixed(N * K, K + 1)
    best = _core._isa(-1)
    try:
        if _core._isa(isa) != isa:
            pytest.skip("this CPU lacks that ISA")  # the baseline copy still runs
        got = bytes(memoryview(_core._gemm(X, W, M, N, K)).cast("B"))
    finally:
        _core._isa(best)
    assert got == literal(X, W, M, N, K)


def test_order_matters_for_these_inputs():
    """Negative control: summing the same products in another order changes bits."""
    K = 1000
    a, b = mixed(K, 3), mixed(K, 4)
    fwd = _core._dot(a, b)
    rev = _core._dot(array.array("f", reversed(a)), array.array("f", reversed(b)))
    assert fwd != rev


def test_gil_released_during_forward():
    blk = mamba.Mamba1Block(mamba.random_weights("mamba1", 256), backend="cpu")
    B = 4
    while True:  # a call long enough to measure, on a fast CPU too
        x = mamba.zeros((B, 1024, 256))
        t0 = time.perf_counter()
        blk.forward(x)
        if time.perf_counter() - t0 > 0.05 or B >= 256:
            break
        B *= 2
    count = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    time.sleep(0.01)
    c0 = count[0]
    t0 = time.perf_counter()
    blk.forward(x)
    elapsed = time.perf_counter() - t0
    c1 = count[0]
    stop.set()
    t.join()
    # with the GIL held for the whole call the spinner could not run at all
    assert elapsed > 0.02 and c1 - c0 > 1000
