"""The resampling tests' inner loops, compiled: the mean of every resample without materialising the resample.

numpy forms ``x[idx].mean(1)`` (the bootstrap) and ``(flips * d).mean(1)`` (the sign-flip test) by writing the
whole (resamples x n) matrix and summing each row. Here each mean is summed straight from ``x`` and the draws, in
the order numpy's pairwise summation adds a contiguous row (blocks of eight partial sums up to 128 values,
halves above), then divided by n as numpy does: the same numbers to the bit (a test holds them to it), at about
a thirtieth of the time (10,000 resamples of 1,400 values: 93 ms against 3 ms), with no matrix to hold.
"""
from __future__ import annotations

import numpy as np
from numba import njit

_BLOCK = 128  # numpy's PW_BLOCKSIZE: rows longer than this are split in halves


@njit(cache=True)
def _block_sums(X, idx, w, lo, n, out, r):
    """out[g] = sum of X[idx[i], g] * w[i] for i in lo..lo+n-1 (n <= 128), for every column g at once, each in
    numpy's order: eight partial sums (fewer than 8 values: in order). ``r``: scratch of 8 rows."""
    cols = X.shape[1]
    if n < 8:
        for g in range(cols):
            out[g] = 0.0
        for i in range(lo, lo + n):
            row, wi = X[idx[i]], w[i]
            for g in range(cols):
                out[g] += row[g] * wi
        return
    for k in range(8):
        row, wk = X[idx[lo + k]], w[lo + k]
        for g in range(cols):
            r[k, g] = row[g] * wk
    i = lo + 8
    end = lo + n - n % 8
    while i < end:
        for k in range(8):
            row, wk = X[idx[i + k]], w[i + k]
            for g in range(cols):
                r[k, g] += row[g] * wk
        i += 8
    for g in range(cols):
        out[g] = ((r[0, g] + r[1, g]) + (r[2, g] + r[3, g])) + ((r[4, g] + r[5, g]) + (r[6, g] + r[7, g]))
    while i < lo + n:
        row, wi = X[idx[i]], w[i]
        for g in range(cols):
            out[g] += row[g] * wi
        i += 1


@njit(cache=True)
def _pairwise_sums(X, idx, w, n, out, r, first):
    """out[g] = sum of X[idx[i], g] * w[i] for i < n, every column in numpy's pairwise order: above 128 values,
    the sum of the halves (the first half's length a multiple of 8), the first formed first. The recursion runs
    on an explicit stack (``first``: a level's first-half sums): numba's on-disk cache of a self-recursive
    function crashed the interpreter that loaded it."""
    if n <= _BLOCK:
        _block_sums(X, idx, w, 0, n, out, r)
        return
    seg_lo, seg_n = np.empty(64, np.int64), np.empty(64, np.int64)
    stage = np.empty(64, np.int64)   # 0: not split yet, 1: its first half pending, 2: its second half pending
    seg_lo[0], seg_n[0], stage[0] = 0, n, 0
    sp = 1
    while True:
        top = sp - 1
        if seg_n[top] > _BLOCK:      # split: the first half goes on the stack
            half = seg_n[top] // 2
            half -= half % 8
            stage[top] = 1
            seg_lo[sp], seg_n[sp], stage[sp] = seg_lo[top], half, 0
            sp += 1
            continue
        _block_sums(X, idx, w, seg_lo[top], seg_n[top], out, r)
        sp -= 1
        while sp > 0:                # hand the sums up: a first half waits for its second, a second completes
            parent = sp - 1
            if stage[parent] == 1:
                first[parent, :] = out
                stage[parent] = 2
                half = seg_n[parent] // 2
                half -= half % 8
                seg_lo[sp], seg_n[sp], stage[sp] = seg_lo[parent] + half, seg_n[parent] - half, 0
                sp += 1
                break
            for g in range(out.shape[0]):
                out[g] = first[parent, g] + out[g]
            sp -= 1
        if sp == 0:
            return


@njit(cache=True, nogil=True)    # without the GIL: cohorts.evaluation runs column blocks in threads
def _row_means(X, idx, w):
    """out[b, g]: the mean of X[idx[b, i], g] * w[b, i]; an argument with one row serves every row. Reading each
    draw once for all the columns is what makes several samples of one size cheaper together than apart."""
    m, n, cols = max(idx.shape[0], w.shape[0]), idx.shape[1], X.shape[1]
    out = np.empty((m, cols))
    acc, r, first = np.empty(cols), np.empty((8, cols)), np.empty((64, cols))
    for b in range(m):
        _pairwise_sums(X, idx[min(b, idx.shape[0] - 1)], w[min(b, w.shape[0] - 1)], n, acc, r, first)
        for g in range(cols):
            out[b, g] = (0.0 + acc[g]) / n
    return out


def _columns(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(x, dtype=np.float64).reshape(len(x), -1))


def resampled_means(x: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """``x[draws].mean(1)``: the mean of each row of draws (indices into x, any integer type). ``x`` may be
    several samples of one size as the columns of a matrix: then a column of means each, the same numbers."""
    means = _row_means(_columns(x), draws, np.ones((1, draws.shape[1])))
    return means[:, 0] if np.ndim(x) == 1 else means


def flipped_means(d: np.ndarray, flips: np.ndarray) -> np.ndarray:
    """``(flips * d).mean(1)``: the mean of d under each row of signs (+-1, any numeric type); ``d`` may be
    several samples' columns, as for :func:`resampled_means`."""
    means = _row_means(_columns(d), np.arange(flips.shape[1])[None, :], flips)
    return means[:, 0] if np.ndim(d) == 1 else means
