"""mamba.lowbit (SPEC 8): the native and pure-Python conversions agree byte for byte,
both match an exact model written with Fractions, a block built from packed weights
equals the float32 block on the expanded weights bit for bit, and every refusal names
its argument. Numpy-free."""
import array
import random
import struct
from fractions import Fraction

import pytest

import mamba
from mamba import lowbit
from _util import rand, raw, state_bytes
from blocks import BLOCKS, gpu_backends

KERNELS = {"native": lowbit._native, "pure": lowbit._pure}


def from_bits(bits, shape):
    """A float32 Array holding the given uint32 bit patterns."""
    return mamba.asarray(memoryview(array.array("I", bits)).cast("B").cast("f"), shape)


def exact(bits):
    """The exact value of a finite float32 bit pattern."""
    return Fraction(struct.unpack("<f", struct.pack("<I", bits))[0])


def f32_bits_of(value):
    """The bit pattern of an exact Fraction if it is a finite float32, else None."""
    try:
        b = struct.unpack("<I", struct.pack("<f", float(value)))[0]
    except OverflowError:
        return None
    if b & 0x7f800000 == 0x7f800000 or exact(b) != value:
        return None
    return b


def random_finite_bits(rng, n):
    out = []
    while len(out) < n:
        b = rng.getrandbits(32)
        if b & 0x7f800000 != 0x7f800000:
            out.append(b)
    return out


# Edge patterns: zeros, subnormals, bf16 ties (even and odd), values around them,
# the largest finite values and the last ones that do not overflow bfloat16.
BF16_EDGES = [
    0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x00007fff, 0x00008000, 0x00008001,
    0x00018000, 0x0001ffff, 0x007fffff, 0x00800000, 0x3f800000, 0x3f808000, 0x3f818000,
    0x3f807fff, 0x3f808001, 0xbf808000, 0xbf818000, 0x3fffffff, 0x7f7f7fff, 0x7f7effff,
    0x7f7e8000, 0xff7f7fff, 0x3effffff, 0x00ff8000,
]
OVERFLOW = [0x7f7fffff, 0x7f7f8000, 0xff7fffff, 0xff7f8000]


# ------------------------------------------------------------------ bfloat16
def bf16_model(bits):
    """Round to nearest even by exact comparison of the two bf16 neighbours."""
    lo = bits >> 16
    if bits & 0xffff == 0:
        return lo
    v = abs(exact(bits))
    lo_v = abs(exact(lo << 16))
    # the next magnitude up; past the largest finite bf16 it is inf (2^128 as a value)
    hi = lo + 1
    hi_v = Fraction(2) ** 128 if hi & 0x7fff == 0x7f80 else abs(exact(hi << 16))
    if v - lo_v < hi_v - v or (v - lo_v == hi_v - v and lo % 2 == 0):
        return lo
    return hi


@pytest.mark.parametrize("impl", KERNELS)
def test_bf16_round_to_nearest_even_matches_exact_model(impl):
    rng = random.Random(1)
    bits = BF16_EDGES + OVERFLOW + random_finite_bits(rng, 3000)
    out, over = KERNELS[impl].bf16_pack(from_bits(bits, (len(bits),)))
    assert list(out) == [bf16_model(b) for b in bits]
    assert over == len(BF16_EDGES), "the first overflowing value is reported"


def test_bf16_native_equals_pure_including_nan_and_inf():
    rng = random.Random(2)
    special = [0x7f800000, 0xff800000, 0x7f800001, 0x7fa00000, 0x7fc00000, 0xffffffff,
               0xff800001, 0x7fffffff]
    bits = special + BF16_EDGES + OVERFLOW + [rng.getrandbits(32) for _ in range(4000)]
    x = from_bits(bits, (len(bits),))
    nat, pur = lowbit._native.bf16_pack(x), lowbit._pure.bf16_pack(x)
    assert nat[0].tobytes() == pur[0].tobytes() and nat[1] == pur[1]
    out = list(nat[0])
    assert out[:8] == [0x7f80, 0xff80, 0x7fc0, 0x7fe0, 0x7fc0, 0xffff, 0xffc0, 0x7fff], \
        "inf kept, NaN kept quiet with its sign and top payload"
    assert nat[1] == len(special) + len(BF16_EDGES), "inf and NaN inputs are not overflows"


