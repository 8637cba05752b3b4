"""The exact solver's control, once per operation: the first (seeded) solution, admitting a token, releasing one,
the end-of-operation polish and the last-resort repair; the storage they need. The path itself runs compiled
(``memory.solver_core``); the state it works on is a :class:`memory.solver_state.SolverState`."""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import solver_core as core
from .errors import SolverError
from .kkt import BOUND, BOUNDARY_SNAP, MARGIN, RESERVE, BatchSolution, midpoint_rho, solve_exact
from .libsvm import sklearn_alpha_guess
from .solver_state import MARGIN_SIZE, SolverState, with_atom_capacity

MARGIN_CAPACITY_START = 64  # margin buffers' first size when no capacity is declared (then doubled)


class Solution(NamedTuple):
    """A copy of the solution part of a state (what a failed solver operation must put back)."""
    n: int
    alpha: np.ndarray
    g: np.ndarray
    status: np.ndarray
    S: np.ndarray
    rho: float
    g_err: float
    fitted: bool


class Rollback:
    """On a SolverError inside the context, put the solver's state back as it was on entry: coefficients, g,
    sets and rho from a copy (O(n), ~1.4 us at 1,024 atoms), the inverse rebuilt from K for that margin set. The
    caller then undoes its own bookkeeping (the token's record and multiplicity), so a failed add or remove
    leaves the memory as it was. A class rather than a generator context: it is entered on every solver-path
    operation, and costs a third as much."""

    __slots__ = ("solver", "saved")

    def __init__(self, solver: ExactSolver):
        st = solver.state
        buf, n = st.buf, st.n
        self.solver = solver
        self.saved = Solution(n, buf.alpha[:n].copy(), buf.g[:n].copy(), buf.status[:n].copy(),
                              st.margin().copy(), st.rho, st.g_err, st.fitted)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is not None and issubclass(exc_type, SolverError):
            st, saved = self.solver.state, self.saved
            n = saved.n
            st.buf.alpha[:n], st.buf.g[:n], st.buf.status[:n] = saved.alpha, saved.g, saved.status
            st.rho, st.g_err, st.fitted = saved.rho, saved.g_err, saved.fitted
            self.solver.set_margin(saved.S)
        return False


