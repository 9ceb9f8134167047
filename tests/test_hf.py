"""The blocks against Hugging Face transformers' torch implementations (CPU torch),
run in float64 so the comparison is against the upstream maths, not its rounding."""
import numpy as np
import pytest

import mamba

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

RTOL, ATOL = 1e-5, 1e-6


def _load(module, weights, prefix_map):
    sd = {prefix_map(k): torch.from_numpy(np.asarray(v, dtype=np.float64).copy())
          for k, v in weights.items()}
    own = module.state_dict()
    sd = {k: v.reshape(own[k].shape) for k, v in sd.items()}
    module.load_state_dict(sd, strict=True)


@pytest.mark.parametrize("B,L,dm", [(1, 1, 16), (2, 33, 32), (1, 200, 48)])
def test_mamba1_matches_hf_mambablock(B, L, dm):
    from transformers.models.mamba.modeling_mamba import MambaBlock, MambaConfig
    cfg = MambaConfig(hidden_size=dm, state_size=16, expand=2, conv_kernel=4,
                      time_step_rank=-(-dm // 16), use_bias=False, use_conv_bias=True,
                      hidden_act="silu", layer_norm_epsilon=1e-5, residual_in_fp32=True,
                      use_mambapy=False)
    hf = MambaBlock(cfg, layer_idx=0).double().eval()
    w = mamba.random_weights("mamba1", dm, seed=B + L)
    _load(hf, w, lambda k: k if k == "norm.weight" else "mixer." + k)
    x = np.random.default_rng(L).standard_normal((B, L, dm)).astype(np.float32)
    with torch.no_grad():
        want = hf(torch.from_numpy(x.astype(np.float64))).numpy()
    got = np.asarray(mamba.Mamba1Block(w, backend="cpu").forward(x))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def _hf_mamba2(w, dm, dt_limit):
    """transformers' Mamba2Block holding our weights (block_norm.weight is its norm;
    everything else, the gated norm included, sits under mixer.)."""
    from transformers import Mamba2Config
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Block
    cfg = Mamba2Config(hidden_size=dm, num_heads=2 * dm // 64, head_dim=64, state_size=128,
                       n_groups=1, chunk_size=256, expand=2, conv_kernel=4, use_bias=False,
                       use_conv_bias=True, hidden_act="silu", layer_norm_epsilon=1e-5,
                       residual_in_fp32=True, time_step_limit=tuple(dt_limit),
                       num_hidden_layers=1)
    hf = Mamba2Block(cfg, layer_idx=0).double().eval()
    _load(hf, w, lambda k: "norm.weight" if k == "block_norm.weight" else "mixer." + k)
    return hf


@pytest.mark.parametrize("B,L,dm,limited", [(1, 1, 32, False), (2, 300, 64, False),
                                            (1, 520, 32, False), (2, 300, 64, True)])
def test_mamba2_matches_hf_mamba2block(B, L, dm, limited):
    """Prefill without a cache: HF's chunked torch path (mamba2_chunk_scan), which
    applies time_step_limit as torch.clamp after softplus, as SPEC 6 does. (HF's
    single-token cache path, mamba2_selective_state_update, ignores the limit, so a
    clamped comparison is only meaningful here.) Under .double() HF still evaluates
    both RMSNorms and the scan in float32 (explicit casts in modeling_mamba2), so
    this checks the maths, and oracle2 checks the float64 precision."""
    from mamba._oracle64 import oracle2
    w = mamba.random_weights("mamba2", dm, seed=B + L)
    x = np.random.default_rng(L).standard_normal((B, L, dm)).astype(np.float32)
    limit = (0.0, float("inf"))
    if limited:
        w64 = {k: np.asarray(v, dtype=np.float64) for k, v in w.items()}
        dt = oracle2.dt_preclamp(w64, x.astype(np.float64))
        limit = tuple(float(np.float32(v)) for v in np.quantile(dt, [0.3, 0.7]))
        assert (dt < limit[0]).any() and (dt > limit[1]).any()
    hf = _hf_mamba2(w, dm, limit)
    with torch.no_grad():
        want = hf(torch.from_numpy(x.astype(np.float64))).numpy()
    got = np.asarray(mamba.Mamba2Block(w, dt_limit=limit, backend="cpu").forward(x))
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    if limited:  # the clamp is really applied on both sides
        hf_free = _hf_mamba2(w, dm, (0.0, float("inf")))
        with torch.no_grad():
            free = hf_free(torch.from_numpy(x.astype(np.float64))).numpy()
        assert not np.allclose(got, free, rtol=RTOL, atol=ATOL)
