"""The C reference (and every backend) against independent float64 oracles written
from the upstream maths, at rtol 1e-5, atol 1e-6 (SPEC 10)."""
import numpy as np
import pytest

import mamba
from mamba._oracle64 import oracle1
from mamba._oracle64 import oracle2
from mamba._oracle64 import oracle3
from blocks import BLOCKS, make

RTOL, ATOL = 1e-5, 1e-6

ORACLES = {"mamba1": oracle1.forward, "mamba2": oracle2.forward, "mamba3": oracle3.forward}
# weights a block is compared on, when its random ones are not "sane inputs" (SPEC 10)
SANE = {"mamba3": oracle3.sane}
# (B, L, d_model) per block: L = 1, around the chunk grid, several d_model
CASES = {
    "mamba1": [(1, 1, 16), (2, 17, 24), (3, 257, 32), (1, 64, 100)],
    "mamba2": [(1, 1, 32), (3, 255, 64), (1, 256, 96), (3, 257, 32), (1, 513, 64), (3, 770, 32)],
    "mamba3": [(1, 1, 32), (3, 63, 64), (1, 64, 32), (3, 65, 32), (1, 129, 64), (3, 257, 64)],
}


def as64(w):
    return {k: np.asarray(v, dtype=np.float64) for k, v in w.items()}


PARAMS = [(n, c) for n in ORACLES for c in CASES[n]]


@pytest.mark.parametrize("name,shape", PARAMS, ids=[f"{n}-{c}" for n, c in PARAMS])
def test_forward_matches_float64_oracle(name, shape):
    B, L, dm = shape
    w = mamba.random_weights(name, dm, seed=L)
    w = SANE.get(name, dict)(w)
    blk = BLOCKS[name]["cls"](w, backend="cpu")
    x = np.random.default_rng(L).standard_normal((B, L, dm)).astype(np.float32)
    y = np.asarray(blk.forward(x))
    want = ORACLES[name](as64(w), x.astype(np.float64))
    np.testing.assert_allclose(y, want, rtol=RTOL, atol=ATOL)
    # the oracle is sensitive enough to notice a wrong block: a perturbed weight fails
    w2 = as64(w)
    key = BLOCKS[name]["cls"]._W_NAMES[-1]
    w2[key] = w2[key] * 1.001
    assert not np.allclose(y, ORACLES[name](w2, x.astype(np.float64)), rtol=RTOL, atol=ATOL)
