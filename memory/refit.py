"""Independent refit of a memory's retained tokens with scikit-learn, and the comparison report.

The refit maps libsvm's scaling to ours as ``memory.libsvm`` states; its decision values are then
g(x) = (2 / (nu n)) * decision_function(k(x, X)).

After a deletion the refit uses nu' = 1 / ((n - 1) C): C stays fixed, the retained problem is not re-tuned.
libsvm stops at its own tolerance (~1e-8 on coefficients), so the report gives the raw comparison and one
against the refit snapped to an exact KKT point (memory.kkt.solve_exact) from sklearn's solution.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .kernels import KERNEL_DIAGONAL, rbf
from .kkt import BOUND, MARGIN, RESERVE, solve_exact
from .libsvm import sklearn_fit

if TYPE_CHECKING:
    from memory.svmemory import SVMemory


@dataclass
class RefitReport:
    """Decrement-vs-refit comparison (decision values in g-form over the probe set).

    ``max_dev``/``median_dev`` compare against the refit snapped to an exact KKT point; ``*_raw`` against
    sklearn's own solution. ``partition_agreement`` is the fraction of distinct keys in the same KKT set;
    ``nondegenerate_mismatches`` counts disagreeing keys that are not on a set boundary (|g| and the
    coefficient's distance to its bounds both above ``degenerate_tol``) -- the unique-optimum disagreements.
    ``rho_pinned`` is False when the margin set is empty: rho is then only bounded, both sides take the midpoint
    of its interval, but libsvm's raw offset may sit elsewhere in it (its "free" test uses its own tolerance).
    """
    n_tokens: int
    n_probes: int
    max_dev: float
    median_dev: float
    max_dev_raw: float
    median_dev_raw: float
    max_alpha_dev: float
    rho_dev: float
    partition_agreement: float
    nondegenerate_mismatches: int
    kkt_residual_memory: float
    kkt_residual_refit: float
    rho_pinned: bool

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def verify_against_refit(memory: SVMemory, probes: np.ndarray | None = None, n_jitter: int = 64, seed: int = 0,
                         degenerate_tol: float = 1e-9) -> RefitReport:
    """Refit the memory's retained tokens from scratch and compare it with the maintained state.

    Parameters
    ----------
    memory : SVMemory
    probes : array-like of shape (m, d), optional
        Extra query points (for instance the keys of removed tokens).
    n_jitter : int
        Number of jittered copies of retained keys added to the probes.
    """
    memory.check_fitted()
    tokens = memory.token_ids()
    X_tok = np.stack([memory.key_of(t) for t in tokens])
    gamma, C = memory.gamma, memory.C
    alpha_tok, rho_raw = sklearn_fit(rbf(X_tok, X_tok, gamma), C)

    # Exact duplicates are one atom with box m C, as in the memory; sklearn's split among copies is arbitrary.
    atoms, inverse, mult = np.unique(X_tok, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.ravel()
    box = mult * C
    K_atoms = rbf(atoms, atoms, gamma)
    alpha_raw = np.bincount(inverse, weights=alpha_tok, minlength=len(atoms))
    snap = solve_exact(K_atoms, box, alpha_raw, diag=KERNEL_DIAGONAL[memory.kernel])

    rng = np.random.default_rng(seed)
    scale = 0.5 / np.sqrt(gamma)
    pick = rng.integers(0, len(atoms), size=n_jitter)
    P = [atoms, atoms[pick] + scale * rng.standard_normal((n_jitter, atoms.shape[1]))]
    if probes is not None and len(probes):
        P.append(np.atleast_2d(np.asarray(probes, dtype=np.float64)))
    P = np.vstack(P)
    Kp = rbf(P, atoms, gamma)
    g_mem = memory.decision_function(P)
    g_snap = snap.rho - 1.0 + 2.0 * (Kp @ snap.alpha)
    g_raw = rho_raw - 1.0 + 2.0 * (Kp @ alpha_raw)
    dev = np.abs(g_mem - g_snap)
    dev_raw = np.abs(g_mem - g_raw)

    # Memory state per atom, aligned with np.unique's order.
    alpha_mem_tok = memory.alpha_
    alpha_mem = np.bincount(inverse, weights=[alpha_mem_tok[t] for t in tokens], minlength=len(atoms))
    st_mem = np.array([{"margin": MARGIN, "bound": BOUND, "reserve": RESERVE}[memory.status_of(tokens[i])]
                       for i in np.unique(inverse, return_index=True)[1]], dtype=np.int8)
    g_atoms_snap = snap.g
    agree = st_mem == snap.status
    degenerate = (np.abs(g_atoms_snap) <= degenerate_tol) & (
        (alpha_mem <= degenerate_tol) | (alpha_mem >= box - degenerate_tol) |
        (snap.alpha <= degenerate_tol) | (snap.alpha >= box - degenerate_tol))
    return RefitReport(
        n_tokens=len(tokens), n_probes=len(P),
        max_dev=float(dev.max()), median_dev=float(np.median(dev)),
        max_dev_raw=float(dev_raw.max()), median_dev_raw=float(np.median(dev_raw)),
        max_alpha_dev=float(np.abs(alpha_mem - snap.alpha).max()), rho_dev=abs(memory.rho_ - snap.rho),
        partition_agreement=float(agree.mean()),
        nondegenerate_mismatches=int((~agree & ~degenerate).sum()),
        kkt_residual_memory=memory.kkt_residual(), kkt_residual_refit=snap.residual,
        rho_pinned=bool((snap.status == MARGIN).any()))