def test_bf16_unpack_is_shift_and_native_equals_pure():
    rng = random.Random(3)
    h = [rng.getrandbits(16) for _ in range(5000)] + [0, 0x8000, 0x7f80, 0x0001]
    bits = array.array("H", h)
    a = lowbit._native.bf16_unpack(bits, (len(h),))
    b = lowbit._pure.bf16_unpack(bits, (len(h),))
    assert raw(a) == raw(b)
    assert list(memoryview(a).cast("B").cast("I")) == [v << 16 for v in h]


# ---------------------------------------------------------------------- int8
def int8_rows(rng):
    """Rows covering the clamp, ties, subnormals, zeros and the largest magnitudes."""
    e = 2.0 ** -10
    rows = [
        [127.5 * e, 126.5 * e, 125.5 * e, -125.5 * e, 0.5 * e, 1.5 * e, -0.5 * e, 2.5 * e],
        [127.99 * e, -127.99 * e, 127.4 * e, 64 * e, 63.5 * e, -0.0, 0.0, 1e-30],
        [0.0, -0.0, 0.0, 0.0, -0.0, 0.0, 0.0, 0.0],
        [3.4028234663852886e38, -3.0e38, 1.0, -1e37, 2.0 ** 121, 0.0, 5e36, 1.7e38],
        [2.0 ** -149, -2.0 ** -149, 3 * 2.0 ** -149, 0.0, 2.0 ** -149, 0.0, 0.0, 0.0],
        [1e-39, -2e-39, 1.1754942e-38, 5e-45, 1e-40, 0.0, 3e-39, -1e-38],
        [-(2.0 ** 20), 2.0 ** 13, 2.0 ** 14 - 1, 96.0, -97.0, 1.0, 0.75, 2.0 ** 13 + 64],
    ]
    rows += [[rng.gauss(0, 1) * 2.0 ** rng.randint(-130, 120) for _ in range(8)]
             for _ in range(200)]
    rows += [[rng.gauss(0, 1) for _ in range(8)] for _ in range(50)]
    return rows


def int8_input(rows):
    flat = array.array("f", [v for r in rows for v in r])
    return mamba.asarray(flat, (len(rows), len(rows[0])))


def test_int8_native_equals_pure():
    x = int8_input(int8_rows(random.Random(4)))
    rows, cols = x.shape
    nc, ne = lowbit._native.i8_pack(x, rows, cols)
    pc, pe = lowbit._pure.i8_pack(x, rows, cols)
    assert nc.tobytes() == pc.tobytes() and ne.tobytes() == pe.tobytes()
    na, nbad = lowbit._native.i8_unpack(nc, ne, rows, cols)
    pa, pbad = lowbit._pure.i8_unpack(pc, pe, rows, cols)
    assert nbad == pbad == -1 and raw(na) == raw(pa)


@pytest.mark.parametrize("impl", KERNELS)
def test_int8_matches_exact_model(impl):
    x = int8_input(int8_rows(random.Random(5)))
    rows, cols = x.shape
    codes, exps = KERNELS[impl].i8_pack(x, rows, cols)
    vals, bad = KERNELS[impl].i8_unpack(codes, exps, rows, cols)
    assert bad == -1
    xb = list(memoryview(x).cast("B").cast("I"))
    vb = list(memoryview(vals).cast("B").cast("I"))
    clamped = 0
    for r in range(rows):
        xs = [exact(b) for b in xb[r * cols:(r + 1) * cols]]
        amax, e = max(abs(v) for v in xs), exps[r]
        if amax == 0:
            assert e == 0 and all(c == 0 for c in codes[r * cols:(r + 1) * cols])
            continue
        assert 2 ** Fraction(e + 6) <= amax < 2 ** Fraction(e + 7), "e = floor(log2 absmax) - 6"
        for c, xv in enumerate(xs):
            i = r * cols + c
            code = codes[i]
            assert code == max(-127, min(127, round(xv / 2 ** Fraction(e)))), (r, c)
            value = code * 2 ** Fraction(e)
            assert exact(vb[i]) == value, "unpack is exactly code * 2^e"
            if abs(code) == 127 and abs(xv) > Fraction(127, 1) * 2 ** Fraction(e):
                clamped += 1
                assert abs(xv - value) < 2 ** Fraction(e)
            else:
                assert abs(xv - value) <= 2 ** Fraction(e - 1)
    assert clamped >= 2, "the edge rows exercise the clamp"


