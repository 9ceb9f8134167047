"""The Mamba-1 backward on the CUDA backend (kernels: backends/kernels/back1.cu and the
shared grad.cu), the twin of reference/back1.c: every gradient has the C reference's
bits (docs/numerics.md, "Backward (Mamba-1)")."""
from types import SimpleNamespace

from . import _cuda_grad

NS, TC = 16, 32                  # back1.cu: NS, M1B_TC
LANE_CH = 8                      # back1.cu M1B_SCH: channels per block of the lane kernels
GRID_Y = 65535
_KERNELS = ("mb_m1b_prep_k", "mb_m1b_gate_k", "mb_m1b_dhc_k", "mb_m1b_lead_k", "mb_m1b_fwd_k",
            "mb_m1b_chunk_k", "mb_m1b_alog_k", "mb_m1b_du_k")

_cdiv = _cuda_grad._cdiv


def chunk_shape(group):
    """(threads, bytes of dynamic shared memory) of mb_m1b_chunk_k with `group`
    channels a group (back1.cu M1B_G; its sub-groups hold as many tokens)."""
    tok, buf = group * (NS + 4) + 16, 4 * TC * group + group * (NS + 4)
    return group * NS, 4 * ((TC + 2 * group) * tok + 2 * buf + TC * 2 * NS)  # M1B_SMEM


