"""The exact solver's state as the compiled core (``memory.solver_core``) reads and updates it in place.

``SolverBuffers`` holds the capacity-sized arrays (only the first n atom slots / m margin rows are meaningful);
``SolverSettings`` the constants of a memory's solver. Both are NamedTuples, which numba passes into compiled
code as one argument each instead of 23 positional ones.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .errors import SolverError

if TYPE_CHECKING:
    from memory.svmemory import SVMemory

GUARDS = ("refused_dependent", "small_pivot", "scheduled_refactor", "large_inverse", "pinv", "iteration_cap",
          "unconverged_refinement", "repair")


class SolverBuffers(NamedTuple):
    """Arrays shared by ``SVMemory`` and the compiled core.

    Attributes
    ----------
    K : (cap, cap) float64
        Gram matrix over atoms, symmetric, so row j is column j and is read contiguously.
    g, alpha : (cap,) float64
        Decision values (g-form) and coefficients; g is within a stated bound (``g_err``) of the coefficients'
        fp64 g (``solver_core.finish``).
    status : (cap,) int8
        KKT set of each slot (``kkt.MARGIN``, ``BOUND``, ``RESERVE``), or ``solver_core.FREE`` for a slot whose
        atom was deleted (its kernel row and column are stale and never read for a live atom's result).
    box : (cap,) float64
        multiplicity * C.
    S : (cap,) int64
        Margin atoms, in the order of the inverse's rows 1..m.
    KSS : (mcap, mcap) float64
        K_SS in that order, top-left m block (the polish reads it contiguously instead of gathering m^2
        scattered entries of K); mcap, the margin buffers' capacity, is its size: a sweep whose margin set would
        outgrow it continues in doubled buffers (``solver_core.enlarged_margin_buffers``).
    KS32 : (mcap, cap) float32
        The margin atoms' kernel rows K[S[a], :n] rounded to single precision, row a for S[a]. A sweep's steps
        locate their next event with it: half the bytes of the fp64 rows, so at ~1,000 atoms the margin rows
        stay in a core's L2 cache instead of streaming from L3 at every step.
    ints : (2,) int64
        [m, rank-one updates since the last refactorisation].
    R : (mcap + 1, mcap + 1) float64
        Inverse of the bordered matrix [[0, 1^T], [1, 2 K_SS]], top-left (m + 1) block.
    guards : int64 counters, indexed by ``GUARDS``.
    """
    K: np.ndarray
    g: np.ndarray
    alpha: np.ndarray
    status: np.ndarray
    box: np.ndarray
    S: np.ndarray
    KSS: np.ndarray
    KS32: np.ndarray
    ints: np.ndarray
    R: np.ndarray
    guards: np.ndarray


class SolverSettings(NamedTuple):
    """Constants of one memory's solver."""
    diag: float            # k(x, x), the kernel's constant diagonal
    eps: float             # rates below this are treated as zero when deciding whether an event is reachable
    rel_pivot: float       # relative Schur-pivot test for a rank-one growth of the inverse
    refactor_every: int    # rank-one updates between two refactorisations of the inverse
    r_cap: float           # a rank-one update with an entry above this triggers a refactorisation


def empty_buffers() -> SolverBuffers:
    return SolverBuffers(
        K=np.empty((0, 0)), g=np.empty(0), alpha=np.empty(0), status=np.empty(0, dtype=np.int8), box=np.empty(0),
        S=np.empty(0, dtype=np.int64), KSS=np.empty((0, 0)), KS32=np.empty((0, 0), dtype=np.float32),
        ints=np.zeros(2, dtype=np.int64), R=np.empty((1, 1)), guards=np.zeros(len(GUARDS), dtype=np.int64))


def grown(a: np.ndarray, shape: tuple, dtype: type = np.float64) -> np.ndarray:
    """A zero array of ``shape`` holding ``a`` in its leading corner (a buffer grown, contents kept)."""
    out = np.zeros(shape, dtype=dtype)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out


def with_atom_capacity(buf: SolverBuffers, n: int, cap: int) -> SolverBuffers:
    """``buf`` with its atom-sized buffers grown to ``cap`` slots, the first n kept (margin buffers as they are)."""
    m = int(buf.ints[0])
    K = np.zeros((cap, cap))
    K[:n, :n] = buf.K[:n, :n]
    return buf._replace(
        K=K, alpha=grown(buf.alpha[:n], (cap,)), g=grown(buf.g[:n], (cap,)), box=grown(buf.box[:n], (cap,)),
        status=grown(buf.status[:n], (cap,), np.int8), S=grown(buf.S[:m], (cap,), np.int64),
        KS32=grown(buf.KS32[:m, :n], (buf.KSS.shape[0], cap), np.float32))


class Solution(NamedTuple):
    """A copy of the solution part of a memory's state (what a failed solver operation must put back)."""
    n: int
    alpha: np.ndarray
    g: np.ndarray
    status: np.ndarray
    S: np.ndarray
    rho: float
    g_err: float
    fitted: bool


class Rollback:
    """On a SolverError inside the context, put the memory's solution back as it was on entry: coefficients, g,
    sets and rho from a copy (O(n), ~1.4 us at 1,024 atoms), the inverse rebuilt from K for that margin set. The
    caller then undoes its own bookkeeping (the token's record and multiplicity), so a failed add or remove
    leaves the memory as it was. A class rather than a generator context: it is entered on every solver-path
    operation, and costs a third as much."""

    __slots__ = ("mem", "saved")

    def __init__(self, mem: SVMemory):
        buf, n = mem._buf, mem._n
        self.mem = mem
        self.saved = Solution(n, buf.alpha[:n].copy(), buf.g[:n].copy(), buf.status[:n].copy(),
                              buf.S[:int(buf.ints[0])].copy(), mem.rho_, mem._g_err, mem._fitted)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is not None and issubclass(exc_type, SolverError):
            mem, saved = self.mem, self.saved
            n = saved.n
            mem._buf.alpha[:n], mem._buf.g[:n], mem._buf.status[:n] = saved.alpha, saved.g, saved.status
            mem.rho_, mem._g_err, mem._fitted = saved.rho, saved.g_err, saved.fitted
            mem._set_margin(saved.S)
        return False
