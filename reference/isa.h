/* Sources under reference/ that hold hot loops are compiled once per ISA: the
 * baseline, x86-64-v3 (AVX2 + FMA) and x86-64-v4 (AVX-512). MB_ISA (base | v3 | v4)
 * is set by meson; MB_ISA_FN(name) gives each copy its own symbol, and dispatch.c
 * picks one at run time. The arithmetic is the same in every copy (explicit fmaf,
 * no contraction, vectors across outputs only), so the choice changes speed only,
 * never bits. */
#ifndef MB_ISA_H
#define MB_ISA_H

#ifndef MB_ISA
#define MB_ISA base
#endif
#define MB_CAT2_(a, b) a##_##b
#define MB_CAT2(a, b) MB_CAT2_(a, b)
#define MB_ISA_FN(name) MB_CAT2(name, MB_ISA)

#endif
