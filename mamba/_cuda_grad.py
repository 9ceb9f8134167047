"""Launchers of the GPU backward building blocks (backends/kernels/grad.cu), the twins
of reference/grad.c that every block's backward shares. CudaBackend inherits
GradMixin; each method issues kernels on stream `s` (a CUstream, as
CudaBackend.gemm takes) and returns at once. Pointers are device addresses (ints
or device Arrays); ld* are row strides in floats, while an offset into a pointer
is in bytes (p + 4 * i for float i), as elsewhere in the backend. `sc` is the call's _Scratch
(stream-ordered scratch, freed when the call's `with` block ends).

Every result has the bits of the C function named, for any launch shape:

- g_transpose(s, rows, cols, src, lds, dst, ldd): mb_transpose,
  dst[c * ldd + r] = src[r * lds + c].
- g_rmsnorm_bwd(s, sc, M, n, x, ldx, w, dout, ldd, dx, lddx, xr=0, ldxr=0):
  mb_rmsnorm_bwd_rows over M rows of n (r recomputed as the forward does); xr, when
  given, receives x * r (the factor of w's gradient). dx aliases neither x nor dout.
- g_colfold(s, sc, B, L, n, a, lda, out, so=1, b=0, ldb=0, shift=0): mb_colfold,
  out[c * so] for c < n = dot v1 over the flat tokens (b, t) of a[k lda + c] *
  b[(k - shift) ldb + c] (b = 0: a plain sum), terms with t < shift skipped, leaves
  cut every 8192 flat tokens.
- g_fold_flat(s, sc, rows, cols, a, lda, out, b=0, ldb=0, G=1, ga=0, gb=0, so=1):
  G independent mb_fold_flat's: out[g * so] = mb_fold_flat(rows, cols, a + g * ga,
  lda, b + g * gb, ldb) (b = 0: a plain sum), e.g. one per head.
- g_linear_bwd(s, sc, M, N, K, X, ldx, W, ldw, dY, ldy, gW=0, dX=0, lddx=0, fast=False):
  mb_linear_bwd for Y = X . W^T (X (M, K), W (N, K), dY (M, N)): gW (N, K) by the
  dot-v1 GEMM on transposed copies (the fold over the M tokens), dX (M, K) = dY . W
  (dot v1 over N); either may be 0 (skipped). fast (numeric_mode="fast", on a backend
  with tensor cores): both products in TF32, gW's tokens cut into slices summed in a
  fixed order when its tiles alone would leave multiprocessors idle.
- g_conv_pre(s, B, L, C, inp, ldi, w, bias, pre, ldp, u, ldu): mb_conv_silu_pre
  from a zero window (a prefill with no state): pre (the conv before silu) and u.
- g_conv_silu_bwd(s, sc, B, L, C, d, ldd, pre, ldp, inp, ldi, w, gw, gb, dx, ldx):
  mb_conv_silu_bwd: d holds du on entry and dpre on return; gw (C, 4), gb (C); dx
  (its own rows of C, ld ldx).
- g_add(s, n, a, b, out): out = a + b element-wise (dx = dx_norm + dy).
- g_fold_leaves(s, P, n, parts, ldp, out, so=1): mb_dot_fold over P leaf results
  parts[p * ldp + i] into out[i * so], for kernels that cut their own leaves.
Kernels outside _cuda.KERNELS are looked up on first use (CudaBackend._kernels)
before _launch names them.

grad.cu also holds the device function mb_dsilu(z) (grad.h's twin) for the block
kernels compiled after it.
"""

LEAF = 8192
THREADS = 256
TILE = 32            # grad.cu GR_TILE; the transpose runs GR_TILE x 8 threads
NORM_ROWS, NORM_THREADS = 32, 128  # grad.cu GR_ROWS, GR_THREADS
GRID_Y = 65535
MAX_SLICES = 32  # token slices of a fast weight gradient
FOLD_LANES = 32  # grad.cu's token folds: one warp (a block) per 32 chains and leaf

_KERNELS = ("mb_transpose_k", "mb_rms_bwd_rows_k", "mb_rms_bwd_apply_k", "mb_colfold_k",
            "mb_fold_flat_k", "mb_conv_pre_k", "mb_dsilu_mul_k", "mb_conv_bwd_dx_k", "mb_add_k")


