/* Scratch memory of the forward passes, kept between calls. A large malloc is a fresh
 * mmap whose every page faults and is zeroed on first touch: for a Mamba-1 or Mamba-2
 * forward at L = 2048 that was about a sixth of the time. */
#ifndef MB_SCRATCH_H
#define MB_SCRATCH_H
#include <stddef.h>

/* n floats, 64-byte aligned, contents unspecified; NULL if memory is refused. */
float *mb_scratch_take(size_t n);

/* Hand back what mb_scratch_take gave (NULL is ignored). */
void mb_scratch_give(float *p);

#endif
