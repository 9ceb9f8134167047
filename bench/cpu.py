"""The three blocks on the CPU (C reference, identical profile) against their torch
baselines, in one process: Hugging Face transformers' MambaBlock / Mamba2Block (CPU torch
float32) and, for Mamba-3 (no HF implementation), the torch eager block in
bench/torch_mamba3.py. Forward, decode step and forward + backward (torch autograd).
Prints a header (date, commit, machine) and markdown rows for docs/performance.md.

    python bench/cpu.py [--blocks mamba1 mamba2 mamba3] [--quick]
"""
import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
from transformers import DynamicCache, Mamba2Config, MambaConfig
from transformers.models.mamba.modeling_mamba import MambaBlock
from transformers.models.mamba2.modeling_mamba2 import Mamba2Block

import mamba

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_mamba3  # noqa: E402


def median_ms(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


# ------------------------------------------------------------------ baselines
def _hf(block_cls, cfg, w, rename):
    blk = block_cls(cfg, layer_idx=0).eval()
    own = blk.state_dict()
    blk.load_state_dict({rename(k): torch.from_numpy(np.asarray(v).copy()).reshape(own[rename(k)].shape)
                         for k, v in w.items()})
    return blk


def hf_mamba1(w, dm):
    cfg = MambaConfig(hidden_size=dm, state_size=16, expand=2, conv_kernel=4,
                      time_step_rank=-(-dm // 16), use_bias=False, use_conv_bias=True,
                      hidden_act="silu", layer_norm_epsilon=1e-5, residual_in_fp32=True,
                      num_hidden_layers=1, use_mambapy=False)
    return _hf(MambaBlock, cfg, w, lambda k: k if k == "norm.weight" else "mixer." + k), cfg


def hf_mamba2(w, dm):
    cfg = Mamba2Config(hidden_size=dm, num_heads=2 * dm // 64, head_dim=64, state_size=128,
                       n_groups=1, chunk_size=256, expand=2, conv_kernel=4, use_bias=False,
                       use_conv_bias=True, hidden_act="silu", layer_norm_epsilon=1e-5,
                       residual_in_fp32=True, num_hidden_layers=1)
    return _hf(Mamba2Block, cfg, w,
               lambda k: "norm.weight" if k == "block_norm.weight" else "mixer." + k), cfg


class TorchMamba3(torch.nn.Module):
    """torch_mamba3 as a module, so the forward/backward timing code is shared."""

    def __init__(self, w):
        super().__init__()
        self.w = torch.nn.ParameterDict(
            {k.replace(".", "_"): torch.nn.Parameter(torch.from_numpy(np.asarray(v).copy()))
             for k, v in w.items()})

    def forward(self, x):
        return torch_mamba3.torch_block({k.replace("_weight", ".weight"): v
                                         for k, v in self.w.items()}, x)


BASELINE = {"mamba1": ("HF MambaBlock", lambda w, dm: hf_mamba1(w, dm)[0]),
            "mamba2": ("HF Mamba2Block", lambda w, dm: hf_mamba2(w, dm)[0]),
            "mamba3": ("torch eager", lambda w, dm: TorchMamba3(w))}
CLASSES = {"mamba1": mamba.Mamba1Block, "mamba2": mamba.Mamba2Block, "mamba3": mamba.Mamba3Block}


# ----------------------------------------------------------------------- rows
def row(case, ours, theirs, who):
    return f"| {case} | {ours:.1f} ms | {theirs:.1f} ms ({who}) | {theirs / ours:.1f}x |"


def forward_row(name, B, L, dm, reps, baseline=True):
    w = mamba.random_weights(name, dm)
    ours = CLASSES[name](w, backend="cpu")
    x = np.random.default_rng(0).standard_normal((B, L, dm)).astype(np.float32)
    t_us = median_ms(lambda: ours.forward(x), reps)
    case = f"{CLASSES[name].__name__}.forward B={B} L={L} d_model={dm}"
    if not baseline:
        return f"| {case} | {t_us:.1f} ms | not run | |"
    who, make = BASELINE[name]
    ref = make(w, dm)
    xt = torch.from_numpy(x)
    with torch.no_grad():
        t_ref = median_ms(lambda: ref(xt), reps)
    return row(case, t_us, t_ref, who)


def backward_row(name, B, L, dm, reps):
    w = mamba.random_weights(name, dm)
    ours = CLASSES[name](w, backend="cpu")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, L, dm)).astype(np.float32)
    dy = rng.standard_normal((B, L, dm)).astype(np.float32)
    t_us = median_ms(lambda: (ours.forward(x), ours.backward(x, dy)), reps)
    who, make = BASELINE[name]
    ref = make(w, dm)  # eval mode: the same slow path as forward, with autograd
    xt = torch.from_numpy(x).requires_grad_(True)
    dyt = torch.from_numpy(dy)

    def step():
        ref.zero_grad(set_to_none=True)
        xt.grad = None
        ref(xt).backward(dyt)

    t_ref = median_ms(step, reps)
    return row(f"{CLASSES[name].__name__} forward + backward B={B} L={L} d_model={dm}",
               t_us, t_ref, who + " + autograd")


