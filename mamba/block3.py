"""The Mamba-3 SISO block (profile identical.mamba3.siso.fp32.v1, SPEC section 7)."""
import operator

from . import _core, _intake as chk
from .blocks import _HeadedBlock, _State

D_STATE, HEADDIM, N_ANGLES, CHUNK = 128, 64, 32, 64
PROFILE = "identical.mamba3.siso.fp32.v1"


class Mamba3State(_State):
    """Recurrent state of a Mamba3Block, owned by the caller.

    With H = d_model / 32 heads, N = 128, P = 64, 32 rotary angles and chunk Q = 64.
    The working chunk is the chunk of the absolute grid (positions 0, 64, 128, ...)
    that holds the last token; it is folded into h only when the first token of the
    next chunk arrives, because that token's dt and sigmoid(trap) complete the
    trapezoid of the chunk's last row.

    theta (B, H, 32): rotary angles after the last token, in [0, 2 pi].
    h (B, H, 64, 128): the SSM state entering the working chunk.
    buffer_qrot, buffer_krot (B, 64, H, 128): rotated q and rotated, unscaled k of
    the working chunk's rows. buffer_v (B, 64, H, 64): its v rows (the raw x split).
    buffer_dt, buffer_sig, buffer_adt (B, 64, H): dt, sigmoid(trap) and A * dt rows.
    pending_k (B, H, 128), pending_v (B, H, 64): the input-state k and v of
    `set_input_states`, read only when `pending`.
    buffered_tokens: valid buffer rows, in [0, 64]; in [1, 64] after any call. The
    rows past it hold zeros.
    pending: True after `set_input_states`; the next call consumes it (and zeroes
    pending_k and pending_v).

    Every piece is a float32 buffer updated in place; the state round-trips byte for
    byte together with the two scalars.
    """
    _PIECES = ("theta", "h", "buffer_qrot", "buffer_krot", "buffer_v", "buffer_dt",
               "buffer_sig", "buffer_adt", "pending_k", "pending_v")
    _SCALARS = ("buffered_tokens", "pending")

    def __init__(self, theta, h, buffer_qrot, buffer_krot, buffer_v, buffer_dt, buffer_sig,
                 buffer_adt, pending_k, pending_v, buffered_tokens=0, pending=False):
        self.theta = theta
        self.h = h
        self.buffer_qrot = buffer_qrot
        self.buffer_krot = buffer_krot
        self.buffer_v = buffer_v
        self.buffer_dt = buffer_dt
        self.buffer_sig = buffer_sig
        self.buffer_adt = buffer_adt
        self.pending_k = pending_k
        self.pending_v = pending_v
        self.buffered_tokens = buffered_tokens
        self.pending = pending

    def set_input_states(self, theta, h, k, v):
        """Start a new sequence from upstream's Input_States (angle, SSM, k, v states).

        theta (B, H, 32), h (B, H, 64, 128), k (B, H, 128) and v (B, H, 64), e.g. a
        block's theta_last_, h_last_, k_last_ and v_last_. The next call starts its
        own chunk grid at position 0 from h0 = h + (v * k) * (dt_1 * (1 - sig_1)),
        dt_1 and sig_1 being its first token's. The buffers are cleared. This
        continuation matches one long prefill only up to rounding (the long prefill
        keeps its chunk grid); it is checked against the upstream maths by tolerance.
        """
        what = "Mamba3State.set_input_states"
        if self._resident_session is not None:
            raise ValueError(f"mamba {what}: the state is owned by an open decode session; "
                             "call sync_state() or close() on the session first")
        dst = {n: chk.f32(getattr(self, n), what, f"state.{n}", writable=True)
               for n in self._PIECES}
        src = []
        for name, piece, arr in (("theta", "theta", theta), ("h", "h", h),
                                 ("k", "pending_k", k), ("v", "pending_v", v)):
            a = chk.f32(arr, what, name)
            chk.shape(a, what, name, dst[piece].shape)
            chk.finite(a, what, name)
            src.append((dst[piece], a))
        # copies first: an argument may alias a piece of this state
        src = [(d, _core.copy(a)) for d, a in src]
        for n in ("buffer_qrot", "buffer_krot", "buffer_v", "buffer_dt", "buffer_sig",
                  "buffer_adt"):
            _core.copy_into(dst[n], _core.zeros(dst[n].shape))
        for d, a in src:
            _core.copy_into(d, a)
        self.buffered_tokens = 0
        self.pending = True


