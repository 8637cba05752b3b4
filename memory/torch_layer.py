"""SV attention in PyTorch: an exact fp64 path with an implicit-function backward, and a batched approximation.

Exact path (``SVCoefficients``, ``SVAttention(exact=True)``): the forward solves the fixed-C problem with the
exact incremental solver (:class:`memory.SVMemory`, fp64) and keeps its maintained bordered KKT inverse R.
The backward differentiates the active KKT system by the implicit function theorem (design note section 6):
with upstream cotangents (rho_bar, alpha_bar_S), w = R [rho_bar; alpha_bar_S] reuses R (no refactorisation) and

    dL/dK_ii += w_i (i in S),   dL/dK_ie += -2 C_e w_i (i in S, e in E),   dL/dK_ij += -2 w_i a_j (i, j in S),

which the RBF chain rule (dK_ij/dx_i = -2 gamma (x_i - x_j) K_ij) takes to the keys. No gradient flows through
changes of the partition (a kink, like ReLU's). Exact duplicate keys are atoms of the solver; their gradient is
shared equally among the copies.

Batched approximation (``batched_sv_coefficients``, ``SVAttention(exact=False)``): a fixed number of FISTA steps
on the same problem with step 1/L (L = 2 lambda_max(K) by power iteration) and an exact, sort-based projection
onto the capped simplex {sum a = 1, 0 <= a <= C}, run without an autograd graph; its gradient is that of one
batched KKT solve on the partition the iterate shows (implicit differentiation, straight-through). It runs
batched on any device and dtype, **carries no deletion certificate** (its zeros are only approximately zero);
audit by re-solving frozen keys on the exact path (``approximation_gap``).
"""
from __future__ import annotations

import numpy as np
import torch

from .svmemory import SVMemory


def rbf_torch(A: torch.Tensor, B: torch.Tensor, gamma: float) -> torch.Tensor:
    d2 = (A.unsqueeze(-2) - B.unsqueeze(-3)).pow(2).sum(-1)
    return torch.exp(-gamma * d2)


class SVCoefficients(torch.autograd.Function):
    """(keys (n, d) fp64, C, gamma) -> (alpha (n,), rho ()) of the exact fixed-C solution."""

    @staticmethod
    def forward(ctx, X: torch.Tensor, C: float, gamma: float) -> tuple:
        Xn = X.detach().cpu().numpy().astype(np.float64)
        mem = SVMemory(C=C, gamma=gamma)
        for i, x in enumerate(Xn):
            mem.add(x, token_id=i)
        if not mem.is_feasible:
            raise ValueError(f"n = {len(Xn)} keys are infeasible for C = {C} (needs n C >= 1)")
        alpha_tok = mem.alpha_
        alpha = torch.tensor([alpha_tok[i] for i in range(len(Xn))], dtype=X.dtype, device=X.device)
        system = mem.kkt_system()
        ctx.save_for_backward(X)
        ctx.gamma, ctx.C = gamma, C
        ctx.atom_of = system.atom_of_token
        ctx.S, ctx.R = system.margin, system.inverse
        ctx.alpha_atoms, ctx.status, ctx.box, ctx.mult = system.alpha, system.status, system.box, system.mult
        return alpha, torch.tensor(mem.rho_, dtype=X.dtype, device=X.device)

    @staticmethod
    def backward(ctx, alpha_bar: torch.Tensor, rho_bar: torch.Tensor) -> tuple:
        (X,) = ctx.saved_tensors
        S, R = ctx.S, ctx.R
        n_atoms = len(ctx.alpha_atoms)
        grad_K_atoms = np.zeros((n_atoms, n_atoms))
        if len(S):
            a_bar_tok = alpha_bar.detach().cpu().numpy().astype(np.float64) if alpha_bar is not None \
                else np.zeros(len(ctx.atom_of))
            # token coefficient = atom coefficient / multiplicity: the atom's cotangent is the copies' mean
            a_bar_atoms = np.bincount(ctx.atom_of, weights=a_bar_tok, minlength=n_atoms) / ctx.mult
            u_bar = np.concatenate([[float(rho_bar) if rho_bar is not None else 0.0], a_bar_atoms[S]])
            w = (R @ u_bar)[1:]  # R is symmetric (inverse of a symmetric matrix)
            E = np.flatnonzero(ctx.status == 2)
            grad_K_atoms[S, S] += w
            if len(E):
                grad_K_atoms[np.ix_(S, E)] += -2.0 * np.outer(w, ctx.box[E])
            grad_K_atoms[np.ix_(S, S)] += -2.0 * np.outer(w, ctx.alpha_atoms[S])
        # atom entries -> token entries, shared equally among copies
        m = ctx.mult[ctx.atom_of]
        G = grad_K_atoms[np.ix_(ctx.atom_of, ctx.atom_of)] / np.outer(m, m)
        G = torch.as_tensor(G, dtype=X.dtype, device=X.device)
        K = rbf_torch(X, X, ctx.gamma)
        Gs = (G + G.T) * K
        diff = X.unsqueeze(1) - X.unsqueeze(0)
        grad_X = (-2.0 * ctx.gamma) * (Gs.unsqueeze(-1) * diff).sum(1)
        return grad_X, None, None


