/* The one projection routine: Y = X . W^T under dot v1 (SPEC 4.4). */
#ifndef MB_GEMM_H
#define MB_GEMM_H
#include <stdint.h>
#include "isa.h"

/* Y[m*ldy + n] = dot_v1_k(X[m*ldx + 0..K), W[n*ldw + 0..K)) for m < M, n < N.
 * W is row-major (N, K), as torch stores Linear weights. Y must not alias X or W.
 * Threads over both cores (OpenMP); bits depend on K only. */
void MB_ISA_FN(mb_gemm)(int64_t M, int64_t N, int64_t K,
                        const float *X, int64_t ldx,
                        const float *W, int64_t ldw,
                        float *Y, int64_t ldy);

/* Y[m*ldy + n] = dot_v1_k(A[m*sam + k*sak], B[k*ldb + n]) for m < M, n < N: mb_gemm's
 * chains with the left operand read at any strides (A^T with sam = 1) and the right
 * one k-major, so neither is transposed first. Returns 0 if its scratch is refused
 * (Y then unset). */
int MB_ISA_FN(mb_gemm_kn)(int64_t M, int64_t N, int64_t K, const float *A, int64_t sam,
                          int64_t sak, const float *B, int64_t ldb, float *Y, int64_t ldy);

#endif