class Back1Mixin:
    """CudaBackend.m1_backward and m1_vjp: _m1_stages runs the forward's first steps,
    _m1_pull the backward from them (the scan's forward runs again inside its
    backward, as in the C reference)."""

    m1b_group = 16  # back1.cu M1B_G under nvcc

    # Bytes of the scan's carries (dh and h every 32 tokens of a run of whole rows, a
    # window): the scan's memory past the activations stays bounded for any B * L. The
    # window cuts no reduction, so its size changes no bit.
    m1_window_bytes = 1 << 29

    def m1_backward(self, w, d_model, x, dy, gx, gw, fast=False):
        """Gradients of a zero-state prefill of x (B, L, d_model) with grad_output dy:
        gx (x's) and gw (one per weight, weight order). Host x gives host gradients,
        device x device ones; dy may live on either. fast: the block norm and every
        projection (forward and backward) on fast mode's kernels, the rest as in
        identical mode."""
        self.g_backward(*self._m1_halves(w, d_model, x, fast), dy, gx, gw)

    def m1_vjp(self, w, d_model, x, y, fast=False):
        """The forward of a zero-state prefill of x into y, keeping a copy of x and the
        activations the backward reads (m2_vjp's contract)."""
        stages, pull = self._m1_halves(w, d_model, x, fast)
        fast = fast and self.tensor_cores

        def out(s, t, a, yd):  # the scan, out_proj and the residual
            h, yi, zero = t(a.B * a.di * NS), t(a.M * a.di), t(a.di)
            self._fill32(s, h, 0, a.B * a.di * NS)
            self._fill32(s, zero, 0, a.di)
            # spre holds dt_proj's output plus its bias, so the scan adds +0 (softplus of
            # -0 + 0 = +0 is softplus of -0)
            self._m1_scan(s, fast, (zero, w[7], w[8]), a.B, a.L, self._uniform_offsets(a.B, a.L),
                          a.di, a.R, a.spre, a.u, a.xz, a.xdbl, h, yi)
            P = self._parts(a.M, d_model, a.di)
            self.gemm(s, a.M, d_model, a.di, yi, a.di, w[9], a.di, yd, d_model,
                      t(P) if P else 0, fast, a.xd)
        return self.g_vjp(stages, pull, out, y)

    def _m1_halves(self, w, d_model, x, fast):
        """(stages, pull) of GradMixin.g_backward for this call."""
        fast = fast and self.tensor_cores  # else the identical path, its bits
        self._kernels(*_KERNELS, smem={"mb_m1b_chunk_k": chunk_shape(self.m1b_group)[1]})
        self._enter()
        return (lambda st, f, snap: self._m1_stages(st, f, w, d_model, x, fast, snap),
                lambda st, a, dyd, outs, consume: self._m1_pull(st, a, w, dyd, outs, fast,
                                                                consume))

    def _m1_stages(self, st, f, w, d_model, x, fast, snapshot):
        """Steps 1-4 of the forward of x (host or device), in scratch f, keeping the
        conv's and dt_proj's pre-activations; snapshot: x is copied there too, else a
        device x is read in place."""
        from . import _cuda as C
        s = st.cu
        dm, B, L = d_model, x.shape[0], x.shape[1]
        di, R = 2 * dm, _cdiv(dm, 16)
        XR, M = R + 2 * NS, B * L
        norm_w, in_proj, conv_w, conv_b, x_proj, dt_w, dt_b = w[:7]
        xd = self._on_device(f, x, copy=snapshot)
        xn, xz, pre, u = f(M * dm), f(M * 2 * di), f(M * di), f(M * di)
        xdbl, spre, delta = f(M * XR), f(M * di), f(M * di)
        with C._Scratch(self, st) as t:
            nparts = max(self._parts(M, 2 * di, dm), self._parts(M, XR, di),
                         self._parts(M, di, R))
            parts = t(nparts) if nparts else 0
            self._rmsnorm(s, fast, M, dm, xd, norm_w, xn, t(M))
            self.gemm(s, M, 2 * di, dm, xn, dm, in_proj, dm, xz, 2 * di, parts, fast)
            self.g_conv_pre(s, B, L, di, xz, 2 * di, conv_w, conv_b, pre, di, u, di)
            self.gemm(s, M, XR, di, u, di, x_proj, di, xdbl, XR, parts, fast)
            self.gemm(s, M, di, R, xdbl, XR, dt_w, R, spre, di, parts, fast)
        self._launch(s, "mb_m1b_prep_k", (self._grid(M * di),), C.THREADS, M, di, spre, dt_b,
                     delta)
        return SimpleNamespace(B=B, L=L, dm=dm, di=di, R=R, XR=XR, M=M, xd=xd, xn=xn, xz=xz,
                               pre=pre, u=u, xdbl=xdbl, spre=spre, delta=delta)

    def _m1_pull(self, st, a, w, dyd, outs, fast, consume):
        """The backward from the activations a (_m1_stages) for grad_output dyd into
        outs (x's gradient, then the weights'). consume: a's scratch, whose buffers may
        then be overwritten; None leaves them as they are."""
        from . import _cuda as C
        s, grid = st.cu, self._grid
        B, L, dm, di, R, XR, M = a.B, a.L, a.dm, a.di, a.R, a.XR, a.M
        norm_w, in_proj, conv_w, conv_b, x_proj, dt_w, dt_b, A_log, D, out_proj = w
        g_x, g_norm, g_in, g_cw, g_cb, g_xp, g_dtw, g_dtb, g_A, g_D, g_out = outs
        with C._Scratch(self, st) as sc:
            # the gate's input gradient: dyg = dout . out_proj, dys = dyg * silu(z)
            dyg, dys = sc(M * di), sc(M * di)
            self.g_linear_bwd(s, sc, M, dm, di, 0, 0, out_proj, di, dyd, dm, dX=dyg, lddx=di,
                              fast=fast)
            self._launch(s, "mb_m1b_gate_k", (grid(M * di),), C.THREADS, M, di, dyg, a.xz, dys)

            # the scan
            yg, ds, dus, dxdbl, dxz = sc(M * di), sc(M * di), sc(M * di), sc(M * XR), sc(M * 2 * di)
            self._m1_scan_bwd(s, sc, B, L, di, R, a.delta, a.u, a.xz, a.xdbl, a.spre, dyg, dys,
                              A_log, D, yg, dxz, ds, dus, dxdbl, g_A)

            # per-channel vectors and the projections; buffers dead by then are reused
            # (dux in dyg, dxn in yg, xr in spre when consumed), as reference/back1.c does
            self.g_colfold(s, sc, B, L, di, dys, di, g_D, b=a.u, ldb=di)
            self.g_colfold(s, sc, B, L, di, ds, di, g_dtb)
            dux, dxn, xr = dyg, yg, a.spre if consume else sc(M * dm)
            self.g_linear_bwd(s, sc, M, dm, di, yg, di, out_proj, di, dyd, dm, gW=g_out,
                              fast=fast)
            self.g_linear_bwd(s, sc, M, di, R, a.xdbl, XR, dt_w, R, ds, di, gW=g_dtw,
                              dX=dxdbl, lddx=XR, fast=fast)
            self.g_linear_bwd(s, sc, M, XR, di, a.u, di, x_proj, di, dxdbl, XR, gW=g_xp,
                              dX=dux, lddx=di, fast=fast)
            self._launch(s, "mb_m1b_du_k", (grid(M * di),), C.THREADS, M, di, dux, dus, dys, D)
            self.g_conv_silu_bwd(s, sc, B, L, di, dux, di, a.pre, di, a.xz, 2 * di, conv_w, g_cw,
                                 g_cb, dxz, 2 * di)
            self.g_linear_bwd(s, sc, M, 2 * di, dm, a.xn, dm, in_proj, dm, dxz, 2 * di, gW=g_in,
                              dX=dxn, lddx=dm, fast=fast)

            # the norm and the residual: dx = dx_norm + dout
            self.g_rmsnorm_bwd(s, sc, M, dm, a.xd, dm, norm_w, dxn, dm, g_x, dm, xr, dm)
            self.g_colfold(s, sc, B, L, dm, dxn, dm, g_norm, b=xr, ldb=dm)
            self.g_add(s, M * dm, g_x, dyd, g_x)

    def _m1_scan_bwd(self, s, sc, B, L, di, R, delta, u, xz, xdbl, spre, dyg, dys, A_log, D,
                     yg, dxz, ds, dus, dxdbl, g_A):
        from . import _cuda as C
        M, per, nch = B * L, di * NS, _cdiv(L, TC)
        P, Pc = _cdiv(M, C.LEAF), _cdiv(di, C.LEAF)
        leaves = sc(P * per)
        nbw = max(1, min(B, self.m1_window_bytes // (2 * 4 * nch * per)))
        dhk, hk = sc(nbw * nch * per), sc(nbw * nch * per)

        def inner_starts(b):  # does row b hold a leaf start past its first token?
            return (b * L // C.LEAF + 1) * C.LEAF < (b + 1) * L
        hL = sc(P * per) if any(inner_starts(b) for b in range(B)) else 0
        cparts = sc(Pc * M * 2 * NS) if Pc > 1 else 0
        lanes = _cdiv(di, LANE_CH)
        for b0 in range(0, B, nbw):
            nb = min(nbw, B - b0)
            m0, m1 = b0 * L, (b0 + nb) * L
            rows = (lanes, min(nb, GRID_Y))
            self._launch(s, "mb_m1b_dhc_k", rows, LANE_CH * NS, L, di, R, b0, nb, delta, dys,
                         xdbl, A_log, dhk)
            if any(inner_starts(b) for b in range(b0, b0 + nb)):
                self._launch(s, "mb_m1b_lead_k", rows, LANE_CH * NS, L, di, R, b0, nb, delta,
                             u, xdbl, A_log, hL)
            nleaves = (m1 - 1) // C.LEAF - m0 // C.LEAF + 1
            self._launch(s, "mb_m1b_fwd_k", (lanes, min(nleaves, GRID_Y)), LANE_CH * NS, L, di,
                         R, b0, nb, delta, u, dys, xdbl, A_log, dhk, hL, hk, leaves)
            threads, smem = chunk_shape(self.m1b_group)
            self._launch(s, "mb_m1b_chunk_k", (nb * nch,), threads, L, di, R, b0, nb, M,
                         delta, u, xz, xdbl, spre, dyg, dys, A_log, D, dhk, hk, yg, dxz, ds, dus,
                         dxdbl, cparts, smem=smem)
        if Pc > 1:  # dB, dC past 8192 channels: join their leaves
            self._launch(s, "mb_dot_fold_k", (self._grid(M * 2 * NS),), C.THREADS, Pc, M,
                         2 * NS, cparts, M * 2 * NS, _cuda_grad._addr(dxdbl) + 4 * R, R + 2 * NS,
                         0, 0, 0)
        self._launch(s, "mb_m1b_alog_k", (self._grid(per),), C.THREADS, per, P, leaves, A_log,
                     g_A)
