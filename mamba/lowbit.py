"""Low-bit weight storage: bfloat16 and int8 weights, expanded exactly to float32.

A block computes in float32 only. Packing a weight stores it in fewer bytes; a block
given packed weights expands each one once, at construction, to the float32 values
`unpack` gives, and its results are bit for bit those of the same block built from
the expanded float32 weights. The formats (exact definitions: docs/numerics.md,
"Low-bit weights"):

- ``"float32"``: no packing (`pack_one` returns a float32 `mamba.Array` copy).
- ``"bfloat16"``: the upper 16 bits of the float32 pattern, rounded to nearest even
  (`BF16Weight`); unpacking is ``bits << 16``.
- ``"int8"``: per row, an int32 exponent ``e = floor(log2(absmax)) - 6`` and int8 codes
  ``clamp(rne(x * 2**-e), -127, 127)``; the value is ``code * 2**e`` (`Int8Weight`). An
  all-zero row stores ``e = 0`` and zero codes.

Only 2-D weights are packed. ``block.weight_format`` names the format the weights came
in: ``"float32"`` when none is packed, the packed weights' format when they share one,
and ``"mixed"`` when a dict mixes bfloat16 and int8 weights (allowed).

The conversions run in C (reference/lowbit.c). A pure-Python implementation with the
same bytes (`mamba._lowbit_pure`) backs the tests; ``mamba.lowbit._kernels`` selects
which one runs.
"""
import array
import operator
import sys

from . import _core, _intake as chk
from . import _lowbit_pure as _pure

FORMATS = ("float32", "bfloat16", "int8")


class _native:
    """The C kernels, behind the interface `_lowbit_pure` also implements."""

    @staticmethod
    def bf16_pack(x):
        out = array.array("H", bytes(2 * x.size))
        return out, _core.bf16_pack(x, out)

    @staticmethod
    def bf16_unpack(bits, shape):
        out = _core.empty(shape)
        _core.bf16_unpack(bits, out)
        return out

    @staticmethod
    def i8_pack(x, rows, cols):
        codes = array.array("b", bytes(rows * cols))
        exps = array.array("i", bytes(4 * rows))
        _core.i8_pack(x, rows, cols, codes, exps)
        return codes, exps

    @staticmethod
    def i8_unpack(codes, exps, rows, cols, write=True):
        out = _core.empty((rows, cols)) if write else None
        bad = _core.i8_unpack(codes, exps, rows, cols, out)
        return (out if bad < 0 else None), bad


_kernels = _native


# ------------------------------------------------------------------- buffers
_LITTLE = sys.byteorder == "little"


def _int_buffer(obj, code, count, what, name):
    """A private array.array(code) copy of `count` integers from a buffer whose format
    is that integer type, or raw bytes (native byte order) of the right length."""
    try:
        m = memoryview(obj)
    except TypeError:
        raise TypeError(f"mamba {what}: {name} must be a buffer (array.array, bytes, "
                        f"numpy array...), got {type(obj).__name__}") from None
    fmt = m.format
    core = fmt[1:] if fmt[:1] in ("@", "=") or (fmt[:1] == "<" and _LITTLE) else fmt
    item = array.array(code).itemsize
    ints = {"H": ("H",), "b": ("b",), "i": ("i", "l")}[code]
    if not (core in ints and m.itemsize == item or core in ("B", "c") and m.itemsize == 1):
        want = {"H": "uint16", "b": "int8", "i": "int32"}[code]
        raise TypeError(f"mamba {what}: {name} must hold {want} values (or raw bytes), "
                        f"got buffer format {fmt!r}")
    if m.nbytes != count * item:
        raise ValueError(f"mamba {what}: {name} holds {m.nbytes} bytes, expected {count} "
                         f"values ({count * item} bytes)")
    out = array.array(code)
    out.frombytes(m.tobytes())
    return out


def _shape2(shape, what):
    try:
        dims = tuple(operator.index(d) for d in shape if not isinstance(d, bool))
    except TypeError:
        dims = ()
    if len(dims) != 2 or len(shape) != 2 or min(dims) < 1:
        raise ValueError(f"mamba {what}: shape must be (rows, cols) of positive "
                         f"integers, got {shape!r}")
    return dims


def _readonly(arr, shape):
    return memoryview(arr).cast("B").cast(arr.typecode, shape).toreadonly()


class _Packed:
    format = None
    _BUFFERS = ()

    @property
    def shape(self):
        """(rows, cols) of the float32 weight this stands for."""
        return self._shape

    @property
    def nbytes(self):
        """Bytes held: the sum over the buffers (codes, exponents or bits)."""
        return sum(getattr(self, n).nbytes for n in self._BUFFERS)

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return self._shape == other._shape and all(
            getattr(self, n).tobytes() == getattr(other, n).tobytes() for n in self._BUFFERS)

    __hash__ = None

    def __repr__(self):
        return f"{type(self).__name__}(shape={self._shape}, nbytes={self.nbytes})"


class BF16Weight(_Packed):
    """A 2-D weight stored as bfloat16 bit patterns.

    BF16Weight(bits, shape): bits is a buffer of rows * cols uint16 values (format 'H',
    e.g. array.array('H') or numpy uint16) or their raw bytes in native byte order;
    it is copied. To serialise, write ``w.shape`` and ``w.bits.tobytes()``; the same
    two rebuild it. Immutable.
    """
    format = "bfloat16"
    _BUFFERS = ("bits",)

    def __init__(self, bits, shape):
        self._shape = _shape2(shape, "BF16Weight")
        self._bits = _int_buffer(bits, "H", self._shape[0] * self._shape[1],
                                 "BF16Weight", "bits")

    @classmethod
    def _make(cls, bits, shape):
        self = cls.__new__(cls)
        self._shape, self._bits = shape, bits
        return self

    @property
    def bits(self):
        """Read-only uint16 memoryview (rows, cols): each the top half of a float32."""
        return _readonly(self._bits, self._shape)


