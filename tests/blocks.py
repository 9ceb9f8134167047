"""The blocks under test and the shapes each lane uses, shared by every promise."""
import array
import os

import mamba

# name -> class, d_model for identity lanes, decode lane (prefill, total),
# split points, and the lengths that cross the block's chunk grid
BLOCKS = {
    "mamba1": dict(cls=mamba.Mamba1Block, d_model=32, decode=(5, 14), splits=(1, 3, 7, 20),
                   length=24),
    # one head; the lanes cross the chunk grid (Q = 256) before, on and after a
    # boundary, decode at the second (a state entering the folding chunk). A slow
    # decay (A = -exp(-1.5)): a chunk keeps about 1 % of the state entering it, so
    # that its fold's exp(cs_last) * h shows in the bits (with random_weights' A it
    # underflows to zero)
    "mamba2": dict(cls=mamba.Mamba2Block, d_model=32, decode=(506, 518),
                   splits=(3, 255, 256, 300), length=520, fill={"A_log": -1.5}),
    # two heads; the lanes cross the chunk grid (Q = 64) and decode seals the second
    # chunk (a nonzero state entering it)
    "mamba3": dict(cls=mamba.Mamba3Block, d_model=64, decode=(124, 134), splits=(1, 63, 64, 65),
                   length=130),
}


def make(name, d_model=None, seed=0, **kw):
    spec = BLOCKS[name]
    dm = d_model or spec["d_model"]
    w = mamba.random_weights(name, dm, seed=seed)
    for k, v in spec.get("fill", {}).items():
        m = memoryview(w[k]).cast("B").cast("f")
        m[:] = array.array("f", [v] * len(m))
    return spec["cls"](w, **kw)


def gpu_backends(block=None):
    """GPU backends to check against the CPU: every usable one that implements
    `block` (all of them when None), and an explicitly requested one even if
    unusable (so the test fails rather than skips)."""
    from mamba import _backends
    want = os.environ.get("MAMBA_BACKEND", "")
    op = None if block is None else _backends._op_for(BLOCKS[block]["cls"].__name__)
    usable = [n for n, (ok, _) in mamba.backends().items()
              if ok and n != "cpu" and _backends.supports(_backends._get(n)[0], op)]
    if want in ("cuda", "hip") and not mamba.backends()[want][0]:
        usable.append(want)
    return usable
