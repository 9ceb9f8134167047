"""Float64 Mamba-1 block written from the upstream maths (HF MambaMixer.slow_forward)."""
import numpy as np


def softplus(x):
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def silu(x):
    return x / (1 + np.exp(-x))


def rmsnorm(x, w, eps=1e-5):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def forward(w, x):
    """w: dict of float64 arrays (upstream names); x (B, L, dm) -> y (B, L, dm)."""
    B, L, dm = x.shape
    di = 2 * dm
    R = -(-dm // 16)
    xz = rmsnorm(x, w["norm.weight"]) @ w["in_proj.weight"].T
    xi, z = xz[..., :di], xz[..., di:]
    cw = w["conv1d.weight"].reshape(di, 4)
    pad = np.concatenate([np.zeros((B, 3, di)), xi], axis=1)
    conv = w["conv1d.bias"] + sum(pad[:, k:k + L] * cw[:, k] for k in range(4))
    u = silu(conv)
    xdbl = u @ w["x_proj.weight"].T
    dt, Bm, Cm = xdbl[..., :R], xdbl[..., R:R + 16], xdbl[..., R + 16:]
    delta = softplus(dt @ w["dt_proj.weight"].T + w["dt_proj.bias"])
    A = -np.exp(w["A_log"])
    h = np.zeros((B, di, 16))
    ys = np.empty((B, L, di))
    for t in range(L):
        dA = np.exp(delta[:, t, :, None] * A)
        h = dA * h + delta[:, t, :, None] * Bm[:, t, None, :] * u[:, t, :, None]
        ys[:, t] = np.einsum("bcn,bn->bc", h, Cm[:, t])
    ys = (ys + u * w["D"]) * silu(z)
    return x + ys @ w["out_proj.weight"].T
