"""The Mamba-3 backward on the CUDA backend (kernels: backends/kernels/back3.cu).

The C reference (reference/back3.c, docs/numerics.md "Backward (Mamba-3)") first
reruns the forward, keeping what the backward reads; here the forward's own kernels
(ssd3.cu, through the device functions back3.cu shares with them) do that on the
chunk layout of a zero-state prefill, where ext rows are the packed tokens. The
backward then runs chunk-parallel: the only serial pieces are the dh chain over a
row's chunks (mb_ssd_dchain_k), the per-chunk chain F0 (mb_m3b_f0_k) and the angle
gradient over its tokens (mb_m3b_theta_k). The projections, norms and folds are the
shared building blocks of _cuda_grad.py. Every value is produced by the reference's
own sequence of float operations, so no launch shape changes a bit. Scratch lives in
nested scopes freed in stream order as soon as its last reader is queued, and the
chunk states' fold buffer is reused for the gated output, Sd and dh.
"""
from ._cuda_ssd import FOLD_THREADS, HP, M3_Q, NA, NS, TILE_THREADS, _plan, m3_dims

THREADS = 256
CHUNK_THREADS = 256                      # back3.cu B3_THREADS
F0_CHAINS = 4                            # back3.cu B3_F0W
_TRI, _TILE = M3_Q * (M3_Q - 1) // 2, 16 * (M3_Q + 4)
CHUNK_SMEM = 4 * (8 * M3_Q + M3_Q * (HP + 1) + 3 * _TRI + 3 * _TILE)  # back3.cu B3_SMEM
_KERNELS = ("mb_ssd_put_k", "mb_ssd_chain_k", "mb_m3_prep_k", "mb_m3_fold_k", "mb_m3_y_k",
            "mb_m3_angles_k", "mb_m3b_rotate_k", "mb_m3b_sd_k", "mb_ssd_dchain_k",
            "mb_m3b_f0_k", "mb_m3b_chunk_k", "mb_m3b_theta_k", "mb_m3b_token_k",
            "mb_m3b_unrot_k", "mb_m3b_heads_k")