def test_int8_negative_zero_and_zero_row():
    x = mamba.asarray(array.array("f", [-0.0, 0.0, -0.0, 1.0, -0.0, 0.0]), (2, 3))
    w = lowbit.pack_one(x, "int8")
    assert list(w.exponents) == [0, -6] and w.codes.tolist() == [[0, 0, 0], [64, 0, 0]]
    assert raw(lowbit.unpack(w)) == raw(mamba.asarray(array.array("f", [0, 0, 0, 1, 0, 0])))


def int8_value_model(code, e):
    """Bits of code * 2^e when that is an exact finite float32 and code != -128."""
    if code == 0:
        return 0
    if code == -128 or not -300 < e < 300:  # beyond float32 range for every other code
        return None
    return f32_bits_of(code * 2 ** Fraction(e))


@pytest.mark.parametrize("impl", KERNELS)
def test_int8_unpack_validity_matches_model(impl):
    cases = [(c, e) for c in range(-128, 128)
             for e in list(range(-160, -140)) + list(range(115, 125)) + [0, -2 ** 31, 2 ** 31 - 1]]
    for c, e in cases:
        one_c, one_e = array.array("b", [c]), array.array("i", [e])
        vals, bad = KERNELS[impl].i8_unpack(one_c, one_e, 1, 1)
        want = int8_value_model(c, e)
        if want is None:
            assert bad == 0, (c, e)
        else:
            assert bad == -1 and list(memoryview(vals).cast("B").cast("I")) == [want], (c, e)


def test_int8_unpack_reports_first_bad_index_alike():
    codes = array.array("b", [1, 2, 3, 4, 5, -128, 1, 1, 127])
    exps = array.array("i", [0, 0, 122])
    for impl in KERNELS.values():
        assert impl.i8_unpack(codes, exps, 3, 3, write=False) == (None, 5)
    exps[1] = 1
    codes[5] = 0
    for impl in KERNELS.values():
        assert impl.i8_unpack(codes, exps, 3, 3, write=False) == (None, 8)


# ------------------------------------------------------------ public surface
@pytest.fixture(params=list(KERNELS))
def kernels(request, monkeypatch):
    monkeypatch.setattr(lowbit, "_kernels", KERNELS[request.param])
    return request.param


@pytest.mark.parametrize("name", list(BLOCKS))
def test_pack_native_equals_pure_on_block_weights(name, monkeypatch):
    w = mamba.random_weights(name, BLOCKS[name]["d_model"], seed=3)
    for fmt in ("bfloat16", "int8"):
        got = {}
        for impl, k in KERNELS.items():
            monkeypatch.setattr(lowbit, "_kernels", k)
            got[impl] = lowbit.pack(w, fmt)
        for key, v in got["native"].items():
            if key in packed_names(w):
                assert v == got["pure"][key], (fmt, key)
            else:
                assert v is w[key] and got["pure"][key] is w[key]


def packed_names(w):
    return [k for k, v in w.items() if memoryview(v).ndim == 2]


def test_pack_formats_and_round_trip(kernels):
    x = rand((6, 40), 1)
    f = lowbit.pack_one(x, "float32")
    assert isinstance(f, mamba.Array) and raw(f) == raw(x) and f.ptr != x.ptr
    b = lowbit.pack_one(x, "bfloat16")
    assert isinstance(b, lowbit.BF16Weight) and b.shape == (6, 40) and b.nbytes == 480
    assert b.bits.format == "H" and b.bits.shape == (6, 40) and b.bits.readonly
    i = lowbit.pack_one(x, "int8")
    assert isinstance(i, lowbit.Int8Weight) and i.nbytes == 240 + 24
    assert i.codes.format == "b" and i.exponents.shape == (6,) and i.codes.readonly
    for p in (b, i):
        u = lowbit.unpack(p)
        assert u.shape == (6, 40) and raw(u) != raw(x), "packing rounds"
        assert raw(lowbit.unpack(lowbit.pack_one(u, p.format))) == raw(u), "idempotent"
    assert raw(lowbit.unpack(x)) == raw(x)


