"""An SV memory's full state in one ``.npz`` file (no pickle): keys, Gram matrix, coefficients, KKT inverse."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import solver_core as core
from .atoms import TokenRecord
from .solver_state import GUARDS

if TYPE_CHECKING:
    from memory.svmemory import SVMemory


def save_memory(mem: SVMemory, path: Path) -> None:
    """Write ``mem``'s state to ``path`` atomically. Token ids must be JSON scalars (int or str)."""
    atoms, buf = mem._atoms, mem._buf
    n = atoms.n
    ids = mem.token_ids()
    if mem.is_feasible:
        mem._exact_maintained_g()
    K = buf.K[:n, :n].copy()
    K[atoms.free, :] = 0.0  # stale rows and columns of deleted atoms are not written (see AtomRegistry)
    K[:, atoms.free] = 0.0
    records = [atoms.tokens[t] for t in ids]
    meta = {
        "C": mem.C, "kernel": mem.kernel, "gamma": mem.gamma, "tol": mem.tol, "tau_res": mem.tau_res,
        "refactor_every": mem.refactor_every, "capacity": mem.capacity, "rho": mem.rho_, "fitted": mem.is_feasible,
        "dim": mem._dim, "value_dim": mem._value_dim, "S": [int(j) for j in mem._margin()],
        "free": [int(j) for j in atoms.free],
        "tokens": [[t, int(r.seq), int(r.arrival)] for t, r in zip(ids, records)],
        "next_seq": int(atoms.seq[:n].max()) + 1 if n else 0,
        "next_arrival": max((r.arrival for r in records), default=-1) + 1,
        "updates_since_refactor": int(buf.ints[1]),
        "guard_events": dict(mem.guard_events_),
    }
    values = np.stack([r.value for r in records]) if ids else np.empty((0, 0))
    tmp = Path(str(path) + ".tmp.npz")
    np.savez(tmp, meta=np.array(json.dumps(meta)), X=atoms.X[:n], K=K, alpha=buf.alpha[:n], g=buf.g[:n],
             mult=atoms.mult[:n], status=buf.status[:n], seq=atoms.seq[:n], Rinv=mem._kkt_inverse(), values=values)
    os.replace(tmp, path)


def load_memory(cls: type, path: Path) -> SVMemory:
    """Inverse of :func:`save_memory`: the same state, bit for bit, as an instance of ``cls``."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(str(z["meta"]))
        mem = cls(C=meta["C"], kernel=meta["kernel"], gamma=meta["gamma"], tol=meta["tol"], tau_res=meta["tau_res"],
                  refactor_every=meta["refactor_every"], capacity=meta.get("capacity"))
        n = len(z["alpha"])
        mem._dim, mem._value_dim = meta["dim"], meta["value_dim"]
        if mem._dim is not None:
            mem._atoms.set_dim(mem._dim)
            mem._ensure_capacity(n)
            buf, atoms = mem._buf, mem._atoms
            atoms.X[:n], atoms.mult[:n], atoms.seq[:n] = z["X"], z["mult"], z["seq"]
            buf.K[:n, :n] = z["K"]
            buf.alpha[:n], buf.g[:n], buf.status[:n] = z["alpha"], z["g"], z["status"]
            buf.box[:n] = atoms.mult[:n] * mem.C
        R = z["Rinv"]
        records = [(tid, TokenRecord(seq, v.copy(), arrival))
                   for (tid, seq, arrival), v in zip(meta["tokens"], z["values"])]
    mem._atoms.restore(n, meta.get("free", []), records)
    m = len(meta["S"])
    mem._ensure_margin_capacity(m)
    buf = mem._buf
    buf.S[:m] = meta["S"]
    buf.R[:m + 1, :m + 1] = R[:m + 1, :m + 1]
    core.gather_margin_kernel(buf.K, buf.S, m, buf.KSS)
    core.gather_margin_rows32(buf.K, buf.S, m, n, buf.KS32)
    buf.ints[:] = (m, meta["updates_since_refactor"])
    for name, count in meta["guard_events"].items():
        buf.guards[GUARDS.index(name)] = count
    mem.rho_ = meta["rho"]
    mem._fitted = meta["fitted"]
    mem._g_err = 0.0 if mem._fitted else math.inf  # save_memory writes g exact
    return mem
