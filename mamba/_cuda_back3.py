"""The Mamba-3 backward on the CUDA backend (kernels: backends/kernels/back3.cu).

The C reference (reference/back3.c, docs/numerics.md "Backward (Mamba-3)") first
reruns the forward, keeping what the backward reads; here the forward's own kernels
(ssd3.cu, through the device functions back3.cu shares with them) do that on the
chunk layout of a zero-state prefill, where ext rows are the packed tokens. The
backward then runs chunk-parallel: the only serial pieces are the dh chain over a
row's chunks (mb_ssd_dchain_k), the per-chunk chain F0 (mb_m3b_f0_k) and the angle
gradient over its tokens (mb_m3b_theta_k). The projections, norms and folds are the
shared building blocks of _cuda_grad.py. Every value is produced by the reference's
own sequence of float operations, so no launch shape changes a bit. _m3_stages
runs the forward, _m3_pull the backward from its activations: m3_backward runs both
and frees scratch in stream order as soon as its last reader is queued; m3_vjp keeps
the activations for any number of backward calls (_cuda_grad.g_vjp).
"""
from types import SimpleNamespace

from ._cuda_ssd import HP, M3_Q, NA, NS, _plan, _release, m3_dims

THREADS = 256
CHUNK_THREADS = 256                      # back3.cu B3_THREADS
F0_CHAINS = 4                            # back3.cu B3_F0W
_TRI, _TILE = M3_Q * (M3_Q - 1) // 2, 16 * (M3_Q + 4)
CHUNK_SMEM = 4 * (8 * M3_Q + M3_Q * (HP + 1) + 3 * _TRI + 3 * _TILE)  # back3.cu B3_SMEM
_KERNELS = ("mb_ssd_put_k", "mb_ssd_chain_k", "mb_m3_prep_k",
            "mb_m3_angles_k", "mb_m3b_rotate_k", "mb_ssd_dchain_k", "mb_m3b_f0_k",
            "mb_m3b_theta_k", "mb_m3b_token_k", "mb_m3b_unrot_k", "mb_m3b_heads_k")
_TWINS = ("m3b_sd_k", "m3b_chunk_k")  # and a tensor-core twin each (kname)


