"""Mamba-1 on the CUDA backend: forward at W2 = (B 8, L 4096, d_model 1024) in both
numeric modes, the projections' GEMMs against cuBLAS, and the decode-session step at
d_model 1024, batch 1 and 32, device arrays in and out (torch.cuda tensors). Times are
CUDA-event medians after warm-up; a session step is timed two ways: the wall time of
sess.step in a Python loop (host included, no sync per step) and the device time of
its CUDA graph replayed back to back. mamba-ssm is not installed on the GPU machine
(it would have to travel as a wheel), so no comparison with it is made here.

    python bench/gpu.py [--json PATH]
"""
import argparse
import json
import statistics
import time

import torch

import mamba
from mamba import _backends, _core

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
    """ms and TFLOP/s of our dot-v1 GEMM, our TF32 GEMM, and cuBLAS with TF32 off/on."""
    X = torch.randn(M, K, device="cuda")
    W = torch.randn(N, K, device="cuda")
    Y = torch.empty(M, N, device="cuda")
    s = be.stream().cu

    def ours(fast):
        return lambda: be.gemm(s, M, N, K, X.data_ptr(), K, W.data_ptr(), K, Y.data_ptr(), N,
                               fast=fast)
    flop = 2.0 * M * N * K
    out = {"MNK": [M, N, K]}
    out["ms"] = events_ms(ours(False))
    out["fast_ms"] = events_ms(ours(True))
    for tf32 in (False, True):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        out["cublas_tf32_ms" if tf32 else "cublas_ms"] = events_ms(
            lambda: torch.matmul(X, W.t(), out=Y))
    torch.backends.cuda.matmul.allow_tf32 = False
    for k in ("ms", "fast_ms", "cublas_ms", "cublas_tf32_ms"):
        out[k.replace("ms", "tflops")] = flop / out[k] / 1e9
    out["of_ceiling"] = out["tflops"] / CEILING
    return out