class Back3Mixin:
    """CudaBackend's m3_backward."""

    def m3_backward(self, w, d_model, x, dy, gx, gw, fast=False):
        """Gradients of a zero-state prefill of x (B, L, d_model) for grad_output dy,
        into gx and gw (the weights' order): device outputs are written in place,
        host ones copied back. fast: the block norm and every projection (forward
        and backward) on fast mode's kernels, the rest as in identical mode."""
        fast = fast and self.tensor_cores  # else the identical path, its bits
        self._kernels(*_KERNELS, smem={"mb_m3b_chunk_k": CHUNK_SMEM})
        self._enter()
        st = self.stream()
        s = st.cu
        dm, B, L = d_model, x.shape[0], x.shape[1]
        di, H, NP = m3_dims(dm)
        oB, oC, oDT = 2 * di, 2 * di + NS, 2 * di + 2 * NS
        oANG = oDT + 3 * H
        norm_w, in_proj, dt_bias, Bn_w, Cn_w, B_bias, C_bias, D, out_proj = w
        plan = _plan(B, L, None, 0, M3_Q, True)
        M, NC, per = plan.M, plan.NC, HP * NS
        rows = self._rows_grid
        from ._cuda import _Scratch  # _cuda imports this module
        with _Scratch(self, st) as sc:
            I = plan.upload(sc)
            I["M"], I["r"] = M, sc(M)
            back = []
            out = [self._out(sc, a, back) for a in (gx,) + tuple(gw)]
            g_x, g_norm, g_in, g_dtb, g_Bn, g_Cn, g_Bb, g_Cb, g_D, g_out = out
            dyd = self._on_device(sc, dy)
            nparts = self._parts(M, NP, dm)
            xd, xn, zx = self._front(s, sc, B, L, None, I, x, dm, norm_w, in_proj, NP,
                                     sc(nparts) if nparts else 0, fast, keep=True)
            # scratch in three lifetimes: sc to the end, mid to the token pass, inner
            # to the chunk pass
            with _Scratch(self, st) as mid:
                # the forward again: B and C norms, per-token values, the angles (parked
                # in q, kept in ANG) and the rotation
                Bn, Cn = self._m3_bc_norms(s, mid, B, L, I, zx, di, NP, Bn_w, Cn_w, False)
                Q, K = mid(M * H * NS), mid(M * H * NS)
                DT, SIG, ADT, QKG = mid(M * H), mid(M * H), mid(M * H), mid(M * H)
                TA, theta, ANG = mid(M * NA), mid(B * H * NA), mid(M * H * NA)
                self._launch(s, "mb_m3_prep_k", rows(L * (H + NA), B), THREADS,
                             B, I["off"], I["eoff"], I["t0"], H, di, NP, zx, dt_bias, Bn, Cn,
                             B_bias, C_bias, DT, SIG, ADT, QKG, TA)
                self._fill32(s, theta, 0, B * H * NA)
                self._launch(s, "mb_m3_angles_k", (self._grid(B * H * NA),), THREADS,
                             B, H, I["off"], I["eoff"], I["t0"], TA, DT, theta, Q, 0)
                self._launch(s, "mb_m3b_rotate_k", (self._grid(M * H * NA),), THREADS,
                             M, H, Bn, Cn, B_bias, C_bias, Q, K, ANG)
                dsc, dadt = mid(M * H), mid(M * H)
                with _Scratch(self, st) as inner:
                    # v, the chunk states, the gated output
                    V = inner(M * di)
                    self._launch(s, "mb_ssd_put_k", rows(L * di, B), THREADS,
                                 B, I["off"], I["eoff"], I["t0"], di, zx + 4 * di, NP, V)
                    S, Ec, hck = inner(NC * H * per), inner(NC * H), inner(NC * H * per)
                    h0 = inner(B * H * per)
                    self._fill32(s, h0, 0, B * H * per)
                    self._launch(s, "mb_m3_fold_k", (NC, H), FOLD_THREADS,
                                 I["desc"], H, K, V, DT, SIG, ADT, 0, S, Ec)
                    self._launch(s, "mb_ssd_chain_k", (self._grid(B * H * per),), THREADS,
                                 B, H, I["cbeg"], I["desc"], Ec, S, h0, hck)
                    # S, read by the chain, holds the gated output yg, then Sd, then dh
                    # leaving each chunk: mb_ssd_dchain_k reads each element of Sd before
                    # it writes the same element of dh
                    yg, Sd, dhL = S, S, S
                    self._launch(s, "mb_m3_y_k", (H, NC), TILE_THREADS, I["desc"], H, di, NP, Q,
                                 K, V, DT, SIG, ADT, QKG, hck, D, zx, yg)

                    # out_proj: its weight's gradient, and dyg = dy . out_proj
                    dyg = inner(M * di)
                    with _Scratch(self, st) as tmp:
                        self.g_linear_bwd(s, tmp, M, dm, di, yg, di, out_proj, di, dyd, dm,
                                          g_out, dyg, di, fast)

                    # the chunks: dh entering each from its own rows, the chain over a
                    # row's chunks in reverse, then every chunk's gradients
                    self._launch(s, "mb_m3b_sd_k", (NC, H), CHUNK_THREADS,
                                 I["desc"], H, di, NP, Q, ADT, zx, dyg, Sd)
                    self._launch(s, "mb_ssd_dchain_k", (self._grid(B * H * per),), THREADS,
                                 B, H, I["cbeg"], Ec, Sd, dhL)
                    F0c = inner(NC * H)
                    self._launch(s, "mb_m3b_f0_k", (-(-NC * H // F0_CHAINS),),
                                 32 * F0_CHAINS, NC * H, I["desc"], H, hck, dhL, F0c)
                    dzx, dQKG = sc(M * NP), sc(M * H)
                    dQ, dK, TH = sc(M * H * NS), sc(M * H * NS), mid(M * H * NA)
                    self._launch(s, "mb_m3b_chunk_k", (NC, H), CHUNK_THREADS,
                                 I["desc"], H, di, NP, Q, K, V, DT, SIG, ADT, QKG, hck, dhL,
                                 F0c, D, zx, dyg, dzx, dQKG, dQ, dK, dsc, dadt, TH,
                                 smem=CHUNK_SMEM)

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
                             M, L, H, di, NP, zx, Bn, Cn, BT, CT, dt_bias, DT, SIG, TA, TH,
                             dQKG, dsc, dadt, dzx)
                self._launch(s, "mb_m3b_unrot_k", (self._grid(M * H * NS // 2),), THREADS,
                             M, H, Bn, Cn, B_bias, C_bias, DT, SIG, ANG, dQKG, TH, dQ, dK)
                dCn, dBn = sc(M * NS), sc(M * NS)
                self._launch(s, "mb_m3b_heads_k", (self._grid(M * (2 * NS + NA)),), THREADS,
                             M, H, NP, oANG, zx, dQ, dK, TH, dCn, dBn, dzx)

            # the B and C norms; in_proj, the block norm (x * r reuses xn) and the
            # residual; the folds
            Bxr, Cxr = sc(M * NS), sc(M * NS)
            for col, wn, d, xr in ((oB, Bn_w, dBn, Bxr), (oC, Cn_w, dCn, Cxr)):
                self.g_rmsnorm_bwd(s, sc, M, NS, zx + 4 * col, NP, wn, d, NS, dzx + 4 * col, NP,
                                   xr, NS)
            dxn = sc(M * dm)
            with _Scratch(self, st) as tmp:
                self.g_linear_bwd(s, tmp, M, NP, dm, xn, dm, in_proj, dm, dzx, NP, g_in, dxn, dm,
                                  fast)
            self.g_rmsnorm_bwd(s, sc, M, dm, xd, dm, norm_w, dxn, dm, g_x, dm, xn, dm)
            self.g_add(s, M * dm, dyd, g_x, g_x)
            for n, a, lda, o, b, ldb in ((dm, dxn, dm, g_norm, xn, dm), (NS, dBn, NS, g_Bn, Bxr, NS),
                                         (NS, dCn, NS, g_Cn, Cxr, NS),
                                         (H * NS, dK, H * NS, g_Bb, 0, 0),
                                         (H * NS, dQ, H * NS, g_Cb, 0, 0), (H, dQKG, H, g_D, 0, 0),
                                         (H, dzx + 4 * oDT, NP, g_dtb, 0, 0)):
                self.g_colfold(s, sc, B, L, n, a, lda, o, 1, b, ldb)
            self._finish(st, back)
