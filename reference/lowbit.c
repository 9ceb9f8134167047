/* Low-bit weight formats (SPEC section 8), native side. Every conversion works on the
 * IEEE bit patterns with integer arithmetic only, so the floating-point environment
 * (rounding mode, FTZ/DAZ) cannot change a bit, and mamba/_lowbit_pure.py computes the
 * same bytes with Python integers. Not hot: compiled once, outside the ISA copies. */
#include <string.h>

#include "mamba_ref.h"

static uint32_t f32_bits(const float *p)
{
    uint32_t b;
    memcpy(&b, p, 4);
    return b;
}

static void put_bits(float *p, uint32_t b)
{
    memcpy(p, &b, 4);
}

static uint16_t bf16_from_bits(uint32_t b)
{
    if ((b & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((b >> 16) | 0x0040u); /* NaN: keep sign and top payload, quiet */
    /* Round to nearest even on the 16 dropped bits; a carry into the exponent is the
     * correct rounding (up to inf past the largest bfloat16). */
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

int64_t mb_bf16_pack(int64_t n, const float *x, uint16_t *out)
{
    int64_t first_inf = -1;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b = f32_bits(x + i);
        out[i] = bf16_from_bits(b);
        if (first_inf < 0 && (out[i] & 0x7f80u) == 0x7f80u && (b & 0x7f800000u) != 0x7f800000u)
            first_inf = i;
    }
    return first_inf;
}

void mb_bf16_unpack(int64_t n, const uint16_t *bits, float *out)
{
    for (int64_t i = 0; i < n; i++)
        put_bits(out + i, (uint32_t)bits[i] << 16);
}

static int bit_length(uint32_t v)
{
    int n = 0;
    while (v) {
        n++;
        v >>= 1;
    }
    return n;
}

/* floor(log2(m)) of a finite nonzero magnitude given by its bits. */
static int32_t ilog2_bits(uint32_t mag)
{
    uint32_t E = mag >> 23;
    return E ? (int32_t)E - 127 : (int32_t)bit_length(mag) - 150;
}

/* rne(|x| * 2^-e) for the magnitude bits of a finite x, as an unsigned integer. */
static uint32_t scaled_rne(uint32_t mag, int32_t e)
{
    uint32_t E = mag >> 23;
    uint64_t M = E ? ((mag & 0x7fffffu) | 0x800000u) : mag;
    int32_t q = (E ? (int32_t)E - 150 : -149) - e; /* |x| 2^-e = M 2^q */
    if (q >= 0)
        return (uint32_t)(M << q); /* q <= 6 here: |x| <= absmax < 2^(e + 7) */
    if (q < -40)
        return 0; /* M < 2^24 <= half of 2^-q */
    int k = -q;
    uint64_t r = M >> k, rem = M & ((1ull << k) - 1), half = 1ull << (k - 1);
    if (rem > half || (rem == half && (r & 1u)))
        r++;
    return (uint32_t)r;
}

void mb_i8_pack(int64_t rows, int64_t cols, const float *x, int8_t *codes, int32_t *exps)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        uint32_t amax = 0;
        for (int64_t c = 0; c < cols; c++) {
            uint32_t mag = f32_bits(row + c) & 0x7fffffffu;
            if (mag > amax)
                amax = mag;
        }
        /* an all-zero row (every element +-0) stores exponent 0 and zero codes */
        int32_t e = amax ? ilog2_bits(amax) - 6 : 0;
        exps[r] = e;
        for (int64_t c = 0; c < cols; c++) {
            uint32_t b = f32_bits(row + c);
            uint32_t v = b & 0x7fffffffu ? scaled_rne(b & 0x7fffffffu, e) : 0;
            if (v > 127)
                v = 127;
            codes[r * cols + c] = (int8_t)(b >> 31 ? -(int32_t)v : (int32_t)v);
        }
    }
}

/* Bits of code * 2^e, or 0xffffffff when that value is not an exact finite float32. */
static uint32_t i8_value_bits(int32_t code, int32_t e)
{
    if (code == 0)
        return 0;
    if (code < -127)
        return 0xffffffffu;
    uint32_t v = (uint32_t)(code < 0 ? -code : code), sign = code < 0 ? 0x80000000u : 0;
    int n = bit_length(v);
    int64_t top = (int64_t)e + n - 1; /* exponent of the leading bit */
    if (top > 127)
        return 0xffffffffu;
    if (top >= -126)
        return sign | (uint32_t)(top + 127) << 23 | ((v << (24 - n)) & 0x7fffffu);
    int64_t s = (int64_t)e + 149; /* subnormal: v 2^e = (v 2^s) 2^-149 */
    if (s >= 0)
        return sign | (v << s);
    if (s < -7 || (v & ((1u << -s) - 1)))
        return 0xffffffffu; /* below the smallest subnormal's grid */
    return sign | (v >> -s);
}

int64_t mb_i8_unpack(int64_t rows, int64_t cols, const int8_t *codes, const int32_t *exps,
                     float *out)
{
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t c = 0; c < cols; c++) {
            int64_t i = r * cols + c;
            uint32_t b = i8_value_bits(codes[i], exps[r]);
            if (b == 0xffffffffu)
                return i;
            if (out)
                put_bits(out + i, b);
        }
    }
    return -1;
}
