"""Float64 torch transcription of the upstream Mamba-2 block for the backward lane:
HF Mamba2Block (RMSNorm, in_proj split z | xBC | dt, causal depthwise conv with bias
then silu, dt = clamp(softplus(dt + dt_bias), dt_limit), A = -exp(A_log)), the SSD in
the quadratic form of mamba_ssm's ssd_minimal with the whole sequence as one block
(y_i = sum_{j <= i} (C_i . B_j) exp(cs_i - cs_j) dt_j x_j + D x_i, cs the cumulative
sum of dt A: no chunks, so nothing of the 256-grid is mirrored), gate before the norm
(RMSNormGated, norm_before_gate=False), out_proj, residual. Autograd differentiates
it: torch.clamp passes the gradient at its bounds and none strictly outside them.

Weights are upstream-like (`mamba.random_weights`) with out_proj scaled by 1/32 and
norm.weight by 1/64. Weight gradients are folds over the B*L tokens: with unit
weights and L = 513, B = 2 they reach 170 (out_proj) and 15 (in_proj), and a cell
near zero, a difference of such terms, carries the float32 rounding of its 1026
addends (measured: out_proj 1.2e-4, in_proj 1.8e-5 absolute, relative errors near
1e-7 of the largest cells), far above atol 1e-6. out_proj's gradient scales with
norm.weight, norm.weight's with out_proj, everything upstream with both; scaled, the
worst cell is within half the tolerance, and the gradients upstream (max 0.06) still
dwarf atol."""
import math

import numpy as np
import torch
import torch.nn.functional as F

import mamba

P, N = 64, 128
# (B, L, d_model): a short row, then lengths just past one and two chunks of 256
CASES = [(2, 9, 32), (1, 257, 32), (2, 513, 32)]


def weights(d_model, seed):
    w = {k: np.array(v) for k, v in mamba.random_weights("mamba2", d_model, seed=seed).items()}
    w["out_proj.weight"] = w["out_proj.weight"] * np.float32(1 / 32)
    w["norm.weight"] = w["norm.weight"] * np.float32(1 / 64)
    return w


def _rmsnorm(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def forward(w, x, dt_limit=(0.0, math.inf)):
    """w: dict of float64 tensors (upstream names); x (B, L, dm) -> y (B, L, dm)."""
    Bsz, L, dm = x.shape
    di = 2 * dm
    H, cd = di // P, di + 2 * N
    zxd = _rmsnorm(x, w["block_norm.weight"]) @ w["in_proj.weight"].T
    z, xbc, dtr = zxd[..., :di], zxd[..., di:di + cd], zxd[..., di + cd:]
    conv = F.conv1d(xbc.transpose(1, 2), w["conv1d.weight"].reshape(cd, 1, 4),
                    w["conv1d.bias"], padding=3, groups=cd)[..., :L]
    u = F.silu(conv.transpose(1, 2))
    xs, Bm, Cm = u[..., :di], u[..., di:di + N], u[..., di + N:]
    dt = torch.clamp(F.softplus(dtr + w["dt_bias"]), dt_limit[0], dt_limit[1])
    A = -torch.exp(w["A_log"])
    xh = xs.reshape(Bsz, L, H, P)
    # the whole sequence as one quadratic block: Y_i = sum_{j <= i} (C_i . B_j)
    # exp(sum dA[j+1..i]) dt_j x_j, then + D x_i
    cs = torch.cumsum(dt * A, dim=1).transpose(1, 2)                 # (B, H, L)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    seg = (cs[..., :, None] - cs[..., None, :]).masked_fill(~causal, -math.inf)
    Lm = torch.exp(seg)                                               # (B, H, L, L)
    CB = torch.einsum("bin,bjn->bij", Cm, Bm)
    y = torch.einsum("bhij,bij,bjh,bjhp->bihp", Lm, CB, dt, xh) + w["D"][:, None] * xh
    g = y.reshape(Bsz, L, di) * F.silu(z)
    return x + _rmsnorm(g, w["norm.weight"]) @ w["out_proj.weight"].T