def decode_gemv_us(be, M, N, K, fast, reps=20):
    """Device us of one decode projection: reps launches captured in a graph and
    replayed (so launch gaps are those of a graph, as in a session step)."""
    cu = be.cu
    X = torch.randn(M, K, device="cuda")
    W = torch.randn(N, K, device="cuda")
    Y = torch.empty(M, N, device="cuda")
    cs = be._capture_stream()
    cu.cuStreamBeginCapture(cs, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    for _ in range(reps):
        be.gemm(cs, M, N, K, X.data_ptr(), K, W.data_ptr(), K, Y.data_ptr(), N, fast=fast)
    graph = cu.cuStreamEndCapture(cs)[1]
    exe = cu.cuGraphInstantiate(graph, 0)[1]
    s = be.stream().cu
    us = events_ms(lambda: cu.cuGraphLaunch(exe, s)) / reps * 1e3
    cu.cuGraphExecDestroy(exe)
    cu.cuGraphDestroy(graph)
    return us


def session_rates(blk, B, dm, n=300):
    """Wall us per sess.step (Python loop, device x, no sync per step) and device us
    per replay of the step's graph."""
    be = blk._backend
    st = blk.allocate_state(B)
    xs = [torch.randn(B, 1, dm, device="cuda") for _ in range(4)]
    out = {}
    with blk.decode_session(st) as sess:
        for i in range(20):
            sess.step(xs[i % 4])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            y = sess.step(xs[i % 4])
        torch.cuda.synchronize()
        out["wall_us"] = (time.perf_counter() - t0) / n * 1e6
        run = sess._run
        s = be.stream().cu
        # the host side of a step: taking the torch tensor in (DLPack), then the rest
        t0 = time.perf_counter()
        for i in range(n):
            a = _core.intake(xs[i % 4], "bench", "x")
        out["host_intake_us"] = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            y = run.step(a, "bench")
        torch.cuda.synchronize()
        out["host_runner_us"] = (time.perf_counter() - t0) / n * 1e6

        def replay():
            for _ in range(n):
                be.cu.cuGraphLaunch(run.exec, s)
        out["graph_us"] = events_ms(replay) / n * 1e3
        out["kernels_ms"] = kernel_table(lambda: sess.step(xs[0]))
    del y
    return out


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
    torch.backends.cuda.matmul.allow_tf32 = False
    B, L, dm = 8, 4096, 1024
    di, R = 2 * dm, -(-dm // 16)
    M = B * L
    res = {"device": be.description, "shape": [B, L, dm]}
    w = mamba.random_weights("mamba1", dm, seed=0)
    blocks = {mode: mamba.Mamba1Block(w, numeric_mode=mode, backend="cuda")
              for mode in ("identical", "fast")}
    x = torch.randn(B, L, dm, device="cuda")
    flop = 2.0 * M * (dm * 2 * di + di * (R + 32) + R * di + di * dm)
    for mode, blk in blocks.items():
        ms = events_ms(lambda: blk.forward(x))
        res[f"forward_{mode}"] = {"ms": ms, "tokens_per_s": M / ms * 1e3,
                                  "gemm_tflops": flop / ms / 1e9,
                                  "kernels_ms": kernel_table(lambda: blk.forward(x))}
    for name, (m, n, k) in {"in_proj": (M, 2 * di, dm), "out_proj": (M, dm, di),
                            "x_proj": (M, R + 32, di)}.items():
        res[f"gemm_{name}"] = gemm_rate(be, m, n, k)
    shapes = {"in_proj": (2 * di, dm), "x_proj": (R + 32, di), "dt_proj": (di, R),
              "out_proj": (dm, di)}
    for mode in blocks:
        for b in (1, 32):
            res[f"decode_gemv_{mode}_B{b}"] = {
                name: decode_gemv_us(be, b, n, k, mode == "fast") for name, (n, k) in shapes.items()}
    for mode, blk in blocks.items():
        for b in (1, 32):
            res[f"session_{mode}_B{b}"] = session_rates(blk, b, dm)
    res["mamba_ssm"] = "not installed on the GPU machine; no comparison made"

    print(f"device            {res['device']}")
    for mode in blocks:
        f = res[f"forward_{mode}"]
        print(f"forward W2 {mode:9s} {f['ms']:.2f} ms ({f['tokens_per_s']:.0f} tokens/s, GEMM "
              f"flops at {f['gemm_tflops']:.1f} TFLOP/s over the forward)")
    for name in ("in_proj", "out_proj", "x_proj"):
        g = res[f"gemm_{name}"]
        print(f"gemm {name:9s} dot-v1 {g['ms']:.2f} ms {g['tflops']:.1f} TFLOP/s "
              f"({100 * g['of_ceiling']:.0f}% of {CEILING:.0f}); cuBLAS SGEMM {g['cublas_tflops']:.1f}; "
              f"TF32 ours {g['fast_tflops']:.1f}, cuBLAS {g['cublas_tf32_tflops']:.1f}")
    for mode in blocks:
        for b in (1, 32):
            r = res[f"session_{mode}_B{b}"]
            print(f"session {mode:9s} B {b:2d}: {r['wall_us']:.1f} us wall per step, "
                  f"{r['graph_us']:.1f} us per graph replay; host: intake {r['host_intake_us']:.1f} "
                  f"us, the rest of a step {r['host_runner_us']:.1f} us")
    for mode in blocks:
        for b in (1, 32):
            g = res[f"decode_gemv_{mode}_B{b}"]
            print(f"decode GEMVs {mode:9s} B {b:2d} (us): " + ", ".join(f"{k} {v:.1f}" for k, v in g.items()))
    for key in ("forward_identical", "forward_fast", "session_identical_B1", "session_fast_B1",
                "session_identical_B32", "session_fast_B32"):
        print(f"{key} kernels (ms): " + ", ".join(
            f"{k} {v:.4f}" for k, v in list(res[key]["kernels_ms"].items())[:10]))
    print(f"mamba-ssm         {res['mamba_ssm']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
