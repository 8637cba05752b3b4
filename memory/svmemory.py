"""The exact, budget-free SV memory: a fixed-box one-class SVM maintained by incremental/decremental steps.

Conventions (see ``shared/design/sv-memory.md``):

* kernel ``k(a, b) = exp(-gamma ||a - b||^2)`` (``gamma = 1 / sigma^2``), so ``k(x, x) = 1``;
* problem ``min a^T K a - 1^T a`` s.t. ``sum(a) = 1, 0 <= a_i <= C`` with C fixed for the memory's life;
* decision value (g-form) ``g(x) = rho - k(x, x) + 2 sum_j a_j k(x_j, x)``: > 0 inside the description;
* reserve tokens (a = 0, g >= 0) carry exactly zero weight and can be evicted with a certificate.

Exact duplicate keys are stored once, as an *atom* with multiplicity m and box m C (exactly equivalent to m
copies, and it keeps the bordered KKT matrix non-singular); each copy's coefficient is a / m, the
minimum-norm split among copies, which makes the readout unique.
"""
import hashlib
import itertools
import json
import math
import os
import struct
from collections import Counter
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path

import numpy as np

from . import solver_core as core
from .errors import InfeasibleError, InvalidKeyError, NotCertifiableError, SolverError, UnknownTokenError
from .kernels import KERNEL_DIAGONAL, check_kernel, rbf, squared_distances
from .kkt import BOUND, BOUNDARY_SNAP, MARGIN, RESERVE, kkt_residual, midpoint_rho, solve_exact

# Feasibility n C >= 1 is tested with this slack so that C = 1 / B admits exactly B tokens despite rounding.
_FEAS_SLACK = 1e-12
_MARGIN_CAPACITY_START = 64  # margin buffers' first size when no capacity is declared (then doubled)


def _grown(a, shape, dtype=np.float64):
    """A zero array of ``shape`` holding ``a`` in its leading corner (a buffer grown, contents kept)."""
    out = np.zeros(shape, dtype=dtype)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out


def _atom_leaf(key, token_ids):
    """Digest leaf of one atom: its key's bytes and its token ids (in arrival order)."""
    return hashlib.sha256(key.tobytes() + b"\x1d" + "\x1f".join(map(repr, token_ids)).encode()).digest()


@dataclass(frozen=True)
class Partition:
    """Token ids by KKT set."""
    margin: frozenset
    bound: frozenset
    reserve: frozenset


@dataclass(frozen=True)
class EvictionCertificate:
    """Proof that evicting ``token_id`` leaves the memory's output unchanged.

    ``alpha`` is the stored coefficient (exactly 0.0), ``decision_value`` the token's g (>= 0), ``margin`` its
    distance above the boundary in g-units, ``strictly_complementary`` whether that margin exceeds ``tau_res``
    (a token on the boundary is output-preserving now but degenerate). ``kkt_residual_after`` is the residual
    of the state without the token; the digests identify the state before and after eviction.

    The readout (``read``) is bit-for-bit unchanged. So is the decision function when ``rho_pinned`` (the margin
    set is non-empty); otherwise rho is only bounded, and is moved to the midpoint of its interval without
    the token, the convention the refit uses (coefficients and readout are unchanged either way).
    """
    token_id: object
    alpha: float
    decision_value: float
    margin: float
    tau_res: float
    strictly_complementary: bool
    rho_pinned: bool
    kkt_residual_after: float
    digest_before: str
    digest_after: str

    def to_dict(self):
        d = dict(self.__dict__)
        d["token_id"] = repr(self.token_id)
        return d


