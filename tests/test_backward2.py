"""Mamba-2 backward with a binding dt_limit: where the clamp holds dt at a bound its
gradient is zero (tests/test_backward.py covers the default limit)."""
import numpy as np
import pytest

import mamba

torch = pytest.importorskip("torch")
import torch_ref2  # noqa: E402


def test_gradients_with_binding_dt_limit():
    B, L, dm = 2, 260, 32
    w = torch_ref2.weights(dm, 5)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((B, L, dm)).astype(np.float32)
    dy = rng.standard_normal((B, L, dm)).astype(np.float32)
    tw = {k: torch.tensor(np.asarray(v, dtype=np.float64), requires_grad=True) for k, v in w.items()}
    tx = torch.tensor(x.astype(np.float64), requires_grad=True)
    with torch.no_grad():  # dt before the clamp, to put the bounds inside its range
        di = 2 * dm
        zxd = torch_ref2._rmsnorm(tx, tw["block_norm.weight"]) @ tw["in_proj.weight"].T
        sp = torch.nn.functional.softplus(zxd[..., 2 * di + 256:] + tw["dt_bias"]).numpy()
    lim = tuple(float(np.quantile(sp, q)) for q in (0.3, 0.7))
    blk = mamba.Mamba2Block(w, dt_limit=lim, backend="cpu")
    got = blk.backward(x, dy)
    y = torch_ref2.forward(tw, tx, dt_limit=blk.dt_limit)
    lo, hi = blk.dt_limit
    assert (sp < lo).mean() > 0.2 and (sp > hi).mean() > 0.2
    y.backward(torch.from_numpy(dy.astype(np.float64)))
    np.testing.assert_allclose(np.asarray(got["x"]), tx.grad.numpy(), rtol=1e-5, atol=1e-6)
    for k in w:
        np.testing.assert_allclose(np.asarray(got[k]), tw[k].grad.numpy().reshape(np.asarray(got[k]).shape),
                                   rtol=1e-5, atol=1e-6, err_msg=k)
    # and the unclamped block's gradients differ (the limit is really applied)
    free = mamba.Mamba2Block(w, backend="cpu").backward(x, dy)
    assert np.asarray(free["dt_bias"]).tobytes() != np.asarray(got["dt_bias"]).tobytes()
