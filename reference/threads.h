/* OpenMP queries that also compile without OpenMP (one thread). */
#ifndef MB_THREADS_H
#define MB_THREADS_H
#ifdef _OPENMP
#include <omp.h>
#endif

static inline int mb_max_threads(void)
{
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

static inline int mb_thread_num(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

#endif