def readout(alpha: torch.Tensor, K_qx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """o(q) = sum_i a_i k(q, x_i) v_i / sum_i a_i k(q, x_i) (batched over leading dimensions)."""
    W = K_qx * alpha.unsqueeze(-2)
    return (W @ values) / W.sum(-1, keepdim=True).clamp_min(1e-300)


def project_capped_simplex(y: torch.Tensor, C: float) -> torch.Tensor:
    """Euclidean projection of each row of y onto {sum a = 1, 0 <= a <= C}: a = clip(y - tau, 0, C).

    s(tau) = sum clip(y - tau, 0, C) is decreasing and linear between the breakpoints {y_i, y_i - C}: evaluate
    it at all sorted breakpoints at once and interpolate inside the segment where it crosses 1 -- exact, with a
    fixed number of batched tensor operations (no iteration), so it suits accelerators.
    """
    with torch.no_grad():
        bp = torch.cat([y, y - C], dim=-1).sort(dim=-1).values
        s_at = (y.unsqueeze(-2) - bp.unsqueeze(-1)).clamp(0.0, C).sum(-1)  # descending along the breakpoints
        k = ((s_at >= 1.0).sum(-1, keepdim=True) - 1).clamp(0, bp.shape[-1] - 2)
        b0, b1 = bp.gather(-1, k), bp.gather(-1, k + 1)
        s0, s1 = s_at.gather(-1, k), s_at.gather(-1, k + 1)
        tau = b0 + (s0 - 1.0) * (b1 - b0) / (s0 - s1).clamp_min(1e-300)
        free = ((y - tau) > 0.0) & ((y - tau) < C)
        upper = (y - tau) >= C
    # tau again, now as a differentiable function of y on the active pieces: sum(a) = 1 gives
    # tau = (sum_free y + C n_upper - 1) / n_free, so gradients see the sum constraint (dtau/dy = 1/n_free).
    n_free = free.sum(-1, keepdim=True)
    tau_g = ((y * free).sum(-1, keepdim=True) + C * upper.sum(-1, keepdim=True) - 1.0) / n_free.clamp_min(1)
    tau = torch.where(n_free > 0, tau_g, tau)
    return (y - tau).clamp(0.0, C)


def _fista(K, C, iters, power_iters):
    n = K.shape[-1]
    v = torch.ones(K.shape[:-1] + (1,), dtype=K.dtype, device=K.device) / n ** 0.5
    for _ in range(power_iters):
        v = K @ v
        v = v / v.norm(dim=-2, keepdim=True).clamp_min(1e-30)
    lam = (v.transpose(-1, -2) @ K @ v).squeeze(-1).clamp_min(1e-12)  # (..., 1)
    step = 1.0 / (2.0 * lam)
    diag = torch.diagonal(K, dim1=-2, dim2=-1)
    a = torch.full(K.shape[:-1], 1.0 / n, dtype=K.dtype, device=K.device)
    z, t = a, 1.0
    for _ in range(iters):
        a_next = project_capped_simplex(z - step * (2.0 * (K @ z.unsqueeze(-1)).squeeze(-1) - diag), C)
        t_next = (1.0 + (1.0 + 4.0 * t * t) ** 0.5) / 2.0
        z = a_next + ((t - 1.0) / t_next) * (a_next - a)
        a, t = a_next, t_next
    return a


def _implicit_coefficients(K, alpha, C, tol, ridge):
    """Coefficients re-solved on the partition read off ``alpha``, as a differentiable function of K.

    Unknowns [rho; a]: sum(a) = 1; for margin atoms rho + 2 (K a)_i = K_ii (g_i = 0); for the others a_i is
    fixed at C (bound) or 0 (reserve). One batched solve; autograd through it is the implicit-function
    gradient on that partition (design note 6.3), with a small ridge on the margin block for stability.
    """
    n = K.shape[-1]
    margin = (alpha > tol) & (alpha < C - tol)
    bound = alpha >= C - tol
    m = margin.to(K.dtype)
    eye = torch.eye(n, dtype=K.dtype, device=K.device)
    top = torch.cat([torch.zeros_like(alpha[..., :1]), torch.ones_like(alpha)], -1).unsqueeze(-2)
    rows_margin = torch.cat([torch.ones_like(alpha).unsqueeze(-1), 2.0 * K + ridge * eye], -1)
    rows_fixed = torch.cat([torch.zeros_like(alpha).unsqueeze(-1), eye.expand_as(K)], -1)
    body = torch.where(margin.unsqueeze(-1), rows_margin, rows_fixed)
    A = torch.cat([top, body], -2)
    rhs_body = m * torch.diagonal(K, dim1=-2, dim2=-1) + (1.0 - m) * bound.to(K.dtype) * C
    rhs = torch.cat([torch.ones_like(alpha[..., :1]), rhs_body], -1)
    return torch.linalg.solve(A, rhs.unsqueeze(-1)).squeeze(-1)[..., 1:]


def batched_sv_coefficients(K: torch.Tensor, C: float, iters: int = 80, power_iters: int = 20, tol: float = 1e-6,
                            ridge: float = 1e-6) -> torch.Tensor:
    """Approximate coefficients for a batch of Gram matrices K (..., n, n).

    The forward value comes from FISTA (no autograd graph); the gradient is that of the partition's KKT solve
    (``_implicit_coefficients``), attached to the FISTA value straight-through: cheap, batched, and the same
    gradient the exact path gives on a correctly identified partition. No certificate.
    """
    with torch.no_grad():
        a = _fista(K, C, iters, power_iters)
    if not K.requires_grad:
        return a
    a_solve = _implicit_coefficients(K, a, C, tol, ridge)
    return a + (a_solve - a_solve.detach())


class SVAttention(torch.nn.Module):
    """Coefficient-weighted attention: ``forward(keys (.., n, d), values (.., n, dv), queries (.., m, d))``.

    ``exact=True`` (fp64, unbatched): the exact solver and the implicit backward; ``exact=False``: the batched
    approximation (no certificate).
    """

    def __init__(self, C: float, gamma: float = 0.5, exact: bool = False, iters: int = 80):
        super().__init__()
        self.C, self.gamma, self.exact, self.iters = float(C), float(gamma), exact, iters

    def coefficients(self, keys: torch.Tensor) -> torch.Tensor:
        if self.exact:
            if keys.dim() != 2:
                raise ValueError("the exact path takes one (n, d) key set at a time")
            return SVCoefficients.apply(keys, self.C, self.gamma)[0]
        return batched_sv_coefficients(rbf_torch(keys, keys, self.gamma), self.C, iters=self.iters)

    def forward(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        alpha = self.coefficients(keys)
        return readout(alpha, rbf_torch(queries, keys, self.gamma), values)


def approximation_gap(keys: torch.Tensor, C: float, gamma: float = 0.5, iters: int = 80) -> tuple:
    """max |a_approx - a_exact| and max |g_approx - g_exact| (decision values at the keys) for one key set."""
    X = keys.detach().to(torch.float64).cpu()
    with torch.no_grad():
        a_exact, rho = SVCoefficients.apply(X, C, gamma)
        K = rbf_torch(X, X, gamma)
        a_apx = batched_sv_coefficients(K, C, iters=iters)
        # rho of the approximate solution: the mean over its (approximately) free coefficients
        g_no_rho = -1.0 + 2.0 * (K @ a_apx)
        free = (a_apx > 1e-6) & (a_apx < C - 1e-6)
        rho_apx = -(g_no_rho[free].mean()) if free.any() else rho
        g_apx = rho_apx + g_no_rho
        g_exact = rho - 1.0 + 2.0 * (K @ a_exact)
    return float((a_apx - a_exact).abs().max()), float((g_apx - g_exact).abs().max())