class Back3Mixin:
    """CudaBackend's m3_backward and m3_vjp. fast: the block norm, every projection
    (forward and backward), the forward's chunk contraction and output kernels and
    the chunk backward's products (Sd and the chunk pass) on fast mode's kernels, the rest as in identical
    mode."""

    def m3_backward(self, w, d_model, x, dy, gx, gw, fast=False):
        """Gradients of a zero-state prefill of x (B, L, d_model) for grad_output dy,
        into gx and gw (the weights' order): device outputs are written in place,
        host ones copied back."""
        self.g_backward(*self._m3_halves(w, d_model, x, fast), dy, gx, gw)

    def m3_vjp(self, w, d_model, x, y, fast=False):
        """The forward of a zero-state prefill of x into y, keeping a copy of x and the
        activations the backward reads (m2_vjp's contract)."""
        stages, pull = self._m3_halves(w, d_model, x, fast)
        fast = fast and self.tensor_cores

        def out(s, t, a, yd):  # out_proj and the residual
            P = self._parts(a.M, d_model, a.di)
            self.gemm(s, a.M, d_model, a.di, a.yg, a.di, w[8], a.di, yd, d_model,
                      t(P) if P else 0, fast, a.xd)
        return self.g_vjp(stages, pull, out, y)

    def _m3_halves(self, w, d_model, x, fast):
        """(stages, pull) of GradMixin.g_backward for this call."""
        fast = fast and self.tensor_cores  # else the identical path, its bits
        self._kernels(*_KERNELS, *(self.kname(k, fast) for k in _TWINS),
                      *self.m3_chunk_kernels(fast),
                      smem={self.kname("m3b_chunk_k", fast): CHUNK_SMEM})
        self._enter()
        return (lambda st, f, snap: self._m3_stages(st, f, w, d_model, x, fast, snap),
                lambda st, a, dyd, outs, consume: self._m3_pull(st, a, w, dyd, outs, fast,
                                                                consume))

    def _m3_stages(self, st, f, w, d_model, x, fast, snapshot):
        """The forward's activations of x (host or device), in scratch f; snapshot:
        x is copied there too, else a device x is read in place."""
        from ._cuda import _Scratch
        s = st.cu
        dm, B, L = d_model, x.shape[0], x.shape[1]
        di, H, NP = m3_dims(dm)
        norm_w, in_proj, dt_bias, Bn_w, Cn_w, B_bias, C_bias, D = w[:8]
        plan = _plan(B, L, None, 0, M3_Q, True)
        M, NC, per = plan.M, plan.NC, HP * NS
        rows = self._rows_grid
        I = plan.upload(f)
        I["M"], I["r"] = M, f(M)
        nparts = self._parts(M, NP, dm)
        with _Scratch(self, st) as t:
            xd, xn, zx = self._front(s, f, B, L, None, I, x, dm, norm_w, in_proj, NP,
                                     t(nparts) if nparts else 0, fast, keep=True, copy=snapshot)
        # B and C norms, per-token values, the angles (parked in q, kept in ANG) and the
        # rotation
        Bn, Cn = self._m3_bc_norms(s, f, B, L, I, zx, di, NP, Bn_w, Cn_w, False)
        Q, K = f(M * H * NS), f(M * H * NS)
        DT, SIG, ADT, QKG = f(M * H), f(M * H), f(M * H), f(M * H)
        TA, ANG = f(M * NA), f(M * H * NA)
        self.m3_prep(s, f, B, L, I, H, di, NP, zx, dt_bias, Bn, Cn, B_bias, C_bias, DT, SIG, ADT,
                     QKG, TA)
        with _Scratch(self, st) as t:
            theta = t(B * H * NA)
            self._fill32(s, theta, 0, B * H * NA)
            self._m3_angles(s, B, H, I, TA, DT, theta, Q, 0, 0)
        self._launch(s, "mb_m3b_rotate_k", (self._grid(M * H * NA),), THREADS,
                     M, H, Bn, Cn, B_bias, C_bias, Q, K, ANG)
        # v, the chunk states, the gated output
        V = f(M * di)
        self._launch(s, "mb_ssd_put_k", rows(L * di, B), THREADS,
                     B, I["off"], I["eoff"], I["t0"], di, zx + 4 * di, NP, V)
        Ec, hck, yg = f(NC * H), f(NC * H * per), f(M * di)
        with _Scratch(self, st) as t:
            S, h0 = t(NC * H * per), t(B * H * per)
            self._fill32(s, h0, 0, B * H * per)
            self.m3_fold(s, fast, NC, H, I["desc"], K, V, DT, SIG, ADT, S, Ec)
            self._launch(s, "mb_ssd_chain_k", (self._grid(B * H * per),), THREADS,
                         B, H, I["cbeg"], I["desc"], Ec, S, h0, hck)
        self.m3_y(s, fast, NC, H, I["desc"], di, NP, Q, K, V, DT, SIG, ADT, QKG, hck, D, zx, yg)
        return SimpleNamespace(B=B, L=L, dm=dm, di=di, H=H, NP=NP, M=M, NC=NC, I=I, xd=xd,
                               xn=xn, zx=zx, Bn=Bn, Cn=Cn, Q=Q, K=K, DT=DT, SIG=SIG, ADT=ADT,
                               QKG=QKG, TA=TA, ANG=ANG, V=V, Ec=Ec, hck=hck, yg=yg)

    def _m3_pull(self, st, a, w, dyd, outs, fast, consume):
        """The backward from the activations a (_m3_stages) for grad_output dyd into
        outs (x's gradient, then the weights'). consume: a's scratch, whose buffers are
        then overwritten or freed once read; None leaves them as they are."""
        from ._cuda import _Scratch
        s = st.cu
        B, L, dm, di, H, NP, M, NC, I = a.B, a.L, a.dm, a.di, a.H, a.NP, a.M, a.NC, a.I
        per = HP * NS
        oB, oC, oDT = 2 * di, 2 * di + NS, 2 * di + 2 * NS
        oANG = oDT + 3 * H
        norm_w, in_proj, dt_bias, Bn_w, Cn_w, B_bias, C_bias, D, out_proj = w
        g_x, g_norm, g_in, g_dtb, g_Bn, g_Cn, g_Bb, g_Cb, g_D, g_out = outs
        # scratch in three lifetimes: sc to the end, mid to the token pass, inner to
        # the chunk pass
        with _Scratch(self, st) as sc:
            dzx, dQKG = sc(M * NP), sc(M * H)
            dQ, dK = sc(M * H * NS), sc(M * H * NS)
            with _Scratch(self, st) as mid:
                dsc, dadt, TH = mid(M * H), mid(M * H), mid(M * H * NA)
                with _Scratch(self, st) as inner:
                    # out_proj: its weight's gradient, and dyg = dy . out_proj
                    dyg = inner(M * di)
                    with _Scratch(self, st) as tmp:
                        self.g_linear_bwd(s, tmp, M, dm, di, a.yg, di, out_proj, di, dyd, dm,
                                          g_out, dyg, di, fast)
                    if consume:
                        _release(consume, a.yg)

                    # the chunks: dh entering each from its own rows, the chain over a
                    # row's chunks in reverse, then every chunk's gradients;
                    # mb_ssd_dchain_k reads each element of Sd before it writes the same
                    # element of dh
                    Sd = dhL = inner(NC * H * per)
                    self._launch(s, self.kname("m3b_sd_k", fast), (NC, H), CHUNK_THREADS,
                                 I["desc"], H, di, NP, a.Q, a.ADT, a.zx, dyg, Sd)
                    self._launch(s, "mb_ssd_dchain_k", (self._grid(B * H * per),), THREADS,
                                 B, H, I["cbeg"], a.Ec, Sd, dhL)
                    F0c = inner(NC * H)
                    self._launch(s, "mb_m3b_f0_k", (-(-NC * H // F0_CHAINS),),
                                 32 * F0_CHAINS, NC * H, I["desc"], H, a.hck, dhL, F0c)
                    self._launch(s, self.kname("m3b_chunk_k", fast), (NC, H), CHUNK_THREADS,
                                 I["desc"], H, di, NP, a.Q, a.K, a.V, a.DT, a.SIG, a.ADT, a.QKG,
                                 a.hck, dhL, F0c, D, a.zx, dyg, dzx, dQKG, dQ, dK, dsc, dadt, TH,
                                 smem=CHUNK_SMEM)
                if consume:
                    _release(consume, a.Q, a.K, a.V, a.QKG, a.ADT, a.Ec, a.hck)

                # per token: the angle gradient (serial in reverse time), dt, trap and
                # dd_A (the biases transposed for it), then the unrotated q and k (TH
                # becomes the per-head angle term); across heads the B, C and angle
                # gradients
                self._launch(s, "mb_m3b_theta_k", (self._grid(B * H * NA),), THREADS,
                             B, L, H, TH)
                BT, CT = mid(NS * H), mid(NS * H)
                self.g_transpose(s, H, NS, B_bias, NS, BT, H)
                self.g_transpose(s, H, NS, C_bias, NS, CT, H)
                self._launch(s, "mb_m3b_token_k", (self._grid(M * H),), THREADS,
                             M, L, H, di, NP, a.zx, a.Bn, a.Cn, BT, CT, dt_bias, a.DT, a.SIG,
                             a.TA, TH, dQKG, dsc, dadt, dzx)
                self._launch(s, "mb_m3b_unrot_k", (self._grid(M * H * NS // 2),), THREADS,
                             M, H, a.Bn, a.Cn, B_bias, C_bias, a.DT, a.SIG, a.ANG, dQKG, TH, dQ,
                             dK)
                dCn, dBn = sc(M * NS), sc(M * NS)
                self._launch(s, "mb_m3b_heads_k", (self._grid(M * (2 * NS + NA)),), THREADS,
                             M, H, NP, oANG, a.zx, dQ, dK, TH, dCn, dBn, dzx)
            if consume:
                _release(consume, a.Bn, a.Cn, a.DT, a.SIG, a.TA, a.ANG)

            # the B and C norms; in_proj, the block norm (x * r reuses xn when consumed)
            # and the residual; the folds
            Bxr, Cxr = sc(M * NS), sc(M * NS)
            for col, wn, d, xr in ((oB, Bn_w, dBn, Bxr), (oC, Cn_w, dCn, Cxr)):
                self.g_rmsnorm_bwd(s, sc, M, NS, a.zx + 4 * col, NP, wn, d, NS,
                                   dzx + 4 * col, NP, xr, NS)
            dxn = sc(M * dm)
            with _Scratch(self, st) as tmp:
                self.g_linear_bwd(s, tmp, M, NP, dm, a.xn, dm, in_proj, dm, dzx, NP, g_in, dxn,
                                  dm, fast)
            xr = a.xn if consume else sc(M * dm)
            self.g_rmsnorm_bwd(s, sc, M, dm, a.xd, dm, norm_w, dxn, dm, g_x, dm, xr, dm)
            self.g_add(s, M * dm, dyd, g_x, g_x)
            for n, v, lda, o, b, ldb in ((dm, dxn, dm, g_norm, xr, dm),
                                         (NS, dBn, NS, g_Bn, Bxr, NS),
                                         (NS, dCn, NS, g_Cn, Cxr, NS),
                                         (H * NS, dK, H * NS, g_Bb, 0, 0),
                                         (H * NS, dQ, H * NS, g_Cb, 0, 0), (H, dQKG, H, g_D, 0, 0),
                                         (H, dzx + 4 * oDT, NP, g_dtb, 0, 0)):
                self.g_colfold(s, sc, B, L, n, v, lda, o, 1, b, ldb)
