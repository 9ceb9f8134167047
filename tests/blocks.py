"""The blocks under test and the shapes each lane uses, shared by every promise."""
import os

import mamba

# name -> class, d_model for identity lanes, decode lane (prefill, total),
# split points, and the lengths that cross the block's chunk grid
BLOCKS = {
    "mamba1": dict(cls=mamba.Mamba1Block, d_model=32, decode=(5, 14), splits=(1, 3, 7, 20),
                   length=24),
}


def make(name, d_model=None, seed=0, **kw):
    spec = BLOCKS[name]
    dm = d_model or spec["d_model"]
    return spec["cls"](mamba.random_weights(name, dm, seed=seed), **kw)


def gpu_backends():
    """GPU backends to check against the CPU: every usable one, and an explicitly
    requested one even if unusable (so the test fails rather than skips)."""
    want = os.environ.get("MAMBA_BACKEND", "")
    usable = [n for n, (ok, _) in mamba.backends().items() if ok and n != "cpu"]
    if want in ("cuda", "hip") and want not in usable:
        usable.append(want)
    return usable
