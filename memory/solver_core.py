"""Compiled inner loops of the exact solver: the incremental/decremental path, the bordered inverse, the polish.

These are the operations whose cost is per bookkeeping event (design note 4.3): every step of a sweep touches
the kernel rows of the margin set, O(n |S| + |S|^2). In interpreted numpy each step also paid ~30 array calls
and gathered K[S, :n] into a temporary; compiled, the rows are read in place. ``SVMemory`` keeps the control
decisions that are once per operation (feasibility, atoms, duplicates, repair) and calls these with its
buffers, which they update in place.

The state they work on is ``memory.solver_state.SolverBuffers`` (the arrays, updated in place; a sweep whose
margin set outgrows its buffers returns new ones) and ``SolverSettings`` (the solver's constants).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
from numba import njit

from .kkt import BOUND, BOUNDARY_SNAP, MARGIN, RESERVE
from .solver_state import GUARD, MARGIN_SIZE, UPDATES_SINCE_REFACTOR, SolverBuffers

if TYPE_CHECKING:
    from .solver_state import SolverSettings

DETACHED = 3  # the atom whose coefficient is being swept; outside S, E and R during a sweep

# the safeguard counters this module increments (numba reads these globals as constants)
_REFUSED, _SMALL_PIVOT, _SCHEDULED = GUARD["refused_dependent"], GUARD["small_pivot"], GUARD["scheduled_refactor"]
_LARGE, _PINV, _ITER_CAP = GUARD["large_inverse"], GUARD["pinv"], GUARD["iteration_cap"]
_UNCONVERGED = GUARD["unconverged_refinement"]
_REFINE_STEPS = 6
_REFINE_TOL = 1e-12  # residual of the bordered system above which the inverse is rebuilt
_RESIDUAL_ROUNDING = 1e-15  # a bordered-system residual this small is not worth a correction

# The maintained g of atoms outside the margin set is tracked with single-precision rates and carries a bound
# on its error (``g_err``), from operation to operation: a sweep adds _G_SLACK (rounding of an fp64 g, and of
# recomputing one) to the bound it starts from, and every g is recomputed from the coefficients once the bound
# passes _G_RESYNC, so that few atoms ever need an exact re-evaluation.
_G_SLACK = 1e-13
_BETA_CARRY = 8  # steps a sweep's beta may be carried from event to event before it is solved afresh
_G_RESYNC = 1e-4
# At the end of an operation, atoms whose maintained g is within its error bound of the wrong side of 0 are
# re-evaluated one by one (a kernel row each); more than this many, and every g is recomputed instead.
_NEAR_EXACT = 16
_F32_UNIT = 2.0 ** -24  # |fl32(x) - x| <= _F32_UNIT |x|

# Outcomes of a sweep.
SWEPT_TO_TARGET, SWEPT_TO_MARGIN, SWEPT_NO_EVENT, SWEPT_ITERATION_CAP = range(4)


@njit(cache=True)
def gather_margin_kernel(K: np.ndarray, S: np.ndarray, m: int, KSS: np.ndarray) -> None:
    """KSS[:m, :m] = K[S, S] (after the margin set was set from outside, e.g. on load)."""
    for a in range(m):
        row = K[S[a]]
        for b in range(m):
            KSS[a, b] = row[S[b]]


@njit(cache=True)
def gather_margin_rows32(K: np.ndarray, S: np.ndarray, m: int, n: int, KS32: np.ndarray) -> None:
    """KS32[a, :n] = K[S[a], :n] in single precision (after the margin set was set from outside)."""
    for a in range(m):
        _copy_row32(K, S[a], n, KS32, a)


@njit(cache=True)
def squared_distances_to(x: np.ndarray, X: np.ndarray, n: int, out: np.ndarray) -> None:
    """out[i] = ||x - X[i]||^2 for i < n, by explicit differences summed in order (bit for bit what
    ``kernels.squared_distances`` gives, without its ~5 us of array wrapping per new token)."""
    d = x.shape[0]
    for i in range(n):
        row = X[i]
        acc = 0.0
        for k in range(d):
            t = row[k] - x[k]
            acc += t * t
        out[i] = acc


@njit(cache=True)
def place_atom(K: np.ndarray, KS32: np.ndarray, S: np.ndarray, m: int, alpha: np.ndarray, g: np.ndarray,
               status: np.ndarray, slot: int, n: int, krow: np.ndarray, diag: float) -> None:
    """A new atom in ``slot`` with kernel values ``krow`` against slots 0..n-1: its kernel row and column, its
    column of the single-precision rows of the m margin atoms (``S``), and a zero coefficient in the reserve set.
    (The buffers are passed one by one: unboxing the whole ``SolverBuffers`` costs ~1.5 us a call.)"""
    for i in range(n):
        K[slot, i] = krow[i]
        K[i, slot] = krow[i]
    K[slot, slot] = diag
    for a in range(m):
        KS32[a, slot] = krow[S[a]]
    alpha[slot] = 0.0
    g[slot] = 0.0
    status[slot] = RESERVE


@njit(cache=True)
def decision_value_of(K: np.ndarray, alpha: np.ndarray, slot: int, n: int, rho: float, diag: float) -> float:
    """g of the atom in ``slot`` from the coefficients: rho - k_ii + 2 sum_j a_j K_ij over the nonzero a_j (a
    dot product of the gathered pairs: the same BLAS call, so the same bits, as numpy's)."""
    count = 0
    for k in range(n):
        if alpha[k] != 0.0:
            count += 1
    krow, coef = np.empty(count), np.empty(count)
    j = 0
    for k in range(n):
        if alpha[k] != 0.0:
            krow[j] = K[slot, k]
            coef[j] = alpha[k]
            j += 1
    return rho - diag + 2.0 * np.dot(krow, coef)


@njit(cache=True)
def reserve_with_largest_g(status: np.ndarray, g: np.ndarray, n: int) -> int:
    """The reserve slot with the largest g (the first of equals), -1 when there is none."""
    best, best_g = -1, -math.inf
    for i in range(n):
        if status[i] == RESERVE and (best < 0 or g[i] > best_g):
            best, best_g = i, g[i]
    return best


@njit(cache=True)
def _copy_row32(K, j, n, KS32, a):
    row = K[j]
    out = KS32[a]
    for i in range(n):
        out[i] = row[i]


@njit(cache=True)
def refactor(buf: SolverBuffers) -> None:
    """Recompute K_SS and the bordered inverse from K (pseudo-inverse when it is numerically singular)."""
    K, S, KSS, ints, R, guards = buf.K, buf.S, buf.KSS, buf.ints, buf.R, buf.guards
    m = ints[MARGIN_SIZE]
    ints[UPDATES_SINCE_REFACTOR] = 0
    if m == 0:
        return
    gather_margin_kernel(K, S, m, KSS)
    M = np.empty((m + 1, m + 1))
    M[0, 0] = 0.0
    for a in range(m):
        M[0, a + 1] = 1.0
        M[a + 1, 0] = 1.0
        for b in range(m):
            M[a + 1, b + 1] = 2.0 * KSS[a, b]
    try:
        Minv = np.linalg.inv(M)
    except Exception:  # noqa: BLE001 -- numba raises LinAlgError as a plain exception
        guards[_PINV] += 1
        Minv = np.linalg.pinv(M)
    for a in range(m + 1):
        for b in range(m + 1):
            R[a, b] = 0.5 * (Minv[a, b] + Minv[b, a])


@njit(cache=True)
def _after_update(buf, cfg, r_max):
    """Count a rank-one update; refactor on schedule or when the update (largest entry: ``r_max``) blew up."""
    buf.ints[UPDATES_SINCE_REFACTOR] += 1
    if buf.ints[UPDATES_SINCE_REFACTOR] >= cfg.refactor_every:
        buf.guards[_SCHEDULED] += 1
        refactor(buf)
    elif r_max > cfg.r_cap:
        buf.guards[_LARGE] += 1
        refactor(buf)


@njit(cache=True)
def _matvec(R, size, v):
    """R[:size, :size] @ v for the (symmetric) bordered inverse, as a sum of R's rows: the inner loop is then
    an axpy that vectorises, where a dot product per row is a serial chain of dependent additions."""
    out = np.zeros(size)
    for b in range(size):
        w = v[b]
        row = R[b]
        for a in range(size):
            out[a] += w * row[a]
    return out


@njit(cache=True)
def _border_solve(K, S, m, R, c):
    """beta = -R [1; 2 K_Sc]: the rates of (rho, a_S) per unit change of a_c."""
    v = np.empty(m + 1)
    v[0] = 1.0
    row = K[c]  # = column c: one row read instead of a strided column
    for a in range(m):
        v[a + 1] = 2.0 * row[S[a]]
    beta = -_matvec(R, m + 1, v)
    return v, beta


@njit(cache=True)
def _rank_one_update(R, size, u, scale):
    """R[:size, :size] += scale * u u^T, bitwise symmetric (each product u_a u_b is formed before scaling, and
    u_a u_b == u_b u_a in IEEE arithmetic); returns the update's largest |entry|, max |u|^2 |scale|.

    Entries of the inverse can only blow up through a large update (a small pivot), so its size is the
    blow-up test: tracking the entries' own maximum would put a reduction in the inner loop, which then no
    longer vectorises (it was half of the update's cost).
    """
    u_max = 0.0
    for a in range(size):
        row = R[a]
        ua = u[a]
        u_max = max(u_max, abs(ua))
        for b in range(size):
            row[b] += (ua * u[b]) * scale
    return u_max * u_max * abs(scale)


@njit(cache=True)
def grow(buf: SolverBuffers, cfg: SolverSettings, n: int, j: int) -> tuple:
    """Append atom j to the margin set by a rank-one growth of the bordered inverse.

    Returns (grown, beta_j, pivot): beta_j = -R [1; 2 K_Sj] (the rates of rho and a_S per unit a_j over the
    old margin set; empty when it was empty) and the Schur pivot, the rate of g_j per unit a_j. ``grown`` is
    False, with nothing changed, when the pivot fails the relative test: j's kernel column is then numerically
    dependent on the margin set's.
    """
    K, S, KSS, KS32, ints, R = buf.K, buf.S, buf.KSS, buf.KS32, buf.ints, buf.R
    m = ints[MARGIN_SIZE]
    if m == 0:
        S[0] = j
        KSS[0, 0] = K[j, j]
        _copy_row32(K, j, n, KS32, 0)
        ints[MARGIN_SIZE] = 1
        R[0, 0] = -2.0 * K[j, j]
        R[0, 1] = 1.0
        R[1, 0] = 1.0
        R[1, 1] = 0.0
        return True, np.zeros(0), 0.0
    v, beta = _border_solve(K, S, m, R, j)
    vb = v @ beta
    pivot = 2.0 * K[j, j] + vb
    if abs(pivot) <= cfg.rel_pivot * (abs(2.0 * K[j, j]) + abs(vb)) or abs(pivot) <= 1e-12:
        buf.guards[_REFUSED] += 1
        return False, beta, pivot
    # Updated as a bitwise-symmetric matrix: entry (a, b) adds (beta_a beta_b) / pivot, the product formed
    # before the scaling, so (a, b) and (b, a) round identically. The solver multiplies by R's rows as if they
    # were its columns (``_matvec``); row by row the update is a contiguous, vectorised pass.
    inv = 1.0 / pivot
    r_max = _rank_one_update(R, m + 1, beta, inv)
    for a in range(m + 1):
        ba = beta[a] * inv
        R[a, m + 1] = ba
        R[m + 1, a] = ba
        r_max = max(r_max, abs(ba))
    R[m + 1, m + 1] = inv
    r_max = max(r_max, abs(inv))
    S[m] = j
    row = K[j]
    for a in range(m):
        KSS[m, a] = row[S[a]]
        KSS[a, m] = row[S[a]]
    KSS[m, m] = row[j]
    _copy_row32(K, j, n, KS32, m)
    ints[MARGIN_SIZE] = m + 1
    _after_update(buf, cfg, r_max)
    return True, beta, pivot


@njit(cache=True)
def shrink(buf: SolverBuffers, cfg: SolverSettings, n: int, pos: int) -> None:
    """Remove the margin atom at position ``pos`` of S from the bordered inverse.

    The last margin atom takes its place (in S and in the inverse's rows and columns): O(|S|) moves besides
    the O(|S|^2) rank-one downdate.
    """
    S, KSS, KS32, ints, R = buf.S, buf.KSS, buf.KS32, buf.ints, buf.R
    m = ints[MARGIN_SIZE]
    k = pos + 1
    rkk = R[k, k]
    S[pos] = S[m - 1]
    for a in range(m):
        KSS[pos, a] = KSS[m - 1, a]
    for a in range(m):
        KSS[a, pos] = KSS[a, m - 1]
    last, moved = KS32[m - 1], KS32[pos]
    for i in range(n):
        moved[i] = last[i]
    ints[MARGIN_SIZE] = m - 1
    if abs(rkk) <= 1e-300:
        buf.guards[_SMALL_PIVOT] += 1
        refactor(buf)
        return
    col = R[k, :m + 1].copy()  # = column k (R is bitwise symmetric)
    r_max = _rank_one_update(R, m + 1, col, -1.0 / rkk)
    # row / column m (the last) moves to k; the downdated row / column k is dropped
    for b in range(m + 1):
        R[k, b] = R[m, b]
    for a in range(m + 1):
        R[a, k] = R[a, m]
    _after_update(buf, cfg, r_max)


@njit(cache=True)
def _accumulate_rows(K, rows, weights, count, n, out):
    """out[:n] += sum_a weights[a] K[rows[a], :n], four rows per pass over ``out`` (memory-bound otherwise).

    K may be single precision (``KS32``, rows = 0..count-1): the sum is still formed in double precision."""
    a = 0
    while a + 4 <= count:
        r0, r1, r2, r3 = K[rows[a]], K[rows[a + 1]], K[rows[a + 2]], K[rows[a + 3]]
        w0, w1, w2, w3 = weights[a], weights[a + 1], weights[a + 2], weights[a + 3]
        for i in range(n):
            out[i] += w0 * r0[i] + w1 * r1[i] + w2 * r2[i] + w3 * r3[i]
        a += 4
    while a < count:
        row = K[rows[a]]
        w = weights[a]
        for i in range(n):
            out[i] += w * row[i]
        a += 1


@njit(cache=True)
def position(S: np.ndarray, m: int, j: int) -> int:
    for a in range(m):
        if S[a] == j:
            return a
    return -1


@njit(cache=True)
def _rate_error(w, m, diag, beta0):
    """Bound on |rate from ``KS32`` - rate from K| for every atom: sum_a |w_a| |fl32(K) - K| with |K_ij| <= k(x, x)
    (a positive semi-definite kernel), plus the two fp64 summations' rounding, with a factor 2 to spare."""
    wsum = 0.0
    for a in range(m):
        wsum += abs(w[a])
    return 2.0 * (wsum * diag * _F32_UNIT + 2.0 * (m + 4) * 2.0 ** -53 * (wsum * diag + 2.0 * diag + abs(beta0)))


@njit(cache=True)
def _exact_rate(K, S, m, c, s, beta0, w, i):
    """Rate of g_i per unit move of a_c from the fp64 kernel: s (2 K_ic + beta_0) + sum_a w_a K_i,S[a]."""
    row = K[i]
    r = s * (2.0 * row[c] + beta0)
    for a in range(m):
        r += w[a] * row[S[a]]
    return r


@njit(cache=True)
def _exact_g_one(K, alpha, n, rho, diag, i):
    row = K[i]
    acc = 0.0
    for k in range(n):
        acc += alpha[k] * row[k]
    return rho - diag + 2.0 * acc


@njit(cache=True)
def _first_crossing(K, S, m, c, s, beta0, w, alpha, rho, diag, g, rate_g, status, frozen, n, skip, eps, err, g_err,
                    best_t, kind, j):
    """The earliest bound atom whose g rises to 0 or reserve atom whose g falls to 0, if before ``best_t``.

    ``rate_g`` and ``g`` are within ``err`` and ``g_err`` of their fp64 values (the rates come from the
    single-precision rows; ``err`` = 0 means they are exact, as with an empty margin set). Each atom is first
    tested against a lower bound on its crossing time formed from them (without a division, and without
    branches on its status and sign, which follow no order a branch predictor could learn); the few whose
    bound does not rule them out are re-evaluated from the fp64 kernel (rate and g recomputed from the
    coefficients, both written back) and decided exactly, so the event found is the one the fp64 path meets.
    Ties as in the fp64 scan: a bound atom wins, then the lowest index; a strict comparison keeps any earlier
    kind.
    """
    lim = best_t * (1.0 + 1e-12)
    for i in range(n):
        r = rate_g[i]
        st = status[i]
        up = (st == BOUND) & (r + err > eps)
        down = (st == RESERVE) & (r - err < -eps)
        num = max((-g[i] if up else g[i]) - g_err, 0.0)
        den = r + err if up else err - r  # > 0 for an atom that moves towards 0
        if not ((up | down) & (num <= lim * den) & ~frozen[i]) or i == skip:
            continue
        r = _exact_rate(K, S, m, c, s, beta0, w, i) if err > 0.0 else rate_g[i]
        gi = _exact_g_one(K, alpha, n, rho, diag, i)
        rate_g[i] = r
        g[i] = gi
        if status[i] == BOUND and r > eps:
            t, rank = max(-gi, 0.0) / r, 4
        elif status[i] == RESERVE and r < -eps:
            t, rank = max(gi, 0.0) / -r, 5
        else:
            continue
        if t < best_t or (t == best_t and rank < kind):
            best_t, kind, j = t, rank, i
            lim = best_t * (1.0 + 1e-12)
    return best_t, kind, j


@njit(cache=True)
def _beta_without(R, m, beta, k):
    """beta over the margin set less its atom at inverse row k, ordered as ``shrink`` leaves it (the last moves
    to k): beta - (beta_k / R_kk) R[:, k], entry k dropped."""
    f = beta[k] / R[k, k]
    out = np.empty(m)
    row = R[k]
    for a in range(m):
        out[a] = beta[a] - f * row[a]
    if k < m:
        out[k] = beta[m] - f * row[m]
    return out


@njit(cache=True)
def _beta_with(beta, beta_j, lam, m):
    """beta over the margin set grown by atom j (appended): [beta + lam beta_j; lam]."""
    out = np.empty(m + 2)
    for a in range(m + 1):
        out[a] = beta[a] + lam * beta_j[a]
    out[m + 1] = lam
    return out


@njit(cache=True)
def enlarged_margin_buffers(buf: SolverBuffers, n: int, need: int) -> SolverBuffers:
    """``buf`` with margin buffers R, KSS, KS32 for at least ``need`` margin atoms (doubled, at most to the
    atoms' capacity), their first m (+1) rows and columns kept. A sweep whose margin set outgrows them goes on
    in these, the same path as in larger ones; the caller sizes them for a margin set it sets from outside."""
    R, KSS, KS32, m = buf.R, buf.KSS, buf.KS32, buf.ints[MARGIN_SIZE]
    mcap = min(max(2 * KSS.shape[0], need), buf.K.shape[0])
    R2 = np.zeros((mcap + 1, mcap + 1))
    R2[:m + 1, :m + 1] = R[:m + 1, :m + 1]
    KSS2 = np.zeros((mcap, mcap))
    KSS2[:m, :m] = KSS[:m, :m]
    KS32_2 = np.zeros((mcap, KS32.shape[1]), dtype=np.float32)
    KS32_2[:m, :n] = KS32[:m, :n]
    return SolverBuffers(buf.K, buf.g, buf.alpha, buf.status, buf.box, buf.S, KSS2, KS32_2, buf.ints, R2, buf.guards)


@njit(cache=True)
def sweep(buf: SolverBuffers, cfg: SolverSettings, n: int, c: int, s: float, target: float, rho: float,
          beta_start: np.ndarray, g_err: float) -> tuple:
    """Move a_c monotonically (s = +1 up, -1 down) towards ``target``, keeping KKT on all other atoms.

    Each step goes to the nearest bookkeeping event (design note 4.3): a_c reaching its target, g_c reaching 0
    (increments only), a margin atom reaching 0 or its box, a bound or reserve atom's g reaching 0. With an
    empty margin set only rho moves. Atoms whose kernel column is numerically in the span of the margin set's
    stay at their bound with g = 0 for this sweep (design note 4.6): admitting one would make the bordered
    matrix singular. ``box[c]`` must already hold max(box_c, target). ``beta_start``: the first step's rates
    of (rho, a_S) per unit a_c when the caller has them (length |S| + 1), else empty. A step costs O(n |S| + |S|^2); its
    O(n |S|) part reads the margin atoms' kernel rows in single precision (``KS32``), with a rigorous bound
    on the rates' error: every atom the bound cannot rule out as the next event is decided from the fp64
    kernel (``_first_crossing``), and a_S, rho, a_c and g_c move at fp64 rates. The other atoms' g then
    carry the bounded error: ``g_err`` bounds it on entry (0: g is the fp64 g of the coefficients), and the
    grown bound is returned; g is recomputed from the coefficients should it pass ``_G_RESYNC``.

    Returns (outcome, rho, g_err, buf): ``buf`` holds new, larger margin buffers when the margin set outgrew them.
    """
    K, g, alpha, status, box, S, ints, R = buf.K, buf.g, buf.alpha, buf.status, buf.box, buf.S, buf.ints, buf.R
    diag, eps = cfg.diag, cfg.eps
    skip = -1
    g_err += _G_SLACK
    # beta carried over from the last event (see below), or given for the first step, instead of solved afresh
    beta_known = len(beta_start) == ints[MARGIN_SIZE] + 1 and ints[MARGIN_SIZE] > 0
    beta = beta_start
    carried = 0
    frozen = np.zeros(n, dtype=np.bool_)
    c_frozen = False
    rate_g = np.empty(n)
    margin_rows = np.arange(n)  # KS32's rows, in the margin set's order
    for _ in range(20 * n + 100):
        m = ints[MARGIN_SIZE]
        if m > 0:
            if beta_known and carried < _BETA_CARRY:
                carried += 1
            else:
                _, beta = _border_solve(K, S, m, R, c)
                carried = 0
            beta_known = False
            rate_rho = s * beta[0]
            rate_c = s
            row = K[c]
            w = (2.0 * s) * beta[1:]
            for i in range(n):
                rate_g[i] = s * (2.0 * row[i] + beta[0])
            _accumulate_rows(buf.KS32, margin_rows, w, m, n, rate_g)
            for a in range(m):
                rate_g[S[a]] = 0.0
            rate_g[c] = _exact_rate(K, S, m, c, s, beta[0], w, c)
            err = _rate_error(w, m, diag, beta[0])
        else:
            beta = np.zeros(1)
            w = np.zeros(0)
            rate_g[:n] = s
            rate_rho = s
            rate_c = 0.0
            err = 0.0

        best_t = math.inf
        kind = -1  # 0 c_target, 1 c_margin, 2 S_to_E, 3 S_to_R, 4 E_to_S, 5 R_to_S; ties go to the lower kind
        j = -1
        if rate_c != 0.0:
            best_t = max(s * (target - alpha[c]), 0.0)
            kind = 0
        if s > 0 and not c_frozen and rate_g[c] > eps:
            t = max(-g[c], 0.0) / rate_g[c]
            if t < best_t:
                best_t, kind = t, 1
        for a in range(m):  # margin atoms rising to their box
            i = S[a]
            ra = s * beta[a + 1]
            if i != skip and ra > eps:
                t = (box[i] - alpha[i]) / ra
                if t < best_t:
                    best_t, kind, j = max(t, 0.0), 2, i
        for a in range(m):  # margin atoms falling to 0
            i = S[a]
            ra = s * beta[a + 1]
            if i != skip and ra < -eps:
                t = alpha[i] / -ra
                if t < best_t:
                    best_t, kind, j = max(t, 0.0), 3, i
        best_t, kind, j = _first_crossing(K, S, m, c, s, beta[0], w, alpha, rho, diag, g, rate_g, status, frozen, n,
                                          skip, eps, err, g_err, best_t, kind, j)
        if kind == -1:
            if m == 0 and s < 0:
                # Every other atom is at a bound: feasibility (checked before the sweep) says their boxes hold
                # the unit mass, so what is left of a_c is rounding from a tie with the terminal event. The
                # caller's polish verifies the result's KKT residual.
                alpha[c] = target
                status[c] = BOUND
                return SWEPT_TO_TARGET, rho, g_err, buf
            return SWEPT_NO_EVENT, rho, g_err, buf

        t = best_t
        for a in range(m):
            alpha[S[a]] += t * s * beta[a + 1]
        alpha[c] += t * rate_c
        rho += t * rate_rho
        for i in range(n):
            g[i] += t * rate_g[i]
        g_err += t * err
        if g_err > _G_RESYNC:
            exact_g(K, alpha, n, rho, diag, g)
            for a in range(m):
                g[S[a]] = 0.0
            g_err = _G_SLACK
        skip = j if t <= 1e-14 else -1

        if kind == 0:
            alpha[c] = target
            status[c] = BOUND
            return SWEPT_TO_TARGET, rho, g_err, buf
        if (kind == 1 or kind >= 4) and ints[MARGIN_SIZE] == buf.KSS.shape[0]:
            buf = enlarged_margin_buffers(buf, n, ints[MARGIN_SIZE] + 1)
            R = buf.R
        # The next step's beta follows from this one's (O(|S|) instead of a solve with the inverse, O(|S|^2)):
        # a margin atom that leaves keeps its coefficient, so beta loses the component along that atom's column
        # of the inverse; an atom that joins moves at the rate lambda that holds its g, beta_j lambda added.
        if kind == 1:
            g[c] = 0.0
            if grow(buf, cfg, n, c)[0]:
                status[c] = MARGIN
                return SWEPT_TO_MARGIN, rho, g_err, buf
            c_frozen = True  # g_c no longer moves with a_c: keep raising a_c at g_c = 0
            beta_known = m > 0
        elif kind == 2 or kind == 3:
            alpha[j] = box[j] if kind == 2 else 0.0
            pos = position(S, ints[MARGIN_SIZE], j)
            k = pos + 1
            if m > 1 and abs(R[k, k]) > 1e-300:
                beta = _beta_without(R, m, beta, k)
                beta_known = True
            shrink(buf, cfg, n, pos)
            status[j] = BOUND if kind == 2 else RESERVE
        else:
            g[j] = 0.0
            grown, beta_j, pivot = grow(buf, cfg, n, j)
            if grown:
                status[j] = MARGIN
                if m > 0:
                    beta = _beta_with(beta, beta_j, -(s * rate_g[j]) / pivot, m)
                    beta_known = True
            else:
                frozen[j] = True
                beta_known = m > 0
    buf.guards[_ITER_CAP] += 1
    return SWEPT_ITERATION_CAP, rho, g_err, buf


@njit(cache=True)
def _bordered_residual(KSS, m, rhs, u):
    """rhs - M u for the bordered matrix M = [[0, 1^T], [1, 2 K_SS]]."""
    resid = np.empty(m + 1)
    resid[0] = rhs[0] - u[1:].sum()
    for a in range(m):
        resid[a + 1] = rhs[a + 1] - u[0]
    for b in range(m):  # row by row (K_SS is symmetric): contiguous axpys instead of one dependent chain
        row = KSS[b]
        w = 2.0 * u[b + 1]
        for a in range(m):
            resid[a + 1] -= w * row[a]
    return resid


@njit(cache=True)
def _refine(KSS, R, m, rhs, u):
    """Iterative refinement of u ~ M^-1 rhs in place; returns the residual rhs - M u of the refined u.

    One step suffices for a well-conditioned margin set; near-duplicate keys need a few more. Stops at a
    residual at rounding level (``_RESIDUAL_ROUNDING``, left as it is) or when the residual no longer shrinks.
    """
    resid = _bordered_residual(KSS, m, rhs, u)
    last = math.inf
    for _ in range(_REFINE_STEPS):
        size = np.abs(resid).max()
        if size <= _RESIDUAL_ROUNDING or size >= last:
            break
        last = size
        u += _matvec(R, m + 1, resid)
        resid = _bordered_residual(KSS, m, rhs, u)
    return resid


@njit(cache=True)
def polish(buf: SolverBuffers, cfg: SolverSettings, n: int, exclude: int, rho: float) -> tuple:
    """Re-solve the bordered system on the current partition with the maintained inverse (iterative
    refinement from the current (rho, a_S), which after a sweep is within rounding of the solution; the
    inverse is rebuilt once when that does not converge), moving margin atoms that sit on a bound to that
    bound's set, until none is left.

    Returns (rho, resid, moved): rho (meaningless when the margin set ends empty: the caller then sets the
    midpoint), the bordered system's residual at the end state (length |S| + 1: the sum constraint's, then the
    margin atoms' -g) and sum |d a| over the coefficients it changed.
    """
    K, alpha, status, box, S, ints = buf.K, buf.alpha, buf.status, buf.box, buf.S, buf.ints
    refactored = False
    moved = 0.0
    while True:
        for i in range(n):
            if i == exclude:
                continue
            st = status[i]
            on_bound = box[i] if st == BOUND else 0.0
            if (st == BOUND or st == RESERVE) and alpha[i] != on_bound:  # rare: a sweep leaves them there
                moved += abs(alpha[i] - on_bound)
                alpha[i] = on_bound
        m = ints[MARGIN_SIZE]
        resid = np.zeros(m + 1)
        if m > 0:
            E = np.empty(n, dtype=np.int64)
            n_e = 0
            for i in range(n):
                if i != exclude and status[i] == BOUND:
                    E[n_e] = i
                    n_e += 1
            rhs = np.empty(m + 1)
            rhs[0] = 1.0
            for e in range(n_e):
                rhs[0] -= box[E[e]]
            for a in range(m):
                rhs[a + 1] = cfg.diag
            for e in range(n_e):
                row = K[E[e]]
                w = 2.0 * box[E[e]]
                for a in range(m):
                    rhs[a + 1] -= w * row[S[a]]
            if math.isfinite(rho):
                u = np.empty(m + 1)
                u[0] = rho
                for a in range(m):
                    u[a + 1] = alpha[S[a]]
            else:
                u = _matvec(buf.R, m + 1, rhs)
            resid = _refine(buf.KSS, buf.R, m, rhs, u)
            if np.abs(resid).max() > _REFINE_TOL and not refactored:
                # The maintained inverse has drifted too far for refinement to converge (ill-conditioned
                # margin sets): rebuild it from K and solve again.
                buf.guards[_UNCONVERGED] += 1
                refactor(buf)
                refactored = True
                u = _matvec(buf.R, m + 1, rhs)
                resid = _refine(buf.KSS, buf.R, m, rhs, u)
            rho = u[0]
            for a in range(m):
                moved += abs(u[a + 1] - alpha[S[a]])
                alpha[S[a]] = u[a + 1]
        snapped = False
        a = 0
        while a < ints[MARGIN_SIZE]:
            i = S[a]
            if alpha[i] <= BOUNDARY_SNAP or alpha[i] >= box[i] - BOUNDARY_SNAP:
                status[i] = RESERVE if alpha[i] <= BOUNDARY_SNAP else BOUND
                shrink(buf, cfg, n, a)
                snapped = True
            else:
                a += 1
        if not snapped:
            return rho, resid, moved


@njit(cache=True)
def finish(buf: SolverBuffers, cfg: SolverSettings, n: int, exclude: int, rho: float, g_err: float) -> tuple:
    """End of an operation: polish (from the current coefficients and ``rho``), then the exact KKT residual of
    the end state.

    ``g`` is within ``g_err`` of the fp64 g of the coefficients on entry (inf: not known). Recomputing every g
    is a pass over the active atoms' fp64 kernel rows, as much memory traffic as a sweep step, and the residual
    needs no such pass: the polish's final bordered residual is the sum constraint's and the margin atoms' g,
    the polish leaves every coefficient within its box (bound and reserve ones on it, margin ones strictly
    inside), every other atom whose maintained g lies within the bound of its wrong side of 0 is re-evaluated
    from its kernel row (``_refresh_near``), and the rest are on their right side by the bound. The bound grows
    by what the polish moved (|d rho| + 2 k(x, x) sum |d a|: |K_ij| <= k(x, x) for a kernel with constant
    diagonal); every g is recomputed when it passes ``_G_RESYNC`` or too many atoms are near.

    Returns (rho, residual, g_err); with an empty margin set rho is not pinned by the system and (nan, nan, nan)
    is returned: the caller sets the midpoint rho and recomputes g.
    """
    K, alpha, g, status, S, diag = buf.K, buf.alpha, buf.g, buf.status, buf.S, cfg.diag
    rho_before = rho
    rho, resid, moved = polish(buf, cfg, n, exclude, rho)
    m = buf.ints[MARGIN_SIZE]
    if m == 0:
        return math.nan, math.nan, math.nan
    g_err += abs(rho - rho_before) + 2.0 * diag * moved  # inf (never nan) when rho_before was not known
    if g_err <= _G_RESYNC:
        worst = _refresh_near(K, alpha, g, status, n, exclude, rho, diag, g_err)
        if worst >= 0.0:
            for a in range(m):
                g[S[a]] = -resid[a + 1]
            return rho, max(worst, np.abs(resid).max()), g_err
    exact_g(K, alpha, n, rho, diag, g)
    return rho, residual(alpha, g, buf.box, status, n, exclude), 0.0


@njit(cache=True)
def _refresh_near(K, alpha, g, status, n, exclude, rho, diag, g_err):
    """Re-evaluate from the coefficients every reserve atom whose maintained g is below ``g_err`` and every
    bound atom whose g is above ``-g_err`` (the others are on their side of 0 whatever their error); returns
    their largest KKT violation (max(-g) over reserve, max(g) over bound ones, 0 if none), or -1 with nothing
    changed when there are more than ``_NEAR_EXACT`` of them."""
    near = np.empty(_NEAR_EXACT, dtype=np.int64)
    count = 0
    for i in range(n):
        st = status[i]
        if ((st == RESERVE) & (g[i] < g_err) | (st == BOUND) & (g[i] > -g_err)) and i != exclude:
            if count == _NEAR_EXACT:
                return -1.0
            near[count] = i
            count += 1
    worst = 0.0
    for k in range(count):
        i = near[k]
        g[i] = _exact_g_one(K, alpha, n, rho, diag, i)
        worst = max(worst, -g[i] if status[i] == RESERVE else g[i])
    return worst


@njit(cache=True)
def move_coefficient(buf: SolverBuffers, cfg: SolverSettings, n: int, c: int, s: float, rho: float,
                     g_err: float) -> tuple:
    """One solver operation in a single compiled call: take atom c out of its set, sweep a_c to its new box
    ``box[c]`` (s = +1 after a token was added, -1 after one was removed), then ``finish``. An atom swept down
    to a zero box is left in the reserve set and excluded from the end state (the caller drops it). ``g`` is
    within ``g_err`` of the coefficients' fp64 g on entry, and g_c exact.

    Returns (outcome, rho, residual, g_err, buf): the sweep's outcome (the state is unfinished unless it is
    SWEPT_TO_TARGET or SWEPT_TO_MARGIN), ``finish``'s rho, residual and error bound of g (the sweep's when
    unfinished), and the buffers (with larger margin buffers when the margin set outgrew them).
    """
    alpha, status, box, S, ints, R = buf.alpha, buf.status, buf.box, buf.S, buf.ints, buf.R
    beta = np.zeros(0)
    if status[c] == MARGIN:
        pos = position(S, ints[MARGIN_SIZE], c)
        k = pos + 1
        m = ints[MARGIN_SIZE]
        if m > 1 and abs(R[k, k]) > 1e-300:
            # With a_c fixed, the other unknowns move at R[:, k] / R_kk per unit a_c (block inverse): the first
            # step's beta without a solve over the shrunk inverse.
            unit = np.zeros(m + 1)
            unit[k] = -1.0  # _beta_without then gives R[:, k] / R_kk, ordered as after the shrink
            beta = _beta_without(R, m, unit, k)
        shrink(buf, cfg, n, pos)
    status[c] = DETACHED
    outcome, rho, g_err, buf = sweep(buf, cfg, n, c, s, box[c], rho, beta, g_err)
    if outcome != SWEPT_TO_TARGET and outcome != SWEPT_TO_MARGIN:
        return outcome, rho, math.nan, g_err, buf
    exclude = -1
    if box[c] == 0.0:
        alpha[c] = 0.0
        status[c] = RESERVE
        exclude = c
    rho_end, res, g_err = finish(buf, cfg, n, exclude, rho, g_err)
    return outcome, rho_end, res, g_err, buf


@njit(cache=True)
def exact_g(K: np.ndarray, alpha: np.ndarray, n: int, rho: float, diag: float, g: np.ndarray) -> None:
    """g_i = rho - k_ii + 2 sum_j a_j K_ji over the atoms with nonzero coefficients (rows: K is symmetric)."""
    act = np.flatnonzero(alpha[:n])
    g[:n] = rho - diag
    _accumulate_rows(K, act, 2.0 * alpha[act], len(act), n, g)


@njit(cache=True)
def residual(alpha: np.ndarray, g: np.ndarray, box: np.ndarray, status: np.ndarray, n: int, exclude: int) -> float:
    """KKT residual over atoms 0..n-1 except ``exclude`` (same definition as ``kkt.kkt_residual``)."""
    total = 0.0
    worst = 0.0
    for i in range(n):
        if i == exclude:
            continue
        a = alpha[i]
        total += a
        worst = max(worst, -a, a - box[i])
        st = status[i]
        if st == MARGIN:
            worst = max(worst, abs(g[i]))
        elif st == RESERVE:
            worst = max(worst, -g[i])
        elif st == BOUND:
            worst = max(worst, g[i])
    return max(worst, abs(total - 1.0))
