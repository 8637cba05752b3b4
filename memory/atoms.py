"""The token/atom registry of an SV memory: which tokens each atom (a distinct key) holds, and where it lives.

Exact duplicate keys are one atom with multiplicity m (box m C). An atom occupies a *slot* of the solver's
buffers; slots freed by deleted atoms are reused. ``seq`` numbers atoms in creation order, the canonical order
in which outputs and digests sum over them, so that a state does not depend on how its atoms occupy slots.
"""
from __future__ import annotations

import hashlib
import itertools
from typing import Hashable, NamedTuple

import numpy as np

from .errors import UnknownTokenError


def grown(a: np.ndarray, shape: tuple, dtype: type = np.float64) -> np.ndarray:
    """A zero array of ``shape`` holding ``a`` in its leading corner (a buffer grown, contents kept)."""
    out = np.zeros(shape, dtype=dtype)
    out[tuple(slice(0, s) for s in a.shape)] = a
    return out


class TokenRecord(NamedTuple):
    seq: int             # creation number of the token's atom
    value: np.ndarray    # the token's value vector
    arrival: int         # arrival number of the token


def atom_leaf(key: np.ndarray, token_ids: list) -> bytes:
    """Digest leaf of one atom: its key's bytes and its token ids (in arrival order)."""
    return hashlib.sha256(key.tobytes() + b"\x1d" + "\x1f".join(map(repr, token_ids)).encode()).digest()


