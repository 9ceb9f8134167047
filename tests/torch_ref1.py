"""Differentiable float64 Mamba-1 block for the backward tests, written from Hugging Face
transformers' MambaBlock (MambaRMSNorm, MambaMixer.slow_forward, residual) with torch
ops: the depthwise conv as a grouped conv1d padded by d_conv - 1 and cut to L, the
selective scan as a loop over tokens. Autograd differentiates it.

The cases put L on one token, across one 32-token chunk of the C backward's scan and
across many, with d_inner below, at and across its 64-channel blocks (d_model 16, 24, 40).

Weights are upstream-like (`mamba.random_weights`) with out_proj scaled by 1/8 and the
gate rows of in_proj (z) by 1/4. Weight gradients are folds over the B*L tokens of terms
near 1 in size: unscaled, the float32 fold of 257 of them sits about 1e-6 from its
float64 value (rounding of the terms alone), so the out_proj and in_proj gradients miss
atol 1e-6 by construction. Scaled, every gradient is smaller than its terms' rounding
would need, and all keep rtol 1e-5, atol 1e-6 with a margin of 2 or more.
"""
import numpy as np
import torch
import torch.nn.functional as F

import mamba

CASES = [(2, 33, 24), (1, 1, 16), (1, 257, 40), (2, 257, 16)]


def weights(d_model, seed):
    w = {k: np.array(v) for k, v in mamba.random_weights("mamba1", d_model, seed=seed).items()}
    w["out_proj.weight"] = w["out_proj.weight"] * np.float32(0.125)
    w["in_proj.weight"][2 * d_model:] *= np.float32(0.25)
    return w


def forward(w, x):
    """w: dict of float64 tensors under the upstream names; x (B, L, dm) -> (B, L, dm)."""
    B, L, dm = x.shape
    di = w["D"].shape[0]
    N = w["A_log"].shape[1]
    R = w["dt_proj.weight"].shape[1]

    var = x.pow(2).mean(-1, keepdim=True)
    xn = w["norm.weight"] * (x * torch.rsqrt(var + 1e-5))

    proj = (xn @ w["in_proj.weight"].T).transpose(1, 2)  # (B, 2 di, L)
    hs, gate = proj.chunk(2, dim=1)
    conv = F.conv1d(hs, w["conv1d.weight"].reshape(di, 1, -1), w["conv1d.bias"],
                    padding=w["conv1d.weight"].shape[-1] - 1, groups=di)[..., :L]
    hs = F.silu(conv)  # (B, di, L)

    ssm = hs.transpose(1, 2) @ w["x_proj.weight"].T
    ts, Bm, Cm = torch.split(ssm, [R, N, N], dim=-1)
    dt = F.softplus(ts @ w["dt_proj.weight"].T + w["dt_proj.bias"]).transpose(1, 2)
    A = -torch.exp(w["A_log"])
    dA = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # (B, di, L, N)
    dBu = dt[:, :, :, None] * Bm[:, None, :, :] * hs[:, :, :, None]

    state = torch.zeros(B, di, N, dtype=x.dtype)
    ys = []
    for i in range(L):
        state = dA[:, :, i, :] * state + dBu[:, :, i, :]
        ys.append(torch.matmul(state, Cm[:, i, :].unsqueeze(-1)))
    y = torch.stack(ys, dim=-1).squeeze(2)  # (B, di, L)
    y = (y + hs * w["D"][None, :, None]) * F.silu(gate)
    return x + y.transpose(1, 2) @ w["out_proj.weight"].T
