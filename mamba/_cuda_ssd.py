"""Mamba-2 and Mamba-3 on the CUDA backend (kernels: backends/kernels/ssd*.cu).

Each row of a call is one extended sequence on the absolute chunk grid: the open
chunk's rows from the state buffers, then the new tokens. The host cuts it into
chunks (descriptors of ssd.cu), the device gathers it into "ext" arrays, computes
every chunk in parallel, runs the state pass serially over each row's chunks, and
stores the chunk left open back into the state buffers. The arithmetic is the C
reference's (reference/block2.c, block3.c) seam by seam; launch shapes cannot
change a bit. In fast mode the projections run on TF32 tensor cores and the norms
and the conv on the fast kernels; the output kernels and the chunk contractions take
the tensor cores (mb_fast_m2_y_k, mb_fast_m2_fold_k, mb_fast_m3_y_k, and for
Mamba-3's forward mb_fast_m3_state_k, its contractions and state pass in one walk
over each row's chunks; Mamba-3's two form new tokens' rotated q and k themselves
from the angles of mb_fast_m3_angles_k), the other chunk kernels are the identical
ones.

VALIDATED switches the two blocks on for this backend; with it False they are
offered only under MAMBA_CUDA_SSD=1 (for a port not yet run on its hardware).
"""
import array
import ctypes
import functools
import os
import struct

from . import _core