def _cdiv(a, b):
    return -(-a // b)


def _addr(a):
    """A device address of a pointer argument (an int or a device Array)."""
    return a if isinstance(a, int) else a.ptr


class GradMixin:
    """CudaBackend methods shared by the blocks' backward passes (module docstring)."""

    def _gk(self):
        self._kernels(*_KERNELS)

    def g_transpose(self, s, rows, cols, src, lds, dst, ldd):
        if rows == 0 or cols == 0:
            return
        self._gk()
        grid = (min(_cdiv(cols, TILE), 32 * self.sms), min(_cdiv(rows, TILE), GRID_Y))
        self._launch(s, "mb_transpose_k", grid, TILE * 8, rows, cols, src, lds, dst, ldd)

    def g_rmsnorm_bwd(self, s, sc, M, n, x, ldx, w, dout, ldd, dx, lddx, xr=0, ldxr=0):
        self._gk()
        rc = sc(2 * M)
        self._launch(s, "mb_rms_bwd_rows_k", (min(_cdiv(M, NORM_ROWS), 16 * self.sms),),
                     NORM_THREADS, M, n, x, ldx, w, dout, ldd, rc)
        self._launch(s, "mb_rms_bwd_apply_k", (self._grid(M * n),), THREADS,
                     M, n, x, ldx, w, dout, ldd, rc, dx, lddx, xr, ldxr)

    def g_fold_leaves(self, s, P, n, parts, ldp, out, so=1):
        self._gk()
        self._launch(s, "mb_dot_fold_k", (self._grid(n),), THREADS, P, n, 1, parts, ldp,
                     out, so, 0, 0, 0)

    def g_colfold(self, s, sc, B, L, n, a, lda, out, so=1, b=0, ldb=0, shift=0):
        self._gk()
        P = max(1, _cdiv(B * L, LEAF))
        dst, ds, dp = (out, so, 0) if P == 1 else (sc(P * n), 1, n)
        self._launch(s, "mb_colfold_k", (self._fold_grid(n, P),), FOLD_LANES,
                     B, L, n, a, lda, b, ldb, shift, P, dst, ds, dp)
        if P > 1:
            self.g_fold_leaves(s, P, n, dst, n, out, so)

    def _fold_grid(self, n, P):
        """Blocks of the token folds: a warp for every 32 chains of a leaf (each a few
        microseconds of serial fmas), so every multiprocessor gets its share."""
        return max(1, min(_cdiv(n, FOLD_LANES) * P, 64 * self.sms))

    def g_fold_flat(self, s, sc, rows, cols, a, lda, out, b=0, ldb=0, G=1, ga=0, gb=0, so=1):
        self._gk()
        P = max(1, _cdiv(rows * cols, LEAF))
        dst, ds, dp = (out, so, 0) if P == 1 else (sc(P * G), 1, G)
        self._launch(s, "mb_fold_flat_k", (self._fold_grid(G, P),), FOLD_LANES,
                     rows, cols, a, lda, b, ldb, G, ga, gb, P, dst, ds, dp)
        if P > 1:
            self.g_fold_leaves(s, P, G, dst, G, out, so)

    def g_linear_bwd(self, s, sc, M, N, K, X, ldx, W, ldw, dY, ldy, gW=0, dX=0, lddx=0,
                     fast=False):
        if gW:
            from . import _cuda as C
            dYT, XT = sc(N * M), sc(K * M)
            self.g_transpose(s, M, N, dY, ldy, dYT, M)
            self.g_transpose(s, M, K, X, ldx, XT, M)
            if fast and N > C.GEMV_MAX_M:  # (fewer rows take the chain GEMV)
                self._tf32_token_fold(s, sc, N, K, M, dYT, XT, gW)
            else:
                P = self._parts(N, K, M)
                self.gemm(s, N, K, M, dYT, M, XT, M, gW, K, sc(P) if P else 0)
        if dX:
            WT = sc(K * N)
            self.g_transpose(s, N, K, W, ldw, WT, N)
            P = self._parts(M, K, N)
            self.gemm(s, M, K, N, dY, ldy, WT, N, dX, lddx, sc(P) if P else 0, fast)

    def _tf32_token_fold(self, s, sc, N, K, M, A, B, out):
        """out (N, K) = A . B^T over M tokens (A (N, M), B (K, M)) on the tensor cores.
        Fewer output tiles than two a multiprocessor (the GEMM's residency) cut the
        tokens into slices of whole 32-token steps, each slice's product into its own
        scratch, summed by mb_dot_fold_k in slice order: no atomics, the same bits on
        every run."""
        from . import _cuda as C
        tiles = _cdiv(N, C.TF32_BM) * _cdiv(K, C.TF32_BN)
        step = 32 * _cdiv(_cdiv(M, min(_cdiv(2 * self.sms, tiles), MAX_SLICES)), 32)
        P = _cdiv(M, step)
        if P == 1:
            self.gemm(s, N, K, M, A, M, B, M, out, K, fast=True)
            return
        parts = sc(P * N * K)
        for p in range(P):
            m0 = p * step
            self.gemm(s, N, K, min(step, M - m0), _addr(A) + 4 * m0, M, _addr(B) + 4 * m0, M,
                      _addr(parts) + 4 * p * N * K, K, fast=True)
        self._launch(s, "mb_dot_fold_k", (self._grid(N * K),), THREADS, P, N, K, parts, N * K,
                     out, K, 0, 0, 0)

    def g_conv_pre(self, s, B, L, C, inp, ldi, w, bias, pre, ldp, u, ldu):
        self._gk()
        self._launch(s, "mb_conv_pre_k", (self._grid(B * L * C),), THREADS,
                     B, L, C, inp, ldi, w, bias, pre, ldp, u, ldu)

    def g_conv_silu_bwd(self, s, sc, B, L, C, d, ldd, pre, ldp, inp, ldi, w, gw, gb, dx, ldx):
        self._gk()
        M = B * L
        self._launch(s, "mb_dsilu_mul_k", (self._grid(M * C),), THREADS, M, C, d, ldd, pre, ldp)
        self.g_colfold(s, sc, B, L, C, d, ldd, gb)
        for k in range(4):  # gw[c][k]: column k of gw, 4 bytes a float
            self.g_colfold(s, sc, B, L, C, d, ldd, _addr(gw) + 4 * k, 4, inp, ldi, 3 - k)
        self._launch(s, "mb_conv_bwd_dx_k", (self._grid(M * C),), THREADS,
                     B, L, C, d, ldd, w, dx, ldx)

    def g_add(self, s, n, a, b, out):
        self._gk()
        self._launch(s, "mb_add_k", (self._grid(n),), THREADS, n, a, b, out)

    # A block's backward is its forward's stages, stages(st, f, snapshot) -> a (the
    # activations, in scratch f; snapshot: x is copied there too), and the backward
    # from them, pull(st, a, dyd, outs, consume) (outs: x's gradient, then the
    # weights'; consume: a's scratch, whose buffers may then be overwritten or freed
    # once read, or None to leave them as they are).
    def g_backward(self, stages, pull, dy, gx, gw):
        """The block's backward in one call, its stages consumed as it goes."""
        from ._cuda import _Scratch
        st = self.stream()
        with _Scratch(self, st) as sc:
            back = []
            outs = [self._out(sc, o, back) for o in (gx,) + tuple(gw)]
            dyd = self._on_device(sc, dy)
            with _Scratch(self, st) as f:
                pull(st, stages(st, f, False), dyd, outs, f)
            self._finish(st, back)

    def g_vjp(self, stages, pull, out, y):
        """The stages of a forward, kept, and y from them (out(s, t, a, yd), t being
        scratch for the call): a Kept whose backward(dy, gx, gw) is the block's."""
        from ._cuda import _Scratch
        st = self.stream()
        f = _Scratch(self, st)
        try:
            a = stages(st, f, True)
            with _Scratch(self, st) as t:
                back = []
                out(st.cu, t, a, self._out(t, y, back))
                self._finish(st, back)
        except BaseException:
            f.__exit__(None, None, None)
            raise
        return Kept(self, st, f, lambda cur, dyd, outs: pull(cur, a, dyd, outs, None))


class Kept:
    """The activations of one vjp forward, in scratch sc of its stream st, freed in
    that stream's order when the last reference goes; pull(st, dyd, outs) is the
    block's backward from them."""

    def __init__(self, be, st, sc, pull):
        self.be, self.st, self.sc, self.pull = be, st, sc, pull

    def backward(self, dy, gx, gw):
        """The block's backward for grad_output dy into gx, gw, on the current stream."""
        from ._cuda import _Scratch
        be, st = self.be, self.st
        be._enter()
        cur = be.stream()
        other = cur.number != st.number
        if other:  # the activations were written on the vjp's stream
            be._wait(cur.cu, st.cu)
        with _Scratch(be, cur) as sc:
            back = []
            outs = [be._out(sc, a, back) for a in (gx,) + tuple(gw)]
            self.pull(cur, be._on_device(sc, dy), outs)
            be._finish(cur, back)
        if other:  # the frees on the vjp's stream wait for this backward
            be._wait(st.cu, cur.cu)

    def __del__(self):
        be, ptrs, s = self.be, self.sc.ptrs, self.st.cu
        be.release(lambda: (be._enter(), [be.cu.cuMemFreeAsync(p, s) for p in ptrs]))
