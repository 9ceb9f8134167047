"""SPEC section 7 executed literally in numpy float32, as a second implementation of
identical.mamba3.siso.fp32.v1: every seam rounded as the spec writes it, each dot v1
a serial chain, fma with one rounding, transcendentals from numerics.h (the helpers
of spec2). Whole sequences at once, chunk by chunk on the grid from position 0;
slow, for small shapes. One row from a fresh state, or from upstream Input_States."""
import numpy as np

from spec2 import f32, fma, fn, dot_last, linear, rmsnorm

N, P, R, Q = 128, 64, 32, 64
PI = np.frombuffer(bytes.fromhex("db0f4940"), np.float32)[0]  # bits 0x40490FDB


def rotate(t, c, s):
    """Pairs (2j, 2j+1), j < 32, of t (L, N) by angles with cos c, sin s (L, 32)."""
    out = t.copy()
    x0, x1 = t[:, 0:2 * R:2], t[:, 1:2 * R:2]
    out[:, 0:2 * R:2] = (x0 * c) - (x1 * s)
    out[:, 1:2 * R:2] = (x0 * s) + (x1 * c)
    return out


def serial_cumsum(a):
    out = np.zeros_like(a)
    acc = f32(0)
    for i in range(len(a)):
        acc = f32(acc + a[i])
        out[i] = acc
    return out


def fold(h, v, ks, cs):
    """fma(exp(cs_last), h, S), S[p][n] = chain_j (v_j[p] exp(cs_last - cs_j)) ks_j[n]."""
    last = cs[-1]
    vd = v * fn("exp", last - cs)[:, None]
    S = np.zeros((P, N), f32)
    for j in range(len(cs)):
        S = fma(vd[j][:, None], ks[j][None, :], S)
    return fma(fn("exp", last), h, S)


def row(w, x, inputs=None):
    """One row x (L, dm). inputs: None (fresh state) or (theta, h, k, v) of one row as
    set_input_states takes them. Returns y, the state pieces (theta, h, buffer_qrot,
    buffer_krot, buffer_v, buffer_dt, buffer_sig, buffer_adt, pending_k, pending_v),
    buffered_tokens, and the reports (h_last, k_last, v_last, theta_last)."""
    L, dm = x.shape
    di = 2 * dm
    H = di // P
    zx = linear(rmsnorm(x, w["block_norm.weight"]), w["in_proj.weight"])
    o = np.cumsum([0, di, di, N, N, H, H, H, R])
    z, v, Bm, Cm, dd_dt, dd_A, trap, ang = (zx[:, a:b] for a, b in zip(o, o[1:]))
    one, floor = f32(1), f32(-1e-4)
    A = -np.where(dd_A >= 0, one + dd_A, one / (one - dd_A)).astype(f32)
    A = np.where(A > floor, floor, A).astype(f32)
    dt = fn("softplus", dd_dt + w["dt_bias"])
    adt = A * dt
    sig = fn("sigmoid", trap)
    Bn, Cn = rmsnorm(Bm, w["B_norm.weight"]), rmsnorm(Cm, w["C_norm.weight"])
    ta = fn("tanh", ang) * PI
    y = np.zeros((L, di), f32)
    n_last = (L - 1) % Q + 1
    c_last = L - n_last
    state = [np.zeros(s, f32) for s in ((H, R), (H, P, N), (Q, H, N), (Q, H, N), (Q, H, P),
                                        (Q, H), (Q, H), (Q, H), (H, N), (H, P))]
    reports = [np.zeros(s, f32) for s in ((H, P, N), (H, N), (H, P), (H, R))]
    for hd in range(H):
        vh, d, sg, ad = v[:, hd * P:(hd + 1) * P], dt[:, hd], sig[:, hd], adt[:, hd]
        k, q = Bn + w["B_bias"][hd], Cn + w["C_bias"][hd]
        gamma = d * sg
        qkg = dot_last(q, k) * gamma
        theta = np.zeros(R, f32)
        h = np.zeros((P, N), f32)
        if inputs is not None:
            theta = inputs[0][hd].copy()
            h = inputs[1][hd] + (inputs[3][hd][:, None] * inputs[2][hd][None, :]) * (
                d[0] * (one - sg[0]))
        thetas = np.zeros((L, R), f32)
        for t in range(L):
            theta = fn("mod2pi", theta + ta[t] * d[t])
            thetas[t] = theta
        cos, sin = fn("cos", thetas), fn("sin", thetas)
        qr, kr = rotate(q, cos, sin), rotate(k, cos, sin)
        beta = np.zeros(L, f32)
        beta[:-1] = d[1:] * (one - sg[1:])  # +0 at the last token
        ks = kr * (gamma + beta)[:, None]
        for c0 in range(0, L, Q):
            n = min(Q, L - c0)
            rs = slice(c0, c0 + n)
            cs = serial_cumsum(ad[rs])
            seg = np.zeros((n, n), f32)  # seg[i][j] = ((+0 + a[j+1]) + ...) + a[i]
            for i in range(1, n):
                seg[i, :i] = seg[i - 1, :i] + ad[c0 + i]
            G = dot_last(qr[rs][:, None, :], ks[rs][None, :, :])
            M = G * np.where(np.tri(n, k=-1, dtype=bool), fn("exp", seg), f32(0))
            yi = np.zeros((n, P), f32)
            for j in range(n):  # strictly causal: rows i > j; masked terms skipped
                yi[j + 1:] = fma(M[j + 1:, j, None], vh[c0 + j][None, :], yi[j + 1:])
            ys = dot_last(qr[rs][:, None, :], h[None, :, :]) * fn("exp", cs)[:, None]
            yy = ys + yi
            yy = yy + (w["D"][hd] + qkg[rs])[:, None] * vh[rs]
            y[rs, hd * P:(hd + 1) * P] = yy * fn("silu", z[rs, hd * P:(hd + 1) * P])
            if c0 == c_last:
                reports[0][hd] = fold(h, vh[rs], ks[rs], cs)  # last row's beta is +0
            else:
                h = fold(h, vh[rs], ks[rs], cs)
        rl = slice(c_last, L)
        state[0][hd], state[1][hd] = theta, h
        for piece, val in zip(state[2:8], (qr[rl], kr[rl], vh[rl], d[rl], sg[rl], ad[rl])):
            piece[:n_last, hd] = val
        reports[1][hd], reports[2][hd], reports[3][hd] = kr[-1], vh[-1], theta
    out = x + linear(y, w["out_proj.weight"])
    return out, state, n_last, reports