class AtomRegistry:
    """Per-slot keys, multiplicities and creation numbers, and the token records behind them.

    ``n`` slots are in use: atoms, and free slots below the last atom (``free``; a new atom takes the most
    recently freed). Per slot: ``X`` the key, ``mult`` the multiplicity, ``seq`` the creation number (-1 when
    free), ``token_lists`` the token ids in arrival order, ``value_sum`` the sum of their values and ``leaves``
    the SHA-256 digest leaf of key and token ids. A leaf is computed when a digest first needs it
    (:meth:`refresh_leaves`; ``stale`` holds the atoms changed since): a stream that never asks for a digest, a
    policy's evictions, hashes nothing.
    """

    def __init__(self):
        self.n = 0
        self.free = []
        self.X = np.empty((0, 0))
        self.mult = np.empty(0, dtype=np.int64)
        self.seq = np.empty(0, dtype=np.int64)
        self.token_lists = []
        self.value_sum = []
        self.leaves = []
        self.stale = set()
        self.slot_of_seq = {}
        self.seq_of_keybytes = {}
        self.tokens = {}  # token id -> TokenRecord, in arrival order
        self.arrivals = itertools.count()
        self.next_seq = itertools.count()
        self.auto_id = itertools.count()

    @property
    def n_atoms(self) -> int:
        return self.n - len(self.free)

    def set_dim(self, dim: int) -> None:
        self.X = np.zeros((0, dim))

    def grow(self, cap: int) -> None:
        """Per-slot arrays for ``cap`` slots, the first n kept."""
        n = self.n
        self.X = grown(self.X[:n], (cap, self.X.shape[1]))
        self.mult = grown(self.mult[:n], (cap,), np.int64)
        self.seq = grown(self.seq[:n], (cap,), np.int64)

    def new_token_id(self) -> int:
        token_id = next(self.auto_id)
        while token_id in self.tokens:
            token_id = next(self.auto_id)
        return token_id

    def slot_of(self, token_id: Hashable) -> int:
        try:
            seq = self.tokens[token_id].seq
        except (KeyError, TypeError):
            raise UnknownTokenError(f"unknown token id {token_id!r}") from None
        return self.slot_of_seq[seq]

    def slot_of_key(self, x: np.ndarray) -> int | None:
        """The slot of the atom whose key equals x bit for bit, or None."""
        seq = self.seq_of_keybytes.get(x.tobytes())
        return None if seq is None else self.slot_of_seq[seq]

    def take_slot(self) -> int:
        """A slot for a new atom: the most recently freed, else a new one at the end (the caller has grown the
        per-slot arrays to hold it)."""
        if self.free:
            return self.free.pop()
        self.token_lists.append([])
        self.value_sum.append(None)
        self.leaves.append(b"")
        self.n += 1
        return self.n - 1

    def open_atom(self, slot: int, x: np.ndarray) -> None:
        """Register key x as a new atom in ``slot`` (multiplicity 0 until tokens are recorded)."""
        self.X[slot] = x
        self.mult[slot] = 0
        seq = next(self.next_seq)
        self.seq[slot] = seq
        self.slot_of_seq[seq] = slot
        self.seq_of_keybytes[x.tobytes()] = seq

    def close_atom(self, slot: int) -> None:
        """Forget an emptied atom; its slot becomes free, and free slots at the end are given back."""
        del self.slot_of_seq[int(self.seq[slot])]
        del self.seq_of_keybytes[self.X[slot].tobytes()]
        self.X[slot] = 0.0
        self.mult[slot] = 0
        self.seq[slot] = -1
        self.token_lists[slot] = []
        self.value_sum[slot] = None
        self.leaves[slot] = b""
        self.stale.discard(slot)
        self.free.append(slot)
        while self.n and self.seq[self.n - 1] == -1:
            self.n -= 1
            self.free.remove(self.n)
            self.token_lists.pop()
            self.value_sum.pop()
            self.leaves.pop()

    def record(self, token_id: Hashable, slot: int, value: np.ndarray) -> None:
        """Add a token to the atom in ``slot`` (its multiplicity is the caller's)."""
        self.tokens[token_id] = TokenRecord(int(self.seq[slot]), value, next(self.arrivals))
        self.token_lists[slot].append(token_id)
        self.stale.add(slot)
        self.value_sum[slot] = value.copy() if self.value_sum[slot] is None else self.value_sum[slot] + value

    def forget(self, token_id: Hashable, slot: int) -> None:
        """Drop a token's record from its atom (which keeps its slot even when emptied: see ``close_atom``)."""
        del self.tokens[token_id]
        tokens = self.token_lists[slot]
        tokens.remove(token_id)
        if tokens:
            # Re-summed from the remaining tokens, not by subtraction, so the atom's mean value is exact.
            self.value_sum[slot] = np.sum([self.tokens[t].value for t in tokens], axis=0)
            self.stale.add(slot)

    def refresh_leaves(self) -> list:
        """``leaves``, with those of the atoms changed since the last call recomputed."""
        for slot in self.stale:
            self.leaves[slot] = atom_leaf(self.X[slot], self.token_lists[slot])
        self.stale.clear()
        return self.leaves

    def restore(self, n: int, free: list, records: list) -> None:
        """Rebuild the slot maps and token lists after X, mult and seq were loaded for ``n`` slots; ``records``
        are (token id, TokenRecord) in arrival order."""
        self.n = n
        self.free = list(free)
        live = [i for i in range(n) if self.seq[i] != -1]
        self.slot_of_seq = {int(self.seq[i]): i for i in live}
        self.seq_of_keybytes = {self.X[i].tobytes(): int(self.seq[i]) for i in live}
        self.token_lists = [[] for _ in range(n)]
        self.value_sum = [None] * n
        self.leaves = [b""] * n
        self.stale = set()
        for tid, rec in records:
            self.tokens[tid] = rec
            self.token_lists[self.slot_of_seq[rec.seq]].append(tid)
        for slot in live:
            self.value_sum[slot] = np.sum([self.tokens[t].value for t in self.token_lists[slot]], axis=0)
            self.stale.add(slot)
        self.next_seq = itertools.count(int(self.seq[:n].max()) + 1 if n else 0)
        self.arrivals = itertools.count(max((r.arrival for _, r in records), default=-1) + 1)
        ints = [t for t in self.tokens if isinstance(t, int)]
        self.auto_id = itertools.count(max(ints) + 1 if ints else 0)
