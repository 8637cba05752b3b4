"""An SV memory's full state in one ``.npz`` file (no pickle): keys, Gram matrix, coefficients, KKT inverse.

It writes and reads the parts a memory is made of (its constructor's parameters, its atom registry, its
:class:`SolverState`), never the memory object itself, so it imports nothing above the solver.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import solver_core as core
from .atoms import TokenRecord
from .exact_solver import ExactSolver
from .solver_state import GUARD, MARGIN_SIZE, UPDATES_SINCE_REFACTOR, SolverState


def save_state(path: Path, params: dict, state: SolverState, token_ids: list) -> None:
    """Write a memory's state to ``path`` atomically: ``params``, its constructor's parameters; ``token_ids`` in
    arrival order (JSON scalars: int or str). The maintained g is written as it is (the caller makes it exact)."""
    atoms, buf = state.atoms, state.buf
    n = atoms.n
    K = buf.K[:n, :n].copy()
    K[atoms.free, :] = 0.0  # stale rows and columns of deleted atoms are not written (see AtomRegistry)
    K[:, atoms.free] = 0.0
    records = [atoms.tokens[t] for t in token_ids]
    meta = {
        **params, "rho": state.rho, "fitted": state.fitted, "dim": state.dim, "value_dim": state.value_dim,
        "S": [int(j) for j in state.margin()], "free": [int(j) for j in atoms.free],
        "tokens": [[t, int(r.seq), int(r.arrival)] for t, r in zip(token_ids, records)],
        "next_seq": int(atoms.seq[:n].max()) + 1 if n else 0,
        "next_arrival": max((r.arrival for r in records), default=-1) + 1,
        "updates_since_refactor": int(buf.ints[UPDATES_SINCE_REFACTOR]),
        "guard_events": dict(state.guard_counts()),
    }
    values = np.stack([r.value for r in records]) if token_ids else np.empty((0, 0))
    tmp = Path(str(path) + ".tmp.npz")
    np.savez(tmp, meta=np.array(json.dumps(meta)), X=atoms.X[:n], K=K, alpha=buf.alpha[:n], g=buf.g[:n],
             mult=atoms.mult[:n], status=buf.status[:n], seq=atoms.seq[:n], Rinv=state.kkt_inverse(), values=values)
    os.replace(tmp, path)


PARAMS = ("C", "kernel", "gamma", "tol", "tau_res", "refactor_every", "capacity")


def read_state(path: Path) -> tuple[dict, Callable[[SolverState, ExactSolver], None]]:
    """Inverse of :func:`save_state`: the constructor's parameters, and ``fill(state, solver)`` that puts the saved
    state, bit for bit, into a new memory's empty state (its solver allocates the storage)."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        arrays = {k: z[k] for k in ("X", "K", "alpha", "g", "mult", "status", "seq", "Rinv", "values")}
    params = {k: meta.get(k) for k in PARAMS}

    def fill(state: SolverState, solver: ExactSolver) -> None:
        n = len(arrays["alpha"])
        state.value_dim = meta["value_dim"]
        if meta["dim"] is not None:
            state.atoms.set_dim(meta["dim"])
            solver.ensure_capacity(n)
            buf, atoms = state.buf, state.atoms
            atoms.X[:n], atoms.mult[:n], atoms.seq[:n] = arrays["X"], arrays["mult"], arrays["seq"]
            buf.K[:n, :n] = arrays["K"]
            buf.alpha[:n], buf.g[:n], buf.status[:n] = arrays["alpha"], arrays["g"], arrays["status"]
            buf.box[:n] = atoms.mult[:n] * state.C
        records = [(tid, TokenRecord(seq, v.copy(), arrival))
                   for (tid, seq, arrival), v in zip(meta["tokens"], arrays["values"])]
        state.atoms.restore(n, meta.get("free", []), records)
        m = len(meta["S"])
        solver.ensure_margin_capacity(m)
        buf = state.buf
        buf.S[:m] = meta["S"]
        buf.R[:m + 1, :m + 1] = arrays["Rinv"][:m + 1, :m + 1]
        core.gather_margin_kernel(buf.K, buf.S, m, buf.KSS)
        core.gather_margin_rows32(buf.K, buf.S, m, n, buf.KS32)
        buf.ints[MARGIN_SIZE], buf.ints[UPDATES_SINCE_REFACTOR] = m, meta["updates_since_refactor"]
        for name, count in meta["guard_events"].items():
            buf.guards[GUARD[name]] = count
        state.rho = meta["rho"]
        state.fitted = meta["fitted"]
        state.g_err = 0.0 if state.fitted else math.inf  # save_state writes g exact
    return params, fill