class ExactSolver:
    """The solver of one memory's :class:`SolverState` (``state``): every operation leaves it optimal within
    ``state.tol``, or raises SolverError with the state as it was. ``capacity``: atom slots to allocate at
    first (a budgeted memory knows it holds at most B + 1); storage grows by doubling past it."""

    def __init__(self, state: SolverState, capacity: int | None = None):
        self.state = state
        self.capacity = capacity

    def ensure_capacity(self, n: int) -> None:
        st = self.state
        if n <= st.cap:
            return
        cap = max(16, 2 * st.cap, n) if st.cap or self.capacity is None else max(n, self.capacity)
        st.atoms.grow(cap)
        st.buf = with_atom_capacity(st.buf, st.n, cap)
        st.cap = cap
        # A declared capacity bounds the margin set too (the pipeline's budgeted memories never grow buffers)
        self.ensure_margin_capacity(cap if self.capacity is not None else MARGIN_CAPACITY_START)

    def ensure_margin_capacity(self, m: int) -> None:
        """Margin buffers (the bordered inverse, K_SS, the single-precision margin rows) for at least m margin
        atoms, doubling. They are sized by the margin set, not by the atoms: at 4,096 atoms three atom-sized
        square buffers would be ~340 MB beside the Gram matrix's 134 MB."""
        st = self.state
        if m > st.buf.KSS.shape[0]:
            st.buf = core.enlarged_margin_buffers(st.buf, st.n, m)

    def exact_g(self) -> np.ndarray:
        st = self.state
        g = np.empty(st.n)
        core.exact_g(st.buf.K, st.buf.alpha, st.n, st.rho, st.diag, g)
        return g

    def exact_maintained_g(self) -> np.ndarray:
        """The maintained g (a view), first recomputed from the coefficients if it carries any error.

        A solver operation leaves g within a bound of exact (``solver_core.finish``: recomputing every g costs
        as much as the decrement's path itself, and the next operation's sweep needs only the bound); whatever
        reads g recomputes it here, once.
        """
        st = self.state
        if st.g_err:
            self.set_exact_g()
        return st.buf.g[:st.n]

    def set_exact_g(self) -> None:
        st = self.state
        core.exact_g(st.buf.K, st.buf.alpha, st.n, st.rho, st.diag, st.buf.g)
        st.g_err = 0.0

    def set_margin(self, slots: np.ndarray) -> None:
        """Make ``slots`` the margin set and refactor the inverse from K."""
        st = self.state
        m = len(slots)
        self.ensure_margin_capacity(m)
        buf = st.buf
        buf.S[:m] = slots
        buf.ints[MARGIN_SIZE] = m
        core.refactor(buf)
        core.gather_margin_rows32(buf.K, buf.S, m, st.n, buf.KS32)

    def seed(self) -> None:
        """First feasible state: an exact batch solve of the tokens stored so far (a few of them)."""
        st = self.state
        with Rollback(self):
            live = st.live_slots()
            sol = self.batch_solve(live, st.box())
            if sol.residual > st.tol:
                raise SolverError(f"could not seed the memory: KKT residual {sol.residual:.3g} > tol={st.tol:g}")
            self.adopt(live, sol)
            st.fitted = True
            self.finish()

    def batch_solve(self, idx: np.ndarray, box: np.ndarray, start: np.ndarray | None = None) -> BatchSolution:
        """Exact batch solve over atoms ``idx`` (``kkt.solve_exact``), from ``start`` or else from
        scikit-learn's solution of the same atoms."""
        st = self.state
        n = len(idx)
        # atoms in slots 0..n-1 (a memory's first solution): a block copy instead of a gather
        K = st.buf.K[:n, :n].copy() if n and idx[-1] == n - 1 else st.buf.K[np.ix_(idx, idx)]
        if start is None:
            start = sklearn_alpha_guess(K, st.atoms.mult[idx], st.C)
        return solve_exact(K, box[idx], start, diag=st.diag, tol=st.tol * 1e-2)

    def adopt(self, idx: np.ndarray, sol: BatchSolution) -> None:
        """Take a batch solution over atoms ``idx`` as the state (the inverse rebuilt for its margin set)."""
        st = self.state
        st.buf.alpha[idx] = sol.alpha
        st.buf.status[idx] = sol.status
        st.rho = sol.rho
        st.g_err = math.inf  # g is not the new coefficients'
        self.set_margin(idx[sol.status == MARGIN])

    def outside(self, g: float) -> bool:
        """Whether a new atom with decision value ``g`` lies outside the description (its coefficient must
        rise), rather than in the reserve set."""
        return g < -1e-2 * self.state.tol

    def admit(self, slot: int) -> None:
        """Restore optimality after atom ``slot`` gained a token (a new atom or a duplicate copy)."""
        st = self.state
        buf = st.buf
        buf.g[slot] = core.decision_value_of(buf.K, buf.alpha, slot, st.n, st.rho, st.diag)
        status, mult = buf.status[slot], st.atoms.mult[slot]
        if status == BOUND or (mult == 1 and self.outside(buf.g[slot])):
            # Below the boundary (or a bound atom whose box just grew): raise its coefficient.
            self.move_coefficient(slot, +1.0)
        elif mult == 1:
            buf.status[slot] = RESERVE  # inside the description: no solver work
            if not buf.ints[MARGIN_SIZE]:
                self.finish()  # rho is unpinned: keep it at the midpoint of its (possibly narrower) interval
        # A margin or reserve atom whose box grew stays optimal as it is.

    def release(self, slot: int) -> None:
        """Restore optimality after atom ``slot``'s multiplicity (so its box) was lowered by one."""
        st = self.state
        buf = st.buf
        if buf.status[slot] == RESERVE or buf.alpha[slot] < buf.box[slot] - BOUNDARY_SNAP:
            # A zero coefficient, or one still inside the smaller box: the optimum is unchanged. One within
            # rounding of the new box is on it (the polish's rule) and goes to the bound set, which can leave the
            # margin set empty and rho at its midpoint.
            return
        self.move_coefficient(slot, -1.0)  # a zero box leaves the atom in reserve; the caller drops it

    def move_coefficient(self, c: int, s: float) -> None:
        """Move a_c monotonically to its new box along the exact solution path, then polish and check the end
        state (``solver_core.move_coefficient``, one compiled call)."""
        st = self.state
        with Rollback(self):
            outcome, rho, res, st.g_err, st.buf = core.move_coefficient(
                st.buf, st.settings, st.n, c, s, st.rho, st.g_err)
            if outcome == core.SWEPT_NO_EVENT:
                raise SolverError("no reachable bookkeeping event: the retained problem is infeasible")
            if outcome == core.SWEPT_ITERATION_CAP:
                raise SolverError("the incremental/decremental path did not terminate")
            self.settle(rho, res, c if st.buf.box[c] == 0.0 else -1)

    def finish(self) -> None:
        """Polish the end state of an operation and repair it if its KKT residual exceeds ``tol``.

        The sweep accumulates rounding in a and rho; re-solving the bordered system on the final partition
        with the maintained inverse (iterative refinement; a rebuilt inverse when that does not converge) removes
        it. The residual is exact; g is left within its stated error bound (see ``solver_core.finish``).
        """
        st = self.state
        rho, res, st.g_err = core.finish(st.buf, st.settings, st.n, -1, st.rho, st.g_err)
        self.settle(rho, res, -1)

    def settle(self, rho: float, res: float, ex: int) -> None:
        """Take ``finish``'s end state: rho (the midpoint of its interval when the margin set is empty), and a
        repair when the KKT residual exceeds ``tol``. ``ex``: an atom left out of the state (-1: none)."""
        st = self.state
        buf, box = st.buf, st.box()
        if buf.ints[MARGIN_SIZE]:
            st.rho = float(rho)
        else:
            st.rho = self.midpoint_rho(self.atoms_except(ex))
            self.set_exact_g()
            res = core.residual(buf.alpha, buf.g, box, buf.status, st.n, ex)
        if res > st.tol:
            self.repair(self.atoms_except(ex), box)

    def atoms_except(self, slot: int) -> np.ndarray:
        st = self.state
        live = st.live_slots()
        return live[live != slot]

    def midpoint_rho(self, idx: np.ndarray) -> float:
        """Midpoint rho over atoms ``idx``, summed in atom creation order so that the same state gives the same
        bits whatever slots its atoms occupy (an eviction's certificate predicts the digest after it)."""
        st = self.state
        idx = idx[np.argsort(st.atoms.seq[idx], kind="stable")]
        return midpoint_rho(st.buf.K[np.ix_(idx, idx)], st.buf.alpha[idx], st.buf.status[idx],
                            np.full(len(idx), st.diag))

    def repair(self, idx: np.ndarray, box: np.ndarray) -> None:
        """Last-resort exact batch solve (counted; should be rare): from the current coefficients, and when
        that start does not reach ``tol`` (near-duplicate keys can leave it far off), from scikit-learn's
        solution of the same atoms, the start the memory is seeded from."""
        st = self.state
        st.count_guard("repair")
        sol = self.batch_solve(idx, box, start=st.buf.alpha[idx])
        if sol.residual > st.tol:
            sol = self.batch_solve(idx, box)
        if sol.residual > st.tol:
            raise SolverError(f"KKT residual {sol.residual:.3g} exceeds tol={st.tol:g} after repair")
        self.adopt(idx, sol)
        self.set_exact_g()
