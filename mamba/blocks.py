"""What the three blocks share: construction, state checks, forward/step plumbing
and the decode session. Each block file adds its weights, state layout and kernel."""
import functools
import os
from types import SimpleNamespace

from . import _core, _intake as chk
from . import _backends

MODES = ("identical", "fast")


class _State:
    """Caller-owned recurrent state: float32 buffers updated in place, plus scalars."""
    _PIECES = ()
    _SCALARS = ()
    _resident_session = None

    def pieces(self):
        return tuple(getattr(self, n) for n in self._PIECES)

    def __repr__(self):
        parts = [f"{n}={getattr(self, n)!r}" for n in self._SCALARS]
        return f"{type(self).__name__}({', '.join(parts)})"


class _Block:
    """Subclasses set _W_NAMES, _STATE and implement _weight_shapes, _state_shapes,
    _check_scalars and _kernel."""
    _W_NAMES = ()
    _STATE = _State

    def __init__(self, weights, *, numeric_mode="identical", backend="auto"):
        what = type(self).__name__
        if numeric_mode not in MODES:
            raise ValueError(f"mamba {what}: numeric_mode must be one of {MODES}, got "
                             f"{numeric_mode!r}")
        self.numeric_mode = numeric_mode
        self._backend = _backends.resolve(backend, what)
        from . import lowbit
        weights, self.weight_format = lowbit.expand(weights, what)
        raw = chk.weights(weights, what, self._W_NAMES)
        arrs = [chk.f32(a, what, n) for a, n in zip(raw, self._W_NAMES)]
        first = arrs[0]
        if first.ndim != 1 or first.shape[0] < 1:
            raise ValueError(f"mamba {what}: {self._W_NAMES[0]} must be 1-D (d_model,), got "
                             f"shape {first.shape}")
        self.d_model = first.shape[0]
        self._check_d_model(what)
        for a, n in zip(arrs, self._W_NAMES):
            chk.shape(a, what, n, *self._weight_shapes()[n])
        chk.finite_later([(a, n, 0) for a, n in zip(arrs, self._W_NAMES)], what)()
        self._w = tuple(arrs)
        self._dev_w = self._backend.upload_weights(self._w)

    def _check_d_model(self, what):
        pass

    @property
    def d_inner(self):
        """Inner width: 2 * d_model (expand 2 in every profile)."""
        return 2 * self.d_model

    # ------------------------------------------------------------- reporting
    def numeric_mode_used(self):
        """The numeric mode the block runs in ('identical' or 'fast')."""
        return self.numeric_mode

    def vendor_used(self):
        """The backend the block runs on: 'cpu', 'cuda' or 'hip'."""
        return self._backend.name

    def refresh_weights(self):
        """Re-read the weight arrays (after editing them in place) into the backend.

        On the CPU the weights are borrowed, so edits are seen without this call; on
        a GPU the block holds an uploaded copy that only this call replaces."""
        what = type(self).__name__ + ".refresh_weights"
        chk.finite_later([(a, n, 0) for a, n in zip(self._w, self._W_NAMES)], what)()
        self._dev_w = self._backend.upload_weights(self._w)

    # --------------------------------------------------------------- state
    def allocate_state(self, batch_size):
        """A zero state for batch_size sequences."""
        what = type(self).__name__ + ".allocate_state"
        if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
            raise ValueError(f"mamba {what}: batch_size must be a positive integer, got "
                             f"{batch_size!r}")
        shapes = self._state_shapes(int(batch_size))
        return self._STATE(*[_core.zeros(shapes[n]) for n in self._STATE._PIECES])

    def _state_arrays(self, state, what, B):
        if not isinstance(state, self._STATE):
            raise TypeError(f"mamba {what}: state must be a {self._STATE.__name__}, got "
                            f"{type(state).__name__}")
        if state._resident_session is not None:
            raise ValueError(f"mamba {what}: the state is owned by an open decode session; "
                             "call sync_state() or close() on the session first")
        shapes = self._state_shapes(B)
        arrs = []
        for n in self._STATE._PIECES:
            a = chk.f32(getattr(state, n), what, f"state.{n}", writable=True)
            chk.shape(a, what, f"state.{n}", shapes[n])
            chk.aligned(a, what, f"state.{n}")
            arrs.append(a)
        chk.finite_later([(a, f"state.{n}", 0) for a, n in zip(arrs, self._STATE._PIECES)],
                         what)()
        self._check_scalars(state, what)
        return arrs

    def _check_scalars(self, state, what):
        pass

    def _session_runner(self, w, state):
        """An object whose step(x, what) runs a decode session's steps on resident
        buffers (a GPU graph) and whose settle(what) waits for them and returns the
        refusal of a step checked on the device still unreported (or None); None
        for the plain step path. state is the session's own: its pieces are the
        session's buffers, and the runner keeps its scalars current."""
        return None

    # ------------------------------------------------------------- compute
    def _call(self, x, state, step, lengths):
        what = type(self).__name__ + (".step" if step else ".forward")
        x = chk.tokens(x, what, self.d_model, step)
        B, L = x.shape[0], x.shape[1]
        if lengths is not None:
            if state is not None:
                raise ValueError(f"mamba {what}: lengths cannot be combined with a carried "
                                 "state (each row would end at a different position)")
            lengths = chk.lengths(lengths, what, B, L)
        stateless = state is None and not step and lengths is None
        settle = chk.real_finite_later(x, what, lengths, in_norm=stateless)
        early, checked = None, False
        try:
            if stateless:
                early = self._early(x)
            if state is None:  # a zero state where x lives (no upload, no checks needed)
                shapes = self._state_shapes(B)
                pieces = self._backend.zeros([shapes[n] for n in self._STATE._PIECES], like=x)
                state = self._STATE(*pieces)
            else:  # x is refused before the state, and before anything the caller owns changes
                settle()
                pieces = self._state_arrays(state, what, B)
            if x.device == "cpu":
                settle()
            y = self._backend.empty(x.shape, like=x)
            kernel = self._kernel if early is None else functools.partial(self._kernel, early=early)
            checked = True  # _run_checked settles the check whatever happens
            self._run_checked(settle, kernel, self._dev_w, x, pieces, state, y, lengths)
        except BaseException:
            if not checked:  # collect the check's answer (its read-back goes back to the
                try:  # backend); the error in flight is the one to report
                    settle()
                except ValueError:
                    pass
            raise
        finally:
            if early is not None:
                early.close()
        return y

    def _early(self, x):
        """A backend's head start on a stateless prefill of x: its front (the norm and
        in_proj) queued before the host sets up the rest of the call, which the device
        of a lone call would otherwise wait through; None where the backend has none."""
        start = getattr(self._backend, "early_front", None)
        return None if start is None else start(self._KIND, self._dev_w, self.d_model, x,
                                                self.numeric_mode == "fast")

    def _run_checked(self, settle, kernel, *args):
        """kernel(*args), then settle() (a no-op once settled). A device call that
        writes nothing the caller owns is launched before its input check answers,
        so the device does not idle through the read-back; a refusal then puts the
        block's reports back as they were."""
        saved = dict(self.__dict__)
        try:
            kernel(*args)
        finally:
            try:
                settle()
            except ValueError:
                self.__dict__.clear()
                self.__dict__.update(saved)
                raise

    def forward(self, x, state=None, *, lengths=None):
        """Run the block over a sequence: x (B, L, d_model) float32 -> y, same shape.

        state=None runs a self-contained prefill from a zero state. A state from
        allocate_state is read at entry and updated in place, so a later forward or
        step continues exactly as one long prefill would. lengths makes the batch
        ragged (B integers in [1, L], right padding): real positions equal the row
        run alone, padding outputs are +0.0 and padding inputs are never read.
        """
        return self._call(x, state, False, lengths)

    __call__ = forward

    def step(self, x, state):
        """One decode token per row: x (B, 1, d_model) or (B, d_model); state required."""
        if state is None:
            raise ValueError(f"mamba {type(self).__name__}.step: state is required "
                             "(allocate_state(B) makes a fresh one)")
        return self._call(x, state, True, None)

    def backward(self, x, grad_output):
        """Gradients of a zero-state prefill (a vector-Jacobian product).

        Recomputes the forward with the current weights; no earlier call or state
        is used or changed. Returns a dict: 'x' and one gradient per weight, under
        the weight names and with the weights' shapes. In identical mode every
        gradient is a pure function of (weights, x, grad_output), equal on every
        backend; docs/numerics.md gives each reduction's order. In fast mode a GPU
        with tensor cores takes the projections in TF32: every gradient within fast
        mode's accuracy bound, the same bits on every run of that GPU, not the CPU's.
        vjp keeps the forward's activations instead of recomputing them.
        """
        what = type(self).__name__ + ".backward"
        x = chk.tokens(x, what, self.d_model, False)
        self._backward_backend(what)
        w = self._dev_w
        return self._gradients(what, x, grad_output, lambda *a: self._backward_kernel(w, x, *a))

    def vjp(self, x):
        """(y, pullback): a zero-state prefill's output and its backward.

        y is forward(x) (its bits in identical mode); pullback(grad_output) returns
        what backward(x, grad_output) returns, bit for bit, for the x and weights of
        this call, and may be called any number of times. On the CUDA backend the
        pullback keeps the forward's activations and does not run the forward again:
        it holds that memory (about 1.8, 2.1 and 2.6 GiB for Mamba-1, -2 and -3 at
        B 8, L 4096, d_model 1024) until it is dropped or closed. On the CPU it holds
        a copy of x and, in bytes a token, Mamba-1's activations before the scan
        (about 52 d_model), Mamba-2's whole forward (56 d_model + 4100) or Mamba-3's
        projections (21 d_model + 2300), and recomputes the rest. Like backward, it
        leaves the block's reports and any state alone. Edit weights in
        place (CPU) only after the last pullback call; on a GPU, refresh_weights does
        not affect an existing pullback.
        """
        what = type(self).__name__ + ".vjp"
        x = chk.tokens(x, what, self.d_model, False)
        self._backward_backend(what)
        be, w = self._backend, self._dev_w
        like = SimpleNamespace(shape=x.shape, device=x.device)  # the gradients' shape and place
        keep = getattr(be, self._KIND + "_vjp", None)
        settle = chk.finite_later([(x, "x", 0)], what)
        if keep is None:
            settle()
            saved = dict(self.__dict__)
            try:
                y = self.forward(x)
            finally:  # the reports stay as they were
                self.__dict__.clear()
                self.__dict__.update(saved)
            xs = be.copy(x)  # complete on return: the pullback may run on any stream
            return y, Pullback(self, like, lambda *a: self._backward_kernel(w, xs, *a))
        if x.device == "cpu":
            settle()
        y = be.empty(x.shape, like=x)
        kept = []
        self._run_checked(settle, lambda: kept.append(self._vjp_kernel(keep, w, x, y)))
        return y, Pullback(self, like, kept[0].backward)

    def _vjp_kernel(self, keep, w, x, y):
        """The backend's vjp (keep) for this block's arguments: the kept activations."""
        return keep(w, self.d_model, x, y, fast=self.numeric_mode == "fast")

    def _backward_backend(self, what):
        if not hasattr(self._backend, self._KIND + "_backward"):
            raise NotImplementedError(f"mamba {what}: backward is not available on the "
                                      f"{self._backend.name} backend yet")

    def _gradients(self, what, x, grad_output, run, x_checked=False):
        """run(dy, gx, gw) after grad_output's checks (and x's unless x_checked: x
        then only gives the shape and place); the gradients' dict."""
        dy = chk.f32(grad_output, what, "grad_output")
        chk.shape(dy, what, "grad_output", x.shape)
        settle = chk.finite_later(([] if x_checked else [(x, "x", 0)]) + [(dy, "grad_output", 0)],
                                  what)
        if x.device == "cpu":
            settle()
        be = self._backend
        gx = be.empty(x.shape, like=x)
        gw = tuple(be.empty(a.shape, like=x) for a in self._w)
        self._run_checked(settle, run, dy, gx, gw)
        return dict(zip(("x",) + self._W_NAMES, (gx,) + gw))

    def decode_session(self, state):
        """Open a DecodeSession for token-by-token decoding from `state`.

        The session copies the weights and the state when it opens (on a GPU, into
        device memory). Until sync_state() or close(), the state's arrays are stale
        and forward/step refuse that state; edits to the state arrays are seen only
        after load_state(); weight edits are not seen by an open session.
        """
        return DecodeSession(self, state)


