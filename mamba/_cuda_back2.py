"""The Mamba-2 backward on the CUDA backend, the twin of reference/back2.c
(mb_m2_backward); docs/numerics.md "Backward (Mamba-2)" gives every order.

The forward of a zero-state prefill runs first through the forward's own kernels
(ssd2.cu; with no state and no lengths the ext rows are the packed tokens), keeping
what the backward reads (_m2_stages): in_proj's output, the conv pre-activations
and u, G, Y before the gate and after it, and the state entering every chunk. The
backward proper (_m2_pull) reads them: m2_backward runs both in one call and frees
the activations as their last reader is queued; m2_vjp keeps them for as many
backward calls as the caller makes (_cuda_grad.g_vjp). The SSD backward is
backends/kernels/back2.cu; the norms, projections, conv and folds are the shared
pieces of _cuda_grad.py.
"""
from types import SimpleNamespace

from ._cuda_ssd import (_plan, _release, _bits, M2_Q, NS, HP, FOLD_THREADS, G_TILES, TILE_THREADS,
                        M2YI_SMEM, OUT_THREADS, IFOLD_THREADS)

ROW_TILE = 32      # back2.cu BT: the rows of a block of mb_m2b_dgs_k and mb_m2b_bc_k
COL_THREADS = 256  # back2.cu COL_THREADS

BACK_KERNELS = ("mb_ssd_put_k", "mb_ssd_chain_k", "mb_m2_prep_k", "mb_m2_g_k", "mb_m2_fold_k",
                "mb_m2_y_k", "mb_m2b_gate_k", "mb_m2b_row_k", "mb_m2b_off_k",
                "mb_ssd_dchain_k", "mb_m2b_col_k", "mb_m2b_dgs_k", "mb_m2b_bc_k", "mb_m2b_alog_k")


