"""SPEC section 6 executed literally in numpy float32, as a second implementation of
identical.mamba2.fp32.v1: every seam rounded as the spec writes it, each dot v1 a
serial chain (vectorised across outputs only), fma with one rounding, transcendentals
from numerics.h (mamba._core._math). Slow; for small shapes. Fresh state only
(buffered_tokens 0), h may be nonzero (initial_states)."""
import numpy as np

from mamba import _core

f32 = np.float32
N, P, Q, EPS = 128, 64, 256, f32(1e-5)


def fma(a, b, c):
    """float32 fma(a, b, c) with one rounding: a*b is exact in float64, TwoSum gives
    the exact a*b + c as s + e, and e breaks the tie when s lies halfway between two
    float32 values (where float64 -> float32 would round s to even)."""
    a, b, c = (np.asarray(v, f32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    r = s.astype(f32)
    up, dn = np.nextafter(r, f32(np.inf)), np.nextafter(r, f32(-np.inf))
    r64 = r.astype(np.float64)
    at_up = s == (r64 + up.astype(np.float64)) / 2
    at_dn = s == (r64 + dn.astype(np.float64)) / 2
    r = np.where(at_up & (e < 0), r, np.where(at_up & (e > 0), up, r))
    r = np.where(at_dn & (e > 0), r, np.where(at_dn & (e < 0), dn, r))
    return r.astype(f32)


def fn(name, x):
    x = np.ascontiguousarray(x, f32)
    return np.asarray(_core._math(name, x.ravel())).reshape(x.shape)


def dot_last(a, b):
    """dot v1 over the last axis (k <= 8192: one chain from +0), broadcasting the rest."""
    a, b = np.broadcast_arrays(np.asarray(a, f32), np.asarray(b, f32))
    acc = np.zeros(a.shape[:-1], f32)
    for k in range(a.shape[-1]):
        acc = fma(a[..., k], b[..., k], acc)
    return acc


def linear(x, w):
    """x (M, K) . w (N, K)^T, chains over K."""
    acc = np.zeros((x.shape[0], w.shape[0]), f32)
    for k in range(x.shape[1]):
        acc = fma(x[:, k, None], w[None, :, k], acc)
    return acc


def rmsnorm(x, w):
    r = fn("rsqrt", dot_last(x, x) / f32(x.shape[-1]) + EPS)
    return (x * r[:, None]) * w


def clamp(x, lo, hi):
    return np.where(x < lo, lo, np.where(x > hi, hi, x)).astype(f32)


def fold(h, Bm, Xd, cs):
    """fma(exp(cs_last), h, S), S[p][n] = chain_j (B_j[n] exp(cs_last - cs_j)) Xd[j][p]."""
    last = cs[-1]
    Bd = Bm * fn("exp", last - cs)[:, None]
    S = np.zeros((P, N), f32)
    for j in range(len(cs)):
        S = fma(Bd[j][None, :], Xd[j][:, None], S)
    return fma(fn("exp", last), h, S)


def row(w, x, h0, dt_limit):
    """One row x (L, dm) from a fresh state whose h is h0 (H, 64, 128): returns y,
    the state (conv_window, h, buffer_xbc, buffer_dtraw, buffered_tokens), h_last."""
    L, dm = x.shape
    di = 2 * dm
    H, CD = di // P, di + 2 * N
    lo, hi = f32(dt_limit[0]), f32(dt_limit[1])
    zxd = linear(rmsnorm(x, w["block_norm.weight"]), w["in_proj.weight"])
    z, xbc, dtr = zxd[:, :di], zxd[:, di:di + CD], zxd[:, di + CD:]
    cw = w["conv1d.weight"].reshape(CD, 4)
    win = np.concatenate([np.zeros((3, CD), f32), xbc])
    acc = np.broadcast_to(w["conv1d.bias"], (L, CD)).astype(f32)
    for k in range(4):
        acc = fma(cw[:, k], win[k:k + L], acc)
    u = fn("silu", acc)
    dt = clamp(fn("softplus", dtr + w["dt_bias"]), lo, hi)
    A = -fn("exp", w["A_log"])
    Y = np.zeros((L, di), f32)
    h = np.array(h0, f32)
    h_last = np.zeros_like(h)
    for c0 in range(0, L, Q):
        n = min(Q, L - c0)
        Bm, Cm = u[c0:c0 + n, di:di + N], u[c0:c0 + n, di + N:]
        G = dot_last(Cm[:, None, :], Bm[None, :, :])
        causal = np.tril(np.ones((n, n), bool))
        for hd in range(H):
            xs = u[c0:c0 + n, hd * P:(hd + 1) * P]
            d = dt[c0:c0 + n, hd]
            Xd, dA = xs * d[:, None], d * A[hd]
            cs = np.zeros(n, f32)
            a = f32(0)
            for i in range(n):
                a = f32(a + dA[i])
                cs[i] = a
            seg = np.zeros((n, n), f32)  # seg[i][j]: ((+0 + dA[j+1]) + ...) + dA[i]
            for i in range(1, n):
                seg[i, :i] = seg[i - 1, :i] + dA[i]
            M = G * np.where(causal, fn("exp", seg), f32(0))
            yd = np.zeros((n, P), f32)
            for j in range(n):  # masked terms skipped
                yd[j:] = fma(M[j:, j, None], Xd[j][None, :], yd[j:])
            yo = dot_last(Cm[:, None, :], h[hd][None, :, :]) * fn("exp", cs)[:, None]
            Y[c0:c0 + n, hd * P:(hd + 1) * P] = (yd + yo) + xs * w["D"][hd]
            h_last[hd] = fold(h[hd], Bm, Xd, cs)
            if n == Q:
                h[hd] = h_last[hd]
    g = Y * fn("silu", z)
    y = x + linear(rmsnorm(g, w["norm.weight"]), w["out_proj.weight"])
    r = L % Q
    buf_x, buf_d = np.zeros((Q, CD), f32), np.zeros((Q, H), f32)
    buf_x[:r], buf_d[:r] = u[L - r:], dtr[L - r:]
    conv_window = np.ascontiguousarray(win[-4:].T)
    return y, (conv_window, h, buf_x, buf_d, r), h_last
