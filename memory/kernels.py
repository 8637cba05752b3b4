"""Kernels with a constant diagonal (needed for the SVDD == one-class SVM mapping)."""
from __future__ import annotations

import numpy as np
from scipy.spatial.distance import cdist

SUPPORTED_KERNELS = ("rbf",)


def check_kernel(kernel: str, gamma: float) -> float | None:
    if kernel not in SUPPORTED_KERNELS:
        raise ValueError(
            f"kernel={kernel!r} is not supported; the exact memory needs a constant-diagonal kernel, one of "
            f"{SUPPORTED_KERNELS}")
    gamma = float(gamma)
    if not np.isfinite(gamma) or gamma <= 0:
        raise ValueError(f"gamma must be a positive finite number, got {gamma!r}")
    return gamma


def squared_distances(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Pairwise ||a - b||^2 by explicit differences.

    The expanded form ||a||^2 + ||b||^2 - 2ab loses digits for near-duplicates and is not exactly 0 for
    exact duplicates; the memory's duplicate handling relies on exact zeros.
    """
    return cdist(np.atleast_2d(A), np.atleast_2d(B), "sqeuclidean")


def rbf(A: np.ndarray, B: np.ndarray, gamma: float) -> np.ndarray:
    """k(a, b) = exp(-gamma ||a - b||^2); gamma = 1 / sigma^2 of the paper's notation."""
    return np.exp(-gamma * squared_distances(A, B))


KERNEL_DIAGONAL = {"rbf": 1.0}
