"""The three blocks on the CUDA backend, side by side with mamba-ssm 2.3.2.post1's own
kernels (bench/upstream.py) on the same weights, device arrays in and out
(torch.cuda tensors): forward at W1 = (B 1, L 2048, d_model 384), W2 = (8, 4096,
1024) and W3 = (1, 16384, 2048) in both numeric modes (upstream with TF32 off and
on; upstream's W1 as a CUDA graph), the peak transient device memory of one forward,
forward + backward at W2 (upstream through torch autograd), the projections' GEMMs
against cuBLAS, and decode-session steps at d_model 1024, batch 1 and 32 (and, asked
for with `--only host`, a profile of the host's time in one forward). Times are
CUDA-event medians after warm-up.

    python bench/gpu.py [--upstream mamba_ssm-2.3.2.post1.tar.gz] [--work DIR]
                        [--only forward,train,gemm,decode,host] [--json PATH]
"""
import argparse
import json
import statistics
import time

import torch

import mamba
import upstream
from mamba import _backends, _core, _cuda

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
    tail, _cuda.TAIL_MAX = _cuda.TAIL_MAX, 0.0  # the last wave's tiles as big ones
    try:
        out["no_tail_ms"] = events_ms(ours(False))
    finally:
        _cuda.TAIL_MAX = tail
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


def session_rates(blk, B, dm, n=300):
    """Wall us per sess.step (Python loop, device x, no sync per step) and, where the
    step is a CUDA graph, device us per replay of it."""
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
        if run is not None:  # the step is a CUDA graph: its host and device parts
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
            s = be.stream().cu

            def replay():
                for _ in range(n):
                    be.cu.cuGraphLaunch(run.exec, s)
            out["graph_us"] = events_ms(replay) / n * 1e3
        out["kernels_ms"] = kernel_table(lambda: sess.step(xs[0]))
        if B == 1:
            try:
                out["timeline"] = kernel_timeline(lambda: sess.step(xs[0]))
            except Exception as e:  # the profiler's event API differs between torch versions
                out["timeline"] = repr(e)
    del y
    return out


