"""reference/numerics.h (SPEC 4.3) and dot v1 (SPEC 4.4), through the private hooks
`_core._math` and `_core._dot`.

Three promises, each its own group of tests:
- accuracy: every function is within its ulp bound of Python's double-precision
  `math` module on 2^20 samples per domain. The bounds are the maxima measured over
  every float32 of the domain (docs/numerics.md), so a sample can meet them, never
  exceed them;
- bits: the results equal an independent model of the spec's algorithm (exact fma,
  every other operation rounded to float32), so the header cannot drift from SPEC 4.3;
- edges: thresholds, signed zeros, subnormals and non-finite inputs behave as
  docs/numerics.md says.
"""
import math
import random
import struct
from array import array

import pytest

from mamba import _core

try:
    import numpy as np
except ImportError:  # the library is numpy-free; so are these tests, only slower
    np = None

N = 1 << 20
INF = math.inf
LO = -87.33654022216797  # exp underflow threshold (float32)
HI = 88.72283935546875  # exp overflow threshold (float32)
TWO_PI = 6.283185482025146484375  # bits 0x40C90FDB
BELOW_TWO_PI = 6.28318500518798828125  # the float32 just below TWO_PI
FMAX = 3.4028234663852886e38
TINY = 1.401298464324817e-45  # smallest subnormal
BIG_SUB = 1.1754942106924411e-38  # largest subnormal
FMIN = 1.1754943508222875e-38  # smallest normal


