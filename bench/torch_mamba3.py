"""The Mamba-3 SISO block in plain torch float32 eager (bench-only), written from
upstream's mamba3_siso_fwd_ref / mamba3_siso_step_ref (state-spaces/mamba
tests/ops/triton/test_mamba3_siso.py) and Mamba3.forward, the quadratic form evaluated
per chunk of 64 and the chunk states passed as in ssd_minimal. Differentiable, so it
also gives the torch-autograd baseline for backward."""
import math

import torch
import torch.nn.functional as F

N, P, R, Q = 128, 64, 32, 64


def rmsnorm(t, w):
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def rotate(t, cos, sin):
    """Rotate the interleaved pairs (2j, 2j+1), j < 32, of t (..., 128)."""
    pairs = t.view(*t.shape[:-1], N // 2, 2)
    a, b = pairs[..., :R, 0], pairs[..., :R, 1]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return torch.cat([rot.flatten(-2), t[..., 2 * R:]], dim=-1)


def segsum(x):
    """exp-ready segment sums over the last axis: out[..., i, j] = sum x[j+1..i], -inf
    above the diagonal."""
    T = x.shape[-1]
    cs = torch.cumsum(x, dim=-1)
    out = cs[..., :, None] - cs[..., None, :]
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device))
    return out.masked_fill(~mask, -torch.inf)


def torch_block(w, x):
    """The Mamba-3 SISO block in torch float32, chunk size 64 (L a multiple of 64)."""
    B, L, dm = x.shape
    di = 2 * dm
    H = di // P
    C = L // Q
    zx = rmsnorm(x, w["block_norm.weight"]) @ w["in_proj.weight"].T
    z, v, Bm, Cm, dd_dt, dd_A, trap, ang = torch.split(zx, [di, di, N, N, H, H, H, R], -1)
    A = -(dd_A.clamp_min(0) + torch.reciprocal(1 - dd_A.clamp_max(0)))  # heavy tail
    A = A.clamp(max=-1e-4)
    dt = F.softplus(dd_dt + w["dt_bias"])                                # (B, L, H)
    adt = A * dt
    sig = torch.sigmoid(trap)
    k = rmsnorm(Bm, w["B_norm.weight"])[:, :, None, :] + w["B_bias"]     # (B, L, H, N)
    q = rmsnorm(Cm, w["C_norm.weight"])[:, :, None, :] + w["C_bias"]
    theta = torch.cumsum(torch.tanh(ang)[:, :, None, :] * math.pi * dt[..., None], dim=1)
    theta = theta - 2 * math.pi * torch.floor(theta / (2 * math.pi))
    cos, sin = torch.cos(theta), torch.sin(theta)
    dt_next = F.pad(dt[:, 1:], (0, 0, 0, 1))
    sig_next = F.pad(sig[:, 1:], (0, 0, 0, 1))
    shifted = dt_next * (1 - sig_next)
    scale = dt * sig + shifted
    qk_dot = (q * k).sum(-1) * shifted
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    ks = k * scale[..., None]
    v = v.reshape(B, L, H, P)
    # chunked quadratic form
    qc, kc, vc = (t.reshape(B, C, Q, H, -1) for t in (q, ks, v))
    a = adt.reshape(B, C, Q, H).permute(0, 3, 1, 2)                      # (B, H, C, Q)
    cs = torch.cumsum(a, dim=-1)
    G = torch.einsum("bclhn,bcshn->bhcls", qc, kc) * torch.exp(segsum(a))
    y = torch.einsum("bhcls,bcshp->bclhp", G, vc)
    decay = torch.exp(cs[..., -1:] - cs)                                 # (B, H, C, Q)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", kc, decay, vc)
    chunk_decay = torch.exp(segsum(F.pad(cs[..., -1], (1, 0))))          # (B, H, C+1, C+1)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    entering = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)[:, :-1]
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", qc, entering, torch.exp(cs))
    y = y.reshape(B, L, H, P)
    y = y + w["D"][:, None] * v - v * qk_dot[..., None]
    y = y.reshape(B, L, di) * F.silu(z)
    return x + y @ w["out_proj.weight"].T


def torch_step(w, x, st):
    """One token x (B, d_model) of the same block from upstream's mamba3_siso_step_ref;
    st = [theta (B,H,32), S (B,H,64,128), k (B,H,128), v (B,H,64)] is updated."""
    B, dm = x.shape
    di = 2 * dm
    H = di // P
    zx = rmsnorm(x, w["block_norm.weight"]) @ w["in_proj.weight"].T
    z, v, Bm, Cm, dd_dt, dd_A, trap, ang = torch.split(zx, [di, di, N, N, H, H, H, R], -1)
    A = (-(dd_A.clamp_min(0) + torch.reciprocal(1 - dd_A.clamp_max(0)))).clamp(max=-1e-4)
    dt = F.softplus(dd_dt + w["dt_bias"])
    sig = torch.sigmoid(trap)
    k = rmsnorm(Bm, w["B_norm.weight"])[:, None, :] + w["B_bias"]
    q = rmsnorm(Cm, w["C_norm.weight"])[:, None, :] + w["C_bias"]
    theta = st[0] + torch.tanh(ang)[:, None, :] * math.pi * dt[..., None]
    theta = theta - 2 * math.pi * torch.floor(theta / (2 * math.pi))
    cos, sin = torch.cos(theta), torch.sin(theta)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    v = v.reshape(B, H, P)
    alpha = torch.exp(A * dt)
    beta, gamma = (1 - sig) * dt * alpha, sig * dt
    S = (alpha[..., None, None] * st[1]
         + beta[..., None, None] * (st[3][..., :, None] * st[2][..., None, :])
         + gamma[..., None, None] * (v[..., :, None] * k[..., None, :]))
    y = torch.einsum("bhpn,bhn->bhp", S, q) + w["D"][:, None] * v
    st[:] = [theta, S, k, v]
    return x + (y.reshape(B, di) * F.silu(z)) @ w["out_proj.weight"].T
