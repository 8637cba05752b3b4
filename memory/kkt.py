"""KKT bookkeeping of the fixed-box SVDD dual, and an exact batch solve by active-set repair.

Problem (over *atoms*: distinct keys, atom i standing for m_i identical tokens with box b_i = m_i C)::

    min_a  a^T K a - d^T a     s.t.  sum(a) = 1,  0 <= a_i <= b_i

Decision value ("g-form", the convention used everywhere in this package)::

    g(x) = rho - k(x, x) + 2 sum_j a_j k(x_j, x)   ( = R^2 - D^2(x): > 0 inside, 0 on the boundary)

Partition: margin S (0 < a < b, g = 0), bound E (a = b, g <= 0), reserve R (a = 0, g >= 0).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RESERVE, MARGIN, BOUND = 0, 1, 2


def kkt_residual(alpha: np.ndarray, g: np.ndarray, box: np.ndarray, status: np.ndarray) -> float:
    """Largest violation of the KKT conditions (0 at an exact optimum).

    max(|1^T a - 1|, box violation, max_S |g|, max(0, -min_R g), max(0, max_E g)).
    """
    if alpha.size == 0:
        return 0.0
    parts = [abs(alpha.sum() - 1.0),
             float(np.max(np.maximum(-alpha, alpha - box), initial=0.0))]
    for code, viol in ((MARGIN, np.abs(g)), (RESERVE, np.maximum(-g, 0.0)), (BOUND, np.maximum(g, 0.0))):
        sel = status == code
        if sel.any():
            parts.append(float(viol[sel].max()))
    return max(0.0, *parts)


def bordered_matrix(K: np.ndarray, S: np.ndarray) -> np.ndarray:
    """M = [[0, 1^T], [1, 2 K_SS]] for margin set S (index array)."""
    m = len(S)
    M = np.empty((m + 1, m + 1))
    M[0, 0] = 0.0
    M[0, 1:] = 1.0
    M[1:, 0] = 1.0
    M[1:, 1:] = 2.0 * K[np.ix_(S, S)]
    return M


def bordered_rhs(K: np.ndarray, diag: np.ndarray, box: np.ndarray, S: np.ndarray, E: np.ndarray) -> np.ndarray:
    """c = [1 - sum_E b ; d_S - 2 K_SE b_E] of the fixed-partition system M [rho; a_S] = c."""
    rhs = np.empty(len(S) + 1)
    rhs[0] = 1.0 - box[E].sum()
    rhs[1:] = diag[S]
    if len(E):
        rhs[1:] -= 2.0 * (K[np.ix_(S, E)] @ box[E])
    return rhs


def gradient(K: np.ndarray, alpha: np.ndarray, rho: float, diag: np.ndarray) -> np.ndarray:
    """g_i = rho - K_ii + 2 (K a)_i over the atoms, summing only nonzero coefficients."""
    active = np.flatnonzero(alpha)
    return rho - diag + 2.0 * (K[:, active] @ alpha[active])


def midpoint_rho(K: np.ndarray, alpha: np.ndarray, status: np.ndarray, diag: np.ndarray) -> float:
    """rho when the margin set is empty: the midpoint of its feasible interval (libsvm's convention).

    With h_i = d_i - 2 (K a)_i, KKT asks max_R h <= rho <= min_E h.
    """
    active = np.flatnonzero(alpha)
    h = diag - 2.0 * (K[:, active] @ alpha[active])
    lo = h[status == RESERVE].max() if (status == RESERVE).any() else None
    hi = h[status == BOUND].min() if (status == BOUND).any() else None
    if lo is None and hi is None:
        raise ValueError("no reserve or bound atom: rho is undetermined")
    if lo is None:
        return float(hi)
    if hi is None:
        return float(lo)
    return 0.5 * (float(lo) + float(hi))


# A margin coefficient this close to a bound is on it: the atom is moved to that bound's set. Otherwise a margin
# set made only of such atoms would pin rho at one end of its interval, where a solver that reached the same
# coefficients by another path takes the midpoint.
BOUNDARY_SNAP = 1e-13


def degenerate_margin(alpha: np.ndarray, box: np.ndarray, status: np.ndarray) -> tuple:
    """Margin atoms whose coefficient sits on a bound: (to_reserve, to_bound) boolean masks."""
    margin = status == MARGIN
    return margin & (alpha <= BOUNDARY_SNAP), margin & (alpha >= box - BOUNDARY_SNAP)


@dataclass
class BatchSolution:
    alpha: np.ndarray
    rho: float
    g: np.ndarray
    status: np.ndarray
    residual: float


def _solve_partition(K, diag, box, status):
    S = np.flatnonzero(status == MARGIN)
    E = np.flatnonzero(status == BOUND)
    alpha = np.zeros(len(box))
    alpha[E] = box[E]
    if len(S):
        M = bordered_matrix(K, S)
        rhs = bordered_rhs(K, diag, box, S, E)
        # Least squares with a cut-off: near-duplicate keys make M numerically singular, and the minimum-norm
        # solution then picks the tie-break among (almost) interchangeable atoms.
        u = np.linalg.lstsq(M, rhs, rcond=1e-13)[0]
        rho = float(u[0])
        alpha[S] = u[1:]
    else:
        rho = midpoint_rho(K, alpha, status, diag)
    return alpha, rho


def solve_exact(K: np.ndarray, box: np.ndarray, alpha_guess: np.ndarray, diag: float = 1.0, max_iter: int = 60,
                tol: float = 1e-12) -> BatchSolution:
    """Exact KKT point of the fixed-box problem from an approximate solution (primal-dual active-set repair).

    A batch QP's "zeros" are only ~1e-9; a certificate or a deviation measured against it would inherit that
    error. Starting from partitions guessed at several thresholds, the bordered system is solved directly and
    violators are moved (S below 0 -> R, S above b -> E, R with g < 0 -> S, E with g > 0 -> S) until none is
    left. The state with the smallest KKT residual is returned.
    """
    K = np.asarray(K, dtype=np.float64)
    box = np.asarray(box, dtype=np.float64)
    n = len(box)
    diag_v = np.full(n, float(diag))
    guess = np.clip(np.asarray(alpha_guess, dtype=np.float64), 0.0, box)
    best = None
    for tau in (1e-7, 1e-9, 1e-5, 1e-11, 1e-4):
        status = np.full(n, RESERVE, dtype=np.int8)
        status[guess > tau] = MARGIN
        status[guess >= box - tau] = BOUND
        for _ in range(max_iter):
            if not (status == MARGIN).any():
                deficit = 1.0 - box[status == BOUND].sum()
                if abs(deficit) > tol:
                    # All mass on bounds cannot sum to one: free the atom closest to switching.
                    cand = np.flatnonzero(status == (RESERVE if deficit > 0 else BOUND))
                    status[cand[np.argmax(guess[cand] if deficit > 0 else -guess[cand])]] = MARGIN
            alpha, rho = _solve_partition(K, diag_v, box, status)
            g = gradient(K, alpha, rho, diag_v)
            moved = False
            for sel, new in ((status == MARGIN) & (alpha < 0.0), RESERVE), \
                            ((status == MARGIN) & (alpha > box), BOUND), \
                            ((status == RESERVE) & (g < -tol), MARGIN), \
                            ((status == BOUND) & (g > tol), MARGIN):
                if sel.any():
                    status[sel] = new
                    moved = True
            if not moved:
                to_r, to_e = degenerate_margin(alpha, box, status)
                if not (to_r.any() or to_e.any()):
                    break
                status[to_r] = RESERVE
                status[to_e] = BOUND
        alpha, rho = _solve_partition(K, diag_v, box, status)
        alpha = np.where(status == RESERVE, 0.0, np.where(status == BOUND, box, alpha))
        g = gradient(K, alpha, rho, diag_v)
        res = kkt_residual(alpha, g, box, status)
        if best is None or res < best.residual:
            best = BatchSolution(alpha, rho, g, status.copy(), res)
        if res <= tol:
            break
    return best
