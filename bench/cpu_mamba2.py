"""Mamba-2 on the CPU against Hugging Face transformers' Mamba2Block (CPU torch float32,
its torch fallback path), in one process: forward at B=1, L=2048, d_model=384 (both),
forward at B=4, L=4096, d_model=768 (ours only: HF's chunked path needs several GiB
there), and decode steps at d_model=1024 from the middle of a chunk (a 384-token prefill).
Prints markdown rows for docs/performance.md."""
import statistics
import time

import numpy as np
import torch
from transformers import DynamicCache, Mamba2Config
from transformers.models.mamba2.modeling_mamba2 import Mamba2Block

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
    cfg = Mamba2Config(hidden_size=dm, num_heads=2 * dm // 64, head_dim=64, state_size=128,
                       n_groups=1, chunk_size=256, expand=2, conv_kernel=4, use_bias=False,
                       use_conv_bias=True, hidden_act="silu", layer_norm_epsilon=1e-5,
                       residual_in_fp32=True, num_hidden_layers=1)
    blk = Mamba2Block(cfg, layer_idx=0).eval()
    sd = {("norm.weight" if k == "block_norm.weight" else "mixer." + k):
          torch.from_numpy(np.asarray(v).copy()) for k, v in w.items()}
    own = blk.state_dict()
    blk.load_state_dict({k: v.reshape(own[k].shape) for k, v in sd.items()})
    return blk, cfg


def forward_row(B, L, dm, reps, with_hf):
    w = mamba.random_weights("mamba2", dm)
    ours = mamba.Mamba2Block(w, backend="cpu")
    x = np.random.default_rng(0).standard_normal((B, L, dm)).astype(np.float32)
    t_us = median_ms(lambda: ours.forward(x), reps)
    case = f"| Mamba2Block.forward B={B} L={L} d_model={dm} | {t_us:.1f} ms |"
    if not with_hf:
        return case + " — | — |"
    hf, _ = hf_block(w, dm)
    xt = torch.from_numpy(x)
    with torch.no_grad():
        t_hf = median_ms(lambda: hf(xt), reps)
    return case + f" {t_hf:.1f} ms | {t_hf / t_us:.1f}x |"


def decode_row(dm, prompt_len, reps):
    w = mamba.random_weights("mamba2", dm)
    ours = mamba.Mamba2Block(w, backend="cpu")
    hf, cfg = hf_block(w, dm)
    rng = np.random.default_rng(1)
    prompt = rng.standard_normal((1, prompt_len, dm)).astype(np.float32)
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
    rows = prompt_len % 256
    return (f"| Mamba2 decode step d_model={dm} B=1, open chunk {rows}..{rows + 2 * reps + 2} rows "
            f"(session / step) | {t_sess:.3f} / {t_step:.3f} ms | {t_hf:.3f} ms | "
            f"{t_hf / t_sess:.1f}x |")


if __name__ == "__main__":
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| case | mamba-blocks (identical) | HF transformers | speed-up |")
    print("|---|---|---|---|")
    print(forward_row(1, 2048, 384, 5, True))
    print(forward_row(4, 4096, 768, 3, False))
    print(decode_row(1024, 384, 30))
