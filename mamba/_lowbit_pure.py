"""Pure-Python low-bit kernels: the same bytes as reference/lowbit.c, computed with
Python integers on the IEEE bit patterns (no numpy, no float arithmetic, so no
rounding can creep in). Slow; the native kernels run by default and the tests check
that both agree byte for byte. Same interface as lowbit._native."""
import array

from . import _core


def _bits(x):
    """The uint32 bit patterns of a float32 host Array."""
    return memoryview(x).cast("B").cast("I")


def _bf16(b):
    if b & 0x7fffffff > 0x7f800000:
        return (b >> 16) | 0x0040  # NaN: keep sign and top payload, set the quiet bit
    # round to nearest even on the 16 dropped bits; a carry into the exponent rounds
    # correctly, up to inf past the largest bfloat16
    return (b + 0x7fff + ((b >> 16) & 1)) >> 16


def bf16_pack(x):
    """(uint16 bits, index of the first finite value that rounded to +-inf or -1)."""
    src = _bits(x)
    out = array.array("H", map(_bf16, src))
    for i, (b, h) in enumerate(zip(src, out)):
        if h & 0x7f80 == 0x7f80 and b & 0x7f800000 != 0x7f800000:
            return out, i
    return out, -1


def bf16_unpack(bits, shape):
    out = _core.empty(shape)
    _bits(out)[:] = array.array("I", (h << 16 for h in bits))
    return out


def _ilog2(mag):
    """floor(log2) of a finite nonzero float32 magnitude given by its bits."""
    E = mag >> 23
    return E - 127 if E else mag.bit_length() - 150


def _scaled_rne(mag, e):
    """rne(|x| * 2^-e) for the magnitude bits of a finite x."""
    E = mag >> 23
    M = (mag & 0x7fffff) | 0x800000 if E else mag
    q = (E - 150 if E else -149) - e
    if q >= 0:
        return M << q
    k = -q
    r, rem, half = M >> k, M & ((1 << k) - 1), 1 << (k - 1)
    return r + 1 if rem > half or (rem == half and r & 1) else r


def i8_pack(x, rows, cols):
    """(int8 codes, int32 exponents): e = floor(log2(absmax)) - 6 per row (0 for an
    all-zero row), code = clamp(rne(x 2^-e), -127, 127)."""
    src = _bits(x)
    codes = array.array("b", bytes(rows * cols))
    exps = array.array("i", bytes(4 * rows))
    for r in range(rows):
        row = src[r * cols:(r + 1) * cols]
        amax = max((b & 0x7fffffff for b in row), default=0)
        e = _ilog2(amax) - 6 if amax else 0
        exps[r] = e
        for c, b in enumerate(row):
            v = min(_scaled_rne(b & 0x7fffffff, e), 127) if b & 0x7fffffff else 0
            codes[r * cols + c] = -v if b >> 31 else v
    return codes, exps


def _value_bits(code, e):
    """Bits of code * 2^e, or None when that is not an exact finite float32."""
    if code == 0:
        return 0
    if code < -127:
        return None
    v, sign = abs(code), 0x80000000 if code < 0 else 0
    n = v.bit_length()
    top = e + n - 1
    if top > 127:
        return None
    if top >= -126:
        return sign | (top + 127) << 23 | ((v << (24 - n)) & 0x7fffff)
    s = e + 149
    if s >= 0:
        return sign | v << s
    if s < -7 or v & ((1 << -s) - 1):  # below the grid of the smallest subnormal
        return None
    return sign | v >> -s


def i8_unpack(codes, exps, rows, cols, write=True):
    """(float32 Array of code * 2^e or None when write is false, first flat index whose
    value is not an exact finite float32 or -1)."""
    vals = array.array("I", bytes(4 * rows * cols))
    for i, code in enumerate(codes):
        b = _value_bits(code, exps[i // cols])
        if b is None:
            return None, i
        vals[i] = b
    if not write:
        return None, -1
    out = _core.empty((rows, cols))
    _bits(out)[:] = vals
    return out, -1
