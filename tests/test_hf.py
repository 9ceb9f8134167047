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
