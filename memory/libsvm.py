"""scikit-learn's one-class SVM (libsvm) on our fixed-box problem: the seed of a new memory and the independent
refit that checks one (``memory.refit``).

Mapping (valid for constant-diagonal kernels, k(x, x) = k0; design note section 7): libsvm solves the one-class
dual scaled so that 0 <= a_lib <= 1 and sum(a_lib) = nu * n. With n tokens and our fixed box C,

    nu    = 1 / (n C)                         (in (0, 1] exactly when the problem is feasible)
    a     = a_lib / (nu n)                    (ours: 0 <= a <= C, sum(a) = 1)
    rho   = k0 - 2 rho_lib / (nu n),          rho_lib = -intercept_ = offset_
"""
import numpy as np

from .kernels import KERNEL_DIAGONAL


def sklearn_fit(K_tokens: np.ndarray, C: float, tol: float = 1e-12) -> tuple:
    """Fit OneClassSVM on a precomputed token Gram matrix; returns (alpha, rho) in our scaling."""
    n = K_tokens.shape[0]
    nu = 1.0 / (n * C)
    if not 0.0 < nu <= 1.0 + 1e-12:
        raise ValueError(f"infeasible refit: n * C = {n * C:.6g} < 1")
    if nu >= 1.0 - 1e-12:
        # n C = 1: the feasible set is the single point a = 1/n (libsvm returns non-finite rho here);
        # every token is bound and rho is the top of its interval, min_i (k0 - 2 (K a)_i).
        alpha = np.full(n, 1.0 / n)
        return alpha, float(np.min(KERNEL_DIAGONAL["rbf"] - 2.0 * (K_tokens @ alpha)))
    # imported on first use: scikit-learn takes ~1.2 s to import, which every command paid before its work
    # started (a deletion's preflight, a rerun's imports), most of them without fitting anything
    from sklearn import config_context
    from sklearn.svm import OneClassSVM
    model = OneClassSVM(kernel="precomputed", nu=min(nu, 1.0), tol=tol, shrinking=False, max_iter=-1)
    # our own finite Gram matrix and parameters: scikit-learn's checks of them were most of a small seed's cost
    with config_context(assume_finite=True, skip_parameter_validation=True):
        model.fit(K_tokens)
    alpha = np.zeros(n)
    alpha[model.support_] = model.dual_coef_.ravel() / (nu * n)
    rho_lib = float(model.offset_[0])
    return alpha, KERNEL_DIAGONAL["rbf"] - 2.0 * rho_lib / (nu * n)


def sklearn_alpha_guess(K_atoms: np.ndarray, mult: np.ndarray, C: float) -> np.ndarray:
    """Atom coefficients from a sklearn fit with each atom expanded into its copies."""
    if (mult == 1).all():
        return sklearn_fit(K_atoms, C)[0]
    rep = np.repeat(np.arange(len(mult)), mult)
    alpha_tok, _ = sklearn_fit(K_atoms[np.ix_(rep, rep)], C)
    return np.bincount(rep, weights=alpha_tok, minlength=len(mult))