def test_serialised_bytes_rebuild_the_same_weight(kernels):
    x = rand((5, 33), 2, scale=40.0)
    b = lowbit.pack_one(x, "bfloat16")
    b2 = lowbit.BF16Weight(b.bits.tobytes(), b.shape)
    assert b2 == b and raw(lowbit.unpack(b2)) == raw(lowbit.unpack(b))
    assert lowbit.BF16Weight(array.array("H", b.bits.tobytes()), [5, 33]) == b
    i = lowbit.pack_one(x, "int8")
    i2 = lowbit.Int8Weight(i.codes.tobytes(), i.exponents.tobytes(), i.shape)
    assert i2 == i and raw(lowbit.unpack(i2)) == raw(lowbit.unpack(i))
    assert lowbit.Int8Weight(array.array("b", i.codes.tobytes()),
                             array.array("i", i.exponents.tobytes()), (5, 33)) == i
    assert b != i and i != lowbit.pack_one(rand((5, 33), 3), "int8")


def test_pack_dict_packs_2d_only_and_leaves_caller_untouched(kernels):
    w = mamba.random_weights("mamba1", 16, seed=1)
    before = {k: raw(v) for k, v in w.items()}
    keys = list(w)
    p = lowbit.pack(w, "int8")
    assert list(p) == keys and list(w) == keys
    assert {k for k, v in p.items() if isinstance(v, lowbit.Int8Weight)} == set(packed_names(w))
    assert p["conv1d.weight"] is w["conv1d.weight"] and p["D"] is w["D"]
    assert {k: raw(v) for k, v in w.items()} == before


# -------------------------------------------------------------- block lanes
LOWBIT_CASES = [(n, be) for n in BLOCKS for be in ["cpu"] + gpu_backends(n)]


@pytest.mark.parametrize("name,backend", LOWBIT_CASES,
                         ids=[f"{n}-{be}" for n, be in LOWBIT_CASES])
@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "mixed"])
def test_block_from_packed_equals_block_on_expanded(name, backend, fmt):
    spec = BLOCKS[name]
    w = mamba.random_weights(name, spec["d_model"], seed=7)
    if fmt == "mixed":
        packed = lowbit.pack(w, "int8")
        packed["out_proj.weight"] = lowbit.pack_one(w["out_proj.weight"], "bfloat16")
    else:
        packed = lowbit.pack(w, fmt)
    expanded = {k: lowbit.unpack(v) for k, v in packed.items()}
    a = spec["cls"](packed, backend=backend)
    b = spec["cls"](expanded, backend=backend)
    assert a.weight_format == fmt and b.weight_format == "float32"
    x = rand((2, 9, a.d_model), 8)
    sa, sb = a.allocate_state(2), b.allocate_state(2)
    ya = a.forward(x, sa)
    assert raw(ya) == raw(b.forward(x, sb))
    xt = rand((2, 1, a.d_model), 9)
    assert raw(a.step(xt, sa)) == raw(b.step(xt, sb))
    assert state_bytes(sa) == state_bytes(sb)
    original = spec["cls"](w, backend=backend)
    assert raw(original.forward(x)) != raw(ya), "negative control: packing changed the weights"


def test_float32_weights_pass_through_unexpanded():
    w = mamba.random_weights("mamba1", 16)
    assert lowbit.expand(w, "Mamba1Block") == (w, "float32")
    assert lowbit.expand(w, "Mamba1Block")[0] is w, "float32 weights stay borrowed"
    assert mamba.Mamba1Block(w, backend="cpu").weight_format == "float32"


# ------------------------------------------------------------------ refusals
def test_refuses_unknown_format():
    with pytest.raises(ValueError, match=r"fmt must be one of \('float32', 'bfloat16', "
                                         r"'int8'\), got 'fp8'"):
        lowbit.pack_one(rand((2, 2), 1), "fp8")
    with pytest.raises(ValueError, match="fmt must be one of"):
        lowbit.pack({}, "int4")


@pytest.mark.parametrize("fmt", lowbit.FORMATS)
def test_refuses_non_float32_and_non_2d(fmt):
    with pytest.raises(TypeError, match="array has dtype float64"):
        lowbit.pack_one(memoryview(array.array("d", [1.0] * 4)).cast("B").cast("d", (2, 2)), fmt)
    with pytest.raises(ValueError, match=r"array must be 2-D \(rows, cols\), not empty, to "
                                         r"pack, got shape \(4,\)"):
        lowbit.pack_one(array.array("f", [1.0] * 4), fmt)
    with pytest.raises(ValueError, match=r"not empty, to pack, got shape \(0, 3\)"):
        lowbit.pack_one(mamba.zeros((0, 3)), fmt)
    with pytest.raises(TypeError, match="array is a list"):
        lowbit.pack_one([[1.0]], fmt)


