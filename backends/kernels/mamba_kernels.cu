/* The one translation unit nvcc and hipcc compile into the kernel modules
 * the loaders open: every op file, so one module holds every kernel. */
#include "conv.cu"   /* its step runs in the decode GEMVs */
#include "finite.cu" /* its guard runs in the norms and the decode GEMV */
#include "gemm.cu"
#include "rmsnorm.cu"
#include "scan1.cu"
#include "residual.cu"
#include "rows.cu"
#include "copy.cu"
#include "fast.cu"
#include "wgmma.cu" /* after fast.cu, whose epilogue it shares */
#include "ssd2.cu"
#include "ssd3.cu"
#include "ssd_step.cu"
#include "grad.cu"
#include "back1.cu"
#include "back2.cu"
#include "back3.cu"
#include "math.cu"
