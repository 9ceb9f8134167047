"""Mamba-1 on the CPU against Hugging Face transformers' MambaBlock (CPU torch float32),
in one process: forward and backward at B=1, L=2048, d_model=384 and a decode step at
d_model=1024.
Prints markdown rows for docs/performance.md."""
import statistics
import time

import numpy as np
import torch
from transformers import DynamicCache
from transformers.models.mamba.modeling_mamba import MambaBlock, MambaConfig

import mamba


def median_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def hf_block(w, dm):
    cfg = MambaConfig(hidden_size=dm, state_size=16, expand=2, conv_kernel=4,
                      time_step_rank=-(-dm // 16), use_bias=False, use_conv_bias=True,
                      hidden_act="silu", layer_norm_epsilon=1e-5, residual_in_fp32=True,
                      num_hidden_layers=1, use_mambapy=False)
    blk = MambaBlock(cfg, layer_idx=0).eval()
    sd = {("norm.weight" if k == "norm.weight" else "mixer." + k): torch.from_numpy(np.asarray(v).copy())
          for k, v in w.items()}
    own = blk.state_dict()
    blk.load_state_dict({k: v.reshape(own[k].shape) for k, v in sd.items()})
    return blk, cfg


def forward_row(B, L, dm, reps):
    w = mamba.random_weights("mamba1", dm)
    ours = mamba.Mamba1Block(w, backend="cpu")
    hf, _ = hf_block(w, dm)
    x = np.random.default_rng(0).standard_normal((B, L, dm)).astype(np.float32)
    xt = torch.from_numpy(x)
    with torch.no_grad():
        t_hf = median_ms(lambda: hf(xt), reps)
    t_us = median_ms(lambda: ours.forward(x), reps)
    return f"| Mamba1Block.forward B={B} L={L} d_model={dm} | {t_us:.1f} ms | {t_hf:.1f} ms | {t_hf / t_us:.1f}x |"


def backward_row(B, L, dm, reps):
    """Gradients of x and every weight: ours against HF's forward + torch autograd."""
    w = mamba.random_weights("mamba1", dm)
    ours = mamba.Mamba1Block(w, backend="cpu")
    hf, _ = hf_block(w, dm)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, L, dm)).astype(np.float32)
    dy = rng.standard_normal((B, L, dm)).astype(np.float32)
    dyt = torch.from_numpy(dy)

    def hf_bwd():
        hf.zero_grad()
        xt = torch.from_numpy(x).requires_grad_(True)
        hf(xt).backward(dyt)

    t_hf = median_ms(hf_bwd, reps)
    t_us = median_ms(lambda: ours.backward(x, dy), reps)
    return (f"| Mamba1Block.backward B={B} L={L} d_model={dm} (HF: forward + autograd) "
            f"| {t_us:.1f} ms | {t_hf:.1f} ms | {t_hf / t_us:.1f}x |")


def decode_row(dm, reps):
    w = mamba.random_weights("mamba1", dm)
    ours = mamba.Mamba1Block(w, backend="cpu")
    hf, cfg = hf_block(w, dm)
    rng = np.random.default_rng(1)
    prompt = rng.standard_normal((1, 8, dm)).astype(np.float32)
    tok = rng.standard_normal((1, 1, dm)).astype(np.float32)
    st = ours.allocate_state(1)
    ours.forward(prompt, st)
    cache = DynamicCache(config=cfg)
    tt = torch.from_numpy(tok)
    with torch.no_grad():
        hf(torch.from_numpy(prompt), cache=cache)
        t_hf = median_ms(lambda: hf(tt, cache=cache), reps)
    with ours.decode_session(st) as s:
        t_sess = median_ms(lambda: s.step(tok), reps)
    t_step = median_ms(lambda: ours.step(tok, st), reps)
    return (f"| Mamba1 decode step d_model={dm} B=1 (session / step) | {t_sess:.3f} / {t_step:.3f} ms "
            f"| {t_hf:.3f} ms | {t_hf / t_sess:.1f}x |")


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| case | mamba-blocks (identical) | HF transformers | speed-up |")
    print("|---|---|---|---|")
    print(forward_row(1, 2048, 384, 7))
    print(backward_row(1, 2048, 384, 5))
    print(decode_row(1024, 50))
