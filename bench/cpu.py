"""The three blocks on the CPU (C reference, identical profile) against their torch
baselines, in one process: Hugging Face transformers' MambaBlock / Mamba2Block (CPU torch
float32) and, for Mamba-3 (no HF implementation), the torch eager block in
bench/torch_mamba3.py. Forward, decode step and forward + backward (torch autograd).
Prints a header (date, commit, machine, the CPU ISA copy in use) and markdown rows for
docs/performance.md, each followed by the load average while it ran (other processes
on the machine slow our OpenMP threads more than torch's: compare under low load).

    python bench/cpu.py [--blocks mamba1 mamba2 mamba3] [--rows forward big decode backward]
                        [--quick] [--rounds N] [--slow-baseline]

Rows: forward (B=1 L=2048 d_model=384), big (Mamba-2 only: B=4 L=4096 d_model=768),
decode (one session step at d_model 1024 after a prompt), backward (forward + backward,
B=1 L=2048 d_model=384: our vjp then its pullback against the baseline's forward then
autograd's backward; HF's Mamba-1 slow path takes many minutes there).
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
from mamba import _core

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_mamba3  # noqa: E402


def paired_ms(fn, ref, reps, ref_warm=True):
    """Medians (ms) of reps timed calls of fn and of ref after a warm-up each, the two
    alternating call by call so that a change of load hits both. ref_warm=False times
    the baseline's first call (for baselines that take minutes per call)."""
    times = ([], [])
    fn()
    if ref_warm:
        ref()
    for _ in range(reps):
        for f, t in zip((fn, ref), times):
            t0 = time.perf_counter()
            f()
            t.append(time.perf_counter() - t0)
    return [1e3 * statistics.median(t) for t in times]


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


def load():
    """The 1-minute load average, or '?' where the platform has none."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"


def forward_row(name, B, L, dm, reps):
    w = mamba.random_weights(name, dm)
    ours = CLASSES[name](w, backend="cpu")
    x = np.random.default_rng(0).standard_normal((B, L, dm)).astype(np.float32)
    case = f"{CLASSES[name].__name__}.forward B={B} L={L} d_model={dm}"
    who, make = BASELINE[name]
    ref = make(w, dm)
    xt = torch.from_numpy(x)
    with torch.no_grad():
        t_us, t_ref = paired_ms(lambda: ours.forward(x), lambda: ref(xt), reps)
    return row(case, t_us, t_ref, who)


def backward_row(name, B, L, dm, reps, ref_warm=True):
    w = mamba.random_weights(name, dm)
    ours = CLASSES[name](w, backend="cpu")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, L, dm)).astype(np.float32)
    dy = rng.standard_normal((B, L, dm)).astype(np.float32)
    who, make = BASELINE[name]
    ref = make(w, dm)  # eval mode: the same slow path as forward, with autograd
    xt = torch.from_numpy(x).requires_grad_(True)
    dyt = torch.from_numpy(dy)

    def step():
        ref.zero_grad(set_to_none=True)
        xt.grad = None
        ref(xt).backward(dyt)

    def ours_step():  # the training API: the forward, then its pullback
        y, pullback = ours.vjp(x)
        pullback(dy)

    t_us, t_ref = paired_ms(ours_step, step, reps, ref_warm)
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

            def ref_step():
                torch_mamba3.torch_step(tw, tt, tst)
            who = "torch eager step"
        else:
            ref, cfg = (hf_mamba1 if name == "mamba1" else hf_mamba2)(w, dm)
            cache = DynamicCache(config=cfg)
            ref(torch.from_numpy(xp), cache=cache)
            tt = torch.from_numpy(tok)

            def ref_step():
                ref(tt, cache=cache)
            who = "HF cached step"
        with ours.decode_session(st) as s:
            t_sess, t_ref = paired_ms(lambda: s.step(tok), ref_step, reps)
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
    isa = ("baseline", "x86-64-v3", "x86-64-v4")[_core._isa(-1)]
    return (f"{datetime.date.today()}, commit {commit}, {os.cpu_count()} cores ({cpu}), "
            f"CPU ISA copy {isa}, torch {torch.__version__} with {torch.get_num_threads()} "
            f"threads, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")


ROWS = ("forward", "big", "decode", "backward")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", nargs="+", default=list(CLASSES))
    p.add_argument("--quick", action="store_true", help="fewer repetitions")
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    p.add_argument("--rounds", type=int, default=1, help="repeat everything this many times")
    p.add_argument("--slow-baseline", action="store_true",
                   help="backward rows: one cold call of the baseline (HF's Mamba-1 training "
                        "path loops over L in Python and takes many minutes at L=2048)")
    args = p.parse_args()
    reps = 3 if args.quick else 7
    print(header())
    print("| case | mamba-blocks | baseline | speed-up | load |")
    print("|---|---|---|---|---|")

    def out(r):
        print(f"{r} {load()} |", flush=True)

    for _ in range(args.rounds):
        for name in args.blocks:
            if "forward" in args.rows:
                out(forward_row(name, 1, 2048, 384, reps))
            if "big" in args.rows and name == "mamba2":
                out(forward_row(name, 4, 4096, 768, 2))
            if "decode" in args.rows:
                out(decode_row(name, 1024, 384 if name == "mamba2" else 60, 10 * reps))
            if "backward" in args.rows:
                try:
                    out(backward_row(name, 1, 2048, 384, 1 if args.slow_baseline else
                                     max(2, reps // 2), not args.slow_baseline))
                except NotImplementedError as e:
                    out(f"| {CLASSES[name].__name__} forward + backward | {e} | | |")


if __name__ == "__main__":
    main()