def issue_ms(fn, reps=20):
    """Median host ms for fn to return (the device may still be running it)."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(out)


def first_launch_ms(be, fn, reps=20):
    """Median host ms from fn's start to its first kernel launch (the device of a
    lone call idles through it), and of the host ms spent in be.intake (taking x in)
    within that time."""
    launch, intake = be._launch, be.intake
    marks = {}

    def spy_launch(*a, **k):
        marks.setdefault("launch", time.perf_counter())
        return launch(*a, **k)

    def spy_intake(*a, **k):
        t = time.perf_counter()
        try:
            return intake(*a, **k)
        finally:
            if "launch" not in marks:
                marks["intake"] = marks.get("intake", 0.0) + time.perf_counter() - t
    be._launch, be.intake = spy_launch, spy_intake
    try:
        first, into = [], []
        for _ in range(reps):
            torch.cuda.synchronize()
            marks.clear()
            t0 = time.perf_counter()
            fn()
            first.append((marks["launch"] - t0) * 1e3)
            into.append(marks.get("intake", 0.0) * 1e3)
    finally:
        del be._launch, be.intake  # the class's methods again
    torch.cuda.synchronize()
    return statistics.median(first), statistics.median(into)


def intake_rows(be, res):
    """Host us for be.intake to take in a torch.cuda tensor through each of its
    exports (the start of every call on device arrays)."""
    x = torch.randn(8, 4096, 1024, device="cuda")

    class Cai:  # x through __cuda_array_interface__ alone
        @property
        def __cuda_array_interface__(self):
            return x.__cuda_array_interface__
    row = res.setdefault("intake", {})
    for name, obj in (("dlpack", x), ("cuda_array_interface", Cai())):
        row[name + "_us"] = 1e3 * issue_ms(lambda: be.intake(obj, "bench", "x", False), reps=50)
    print("intake: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)


def host_rows(res, kinds, shapes, reps=50):
    """Where the host's time in one identical forward goes (cProfile over reps calls,
    each waited for): the functions with the most cumulative time, us a call."""
    import cProfile
    import pstats
    for kind in kinds:
        for wname, (B, L, dm) in shapes.items():
            blk = CLASSES[kind](mamba.random_weights(kind, dm, seed=0), backend="cuda")
            x = torch.randn(B, L, dm, device="cuda")
            blk.forward(x)
            torch.cuda.synchronize()
            prof = cProfile.Profile()
            for _ in range(reps):
                prof.enable()
                blk.forward(x)
                prof.disable()
                torch.cuda.synchronize()
            st = pstats.Stats(prof)
            top = sorted(st.stats.items(), key=lambda kv: -kv[1][3])[:25]
            row = res.setdefault("host", {}).setdefault(kind, {})[wname] = {
                f"{fn[0].rsplit('/', 1)[-1]}:{fn[1]}({fn[2]})": 1e6 * v[3] / reps
                for fn, v in top}
            print(f"host {kind} {wname}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items()),
                  flush=True)
            del blk


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


def kernel_timeline(fn, calls=2):
    """The device work of the last of `calls` calls of fn (kernels and copies, a
    replayed graph's too), each as (name, start us, end us) from that call's first
    start, by torch's profiler; fn must issue the same work each call."""
    from torch.profiler import profile, ProfilerActivity
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    ev = sorted((e.start_ns(), e.end_ns(), e.name()) for e in prof.profiler.kineto_results.events()
                if e.device_type() == cuda)
    if not ev or len(ev) % calls:
        return None
    last = ev[-len(ev) // calls:]
    t0 = last[0][0]
    return [(n, (a - t0) / 1e3, (b - t0) / 1e3) for a, b, n in last]


SHAPES = {"W1": (1, 2048, 384), "W2": (8, 4096, 1024), "W3": (1, 16384, 2048)}
KINDS = ("mamba1", "mamba2", "mamba3")
CLASSES = {"mamba1": mamba.Mamba1Block, "mamba2": mamba.Mamba2Block, "mamba3": mamba.Mamba3Block}


def pool_peak_mib(be, fn):
    """Peak bytes taken from our stream-ordered pool while fn runs (outputs and
    scratch; the weights are plain allocations made earlier), MiB."""
    cu, attr = be.cu, be.cu.CUmemPool_attribute
    torch.cuda.synchronize()
    used = int(cu.cuMemPoolGetAttribute(be.pool, attr.CU_MEMPOOL_ATTR_USED_MEM_CURRENT)[1])
    cu.cuMemPoolSetAttribute(be.pool, attr.CU_MEMPOOL_ATTR_USED_MEM_HIGH, cu.cuuint64_t(0))
    keep = fn()
    torch.cuda.synchronize()
    high = int(cu.cuMemPoolGetAttribute(be.pool, attr.CU_MEMPOOL_ATTR_USED_MEM_HIGH)[1])
    del keep
    return (high - used) / 2**20


def torch_peak_mib(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    keep = fn()
    torch.cuda.synchronize()
    del keep
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def graph_ms(fn):
    """Device ms of fn replayed as a CUDA graph (captured after warm-up)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return events_ms(g.replay, reps=20)


def forward_rows(be, res, kinds, shapes, upstream_ok):
    for kind in kinds:
        for wname, (B, L, dm) in shapes.items():
            w = mamba.random_weights(kind, dm, seed=0)
            x = torch.randn(B, L, dm, device="cuda")
            row = res.setdefault("forward", {}).setdefault(kind, {}).setdefault(wname, {})
            for mode in ("identical", "fast"):
                blk = CLASSES[kind](w, numeric_mode=mode, backend="cuda")
                row[mode + "_ms"] = events_ms(lambda: blk.forward(x))
                row[mode + "_peak_mib"] = pool_peak_mib(be, lambda: blk.forward(x))
                row[mode + "_kernels_ms"] = kernel_table(lambda: blk.forward(x))
                # device busy time: steadier than a lone call's events between trees
                row[mode + "_kernel_sum_ms"] = sum(row[mode + "_kernels_ms"].values())
                try:  # first start to last end: the busy time plus the gaps inside
                    tl = kernel_timeline(lambda: blk.forward(x))
                    if tl:  # sorted by start; the last to start need not end last
                        row[mode + "_span_ms"] = (max(e for _, _, e in tl) - tl[0][1]) / 1e3
                except Exception as e:  # the profiler's event API differs between torch versions
                    row[mode + "_span_error"] = repr(e)
                # host time before the first launch, and x's intake within it
                row[mode + "_first_launch_ms"], row[mode + "_intake_ms"] = \
                    first_launch_ms(be, lambda: blk.forward(x))
                if wname == "W1":  # host time to issue one call (no wait)
                    row[mode + "_issue_ms"] = issue_ms(lambda: blk.forward(x))
                del blk
            if upstream_ok:
                ub = upstream.Block(kind, w, dm)
                row["upstream_loaded"] = ub.loaded
                with torch.no_grad():
                    for tf32 in (False, True):
                        torch.backends.cuda.matmul.allow_tf32 = tf32
                        key = "upstream_tf32_" + ("on" if tf32 else "off")
                        row[key + "_ms"] = graph_ms(lambda: ub(x)) if wname == "W1" else \
                            events_ms(lambda: ub(x))
                        if not tf32:
                            row["upstream_peak_mib"] = torch_peak_mib(lambda: ub(x))
                torch.backends.cuda.matmul.allow_tf32 = False
                del ub
            print(f"forward {kind} {wname}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float)), flush=True)
            torch.cuda.empty_cache()


def train_rows(be, res, kinds, upstream_ok):
    """Forward + backward at W2: ours in both modes, as forward then backward (which
    recomputes the forward inside) and as vjp then its pullback (which keeps the
    forward's activations where the backend can), and upstream's through torch
    autograd, TF32 off and on."""
    B, L, dm = SHAPES["W2"]
    for kind in kinds:
        w = mamba.random_weights(kind, dm, seed=0)
        x = torch.randn(B, L, dm, device="cuda")
        dy = torch.randn(B, L, dm, device="cuda")
        row = res.setdefault("train", {}).setdefault(kind, {})
        for mode in ("identical", "fast"):
            blk = CLASSES[kind](w, numeric_mode=mode, backend="cuda")

            def ours():
                y = blk.forward(x)
                return y, blk.backward(x, dy)
            def ours_vjp():
                y, pullback = blk.vjp(x)
                return y, pullback(dy)
            row[mode + "_ms"] = events_ms(ours, warm=1, reps=3)
            row[mode + "_peak_mib"] = pool_peak_mib(be, ours)
            row[mode + "_vjp_ms"] = events_ms(ours_vjp, warm=1, reps=3)
            row[mode + "_vjp_peak_mib"] = pool_peak_mib(be, ours_vjp)
            row[mode + "_backward_kernels_ms"] = kernel_table(lambda: blk.backward(x, dy))
            del blk
        if upstream_ok:
            ub = upstream.Block(kind, w, dm)
            xr = x.clone().requires_grad_(True)

            def theirs():
                y = ub(xr)
                y.backward(dy)
                return y
            for tf32 in (False, True):
                torch.backends.cuda.matmul.allow_tf32 = tf32
                key = "upstream_tf32_" + ("on" if tf32 else "off")
                row[key + "_ms"] = events_ms(theirs, warm=1, reps=3)
            torch.backends.cuda.matmul.allow_tf32 = False
            row["upstream_peak_mib"] = torch_peak_mib(theirs)
            del ub, xr
        print(f"train {kind} W2: " + ", ".join(
            f"{k} {v:.2f}" for k, v in row.items() if isinstance(v, float)), flush=True)
        for mode in ("identical", "fast"):
            print(f"  {mode} backward kernels (ms): " + ", ".join(
                f"{k} {v:.2f}" for k, v in list(row[mode + "_backward_kernels_ms"].items())[:10]),
                flush=True)
        torch.cuda.empty_cache()


def gemm_rows(be, res, shapes):
    """Mamba-1's projections (Mamba-2's and Mamba-3's in_proj are a little wider)."""
    for wname in [w for w in shapes if w != "W1"]:
        B, L, dm = shapes[wname]
        M, di, R = B * L, 2 * dm, -(-dm // 16)
        for name, (m, n, k) in {"in_proj": (M, 2 * di, dm), "out_proj": (M, dm, di),
                                "x_proj": (M, R + 32, di)}.items():
            g = res.setdefault("gemm", {}).setdefault(wname, {})[name] = gemm_rate(be, m, n, k)
            print(f"gemm {wname} {name:9s} dot-v1 {g['ms']:.2f} ms {g['tflops']:.1f} TFLOP/s "
                  f"({100 * g['of_ceiling']:.0f}% of {CEILING:.0f}; without the tail tiles "
                  f"{g['no_tail_ms']:.2f} ms); cuBLAS SGEMM {g['cublas_tflops']:.1f}; TF32 "
                  f"ours {g['fast_tflops']:.1f}, cuBLAS {g['cublas_tf32_tflops']:.1f}",
                  flush=True)


def decode_rows(res, kinds):
    dm = 1024
    for kind in kinds:
        w = mamba.random_weights(kind, dm, seed=0)
        for mode in ("identical", "fast"):
            blk = CLASSES[kind](w, numeric_mode=mode, backend="cuda")
            for b in (1, 32):
                r = session_rates(blk, b, dm)
                res.setdefault("decode", {}).setdefault(kind, {})[f"{mode}_B{b}"] = r
                print(f"session {kind} {mode:9s} B {b:2d}: {r['wall_us']:.1f} us wall per "
                      f"step" + (f", {r['graph_us']:.1f} us per graph replay"
                                 if "graph_us" in r else "") + "; kernels (ms): " + ", ".join(
                          f"{k} {v:.4f}" for k, v in list(r["kernels_ms"].items())[:6]),
                      flush=True)
                tl = r.get("timeline")
                if tl is not None:  # start-end us of each kernel and copy of one step
                    print(f"timeline {kind} {mode} B {b}: " + (tl if isinstance(tl, str) else
                          " | ".join(f"{n.split('(')[0]} {a:.1f}-{e:.1f}" for n, a, e in tl)),
                          flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--upstream", help="mamba-ssm 2.3.2.post1 sdist or source tree")
    p.add_argument("--work", default="/tmp/mamba_bench")
    p.add_argument("--only", default="forward,train,gemm,decode")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--json")
    args = p.parse_args()
    be = _backends._get("cuda")[0]
    if be is None:
        raise SystemExit(f"no usable CUDA backend: {mamba.backends()['cuda'][1]}")
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"device": be.description}
    up = False
    if args.upstream:
        try:
            res["upstream"] = upstream.load(args.upstream, args.work).__version__
            up = True
        except Exception as e:  # report and go on with our rows
            res["upstream"] = f"not loaded: {type(e).__name__}: {e}"
    print(f"device   {res['device']}\nupstream {res.get('upstream', 'not asked for')}",
          flush=True)
    kinds, only = args.kinds.split(","), args.only.split(",")
    shapes = {k: SHAPES[k] for k in args.shapes.split(",")}
    try:
        if "forward" in only:
            intake_rows(be, res)
            forward_rows(be, res, kinds, shapes, up)
        if "train" in only:
            train_rows(be, res, kinds, up)
        if "gemm" in only:
            gemm_rows(be, res, shapes)
        if "decode" in only:
            decode_rows(res, kinds)
        if "host" in only:
            host_rows(res, kinds, shapes)
    finally:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
