"""Float64 Mamba-3 SISO block written from the upstream token recurrence
(mamba3_siso_step_ref in state-spaces/mamba tests/ops/triton/test_mamba3_siso.py, with
Mamba3.forward's preprocessing and upstream main's heavy-tail A): one state update
per token, no chunks."""
import numpy as np

from .oracle1 import rmsnorm, softplus

N, P, R = 128, 64, 32


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def heavy_tail(x):
    return np.where(x >= 0, 1 + np.maximum(x, 0), 1 / (1 - np.minimum(x, 0)))


def project(w, x, a_floor=1e-4):
    """The per-token inputs of the recurrence: z, v, q, k (biased, unrotated), dt,
    A*dt, sigmoid(trap), tanh(angle) * pi, each (B, L, ...) with heads on axis 2."""
    B, L, dm = x.shape
    di = 2 * dm
    H = di // P
    zx = rmsnorm(x, w["block_norm.weight"]) @ w["in_proj.weight"].T
    o = np.cumsum([0, di, di, N, N, H, H, H, R])
    z, v, Bm, Cm, dd_dt, dd_A, trap, ang = (zx[..., a:b] for a, b in zip(o, o[1:]))
    A = np.minimum(-heavy_tail(dd_A), -a_floor)
    dt = softplus(dd_dt + w["dt_bias"])
    k = rmsnorm(Bm, w["B_norm.weight"])[:, :, None, :] + w["B_bias"]
    q = rmsnorm(Cm, w["C_norm.weight"])[:, :, None, :] + w["C_bias"]
    return dict(z=z.reshape(B, L, H, P), v=v.reshape(B, L, H, P), q=q, k=k, dt=dt,
                adt=A * dt, sig=sigmoid(trap), ang=np.tanh(ang) * np.pi, dd_A=dd_A)


def rotate(t, theta):
    """Rotate pairs (2j, 2j+1), j < 32, of t (B, H, N) by theta (B, H, 32)."""
    out = t.copy()
    c, s = np.cos(theta), np.sin(theta)
    x0, x1 = t[..., 0:2 * R:2], t[..., 1:2 * R:2]
    out[..., 0:2 * R:2] = x0 * c - x1 * s
    out[..., 1:2 * R:2] = x0 * s + x1 * c
    return out


def forward(w, x, input_states=None, reports=False, a_floor=1e-4):
    """w: dict of float64 arrays (upstream names); x (B, L, dm) -> y (B, L, dm).

    input_states: upstream's (angle, ssm, k, v) to start from. With reports=True
    also returns the final (theta, h, k, v): upstream's Final_States. a_floor is
    the floor of -A (tests set 0 to see that the floor matters)."""
    B, L, dm = x.shape
    H = 2 * dm // P
    t = project(w, x, a_floor)
    if input_states is None:
        theta = np.zeros((B, H, R))
        S = np.zeros((B, H, P, N))
        k_prev = np.zeros((B, H, N))
        v_prev = np.zeros((B, H, P))
    else:
        theta, S, k_prev, v_prev = (np.array(a, dtype=np.float64) for a in input_states)
    ys = np.empty((B, L, H, P))
    for i in range(L):
        dt, sig = t["dt"][:, i], t["sig"][:, i]
        theta = theta + t["ang"][:, i, None, :] * dt[..., None]
        theta = theta - 2 * np.pi * np.floor(theta / (2 * np.pi))
        q, k = rotate(t["q"][:, i], theta), rotate(t["k"][:, i], theta)
        v = t["v"][:, i]
        alpha = np.exp(t["adt"][:, i])
        beta = (1 - sig) * dt * alpha
        gamma = sig * dt
        S = (alpha[..., None, None] * S
             + beta[..., None, None] * (v_prev[..., :, None] * k_prev[..., None, :])
             + gamma[..., None, None] * (v[..., :, None] * k[..., None, :]))
        out = np.einsum("bhpn,bhn->bhp", S, q) + w["D"][:, None] * v
        z = t["z"][:, i]
        ys[:, i] = out * z * sigmoid(z)
        k_prev, v_prev = k, v
    y = x + ys.reshape(B, L, H * P) @ w["out_proj.weight"].T
    if reports:
        return y, (theta, S, k_prev, v_prev)
    return y


def sane(w):
    """The weights the tolerance comparison runs on: out_proj scaled by 1/8 (exact).

    Upstream's unit B/C biases make q.k about 128, so at upstream-like init the mixer
    adds about 2 (rms) to the residual, against about 0.05 for Mamba-1's random
    weights. Any float32 evaluation (the C reference, or this recurrence run in
    float32 numpy) then differs from float64 by a few 1e-6 absolute, which exceeds
    atol 1e-6 where y crosses zero. Scaled, the mixer adds 0.03 to 0.4 and the
    comparison keeps its full rtol 1e-5, atol 1e-6."""
    out = dict(w)
    out["out_proj.weight"] = np.asarray(w["out_proj.weight"], dtype=np.float32) * np.float32(0.125)
    return out