class Int8Weight(_Packed):
    """A 2-D weight stored as int8 codes and one power-of-two exponent per row.

    Int8Weight(codes, exponents, shape): codes holds rows * cols int8 values (format
    'b') and exponents rows int32 values (format 'i'), or the raw bytes of either in
    native byte order; both are copied. Value (r, c) is ``codes[r, c] * 2**exponents[r]``;
    a code of -128, or a value that is not an exact finite float32, is refused. To
    serialise, write ``w.shape``, ``w.codes.tobytes()`` and ``w.exponents.tobytes()``.
    Immutable.
    """
    format = "int8"
    _BUFFERS = ("codes", "exponents")

    def __init__(self, codes, exponents, shape):
        what = "Int8Weight"
        rows, cols = self._shape = _shape2(shape, what)
        self._codes = _int_buffer(codes, "b", rows * cols, what, "codes")
        self._exps = _int_buffer(exponents, "i", rows, what, "exponents")
        _, bad = _kernels.i8_unpack(self._codes, self._exps, rows, cols, write=False)
        if bad >= 0:
            r = bad // cols
            raise ValueError(f"mamba {what}: code {self._codes[bad]} at flat index {bad} "
                             f"(row {r}, exponent {self._exps[r]}) is -128 or does not "
                             "give an exact finite float32 (code * 2**exponent)")

    @classmethod
    def _make(cls, codes, exps, shape):
        self = cls.__new__(cls)
        self._shape, self._codes, self._exps = shape, codes, exps
        return self

    @property
    def codes(self):
        """Read-only int8 memoryview (rows, cols)."""
        return _readonly(self._codes, self._shape)

    @property
    def exponents(self):
        """Read-only int32 memoryview (rows,): the power of two of each row."""
        return _readonly(self._exps, (self._shape[0],))


_PACKED = (BF16Weight, Int8Weight)


# ------------------------------------------------------------------- public API
def _check_format(fmt, what):
    if fmt not in FORMATS:
        raise ValueError(f"mamba {what}: fmt must be one of {FORMATS}, got {fmt!r}")


def _pack(obj, fmt, what, name):
    if isinstance(obj, _PACKED):
        raise TypeError(f"mamba {what}: {name} is already a {type(obj).__name__}; "
                        "unpack() it first to repack")
    a = chk.f32(obj, what, name)
    if a.ndim != 2 or a.size == 0:
        raise ValueError(f"mamba {what}: {name} must be 2-D (rows, cols), not empty, to "
                         f"pack, got shape {a.shape}")
    chk.finite(a, what, name)
    if fmt == "float32":
        return _core.copy(a)
    if fmt == "bfloat16":
        bits, over = _kernels.bf16_pack(a)
        if over >= 0:
            v = memoryview(a).cast("B").cast("f")[over]
            raise ValueError(f"mamba {what}: {name} holds {v!r} at flat index {over}, "
                             "which rounds to infinity in bfloat16")
        return BF16Weight._make(bits, a.shape)
    codes, exps = _kernels.i8_pack(a, *a.shape)
    return Int8Weight._make(codes, exps, a.shape)


def pack_one(array, fmt):
    """One 2-D float32 weight in format fmt ('float32', 'bfloat16' or 'int8'): a
    float32 mamba.Array copy, a BF16Weight or an Int8Weight. Non-finite values and
    values that overflow bfloat16 are refused, naming the flat index."""
    _check_format(fmt, "lowbit.pack_one")
    return _pack(array, fmt, "lowbit.pack_one", "array")


def pack(weights, fmt):
    """A new weight dict with every 2-D weight packed in format fmt; the other entries
    are the caller's objects, unchanged. The caller's dict and arrays are not modified."""
    what = "lowbit.pack"
    _check_format(fmt, what)
    if not hasattr(weights, "items"):
        raise TypeError(f"mamba {what}: weights must be a dict of float32 buffers, got "
                        f"{type(weights).__name__}")
    out = {}
    for name, obj in weights.items():
        is2d = isinstance(obj, _PACKED) or chk.f32(obj, what, name).ndim == 2
        out[name] = _pack(obj, fmt, what, name) if is2d else obj
    return out


def unpack(packed):
    """The float32 values of a BF16Weight or Int8Weight, as a new (rows, cols)
    mamba.Array; a float32 buffer is returned as a float32 copy."""
    if isinstance(packed, BF16Weight):
        return _kernels.bf16_unpack(packed._bits, packed.shape)
    if isinstance(packed, Int8Weight):
        return _kernels.i8_unpack(packed._codes, packed._exps, *packed.shape)[0]
    return _core.copy(chk.f32(packed, "lowbit.unpack", "packed"))


def expand(weights, what):
    """(weights with packed entries unpacked, weight_format) for a block constructor."""
    if not hasattr(weights, "items"):
        return weights, "float32"
    formats = {w.format for w in weights.values() if isinstance(w, _PACKED)}
    if not formats:
        return weights, "float32"
    out = {n: unpack(w) if isinstance(w, _PACKED) else w for n, w in weights.items()}
    return out, formats.pop() if len(formats) == 1 else "mixed"
