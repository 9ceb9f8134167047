"""python -m mamba [run|info]: the demo job and the backend listing."""
import argparse
import random
import sys
import time

import mamba
from . import _core


def _random_input(shape, seed):
    rng = random.Random(seed)
    x = _core.empty(shape)
    mv = memoryview(x).cast("B").cast("f")
    for i in range(x.size):
        mv[i] = rng.gauss(0.0, 1.0)
    return x


def _token(x, t):
    """Token t of every row of x (B, L, D) as a (B, 1, D) Array."""
    B, L, D = x.shape
    out = _core.empty((B, 1, D))
    src = memoryview(x).cast("B")
    dst = memoryview(out).cast("B")
    for b in range(B):
        dst[4 * b * D:4 * (b + 1) * D] = src[4 * (b * L + t) * D:4 * (b * L + t + 1) * D]
    return out


def cmd_run(args):
    cls = {"mamba1": mamba.Mamba1Block, "mamba2": mamba.Mamba2Block}[args.block]
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
            yt = memoryview(session.step(_token(x, t))).cast("B")
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


def cmd_info(args):
    for name, (ok, why) in mamba.backends().items():
        print(f"{name:5s} {'usable' if ok else 'unusable'}: {why}")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mamba", description=__doc__)
    sub = p.add_subparsers(dest="cmd")
    run = sub.add_parser("run", help="build a block with random weights, prefill, decode, "
                         "compare bits (the default)")
    for q in (p, run):
        q.add_argument("--block", default="mamba1", choices=["mamba1", "mamba2"])
        q.add_argument("--d-model", type=int, default=256)
        q.add_argument("--length", type=int, default=256)
        q.add_argument("--batch", type=int, default=1)
        q.add_argument("--backend", default="auto")
        q.add_argument("--seed", type=int, default=0)
    sub.add_parser("info", help="list backends and why any is unusable")
    args = p.parse_args(argv)
    if args.cmd == "info":
        return cmd_info(args)
    return cmd_run(args)
