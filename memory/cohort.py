"""The persisted cohort memory: one budgeted SV memory fed the whole cohort's events in global time order.

A retrieval memory of the unit's atypical events. It is saved with its full solver state after every run
(``checkpoints/<seq>/``) so the next run resumes it, and a deletion can decrement it exactly. Token ids are
``"<owner>:<item>:<occurrence>"`` with an opaque owner reference (a keyed hash of the patient, made by the
pipeline); ``watermark`` is the order key of the last event fed, events are
fed in ``order_key`` order (ISO time, then event hash and occurrence). ``history`` is a digest of every row fed
(:func:`prefix_digests`): a run compares it with the store's rows up to the watermark to notice rows that
arrived late (dated before the watermark), which a watermark alone would skip for ever.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from .policies import SVSelection
from .svmemory import SVMemory


def token_id(owner: str, item: str, occurrence: int) -> str:
    """``owner``: an opaque reference of whom the token belongs to (the pipeline passes a keyed hash, so the
    memory never holds a patient identifier); ``item``: what the token is within the owner's stream."""
    return f"{owner}:{item}:{int(occurrence)}"


def owner_of(token: str) -> str:
    return str(token).split(":", 1)[0]


DIGEST_MOD = 1 << 64


def _hash_bytes(order_key: str, key_bytes: bytes) -> int:
    return int.from_bytes(hashlib.sha256(order_key.encode() + key_bytes).digest()[:8], "big")


def _row_bytes(keys: np.ndarray) -> Callable[[int], bytes]:
    """Row i's fp64 bytes, the block converted once (a conversion per row was a fifth of a long feed's hashing)."""
    raw = np.ascontiguousarray(keys, dtype=np.float64)
    width = raw.shape[1] * 8 if raw.ndim == 2 else 0
    flat = raw.tobytes()
    return lambda i: flat[i * width:(i + 1) * width]


def row_hashes(order_keys: list, keys: np.ndarray) -> Iterator[int]:
    """Each row's contribution to a history digest, in order: the hash of its order key and its key's fp64
    bytes."""
    row = _row_bytes(keys)
    return (_hash_bytes(ok, row(i)) for i, ok in enumerate(order_keys))


def prefix_digests(blocks: Iterable[tuple[list, np.ndarray]], marks: Iterable[str],
                   saved: Mapping[str, Collection[int]] | None = None) -> dict[str, int]:
    """The history digest at each order key of ``marks``: the multiset hash (sum of row hashes mod 2^64) of the
    rows ordered at or before it, equal for equal histories in any order, and a row can be subtracted from it
    (deletion) without the others. One pass over ``blocks`` of rows (order keys, keys), which come in order-key
    order, up to the last mark.

    ``saved``: the digests saved memories hold at each mark. The pass then stops at the first mark where the
    rows' digest is none of them (the history changed before it): that mark is the last one returned, the rows
    after it are not hashed (whoever asks re-feeds them from an earlier memory)."""
    todo, out, total = sorted(set(marks)), {}, 0

    def changed_at(mark: str) -> bool:     # records the digest at ``mark``; True: no saved memory holds it
        out[mark] = total % DIGEST_MOD
        return saved is not None and out[mark] not in saved.get(mark, ())
    i = 0
    for order_keys, keys in blocks:
        for order_key, h in zip(order_keys, row_hashes(order_keys, keys)):
            while i < len(todo) and order_key > todo[i]:
                if changed_at(todo[i]):
                    return out
                i += 1
            if i == len(todo):
                return out
            total += h
    for mark in todo[i:]:
        if changed_at(mark):
            break
    return out


class CohortMemory:
    def __init__(self, budget: int = 128, gamma: float = 0.5, nu: float = 0.5):
        self.policy = SVSelection(budget, gamma=gamma, nu=nu)
        self.gamma = gamma
        self.watermark = ""
        self.fed = 0
        self.history = 0          # the digest of every row fed so far (None: a checkpoint from before it)

    @property
    def memory(self) -> SVMemory:
        return self.policy.memory

    def feed(self, keys: np.ndarray, token_ids: list, order_keys: list) -> None:
        """Offer events in order; those at or below the watermark (already fed) are skipped. The block's keys are
        checked once, as the memory checks one."""
        checked = self.memory.check_keys(keys) if len(keys) else keys
        row = _row_bytes(keys) if len(keys) else None
        for i, (x, tid, ok) in enumerate(zip(checked, token_ids, order_keys)):
            if ok <= self.watermark:
                continue
            self.policy.learn_one(x, None, tid, check_input=False)
            self.watermark = ok
            self.fed += 1
            if self.history is not None:
                self.history = (self.history + _hash_bytes(ok, row(i))) % DIGEST_MOD

    def forget_history(self, order_keys: list, keys: np.ndarray) -> None:
        """Take rows that were fed out of the history digest (a deleted patient's rows at or before the
        watermark), so the digest stays that of the store's rows."""
        if self.history is not None:
            gone = sum(h for o, h in zip(order_keys, row_hashes(order_keys, keys)) if o <= self.watermark)
            self.history = (self.history - gone) % DIGEST_MOD

    def tokens_of(self, owner: str) -> list:
        return [t for t in self.memory.token_ids() if owner_of(t) == owner]

    def save(self, directory: Path) -> None:
        d = Path(directory)
        tmp = d.with_name(d.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.memory.save(tmp / "memory.npz")
        (tmp / "meta.json").write_text(json.dumps({
            "budget": self.policy.budget, "nu": self.policy.nu, "gamma": self.gamma, "watermark": self.watermark,
            "fed": self.fed, "certified": self.policy.certified, "uncertified": self.policy.uncertified,
            "history": None if self.history is None else f"{self.history:016x}"}))
        if d.exists():
            shutil.rmtree(d)
        tmp.rename(d)

    @staticmethod
    def saved_watermark(directory: Path) -> str:
        """The watermark of a saved memory, from its metadata alone (no solver state is loaded)."""
        return json.loads((Path(directory) / "meta.json").read_text())["watermark"]

    @staticmethod
    def saved_history(directory: Path) -> int | None:
        """The history digest of a saved memory, from its metadata alone (None: a memory from before it)."""
        h = json.loads((Path(directory) / "meta.json").read_text()).get("history")
        return None if h is None else int(h, 16)

    @classmethod
    def load(cls, directory: Path) -> CohortMemory:
        d = Path(directory)
        meta = json.loads((d / "meta.json").read_text())
        cm = cls.__new__(cls)
        cm.policy = SVSelection(meta["budget"], gamma=meta["gamma"], nu=meta["nu"],
                                memory=SVMemory.load(d / "memory.npz"))
        cm.policy.certified, cm.policy.uncertified = meta["certified"], meta["uncertified"]
        cm.gamma, cm.watermark, cm.fed = meta["gamma"], meta["watermark"], meta["fed"]
        cm.history = int(meta["history"], 16) if meta.get("history") is not None else None
        return cm
