"""The Mamba-1 block (profile identical.mamba1.fp32.v1, SPEC section 5)."""
from .blocks import _Block, _State

D_STATE, D_CONV = 16, 4
PROFILE = "identical.mamba1.fp32.v1"


class Mamba1State(_State):
    """Recurrent state of a Mamba1Block, owned by the caller.

    conv_window: float32 (B, d_inner, 4), the last four pre-convolution inputs,
    oldest first. h: float32 (B, d_inner, 16), the SSM state. Both are updated in
    place and round-trip byte for byte.
    """
    _PIECES = ("conv_window", "h")

    def __init__(self, conv_window, h):
        self.conv_window = conv_window
        self.h = h


class Mamba1Block(_Block):
    """One Mamba-1 block: RMSNorm, selective-scan mixer, residual (HF MambaBlock).

    weights: dict of float32 buffers under the upstream names, d_inner = 2 d_model,
    dt_rank R = ceil(d_model / 16): norm.weight (d_model,), in_proj.weight
    (2 d_inner, d_model), conv1d.weight (d_inner, 1, 4) or (d_inner, 4), conv1d.bias
    (d_inner,), x_proj.weight (R + 32, d_inner), dt_proj.weight (d_inner, R),
    dt_proj.bias (d_inner,), A_log (d_inner, 16), D (d_inner,), out_proj.weight
    (d_model, d_inner).
    """
    _W_NAMES = ("norm.weight", "in_proj.weight", "conv1d.weight", "conv1d.bias",
                "x_proj.weight", "dt_proj.weight", "dt_proj.bias", "A_log", "D",
                "out_proj.weight")
    _STATE = Mamba1State
    _KIND = "m1"
    profile = PROFILE

    @property
    def dt_rank(self):
        return -(-self.d_model // 16)

    def _weight_shapes(self):
        dm, di, r = self.d_model, self.d_inner, self.dt_rank
        return {
            "norm.weight": ((dm,),), "in_proj.weight": ((2 * di, dm),),
            "conv1d.weight": ((di, 1, D_CONV), (di, D_CONV)), "conv1d.bias": ((di,),),
            "x_proj.weight": ((r + 2 * D_STATE, di),), "dt_proj.weight": ((di, r),),
            "dt_proj.bias": ((di,),), "A_log": ((di, D_STATE),), "D": ((di,),),
            "out_proj.weight": ((dm, di),),
        }

    def _state_shapes(self, B):
        return {"conv_window": (B, self.d_inner, D_CONV), "h": (B, self.d_inner, D_STATE)}

    def _kernel(self, w, x, pieces, state, y, lengths, early=None):
        self._backend.m1_forward(w, self.d_model, x, pieces, y, lengths,
                                 fast=self.numeric_mode == "fast", early=early)

    def _backward_kernel(self, w, x, dy, gx, gw):
        self._backend.m1_backward(w, self.d_model, x, dy, gx, gw,
                                  fast=self.numeric_mode == "fast")

    def _session_runner(self, w, state):
        # a GPU backend may run a session's step as one captured graph
        open_session = getattr(self._backend, "m1_session", None)
        if open_session is None:
            return None
        return open_session(w, self.d_model, state.pieces(), self.numeric_mode == "fast")