class Back2Mixin:
    """CudaBackend.m2_backward (the CPU backend's signature) and m2_vjp. fast: the
    norms and every projection (forward and backward) on fast mode's kernels, the SSD
    as in identical mode (also the output kernel, which fast mode's forward runs on
    the tensor cores: its TF32 Y, through the gated norm's backward, doubled the
    error of D's gradient, to 2.2e-3 of fast mode's 2e-3)."""

    def m2_backward(self, w, d_model, dt_limit, x, dy, gx, gw, fast=False):
        self.g_backward(*self._m2_halves(w, d_model, dt_limit, x, fast), dy, gx, gw)

    def m2_vjp(self, w, d_model, dt_limit, x, y, fast=False):
        """The forward of a zero-state prefill of x into y (the forward's bits in
        identical mode), keeping a copy of x and the activations the backward reads;
        returns an object whose backward(dy, gx, gw) gives m2_backward's results
        without running the forward again."""
        stages, pull = self._m2_halves(w, d_model, dt_limit, x, fast)
        fast = fast and self.tensor_cores

        def out(s, t, a, yd):  # the gated norm, out_proj and the residual
            dm, di, M = d_model, a.di, a.M
            gn, r = t(M * di), t(M)
            P = self._parts(M, dm, di)
            self._rmsnorm(s, fast, M, di, a.g, w[7], gn, r)
            self.gemm(s, M, dm, di, gn, di, w[8], di, yd, dm, t(P) if P else 0, fast, a.xd)
        return self.g_vjp(stages, pull, out, y)

    def _m2_halves(self, w, d_model, dt_limit, x, fast):
        """(stages, pull) of GradMixin.g_backward for this call."""
        fast = fast and self.tensor_cores  # else the identical path, its bits
        self._kernels(*BACK_KERNELS)
        self._enter()
        return (lambda st, f, snap: self._m2_stages(st, f, w, d_model, dt_limit, x, fast, snap),
                lambda st, a, dyd, outs, consume: self._m2_pull(st, a, w, dyd, outs, fast,
                                                                consume))

    def _m2_stages(self, st, f, w, d_model, dt_limit, x, fast, snapshot):
        """The forward's activations of x (host or device), in scratch f; snapshot:
        x is copied there too, else a device x is read in place."""
        from ._cuda import _Scratch, THREADS as T
        s = st.cu
        dm, B, L = d_model, x.shape[0], x.shape[1]
        di = 2 * dm
        H, CD = di // HP, di + 2 * NS
        NP, M, Q, per = di + CD + H, B * L, M2_Q, HP * NS
        norm_w, in_proj, conv_w, conv_b, dt_bias, A_log, D = w[:7]
        plan = _plan(B, L, None, 0, Q, False)
        NC = plan.NC
        I = plan.upload(f)
        xd = self._on_device(f, x, copy=snapshot)
        r, xn, zx = f(M), f(M * dm), f(M * NP)
        with _Scratch(self, st) as t:
            P = self._parts(M, NP, dm)
            self._rmsnorm(s, fast, M, dm, xd, norm_w, xn, r)
            self.gemm(s, M, NP, dm, xn, dm, in_proj, dm, zx, NP, t(P) if P else 0, fast)
        pre, U, DTR = f(M * CD), f(M * CD), f(M * H)
        self.g_conv_pre(s, B, L, CD, zx + 4 * di, NP, conv_w, conv_b, pre, CD, U, CD)
        self._launch(s, "mb_ssd_put_k", self._rows_grid(L * H, B), T,
                     B, I["off"], I["off"], I["zero"], H, zx + 4 * (di + CD), NP, DTR)
        dt, dA, cs = f(NC * H * Q), f(NC * H * Q), f(NC * H * Q)
        self._m2_prep(s, NC, I["desc"], H, DTR, dt_bias, A_log, dt_limit, dt, dA, cs)
        G = f(NC * Q * Q)
        self._launch(s, "mb_m2_g_k", (G_TILES, NC), TILE_THREADS, I["desc"], di, CD, U, G)
        Ec, hck = f(NC * H), f(NC * H * per)
        with _Scratch(self, st) as t:
            S, h0 = t(NC * H * per), t(B * H * per)
            self._launch(s, "mb_m2_fold_k", (NC, H), IFOLD_THREADS,
                         I["desc"], H, di, CD, U, dt, cs, 0, S, Ec)
            self._fill32(s, h0, 0, B * H * per)
            self._launch(s, "mb_ssd_chain_k", (self._grid(B * H * per),), T,
                         B, H, I["cbeg"], I["desc"], Ec, S, h0, hck)
        Y, g = f(M * di), f(M * di)  # the output before the gate, and gated
        self._launch(s, "mb_m2_y_k", (H, NC), OUT_THREADS, I["desc"], H, di, CD, U, G,
                     dt, dA, cs, hck, D, zx, NP, Y, g, smem=M2YI_SMEM)
        return SimpleNamespace(B=B, L=L, dm=dm, di=di, H=H, CD=CD, NP=NP, M=M, NC=NC,
                               nk=NC // B, lo=_bits(dt_limit[0]), hi=_bits(dt_limit[1]), I=I,
                               xd=xd, r=r, xn=xn, zx=zx, pre=pre, U=U, DTR=DTR, dt=dt, dA=dA,
                               cs=cs, G=G, Ec=Ec, hck=hck, Y=Y, g=g)

    def _m2_pull(self, st, a, w, dyd, outs, fast, consume):
        """The backward from the activations a (_m2_stages) for grad_output dyd into
        outs (x's gradient, then the weights'). consume: a's scratch, whose buffers are
        then overwritten or freed once read; None leaves them as they are."""
        from ._cuda import _Scratch, THREADS as T
        s = st.cu

        def scope():
            """Scratch freed (in stream order) when its phase ends, for later ones."""
            return _Scratch(self, st)

        B, L, dm, di, H, CD, NP, M, NC, nk = a.B, a.L, a.dm, a.di, a.H, a.CD, a.NP, a.M, a.NC, a.nk
        Q, per, I = M2_Q, HP * NS, a.I
        norm_w, in_proj, conv_w, conv_b, dt_bias, A_log, D, gnorm_w, out_proj = w
        g_x, g_norm, g_in, g_convw, g_convb, g_dtb, g_alog, g_D, g_gnorm, g_out = outs
        with scope() as sc:
            dzxd = sc(M * NP)
            dY = a.Y if consume else sc(M * di)  # dY may replace Y
            with scope() as t:  # the gated norm, out_proj and the gate
                dgn = t(M * di)
                with scope() as u:
                    gn, r = u(M * di), u(M)
                    self._rmsnorm(s, fast, M, di, a.g, gnorm_w, gn, r)
                    self.g_linear_bwd(s, u, M, dm, di, gn, di, out_proj, di, dyd, dm, g_out,
                                      dgn, di, fast)
                dg, xr = t(M * di), t(M * di)
                self.g_rmsnorm_bwd(s, t, M, di, a.g, di, gnorm_w, dgn, di, dg, di, xr, di)
                self.g_colfold(s, t, B, L, di, dgn, di, g_gnorm, 1, xr, di)
                self._launch(s, "mb_m2b_gate_k", (self._grid(M * di),), T, M, di, a.Y, a.zx, NP,
                             dg, dzxd, dY)
            if consume:
                _release(consume, a.g)

            with scope() as m:
                # the SSD: each chunk's own part, the dh chain, the parts that read dh
                du, ddA, dts = m(M * CD), m(M * H), m(M * H)
                with scope() as t:
                    dcs, sacc = t(NC * H * Q), t(NC * H * Q)
                    Sd = dh = t(NC * H * per)  # the dh chain reads each S' before writing dh
                    self._launch(s, "mb_m2b_row_k", (H, NC), Q, I["desc"], H, di, CD, a.U, a.G,
                                 a.dt, a.dA, dY, sacc, du)
                    self._launch(s, "mb_m2b_off_k", (H, NC), FOLD_THREADS, I["desc"], nk, H, di,
                                 CD, a.U, a.cs, a.hck, dY, dcs, Sd)
                    self._launch(s, "mb_ssd_dchain_k", (self._grid(B * H * per),), T, B, H,
                                 I["cbeg"], a.Ec, Sd, dh)
                    self._launch(s, "mb_m2b_col_k", (H, NC), COL_THREADS, I["desc"], nk, H, di,
                                 CD, a.U, a.DTR, dt_bias, A_log, a.lo, a.hi, a.dt, a.cs, a.hck,
                                 dh, dY, D, dcs, sacc, du, dzxd + 4 * (di + CD), NP, ddA, dts)
                    dGs = t(NC * Q * Q)
                    tiles = Q // ROW_TILE
                    self._launch(s, "mb_m2b_dgs_k", (tiles, NC), Q, I["desc"], H, di, CD, a.U,
                                 a.dt, a.dA, dY, dGs)
                    self._launch(s, "mb_m2b_bc_k", (tiles, NC, 2), NS, I["desc"], nk, H, di, CD,
                                 a.U, a.dt, a.cs, a.hck, dh, dY, dGs, du)

                # the per-head vectors: D over (token, p), A_log and dt_bias over tokens
                with scope() as t:
                    self.g_fold_flat(s, t, M, HP, dY, di, g_D, a.U, CD, H, HP, HP)
                    self.g_fold_flat(s, t, M, 1, ddA, H, g_alog, dts, H, H, 1, 1)
                    self._launch(s, "mb_m2b_alog_k", (1,), T, H, A_log, g_alog)
                    self.g_fold_flat(s, t, M, 1, dzxd + 4 * (di + CD), NP, g_dtb, 0, 0, H, 1)

                # conv + silu
                with scope() as t:
                    self.g_conv_silu_bwd(s, t, B, L, CD, du, CD, a.pre, CD, a.zx + 4 * di, NP,
                                         conv_w, g_convw, g_convb, dzxd + 4 * di, NP)
            if consume:
                _release(consume, a.zx, a.pre, a.U, a.DTR, a.dt, a.dA, a.cs, a.G, a.Ec, a.hck,
                         a.Y)

            # in_proj, the block norm and the residual
            with scope() as t:
                dxn, xr2 = t(M * dm), t(M * dm)
                self.g_linear_bwd(s, t, M, NP, dm, a.xn, dm, in_proj, dm, dzxd, NP, g_in, dxn,
                                  dm, fast)
                self.g_rmsnorm_bwd(s, t, M, dm, a.xd, dm, norm_w, dxn, dm, g_x, dm, xr2, dm)
                self.g_colfold(s, t, B, L, dm, dxn, dm, g_norm, 1, xr2, dm)
            self.g_add(s, M * dm, g_x, dyd, g_x)
