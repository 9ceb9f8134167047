"""Mamba-1 on the CUDA backend: forward at W2 = (B 8, L 4096, d_model 1024) and the
decode-session step at d_model 1024, device arrays in and out (torch.cuda tensors),
timed with CUDA events (median of several runs after warm-up). The dot-v1 GEMM's
rate is reported against the 51 TFLOP/s fp32 ceiling and against cuBLAS SGEMM
(TF32 off) on the same shape. mamba-ssm is not installed on the GPU machine (it
would have to travel as a wheel), so no comparison with it is made here.

    python bench/gpu.py [--json PATH]
"""
import argparse
import json
import statistics
import time

import torch

import mamba
from mamba import _backends
from mamba._cuda import _Scratch

CEILING = 51.0  # TFLOP/s, fp32 FFMA


def events_ms(fn, warm=2, reps=7):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def gemm_rate(be, M, N, K):
    X = torch.randn(M, K, device="cuda")
    W = torch.randn(N, K, device="cuda")
    Y = torch.empty(M, N, device="cuda")

    def ours():
        with _Scratch(be) as sc:
            be.gemm(sc, M, N, K, X.data_ptr(), K, W.data_ptr(), K, Y.data_ptr(), N)
    torch.backends.cuda.matmul.allow_tf32 = False
    ms = events_ms(ours)
    ms_cublas = events_ms(lambda: torch.matmul(X, W.t(), out=Y))
    flop = 2.0 * M * N * K
    return ms, flop / ms / 1e9, flop / ms_cublas / 1e9


def kernel_table(fn):
    """Device time per kernel name over one call (torch's profiler sees our launches)."""
    from torch.profiler import profile, ProfilerActivity
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0)
        if t > 0:
            out[e.key] = t / 1e3  # ms
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    args = p.parse_args()
    be = _backends._get("cuda")[0]
    if be is None:
        raise SystemExit(f"no usable CUDA backend: {mamba.backends()['cuda'][1]}")
    B, L, dm = 8, 4096, 1024
    di, R = 2 * dm, -(-dm // 16)
    M = B * L
    res = {"device": be.description, "shape": [B, L, dm]}
    t0 = time.perf_counter()
    w = mamba.random_weights("mamba1", dm, seed=0)
    blk = mamba.Mamba1Block(w, backend="cuda")
    res["weights_s"] = time.perf_counter() - t0

    x = torch.randn(B, L, dm, device="cuda")
    fwd_ms = events_ms(lambda: blk.forward(x))
    flop = 2.0 * M * (dm * 2 * di + di * (R + 32) + R * di + di * dm)
    res["forward_ms"] = fwd_ms
    res["forward_gemm_tflops"] = flop / fwd_ms / 1e9
    res["forward_tokens_per_s"] = M / fwd_ms * 1e3

    res["forward_kernels_ms"] = kernel_table(lambda: blk.forward(x))

    for name, (m, n, k) in {"in_proj": (M, 2 * di, dm), "out_proj": (M, dm, di),
                            "x_proj": (M, R + 32, di)}.items():
        ms, ours, cublas = gemm_rate(be, m, n, k)
        res[f"gemm_{name}"] = {"MNK": [m, n, k], "ms": ms, "tflops": ours,
                               "of_ceiling": ours / CEILING, "cublas_sgemm_tflops": cublas}

    st = blk.allocate_state(1)
    xt = torch.randn(1, 1, dm, device="cuda")
    with blk.decode_session(st) as sess:
        for _ in range(10):
            sess.step(xt)
        torch.cuda.synchronize()
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            y = sess.step(xt)
        torch.cuda.synchronize()
        res["decode_step_us"] = (time.perf_counter() - t0) / n * 1e6
        res["decode_kernels_ms"] = kernel_table(lambda: sess.step(xt))
    del y
    res["mamba_ssm"] = "not installed on the GPU machine; no comparison made"

    print(f"device           {res['device']}")
    print(f"forward W2       {fwd_ms:.2f} ms  ({res['forward_tokens_per_s']:.0f} tokens/s, "
          f"GEMM flops at {res['forward_gemm_tflops']:.1f} TFLOP/s over the whole forward)")
    for name in ("in_proj", "out_proj", "x_proj"):
        g = res[f"gemm_{name}"]
        print(f"gemm {name:9s}   {g['ms']:.2f} ms  {g['tflops']:.1f} TFLOP/s "
              f"({100 * g['of_ceiling']:.0f}% of {CEILING:.0f}); cuBLAS SGEMM "
              f"{g['cublas_sgemm_tflops']:.1f}")
    print(f"decode step      {res['decode_step_us']:.0f} us per token (B 1, d_model {dm}, session)")
    for what in ("forward", "decode"):
        print(f"{what} kernels (ms): " + ", ".join(
            f"{k} {v:.3f}" for k, v in list(res[f"{what}_kernels_ms"].items())[:10]))
    print(f"mamba-ssm        {res['mamba_ssm']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
