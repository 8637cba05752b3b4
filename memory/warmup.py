"""The exact solver's compiled inner loops, compiled ahead of the work that needs them.

``memory.solver_core`` is compiled by numba on first use and cached on disk (``cache=True``). The first run after
an install used to compile it inside its first scoring items, in every worker at once: a progress bar stood at
"3/55 stays" for 40 s while its ETA climbed past ten minutes. ``make setup`` compiles it at install
(``python -m memory.warmup``), and a run whose cache is cold compiles it as a step of its own, named so.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from numba.core.registry import CPUDispatcher

from . import solver_core
from .policies import SVSelection
from .refit import verify_against_refit


def _dispatchers() -> list[CPUDispatcher]:
    return [v for v in vars(solver_core).values() if isinstance(v, CPUDispatcher)]


def is_compiled() -> bool:
    """Whether every compiled function of the solver has its on-disk cache (numba names each cache index
    ``<module>.<function>-<first line>.py<version>.nbi`` in the module's ``__pycache__``)."""
    cache = Path(solver_core.__file__).parent / "__pycache__"
    return all(any(cache.glob(f"solver_core.{d.__name__}-{d.py_func.__code__.co_firstlineno}.*.nbi"))
               for d in _dispatchers())


def compile_solver(n: int = 48, dim: int = 6, budget: int = 12, seed: int = 0) -> float:
    """Exercise every path of the solver once (seed, admit, certified eviction, decrement, refit check) on a
    small random stream, so that each compiled function is compiled and cached; the seconds it took."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    keys = rng.normal(size=(n, dim))
    sel = SVSelection(budget, gamma=0.5, nu=0.5)
    for i, key in enumerate(keys):
        sel.learn_one(key, None, i)
    memory = sel.memory
    verify_against_refit(memory, probes=keys[:4], n_jitter=4)
    memory.remove_many(memory.token_ids()[:2])
    memory.decision_function(keys[:4])
    return time.perf_counter() - t0


if __name__ == "__main__":
    print(f"compiled the exact solver's inner loops in {compile_solver():.1f} s (cached for every later run)")
