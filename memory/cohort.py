"""The persisted cohort memory: one budgeted SV memory fed the whole cohort's events in global time order.

A retrieval memory of the unit's atypical events. It is saved with its full solver state after every run
(``checkpoints/<seq>/``) so the next run resumes it, and a deletion can decrement it exactly. Token ids are
``"<subject_id>:<event_hash>:<occurrence>"``; ``watermark`` is the order key of the last event fed, events are
fed in ``order_key`` order (ISO time, then event hash and occurrence).
"""
import json
import shutil
from pathlib import Path

import numpy as np

from .policies import SVSelection
from .svmemory import SVMemory


def token_id(subject_id, event_hash, occurrence):
    return f"{int(subject_id)}:{event_hash}:{int(occurrence)}"


def subject_of(token):
    return int(str(token).split(":", 1)[0])


class CohortMemory:
    def __init__(self, budget=128, gamma=0.5, nu=0.5):
        self.policy = SVSelection(budget, gamma=gamma, nu=nu)
        self.gamma = gamma
        self.watermark = ""
        self.fed = 0

    @property
    def memory(self):
        return self.policy.memory

    def feed(self, keys, token_ids, order_keys):
        """Offer events in order; those at or below the watermark (already fed) are skipped."""
        for key, tid, ok in zip(keys, token_ids, order_keys):
            if ok <= self.watermark:
                continue
            self.policy.learn_one(np.asarray(key, dtype=np.float64), None, tid)
            self.watermark = ok
            self.fed += 1

    def tokens_of(self, subject_id):
        return [t for t in self.memory.token_ids() if subject_of(t) == int(subject_id)]

    def save(self, directory):
        d = Path(directory)
        tmp = d.with_name(d.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.memory.save(tmp / "memory.npz")
        (tmp / "meta.json").write_text(json.dumps({
            "budget": self.policy.budget, "nu": self.policy.nu, "gamma": self.gamma, "watermark": self.watermark,
            "fed": self.fed, "certified": self.policy.certified, "uncertified": self.policy.uncertified}))
        if d.exists():
            shutil.rmtree(d)
        tmp.rename(d)

    @classmethod
    def load(cls, directory):
        d = Path(directory)
        meta = json.loads((d / "meta.json").read_text())
        cm = cls.__new__(cls)
        cm.policy = SVSelection(meta["budget"], gamma=meta["gamma"], nu=meta["nu"],
                                memory=SVMemory.load(d / "memory.npz"))
        cm.policy.certified, cm.policy.uncertified = meta["certified"], meta["uncertified"]
        cm.gamma, cm.watermark, cm.fed = meta["gamma"], meta["watermark"], meta["fed"]
        return cm
