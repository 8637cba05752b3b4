"""The exact solver's state: what the compiled core (``memory.solver_core``) reads and updates in place, and the
rest of a memory's solution.

``SolverBuffers`` holds the capacity-sized arrays (only the first n atom slots / m margin rows are meaningful);
``SolverSettings`` the constants of a memory's solver. Both are NamedTuples, which numba passes into compiled
code as one argument each instead of 23 positional ones. :class:`SolverState` holds them with the atom registry,
rho, g's error bound and whether the memory has a solution: the one object the solver
(``memory.exact_solver``), the public API (``memory.svmemory``) and persistence (``memory.persistence``) share.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

import numpy as np

from .atoms import AtomRegistry, grown

# The numerical safeguards counted in ``SolverBuffers.guards``, in counter order; the compiled core and the
# solver index them by name through GUARD.
GUARDS = ("refused_dependent", "small_pivot", "scheduled_refactor", "large_inverse", "pinv", "iteration_cap",
          "unconverged_refinement", "repair")
GUARD = {name: i for i, name in enumerate(GUARDS)}
# The entries of ``SolverBuffers.ints``.
MARGIN_SIZE, UPDATES_SINCE_REFACTOR = 0, 1
# A slot whose atom was deleted, until a new atom takes it: a zero coefficient and box, no set, so every loop of
# the core that tests a status passes it by. Leaving the slot free instead of moving the last atom into it saves
# rewriting that atom's kernel column, n strided stores (as much as one pass over the margin rows).
FREE = 4


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
        [m, rank-one updates since the last refactorisation], at ``MARGIN_SIZE`` and ``UPDATES_SINCE_REFACTOR``.
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


def with_atom_capacity(buf: SolverBuffers, n: int, cap: int) -> SolverBuffers:
    """``buf`` with its atom-sized buffers grown to ``cap`` slots, the first n kept (margin buffers as they are)."""
    m = int(buf.ints[MARGIN_SIZE])
    K = np.zeros((cap, cap))
    K[:n, :n] = buf.K[:n, :n]
    return buf._replace(
        K=K, alpha=grown(buf.alpha[:n], (cap,)), g=grown(buf.g[:n], (cap,)), box=grown(buf.box[:n], (cap,)),
        status=grown(buf.status[:n], (cap,), np.int8), S=grown(buf.S[:m], (cap,), np.int64),
        KS32=grown(buf.KS32[:m, :n], (buf.KSS.shape[0], cap), np.float32))


class SolverState:
    """A memory's solution and the storage it lives in: the buffers, the atom registry, rho, the bound on g's
    error (``g_err``; 0: the maintained g is exact to rounding) and whether the memory has a solution
    (``fitted``), with the box C and the KKT tolerance they are kept to."""

    __slots__ = ("C", "tol", "settings", "atoms", "buf", "cap", "value_dim", "rho", "g_err", "fitted")

    def __init__(self, C: float, tol: float, settings: SolverSettings):
        self.C, self.tol, self.settings = C, tol, settings
        self.atoms = AtomRegistry()
        self.buf = empty_buffers()
        self.cap = 0                 # atom slots allocated
        self.value_dim = None
        self.rho = float("nan")
        self.g_err = math.inf
        self.fitted = False

    @property
    def diag(self) -> float:
        return self.settings.diag

    @property
    def n(self) -> int:
        """Slots in use: atoms, and free slots below the last atom."""
        return self.atoms.n

    @property
    def margin_size(self) -> int:
        return int(self.buf.ints[MARGIN_SIZE])

    @property
    def dim(self) -> int | None:
        return self.atoms.X.shape[1] if self.atoms.X.ndim == 2 and self.atoms.X.shape[1] else None

    def margin(self) -> np.ndarray:
        """Margin slots (a view), in the order of the inverse's rows."""
        return self.buf.S[:self.margin_size]

    def kkt_inverse(self) -> np.ndarray:
        """The maintained inverse of the bordered matrix [[0, 1^T], [1, 2 K_SS]] (a view)."""
        m = self.margin_size
        return self.buf.R[:m + 1, :m + 1]

    def live_slots(self) -> np.ndarray:
        return np.flatnonzero(self.buf.status[:self.n] != FREE)

    def box(self) -> np.ndarray:
        """Boxes multiplicity * C of slots 0..n-1 (a view, kept in step with the multiplicities)."""
        return self.buf.box[:self.n]

    def set_multiplicity(self, slot: int, k: int) -> None:
        k = int(k)  # a numpy integer times a float takes numpy's scalar promotion, ~1 us
        self.atoms.mult[slot] = k
        self.buf.box[slot] = k * self.C

    def count_guard(self, name: str) -> None:
        self.buf.guards[GUARD[name]] += 1

    def guard_counts(self) -> Counter:
        """The safeguards that fired, by name."""
        return Counter({name: int(k) for name, k in zip(GUARDS, self.buf.guards) if k})
