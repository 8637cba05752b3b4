"""The exact solver's control, once per operation: the first (seeded) solution, admitting a token, releasing one,
the end-of-operation polish and the last-resort repair. The path itself runs compiled (``memory.solver_core``)."""
import math

import numpy as np

from . import solver_core as core
from .errors import SolverError
from .kkt import BOUND, BOUNDARY_SNAP, MARGIN, RESERVE, midpoint_rho, solve_exact
from .libsvm import sklearn_alpha_guess
from .solver_state import GUARDS, Rollback


class ExactSolver:
    """Solver methods of :class:`memory.SVMemory` (which holds the state they work on: ``_buf``, ``_atoms``,
    ``_settings``, ``rho_``, ``_g_err``, ``_fitted``, ``C``, ``tol``, ``_diag``)."""

    def _exact_g(self) -> np.ndarray:
        g = np.empty(self._n)
        core.exact_g(self._buf.K, self._buf.alpha, self._n, self.rho_, self._diag, g)
        return g

    def _exact_maintained_g(self) -> np.ndarray:
        """The maintained g (a view), first recomputed from the coefficients if it carries any error.

        A solver operation leaves g within a bound of exact (``solver_core.finish``: recomputing every g costs
        as much as the decrement's path itself, and the next operation's sweep needs only the bound); whatever
        reads g recomputes it here, once.
        """
        if self._g_err:
            self._set_exact_g()
        return self._buf.g[:self._n]

    def _set_exact_g(self) -> None:
        core.exact_g(self._buf.K, self._buf.alpha, self._n, self.rho_, self._diag, self._buf.g)
        self._g_err = 0.0

    def _set_margin(self, slots: np.ndarray) -> None:
        """Make ``slots`` the margin set and refactor the inverse from K."""
        m = len(slots)
        self._ensure_margin_capacity(m)
        buf = self._buf
        buf.S[:m] = slots
        buf.ints[0] = m
        core.refactor(buf)
        core.gather_margin_rows32(buf.K, buf.S, m, self._n, buf.KS32)

    def _seed(self) -> None:
        """First feasible state: an exact batch solve of the tokens stored so far (a few of them)."""
        with Rollback(self):
            live = self._live_slots()
            sol = self._batch_solve(live, self._box())
            if sol.residual > self.tol:
                raise SolverError(f"could not seed the memory: KKT residual {sol.residual:.3g} > tol={self.tol:g}")
            self._adopt(live, sol)
            self._fitted = True
            self._finish()

    def _batch_solve(self, idx: np.ndarray, box: np.ndarray, start: np.ndarray | None = None):
        """Exact batch solve over atoms ``idx`` (``kkt.solve_exact``), from ``start`` or else from
        scikit-learn's solution of the same atoms."""
        K = self._buf.K[np.ix_(idx, idx)]
        if start is None:
            start = sklearn_alpha_guess(K, self._atoms.mult[idx], self.C)
        return solve_exact(K, box[idx], start, diag=self._diag, tol=self.tol * 1e-2)

    def _adopt(self, idx: np.ndarray, sol) -> None:
        """Take a batch solution over atoms ``idx`` as the state (the inverse rebuilt for its margin set)."""
        self._buf.alpha[idx] = sol.alpha
        self._buf.status[idx] = sol.status
        self.rho_ = sol.rho
        self._g_err = math.inf  # g is not the new coefficients'
        self._set_margin(idx[sol.status == MARGIN])

    def _admit(self, slot: int) -> None:
        """Restore optimality after atom ``slot`` gained a token (a new atom or a duplicate copy)."""
        buf = self._buf
        act = np.flatnonzero(buf.alpha[:self._n])
        buf.g[slot] = self.rho_ - self._diag + 2.0 * (buf.K[slot, act] @ buf.alpha[act])
        status, mult = buf.status[slot], self._atoms.mult[slot]
        if status == BOUND or (mult == 1 and buf.g[slot] < -1e-2 * self.tol):
            # Below the boundary (or a bound atom whose box just grew): raise its coefficient.
            self._move_coefficient(slot, +1.0)
        elif mult == 1:
            buf.status[slot] = RESERVE  # inside the description: no solver work
            if not buf.ints[0]:
                self._finish()  # rho is unpinned: keep it at the midpoint of its (possibly narrower) interval
        # A margin or reserve atom whose box grew stays optimal as it is.

    def _release(self, slot: int) -> None:
        """Restore optimality after atom ``slot``'s multiplicity (so its box) was lowered by one."""
        buf = self._buf
        if buf.status[slot] == RESERVE or buf.alpha[slot] < buf.box[slot] - BOUNDARY_SNAP:
            # A zero coefficient, or one still inside the smaller box: the optimum is unchanged. One within
            # rounding of the new box is on it (the polish's rule) and goes to the bound set, which can leave the
            # margin set empty and rho at its midpoint.
            return
        self._move_coefficient(slot, -1.0)  # a zero box leaves the atom in reserve; the caller drops it

    def _move_coefficient(self, c: int, s: float) -> None:
        """Move a_c monotonically to its new box along the exact solution path, then polish and check the end
        state (``solver_core.move_coefficient``, one compiled call)."""
        with Rollback(self):
            outcome, rho, res, self._g_err, self._buf = core.move_coefficient(
                self._buf, self._settings, self._n, c, s, self.rho_, self._g_err)
            if outcome == core.SWEPT_NO_EVENT:
                raise SolverError("no reachable bookkeeping event: the retained problem is infeasible")
            if outcome == core.SWEPT_ITERATION_CAP:
                raise SolverError("the incremental/decremental path did not terminate")
            self._settle(rho, res, c if self._buf.box[c] == 0.0 else -1)

    def _finish(self) -> None:
        """Polish the end state of an operation and repair it if its KKT residual exceeds ``tol``.

        The sweep accumulates rounding in a and rho; re-solving the bordered system on the final partition
        with the maintained inverse (iterative refinement; a rebuilt inverse when that does not converge) removes
        it. The residual is exact; g is left within its stated error bound (see ``solver_core.finish``).
        """
        rho, res, self._g_err = core.finish(self._buf, self._settings, self._n, -1, self.rho_, self._g_err)
        self._settle(rho, res, -1)

    def _settle(self, rho: float, res: float, ex: int) -> None:
        """Take ``finish``'s end state: rho (the midpoint of its interval when the margin set is empty), and a
        repair when the KKT residual exceeds ``tol``. ``ex``: an atom left out of the state (-1: none)."""
        buf, box = self._buf, self._box()
        if buf.ints[0]:
            self.rho_ = float(rho)
        else:
            self.rho_ = self._midpoint_rho(self._atoms_except(ex))
            self._set_exact_g()
            res = core.residual(buf.alpha, buf.g, box, buf.status, self._n, ex)
        if res > self.tol:
            self._repair(self._atoms_except(ex), box)

    def _atoms_except(self, slot: int) -> np.ndarray:
        live = self._live_slots()
        return live[live != slot]

    def _midpoint_rho(self, idx: np.ndarray) -> float:
        """Midpoint rho over atoms ``idx``, summed in atom creation order so that the same state gives the same
        bits whatever slots its atoms occupy (an eviction's certificate predicts the digest after it)."""
        idx = idx[np.argsort(self._atoms.seq[idx], kind="stable")]
        return midpoint_rho(self._buf.K[np.ix_(idx, idx)], self._buf.alpha[idx], self._buf.status[idx],
                            np.full(len(idx), self._diag))

    def _repair(self, idx: np.ndarray, box: np.ndarray) -> None:
        """Last-resort exact batch solve (counted; should be rare): from the current coefficients, and when
        that start does not reach ``tol`` (near-duplicate keys can leave it far off), from scikit-learn's
        solution of the same atoms, the start the memory is seeded from."""
        self._buf.guards[GUARDS.index("repair")] += 1
        sol = self._batch_solve(idx, box, start=self._buf.alpha[idx])
        if sol.residual > self.tol:
            sol = self._batch_solve(idx, box)
        if sol.residual > self.tol:
            raise SolverError(f"KKT residual {sol.residual:.3g} exceeds tol={self.tol:g} after repair")
        self._adopt(idx, sol)
        self._set_exact_g()