def decode_row(name, dm, prompt, reps):
    w = mamba.random_weights(name, dm)
    ours = CLASSES[name](w, backend="cpu")
    rng = np.random.default_rng(1)
    xp = rng.standard_normal((1, prompt, dm)).astype(np.float32)
    tok = rng.standard_normal((1, 1, dm)).astype(np.float32)
    st = ours.allocate_state(1)
    ours.forward(xp, st)
    with torch.no_grad():
        if name == "mamba3":
            tw = {k: torch.from_numpy(np.asarray(v)) for k, v in w.items()}
            H = 2 * dm // 64
            tst = [torch.zeros(1, H, 32), torch.zeros(1, H, 64, 128), torch.zeros(1, H, 128),
                   torch.zeros(1, H, 64)]
            for t in range(prompt):
                torch_mamba3.torch_step(tw, torch.from_numpy(xp[:, t]), tst)
            tt = torch.from_numpy(tok[:, 0])
            t_ref = median_ms(lambda: torch_mamba3.torch_step(tw, tt, tst), reps)
            who = "torch eager step"
        else:
            ref, cfg = (hf_mamba1 if name == "mamba1" else hf_mamba2)(w, dm)
            cache = DynamicCache(config=cfg)
            ref(torch.from_numpy(xp), cache=cache)
            tt = torch.from_numpy(tok)
            t_ref = median_ms(lambda: ref(tt, cache=cache), reps)
            who = "HF cached step"
    with ours.decode_session(st) as s:
        t_sess = median_ms(lambda: s.step(tok), reps)
    return row(f"{CLASSES[name].__name__} decode step (session) d_model={dm} B=1",
               t_sess, t_ref, who)


def header():
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=os.path.dirname(__file__)).stdout.strip()
    except OSError:
        commit = "?"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{datetime.date.today()}, commit {commit}, {os.cpu_count()} cores ({cpu}), "
            f"torch {torch.__version__} with {torch.get_num_threads()} threads, "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", nargs="+", default=list(CLASSES))
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = p.parse_args()
    reps = 3 if args.quick else 7
    print(header())
    print("| case | mamba-blocks | baseline | speed-up |")
    print("|---|---|---|---|")
    for name in args.blocks:
        print(forward_row(name, 1, 2048, 384, reps), flush=True)
        if name == "mamba2":
            print(forward_row(name, 4, 4096, 768, 2, baseline=False), flush=True)
        print(decode_row(name, 1024, 384 if name == "mamba2" else 60, 10 * reps), flush=True)
        try:
            print(backward_row(name, 1, 2048, 384, max(2, reps // 2)), flush=True)
        except NotImplementedError as e:
            print(f"| {CLASSES[name].__name__} forward + backward | {e} | | |")


if __name__ == "__main__":
    main()