class Mamba3Block(_HeadedBlock):
    """One Mamba-3 SISO block: RMSNorm, Mamba-3 mixer, residual (upstream Mamba3 with
    is_mimo=False, is_outproj_norm=False, inside the non-fused block).

    weights: dict of float32 buffers under the upstream names, d_inner = 2 d_model,
    H = d_inner / 64 heads, N = 128: block_norm.weight (d_model,), in_proj.weight
    (2 d_inner + 256 + 3 H + 32, d_model) with rows z | x | B | C | dd_dt | dd_A |
    trap | angle, dt_bias (H,), B_norm.weight (N,), C_norm.weight (N,), B_bias (H, N),
    C_bias (H, N), D (H,), out_proj.weight (d_model, d_inner). d_model must be a
    multiple of 32. Fixed: d_state 128, headdim 64, one group, rope fraction 0.5 (32
    angles on interleaved pairs), A floor 1e-4 with upstream main's heavy-tail A,
    chunk size 64, no conv, no dt clamp, no output norm.

    After every call the block holds reports for the last token of each row (values
    to read, not the resumption state): h_last_ (B, H, 64, 128), the working chunk
    folded into h as if the sequence ended there (that token's beta is 0: upstream's
    final SSM state); k_last_ (B, H, 128), that token's rotated unscaled k; v_last_
    (B, H, 64), its v; theta_last_ (B, H, 32), the angles after it. Passing them to
    Mamba3State.set_input_states continues the sequence as upstream's Input_States.
    """
    _W_NAMES = ("block_norm.weight", "in_proj.weight", "dt_bias", "B_norm.weight",
                "C_norm.weight", "B_bias", "C_bias", "D", "out_proj.weight")
    _STATE = Mamba3State
    _KIND = "m3"
    profile = PROFILE
    _report = _reported = None  # what gives the four reports when first read, and what it gave

    def _reports(self, i):
        if self._reported is None and self._report is not None:
            self._reported = self._report()
        return None if self._reported is None else self._reported[i]

    h_last_ = property(lambda self: self._reports(0))
    k_last_ = property(lambda self: self._reports(1))
    v_last_ = property(lambda self: self._reports(2))
    theta_last_ = property(lambda self: self._reports(3))

    @property
    def d_in_proj(self):
        return 2 * self.d_inner + 2 * D_STATE + 3 * self.nheads + N_ANGLES

    def _weight_shapes(self):
        dm, di, H = self.d_model, self.d_inner, self.nheads
        return {
            "block_norm.weight": ((dm,),), "in_proj.weight": ((self.d_in_proj, dm),),
            "dt_bias": ((H,),), "B_norm.weight": ((D_STATE,),),
            "C_norm.weight": ((D_STATE,),), "B_bias": ((H, D_STATE),),
            "C_bias": ((H, D_STATE),), "D": ((H,),), "out_proj.weight": ((dm, di),),
        }

    def _state_shapes(self, B):
        H = self.nheads
        return {
            "theta": (B, H, N_ANGLES), "h": (B, H, HEADDIM, D_STATE),
            "buffer_qrot": (B, CHUNK, H, D_STATE), "buffer_krot": (B, CHUNK, H, D_STATE),
            "buffer_v": (B, CHUNK, H, HEADDIM), "buffer_dt": (B, CHUNK, H),
            "buffer_sig": (B, CHUNK, H), "buffer_adt": (B, CHUNK, H),
            "pending_k": (B, H, D_STATE), "pending_v": (B, H, HEADDIM),
        }

    def _check_scalars(self, state, what):
        n, p = state.buffered_tokens, state.pending
        try:
            ok = not isinstance(n, bool) and 0 <= operator.index(n) <= CHUNK
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"mamba {what}: state.buffered_tokens must be an integer in "
                             f"[0, {CHUNK}], got {n!r}")
        if p not in (True, False):
            raise ValueError(f"mamba {what}: state.pending must be True or False, got {p!r}")
        if p and n:
            raise ValueError(f"mamba {what}: state.pending needs buffered_tokens == 0 (an "
                             f"input state starts a new sequence), got {n}")

    def _backward_kernel(self, w, x, dy, gx, gw):
        self._backend.m3_backward(w, self.d_model, x, dy, gx, gw,
                                  fast=self.numeric_mode == "fast")

    def _kernel(self, w, x, pieces, state, y, lengths, early=None):
        B, H = x.shape[0], self.nheads
        be = self._backend
        # reports live where the state does (the device for a GPU session)
        shapes = ((B, H, HEADDIM, D_STATE), (B, H, D_STATE), (B, H, HEADDIM), (B, H, N_ANGLES))
        reports = tuple(be.empty(s, like=pieces[1]) for s in shapes)
        n = be.m3_forward(w, self.d_model, x, pieces, operator.index(state.buffered_tokens),
                          bool(state.pending), y, reports, lengths,
                          fast=self.numeric_mode == "fast", early=early)
        state.buffered_tokens = n
        state.pending = False
        self._report, self._reported = None, reports

    def _session_runner(self, w, state):
        # as Mamba2Block's
        open_session = getattr(self._backend, "m3_session", None)
        if open_session is None:
            return None
        return open_session(self, w, state, self.numeric_mode == "fast")
