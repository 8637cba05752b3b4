"""The exact, budget-free SV memory: a fixed-box one-class SVM maintained by incremental/decremental steps.

Conventions (see ``shared/design/sv-memory.md``):

* kernel ``k(a, b) = exp(-gamma ||a - b||^2)`` (``gamma = 1 / sigma^2``), so ``k(x, x) = 1``;
* problem ``min a^T K a - 1^T a`` s.t. ``sum(a) = 1, 0 <= a_i <= C`` with C fixed for the memory's life;
* decision value (g-form) ``g(x) = rho - k(x, x) + 2 sum_j a_j k(x_j, x)``: > 0 inside the description;
* reserve tokens (a = 0, g >= 0) carry exactly zero weight and can be evicted with a certificate.

Exact duplicate keys are stored once, as an *atom* with multiplicity m and box m C (exactly equivalent to m
copies, and it keeps the bordered KKT matrix non-singular); each copy's coefficient is a / m, the
minimum-norm split among copies, which makes the readout unique.

This module is the public API: validation, feasibility, atoms and duplicates. A memory holds its state
(``memory.solver_state.SolverState``: buffers, atom registry, rho) and a solver over it (``memory.exact_solver``:
seed, admit, release, polish, repair), whose inner loops are compiled (``memory.solver_core``); the token/atom
registry is ``memory.atoms``; persistence (``memory.persistence``) writes and reads the state.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Hashable, NamedTuple

import numpy as np

from . import solver_core as core
from .atoms import atom_leaf
from .certificates import EvictionCertificate, Partition, leaves_in_order, state_digest
from .errors import InfeasibleError, InvalidKeyError, NotCertifiableError, SolverError
from .exact_solver import ExactSolver
from .kernels import KERNEL_DIAGONAL, check_kernel, rbf, squared_distances
from .kkt import BOUND, MARGIN, RESERVE, kkt_residual
from .persistence import read_state, save_state
from .solver_state import FREE, MARGIN_SIZE, SolverSettings, SolverState

if TYPE_CHECKING:
    from pathlib import Path

# Feasibility n C >= 1 is tested with this slack so that C = 1 / B admits exactly B tokens despite rounding.
_FEAS_SLACK = 1e-12
_STATUS_NAMES = {MARGIN: "margin", BOUND: "bound", RESERVE: "reserve"}


class KKTSystem(NamedTuple):
    """The active KKT system of a fitted memory, copied, over its atoms (what implicit differentiation needs)."""
    atom_of_token: np.ndarray  # atom index of each token, in ``token_ids()`` order
    margin: np.ndarray         # margin atoms, in the inverse's row order
    inverse: np.ndarray        # inverse of the bordered matrix [[0, 1^T], [1, 2 K_SS]]
    alpha: np.ndarray          # atom coefficients
    status: np.ndarray         # atom KKT sets (kkt.MARGIN, BOUND, RESERVE)
    box: np.ndarray            # atom boxes, multiplicity * C
    mult: np.ndarray           # atom multiplicities


class SVMemory:
    """Fixed-box one-class SV memory with exact add/remove and certified eviction.

    Parameters
    ----------
    C : float
        Box on every coefficient, fixed for the memory's life. The problem is feasible once the memory holds
        n >= ceil(1 / C) tokens; before that the memory stores tokens ungated and has no solution yet.
    kernel : {"rbf"}
        Kernel; must have a constant diagonal.
    gamma : float
        RBF width, ``k(a, b) = exp(-gamma ||a - b||^2)``.
    tol : float
        KKT tolerance: a state whose residual exceeds it is repaired (and counted in ``guard_events_``).
    tau_res : float
        Reserve tokens with ``g <= tau_res`` are certified but flagged as not strictly complementary.
    refactor_every : int
        Recompute the KKT inverse from scratch after this many rank-one updates.
    capacity : int, optional
        Atoms to allocate storage for up front (a budgeted memory knows it holds at most B + 1); storage grows
        by doubling past it.

    Attributes
    ----------
    rho_ : float
        Offset of the decision function (g-form).
    alpha_ : dict
        Coefficient of every stored token, by token id.
    guard_events_ : collections.Counter
        Numerical safeguards that fired: refactorisations, small pivots, repairs.
    """

    _EPS = 1e-11       # rates below this are treated as zero when deciding whether an event is reachable
    _REL_PIVOT = 1e-9  # relative Schur-pivot test for a rank-one growth of the inverse
    _R_CAP = 1e9       # a rank-one update of the inverse with an entry above this triggers a refactorisation

    def __init__(self, C: float, kernel: str = "rbf", gamma: float = 1.0, tol: float = 1e-10,
                 tau_res: float = 1e-10, refactor_every: int = 500, capacity: int | None = None):
        C = float(C)
        if not math.isfinite(C) or C <= 0.0:
            raise InfeasibleError(f"C must be a positive finite number, got {C!r}")
        self.C = C
        self.kernel = kernel
        self.gamma = check_kernel(kernel, gamma)
        self.tol = float(tol)
        self.tau_res = float(tau_res)
        self.refactor_every = int(refactor_every)
        self.capacity = None if capacity is None else int(capacity)
        self._diag = KERNEL_DIAGONAL[kernel]
        self._reset()

    def _reset(self) -> None:
        """An empty memory with this memory's parameters."""
        settings = SolverSettings(self._diag, self._EPS, self._REL_PIVOT, self.refactor_every, self._R_CAP)
        self._state = SolverState(self.C, self.tol, settings)
        self._solver = ExactSolver(self._state, self.capacity)

    # ------------------------------------------------------------------ properties
    @property
    def guard_events_(self) -> Counter:
        return self._state.guard_counts()

    @property
    def rho_(self) -> float:
        return self._state.rho

    @property
    def n_tokens(self) -> int:
        return len(self._state.atoms.tokens)

    @property
    def n_atoms(self) -> int:
        return self._state.atoms.n_atoms

    @property
    def min_tokens(self) -> int:
        """Smallest number of tokens for which the problem is feasible, ceil(1 / C)."""
        return max(1, math.ceil(1.0 / self.C - _FEAS_SLACK))

    @property
    def is_feasible(self) -> bool:
        return self._state.fitted

    @property
    def alpha_(self) -> dict:
        self.check_fitted()
        atoms = self._state.atoms
        out = {}
        for tid, record in atoms.tokens.items():
            slot = atoms.slot_of_seq[record.seq]
            out[tid] = float(self._state.buf.alpha[slot] / atoms.mult[slot])
        return out

    def token_ids(self) -> list:
        """Stored token ids in arrival order (the dict keeps insertion order, which is arrival order)."""
        return list(self._state.atoms.tokens)

    def __contains__(self, token_id) -> bool:
        return token_id in self._state.atoms.tokens

    def __len__(self) -> int:
        return len(self._state.atoms.tokens)

    def key_of(self, token_id: Hashable) -> np.ndarray:
        return self._state.atoms.X[self._state.atoms.slot_of(token_id)].copy()

    def value_of(self, token_id: Hashable) -> np.ndarray:
        self._state.atoms.slot_of(token_id)
        return self._state.atoms.tokens[token_id].value.copy()

    def decision_value_of(self, token_id: Hashable) -> float:
        """g of a stored token, computed from the coefficients in fp64."""
        self.check_fitted()
        return float(self._solver.exact_maintained_g()[self._state.atoms.slot_of(token_id)])

    def status_of(self, token_id: Hashable) -> str:
        """'margin', 'bound' or 'reserve'."""
        self.check_fitted()
        return _STATUS_NAMES[int(self._state.buf.status[self._state.atoms.slot_of(token_id)])]

    def partition(self) -> Partition:
        """The three token-id sets (margin S, bound E, reserve R)."""
        self.check_fitted()
        sets = {MARGIN: set(), BOUND: set(), RESERVE: set()}
        for tid, record in self._state.atoms.tokens.items():
            sets[int(self._state.buf.status[self._state.atoms.slot_of_seq[record.seq]])].add(tid)
        return Partition(frozenset(sets[MARGIN]), frozenset(sets[BOUND]), frozenset(sets[RESERVE]))

    def kkt_residual(self) -> float:
        """KKT residual of the current state, recomputing g from the coefficients."""
        self.check_fitted()
        live = self._state.live_slots()
        g = self._solver.exact_g()
        return kkt_residual(self._state.buf.alpha[live], g[live], self._state.box()[live], self._state.buf.status[live])

    def kkt_system(self) -> KKTSystem:
        """A copy of the active KKT system over the atoms, atoms numbered 0..n_atoms-1."""
        self.check_fitted()
        live = self._state.live_slots()
        index = np.full(self._state.n, -1, dtype=np.int64)
        index[live] = np.arange(len(live))
        st = self._state
        buf = st.buf
        return KKTSystem(
            atom_of_token=np.array([index[st.atoms.slot_of(t)] for t in self.token_ids()], dtype=np.int64),
            margin=index[st.margin()], inverse=st.kkt_inverse().copy(), alpha=buf.alpha[live].copy(),
            status=buf.status[live].copy(), box=st.box()[live].copy(), mult=st.atoms.mult[live].copy())

    # ------------------------------------------------------------------ validation
    def check_fitted(self) -> None:
        """Raise InfeasibleError when the memory has no solution yet (fewer than ``min_tokens`` tokens)."""
        if not self._state.fitted:
            raise InfeasibleError(
                f"the memory holds {self.n_tokens} token(s) but C={self.C!r} needs at least {self.min_tokens} "
                f"(n * C >= 1) before it has a solution")

    def _check_key(self, key) -> np.ndarray:
        try:
            x = np.asarray(key, dtype=np.float64)
        except (TypeError, ValueError):
            raise InvalidKeyError(f"a key must be a numeric vector, got {key!r}") from None
        if x.ndim != 1 or x.size == 0:
            raise InvalidKeyError(f"a key must be a non-empty 1-D vector, got shape {np.shape(key)}")
        if self._state.dim is not None and x.size != self._state.dim:
            raise InvalidKeyError(f"key has dimension {x.size}, the memory's keys have dimension {self._state.dim}")
        if not np.isfinite(x).all():
            raise InvalidKeyError(f"key has non-finite entries: {x.tolist()}")
        return x + 0.0  # turns -0.0 into 0.0 so that equal keys have equal bytes

    def _check_value(self, value, key, is_key: bool = False) -> np.ndarray:
        """``is_key``: the value given is the key object itself (an auto-associative stream), checked already."""
        v = key.copy() if value is None else np.asarray(value, dtype=np.float64).ravel()
        if value is not None and not is_key and (v.size == 0 or not np.isfinite(v).all()):
            raise InvalidKeyError(f"value must be a non-empty finite vector, got {np.asarray(value).tolist()}")
        if self._state.value_dim is not None and v.size != self._state.value_dim:
            raise InvalidKeyError(f"value has dimension {v.size}, the memory's values have dimension "
                                  f"{self._state.value_dim}")
        return v

    def _check_queries(self, X):
        Q = np.asarray(X, dtype=np.float64)
        single = Q.ndim == 1
        Q = np.atleast_2d(Q)
        if Q.ndim != 2 or (self._state.dim is not None and Q.shape[1] != self._state.dim):
            raise InvalidKeyError(f"queries must have shape (m, {self._state.dim}), got {np.shape(X)}")
        if not np.all(np.isfinite(Q)):
            raise InvalidKeyError("queries have non-finite entries")
        return Q, single

    # ------------------------------------------------------------------ slots and storage
    def _kernel_row(self, x: np.ndarray) -> np.ndarray:
        """k(x, X[i]) for slots 0..n-1, with room for a new atom's slot made first."""
        st = self._state
        n = st.n
        if not st.atoms.free:
            self._solver.ensure_capacity(n + 1)
        d2 = np.empty(n)
        core.squared_distances_to(x, st.atoms.X, n, d2)
        return np.exp(-self.gamma * d2)  # numpy's exp, not the compiled one: they differ in the last bit

    def _new_atom(self, x: np.ndarray, krow: np.ndarray | None = None) -> int:
        """A slot for key x (a free one if any), its kernel row and column filled in (``krow``: the row
        :meth:`_kernel_row` gave, when it was computed already), in the reserve set."""
        st = self._state
        if krow is None:
            krow = self._kernel_row(x)
        n = st.n
        slot = st.atoms.take_slot()
        st.atoms.open_atom(slot, x)
        buf = st.buf
        core.place_atom(buf.K, buf.KS32, buf.S, int(buf.ints[MARGIN_SIZE]), buf.alpha, buf.g, buf.status, slot, n, krow,
                        self._diag)
        st.set_multiplicity(slot, 0)
        return slot

    def _drop_atom(self, slot: int) -> None:
        """Delete an atom: its slot becomes free (O(1); see ``solver_core.FREE``). The key is zeroed at once;
        the kernel row and column stay until a new atom overwrites them, and :meth:`save` writes them as 0."""
        buf = self._state.buf
        buf.alpha[slot] = buf.g[slot] = 0.0
        self._state.set_multiplicity(slot, 0)
        buf.status[slot] = FREE
        self._state.atoms.close_atom(slot)

    # ------------------------------------------------------------------ public API: add / remove
    def add(self, key: list | np.ndarray, value: np.ndarray | None = None,
            token_id: Hashable | None = None, check_input: bool = True) -> Hashable:
        """Insert one event; returns its token id.

        The new token enters the reserve set at O(stored) cost when it already lies inside the description
        (g >= 0); otherwise its coefficient is raised by the adiabatic incremental procedure. ``value`` defaults
        to the key itself (an auto-associative memory). ``check_input=False`` (scikit-learn's convention): ``key``
        is a row of :meth:`check_keys`' result, checked with its block already.
        """
        x, v, token_id = self._check_new_token(key, value, token_id, check_input)
        return self._add(x, v, token_id, self._state.atoms.slot_of_key(x))

    def check_keys(self, keys: list | np.ndarray) -> np.ndarray:
        """A block of keys (m x dim) checked at once, as :meth:`add` checks one: fp64, finite, of the memory's
        dimension, -0.0 made 0.0; its rows may then be added with ``check_input=False`` (a long stream's per-key
        checks were a third of its cost)."""
        X = np.asarray(keys, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] == 0:
            raise InvalidKeyError(f"keys must be a block of shape (m, dim), got shape {np.shape(keys)}")
        if self._state.dim is not None and X.shape[1] != self._state.dim:
            raise InvalidKeyError(f"keys have dimension {X.shape[1]}, the memory's keys have dimension "
                                  f"{self._state.dim}")
        if not np.isfinite(X).all():
            bad = int(np.flatnonzero(~np.isfinite(X).all(axis=1))[0])
            raise InvalidKeyError(f"key {bad} of the block has non-finite entries: {X[bad].tolist()}")
        return np.ascontiguousarray(X + 0.0)

    def _check_new_token(self, key, value, token_id, check_input: bool = True) -> tuple:
        x = self._check_key(key) if check_input else key
        v = self._check_value(value, x, is_key=value is key)
        if token_id is None:
            token_id = self._state.atoms.new_token_id()
        elif token_id in self._state.atoms.tokens:
            raise ValueError(f"token id {token_id!r} is already stored")
        return x, v, token_id

    def _add(self, x: np.ndarray, v: np.ndarray, token_id: Hashable, slot: int | None,
             krow: np.ndarray | None = None) -> Hashable:
        """:meth:`add` of a checked token; ``slot``: the atom of its key, None for a new atom (whose kernel row
        ``krow`` may be computed already)."""
        if self._state.dim is None:
            self._state.atoms.set_dim(x.size)
        if self._state.value_dim is None:
            self._state.value_dim = v.size
        if slot is None:
            slot = self._new_atom(x, krow)
        self._state.atoms.record(token_id, slot, v)
        self._state.set_multiplicity(slot, self._state.atoms.mult[slot] + 1)
        try:
            if self._state.fitted:
                self._solver.admit(slot)
            elif self.n_tokens * self.C >= 1.0 - _FEAS_SLACK:
                self._solver.seed()
        except SolverError:
            # the solution is already back as it was
            self._state.set_multiplicity(slot, self._state.atoms.mult[slot] - 1)
            self._forget_token(token_id, slot)
            raise
        return token_id

    def offer(self, key: list | np.ndarray, value: np.ndarray | None, token_id: Hashable,
              check_input: bool = True) -> bool:
        """Add one event to a memory kept at its budget, where the caller evicts the reserve token with the largest
        slack next. True when the event is that token: a new reserve atom with the largest slack, which a certified
        eviction takes straight back out. The state is then exactly what :meth:`add` and :meth:`evict` of it leave
        (the same buffer writes, the registry's counters advanced), without their bookkeeping; most events of a
        long stream take this path (93 % of the demo's cohort stream). False: the event was added as :meth:`add`
        adds it (its key checked and its kernel row computed once).

        It passes only where the outcome is that of those calls to the bit: a fitted memory whose rho is pinned
        (an eviction moves no offset) and whose maintained g is exact (the largest slack is read from it).
        ``check_input``: as :meth:`add`'s."""
        x, v, token_id = self._check_new_token(key, value, token_id, check_input)
        st = self._state
        atoms = st.atoms
        slot = atoms.slot_of_key(x)
        if slot is not None or not st.fitted or st.g_err or not st.buf.ints[MARGIN_SIZE]:
            self._add(x, v, token_id, slot)
            return False
        krow = self._kernel_row(x)
        n = st.n
        slot, n_after = (atoms.free[-1], n) if atoms.free else (n, n + 1)
        buf = st.buf
        core.place_atom(buf.K, buf.KS32, buf.S, int(buf.ints[MARGIN_SIZE]), buf.alpha, buf.g, buf.status, slot, n, krow,
                        self._diag)
        g = core.decision_value_of(buf.K, buf.alpha, slot, n_after, st.rho, st.diag)   # as admit computes it
        buf.g[slot] = g
        through = not self._solver.outside(g) and core.reserve_with_largest_g(buf.status, buf.g, n_after) == slot
        buf.alpha[slot] = buf.g[slot] = 0.0     # the slot as _drop_atom leaves it (its key, box, seq already are)
        buf.status[slot] = FREE
        if not through:
            self._add(x, v, token_id, None, krow)
            return False
        next(atoms.next_seq)
        next(atoms.arrivals)
        return True

    def fit(self, X: list | np.ndarray, token_ids: list | None = None) -> SVMemory:
        """Replace the memory's contents by the rows of ``X`` (auto-associative: each row is its own value;
        token ids 0..n-1 unless given), solved in one batch; returns the memory.

        The state is the one adding the rows one by one reaches, to rounding (the problem's optimum, unique for
        distinct keys; the same partition, exact zeros, coefficients within 1e-12 in the tests):
        scikit-learn's solution snapped to an exact KKT state, as a new memory is seeded, over one Gram matrix
        instead of n solver operations (4x faster for a stay's full history). Where that batch solve does not
        reach ``tol`` the rows are added one by one instead (which raises SolverError where :meth:`add` would).
        """
        try:
            Q = np.asarray(X, dtype=np.float64)
        except (TypeError, ValueError):
            raise InvalidKeyError(f"fit takes a numeric array of keys, one per row, got {X!r}") from None
        if Q.ndim != 2 or Q.shape[1] == 0:
            raise InvalidKeyError(f"fit takes a 2-D array of keys, one per row, got shape {np.shape(X)}")
        if not np.isfinite(Q).all():
            raise InvalidKeyError("keys have non-finite entries")
        ids = list(range(len(Q))) if token_ids is None else list(token_ids)
        if len(ids) != len(Q) or len(set(ids)) != len(ids):
            raise ValueError(f"fit needs one distinct token id per row: {len(Q)} rows, {len(set(ids))} distinct ids")
        self._reset()
        if not len(Q):
            return self
        Q = Q + 0.0  # -0.0 -> 0.0, as for a key given to add
        atoms = self._state.atoms
        atoms.set_dim(Q.shape[1])
        self._state.value_dim = Q.shape[1]
        slot_of_row = np.empty(len(Q), dtype=np.int64)
        for i, x in enumerate(Q):
            slot = atoms.slot_of_key(x)
            if slot is None:
                self._solver.ensure_capacity(atoms.n + 1)
                slot = atoms.take_slot()
                atoms.open_atom(slot, x)
            slot_of_row[i] = slot
            atoms.record(ids[i], slot, x)
        n = atoms.n
        buf = self._state.buf
        buf.K[:n, :n] = rbf(atoms.X[:n], atoms.X[:n], self.gamma)
        buf.K[np.arange(n), np.arange(n)] = self._diag
        buf.alpha[:n] = buf.g[:n] = 0.0
        buf.status[:n] = RESERVE
        for slot, k in enumerate(np.bincount(slot_of_row, minlength=n)):
            self._state.set_multiplicity(slot, k)
        if self.n_tokens * self.C >= 1.0 - _FEAS_SLACK:
            try:
                self._solver.seed()
            except SolverError:
                self._reset()
                for i, x in enumerate(Q):
                    self.add(x, token_id=ids[i])
        return self

    def learn_one(self, key: bytes, value: np.ndarray | None = None, token_id: Hashable | None = None) -> Hashable:
        """river's one-event name for :meth:`add`."""
        return self.add(key, value, token_id)

    def remove(self, token_id: Hashable) -> None:
        """Delete one token by the exact decremental procedure.

        Afterwards the state equals the fixed-C solution over the retained tokens (see
        :func:`memory.refit.verify_against_refit`).
        """
        slot = self._state.atoms.slot_of(token_id)
        if self.n_tokens == 1:
            raise InfeasibleError(f"cannot remove token {token_id!r}: it is the memory's last token")
        if self._state.fitted and (self.n_tokens - 1) * self.C < 1.0 - _FEAS_SLACK:
            raise InfeasibleError(
                f"removing token {token_id!r} would leave {self.n_tokens - 1} tokens, infeasible for "
                f"C={self.C!r} (needs n * C >= 1, i.e. at least {self.min_tokens} tokens)")
        self._state.set_multiplicity(slot, self._state.atoms.mult[slot] - 1)
        if self._state.fitted:
            try:
                self._solver.release(slot)
            except SolverError:
                # the solution is already back as it was
                self._state.set_multiplicity(slot, self._state.atoms.mult[slot] + 1)
                raise
        self._forget_token(token_id, slot)

    def remove_many(self, token_ids: list) -> None:
        """Delete several tokens (all-or-nothing on validation: unknown ids or infeasibility raise first)."""
        token_ids = list(dict.fromkeys(token_ids))
        for t in token_ids:
            self._state.atoms.slot_of(t)
        left = self.n_tokens - len(token_ids)
        if left < 1:
            raise InfeasibleError("cannot remove every token of the memory")
        if self._state.fitted and left * self.C < 1.0 - _FEAS_SLACK:
            raise InfeasibleError(f"removing {len(token_ids)} tokens would leave {left}, infeasible for "
                                  f"C={self.C!r} (needs at least {self.min_tokens})")
        for t in token_ids:
            self.remove(t)

    def _forget_token(self, token_id: Hashable, slot: int) -> None:
        """Drop the token's records (its atom's multiplicity is already decremented) and an emptied atom."""
        self._state.atoms.forget(token_id, slot)
        if self._state.atoms.mult[slot] == 0:
            self._drop_atom(slot)
            if self._state.fitted and not self._state.buf.ints[MARGIN_SIZE]:
                self._solver.finish()  # rho is unpinned: its interval may have widened; return to the midpoint

    # ------------------------------------------------------------------ certified eviction
    def certify_eviction(self, token_id: Hashable, digests: bool = True) -> EvictionCertificate:
        """Certificate that evicting a reserve token changes no output; raises for any other token.

        ``digests=False``: without the state digests before and after (None), for a caller that keeps no
        certificate (a streaming policy counts its certified evictions); every condition is still checked."""
        slot = self._state.atoms.slot_of(token_id)
        self.check_fitted()
        buf = self._state.buf
        if buf.status[slot] != RESERVE or buf.alpha[slot] != 0.0:
            raise NotCertifiableError(
                f"token {token_id!r} is in the {self.status_of(token_id)} set with coefficient "
                f"{buf.alpha[slot] / self._state.atoms.mult[slot]!r}; only reserve tokens (coefficient exactly 0) can "
                f"be evicted with a certificate")
        if self.n_tokens == 1:
            raise InfeasibleError(f"cannot evict token {token_id!r}: it is the memory's last token")
        n = self._state.n
        leaves = self._state.atoms.mult[slot] == 1  # the atom goes; otherwise it loses one copy (and C of its box)
        gone = slot if leaves else -1
        box = self._state.box().copy()
        if not leaves:
            box[slot] -= self.C
        rho_pinned = bool(buf.ints[MARGIN_SIZE])
        # evicting a reserve token changes no coefficient, so no g but rho's shift
        g = self._solver.exact_maintained_g()
        if rho_pinned:
            rho_after, g_after = self.rho_, g
        else:
            rho_after = self._solver.midpoint_rho(self._solver.atoms_except(gone))
            g_after = g[:n] + (rho_after - self.rho_)
        residual = float(core.residual(buf.alpha, g_after, box, buf.status, n, gone))
        gj = float(g[slot])
        return EvictionCertificate(
            token_id=token_id, alpha=float(buf.alpha[slot]), decision_value=gj, margin=gj,
            tau_res=self.tau_res, strictly_complementary=gj > self.tau_res, rho_pinned=rho_pinned,
            kkt_residual_after=residual, digest_before=self.state_digest() if digests else None,
            digest_after=self.state_digest(exclude=token_id, rho=rho_after) if digests else None)

    def evict(self, token_id: Hashable, certificate: EvictionCertificate | None = None,
              digests: bool = True) -> EvictionCertificate:
        """Remove a certified reserve token without any solver work; returns its certificate.

        ``read`` is bit-for-bit unchanged (and ``decision_function`` when rho is pinned): both sum over the
        nonzero coefficients in atom creation order, and neither that set nor its order changes. The state
        after is checked against the certificate's digest, unless it was issued without digests (``digests``,
        as in :meth:`certify_eviction`).
        """
        if certificate is None:
            cert = self.certify_eviction(token_id, digests=digests)
        elif certificate.token_id != token_id or certificate.digest_before != self.state_digest():
            raise NotCertifiableError(f"the certificate does not belong to token {token_id!r} in this state")
        else:
            cert = certificate
        slot = self._state.atoms.slot_of(token_id)
        self._state.set_multiplicity(slot, self._state.atoms.mult[slot] - 1)
        self._forget_token(token_id, slot)
        if cert.digest_after is not None and self.state_digest() != cert.digest_after:
            raise SolverError(f"state after evicting {token_id!r} does not match its certificate")
        return cert

    def state_digest(self, exclude: Hashable | None = None, rho: float | None = None) -> str:
        """SHA-256 over the solution state: C, gamma, rho, then every atom's leaf (SHA-256 of its key and token
        ids, cached per atom) and per-token coefficient, atoms in creation order (so the digest does not depend
        on how atoms occupy slots).

        ``exclude``: the digest of the state without that token (its coefficient unchanged: a reserve token's
        is 0), with ``rho`` in place of the current offset.
        """
        atoms = self._state.atoms
        rho = rho if rho is not None else (self.rho_ if self._state.fitted else float("nan"))
        live = self._state.live_slots()
        order = live[np.argsort(atoms.seq[live], kind="stable")]
        leaves = leaves_in_order(atoms.refresh_leaves(), order)
        mult = atoms.mult[:self._state.n].copy()
        if exclude is not None:
            slot = atoms.slot_of(exclude)
            pos = int(np.flatnonzero(order == slot)[0])
            mult[slot] -= 1
            if mult[slot]:
                leaves[pos] = atom_leaf(atoms.X[slot], [t for t in atoms.token_lists[slot] if t != exclude])
            else:
                del leaves[pos]
                order = np.delete(order, pos)
        coef = self._state.buf.alpha[order] / mult[order] if self._state.fitted else np.zeros(len(order))
        return state_digest(self.C, self.gamma, rho, leaves, coef)

    def reserve_with_largest_slack(self) -> Hashable:
        """The reserve token whose g is largest (the least likely to be needed again), or None."""
        self.check_fitted()
        st = self._state
        slot = core.reserve_with_largest_g(st.buf.status, st.buf.g, st.n)
        if slot < 0:
            return None
        if st.g_err:  # the maintained g carries an error bound: the largest exact g decides
            slot = core.reserve_with_largest_g(st.buf.status, self._solver.exact_maintained_g(), st.n)
        return st.atoms.token_lists[slot][0]

    def smallest_active(self) -> Hashable:
        """The active token with the smallest coefficient, margin tokens before bound ones."""
        self.check_fitted()
        n, buf = self._state.n, self._state.buf
        for code in (MARGIN, BOUND):
            act = np.flatnonzero(buf.status[:n] == code)
            if len(act):
                slot = act[np.argmin(buf.alpha[act] / self._state.atoms.mult[act])]
                return self._state.atoms.token_lists[slot][0]
        return None

    # ------------------------------------------------------------------ persistence
    def save(self, path: Path) -> None:
        """Write the full solver state (keys, Gram matrix, coefficients, KKT inverse) to an ``.npz`` file.

        Token ids must be JSON scalars (int or str). No pickle: the file loads with ``allow_pickle=False``.
        """
        if self.is_feasible:
            self._solver.exact_maintained_g()       # the file holds g exact
        save_state(path, self.get_params(), self._state, self.token_ids())

    def get_params(self) -> dict:
        """The constructor's parameters (scikit-learn's convention)."""
        return {"C": self.C, "kernel": self.kernel, "gamma": self.gamma, "tol": self.tol, "tau_res": self.tau_res,
                "refactor_every": self.refactor_every, "capacity": self.capacity}

    @classmethod
    def load(cls, path: Path) -> SVMemory:
        """Inverse of :meth:`save`: the same state, bit for bit."""
        params, fill = read_state(path)
        mem = cls(**params)
        fill(mem._state, mem._solver)
        return mem

    # ------------------------------------------------------------------ outputs
    def _active_atoms(self) -> np.ndarray:
        idx = np.flatnonzero(self._state.buf.alpha[:self._state.n])
        return idx[np.argsort(self._state.atoms.seq[idx], kind="stable")]

    def decision_function(self, X: list | np.ndarray) -> np.ndarray:
        """g(x) = rho - k(x, x) + 2 sum_j a_j k(x_j, x) for each row of X (> 0 inside the description)."""
        self.check_fitted()
        Q, single = self._check_queries(X)
        act = self._active_atoms()
        Kq = rbf(Q, self._state.atoms.X[act], self.gamma)
        out = self.rho_ - self._diag + 2.0 * (Kq @ self._state.buf.alpha[act])
        return out[0] if single else out

    def read(self, query: np.ndarray) -> np.ndarray:
        """The memory's output: sum_i a_i k(q, x_i) v_i / sum_i a_i k(q, x_i).

        Computed as a softmax over active tokens with logits log a_i - gamma ||q - x_i||^2 (the identity of the
        design note, section 3.2), which does not underflow for queries far from every key.
        """
        self.check_fitted()
        Q, single = self._check_queries(query)
        act = self._active_atoms()
        alpha = self._state.buf.alpha[act]
        values = np.stack([self._state.atoms.value_sum[s] for s in act]) / self._state.atoms.mult[act][:, None]
        logits = np.log(alpha)[None, :] - self.gamma * squared_distances(Q, self._state.atoms.X[act])
        logits -= logits.max(axis=1, keepdims=True)
        w = np.exp(logits)
        out = (w @ values) / w.sum(axis=1, keepdims=True)
        return out[0] if single else out