class _HeadedBlock(_Block):
    """Mamba-2 and Mamba-3: heads of 64 channels, so d_model must be a multiple of 32."""
    HEADDIM = 64

    def _check_d_model(self, what):
        if self.d_model % (self.HEADDIM // 2):
            raise ValueError(f"mamba {what}: d_model must be a multiple of 32 (so that "
                             f"H = 2 d_model / 64 heads is whole), got {self.d_model}")

    @property
    def nheads(self):
        return self.d_inner // self.HEADDIM


class DecodeSession:
    """Token-by-token decoding on one block and one state, the same bytes as step.

    Use as a context manager; close() copies the state back."""

    def __init__(self, block, state):
        what = "DecodeSession"
        if state is None:
            raise ValueError(f"mamba {what}: state is required (allocate_state)")
        self._block = block
        B = _state_batch(block, state, what)
        src = block._state_arrays(state, what, B)
        self._b = B
        self._state = state
        self._w = block._backend.session_weights(block)
        self._pieces = [block._backend.copy(a) for a in src]
        self._scalars = {n: getattr(state, n) for n in state._SCALARS}
        self._shadow = block._STATE(*self._pieces, **self._scalars)
        self._run = block._session_runner(self._w, self._shadow)
        self._open = True
        state._resident_session = self

    @property
    def state(self):
        return self._state

    @property
    def is_open(self):
        return self._open

    def _require_open(self, what):
        if not self._open:
            raise ValueError(f"mamba DecodeSession.{what}: the session is closed")

    def step(self, x):
        """Decode one token per row; x is (B, 1, d_model) or (B, d_model)."""
        self._require_open("step")
        blk = self._block
        what = "DecodeSession.step"
        x = chk.tokens(x, what, blk.d_model, True)
        if x.shape[0] != self._b:
            raise ValueError(f"mamba {what}: the session holds {self._b} rows, x has "
                             f"B = {x.shape[0]}")
        if self._run is not None:
            return self._run.step(x, what)  # checks x itself (a device x on the device)
        chk.finite(x, what, "x")
        y = blk._backend.empty(x.shape, like=x)
        blk._kernel(self._w, x, self._pieces, self._shadow, y, None)
        return y

    def sync_state(self):
        """Copy the session's state into the caller's state arrays; returns the state.

        A step refused on the device (docs/cuda.md) is raised here, after the copy."""
        self._require_open("sync_state")
        refused = None if self._run is None else self._run.settle("DecodeSession.sync_state")
        for n, src in zip(self._state._PIECES, self._pieces):
            dst = chk.f32(getattr(self._state, n), "DecodeSession.sync_state", n, writable=True)
            self._block._backend.copy_into(dst, src)
        for n in self._state._SCALARS:
            setattr(self._state, n, getattr(self._shadow, n))
        if refused is not None:
            raise refused
        return self._state

    def load_state(self):
        """Reload the session from the caller's state arrays (after editing them)."""
        self._require_open("load_state")
        what = "DecodeSession.load_state"
        refused = None if self._run is None else self._run.settle(what)
        if refused is not None:
            raise refused
        self._state._resident_session = None
        try:
            src = self._block._state_arrays(self._state, what, self._b)
        finally:
            self._state._resident_session = self
        for dst, a in zip(self._pieces, src):
            self._block._backend.copy_into(dst, a)
        for n in self._state._SCALARS:
            setattr(self._shadow, n, getattr(self._state, n))
        return self._state

    def close(self):
        """Copy the state back and release the session; closing twice is a no-op."""
        if not self._open:
            return
        try:
            self.sync_state()
        finally:
            self._open = False
            self._state._resident_session = None
            self._pieces = self._w = self._run = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        if getattr(self, "_open", False):
            self._open = False
            self._state._resident_session = None

    def __repr__(self):
        return f"DecodeSession(block={type(self._block).__name__}, open={self._open}, rows={self._b})"


class Pullback:
    """The backward of one forward, from a block's vjp: pullback(grad_output) returns
    backward's dict of gradients for that forward. close() (or dropping it) frees
    what it holds."""

    def __init__(self, block, like, run):
        self._block, self._like, self._run = block, like, run

    def __call__(self, grad_output):
        what = type(self._block).__name__ + ".vjp pullback"
        if self._run is None:
            raise ValueError(f"mamba {what}: the pullback is closed")
        return self._block._gradients(what, self._like, grad_output, self._run, x_checked=True)

    def close(self):
        self._run = None


def _state_batch(block, state, what):
    # the intake reads host buffers and device arrays (torch.cuda, CuPy) alike
    name = state._PIECES[0]
    shape = chk.f32(getattr(state, name, None), what, f"state.{name}").shape
    if not shape:
        raise ValueError(f"mamba {what}: state.{state._PIECES[0]} has no batch dimension")
    return shape[0]