@pytest.mark.parametrize("fmt", lowbit.FORMATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_refuses_non_finite_by_name_and_index(kernels, fmt, bad):
    w = mamba.random_weights("mamba1", 16)
    x = w["x_proj.weight"]
    memoryview(x).cast("B").cast("f")[37] = bad
    before = raw(x)
    with pytest.raises(ValueError,
                       match="x_proj.weight holds a non-finite value .* flat index 37$"):
        lowbit.pack(w, fmt)
    with pytest.raises(ValueError, match="array holds a non-finite value .* flat index 37$"):
        lowbit.pack_one(x, fmt)
    assert raw(x) == before


def test_refuses_bfloat16_overflow(kernels):
    x = from_bits([0x3f800000, 0x7f7f7fff, 0xff7f8000, 0x7f7fffff], (2, 2))
    with pytest.raises(ValueError, match="holds -3.3.*e\\+38 at flat index 2, which rounds to "
                                         "infinity in bfloat16"):
        lowbit.pack_one(x, "bfloat16")
    assert lowbit.pack_one(x, "int8").exponents.tolist() == [121, 121]


def test_refuses_repacking_and_non_dicts():
    p = lowbit.pack_one(rand((2, 2), 1), "int8")
    with pytest.raises(TypeError, match="array is already a Int8Weight; unpack"):
        lowbit.pack_one(p, "bfloat16")
    with pytest.raises(TypeError, match="in_proj.weight is already a Int8Weight"):
        lowbit.pack({"in_proj.weight": p}, "int8")
    with pytest.raises(TypeError, match="weights must be a dict"):
        lowbit.pack([rand((2, 2), 1)], "int8")
    with pytest.raises(TypeError, match="packed is a list"):
        lowbit.unpack([1.0])


def test_weight_constructors_refuse_bad_buffers():
    with pytest.raises(ValueError, match=r"shape must be \(rows, cols\)"):
        lowbit.BF16Weight(bytes(8), (4,))
    with pytest.raises(ValueError, match=r"shape must be \(rows, cols\) of positive"):
        lowbit.BF16Weight(bytes(0), (2, 0))
    with pytest.raises(ValueError, match=r"bits holds 6 bytes, expected 4 values \(8 bytes\)"):
        lowbit.BF16Weight(bytes(6), (2, 2))
    with pytest.raises(TypeError, match="bits must hold uint16 values .* format 'f'"):
        lowbit.BF16Weight(array.array("f", [0.0] * 4), (2, 2))
    with pytest.raises(TypeError, match="bits must be a buffer"):
        lowbit.BF16Weight([0, 0, 0, 0], (2, 2))
    with pytest.raises(TypeError, match="exponents must hold int32 values .* format 'h'"):
        lowbit.Int8Weight(bytes(4), array.array("h", [0, 0]), (2, 2))
    with pytest.raises(ValueError, match="codes holds 3 bytes, expected 4 values"):
        lowbit.Int8Weight(bytes(3), array.array("i", [0, 0]), (2, 2))
    with pytest.raises(ValueError, match=r"code -128 at flat index 3 \(row 1, exponent 0\)"):
        lowbit.Int8Weight(array.array("b", [0, 0, 0, -128]), array.array("i", [0, 0]), (2, 2))
    with pytest.raises(ValueError, match=r"code 127 at flat index 0 \(row 0, exponent 122\)"):
        lowbit.Int8Weight(array.array("b", [127, 0]), array.array("i", [122]), (1, 2))
    with pytest.raises(ValueError, match=r"code 3 at flat index 1 \(row 0, exponent -150\)"):
        lowbit.Int8Weight(array.array("b", [2, 3]), array.array("i", [-150]), (1, 2))


def test_block_refuses_non_finite_or_misshapen_packed_weights():
    w = mamba.random_weights("mamba1", 16)
    p = lowbit.pack(w, "bfloat16")
    bits = array.array("H", p["out_proj.weight"].bits.tobytes())
    bits[5] = 0x7f80
    p["out_proj.weight"] = lowbit.BF16Weight(bits, p["out_proj.weight"].shape)
    with pytest.raises(ValueError,
                       match="out_proj.weight holds a non-finite value .* flat index 5$"):
        mamba.Mamba1Block(p, backend="cpu")
    p["out_proj.weight"] = lowbit.pack_one(rand((32, 16), 1), "int8")
    with pytest.raises(ValueError,
                       match=r"out_proj.weight has shape \(32, 16\), expected \(16, 32\)"):
        mamba.Mamba1Block(p, backend="cpu")
