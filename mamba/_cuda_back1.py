"""The Mamba-1 backward on the CUDA backend (kernels: backends/kernels/back1.cu and the
shared grad.cu), the twin of reference/back1.c: every gradient has the C reference's
bits (docs/numerics.md, "Backward (Mamba-1)")."""
from . import _cuda_grad

NS, TC = 16, 32      # back1.cu: NS, M1B_TC
CHUNK_THREADS = 128  # mb_m1b_chunk_k: channels per block
GRID_Y = 65535
_KERNELS = ("mb_m1b_prep_k", "mb_m1b_gate_k", "mb_m1b_carry_k", "mb_m1b_chunk_k",
            "mb_m1b_fold_bc_k", "mb_m1b_fold_a_k", "mb_m1b_alog_k", "mb_m1b_du_k")

_cdiv = _cuda_grad._cdiv


class Back1Mixin:
    """CudaBackend.m1_backward."""

    # Bytes of the scan's window buffers (h, dh and w of a run of whole chunks): the
    # scan's memory past the activations stays bounded for any B * L. The window
    # cuts no reduction, so its size changes no bit.
    m1_window_bytes = 1 << 29

    def m1_backward(self, w, d_model, x, dy, gx, gw):
        """Gradients of a zero-state prefill of x (B, L, d_model) with grad_output dy:
        gx (x's) and gw (one per weight, weight order). Host x gives host gradients,
        device x device ones; dy may live on either. numeric_mode='fast' runs this
        same identical path (the block passes no mode): the backward has no faster
        schedule, so fast mode's accuracy promise holds with the identical bits."""
        from . import _cuda as C
        self._kernels(*_KERNELS)
        self._enter()
        st = self.stream()
        s = st.cu
        dm, B, L = d_model, x.shape[0], x.shape[1]
        di, R = 2 * dm, _cdiv(dm, 16)
        XR, M = R + 2 * NS, B * L
        norm_w, in_proj, conv_w, conv_b, x_proj, dt_w, dt_b, A_log, D, out_proj = w
        grid = self._grid
        back = []
        with C._Scratch(self, st) as sc:
            xd, dyd = self._on_device(sc, x), self._on_device(sc, dy)
            outs = [self._out(sc, o, back) for o in (gx,) + tuple(gw)]
            g_x, g_norm, g_in, g_cw, g_cb, g_xp, g_dtw, g_dtb, g_A, g_D, g_out = outs

            # steps 1-4 of the forward, keeping the conv's and dt_proj's pre-activations
            xn, xz, pre, u = sc(M * dm), sc(M * 2 * di), sc(M * di), sc(M * di)
            xdbl, spre, delta, dlu = sc(M * XR), sc(M * di), sc(M * di), sc(M * di)
            nparts = max(self._parts(M, 2 * di, dm), self._parts(M, XR, di),
                         self._parts(M, di, R))
            parts = sc(nparts) if nparts else 0
            self._rmsnorm(s, False, M, dm, xd, norm_w, xn, sc(M))
            self.gemm(s, M, 2 * di, dm, xn, dm, in_proj, dm, xz, 2 * di, parts)
            self.g_conv_pre(s, B, L, di, xz, 2 * di, conv_w, conv_b, pre, di, u, di)
            self.gemm(s, M, XR, di, u, di, x_proj, di, xdbl, XR, parts)
            self.gemm(s, M, di, R, xdbl, XR, dt_w, R, spre, di, parts)
            self._launch(s, "mb_m1b_prep_k", (grid(M * di),), C.THREADS, M, di, spre, dt_b, u,
                         delta, dlu)

            # the gate's input gradient: dyg = dout . out_proj, dys = dyg * silu(z)
            dyg, dys = sc(M * di), sc(M * di)
            self.g_linear_bwd(s, sc, M, dm, di, 0, 0, out_proj, di, dyd, dm, dX=dyg, lddx=di)
            self._launch(s, "mb_m1b_gate_k", (grid(M * di),), C.THREADS, M, di, dyg, xz, dys)

            # the scan: carries, then windows of whole chunks
            yg, ds, dus, dxdbl, dxz = sc(M * di), sc(M * di), sc(M * di), sc(M * XR), sc(M * 2 * di)
            self._m1_scan_bwd(s, sc, B, L, di, R, delta, dlu, u, xz, xdbl, spre, dyg, dys, A_log,
                              D, yg, dxz, ds, dus, dxdbl, g_A)

            # per-channel vectors and the projections
            self.g_colfold(s, sc, B, L, di, dys, di, g_D, b=u, ldb=di)
            self.g_colfold(s, sc, B, L, di, ds, di, g_dtb)
            dux = sc(M * di)
            self.g_linear_bwd(s, sc, M, dm, di, yg, di, out_proj, di, dyd, dm, gW=g_out)
            self.g_linear_bwd(s, sc, M, di, R, xdbl, XR, dt_w, R, ds, di, gW=g_dtw, dX=dxdbl,
                              lddx=XR)
            self.g_linear_bwd(s, sc, M, XR, di, u, di, x_proj, di, dxdbl, XR, gW=g_xp, dX=dux,
                              lddx=di)
            self._launch(s, "mb_m1b_du_k", (grid(M * di),), C.THREADS, M, di, dux, dus, dys, D)
            self.g_conv_silu_bwd(s, sc, B, L, di, dux, di, pre, di, xz, 2 * di, conv_w, g_cw,
                                 g_cb, dxz, 2 * di)
            dxn, xr = sc(M * dm), sc(M * dm)
            self.g_linear_bwd(s, sc, M, 2 * di, dm, xn, dm, in_proj, dm, dxz, 2 * di, gW=g_in,
                              dX=dxn, lddx=dm)

            # the norm and the residual: dx = dx_norm + dout
            self.g_rmsnorm_bwd(s, sc, M, dm, xd, dm, norm_w, dxn, dm, g_x, dm, xr, dm)
            self.g_colfold(s, sc, B, L, dm, dxn, dm, g_norm, b=xr, ldb=dm)
            self.g_add(s, M * dm, g_x, dyd, g_x)
            self._finish(st, back)

    def _m1_scan_bwd(self, s, sc, B, L, di, R, delta, dlu, u, xz, xdbl, spre, dyg, dys, A_log,
                     D, yg, dxz, ds, dus, dxdbl, g_A):
        from . import _cuda as C
        M, per, nch = B * L, di * NS, _cdiv(L, TC)
        ck, hk = sc(B * nch * 2 * per), sc(B * nch * per)
        self._launch(s, "mb_m1b_carry_k", (_cdiv(per, C.THREADS), min(B, GRID_Y), 2), C.THREADS,
                     B, L, di, R, delta, u, dys, xdbl, A_log, ck, hk)
        P = _cdiv(M, C.LEAF)
        leaves = sc(P * per)
        nj = max(1, self.m1_window_bytes // (3 * 4 * TC * per))
        H, DH, WV = (sc(min(nj * TC, M) * per) for _ in range(3))

        def start(j):  # the flat token where chunk j (row j // nch, chunk j % nch) starts
            return M if j == B * nch else j // nch * L + j % nch * TC
        for j0 in range(0, B * nch, nj):
            j1 = min(j0 + nj, B * nch)
            m0, m1 = start(j0), start(j1)
            self._launch(s, "mb_m1b_chunk_k", (_cdiv(di, CHUNK_THREADS), min(j1 - j0, GRID_Y)),
                         CHUNK_THREADS, L, di, R, j0, j1 - j0, m0, delta, u, xz, xdbl, spre, dyg,
                         dys, A_log, D, ck, hk, H, DH, WV, yg, dxz, ds, dus)
            self._launch(s, "mb_m1b_fold_bc_k", (self._grid((m1 - m0) * NS),), C.THREADS,
                         di, R, m0, m1 - m0, dlu, dys, H, DH, dxdbl)
            self._launch(s, "mb_m1b_fold_a_k", (self._grid(per),), C.THREADS,
                         di, m0, m1, delta, WV, leaves)
        self._launch(s, "mb_m1b_alog_k", (self._grid(per),), C.THREADS, per, P, leaves, A_log,
                     g_A)