class _Rollback:
    """On a SolverError inside the context, put the memory's solution back as it was on entry: coefficients, g,
    sets and rho from a copy (O(n), ~1.4 us at 1,024 atoms), the inverse rebuilt from K for that margin set. The
    caller then undoes its own bookkeeping (the token's record and multiplicity), so a failed add or remove
    leaves the memory as it was. A class rather than a generator context: it is entered on every solver-path
    operation, and costs a third as much."""

    __slots__ = ("mem", "saved")

    def __init__(self, mem):
        n, m = mem._n, int(mem._ints[0])
        self.mem = mem
        self.saved = (n, mem._alpha[:n].copy(), mem._g[:n].copy(), mem._status[:n].copy(), mem._Sbuf[:m].copy(),
                      mem.rho_, mem._g_err, mem._fitted)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is not None and issubclass(exc_type, SolverError):
            mem = self.mem
            n, alpha, g, status, S, mem.rho_, mem._g_err, mem._fitted = self.saved
            mem._alpha[:n], mem._g[:n], mem._status[:n] = alpha, g, status
            mem._set_margin(S)
        return False


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

    The solver's inner loops (sweeps, inverse updates, polish) are compiled (``memory.solver_core``) and work
    in place on this object's capacity-sized buffers.
    """

    _EPS = 1e-11       # rates below this are treated as zero when deciding whether an event is reachable
    _REL_PIVOT = 1e-9  # relative Schur-pivot test for a rank-one growth of the inverse
    _R_CAP = 1e9       # a rank-one update of the inverse with an entry above this triggers a refactorisation

    def __init__(self, C, kernel="rbf", gamma=1.0, tol=1e-10, tau_res=1e-10, refactor_every=500, capacity=None):
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
        self._dim = None
        self._value_dim = None
        self._cap = 0
        self._n = 0                       # slots in use: atoms, and free slots below the last atom
        self._free = []                   # free slots below n; a new atom takes the most recently freed
        self._X = np.empty((0, 0))
        self._K = np.empty((0, 0))
        self._alpha = np.empty(0)
        self._g = np.empty(0)
        self._mult = np.empty(0, dtype=np.int64)
        self._box_buf = np.empty(0)           # multiplicity * C
        self._status = np.empty(0, dtype=np.int8)
        self._seq = np.empty(0, dtype=np.int64)  # creation order of atoms: the canonical summation order
        self._atom_tokens = []            # per slot: list of token ids, in arrival order
        self._value_sum = []              # per slot: sum of its tokens' values
        self._atom_leaf = []              # per slot: SHA-256 of its key and token ids (state digest leaves)
        self._slot_of_seq = {}
        self._seq_of_keybytes = {}
        self._tokens = {}                 # token id -> (atom seq, value, arrival number)
        self._arrivals = itertools.count()
        self._next_seq = itertools.count()
        self._auto_id = itertools.count()
        self._Sbuf = np.empty(0, dtype=np.int64)  # margin slots, in the order of the inverse's rows 1..m
        self._Rbuf = np.empty((1, 1))             # bordered inverse, top-left (m + 1) block
        self._KSS = np.empty((0, 0))              # K over the margin set, in its order
        self._KS32 = np.empty((0, 0), dtype=np.float32)  # the margin atoms' kernel rows, single precision
        self._ints = np.zeros(2, dtype=np.int64)  # [m, rank-one updates since the last refactorisation]
        self._guards = np.zeros(len(core.GUARDS), dtype=np.int64)
        self.rho_ = float("nan")
        self._g_err = math.inf  # bound on |_g - fp64 g of the coefficients| (0: _g is that g, to rounding)
        self._fitted = False

    # ------------------------------------------------------------------ properties
    @property
    def guard_events_(self):
        return Counter({name: int(k) for name, k in zip(core.GUARDS, self._guards) if k})

    def _margin(self):
        """Margin slots (a view), in the order of the inverse's rows."""
        return self._Sbuf[:self._ints[0]]

    def _kkt_inverse(self):
        """The maintained inverse of the bordered matrix [[0, 1^T], [1, 2 K_SS]] (a view)."""
        m = int(self._ints[0])
        return self._Rbuf[:m + 1, :m + 1]

    @property
    def n_tokens(self):
        return len(self._tokens)

    @property
    def n_atoms(self):
        return self._n - len(self._free)

    @property
    def min_tokens(self):
        """Smallest number of tokens for which the problem is feasible, ceil(1 / C)."""
        return max(1, math.ceil(1.0 / self.C - _FEAS_SLACK))

    @property
    def is_feasible(self):
        return self._fitted

    @property
    def alpha_(self):
        self._check_fitted()
        out = {}
        for tid, (seq, _, _) in self._tokens.items():
            slot = self._slot_of_seq[seq]
            out[tid] = float(self._alpha[slot] / self._mult[slot])
        return out

    def token_ids(self):
        """Stored token ids in arrival order (the dict keeps insertion order, which is arrival order)."""
        return list(self._tokens)

    def __contains__(self, token_id):
        return token_id in self._tokens

    def __len__(self):
        return len(self._tokens)

    def key_of(self, token_id):
        return self._X[self._slot(token_id)].copy()

    def value_of(self, token_id):
        self._slot(token_id)
        return self._tokens[token_id][1].copy()

    def decision_value_of(self, token_id):
        """g of a stored token, computed from the coefficients in fp64."""
        self._check_fitted()
        return float(self._exact_maintained_g()[self._slot(token_id)])

    def status_of(self, token_id):
        """'margin', 'bound' or 'reserve'."""
        self._check_fitted()
        return {MARGIN: "margin", BOUND: "bound", RESERVE: "reserve"}[int(self._status[self._slot(token_id)])]

    def partition(self):
        """The three token-id sets (margin S, bound E, reserve R)."""
        self._check_fitted()
        sets = {MARGIN: set(), BOUND: set(), RESERVE: set()}
        for tid, (seq, _, _) in self._tokens.items():
            sets[int(self._status[self._slot_of_seq[seq]])].add(tid)
        return Partition(frozenset(sets[MARGIN]), frozenset(sets[BOUND]), frozenset(sets[RESERVE]))

    def kkt_residual(self):
        """KKT residual of the current state, recomputing g from the coefficients."""
        self._check_fitted()
        live = self._live_slots()
        g = self._exact_g()
        return kkt_residual(self._alpha[live], g[live], self._box()[live], self._status[live])

    # ------------------------------------------------------------------ validation
    def _check_fitted(self):
        if not self._fitted:
            raise InfeasibleError(
                f"the memory holds {self.n_tokens} token(s) but C={self.C!r} needs at least {self.min_tokens} "
                f"(n * C >= 1) before it has a solution")

    def _check_key(self, key):
        try:
            x = np.asarray(key, dtype=np.float64)
        except (TypeError, ValueError):
            raise InvalidKeyError(f"a key must be a numeric vector, got {key!r}") from None
        if x.ndim != 1 or x.size == 0:
            raise InvalidKeyError(f"a key must be a non-empty 1-D vector, got shape {np.shape(key)}")
        if self._dim is not None and x.size != self._dim:
            raise InvalidKeyError(f"key has dimension {x.size}, the memory's keys have dimension {self._dim}")
        if not np.all(np.isfinite(x)):
            raise InvalidKeyError(f"key has non-finite entries: {x.tolist()}")
        return x + 0.0  # turns -0.0 into 0.0 so that equal keys have equal bytes

    def _check_value(self, value, key):
        v = key.copy() if value is None else np.asarray(value, dtype=np.float64).ravel()
        if v.size == 0 or not np.all(np.isfinite(v)):
            raise InvalidKeyError(f"value must be a non-empty finite vector, got {np.asarray(value).tolist()}")
        if self._value_dim is not None and v.size != self._value_dim:
            raise InvalidKeyError(f"value has dimension {v.size}, the memory's values have dimension "
                                  f"{self._value_dim}")
        return v

    def _check_queries(self, X):
        Q = np.asarray(X, dtype=np.float64)
        single = Q.ndim == 1
        Q = np.atleast_2d(Q)
        if Q.ndim != 2 or (self._dim is not None and Q.shape[1] != self._dim):
            raise InvalidKeyError(f"queries must have shape (m, {self._dim}), got {np.shape(X)}")
        if not np.all(np.isfinite(Q)):
            raise InvalidKeyError("queries have non-finite entries")
        return Q, single

    def _slot(self, token_id):
        try:
            seq = self._tokens[token_id][0]
        except (KeyError, TypeError):
            raise UnknownTokenError(f"unknown token id {token_id!r}") from None
        return self._slot_of_seq[seq]

    def _live_slots(self):
        return np.flatnonzero(self._status[:self._n] != core.FREE)

    def _box(self):
        """Boxes multiplicity * C of slots 0..n-1 (a view, kept in step with the multiplicities)."""
        return self._box_buf[:self._n]

    def _set_multiplicity(self, slot, k):
        k = int(k)  # a numpy integer times a float takes numpy's scalar promotion, ~1 us
        self._mult[slot] = k
        self._box_buf[slot] = k * self.C

    # ------------------------------------------------------------------ storage
    def _ensure_capacity(self, n):
        if n <= self._cap:
            return
        cap = max(16, 2 * self._cap, n) if self._cap or self.capacity is None else max(n, self.capacity)
        d = self._dim
        self._X = _grown(self._X[:self._n], (cap, d)) if self._X.size else np.zeros((cap, d))
        K = np.zeros((cap, cap))
        K[:self._n, :self._n] = self._K[:self._n, :self._n]
        self._K = K
        self._alpha = _grown(self._alpha[:self._n], (cap,))
        self._g = _grown(self._g[:self._n], (cap,))
        self._mult = _grown(self._mult[:self._n], (cap,), np.int64)
        self._box_buf = _grown(self._box_buf[:self._n], (cap,))
        self._status = _grown(self._status[:self._n], (cap,), np.int8)
        self._seq = _grown(self._seq[:self._n], (cap,), np.int64)
        self._Sbuf = _grown(self._margin(), (cap,), np.int64)
        m = int(self._ints[0])
        self._KS32 = _grown(self._KS32[:m, :self._n], (self._KSS.shape[0], cap), np.float32)
        self._cap = cap
        # A declared capacity bounds the margin set too (the pipeline's budgeted memories never grow buffers)
        self._ensure_margin_capacity(cap if self.capacity is not None else _MARGIN_CAPACITY_START)

    def _ensure_margin_capacity(self, m):
        """Margin buffers (the bordered inverse, K_SS, the single-precision margin rows) for at least m margin
        atoms, doubling. They are sized by the margin set, not by the atoms: at 4,096 atoms three atom-sized
        square buffers would be ~340 MB beside the Gram matrix's 134 MB."""
        if m > self._KSS.shape[0]:
            self._Rbuf, self._KSS, self._KS32 = core.enlarged_margin_buffers(
                self._Rbuf, self._KSS, self._KS32, int(self._ints[0]), self._n, m, self._cap)

    def _new_atom(self, x, krow):
        """A slot for key x (a free one if any) with ``krow`` = its kernel values against slots 0..n-1."""
        n = self._n
        if self._free:
            slot = self._free.pop()
        else:
            slot = n
            self._ensure_capacity(slot + 1)
            self._atom_tokens.append([])
            self._value_sum.append(None)
            self._atom_leaf.append(b"")
            self._n += 1
        self._X[slot] = x
        self._K[slot, :n] = krow
        self._K[:n, slot] = krow
        self._K[slot, slot] = self._diag
        m = int(self._ints[0])
        self._KS32[:m, slot] = krow[self._Sbuf[:m]]
        self._alpha[slot] = 0.0
        self._g[slot] = 0.0
        self._set_multiplicity(slot, 0)
        self._status[slot] = RESERVE
        seq = next(self._next_seq)
        self._seq[slot] = seq
        self._slot_of_seq[seq] = slot
        self._seq_of_keybytes[x.tobytes()] = seq
        return slot

    def _drop_atom(self, slot):
        """Delete an atom: its slot becomes free (O(1); see ``solver_core.FREE``). The key is zeroed at once;
        the kernel row and column stay until a new atom overwrites them, and :meth:`save` writes them as 0."""
        del self._slot_of_seq[int(self._seq[slot])]
        del self._seq_of_keybytes[self._X[slot].tobytes()]
        self._X[slot] = 0.0
        self._alpha[slot] = self._g[slot] = 0.0
        self._set_multiplicity(slot, 0)
        self._status[slot] = core.FREE
        self._seq[slot] = -1
        self._atom_tokens[slot] = []
        self._value_sum[slot] = None
        self._atom_leaf[slot] = b""
        self._free.append(slot)
        while self._n and self._status[self._n - 1] == core.FREE:  # free slots at the end are given back
            self._n -= 1
            self._free.remove(self._n)
            self._atom_tokens.pop()
            self._value_sum.pop()
            self._atom_leaf.pop()

    # ------------------------------------------------------------------ public API: add / remove
    def add(self, key, value=None, token_id=None):
        """Insert one event; returns its token id.

        The new token enters the reserve set at O(stored) cost when it already lies inside the description
        (g >= 0); otherwise its coefficient is raised by the adiabatic incremental procedure. ``value`` defaults
        to the key itself (an auto-associative memory).
        """
        x = self._check_key(key)
        v = self._check_value(value, x)
        if token_id is None:
            token_id = next(self._auto_id)
            while token_id in self._tokens:
                token_id = next(self._auto_id)
        elif token_id in self._tokens:
            raise ValueError(f"token id {token_id!r} is already stored")
        if self._dim is None:
            self._dim = x.size
            self._X = np.zeros((0, self._dim))
        if self._value_dim is None:
            self._value_dim = v.size

        seq = self._seq_of_keybytes.get(x.tobytes())
        if seq is None:
            krow = np.exp(-self.gamma * squared_distances(x, self._X[:self._n])[0]) if self._n else np.empty(0)
            slot = self._new_atom(x, krow)
        else:
            slot = self._slot_of_seq[seq]
        self._tokens[token_id] = (int(self._seq[slot]), v, next(self._arrivals))
        self._atom_tokens[slot].append(token_id)
        self._atom_leaf[slot] = _atom_leaf(self._X[slot], self._atom_tokens[slot])
        self._value_sum[slot] = v.copy() if self._value_sum[slot] is None else self._value_sum[slot] + v
        self._set_multiplicity(slot, self._mult[slot] + 1)

        try:
            if self._fitted:
                self._admit(slot)
            elif self.n_tokens * self.C >= 1.0 - _FEAS_SLACK:
                self._seed()
        except SolverError:
            self._set_multiplicity(slot, self._mult[slot] - 1)  # the solution is already back as it was
            self._forget_token(token_id, slot)
            raise
        return token_id

    def remove(self, token_id):
        """Delete one token by the exact decremental procedure.

        Afterwards the state equals the fixed-C solution over the retained tokens (see
        :func:`memory.refit.verify_against_refit`).
        """
        slot = self._slot(token_id)
        if self.n_tokens == 1:
            raise InfeasibleError(f"cannot remove token {token_id!r}: it is the memory's last token")
        if self._fitted and (self.n_tokens - 1) * self.C < 1.0 - _FEAS_SLACK:
            raise InfeasibleError(
                f"removing token {token_id!r} would leave {self.n_tokens - 1} tokens, infeasible for "
                f"C={self.C!r} (needs n * C >= 1, i.e. at least {self.min_tokens} tokens)")
        self._set_multiplicity(slot, self._mult[slot] - 1)
        if self._fitted:
            try:
                self._release(slot)
            except SolverError:
                self._set_multiplicity(slot, self._mult[slot] + 1)  # the solution is already back as it was
                raise
        self._forget_token(token_id, slot)

    def remove_many(self, token_ids):
        """Delete several tokens (all-or-nothing on validation: unknown ids or infeasibility raise first)."""
        token_ids = list(dict.fromkeys(token_ids))
        for t in token_ids:
            self._slot(t)
        left = self.n_tokens - len(token_ids)
        if left < 1:
            raise InfeasibleError("cannot remove every token of the memory")
        if self._fitted and left * self.C < 1.0 - _FEAS_SLACK:
            raise InfeasibleError(f"removing {len(token_ids)} tokens would leave {left}, infeasible for "
                                  f"C={self.C!r} (needs at least {self.min_tokens})")
        for t in token_ids:
            self.remove(t)

    def _forget_token(self, token_id, slot):
        """Drop the token's records (its atom's multiplicity is already decremented) and an emptied atom."""
        seq, v, _ = self._tokens.pop(token_id)
        tokens = self._atom_tokens[slot]
        tokens.remove(token_id)
        if tokens:
            # Re-summed from the remaining tokens, not by subtraction, so the atom's mean value is exact.
            self._value_sum[slot] = np.sum([self._tokens[t][1] for t in tokens], axis=0)
            self._atom_leaf[slot] = _atom_leaf(self._X[slot], tokens)
        if self._mult[slot] == 0:
            self._drop_atom(slot)
            if self._fitted and not self._ints[0]:
                self._finish()  # rho is unpinned: its interval may have widened; return to the midpoint

    # ------------------------------------------------------------------ certified eviction
    def certify_eviction(self, token_id):
        """Certificate that evicting a reserve token changes no output; raises for any other token."""
        slot = self._slot(token_id)
        self._check_fitted()
        if self._status[slot] != RESERVE or self._alpha[slot] != 0.0:
            raise NotCertifiableError(
                f"token {token_id!r} is in the {self.status_of(token_id)} set with coefficient "
                f"{self._alpha[slot] / self._mult[slot]!r}; only reserve tokens (coefficient exactly 0) can be "
                f"evicted with a certificate")
        if self.n_tokens == 1:
            raise InfeasibleError(f"cannot evict token {token_id!r}: it is the memory's last token")
        n = self._n
        leaves = self._mult[slot] == 1  # the atom goes; otherwise it loses one copy (and C of its box)
        gone = slot if leaves else -1
        box = self._box().copy()
        if not leaves:
            box[slot] -= self.C
        rho_pinned = bool(self._ints[0])
        g = self._exact_maintained_g()  # evicting a reserve token changes no coefficient, so no g but rho's shift
        if rho_pinned:
            rho_after, g_after = self.rho_, g
        else:
            rho_after = self._midpoint_rho(self._atoms_except(gone))
            g_after = g[:n] + (rho_after - self.rho_)
        residual = float(core.residual(self._alpha, g_after, box, self._status, n, gone))
        gj = float(g[slot])
        return EvictionCertificate(
            token_id=token_id, alpha=float(self._alpha[slot]), decision_value=gj, margin=gj,
            tau_res=self.tau_res, strictly_complementary=gj > self.tau_res, rho_pinned=rho_pinned,
            kkt_residual_after=residual, digest_before=self.state_digest(),
            digest_after=self.state_digest(exclude=token_id, rho=rho_after))

    def evict(self, token_id, certificate=None):
        """Remove a certified reserve token without any solver work; returns its certificate.

        ``read`` is bit-for-bit unchanged (and ``decision_function`` when rho is pinned): both sum over the
        nonzero coefficients in atom creation order, and neither that set nor its order changes.
        """
        if certificate is None:
            cert = self.certify_eviction(token_id)
        elif certificate.token_id != token_id or certificate.digest_before != self.state_digest():
            raise NotCertifiableError(f"the certificate does not belong to token {token_id!r} in this state")
        else:
            cert = certificate
        slot = self._slot(token_id)
        self._set_multiplicity(slot, self._mult[slot] - 1)
        self._forget_token(token_id, slot)
        if self.state_digest() != cert.digest_after:
            raise SolverError(f"state after evicting {token_id!r} does not match its certificate")
        return cert

    def state_digest(self, exclude=None, rho=None):
        """SHA-256 over the solution state: C, gamma, rho, then every atom's leaf (SHA-256 of its key and token
        ids, cached per atom) and per-token coefficient, atoms in creation order (so the digest does not depend
        on how atoms occupy slots).

        ``exclude``: the digest of the state without that token (its coefficient unchanged: a reserve token's
        is 0), with ``rho`` in place of the current offset.
        """
        h = hashlib.sha256()
        rho = rho if rho is not None else (self.rho_ if self._fitted else float("nan"))
        h.update(struct.pack("<3d", self.C, self.gamma, rho))
        live = self._live_slots()
        order = live[np.argsort(self._seq[live], kind="stable")]
        leaves = [self._atom_leaf[i] for i in order] if len(order) < 2 else list(itemgetter(*order)(self._atom_leaf))
        mult = self._mult[:self._n].copy()
        if exclude is not None:
            slot = self._slot(exclude)
            pos = int(np.flatnonzero(order == slot)[0])
            mult[slot] -= 1
            if mult[slot]:
                leaves[pos] = _atom_leaf(self._X[slot], [t for t in self._atom_tokens[slot] if t != exclude])
            else:
                del leaves[pos]
                order = np.delete(order, pos)
        h.update(b"".join(leaves))
        coef = self._alpha[order] / mult[order] if self._fitted else np.zeros(len(order))
        h.update(coef.tobytes())
        return h.hexdigest()

    def reserve_with_largest_slack(self):
        """The reserve token whose g is largest (the least likely to be needed again), or None."""
        self._check_fitted()
        n = self._n
        res = np.flatnonzero(self._status[:n] == RESERVE)
        if not len(res):
            return None
        slot = res[np.argmax(self._exact_maintained_g()[res])]
        return self._atom_tokens[slot][0]

    def smallest_active(self):
        """The active token with the smallest coefficient, margin tokens before bound ones."""
        self._check_fitted()
        n = self._n
        for code in (MARGIN, BOUND):
            act = np.flatnonzero(self._status[:n] == code)
            if len(act):
                slot = act[np.argmin(self._alpha[act] / self._mult[act])]
                return self._atom_tokens[slot][0]
        return None

    # ------------------------------------------------------------------ persistence
    def save(self, path):
        """Write the full solver state (keys, Gram matrix, coefficients, KKT inverse) to an ``.npz`` file.

        Token ids must be JSON scalars (int or str). No pickle: the file loads with ``allow_pickle=False``.
        """
        n = self._n
        ids = self.token_ids()
        if self._fitted:
            self._exact_maintained_g()
        K = self._K[:n, :n].copy()
        K[self._free, :] = 0.0  # stale rows and columns of deleted atoms are not written (see _drop_atom)
        K[:, self._free] = 0.0
        meta = {
            "C": self.C, "kernel": self.kernel, "gamma": self.gamma, "tol": self.tol, "tau_res": self.tau_res,
            "refactor_every": self.refactor_every, "capacity": self.capacity, "rho": self.rho_, "fitted": self._fitted,
            "dim": self._dim, "value_dim": self._value_dim, "S": [int(j) for j in self._margin()],
            "free": [int(j) for j in self._free],
            "tokens": [[t, int(self._tokens[t][0]), int(self._tokens[t][2])] for t in ids],
            "next_seq": int(self._seq[:n].max()) + 1 if n else 0,
            "next_arrival": max((self._tokens[t][2] for t in ids), default=-1) + 1,
            "updates_since_refactor": int(self._ints[1]),
            "guard_events": dict(self.guard_events_),
        }
        values = np.stack([self._tokens[t][1] for t in ids]) if ids else np.empty((0, 0))
        tmp = Path(str(path) + ".tmp.npz")
        np.savez(tmp, meta=np.array(json.dumps(meta)), X=self._X[:n], K=K, alpha=self._alpha[:n],
                 g=self._g[:n], mult=self._mult[:n], status=self._status[:n], seq=self._seq[:n],
                 Rinv=self._kkt_inverse(), values=values)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path):
        """Inverse of :meth:`save`: the same state, bit for bit."""
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            mem = cls(C=meta["C"], kernel=meta["kernel"], gamma=meta["gamma"], tol=meta["tol"],
                      tau_res=meta["tau_res"], refactor_every=meta["refactor_every"],
                      capacity=meta.get("capacity"))
            n = len(z["alpha"])
            mem._dim, mem._value_dim = meta["dim"], meta["value_dim"]
            if mem._dim is not None:
                mem._X = np.zeros((0, mem._dim))
                mem._ensure_capacity(n)
                mem._X[:n] = z["X"]
                mem._K[:n, :n] = z["K"]
                for name in ("alpha", "g", "mult", "status", "seq"):
                    getattr(mem, "_" + name)[:n] = z[name]
                mem._box_buf[:n] = mem._mult[:n] * mem.C
            mem._n = n
            mem._free = list(meta.get("free", []))
            R = z["Rinv"]
            values = z["values"]
        live = mem._live_slots()
        mem._slot_of_seq = {int(mem._seq[i]): int(i) for i in live}
        mem._seq_of_keybytes = {mem._X[i].tobytes(): int(mem._seq[i]) for i in live}
        mem._atom_tokens = [[] for _ in range(n)]
        mem._value_sum = [None] * n
        for (tid, seq, arrival), v in zip(meta["tokens"], values):
            slot = mem._slot_of_seq[seq]
            mem._tokens[tid] = (seq, v.copy(), arrival)
            mem._atom_tokens[slot].append(tid)
        mem._atom_leaf = [b""] * n
        for slot in live:  # tokens were saved in arrival order, so each atom's list already is
            mem._value_sum[slot] = np.sum([mem._tokens[t][1] for t in mem._atom_tokens[slot]], axis=0)
            mem._atom_leaf[slot] = _atom_leaf(mem._X[slot], mem._atom_tokens[slot])
        m = len(meta["S"])
        mem._ensure_margin_capacity(m)
        mem._Sbuf[:m] = meta["S"]
        mem._Rbuf[:m + 1, :m + 1] = R[:m + 1, :m + 1]
        core.gather_margin_kernel(mem._K, mem._Sbuf, m, mem._KSS)
        core.gather_margin_rows32(mem._K, mem._Sbuf, m, n, mem._KS32)
        mem._ints[:] = (m, meta["updates_since_refactor"])
        for name, count in meta["guard_events"].items():
            mem._guards[core.GUARDS.index(name)] = count
        mem.rho_ = meta["rho"]
        mem._fitted = meta["fitted"]
        mem._g_err = 0.0 if mem._fitted else math.inf  # save() writes g exact
        mem._next_seq = itertools.count(meta["next_seq"])
        mem._arrivals = itertools.count(meta["next_arrival"])
        ints = [t for t in mem._tokens if isinstance(t, int)]
        mem._auto_id = itertools.count(max(ints) + 1 if ints else 0)
        return mem

    # ------------------------------------------------------------------ outputs
    def _active_atoms(self):
        idx = np.flatnonzero(self._alpha[:self._n])
        return idx[np.argsort(self._seq[idx], kind="stable")]

    def decision_function(self, X):
        """g(x) = rho - k(x, x) + 2 sum_j a_j k(x_j, x) for each row of X (> 0 inside the description)."""
        self._check_fitted()
        Q, single = self._check_queries(X)
        act = self._active_atoms()
        Kq = rbf(Q, self._X[act], self.gamma)
        out = self.rho_ - self._diag + 2.0 * (Kq @ self._alpha[act])
        return out[0] if single else out

    def read(self, query):
        """The memory's output: sum_i a_i k(q, x_i) v_i / sum_i a_i k(q, x_i).

        Computed as a softmax over active tokens with logits log a_i - gamma ||q - x_i||^2 (the identity of the
        design note, section 3.2), which does not underflow for queries far from every key.
        """
        self._check_fitted()
        Q, single = self._check_queries(query)
        act = self._active_atoms()
        alpha = self._alpha[act]
        values = np.stack([self._value_sum[s] for s in act]) / self._mult[act][:, None]
        logits = np.log(alpha)[None, :] - self.gamma * squared_distances(Q, self._X[act])
        logits -= logits.max(axis=1, keepdims=True)
        w = np.exp(logits)
        out = (w @ values) / w.sum(axis=1, keepdims=True)
        return out[0] if single else out

    # ------------------------------------------------------------------ solver
    def _exact_g(self):
        g = np.empty(self._n)
        core.exact_g(self._K, self._alpha, self._n, self.rho_, self._diag, g)
        return g

    def _exact_maintained_g(self):
        """The maintained g (a view), first recomputed from the coefficients if it carries any error.

        A solver operation leaves g within a bound of exact (``solver_core.finish``: recomputing every g costs
        as much as the decrement's path itself, and the next operation's sweep needs only the bound); whatever
        reads g recomputes it here, once.
        """
        if self._g_err:
            self._set_exact_g()
        return self._g[:self._n]

    def _set_exact_g(self):
        core.exact_g(self._K, self._alpha, self._n, self.rho_, self._diag, self._g)
        self._g_err = 0.0

    def _set_margin(self, slots):
        """Make ``slots`` the margin set and refactor the inverse from K."""
        m = len(slots)
        self._ensure_margin_capacity(m)
        self._Sbuf[:m] = slots
        self._ints[0] = m
        core.refactor(self._K, self._Sbuf, self._KSS, self._ints, self._Rbuf, self._guards)
        core.gather_margin_rows32(self._K, self._Sbuf, m, self._n, self._KS32)

    def _seed(self):
        """First feasible state: an exact batch solve of the tokens stored so far (a few of them)."""
        with _Rollback(self):
            live = self._live_slots()
            sol = self._batch_solve(live, self._box())
            if sol.residual > self.tol:
                raise SolverError(f"could not seed the memory: KKT residual {sol.residual:.3g} > tol={self.tol:g}")
            self._adopt(live, sol)
            self._fitted = True
            self._finish()

    def _batch_solve(self, idx, box, start=None):
        """Exact batch solve over atoms ``idx`` (``kkt.solve_exact``), from ``start`` or else from
        scikit-learn's solution of the same atoms."""
        from .refit import sklearn_alpha_guess
        K = self._K[np.ix_(idx, idx)]
        if start is None:
            start = sklearn_alpha_guess(K, self._mult[idx], self.C)
        return solve_exact(K, box[idx], start, diag=self._diag, tol=self.tol * 1e-2)

    def _adopt(self, idx, sol):
        """Take a batch solution over atoms ``idx`` as the state (the inverse rebuilt for its margin set)."""
        self._alpha[idx] = sol.alpha
        self._status[idx] = sol.status
        self.rho_ = sol.rho
        self._g_err = math.inf  # g is not the new coefficients'
        self._set_margin(idx[sol.status == MARGIN])

    def _admit(self, slot):
        """Restore optimality after atom ``slot`` gained a token (a new atom or a duplicate copy)."""
        n = self._n
        act = np.flatnonzero(self._alpha[:n])
        self._g[slot] = self.rho_ - self._diag + 2.0 * (self._K[slot, act] @ self._alpha[act])
        status = self._status[slot]
        if status == BOUND or (self._mult[slot] == 1 and self._g[slot] < -1e-2 * self.tol):
            # Below the boundary (or a bound atom whose box just grew): raise its coefficient.
            self._move_coefficient(slot, +1.0)
        elif self._mult[slot] == 1:
            self._status[slot] = RESERVE  # inside the description: no solver work
            if not self._ints[0]:
                self._finish()  # rho is unpinned: keep it at the midpoint of its (possibly narrower) interval
        # A margin or reserve atom whose box grew stays optimal as it is.

    def _release(self, slot):
        """Restore optimality after atom ``slot``'s multiplicity (so its box) was lowered by one."""
        if self._status[slot] == RESERVE or self._alpha[slot] < self._box_buf[slot] - BOUNDARY_SNAP:
            # A zero coefficient, or one still inside the smaller box: the optimum is unchanged. One within
            # rounding of the new box is on it (the polish's rule) and goes to the bound set, which can leave the
            # margin set empty and rho at its midpoint.
            return
        self._move_coefficient(slot, -1.0)  # a zero box leaves the atom in reserve; the caller drops it

    def _move_coefficient(self, c, s):
        """Move a_c monotonically to its new box along the exact solution path, then polish and check the end
        state (``solver_core.move_coefficient``, one compiled call)."""
        box = self._box()
        with _Rollback(self):
            outcome, rho, res, self._g_err, self._Rbuf, self._KSS, self._KS32 = core.move_coefficient(
                self._K, self._g, self._alpha, self._status, box, self._Sbuf, self._KSS, self._KS32, self._ints,
                self._Rbuf, self._guards, self._n, c, s, self.rho_, self._diag, self._EPS, self._REL_PIVOT,
                self.refactor_every, self._R_CAP, self._g_err)
            if outcome == core.SWEPT_NO_EVENT:
                raise SolverError("no reachable bookkeeping event: the retained problem is infeasible")
            if outcome == core.SWEPT_ITERATION_CAP:
                raise SolverError("the incremental/decremental path did not terminate")
            self._settle(rho, res, c if box[c] == 0.0 else -1, box)

    def _finish(self):
        """Polish the end state of an operation and repair it if its KKT residual exceeds ``tol``.

        The sweep accumulates rounding in a and rho; re-solving the bordered system on the final partition
        with the maintained inverse (iterative refinement; a rebuilt inverse when that does not converge) removes
        it. The residual is exact; g is left within its stated error bound (see ``solver_core.finish``).
        """
        box = self._box()
        rho, res, self._g_err = core.finish(
            self._K, self._alpha, self._g, self._status, box, self._Sbuf, self._KSS, self._KS32, self._ints,
            self._Rbuf, self._guards, self._n, -1, self._diag, self.refactor_every, self._R_CAP, self.rho_,
            self._g_err)
        self._settle(rho, res, -1, box)

    def _settle(self, rho, res, ex, box):
        """Take ``finish``'s end state: rho (the midpoint of its interval when the margin set is empty), and a
        repair when the KKT residual exceeds ``tol``. ``ex``: an atom left out of the state (-1: none)."""
        n = self._n
        if self._ints[0]:
            self.rho_ = float(rho)
        else:
            self.rho_ = self._midpoint_rho(self._atoms_except(ex))
            self._set_exact_g()
            res = core.residual(self._alpha, self._g, box, self._status, n, ex)
        if res > self.tol:
            self._repair(self._atoms_except(ex), box)

    def _atoms_except(self, slot):
        live = self._live_slots()
        return live[live != slot]

    def _midpoint_rho(self, idx):
        """Midpoint rho over atoms ``idx``, summed in atom creation order so that the same state gives the same
        bits whatever slots its atoms occupy (an eviction's certificate predicts the digest after it)."""
        idx = idx[np.argsort(self._seq[idx], kind="stable")]
        return midpoint_rho(self._K[np.ix_(idx, idx)], self._alpha[idx], self._status[idx],
                            np.full(len(idx), self._diag))

    def _repair(self, idx, box):
        """Last-resort exact batch solve (counted; should be rare): from the current coefficients, and when
        that start does not reach ``tol`` (near-duplicate keys can leave it far off), from scikit-learn's
        solution of the same atoms, the start the memory is seeded from."""
        self._guards[core.GUARDS.index("repair")] += 1
        sol = self._batch_solve(idx, box, start=self._alpha[idx])
        if sol.residual > self.tol:
            sol = self._batch_solve(idx, box)
        if sol.residual > self.tol:
            raise SolverError(f"KKT residual {sol.residual:.3g} exceeds tol={self.tol:g} after repair")
        self._adopt(idx, sol)
        self._set_exact_g()
