"""The Mamba-2 (SSD) block (profile identical.mamba2.fp32.v1, SPEC section 6)."""
import array
import math
import operator

from .blocks import _HeadedBlock, _State

D_STATE, HEADDIM, D_CONV, CHUNK = 128, 64, 4, 256
PROFILE = "identical.mamba2.fp32.v1"


class Mamba2State(_State):
    """Recurrent state of a Mamba2Block, owned by the caller.

    With d_inner = 2 d_model, H = d_inner / 64 heads and CD = d_inner + 256 conv
    channels (x | B | C). The chunk grid (positions 0, 256, 512, ...) is absolute; the
    open chunk is the one holding the next token.

    conv_window (B, CD, 4): the last four pre-convolution xBC inputs, oldest first.
    h (B, H, 64, 128): the SSM state entering the open chunk. Setting it nonzero on a
    fresh state supplies upstream's initial_states.
    buffer_xbc (B, 256, CD): post-convolution, post-silu xBC rows of the open chunk.
    buffer_dtraw (B, 256, H): its dt rows as in_proj gives them (before dt_bias).
    buffered_tokens: rows of the open chunk held, in [0, 256). Buffer rows past them
    are never read; after a call that closes a chunk they are zero.

    Every piece is a float32 buffer updated in place; the state round-trips byte for
    byte together with buffered_tokens.
    """
    _PIECES = ("conv_window", "h", "buffer_xbc", "buffer_dtraw")
    _SCALARS = ("buffered_tokens",)

    def __init__(self, conv_window, h, buffer_xbc, buffer_dtraw, buffered_tokens=0):
        self.conv_window = conv_window
        self.h = h
        self.buffer_xbc = buffer_xbc
        self.buffer_dtraw = buffer_dtraw
        self.buffered_tokens = buffered_tokens


def _dt_limit(lim, what):
    """(lo, hi) rounded to float32: lo finite, hi finite or +inf, lo <= hi."""
    try:
        lo, hi = array.array("f", [float(v) for v in lim])
    except (TypeError, ValueError):
        raise ValueError(f"mamba {what}: dt_limit must be a pair of floats (lo, hi), got "
                         f"{lim!r}") from None
    if math.isnan(lo) or math.isnan(hi) or math.isinf(lo) or hi < lo:
        raise ValueError(f"mamba {what}: dt_limit must be (lo, hi) with lo finite in "
                         f"float32, hi finite or +inf and lo <= hi, got {lim!r}")
    return lo, hi


class Mamba2Block(_HeadedBlock):
    """One Mamba-2 (SSD) block: RMSNorm, SSD mixer, residual (HF Mamba2Block).

    weights: dict of float32 buffers under the upstream names, d_inner = 2 d_model,
    H = d_inner / 64 heads, CD = d_inner + 256: block_norm.weight (d_model,),
    in_proj.weight (2 d_inner + 256 + H, d_model) with rows z | xBC | dt,
    conv1d.weight (CD, 1, 4) or (CD, 4), conv1d.bias (CD,), dt_bias (H,), A_log (H,),
    D (H,), norm.weight (d_inner,) the gated norm, out_proj.weight (d_model, d_inner).
    d_model must be a multiple of 32. Fixed: d_state 128, headdim 64, one group, chunk
    size 256, conv kernel 4 with bias, gate before the norm.

    dt_limit (lo, hi): dt = clamp(softplus(dt_raw + dt_bias), lo, hi), always applied;
    both bounds are rounded to float32 (hi may be +inf).

    After every call h_last_ (B, H, 64, 128) holds each row's SSM state after its last
    token with the open chunk folded as if it were closed (upstream final_states). It
    is a report, not the resumption state: on a chunk boundary it equals state.h. It
    is folded when first read, from copies taken at the call, so later edits of the
    state or the weights do not change it.
    """
    _W_NAMES = ("block_norm.weight", "in_proj.weight", "conv1d.weight", "conv1d.bias",
                "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")
    _STATE = Mamba2State
    _KIND = "m2"
    profile = PROFILE
    _report = _reported = None  # what gives h_last_ when first read, and what it gave

    def __init__(self, weights, *, dt_limit=(0.0, math.inf), numeric_mode="identical",
                 backend="auto"):
        self._dt_lim = _dt_limit(dt_limit, type(self).__name__)
        super().__init__(weights, numeric_mode=numeric_mode, backend=backend)

    @property
    def conv_dim(self):
        return self.d_inner + 2 * D_STATE

    def _weight_shapes(self):
        dm, di, H, cd = self.d_model, self.d_inner, self.nheads, self.conv_dim
        return {
            "block_norm.weight": ((dm,),), "in_proj.weight": ((di + cd + H, dm),),
            "conv1d.weight": ((cd, 1, D_CONV), (cd, D_CONV)), "conv1d.bias": ((cd,),),
            "dt_bias": ((H,),), "A_log": ((H,),), "D": ((H,),), "norm.weight": ((di,),),
            "out_proj.weight": ((dm, di),),
        }

    def _state_shapes(self, B):
        H, cd = self.nheads, self.conv_dim
        return {
            "conv_window": (B, cd, D_CONV), "h": (B, H, HEADDIM, D_STATE),
            "buffer_xbc": (B, CHUNK, cd), "buffer_dtraw": (B, CHUNK, H),
        }

    def _check_scalars(self, state, what):
        n = state.buffered_tokens
        try:
            ok = not isinstance(n, bool) and 0 <= operator.index(n) < CHUNK
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"mamba {what}: state.buffered_tokens must be an integer in "
                             f"[0, {CHUNK}), got {n!r}")

    @property
    def dt_limit(self):
        """(lo, hi) as applied (float32 values)."""
        return self._dt_lim

    @property
    def h_last_(self):
        """(B, H, 64, 128) report of the last call (None before any call)."""
        if self._reported is None and self._report is not None:
            self._reported = self._report()
        return self._reported

    def _backward_kernel(self, w, x, dy, gx, gw):
        self._backend.m2_backward(w, self.d_model, self.dt_limit, x, dy, gx, gw,
                                  fast=self.numeric_mode == "fast")

    def _vjp_kernel(self, keep, w, x, y):
        return keep(w, self.d_model, self.dt_limit, x, y, fast=self.numeric_mode == "fast")

    def _kernel(self, w, x, pieces, state, y, lengths, early=None):
        be = self._backend
        counts = be.m2_forward(w, self.d_model, self.dt_limit, x, pieces,
                               operator.index(state.buffered_tokens), y, lengths,
                               fast=self.numeric_mode == "fast", early=early)
        if lengths is None:
            state.buffered_tokens = counts[0]
        # h_last_ is a function of the state after the call: keep copies of what it
        # reads and fold only when it is read, so a decode step does not pay for it
        inputs, dm = be.m2_report_inputs(w, self.dt_limit, pieces, counts), self.d_model
        self._report, self._reported = (lambda: be.m2_h_last(dm, inputs)), None

    def _session_runner(self, w, state):
        # a GPU backend may run a session's step as one captured graph, which leaves
        # the block a report read from the session's buffers
        open_session = getattr(self._backend, "m2_session", None)
        if open_session is None:
            return None
        return open_session(self, w, state, self.numeric_mode == "fast")