M2_Q, M3_Q, NS, HP, NA = 256, 64, 128, 64, 32
DESC = 6          # ssd.cu MB_DESC: b, e0, n, r0, tok, fold
FOLD_THREADS = 256
IFOLD_THREADS = 128  # ssd.cu SSD_IFOLD: mb_m2_fold_k and mb_m3_fold_k
TILE_THREADS = 64  # ssd.cu SSD_UT: mb_m2_g_k
OUT_THREADS = 128  # ssd.cu SSD_OUT: mb_m2_y_k and mb_m3_y_k
M2Y_THREADS = 256  # ssd2.cu: mb_fast_m2_y_k
M3Y_THREADS = 256  # ssd3.cu: mb_fast_m3_y_k, its dynamic shared memory M3Y_SMEM
M3Y_SMEM = 4 * (3 * 3 * 64 * 16 + 64 * 72)
M3YI_SMEM = 4 * (2 * 3 * 64 * 12 + 2 * 64 * 68 + 3 * 64)  # mb_m3_y_k's: a ring, M and v
M2YI_SMEM = 4 * (64 * 64 + 2 * 64 * 68 + 3 * 256)  # mb_m2_y_k's: G and x (or a ring), M
M3S_THREADS = 256  # ssd3.cu: mb_fast_m3_state_k (state2: half a state a block), two chunks
M3S = {1: "mb_fast_m3_state_k", 2: "mb_fast_m3_state2_k"}
M3S_SMEM = {qs: 4 * 2 * 64 * (64 // qs + 128) for qs in M3S}
# the kernels launched with more than the default 48 KiB of shared memory: their bound
SMEM = {"mb_fast_m3_y_k": M3Y_SMEM, "mb_m3_y_k": M3YI_SMEM, "mb_m2_y_k": M2YI_SMEM,
        **{M3S[qs]: M3S_SMEM[qs] for qs in M3S}}
M3R_ANG, M3R_RUNS = 8, 64  # ssd3.cu: mb_fast_m3_angles_k's angles a block, runs of tokens
ANGLE_THREADS = 256  # ssd3.cu M3_ANG_THREADS: mb_m3_angles_k's block (a row and head)
G_TILES = 10       # ssd2.cu G_TILES: the blocks of mb_m2_g_k per chunk
PREP_HEADS = 8     # ssd2.cu M2_PREP_HEADS: heads a block of mb_m2_prep_k (M2_Q threads)
MAX_GRID_Z = 65535
# floats of Mamba-3's chunk states (S, hck) live at once: rows in groups (twice that
# in fast mode, whose state kernel then takes W2's rows in one launch)
S_GROUP = 1 << 26
# identical mode folds the chunks and passes the states in one kernel
# (mb_m2_fold_chain_k, mb_m3_fold_chain_k) for launches of at least this many
# (row, head) chains: each chain then waits a hop (L2 round trips and fences) a
# chunk, which only enough chains side by side hide behind the folds. The smallest
# count measured to gain (H100, both blocks)
CHAIN_MIN = 64
VALIDATED = True  # the mamba2/mamba3 lanes passed on an H200 (docs/gpu-validation.md, run 9)


def m2_dims(d_model):
    """Mamba-2's inner width, heads and in_proj row width (z | xBC | dt)."""
    di = 2 * d_model
    H = di // HP
    return di, H, 2 * di + 2 * NS + H


def m3_dims(d_model):
    """Mamba-3's inner width, heads and in_proj row width (z | x | B | C | dd_dt |
    dd_A | trap | angles)."""
    di, H, _ = m2_dims(d_model)
    return di, H, 2 * di + 2 * NS + 3 * H + NA


def enabled():
    return VALIDATED or os.environ.get("MAMBA_CUDA_SSD") == "1"


def _release(sc, *ptrs):
    """Hand scratch of a call's _Scratch back to the pool before the call ends, in
    the call's stream order, so its later allocations can take the memory."""
    for p in ptrs:
        sc.ptrs.remove(p)
        sc.be._ck(sc.be.cu.cuMemFreeAsync(p, sc.s.cu), "cuMemFreeAsync")


class _Early:
    """A prefill's front queued ahead of the rest of its call (SsdMixin._early_front):
    the forward takes it, with its scratch; close() returns the scratch to the pool
    if no forward did (an error between the two)."""

    def __init__(self, sc, front):
        self.sc, self.front = sc, front

    def take(self):
        front, self.front = self.front, None
        return front

    def close(self):
        if self.front is not None:
            self.front = None
            self.sc.__exit__()


def _rot(rot):
    """The output kernels' last arguments that form new rows' q and k: Bn, Cn,
    B_bias, C_bias and TH, the angles (fast mode) or turns (identical) of the new
    tokens (all 0: q and k from Q and K's ext rows)."""
    return rot or (0,) * 5


def _bits(f):
    return struct.unpack("<I", struct.pack("<f", f))[0]


class _Plan:
    """Host bookkeeping of one call: packed token offsets, ext rows, chunks, and
    what goes back into the state buffers. m3: a chunk folds only once the next
    row exists (sealed), and the open chunk keeps 1..Q rows; Mamba-2 folds a full
    chunk at once and keeps 0..Q-1. Rows are also cut into groups of at most
    `group` chunks (a longer row alone): per group (b0, rows, c0, chunks, at), its
    own cbeg counted from its first chunk at entry `at` of the "gcbeg" table."""

    def __init__(self, B, L, lengths, t0, Q, m3, group=None):
        self.B, self.Q = B, Q
        off, eoff, cbeg, store, last, rep, desc, counts = [0], [0], [0], [], [], [], [], []
        store_c, last_c = [], []  # as store and last for arrays of the open chunks alone
        for b in range(B):
            off.append(off[-1] + (lengths[b] if lengths is not None else L))
        for b in range(B):
            T = t0 + off[b + 1] - off[b]
            for k in range((T - 1) // Q + 1):
                n = min(Q, T - k * Q)
                r0 = t0 if k == 0 else 0
                fold = T > (k + 1) * Q if m3 else n == Q
                desc += [b, eoff[b] + k * Q, n, r0, off[b] + k * Q + r0 - t0, int(fold)]
            cbeg.append(len(desc) // DESC)
            kl = (T - 1) // Q if m3 else T // Q
            r, base = T - kl * Q, eoff[b] + kl * Q
            store += [base, 0, r, 1] if kl > 0 else [base, t0, T, 0]
            store_c += [b * Q] + store[-3:]
            rep += [b, base, r, 0, 0, 0]
            last.append(eoff[b] + T - 1)
            last_c.append(b * Q + r - 1)
            counts.append(r)
            eoff.append(eoff[b] + T)
        self.M, self.E, self.NC = off[-1], eoff[-1], len(desc) // DESC
        if self.NC > MAX_GRID_Z:
            raise ValueError(f"mamba: a call of {self.NC} chunks exceeds the CUDA backend's "
                             f"{MAX_GRID_Z}; split the batch or the sequence")
        self.counts = counts
        self.groups, gcbeg, kord, b0 = [], [], [], 0
        while b0 < B:
            b1 = b0 + 1
            while b1 < B and (group is None or cbeg[b1 + 1] - cbeg[b0] <= group
                              or cbeg[b1] == cbeg[b0]):  # a group holds a chunk
                b1 += 1
            self.groups.append((b0, b1 - b0, cbeg[b0], cbeg[b1] - cbeg[b0], len(gcbeg)))
            gcbeg += [c - cbeg[b0] for c in cbeg[b0:b1 + 1]]
            # the group's chunks, the rows' first ones, then their second ones, ...
            spans = list(zip(gcbeg[-(b1 - b0 + 1):-1], gcbeg[-(b1 - b0):]))
            kord += [c0 + k for k in range(max(c1 - c0 for c0, c1 in spans))
                     for c0, c1 in spans if c0 + k < c1]
            b0 = b1
        self._tables, self._at = array.array("q"), []
        for name, part in (("off", off), ("t0", [t0] * B), ("zero", [0] * B), ("eoff", eoff),
                           ("cbeg", cbeg), ("store", store), ("last", last), ("rep", rep),
                           ("desc", desc), ("gcbeg", gcbeg), ("coff", range(0, B * Q, Q)),
                           ("store_c", store_c), ("last_c", last_c), ("kord", kord)):
            self._at.append((name, len(self._tables)))
            self._tables.extend(part)

    def upload(self, sc):
        """Device pointers of the int64 tables (one upload)."""
        base = sc.upload(self._tables.buffer_info()[0], 8 * len(self._tables))
        return {name: base + 8 * at for name, at in self._at}


@functools.lru_cache(maxsize=32)
def _cached_plan(B, L, lengths, t0, Q, m3, group):
    return _Plan(B, L, lengths, t0, Q, m3, group)


def _plan(B, L, lengths, t0, Q, m3, group=None):
    """The _Plan of a call, built once per shape: building it in Python costs about
    a millisecond at 512 chunks, time the device would sit idle. Plans are never
    modified after construction."""
    return _cached_plan(B, L, None if lengths is None else tuple(lengths), t0, Q, m3, group)


class SsdMixin:
    """CudaBackend methods of the Mamba-2 and Mamba-3 blocks."""

    def _ssd_fn(self, *names):
        """Look up the kernels (on first use) and return the _cuda module (imported
        here: _cuda imports this module)."""
        from . import _cuda
        self._kernels(*names)
        return _cuda

    def _m2_prep(self, s, NC, desc, H, DTR, dt_bias, A_log, limit, dt, dA, cs):
        """dt, dA and their cumsums of NC chunks (desc) of H heads from DTR."""
        if NC:
            self._launch(s, "mb_m2_prep_k", (NC, -(-H // PREP_HEADS)), M2_Q, desc, H, DTR,
                         dt_bias, A_log, _bits(limit[0]), _bits(limit[1]), dt, dA, cs)

    def _m3_angles(self, s, B, H, I, TA, DT, theta, park, turns, last):
        """Mamba-3's angle recurrence (identical), each token's angle r into slot r of
        its row of park (H * NS floats an ext row), or with turns its cos and sin into
        slots 2r, 2r + 1; last: theta_last's copy (0: none)."""
        self._launch(s, "mb_m3_angles_k", (B * H,), ANGLE_THREADS,
                     B, H, I["off"], I["eoff"], I["t0"], TA, DT, theta, park, turns, last)

    def _ssd_front(self, s, sc, x, lengths, plan, w, dm, fast, m3):
        """A Mamba-2 or Mamba-3 prefill's front: (I, parts, x, xn, blocks), I holding
        M, the norm's scratch and, where rows are packed (lengths), the plan's tables,
        which the front then reads (uploaded after it otherwise); parts: the
        projections' leaf scratch; blocks: in_proj's output as _front_cols gives it
        (Mamba-3: z, x and the rest; Mamba-2: one block)."""
        B, L = x.shape[0], x.shape[1]
        di, _, NP = (m3_dims if m3 else m2_dims)(dm)
        M = B * L if lengths is None else plan.M
        I = {} if lengths is None else plan.upload(sc)
        I["M"], I["r"] = M, sc(M)
        nparts = max(self._parts(M, NP, dm), self._parts(M, dm, di))
        parts = sc(nparts) if nparts else 0
        widths = (di, di, NP - 2 * di) if m3 else (NP,)
        return (I, parts, *self._front_cols(s, sc, B, L, lengths, I, x, dm, w[0], w[1], widths,
                                            parts, fast))

    def _early_front(self, kind, w, dm, x, fast):
        """A stateless prefill's front queued now (blocks._Block._early): the forward
        given it (early=) goes on from there."""
        self._enter()
        return _Early(*self._begin(self.stream(), x, None, None, w, dm, fast, kind == "m3"))

    def _begin(self, st, x, lengths, plan, w, dm, fast, m3, early=None):
        """(scratch, front) of a prefill: early's, or a new scratch and front (the
        scratch back in the pool if the front fails)."""
        if early is not None:
            return early.sc, early.take()
        sc = self._ssd_fn()._Scratch(self, st)
        try:
            return sc, self._ssd_front(st.cu, sc, x, lengths, plan, w, dm, fast, m3)
        except BaseException:
            sc.__exit__()
            raise

    def _rows_grid(self, n, B):
        return (self._grid(n), min(B, 65535))

    def _front(self, s, sc, B, L, lengths, I, x, dm, norm_w, in_proj, NP, parts, fast,
               conv=None, keep=False, copy=False):
        """Pack, block RMSNorm and in_proj: (x, xn, zx) device pointers, M rows; conv:
        a one-token call's conv step on zx's columns (gemm's). xn holds the normed
        rows only when kept (keep), else it is M * dm floats of scratch; copy: x is
        copied into scratch even when on the device."""
        xd, xn, (zx,) = self._front_cols(s, sc, B, L, lengths, I, x, dm, norm_w, in_proj, (NP,),
                                         parts, fast, conv, keep, copy)
        return xd, xn, zx

    def _front_cols(self, s, sc, B, L, lengths, I, x, dm, norm_w, in_proj, widths, parts, fast,
                    conv=None, keep=False, copy=False):
        """_front with in_proj's output columns cut into blocks of the given widths,
        each an array of its own (M rows of that width) that can be freed apart:
        (x, xn, [blocks]). Each output is the same dot product either way. conv goes
        with the first block. The second block's GEMM runs beside the others (on
        side_stream), so no GEMM ends on a part-empty wave of its own."""
        C = self._ssd_fn()
        M = I["M"]
        xs = self._on_device(sc, x, copy=copy)
        xd = xs
        if lengths is not None:
            xs = sc(M * dm)
            self._launch(s, "mb_pack_rows_k", (self._grid(B * L * dm),), C.THREADS,
                         B, L, dm, I["off"], xd, xs)
        xn = sc(M * dm)
        if len(widths) == 1:  # the norm may then run in in_proj's GEMV
            blocks = [sc(M * widths[0])]
            self._norm_gemm(s, fast, M, dm, xs, norm_w, xn, I["r"], widths[0], in_proj, blocks[0],
                            parts, conv, keep)
            return xd, xn, blocks
        self._rmsnorm(s, fast, M, dm, xs, norm_w, xn, I["r"])
        blocks, col = [sc(M * n) for n in widths], 0
        side = self.side_stream(s, M, dm)
        try:
            for k, n in enumerate(widths):
                self.gemm(side if k == 1 and side else s, M, n, dm, xn, dm,
                          C._ptr(in_proj) + 4 * col * dm, dm, blocks[k], n, parts, fast,
                          conv=None if col else conv)
                col += n
        finally:  # s's later work (and frees) come after the side's GEMM
            if side:
                self._wait(s, side)
        return xd, xn, blocks

    # ---------------------------------------------------------------- Mamba-2
    def _m2_forward(self, w, d_model, dt_limit, x, pieces, buffered_tokens, y, lengths,
                    fast=False, early=None):
        tc = fast and self.tensor_cores  # fast mode's chunk kernels (ssd2.cu)
        dm, B, L = d_model, x.shape[0], x.shape[1]
        di, H, NP = m2_dims(dm)
        fused = not tc and B * H >= CHAIN_MIN
        y_k, fold_k = self.kname("m2_y_k", tc), self.kname("m2_fold_k", tc)
        C = self._ssd_fn("mb_ssd_load_k", "mb_ssd_store_k", "mb_ssd_put_k", "mb_m2_prep_k",
                     "mb_m2_g_k", y_k, *(("mb_m2_fold_chain_k",) if fused else
                                         (fold_k, "mb_ssd_chain_k")))
        self._enter()
        st = self.stream()
        s = st.cu
        CD = di + 2 * NS
        norm_w, in_proj, conv_w, conv_b, dt_bias, A_log, D, gnorm_w, out_proj = w
        plan = _plan(B, L, lengths, buffered_tokens, M2_Q, False)
        M, E, NC, per = plan.M, plan.E, plan.NC, HP * NS
        back = []
        sc, (I, parts, xd, xn, (zx,)) = self._begin(st, x, lengths, plan, w, dm, fast, False,
                                                    early)
        with sc:
            if lengths is None:
                I.update(plan.upload(sc))
            cw, h, bx, bd = (self._on_device(sc, p, back) for p in pieces)
            yd = self._out(sc, y, back)
            _release(sc, xn)  # out_proj takes its scratch once the chunk buffers are gone
            # conv + silu over xBC, then the ext rows: buffered ones, then new ones
            # (with none buffered, the conv's packed rows are the ext rows already)
            direct = buffered_tokens == 0
            U, DTR = sc(E * CD), sc(E * H)
            unew = U if direct else sc(M * CD)
            xbc = zx + 4 * di
            self._launch(s, self.kname("conv_silu_k", fast),
                         self._rows_grid(C._cdiv(L, C.CONV_RUN) * CD, B), C.THREADS,
                         B, I["off"], CD, xbc, NP, cw, conv_w, conv_b, unew, CD)
            self._launch(s, "mb_conv_window_k", (self._grid(B * CD),), C.THREADS,
                         B, I["off"], CD, xbc, NP, cw)
            for buf, ext, W, src, lds in ((bx, U, CD, unew, CD), (bd, DTR, H, xbc + 4 * CD, NP)):
                if ext == src:
                    continue
                if not direct:  # none buffered: none to load
                    self._launch(s, "mb_ssd_load_k", self._rows_grid(M2_Q * W, B), C.THREADS,
                                 B, I["eoff"], I["t0"], M2_Q, W, buf, ext)
                self._launch(s, "mb_ssd_put_k", self._rows_grid(L * W, B), C.THREADS,
                             B, I["off"], I["eoff"], I["t0"], W, src, lds, ext)
            # the chunks: dt and cumsums, G, each chunk's contraction, the state pass,
            # the outputs
            dt, dA, cs = sc(NC * H * M2_Q), sc(NC * H * M2_Q), sc(NC * H * M2_Q)
            self._m2_prep(s, NC, I["desc"], H, DTR, dt_bias, A_log, dt_limit, dt, dA, cs)
            G = sc(NC * M2_Q * M2_Q)
            self._launch(s, "mb_m2_g_k", (G_TILES, NC), TILE_THREADS, I["desc"], di, CD, U, G)
            # Ec: exp(cs_last) a (chunk, head) for the state pass, or the fused
            # kernel's ticket and flags
            S, Ec = sc(NC * H * per), sc(NC * H + 1)
            hck = S  # each contraction overwritten with the state entering its chunk
            if fused:
                self._fill32(s, Ec, 0, NC * H + 1)
                self._launch(s, "mb_m2_fold_chain_k", (NC * H,), IFOLD_THREADS, I["desc"], H,
                             di, CD, U, dt, cs, NC, 0, I["cbeg"], I["kord"], Ec, h, hck)
            else:
                self._launch(s, fold_k, (NC, H), FOLD_THREADS if tc else IFOLD_THREADS,
                             I["desc"], H, di, CD, U, dt, cs, 0, S, Ec)
                self._launch(s, "mb_ssd_chain_k", (self._grid(B * H * per),), C.THREADS,
                             B, H, I["cbeg"], I["desc"], Ec, S, h, hck)
            yg = sc(M * di)  # the outputs gated, Y * silu(z), as the kernel writes them
            self._launch(s, y_k, (H, NC, M2_Q // 64 if tc else 1),  # tc: a block a 64-row tile
                         M2Y_THREADS if tc else OUT_THREADS, I["desc"], H, di, CD, U, G, dt, dA,
                         cs, hck, D, zx, NP, 0, yg, smem=0 if tc else M2YI_SMEM)
            for buf, ext, W in ((bx, U, CD), (bd, DTR, H)):
                self._launch(s, "mb_ssd_store_k", self._rows_grid(M2_Q * W, B), C.THREADS,
                             B, I["store"], M2_Q, W, ext, buf)
            # the gated norm, out_proj, residual
            _release(sc, zx, U, DTR, dt, dA, cs, G, S, Ec, *(() if direct else (unew,)))
            self._back(s, B, L, dm, di, M, I["off"], yg, out_proj, xd, sc(M * dm), yd, parts,
                       fast, gnorm=(gnorm_w, I["r"]))
            self._finish(st, back)
        return tuple(plan.counts)

    def _m2_report_inputs(self, w, dt_limit, pieces, counts):
        """What the h_last report reads, copied in stream order on the device (h and
        the open rows of the two chunk buffers), or on the host for a host state. The
        weights' device copies are never edited: refresh_weights replaces them."""
        h, bx, bd = pieces[1:4]
        if h.device != self.name:
            return (w[4], w[5], dt_limit, _core.copy(h), _core.copy_leading_rows(bx, counts),
                    _core.copy_leading_rows(bd, counts), counts, None)
        self._enter()
        s = self.stream()
        hc = self.empty(h.shape, like=h)
        self.copy_into(hc, h)
        n = max(max(counts), 1)  # an empty chunk still reads nothing past row 0
        open_rows = [self.gather(s, a, (a.shape[0], n, a.shape[2]),
                                 (a.shape[1] * a.shape[2], a.shape[2], 1)) for a in (bx, bd)]
        return (w[4], w[5], dt_limit, hc, *open_rows, counts, s.number)

    def _m2_h_last(self, d_model, inputs):
        """The open rows folded into h as if the chunk closed; on the device when the
        state was, else on the host."""
        C = self._ssd_fn("mb_m2_prep_k", "mb_m2_fold_k")
        dt_bias, A_log, (lo, hi), h, bx, bd, counts, producer = inputs
        self._enter()
        st = self.stream()
        s = st.cu
        on_device = producer is not None
        if not on_device:
            h, bx, bd = self.copy(h), self.copy(bx), self.copy(bd)
        elif producer != st.number:
            self._wait(s, self._stream_of(producer))
        B, di = h.shape[0], 2 * d_model
        H, CD = di // HP, di + 2 * NS
        out = self.empty(h.shape, like=h) if on_device else _core.empty(h.shape)
        desc = []
        for b in range(B):
            desc += [b, b * bx.shape[1], counts[b], 0, 0, 0]
        with C._Scratch(self, st) as sc:
            host = (ctypes.c_int64 * len(desc))(*desc)
            dp = sc.upload(ctypes.addressof(host), 8 * len(desc))
            dt, dA, cs = sc(B * H * M2_Q), sc(B * H * M2_Q), sc(B * H * M2_Q)
            self._m2_prep(s, B, dp, H, bd, dt_bias, A_log, (lo, hi), dt, dA, cs)
            od = out.ptr if on_device else sc(out.size)
            self._launch(s, "mb_m2_fold_k", (B, H), IFOLD_THREADS, dp, H, di, CD, bx, dt, cs, h,
                         od, 0)
            self._finish(st, [] if on_device else [(out, od)])
        if on_device and producer != st.number:  # the copies are freed in the producer's order
            self._wait(self._stream_of(producer), s)
        return out

    # ---------------------------------------------------------------- Mamba-3
    def _m3_bc_norms(self, s, sc, B, L, I, zx, di, NP, Bn_w, Cn_w, fast):
        """B and C RMSNorm over N, read in place from in_proj's rows zx: the (Bn, Cn)
        device pointers, M rows each."""
        M = I["M"]
        Bn, Cn = sc(M * NS), sc(M * NS)
        for col, wn, out in ((2 * di, Bn_w, Bn), (2 * di + NS, Cn_w, Cn)):
            self._rmsnorm(s, fast, M, NS, zx + 4 * col, wn, out, I["r"], NP)
        return Bn, Cn

    def _m3_forward(self, w, d_model, x, pieces, buffered_tokens, pending, y, reports, lengths,
                    fast=False, early=None):
        tc = fast and self.tensor_cores  # fast mode's chunk kernels (ssd3.cu)
        C = self._ssd_fn("mb_ssd_load_k", "mb_ssd_store_k", "mb_ssd_put_k",
                     "mb_m3_prep_k", "mb_m3_angles_k", "mb_m3_rotate_k", "mb_m3_pending_k",
                     "mb_m3_fold_k", "mb_m3_last_k", *self.m3_chunk_kernels(tc),
                     *(("mb_fast_m3_angles_k", *M3S.values()) if tc else
                       ("mb_ssd_chain_k", "mb_m3_fold_chain_k")))
        self._enter()
        st = self.stream()
        s = st.cu
        dm, B, L = d_model, x.shape[0], x.shape[1]
        di, H, NP = m3_dims(dm)
        NR = NP - 2 * di
        norm_w, in_proj, dt_bias, Bn_w, Cn_w, B_bias, C_bias, D, out_proj = w
        per = HP * NS
        plan = _plan(B, L, lengths, buffered_tokens, M3_Q, True,
                     S_GROUP * (2 if tc else 1) // (H * per))
        M, E, NC = plan.M, plan.E, plan.NC
        back = []
        # in_proj as z (gated in place into the outputs by mb_m3_y_k), x (the ext v rows
        # themselves when none are buffered) and the rest from B on (read as rows of
        # width NR whose B sits at 2 * di = 0)
        sc, (I, parts, xd, xn, (z, xv, R)) = self._begin(st, x, lengths, plan, w, dm, fast, True,
                                                         early)
        with sc:
            if lengths is None:
                I.update(plan.upload(sc))
            p = [self._on_device(sc, a, back) for a in pieces]
            theta, h, bq, bk, bv, bdt, bsig, badt, pk, pv = p
            rep = [self._out(sc, a, back) for a in reports]
            yd = self._out(sc, y, back)
            _release(sc, xn)  # out_proj takes its scratch once the chunk buffers are gone
            Bn, Cn = self._m3_bc_norms(s, sc, B, L, I, R, 0, NR, Bn_w, Cn_w, fast)
            # ext rows: the working chunk's from the state, then the new tokens'
            direct = buffered_tokens == 0
            # (Q and K hold each row's last chunk alone, as the state does: the chunks
            # take the state's rows and form the new ones)
            ext_at = (I["eoff"], I["store"])  # the tables that load and store a buffer
            qk_at = (I["coff"], I["store_c"])
            Q, K, V = sc(B * M3_Q * H * NS), sc(B * M3_Q * H * NS), xv if direct else sc(E * di)
            DT, SIG, ADT, QKG, TA = sc(E * H), sc(E * H), sc(E * H), sc(E * H), sc(M * NA)
            bufs = ((bq, Q, H * NS, qk_at), (bk, K, H * NS, qk_at), (bv, V, di, ext_at),
                    (bdt, DT, H, ext_at), (bsig, SIG, H, ext_at), (badt, ADT, H, ext_at))
            for buf, ext, W, (at, _) in bufs if not direct else ():  # none buffered: none to load
                self._launch(s, "mb_ssd_load_k", self._rows_grid(M3_Q * W, B), C.THREADS,
                             B, at, I["t0"], M3_Q, W, buf, ext)
            self.m3_prep(s, sc, B, L, I, H, 0, NR, R, dt_bias, Bn, Cn, B_bias, C_bias,
                         DT, SIG, ADT, QKG, TA)
            if not direct:
                self._launch(s, "mb_ssd_put_k", self._rows_grid(L * di, B), C.THREADS,
                             B, I["off"], I["eoff"], I["t0"], di, xv, di, V)
                _release(sc, xv)
            # new tokens' q and k are formed where used (ssd3.cu) from their angles
            # (fast mode) or turns (identical), TH; the last chunks' are formed here
            if tc:
                TH = sc(M * H * NA)
                self._launch(s, "mb_fast_m3_angles_k", (B * H * (NA // M3R_ANG),),
                             M3R_ANG * M3R_RUNS, B, H, I["off"], I["eoff"], I["t0"], TA, DT,
                             theta, TH, Bn, Cn, B_bias, C_bias, Q, K, rep[3])
            else:
                TH = sc(E * H * 2 * NA)  # ssd3.cu M3_TURNS a (ext row, head)
                self._m3_angles(s, B, H, I, TA, DT, theta, TH, 1, rep[3])
                self._launch(s, "mb_m3_rotate_k", self._rows_grid(M3_Q * H * NA, B), C.THREADS,
                             B, H, I["off"], I["eoff"], I["t0"], Bn, Cn, B_bias, C_bias, TH,
                             Q, K)
            rot = (Bn, Cn, B_bias, C_bias, TH)
            _release(sc, R, TA)
            if pending:
                self._launch(s, "mb_m3_pending_k", (self._grid(B * H * per),), C.THREADS,
                             B, H, I["eoff"], DT, SIG, pk, pv, h)
                for a, n in ((pk, B * H * NS), (pv, B * H * HP)):
                    self._fill32(s, a, 0, n)
            # the chunks, a group of rows at a time (their states S, which the state
            # pass overwrites with the state entering each chunk, as for Mamba-2):
            # sealed ones' contractions, the state pass (fast mode: both in one
            # kernel walking each row's chunks), the outputs
            # (Ec as Mamba-2's)
            ncg = max(g[3] for g in plan.groups)
            S, Ec = sc(ncg * H * per), 0 if tc else sc(ncg * H + 1)
            for b0, nb, c0, nc, at in plan.groups:
                dsc, cb, hb = I["desc"] + 8 * DESC * c0, I["gcbeg"] + 8 * at, h + 4 * b0 * H * per
                if tc:
                    split = self.m3_state_parts(nb * H)
                    self._launch(s, M3S[split], (nb * H * split,), M3S_THREADS, H, cb, dsc,
                                 bk, V, DT, SIG, ADT, Bn, B_bias, TH, hb, S,
                                 smem=M3S_SMEM[split])
                elif nb * H >= CHAIN_MIN:
                    self._fill32(s, Ec, 0, nc * H + 1)
                    self._launch(s, "mb_m3_fold_chain_k", (nc * H,), IFOLD_THREADS, dsc, H, bk,
                                 V, DT, SIG, ADT, I["coff"], Bn, B_bias, TH, nc, b0, cb,
                                 I["kord"] + 8 * c0, Ec, hb, S)
                else:
                    self.m3_fold(s, tc, nc, H, dsc, bk, V, DT, SIG, ADT, S, Ec, rot, I["coff"])
                    self._launch(s, "mb_ssd_chain_k", (self._grid(nb * H * per),), C.THREADS,
                                 nb, H, cb, dsc, Ec, S, hb, S)
                self.m3_y(s, tc, nc, H, dsc, di, di, bq, bk, V, DT, SIG, ADT, QKG, S, D, z, z,
                          rot)
            # reports of each row's last token, then the working chunk into the state
            self._launch(s, "mb_m3_fold_k", (B, H), IFOLD_THREADS,
                         I["rep"], H, K, V, DT, SIG, ADT, h, rep[0], 0, I["coff"], 0, 0, 0)
            self._launch(s, "mb_m3_last_k", (self._grid(B * H * (NS + HP)),), C.THREADS,
                         B, H, I["last"], K, V, rep[1], rep[2], I["last_c"])
            for buf, ext, W, (_, at) in bufs:
                self._launch(s, "mb_ssd_store_k", self._rows_grid(M3_Q * W, B), C.THREADS,
                             B, at, M3_Q, W, ext, buf)
            _release(sc, Q, K, V, DT, SIG, ADT, QKG, S, Bn, Cn, TH, *(() if tc else (Ec,)))
            self._back(s, B, L, dm, di, M, I["off"], z, out_proj, xd, sc(M * dm), yd, parts,
                       fast)
            self._finish(st, back)
        return buffered_tokens if lengths is not None else plan.counts[0]

    def m3_prep(self, s, sc, B, L, I, H, di, NP, zx, dt_bias, Bn, Cn, B_bias, C_bias, DT, SIG,
                ADT, QKG, TA):
        """mb_m3_prep_k over the new tokens of rows NP floats wide, its biases first
        turned head-minor."""
        C, bt = self._ssd_fn("mb_m3_prep_k"), sc(2 * NS * H)
        for i, bias in enumerate((B_bias, C_bias)):
            self.g_transpose(s, H, NS, bias, NS, bt + 4 * i * NS * H, H)
        self._launch(s, "mb_m3_prep_k", self._rows_grid(L * (H + NA), B), C.THREADS,
                     B, I["off"], I["eoff"], I["t0"], H, di, NP, zx, dt_bias, Bn, Cn,
                     bt, bt + 4 * NS * H, DT, SIG, ADT, QKG, TA)
        _release(sc, bt)

    def m3_state_parts(self, rows):
        """The state kernel's blocks a (row, head): two (each half the state's rows p)
        where rows alone would leave multiprocessors idle. Both give the same bits."""
        return 1 if rows >= self.sms else 2

    @classmethod
    def m3_chunk_kernels(cls, tc):
        """The chunk contraction and output kernels of m3_fold and m3_y."""
        return cls.kname("m3_fold_k", tc), cls.kname("m3_y_k", tc)

    def m3_fold(self, s, tc, nc, H, desc, K, V, DT, SIG, ADT, S, E, rot=(), krow=0):
        """The sealed chunks' contractions S and exp(cs_last) E, of nc chunks from desc;
        tc: fast mode's tensor-core kernel; rot (identical) as m3_y's, its new rows'
        k formed from Bn and B_bias by the turns TH, the others K's row krow[b] on
        (0: K's ext rows)."""
        form = (rot[0], rot[2], rot[4]) if rot else (0, 0, 0)
        self._launch(s, self.kname("m3_fold_k", tc), (nc, H), FOLD_THREADS if tc else IFOLD_THREADS,
                     desc, H, K, V, DT, SIG, ADT, 0, S, E, *(() if tc else (krow, *form)))

    def m3_y(self, s, tc, nc, H, desc, di, dip, Q, K, V, DT, SIG, ADT, QKG, hck, D, zx, yg,
             rot=()):
        """The gated outputs yg of nc chunks from desc (z from zx, rows dip apart); tc:
        fast mode's tensor-core kernel; rot (Bn, Cn, B_bias, C_bias, TH) when new
        tokens' q and k are formed there, the other rows Q's and K's as the state's
        buffers (ssd3.cu)."""
        self._launch(s, self.kname("m3_y_k", tc), (H, nc), M3Y_THREADS if tc else OUT_THREADS,
                     desc, H, di, dip, Q, K, V, DT, SIG, ADT, QKG, hck, D, zx, yg,
                     *_rot(rot), smem=M3Y_SMEM if tc else M3YI_SMEM)

    # ---------------------------------------------------------------- sessions
    def _m2_session(self, block, w, state, fast=False):
        from . import _cuda_session  # it imports this module
        return _cuda_session.M2Session(self, block, w, state, fast)

    def _m3_session(self, block, w, state, fast=False):
        from . import _cuda_session
        return _cuda_session.M3Session(self, block, w, state, fast)


if enabled():
    SsdMixin.m2_forward = SsdMixin._m2_forward
    SsdMixin.m2_report_inputs = SsdMixin._m2_report_inputs
    SsdMixin.m2_h_last = SsdMixin._m2_h_last
    SsdMixin.m2_session = SsdMixin._m2_session
    SsdMixin.m3_forward = SsdMixin._m3_forward
    SsdMixin.m3_session = SsdMixin._m3_session