# ------------------------------------------------------------------ float32 helpers
def f32(x):
    """Nearest float32 of a double (ties to even, subnormals kept)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(INF, x)


def bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def fbits(u):
    return struct.unpack("<f", struct.pack("<I", u))[0]


def _ord(x):
    u = bits(x)
    return -(u & 0x7FFFFFFF) if u >> 31 else u


def _unord(o):
    return fbits(0x80000000 | -o) if o < 0 else fbits(o)


def nextup(x):
    return _unord(_ord(x) + 1)


def nextdown(x):
    return _unord(_ord(x) - 1)


def call(name, xs):
    """_core._math over a sequence of floats; returns array('f')."""
    if not isinstance(xs, array):
        xs = array("f", xs)
    return array("f", bytes(memoryview(_core._math(name, xs))))


def one(name, x):
    return call(name, [x])[0]


def same(a, b):
    """Equal bits; every NaN equals every NaN (SPEC 4.6)."""
    return (a != a and b != b) or bits(a) == bits(b)


# ------------------------------------------------------------------ exact model
def _split(x):
    m, e = math.frexp(x)
    return int(m * (1 << 53)), e - 53


def _round_int(n, e):
    """Nearest float32 of n * 2^e (n a nonzero int), ties to even."""
    s = -1.0 if n < 0 else 1.0
    n = abs(n)
    qe = max(n.bit_length() - 1 + e, -126) - 23
    shift = qe - e
    if shift > 0:
        q, r = divmod(n, 1 << shift)
        half = 1 << (shift - 1)
        if r > half or (r == half and q & 1):
            q += 1
    else:
        q = n << -shift
    if q.bit_length() + qe > 128:
        return s * INF
    return s * math.ldexp(q, qe)


def fmaf(a, b, c):
    """fmaf with one rounding, exactly, for finite float32 a, b, c."""
    if not (math.isfinite(a) and math.isfinite(b) and math.isfinite(c)):
        return f32(a * b + c)
    na, ea = _split(a)
    nb, eb = _split(b)
    nc, ec = _split(c)
    n1, e1 = na * nb, ea + eb
    e = min(e1, ec)
    n = (n1 << (e1 - e)) + (nc << (ec - e))
    if n == 0:
        p = a * b
        both_neg = p == 0 and c == 0 and math.copysign(1, p) < 0 and math.copysign(1, c) < 0
        return -0.0 if both_neg else 0.0
    return _round_int(n, e)


def m_exp(x):
    if x != x:
        return x
    if x > HI:
        return INF
    if x < LO:
        return 0.0
    z = float(math.floor(fmaf(x, f32(1.44269504088896341), 0.5)))
    k = int(z)
    r = fmaf(z, -0.693359375, x)
    r = fmaf(z, f32(2.12194440e-4), r)
    p = f32(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = fmaf(p, r, f32(c))
    y = f32(fmaf(p, f32(r * r), r) + 1.0)
    k1 = k >> 1
    y = f32(y * math.ldexp(1.0, k1))
    return f32(y * math.ldexp(1.0, k - k1))


LOGP = (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1,
        -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1)


def m_logcore(t, e):
    z = f32(t * t)
    p = f32(LOGP[0])
    for c in LOGP[1:]:
        p = fmaf(p, t, f32(c))
    y = f32(f32(p * t) * z)
    if e:
        y = fmaf(float(e), f32(-2.12194440e-4), y)
    y = fmaf(z, -0.5, y)
    r = f32(t + y)
    if e:
        r = fmaf(float(e), 0.693359375, r)
    return r


def m_log1p(x):
    if x != x or x == INF:
        return x
    if x == -1.0:
        return -INF
    if x < -1.0:
        return math.nan
    if fbits(0xBE95F61A) <= x <= fbits(0x3ED413CD):
        return m_logcore(x, 0)
    m, e = math.frexp(f32(1.0 + x))  # 1 + x = m 2^e, m in [0.5, 1)
    if m < f32(0.707106781186547524):
        return m_logcore(f32(f32(m + m) - 1.0), e - 1)
    return m_logcore(f32(m - 1.0), e)


def m_softplus(x):
    return m_log1p(m_exp(x)) if x <= 20.0 else x


def m_sigmoid(x):
    return f32(1.0 / f32(1.0 + m_exp(-x)))


def m_silu(x):
    return f32(x / f32(1.0 + m_exp(-x)))


def m_tanh(x):
    if x != x:
        return x
    ax = abs(x)
    if ax > fbits(0x42317218):
        r = 1.0
    elif ax >= 0.625:
        r = f32(1.0 - f32(2.0 / f32(m_exp(f32(ax + ax)) + 1.0)))
    else:
        z = f32(ax * ax)
        p = f32(-5.70498872745e-3)
        for c in (2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1, -3.33332819422e-1):
            p = fmaf(p, z, f32(c))
        r = fmaf(f32(p * z), ax, ax)
    return math.copysign(r, x)


def m_trig(x, cosine):
    if not math.isfinite(x):
        return math.nan
    ax = abs(x)
    if ax > 16777215.0:
        return 0.0
    j = int(f32(ax * f32(1.27323954473516)))
    j += j & 1
    y = float(j)
    r = fmaf(y, -0.78515625, ax)
    r = fmaf(y, -2.4187564849853515625e-4, r)
    r = fmaf(y, f32(-3.77489497744594108e-8), r)
    z = f32(r * r)
    ps = fmaf(fmaf(f32(-1.9515295891e-4), z, f32(8.3321608736e-3)), z, f32(-1.6666654611e-1))
    s = fmaf(f32(ps * z), r, r)
    pc = fmaf(fmaf(f32(2.443315711809948e-5), z, f32(-1.388731625493765e-3)), z,
              f32(4.166664568298827e-2))
    c = f32(fmaf(z, -0.5, f32(f32(pc * z) * z)) + 1.0)
    if cosine:
        v = s if j & 2 else c
        neg = ((j >> 2) ^ (j >> 1)) & 1
    else:
        v = c if j & 2 else s
        neg = ((j >> 2) & 1) ^ (math.copysign(1, x) < 0)
    return -v if neg else v


def m_mod2pi(x):
    q = f32(x / TWO_PI)
    if not math.isfinite(q):
        fl = q
    else:  # floorf(-0) is -0
        fl = math.copysign(0.0, q) if 0 <= q < 1 else float(math.floor(q))
    return fmaf(-TWO_PI, fl, x)


def m_sqrt(x):
    return f32(math.sqrt(x)) if x >= 0 else math.nan


def m_rsqrt(x):
    s = m_sqrt(x)
    if s == 0:
        return math.copysign(INF, s)
    return f32(1.0 / s)


MODEL = {"exp": m_exp, "log1p": m_log1p, "softplus": m_softplus, "sigmoid": m_sigmoid,
         "silu": m_silu, "sqrt": m_sqrt, "rsqrt": m_rsqrt, "tanh": m_tanh,
         "sin": lambda x: m_trig(x, False), "cos": lambda x: m_trig(x, True), "mod2pi": m_mod2pi}


# ------------------------------------------------------------------ references
def r_softplus(x):
    return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))


def r_sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def r_silu(x):
    return x / (1.0 + math.exp(-x))


def r_mod2pi(x):
    return x - TWO_PI * math.floor(x / TWO_PI)


def r_rsqrt(x):
    return 1.0 / math.sqrt(x)


REF = {"exp": math.exp, "log1p": math.log1p, "softplus": r_softplus, "sigmoid": r_sigmoid,
       "silu": r_silu, "sqrt": math.sqrt, "rsqrt": r_rsqrt, "tanh": math.tanh,
       "sin": math.sin, "cos": math.cos, "mod2pi": r_mod2pi}


# ------------------------------------------------------------------ sampling
def samples(lo, hi, n, seed):
    """array('f') of n float32 in [lo, hi]: half uniform in value, half uniform in
    float32 order (so tiny magnitudes and subnormals are hit as often as large ones).
    The same bytes feed both paths, so numpy and pure Python draw the same samples."""
    raw = random.Random(seed).randbytes(4 * n)
    half = n // 2
    a, b = _ord(lo), _ord(hi)
    width = b - a + 1
    if np is not None:
        u = np.frombuffer(raw, dtype=np.uint32).astype(np.uint64)
        vals = np.float64(lo) + np.float64(hi - lo) * (u[:half] * 2.0 ** -32)
        ords = a + ((u[half:] * np.uint64(width)) >> np.uint64(32)).astype(np.int64)
        u32 = np.where(ords < 0, 0x80000000 | -ords, ords).astype(np.uint32)
        return array("f", vals.astype(np.float32).tobytes() + u32.tobytes())
    u = array("I", raw)
    vals = array("f", [lo + (hi - lo) * (v * 2.0 ** -32) for v in u[:half]])
    ords = [a + (v * width >> 32) for v in u[half:]]
    return vals + array("f", array("I", [(0x80000000 | -o) if o < 0 else o for o in ords]).tobytes())


def max_ulp(name, xs, ys):
    """Largest error in float32 ulps at the true value (2^-149 below 2^-126), for
    mod2pi modulo the period; returns (err, x, y, true value)."""
    if np is not None:
        r = np.fromiter(map(REF[name], xs), dtype=np.float64, count=len(xs))
        d = np.abs(np.frombuffer(ys, dtype=np.float32).astype(np.float64) - r)
        if name == "mod2pi":
            d = np.minimum(d, np.abs(d - TWO_PI))
        e = np.where(r == 0, -149, np.maximum(np.frexp(r)[1] - 24, -149))
        err = d / np.ldexp(1.0, e)
        i = int(np.argmax(err))
        return float(err[i]), xs[i], ys[i], float(r[i])
    worst = (0.0, None, None, None)
    top, ref, periodic = 0.0, REF[name], name == "mod2pi"
    for x, y in zip(xs, ys):
        r = ref(x)
        d = abs(y - r)
        if periodic:
            d = min(d, abs(d - TWO_PI))
        if d * 16777216.0 <= top * abs(r):  # ulp(r) >= |r| 2^-24: cannot beat top
            continue
        err = d / math.ldexp(1.0, max(math.frexp(r)[1] - 24, -149) if r else -149)
        if err > top:
            top, worst = err, (err, x, y, r)
    return worst


# (function, domain, max ulp over every float32 of the domain: docs/numerics.md)
BOUNDS = [
    ("exp", LO, nextdown(HI), 1.011),  # exp(HI) itself rounds to +inf
    ("log1p", nextup(-1.0), 1e30, 2.394),
    ("softplus", LO, 100.0, 2.628),
    ("sigmoid", LO, 100.0, 2.481),
    ("silu", LO, 100.0, 2.404),
    ("sqrt", 0.0, FMAX, 0.5),
    ("rsqrt", TINY, FMAX, 1.491),
    ("tanh", -50.0, 50.0, 1.331),
    ("sin", 0.0, BELOW_TWO_PI, 1.486),
    ("cos", 0.0, BELOW_TWO_PI, 5.794),
    ("sin", -100.0, 100.0, 5.794),
    ("cos", -100.0, 100.0, 5.794),
    ("mod2pi", -50.0, 50.0, 0.5),
]


@pytest.mark.parametrize("case", range(len(BOUNDS)),
                         ids=[f"{b[0]}[{b[1]:.6g},{b[2]:.6g}]" for b in BOUNDS])
def test_accuracy_against_math(case):
    name, lo, hi, bound = BOUNDS[case]
    xs = samples(lo, hi, N, seed=20261130 + case)
    ys = call(name, xs)
    assert all(math.isfinite(y) for y in ys)
    err, x, y, r = max_ulp(name, xs, ys)
    assert err <= bound, f"{name}({x!r}) = {y!r}, true {r!r}: {err:.4f} ulp > {bound}"


# ------------------------------------------------------------------ bits vs the spec
SPECIALS = [0.0, -0.0, TINY, -TINY, BIG_SUB, -BIG_SUB, FMIN, -FMIN, 1.0, -1.0, 0.5, -0.5,
            20.0, nextup(20.0), nextdown(20.0), HI, nextup(HI), nextdown(HI), LO, nextup(LO),
            nextdown(LO), -HI, nextdown(-HI), -LO, 0.625, nextdown(0.625), -0.625,
            fbits(0x42317218), nextup(fbits(0x42317218)), fbits(0xBE95F61A),
            nextup(fbits(0xBE95F61A)), nextdown(fbits(0xBE95F61A)), fbits(0x3ED413CD),
            nextup(fbits(0x3ED413CD)), nextdown(fbits(0x3ED413CD)), nextup(-1.0), -1.0, -2.0,
            f32(math.pi / 2), f32(math.pi), f32(3 * math.pi / 2), BELOW_TWO_PI, TWO_PI,
            -TWO_PI, 50.0, -50.0, 100.0, -100.0, 8192.0, 16777215.0, 16777216.0, 1e30, -1e30,
            FMAX, -FMAX, INF, -INF, math.nan]
MODEL_DOMAINS = [(-100.0, 100.0), (-1.0, 1.0), (0.0, BELOW_TWO_PI), (-FMAX, FMAX)]


@pytest.mark.parametrize("name", sorted(MODEL))
def test_bits_equal_spec_model(name):
    xs = array("f", SPECIALS)
    for i, (lo, hi) in enumerate(MODEL_DOMAINS):
        xs += samples(lo, hi, 400, seed=7 + i)
    if name in ("sqrt", "rsqrt"):
        xs = array("f", [abs(x) for x in xs] + [-1.0, -TINY])
    got = call(name, xs)
    for x, y in zip(xs, got):
        want = MODEL[name](x)
        assert same(y, want), f"{name}({x!r}): got {y!r} ({bits(y):#010x}), spec {want!r}"


@pytest.mark.parametrize("vec,scalar", [("vexp", "exp"), ("vsilu", "silu")])
def test_vector_forms_equal_scalar_on_every_isa(vec, scalar):
    """The hot loops' vector exp and silu (reference/simd.h: AVX-512, AVX2 and the
    baseline's scalar form) give numerics.h's bits. Checked by hand over all 2^32
    inputs for the AVX-512 and AVX2 forms; here the specials, 2^18 random bit patterns
    and an odd count, so the partial last vector is exercised too."""
    raw = random.Random(11).randbytes(4 << 18)
    xs = array("f", SPECIALS) + array("f", raw[:4 * ((1 << 18) - 3)])
    best = _core._isa(-1)
    try:
        want = call(scalar, xs)
        for isa in range(best + 1):
            if _core._isa(isa) == isa:
                got = call(vec, xs)
                bad = [i for i in range(len(xs)) if not same(got[i], want[i])]
                assert not bad, (f"ISA {isa}: {vec}({xs[bad[0]]!r}) = {got[bad[0]]!r}, "
                                 f"{scalar} gives {want[bad[0]]!r}")
    finally:
        _core._isa(best)


# ------------------------------------------------------------------ edge cases
def test_exp_core_equals_exp_on_its_domain():
    """mb_exp_core (the scans' exp where delta * A is known to lie in [LO, 0]) gives
    mb_exp's bits there: the domain's ends, the subnormal results near LO, the points
    where exp's k steps, and 2^18 random inputs (checked by hand over all 1.1e9 floats
    of the domain)."""
    xs = [LO, nextup(LO), -0.0, 0.0, -TINY, -BIG_SUB, -1e-30, -0.5, -1.0, -87.0, -86.5]
    for k in range(0, 127):  # k = floor(x log2(e) + 0.5) changes at x = (k - 0.5) ln 2
        m = f32(-(k - 0.5) * math.log(2.0))
        if m >= LO:
            xs += [m, nextup(m), nextdown(m)]
    xs += samples(LO, 0.0, 1 << 18, seed=21)
    xs = [x for x in xs if LO <= x <= 0.0]
    got, want = call("exp_core", xs), call("exp", xs)
    bad = [i for i in range(len(xs)) if not same(got[i], want[i])]
    assert not bad, f"exp_core({xs[bad[0]]!r}) = {got[bad[0]]!r}, exp gives {want[bad[0]]!r}"


def test_exp_thresholds():
    # exp(HI) is 3.4028245e38 > FLT_MAX + ulp/2: +inf is its correct rounding too
    assert one("exp", HI) == INF and one("exp", nextup(HI)) == INF
    assert one("exp", nextdown(HI)) == f32(math.exp(nextdown(HI))) < INF
    assert FMIN <= one("exp", LO) < 1.2e-38
    assert bits(one("exp", nextdown(LO))) == 0  # +0.0 below the threshold, by definition
    assert [one("exp", x) for x in (0.0, -0.0, TINY, -TINY, BIG_SUB, -BIG_SUB)] == [1.0] * 6
    assert one("exp", INF) == INF and bits(one("exp", -INF)) == 0
    assert math.isnan(one("exp", math.nan))


def test_log1p_edges():
    for x in (0.0, -0.0, TINY, -TINY, BIG_SUB, -BIG_SUB, FMIN, -FMIN):
        assert bits(one("log1p", x)) == bits(x)  # log1p(x) = x, sign of zero kept
    assert one("log1p", -1.0) == -INF
    assert math.isnan(one("log1p", -2.0)) and math.isnan(one("log1p", -INF))
    assert one("log1p", INF) == INF and math.isnan(one("log1p", math.nan))
    assert one("log1p", FMAX) == f32(math.log1p(FMAX))


def test_softplus_switch_at_20():
    e20 = one("exp", 20.0)
    assert one("softplus", 20.0) == one("log1p", e20)  # x <= 20 takes log1p(exp(x))
    d = nextdown(20.0)
    assert one("softplus", d) == one("log1p", one("exp", d))
    u = nextup(20.0)
    assert bits(one("softplus", u)) == bits(u)  # above 20: x itself
    assert one("softplus", f32(1e30)) == f32(1e30) and one("softplus", FMAX) == FMAX
    for x in (nextdown(LO), -100.0, -FMAX):  # exp underflows to +0, so softplus is +0
        assert bits(one("softplus", x)) == 0
    for x in (0.0, -0.0, TINY, -TINY):
        assert one("softplus", x) == f32(math.log(2.0))


def test_sigmoid_silu_tails():
    for x in (0.0, -0.0, TINY, -TINY):
        assert one("sigmoid", x) == 0.5
    assert bits(one("silu", 0.0)) == 0 and bits(one("silu", -0.0)) == 0x80000000
    for x in (nextdown(-HI), -100.0, -1e30, -FMAX):  # exp(-x) overflows: 1/inf, x/inf
        assert bits(one("sigmoid", x)) == 0
        assert bits(one("silu", x)) == 0x80000000
    for x in (HI, 100.0, FMAX):
        assert one("sigmoid", x) == 1.0 and one("silu", x) == x
    # within the domain of the accuracy bound the results stay normal or exact
    assert one("sigmoid", LO) >= FMIN


def test_tanh_symmetry_and_saturation():
    xs = samples(-50.0, 50.0, 20000, seed=3)
    pos, neg = call("tanh", xs), call("tanh", [-x for x in xs])
    assert all(bits(a) ^ bits(b) == 0x80000000 for a, b in zip(pos, neg))
    assert bits(one("tanh", -0.0)) == 0x80000000 and bits(one("tanh", 0.0)) == 0
    t = fbits(0x42317218)
    assert one("tanh", nextup(t)) == 1.0 and one("tanh", -nextup(t)) == -1.0
    assert one("tanh", INF) == 1.0 and one("tanh", -INF) == -1.0
    assert one("tanh", TINY) == TINY and one("tanh", -BIG_SUB) == -BIG_SUB


def test_sin_cos_symmetry_and_range():
    xs = samples(0.0, 100.0, 20000, seed=4)
    ms = array("f", [-x for x in xs])
    assert all(bits(a) ^ bits(b) == 0x80000000 for a, b in zip(call("sin", xs), call("sin", ms)))
    assert all(bits(a) == bits(b) for a, b in zip(call("cos", xs), call("cos", ms)))
    assert bits(one("sin", -0.0)) == 0x80000000 and one("cos", -0.0) == 1.0
    assert one("sin", TINY) == TINY and one("cos", BIG_SUB) == 1.0
    # past 2^24 - 1 Cephes has no precision left and gives 0; non-finite gives NaN
    assert one("sin", 16777216.0) == 0.0 and one("cos", 1e30) == 0.0
    assert all(math.isnan(one(f, x)) for f in ("sin", "cos") for x in (INF, -INF, math.nan))


def test_mod2pi_quotient_edges():
    """mb_mod2pi takes its quotient by a multiply and two fmas, not a division: where
    floor() of the quotient turns (x at and next to multiples of TWO_PI, up to 2^24
    periods), at zeros and subnormals, its bits are the spec's (checked by hand over
    all 2^32 inputs)."""
    xs = [0.0, -0.0, TINY, -TINY, BIG_SUB, -BIG_SUB, INF, -INF, math.nan]
    for k in [1, 2, 3, 7, 100, 1000, 12345, 1 << 20, (1 << 24) - 1] + list(range(-50, 50)):
        m = f32(k * TWO_PI)
        xs += [m, nextup(m), nextdown(m), -m, nextup(-m), nextdown(-m)]
    got = call("mod2pi", xs)
    for x, y in zip(xs, got):
        want = m_mod2pi(x)
        assert same(y, want), f"mod2pi({x!r}): got {y!r} ({bits(y):#010x}), spec {want!r}"


def test_mod2pi_range():
    xs = samples(-50.0, 50.0, 50000, seed=5)
    ys = call("mod2pi", xs)
    # [0, TWO_PI] up to the rounding of x / TWO_PI, which can leave a tiny negative
    assert all(-1e-6 < y <= TWO_PI for y in ys)
    assert one("mod2pi", TWO_PI) == 0.0 and one("mod2pi", -TWO_PI) == 0.0
    assert one("mod2pi", f32(math.pi)) == f32(math.pi)
    assert one("mod2pi", -f32(math.pi)) == f32(math.pi)


def test_mod2pi_near_equals_mod2pi_on_its_domain():
    """mb_mod2pi_near (the angle walk's reduction where th + ta * dt is known to lie in
    [-TWO_PI, 2 TWO_PI)) gives mb_mod2pi's bits there: the domain's ends, the points
    where floor(q) steps (TWO_PI, the negative subnormals next to -0) with their
    neighbours, zeros, and 2^18 random inputs (checked by hand over all 2.2e9 floats
    of the domain)."""
    lo, hi = -TWO_PI, f32(2 * TWO_PI)
    xs = [lo, nextup(lo), nextdown(hi), 0.0, -0.0, TINY, -TINY, -2 * TINY, -3 * TINY,
          -4 * TINY, -5 * TINY, BIG_SUB, -BIG_SUB, TWO_PI, nextup(TWO_PI), nextdown(TWO_PI),
          f32(math.pi), -f32(math.pi), -1e-30, 1e-30]
    xs += samples(lo, nextdown(hi), 1 << 18, seed=22)
    assert all(lo <= x < hi for x in xs)
    got, want = call("mod2pi_near", xs), call("mod2pi", xs)
    bad = [i for i in range(len(xs)) if not same(got[i], want[i])]
    assert not bad, f"mod2pi_near({xs[bad[0]]!r}) = {got[bad[0]]!r}, mod2pi {want[bad[0]]!r}"
    # outside the domain it is not mod2pi: the walk must check its range
    assert one("mod2pi_near", hi) != one("mod2pi", hi)
    assert one("mod2pi_near", nextdown(lo)) != one("mod2pi", nextdown(lo))


def test_sqrt_rsqrt_edges():
    assert bits(one("sqrt", -0.0)) == 0x80000000 and one("sqrt", INF) == INF
    assert math.isnan(one("sqrt", -1.0)) and math.isnan(one("rsqrt", -TINY))
    assert one("rsqrt", 0.0) == INF and one("rsqrt", -0.0) == -INF and one("rsqrt", INF) == 0.0
    assert one("rsqrt", 4.0) == 0.5 and one("sqrt", TINY) == f32(math.sqrt(TINY))


# ------------------------------------------------------------------ dot v1
LEAF = 8192


def dot_data(k, seed):
    """Mixed magnitudes and signs, so every change of order shows in the bits."""
    rng = random.Random(seed)
    a = array("f", [rng.uniform(-1, 1) * 2.0 ** rng.randint(-12, 12) for _ in range(k)])
    b = array("f", [rng.uniform(-1, 1) * 2.0 ** rng.randint(-12, 12) for _ in range(k)])
    return a, b


def chain(a, b):
    acc = 0.0
    for x, y in zip(a, b):
        acc = fmaf(x, y, acc)
    return acc


def tree(parts):
    """Level-by-level pairs (0,1), (2,3), ...; an odd last node is carried up."""
    while len(parts) > 1:
        nxt = [f32(parts[i] + parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts = nxt
    return parts[0]


def dot_v1(a, b):
    k = len(a)
    if k <= LEAF:
        return chain(a, b)
    return tree([chain(a[s:s + LEAF], b[s:s + LEAF]) for s in range(0, k, LEAF)])


@pytest.mark.parametrize("k", [0, 1, 2, 3, 7, 64, 1000, 8191, 8192])
def test_dot_chain_exact(k):
    a, b = dot_data(k, seed=k)
    assert same(_core._dot(a, b), dot_v1(a, b))


def test_dot_chain_signed_zero_seed():
    # the chain is seeded with +0.0: a single product -0.0 gives +0.0
    assert bits(_core._dot(array("f", [-0.0]), array("f", [1.0]))) == 0
    assert bits(_core._dot(array("f", []), array("f", []))) == 0


@pytest.mark.parametrize("k", [LEAF + 1, 2 * LEAF + 1, 3 * LEAF + 5])
def test_dot_leaf_tree_exact(k):
    a, b = dot_data(k, seed=k)
    assert same(_core._dot(a, b), dot_v1(a, b))


X = 1.0 + 2.0 ** -12  # X * X = 1 + 2^-11 + 2^-24: its float32 rounding is a tie


def leaves_with(values, k, last):
    """Data whose leaf chains give exactly `values` (one product each), optionally
    ending in the product X * X."""
    a, b = array("f", [0.0]) * k, array("f", [1.0]) * k
    for i, v in enumerate(values):
        a[i * LEAF] = v
    if last:
        a[k - 1], b[k - 1] = X, X
    return a, b


# (k, leaf values, ends in X*X, dot v1, one serial chain over all k)
CONTROLS = [
    (LEAF + 1, [8192.0], True, 8193.0, 8193.0 + 2.0 ** -10),
    (2 * LEAF + 1, [4096.0, 4096.0], True, 8193.0, 8193.0 + 2.0 ** -10),
    (3 * LEAF + 5, [2.0 ** 24, 1.0, 1.0, 1.0], False, 2.0 ** 24 + 2, 2.0 ** 24),
    (4 * LEAF + 5, [2.0 ** 24, 1.0, 1.0, 1.0, 1.0], False, 2.0 ** 24 + 4, 2.0 ** 24),
    (6 * LEAF + 5, [2.0 ** 24, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], False, 2.0 ** 24 + 4, 2.0 ** 24),
]


@pytest.mark.parametrize("k,values,tail,want,serial", CONTROLS, ids=[str(c[0]) for c in CONTROLS])
def test_dot_leaf_structure_controls(k, values, tail, want, serial):
    # leaves end at multiples of 8192, combine as a balanced tree, and the last leaf's
    # chain rounds on its own: a serial chain, or another tree, gives other bits
    a, b = leaves_with(values, k, tail)
    assert dot_v1(a, b) == want and chain(a, b) == serial != want
    assert _core._dot(a, b) == want


_BIG = {}


def big_data():
    if not _BIG:
        _BIG["ab"] = dot_data(17 * LEAF + 1, seed=17)
    return _BIG["ab"]


@pytest.mark.parametrize("leaves", [2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17])
def test_dot_leaf_tree_shapes(leaves):
    # each leaf's chain is checked exactly above; here the combination of P leaves
    k = (leaves - 1) * LEAF + 1 + leaves * 37
    a, b = (v[:k] for v in big_data())
    parts = [_core._dot(a[s:s + LEAF], b[s:s + LEAF]) for s in range(0, k, LEAF)]
    assert len(parts) == leaves
    assert same(_core._dot(a, b), tree(parts))
