"""Random weights with upstream-like initialisation, numpy-free (demos, benchmarks)."""
import math
import random

from . import _core


def _fill(shape, values):
    a = _core.empty(shape)
    mv = memoryview(a).cast("B").cast("f")
    for i, v in enumerate(values):
        mv[i] = v
    return a


def _uniform(rng, shape, bound):
    n = 1
    for d in shape:
        n *= d
    return _fill(shape, (rng.uniform(-bound, bound) for _ in range(n)))


def _dt_bias(rng, n):
    # inverse softplus of dt ~ logU(1e-3, 1e-1), as upstream initialises it
    out = []
    for _ in range(n):
        dt = math.exp(rng.uniform(math.log(1e-3), math.log(1e-1)))
        out.append(dt + math.log(-math.expm1(-dt)))
    return out


def random_weights(block, d_model, seed=0):
    """A weight dict for `block` ('mamba1', 'mamba2' or 'mamba3') at d_model."""
    rng = random.Random(seed)
    dm, di = d_model, 2 * d_model
    s_in, s_out = 1 / math.sqrt(dm), 1 / math.sqrt(di)
    if block == "mamba1":
        r = -(-dm // 16)
        return {
            "norm.weight": _fill((dm,), (1 + 0.1 * rng.uniform(-1, 1) for _ in range(dm))),
            "in_proj.weight": _uniform(rng, (2 * di, dm), s_in),
            "conv1d.weight": _uniform(rng, (di, 1, 4), 0.5),
            "conv1d.bias": _uniform(rng, (di,), 0.5),
            "x_proj.weight": _uniform(rng, (r + 32, di), s_out),
            "dt_proj.weight": _uniform(rng, (di, r), r ** -0.5),
            "dt_proj.bias": _fill((di,), _dt_bias(rng, di)),
            "A_log": _fill((di, 16), (math.log(n + 1) for _ in range(di) for n in range(16))),
            "D": _fill((di,), (1.0 for _ in range(di))),
            "out_proj.weight": _uniform(rng, (dm, di), s_out),
        }
    if block == "mamba2":
        H = di // 64
        cd = di + 256
        return {
            "block_norm.weight": _fill((dm,), (1 + 0.1 * rng.uniform(-1, 1) for _ in range(dm))),
            "in_proj.weight": _uniform(rng, (2 * di + 256 + H, dm), s_in),
            "conv1d.weight": _uniform(rng, (cd, 1, 4), 0.5),
            "conv1d.bias": _uniform(rng, (cd,), 0.5),
            "dt_bias": _fill((H,), _dt_bias(rng, H)),
            "A_log": _fill((H,), (math.log(rng.uniform(1, 16)) for _ in range(H))),
            "D": _fill((H,), (1.0 for _ in range(H))),
            "norm.weight": _fill((di,), (1 + 0.1 * rng.uniform(-1, 1) for _ in range(di))),
            "out_proj.weight": _uniform(rng, (dm, di), s_out),
        }
    if block == "mamba3":
        H = di // 64
        dip = 2 * di + 256 + 3 * H + 32

        def near_one(shape):
            # upstream starts norm weights and B/C biases at exactly 1; the small
            # spread keeps every element distinguishable in tests
            n = 1
            for d in shape:
                n *= d
            return _fill(shape, (1 + 0.1 * rng.uniform(-1, 1) for _ in range(n)))
        return {
            "block_norm.weight": near_one((dm,)),
            "in_proj.weight": _uniform(rng, (dip, dm), s_in),
            "dt_bias": _fill((H,), _dt_bias(rng, H)),
            "B_norm.weight": near_one((128,)),
            "C_norm.weight": near_one((128,)),
            "B_bias": near_one((H, 128)),
            "C_bias": near_one((H, 128)),
            "D": _fill((H,), (1.0 for _ in range(H))),
            "out_proj.weight": _uniform(rng, (dm, di), s_out),
        }
    raise ValueError(f"random_weights: unknown block {block!r}")
