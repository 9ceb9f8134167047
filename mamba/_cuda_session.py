"""Decode sessions on the CUDA backend: each step is one replay of a CUDA graph.

A session's step is captured once, over the session's resident weights, state and
fixed input and output buffers: a step is a copy of x in, one cuGraphLaunch and a
copy of y out, with no host wait for a device input and no host data per step.
Mamba-2 and Mamba-3 keep their count of buffered tokens on the device too, where
the step's first kernel of ssd_step.cu writes the chunk tables that _cuda_ssd._Plan
would give a one-token call, and moves the count on; the host keeps its own copy
of the count in step with the device's, in the session's state.

The graph's first kernel (the block norm, or mb_step_guard_k just before it:
CudaBackend.step_guard) checks the step's input on the device. A refused step (a NaN
or inf in x) leaves the state alone, gives NaN outputs, and so do the steps after it
until the host has reported it: the guard writes the step and index to mapped host
memory, which the next step reads without waiting, and which sync_state, load_state
and close read after waiting for the stream. A host input is checked on the host
before it is uploaded.
"""
import ctypes
import operator

from . import _core, _cuda_ssd, _intake as chk
from ._cuda import NONE, THREADS, _M1Buffers, _Mem
from ._cuda_ssd import HP, IFOLD_THREADS, M2_Q, M3_Q, NS

STEP_PS = 2  # ssd_step.cu: blocks per head of mb_m2_step_y_k, HP / STEP_PS columns each
STEP_CB, STEP_CBT = 32, 128  # ssd_step.cu: rows per block of mb_m2_step_cb_k, threads
# A step of at most this many rows launches its kernels as programmatic dependents
# (_cuda.WAITS): its grids are one wave, and each kernel's start hides behind the
# one before (H200, batch 1: 3-4 us a step). With 32 rows the grids span waves and
# the step measured slower so (Mamba-2 and Mamba-3 identical: 11-12 us).
DEPENDENT_ROWS = 8


