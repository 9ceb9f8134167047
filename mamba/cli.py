"""python -m mamba [run|check|bench|info]: the demo job, the cross-check of every
identity lane on every backend, timings, and the backend listing."""
import argparse
import sys
import time

import mamba
from . import _backends, _core
from ._lanes import _rand as _random_input, _tslice


_CLASSES = {"mamba1": mamba.Mamba1Block, "mamba2": mamba.Mamba2Block,
            "mamba3": mamba.Mamba3Block}


def cmd_run(args):
    cls = _CLASSES[args.block]
    w = mamba.random_weights(args.block, args.d_model, seed=args.seed)
    block = cls(w, backend=args.backend)
    x = _random_input((args.batch, args.length, args.d_model), args.seed + 1)
    t0 = time.perf_counter()
    y = block.forward(x)
    t_prefill = time.perf_counter() - t0
    state = block.allocate_state(args.batch)
    ybytes = memoryview(y).cast("B")
    D = args.d_model
    same = True
    t0 = time.perf_counter()
    with block.decode_session(state) as session:
        for t in range(args.length):
            yt = memoryview(session.step(_tslice(x, t, t + 1))).cast("B")
            for b in range(args.batch):
                row = ybytes[4 * (b * args.length + t) * D:4 * (b * args.length + t + 1) * D]
                same &= yt[4 * b * D:4 * (b + 1) * D] == row
    t_decode = time.perf_counter() - t0
    print(f"block            {cls.__name__} (d_model {args.d_model}, B {args.batch}, "
          f"L {args.length}, profile {block.profile})")
    print(f"backend          {block.vendor_used()}, numeric mode {block.numeric_mode_used()}")
    print(f"prefill          {1e3 * t_prefill:.2f} ms")
    print(f"decode           {1e3 * t_decode / args.length:.3f} ms per token "
          f"({args.length} tokens, one session)")
    print(f"decode == prefill bit for bit: {'yes' if same else 'NO'}")
    return 0 if same else 1


# _core._isa levels: the copy of the CPU hot loops in use (bits never depend on it)
_CPU_ISAS = ("baseline (portable C, software fma)", "x86-64-v3 (AVX2 + FMA)",
             "x86-64-v4 (AVX-512)")


def cmd_info(args):
    for name, (ok, why) in mamba.backends().items():
        print(f"{name:5s} {'usable' if ok else 'unusable'}: {why}")
    print(f"cpu ISA: {_CPU_ISAS[_core._isa(-1)]}")
    return 0


def _progress(text, tty_only=False):
    """Progress on stderr: one line rewritten in place on a terminal; elsewhere a
    plain line per call, except tty_only ones."""
    if sys.stderr.isatty():
        sys.stderr.write(f"\r\033[K{text}")
    elif not tty_only:
        sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _progress_done():
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()


def cmd_check(args):
    from . import _lanes
    usable = mamba.backends()
    for be in args.backend or ():
        if not usable[be][0]:
            print(f"mamba check: backend {be!r} was requested but is not usable: "
                  f"{usable[be][1]}", file=sys.stderr)
            return 2
    results = _lanes.run(args.backend, args.block,
                         progress=lambda text: _progress(f"checking {text}"))
    _progress_done()
    print(_lanes.table(results))
    counts = {k: sum(r.status == k for r in results) for k in ("ok", "FAIL", "n/a")}
    print(f"\n{len(results)} checks: {counts['ok']} ok, {counts['FAIL']} failed, "
          f"{counts['n/a']} not applicable. Bitwise lanes compare with the first result "
          "of the same backend (or, for '== C reference', with the CPU); rel err is "
          f"max |y - y64| / (|y64| + {_lanes.ATOL / _lanes.RTOL:g}) against the float64 "
          f"oracle (passes at <= {_lanes.RTOL:g}).")
    return 1 if counts["FAIL"] else 0


def _timed(label, n, fn):
    """Run fn n times with progress; the sorted wall times in seconds."""
    times = []
    for i in range(n):
        _progress(f"{label} {i + 1}/{n}", tty_only=i > 0)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)


def cmd_bench(args):
    cls = _CLASSES[args.block]
    block = cls(mamba.random_weights(args.block, args.d_model, seed=args.seed),
                backend=args.backend)
    B, L, D = args.batch, args.length, args.d_model
    x = _random_input((B, L, D), args.seed + 1)
    rows = []
    block.forward(x)  # warm-up: first-call setup is not what is measured
    t = _timed("forward", args.repeat, lambda: block.forward(x))
    rows.append(("forward", t[len(t) // 2], B * L))
    state = block.allocate_state(B)
    tok = _tslice(x, 0, 1)
    with block.decode_session(state) as session:
        session.step(tok)
        t = _timed("decode", args.tokens, lambda: session.step(tok))
    rows.append(("decode (session step)", t[len(t) // 2], B))
    backward = getattr(block, "backward", None)
    note = ""
    if backward is None:
        note = "backward: not available in this build"
    else:
        g = _random_input((B, L, D), args.seed + 2)
        try:
            backward(x, g)
            t = _timed("backward", args.repeat, lambda: backward(x, g))
            rows.append(("backward", t[len(t) // 2], B * L))
        except NotImplementedError as e:
            note = f"backward: not available on this backend ({e})"
    _progress_done()
    print(f"block    {cls.__name__} (d_model {D}, B {B}, L {L}, profile {block.profile})")
    print(f"backend  {block.vendor_used()}, numeric mode {block.numeric_mode_used()}; "
          "host buffers in and out, medians")
    print(f"{'phase':22s} {'median ms':>10s} {'tokens/s':>12s}")
    for name, sec, ntok in rows:
        print(f"{name:22s} {1e3 * sec:10.3f} {ntok / sec:12.0f}")
    if note:
        print(note)
    return 0


def _positive(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return n


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mamba", description=__doc__)
    sub = p.add_subparsers(dest="cmd")
    run = sub.add_parser("run", help="build a block with random weights, prefill, decode, "
                         "compare bits (the default)")
    bench = sub.add_parser("bench", help="time forward, decode (session step) and backward")
    for q in (p, run, bench):
        q.add_argument("--block", default="mamba1", choices=["mamba1", "mamba2", "mamba3"])
        q.add_argument("--d-model", type=int, default=256)
        q.add_argument("--length", type=int, default=256)
        q.add_argument("--batch", type=int, default=1)
        q.add_argument("--backend", default="auto")
        q.add_argument("--seed", type=int, default=0)
    sub.add_parser("info", help="list backends and why any is unusable")
    check = sub.add_parser("check", help="run every identity lane on every usable backend "
                           "and block, compare with the C reference and a float64 oracle; "
                           "exit 1 on any divergence")
    check.add_argument("--backend", action="append", choices=_backends.NAMES,
                       help="check only this backend (repeatable; default: every usable one)")
    check.add_argument("--block", action="append", choices=list(_CLASSES),
                       help="check only this block (repeatable; default: all)")
    bench.add_argument("--repeat", type=_positive, default=5,
                       help="timed forward/backward calls")
    bench.add_argument("--tokens", type=_positive, default=64, help="timed decode steps")
    args = p.parse_args(argv)
    if args.cmd == "info":
        return cmd_info(args)
    if args.cmd == "check":
        return cmd_check(args)
    if args.cmd == "bench":
        return cmd_bench(args)
    return cmd_run(args)
