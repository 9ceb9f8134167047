"""mamba-blocks: Mamba-1, Mamba-2 and Mamba-3 blocks whose float32 results are
bit-identical on the CPU and on GPUs, across batch composition, and between one
prefill and any split of it into prefill and decode steps."""
import os as _os

# OpenMP workers sleep between parallel regions instead of spinning: on a shared or
# oversubscribed machine spinning made a decode step 25x slower, and sleeping costs a
# few microseconds per region. Set OMP_WAIT_POLICY yourself to choose otherwise.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    from ._core import Array, empty, zeros
except ImportError as e:  # the source checkout shadows the installed package
    raise ImportError("mamba: the compiled core is missing. If you are inside the source "
                      "checkout, run from another directory (or use the `mamba-blocks` "
                      "command); otherwise reinstall with `pip install .`") from e
from ._backends import backends
from ._cuda import stream
from .blocks import DecodeSession, Pullback
from .block1 import Mamba1Block, Mamba1State
from .block2 import Mamba2Block, Mamba2State
from .block3 import Mamba3Block, Mamba3State
from ._weights import random_weights
from . import lowbit

__version__ = "0.1.0"


def asarray(obj, shape=None):
    """A float32 mamba.Array copy of a float32 buffer, optionally reshaped."""
    from . import _core
    a = _core.copy(_core.intake(obj, "asarray", "obj"))
    return a.reshape(tuple(shape)) if shape is not None else a


__all__ = ["Array", "empty", "zeros", "asarray", "backends", "stream", "DecodeSession", "Pullback",
           "Mamba1Block", "Mamba1State", "Mamba2Block", "Mamba2State", "Mamba3Block", "Mamba3State",
           "random_weights", "lowbit"]
