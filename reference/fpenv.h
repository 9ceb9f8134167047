/* Subnormals are part of the profile (SPEC 4.1): every entry point and every
 * worker thread clears FTZ/DAZ for the duration of the call and then restores
 * whatever another library in the process had set. */
#ifndef MB_FPENV_H
#define MB_FPENV_H

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
typedef unsigned int mb_fpenv;
static inline mb_fpenv mb_fpenv_enter(void)
{
    mb_fpenv old = _mm_getcsr();
    _mm_setcsr(old & ~(0x8000u | 0x0040u)); /* FTZ, DAZ */
    return old;
}
static inline void mb_fpenv_exit(mb_fpenv old) { _mm_setcsr(old); }
#elif defined(__aarch64__)
typedef unsigned long mb_fpenv;
static inline mb_fpenv mb_fpenv_enter(void)
{
    unsigned long old;
    __asm__ volatile("mrs %0, fpcr" : "=r"(old));
    __asm__ volatile("msr fpcr, %0" : : "r"(old & ~(1ul << 24)));
    return old;
}
static inline void mb_fpenv_exit(mb_fpenv old) { __asm__ volatile("msr fpcr, %0" : : "r"(old)); }
#else
typedef int mb_fpenv;
static inline mb_fpenv mb_fpenv_enter(void) { return 0; }
static inline void mb_fpenv_exit(mb_fpenv old) { (void)old; }
#endif

#endif
