"""Float64 Mamba-2 block written from the upstream maths as the plain per-token
recurrence (no chunks): h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t
(mamba_ssm's selective_state_update / ssd_minimal's reference), gate before the
norm, RMSNorm, out_proj, residual."""
import numpy as np

from .oracle1 import rmsnorm, silu, softplus

P, N = 64, 128


def _mixer_inputs(w, x):
    """z, post-conv x, B, C and dt before the clamp, for x (B, L, dm)."""
    Bsz, L, dm = x.shape
    di = 2 * dm
    cd = di + 2 * N
    zxd = rmsnorm(x, w["block_norm.weight"]) @ w["in_proj.weight"].T
    z, xbc, dtr = zxd[..., :di], zxd[..., di:di + cd], zxd[..., di + cd:]
    cw = w["conv1d.weight"].reshape(cd, 4)
    pad = np.concatenate([np.zeros((Bsz, 3, cd)), xbc], axis=1)
    u = silu(w["conv1d.bias"] + sum(pad[:, k:k + L] * cw[:, k] for k in range(4)))
    return z, u[..., :di], u[..., di:di + N], u[..., di + N:], softplus(dtr + w["dt_bias"])


def dt_preclamp(w, x):
    """softplus(dt_raw + dt_bias), (B, L, H): dt before dt_limit is applied."""
    return _mixer_inputs(w, x)[4]


def forward(w, x, dt_limit=(0.0, np.inf), h0=None, return_state=False):
    """w: dict of float64 arrays (upstream names); x (B, L, dm) -> y (B, L, dm).
    h0 (B, H, 64, 128) is upstream's initial_states; return_state also returns the
    final SSM state (upstream final_states)."""
    Bsz, L, dm = x.shape
    di = 2 * dm
    H = di // P
    z, xs, Bm, Cm, dt = _mixer_inputs(w, x)
    dt = np.clip(dt, dt_limit[0], dt_limit[1])
    A = -np.exp(w["A_log"])
    xh = xs.reshape(Bsz, L, H, P)
    h = np.zeros((Bsz, H, P, N)) if h0 is None else np.array(h0, dtype=np.float64)
    ys = np.empty((Bsz, L, H, P))
    for t in range(L):
        dA = np.exp(dt[:, t] * A)  # (B, H)
        dBx = (dt[:, t, :, None] * xh[:, t])[..., None] * Bm[:, t, None, None, :]
        h = dA[..., None, None] * h + dBx
        ys[:, t] = np.einsum("bhpn,bn->bhp", h, Cm[:, t]) + w["D"][:, None] * xh[:, t]
    g = ys.reshape(Bsz, L, di) * silu(z)
    y = x + rmsnorm(g, w["norm.weight"]) @ w["out_proj.weight"].T
    return (y, h) if return_state else y