class _GraphSession:
    """What every block's session shares: the fixed x and y buffers, the guard, the
    capture of a step, the step itself, stream following and refusals. A subclass
    captures its step (self.exec) and may adjust the step before the launch
    (_prepare: the graph to launch) and after it (_stepped), and learn of refused
    steps (_rolled_back)."""

    def __init__(self, be, shape):
        cu = be.cu
        be._enter()
        s = be.stream()
        self.be, self.shape = be, shape
        self.x, self.y = be.new(shape), be.new(shape)
        self.nbytes = 4 * self.x.size
        self._keep, self._graphs = [], []
        self.guard = _Mem(be, 24)
        be._ck(cu.cuMemsetD8Async(self.guard.ptr, 0xFF, 8, s.cu), "cuMemsetD8Async")
        be._ck(cu.cuMemsetD8Async(self.guard.ptr + 8, 0, 16, s.cu), "cuMemsetD8Async")
        self.host = be._ck(cu.cuMemHostAlloc(16, cu.CU_MEMHOSTALLOC_DEVICEMAP), "cuMemHostAlloc")
        self.seen = (ctypes.c_uint64 * 2).from_address(int(self.host))
        self.seen[0] = self.seen[1] = NONE
        self.dev_seen = int(be._ck(cu.cuMemHostGetDevicePointer(self.host, 0),
                                   "cuMemHostGetDevicePointer"))
        self.steps = 0  # graph launches, as the guard counts them
        self.exec = None
        self.last = s

    def alloc(self, n):
        """n floats (or n / 2 int64) of device memory the session keeps."""
        m = _Mem(self.be, 4 * n)
        self._keep.append(m)
        return m.ptr

    def counters(self, n):
        """n zeroed 32-bit counters the session keeps (a kernel's last-block count;
        the last block sets its counter back to 0)."""
        p = self.alloc(n)
        self.be._fill32(self.be.stream().cu, p, 0, n)
        return p

    def arena(self, n):
        """An allocator for launchers that take one (CudaBackend._front and friends)
        while a graph is captured, when no memory can be allocated: it hands out, 256
        bytes aligned, the n floats allocated now."""
        base, end, at = self.alloc(n), 4 * n, [0]

        def take(k):
            p = base + at[0]
            at[0] += -(-4 * k // 256) * 256
            if at[0] > end:
                raise AssertionError("a session's arena is too small")
            return p
        return take

    def capture(self, body):
        """The graph of the guard and the launches body(stream) makes, instantiated and
        uploaded; body's launches read the guard word. The guard runs in or just before
        body's first launch, the block norm (CudaBackend.step_guard)."""
        be, cu = self.be, self.be.cu
        s = be.stream()
        be._sync(s)  # the session's buffers are set
        with be.capturing(self.shape[0] <= DEPENDENT_ROWS) as cs:
            be._ck(cu.cuStreamBeginCapture(
                cs, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                "cuStreamBeginCapture")
            try:
                be.step_guard((self.x.size, self.x, self.guard.ptr, self.dev_seen))
                body(cs)
                if be.step_guard(None) is not None:
                    raise AssertionError("a session step must open with its block norm")
            except BaseException:
                be.step_guard(None)
                cu.cuStreamEndCapture(cs)  # the body's error is the one to report
                raise
            graph = be._ck(cu.cuStreamEndCapture(cs), "cuStreamEndCapture")
        self._graphs.append([graph, None])
        exe = self._graphs[-1][1] = be._ck(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
        be._ck(cu.cuGraphUpload(exe, s.cu), "cuGraphUpload")
        return exe

    def _follow(self, s):
        """Order this call after the session's previous one when the stream changed."""
        if s.number != self.last.number:
            self.be._wait(s.cu, self.last.cu)
        self.last = s

    def _refusal(self, s, what):
        """The refusal the guard has reported (a ValueError), if any; the guard reopens
        for the steps issued after this call."""
        idx = self.seen[0]
        if idx == NONE:
            return None
        step = self.seen[1]
        self.seen[0] = self.seen[1] = NONE
        self.be._ck(self.be.cu.cuMemsetD8Async(self.guard.ptr, 0xFF, 8, s.cu), "cuMemsetD8Async")
        self._rolled_back(step)
        return ValueError(f"mamba {what}: x of step {step + 1} of this session held a non-finite "
                          f"value (NaN or inf) at flat index {idx}; that step and the later ones "
                          "until now were refused (NaN outputs, state left as before that step)")

    def _prepare(self, s, x, what):
        return self.exec

    def _stepped(self):
        pass

    def _rolled_back(self, step):
        """Steps from number `step` (from 0) to the last one issued were refused."""

    def step(self, x, what):
        be, cu = self.be, self.be.cu
        be._enter()
        s = be.stream()
        self._follow(s)
        refused = self._refusal(s, what)
        if refused is not None:
            raise refused
        on_host = x.device == "cpu"
        if on_host:
            chk.finite(x, what, "x")
        exe = self._prepare(s, x, what)
        if on_host:
            be._ck(cu.cuMemcpyHtoDAsync(self.x.ptr, x.ptr, self.nbytes, s.cu), "cuMemcpyHtoDAsync")
        else:
            be._ck(cu.cuMemcpyDtoDAsync(self.x.ptr, x.ptr, self.nbytes, s.cu), "cuMemcpyDtoDAsync")
        be._ck(cu.cuGraphLaunch(exe, s.cu), "cuGraphLaunch")
        self.steps += 1
        self._stepped()
        if on_host:
            y = _core.empty(self.shape)
            be._ck(cu.cuMemcpyDtoHAsync(y.ptr, self.y.ptr, self.nbytes, s.cu), "cuMemcpyDtoHAsync")
            be._sync(s)
            refused = self._refusal(s, what)  # an earlier device step's refusal refused this one
            if refused is not None:
                raise refused
            return y
        y = be.empty(self.shape, like=x)
        be._ck(cu.cuMemcpyDtoDAsync(y.ptr, self.y.ptr, self.nbytes, s.cu), "cuMemcpyDtoDAsync")
        return y

    def settle(self, what):
        """Wait for the session's work; the refusal still unreported, or None."""
        s = self.be.stream()
        self._follow(s)
        self._settling(s)
        self.be._sync(s)
        return self._refusal(s, what)

    def _settling(self, s):
        """Work to issue before sync_state or load_state reads or replaces the state."""

    def __del__(self):
        cu, graphs, host = self.be.cu, self._graphs, self.host

        def free():
            for graph, exe in graphs:
                if exe is not None:
                    cu.cuGraphExecDestroy(exe)
                cu.cuGraphDestroy(graph)
            cu.cuMemFreeHost(host)
        self.be.release(free)


class M1Session(_GraphSession):
    """Mamba-1: the launches of a one-token call (CudaBackend._m1_launch)."""

    def __init__(self, be, w, dm, pieces, fast):
        B = pieces[0].shape[0]
        super().__init__(be, (B, 1, dm))
        bufs = _M1Buffers(be, self.alloc, B, dm, False).rest()
        off = be._uniform_offsets(B, 1)
        self.exec = self.capture(lambda cs: be._m1_launch(
            cs, fast, w, dm, B, 1, off, B, self.x.ptr, pieces[0].ptr, pieces[1].ptr,
            self.y.ptr, bufs, False, self.guard.ptr))


class _Report:
    """A session step's reports, computed from the session's buffers when first read
    (the next step replaces it on the block, and sync_state and load_state compute
    it before the buffers change)."""

    def __init__(self, session):
        self.session, self.value = session, None

    def __call__(self):
        if self.session is not None:
            self.value = self.session._reports()
            self.session = None  # the session's buffers are not kept for it
        return self.value


class _SsdSession(_GraphSession):
    """Mamba-2 and Mamba-3: the count of buffered tokens lives in ctl on the device
    (set from the state when it differs from the host's count, after load_state),
    the host's count in the session's state follows each step and each refusal, and
    each step leaves the block a _Report."""
    SCALARS = ("buffered_tokens",)

    def __init__(self, be, block, state):
        dm = block.d_model
        B = state.h.shape[0]
        super().__init__(be, (B, 1, dm))
        self.block, self.state, self.B, self.dm = block, state, B, dm
        self.ctl = self.alloc(4)
        s = be.stream()
        be._fill32(s.cu, self.ctl, 0, 4)
        self._whole(s)
        self.base, self.base_step = None, 0
        self.report = None
        be._kernels(*self.KERNELS)

    def scratch(self):
        """The table CudaBackend._front and friends take."""
        return {"M": self.B, "r": self.alloc(self.B), "off": self.be._uniform_offsets(self.B, 1)}

    def front_arena(self, NP):
        """An arena for _front's rows and Mamba-3's B and C norms."""
        return self.arena(self.B * (self.dm + NP + 2 * NS) + 4 * 64)

    def _count(self):
        """The host's scalars now: the state's after base_step, advanced by the steps
        issued since."""
        return self.advance(self.base, self.steps - self.base_step)

    def _prepare(self, s, x, what):
        given = tuple(f(getattr(self.state, n)) for n, f in
                      zip(self.SCALARS, (operator.index, bool)))
        if self.base is None or given != self._count():  # opened, or load_state
            self.base, self.base_step = given, self.steps
            self.be._fill32(s.cu, self.ctl, given[0], 1)
        return self.exec

    def _stepped(self):
        self._publish()
        self.report = _Report(self)
        self.block._report, self.block._reported = self.report, None

    def _publish(self):
        for n, v in zip(self.SCALARS, self._count()):
            setattr(self.state, n, v)

    def _rolled_back(self, step):
        self.base = self.advance(self.base, step - self.base_step)
        self.base_step = self.steps
        self._publish()

    def _whole(self, s):
        """Have the next step rebuild what the session carries between steps from the
        state (ctl[1])."""
        self.be._fill32(s.cu, self.ctl + 8, 1, 1)

    def _settling(self, s):
        if self.report is not None and self.block._report is self.report:
            self.block._reported = self.report()
        self.report = None
        self._whole(s)  # load_state may replace the state


class M2Session(_SsdSession):
    """Mamba-2 (_cuda_ssd._m2_forward at L = 1 on the ext layout of ssd_step.cu).
    The step carries dt, dA and their cumsum of the open rows, and the seg columns
    of its output row, from one step to the next and computes only what the new row
    adds; they are rebuilt at the first step after the session opens and after each
    sync_state or load_state (ctl[1])."""
    KERNELS = ("mb_m2_step_cb_k", "mb_m2_step_y_k", "mb_m2_fold_k")

    @staticmethod
    def advance(count, n):
        return ((count[0] + n) % M2_Q,)

    def __init__(self, be, block, w, state, fast):
        super().__init__(be, block, state)
        B, dm, a = self.B, self.dm, self.alloc
        di = 2 * dm
        H, CD = di // HP, di + 2 * NS
        NP = di + CD + H
        self.H, self.di, self.CD = H, di, CD
        norm_w, in_proj, conv_w, conv_b, dt_bias, A_log, D, gnorm_w, out_proj = w
        lo, hi = block.dt_limit
        cw, h, bx, bd = (p.ptr for p in state.pieces())
        self.h, self.bx = state.h, bx
        I = self.scratch()
        nparts = max(be._parts(B, NP, dm), be._parts(B, dm, di))
        parts = a(nparts) if nparts else 0
        unew, yg = a(B * CD), a(B * di)
        self.dt, dA, self.cs = (a(B * H * M2_Q) for _ in range(3))
        seg = a(2 * B * H * M2_Q)  # the rows of even and odd steps
        G, Yo = a(B * M2_Q), a(B * H * HP)  # the step's dots with C_t
        scal, desc, self.rep = a(8), a(12 * B), a(12 * B)
        done = self.counters(B)
        g, L = self.guard.ptr, be._launch
        sc = self.front_arena(NP)

        def body(cs):
            xd, xn, zx = be._front(cs, sc, B, 1, None, I, self.x, dm, norm_w, in_proj, NP, parts,
                                   fast, (di, CD, cw, conv_w, conv_b, unew, CD, g))
            L(cs, "mb_m2_step_cb_k", ((M2_Q + H * HP) // STEP_CB, B), STEP_CBT,
              H, di, CD, unew, zx + 4 * (di + CD), NP, dt_bias, A_log,
              _cuda_ssd._bits(lo), _cuda_ssd._bits(hi), g, self.ctl, bx, bd,
              self.dt, dA, self.cs, scal, desc, self.rep, h, G, Yo)
            L(cs, "mb_m2_step_y_k", (H, B, STEP_PS), M2_Q,
              desc, H, di, CD, scal, self.ctl, done, bx, bd, self.dt, dA, self.cs, D, zx, NP,
              G, Yo, h, seg, yg)
            be._back(cs, B, 1, dm, di, B, I["off"], yg, out_proj, xd, xn, self.y.ptr, parts, fast,
                     g, gnorm=(gnorm_w, I["r"]))
        self.exec = self.capture(body)

    def _reports(self):
        """h_last_: the open rows (rep) folded into h from the cache, as _m2_h_last."""
        be = self.be
        be._enter()
        s = be.stream()
        self._follow(s)
        out = be.empty(self.h.shape, like=self.h)
        be._launch(s.cu, "mb_m2_fold_k", (self.B, self.H), IFOLD_THREADS, self.rep, self.H,
                   self.di, self.CD, self.bx, self.dt, self.cs, self.h, out, 0)
        return out


class M3Session(_SsdSession):
    """Mamba-3 (_cuda_ssd._m3_forward at L = 1) in one kernel after in_proj
    (ssd_step.cu mb_m3_step_k, a block per head and row): it plans the step, computes
    its head's rows of the new token (B and C norms, prep, angle and rotation), folds
    a sealed chunk into h, gives the output row (carrying the seg columns and the
    cumsum between steps as Mamba-2's does) and places the new row in the working
    chunk. A step that consumes Input_States (the state's pending flag) runs a second
    graph whose step kernel adds them first; its x is checked before the launch, so
    that it is never refused."""
    SCALARS = ("buffered_tokens", "pending")
    KERNELS = ("mb_m3_step_k", "mb_m3_fold_k", "mb_m3_last_k")

    @staticmethod
    def advance(count, n):
        if n == 0:
            return count
        return ((count[0] % M3_Q + n - 1) % M3_Q + 1, False)

    def __init__(self, be, block, w, state, fast):
        super().__init__(be, block, state)
        B, dm, a = self.B, self.dm, self.alloc
        di, H, NP = _cuda_ssd.m3_dims(dm)
        self.H = H
        norm_w, in_proj, dt_bias, Bn_w, Cn_w, B_bias, C_bias, D, out_proj = w
        theta, h, bq, bk, bv, bdt, bsg, bad, pk, pv = (p.ptr for p in state.pieces())
        self.bufs = (bk, bv, bdt, bsg, bad)
        I = self.scratch()
        nparts = max(be._parts(B, NP, dm), be._parts(B, dm, di))
        parts = a(nparts) if nparts else 0
        yg, seg, done = a(B * di), a(B * H * (M3_Q + 1)), self.counters(1)
        self.rep, self.last_row = a(12 * B), a(2 * B)
        g, L = self.guard.ptr, be._launch

        def body(cs, sc, pending):
            xd, xn, zx = be._front(cs, sc, B, 1, None, I, self.x, dm, norm_w, in_proj, NP, parts,
                                   fast)
            L(cs, "mb_m3_step_k", (H, B), M3_Q + HP, H, di, NP, zx, Bn_w, Cn_w, dt_bias, B_bias,
              C_bias, D, int(fast), g, self.ctl, done, self.rep, self.last_row, theta,
              *((pk, pv) if pending else (0, 0)), bq, bk, bv, bdt, bsg, bad, h, seg, yg)
            be._back(cs, B, 1, dm, di, B, I["off"], yg, out_proj, xd, xn, self.y.ptr, parts, fast,
                     g)
        self._body, self.NP = body, NP
        self.exec = self._capture(False)
        self._pending_exec = None

    def _capture(self, pending):
        sc = self.front_arena(self.NP)
        return self.capture(lambda cs: self._body(cs, sc, pending))

    def _prepare(self, s, x, what):
        exe = super()._prepare(s, x, what)
        if not self._count()[1]:
            return exe
        # Input_States go into h before the step's fold: a refused step could not
        # take them back, so this step's x is checked first (a host x already was)
        if x.device != "cpu":
            chk.finite(x, what, "x")
        if self._pending_exec is None:
            self._pending_exec = self._capture(True)
        return self._pending_exec

    def _reports(self):
        """h_last_, k_last_, v_last_, theta_last_ of the working chunk (rep, last), as
        _m3_forward writes them."""
        be, st = self.be, self.state
        be._enter()
        s = be.stream()
        self._follow(s)
        B, H = self.B, self.H
        out = tuple(be.empty(p.shape, like=p) for p in (st.h, st.pending_k, st.pending_v, st.theta))
        bk, bv, bdt, bsg, bad = self.bufs
        L = be._launch
        L(s.cu, "mb_m3_fold_k", (B, H), IFOLD_THREADS,
          self.rep, H, bk, bv, bdt, bsg, bad, st.h, out[0], 0, 0, 0, 0, 0)
        L(s.cu, "mb_m3_last_k", (be._grid(B * H * (NS + HP)),), THREADS,
          B, H, self.last_row, bk, bv, out[1], out[2], 0)
        be._ck(be.cu.cuMemcpyDtoDAsync(out[3].ptr, st.theta.ptr, 4 * out[3].size, s.cu),
               "cuMemcpyDtoDAsync")
        return out
