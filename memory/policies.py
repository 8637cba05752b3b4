"""Budgeted streaming memories: certified SV selection and the baselines, with one river-style API.

Every policy holds at most ``budget`` events; ``learn_one(key, value, token_id)`` offers one event and
``kept()`` returns the ids held; ``key_source`` says which keys of a stream it reads (``"event"`` or
``"learned"``). Rules (design note sections 8 and 9):

* ``SVSelection``: an SVMemory with fixed C = 1 / (nu_B * B) (feasible once it holds ceil(nu_B B) <= B events).
  When over budget it evicts the reserve token with the largest slack g (certified); only when the reserve set
  is empty it exactly decrements the active token with the smallest coefficient (an uncertified eviction,
  counted). Below ceil(1/C) stored events it is ungated.
* ``Recency``: FIFO of the last B events.
* ``SoftmaxHeavyHitter`` (online H2O): each stored event accumulates the softmax attention it receives from every
  later event's key as query; evicts the smallest accumulated mass outside the protected most recent B/2.
* ``ResidualRetention`` (delta-rule residual cache): a linear associative memory S predicts each event's value
  from its normalised key; score beta * ||v - S k||, min-heap of size B.
* ``ReservoirRandom``: uniform sample of the whole history (Algorithm R), seeded.
* ``SVLearnedSelection``: SV selection on the keys of a trained encoder (a stream's ``learned_keys``).
"""
from __future__ import annotations

import functools
import heapq
import inspect
import math

import numpy as np

from .svmemory import SVMemory


@functools.cache
def _constructor_options(cls: type) -> frozenset:
    # inspect.signature per policy made was a measurable share of scoring (one policy per stay and budget)
    return frozenset(inspect.signature(cls.__init__).parameters) - {"self", "budget"}


class Policy:
    """A budgeted streaming memory (river's one-event API): :meth:`learn_one` offers one event, :meth:`kept`
    returns the ids held, never more than ``budget``, and every event offered while it holds fewer (a policy
    evicts only past its budget: scoring relies on it, and a test holds every policy to it). ``key_source``:
    which keys of a stream it reads, the event keys or the learned ones. A subclass's constructor names every
    option it takes; anything else is an error."""
    name = ""
    key_source = "event"

    def __init__(self, budget: int):
        self.budget = int(budget)
        if self.budget < 1:
            raise ValueError(f"a policy's budget must be at least 1, got {budget!r}")

    def learn_one(self, key: np.ndarray, value: np.ndarray | None, token_id: int | str) -> None:
        raise NotImplementedError

    def kept(self) -> set:
        raise NotImplementedError

    @classmethod
    def options(cls) -> frozenset:
        """The keyword options its constructor takes besides the budget."""
        return _constructor_options(cls)


class SVSelection(Policy):
    name = "sv_certified"

    def __init__(self, budget: int, gamma: float = 0.5, nu: float = 0.5, memory: SVMemory | None = None):
        super().__init__(budget)
        self.nu = nu
        self.C = 1.0 / (nu * self.budget)
        if math.ceil(1.0 / self.C - 1e-12) > self.budget:
            raise ValueError(f"C={self.C} is infeasible for budget {budget}")
        self.memory = memory if memory is not None else SVMemory(C=self.C, gamma=gamma, capacity=self.budget + 1)
        self.certified = 0
        self.uncertified = 0
        self.certified_ids = []   # tokens evicted with a certificate, in eviction order (certificate expiry)

    def learn_one(self, key: np.ndarray, value: np.ndarray | None, token_id: int | str,
                  check_input: bool = True) -> None:
        """``check_input=False``: ``key`` is a row of ``memory.check_keys``' block (:meth:`SVMemory.add`)."""
        if self.memory.n_tokens < self.budget:
            self.memory.add(key, value, token_id=token_id, check_input=check_input)
            return
        if self.memory.offer(key, value, token_id, check_input):
            # added and evicted at once: a new reserve atom with the largest slack (certified, as below)
            self.certified += 1
            self.certified_ids.append(token_id)
            return
        victim = self.memory.reserve_with_largest_slack()
        if victim is not None:
            # the policy keeps no certificate, only the count: the state digests would be hashed and dropped
            self.memory.evict(victim, digests=False)
            self.certified += 1
            self.certified_ids.append(victim)
        else:
            self.memory.remove(self.memory.smallest_active())
            self.uncertified += 1

    def kept(self) -> set:
        return set(self.memory.token_ids())

    @property
    def certified_fraction(self) -> float:
        """Certified evictions / all evictions (1.0 before the first eviction)."""
        total = self.certified + self.uncertified
        return self.certified / total if total else 1.0


class SVLearnedSelection(SVSelection):
    """SV certified selection over learned event keys (``memory.encoder``); same rule, other keys."""
    name = "sv_learned"
    key_source = "learned"


class Recency(Policy):
    name = "recency"

    def __init__(self, budget: int):
        super().__init__(budget)
        self.ids = []

    def learn_one(self, key: np.ndarray, value: np.ndarray, token_id: int) -> None:
        self.ids.append(token_id)
        if len(self.ids) > self.budget:
            self.ids.pop(0)

    def kept(self) -> set:
        return set(self.ids)


class SoftmaxHeavyHitter(Policy):
    name = "softmax_h2o"

    def __init__(self, budget: int):
        super().__init__(budget)
        self.recent = max(1, self.budget // 2)
        self.ids = []
        self.keys = None   # (budget + 1, d): stored keys in arrival order
        self.mass = np.zeros(self.budget + 1)

    def learn_one(self, key: np.ndarray, value: np.ndarray, token_id: int) -> None:
        key = np.asarray(key, dtype=np.float64)
        n = len(self.ids)
        if self.keys is None:
            self.keys = np.zeros((self.budget + 1, key.size))
        if n:
            logits = self.keys[:n] @ key / math.sqrt(key.size)
            p = np.exp(logits - logits.max())
            self.mass[:n] += p / p.sum()
        self.ids.append(token_id)
        self.keys[n] = key
        self.mass[n] = 0.0
        if len(self.ids) > self.budget:
            i = int(np.argmin(self.mass[:len(self.ids) - self.recent]))
            del self.ids[i]
            self.keys[i:-1] = self.keys[i + 1:].copy()
            self.mass[i:-1] = self.mass[i + 1:].copy()

    def kept(self) -> set:
        return set(self.ids)


class ResidualRetention(Policy):
    name = "residual_delta"

    def __init__(self, budget: int, beta: float = 0.5):
        super().__init__(budget)
        self.beta = beta
        self.S = None
        self.heap = []
        self._n = 0

    def learn_one(self, key: np.ndarray, value: np.ndarray, token_id: int) -> None:
        k = np.asarray(key, dtype=np.float64)
        k = k / (np.linalg.norm(k) or 1.0)
        v = np.asarray(value, dtype=np.float64)
        if self.S is None:
            self.S = np.zeros((v.size, k.size))
        e = v - self.S @ k
        self.S += self.beta * np.outer(e, k)
        score = self.beta * float(np.linalg.norm(e))
        self._n += 1
        item = (score, self._n, token_id)
        if len(self.heap) < self.budget:
            heapq.heappush(self.heap, item)
        elif score > self.heap[0][0]:
            heapq.heapreplace(self.heap, item)

    def kept(self) -> set:
        return {t for _, _, t in self.heap}


class ReservoirRandom(Policy):
    name = "random"

    def __init__(self, budget: int, seed: int = 0):
        super().__init__(budget)
        self.rng = np.random.default_rng(seed)
        self.ids = []
        self._n = 0

    def learn_one(self, key: np.ndarray, value: np.ndarray, token_id: int) -> None:
        self._n += 1
        if len(self.ids) < self.budget:
            self.ids.append(token_id)
        else:
            j = int(self.rng.integers(self._n))
            if j < self.budget:
                self.ids[j] = token_id

    def kept(self) -> set:
        return set(self.ids)


POLICIES = {p.name: p for p in (SVSelection, SVLearnedSelection, Recency, SoftmaxHeavyHitter, ResidualRetention,
                                 ReservoirRandom)}


def make_policy(name: str, budget: int, **options) -> Policy:
    """Policy ``name`` at ``budget``, given those of ``options`` it takes: callers hold one set of run options
    (the kernel width, the seed) for every policy. An option that no policy takes is refused, so a misspelled one
    is never dropped silently."""
    known = frozenset().union(*(p.options() for p in POLICIES.values()))
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"no policy takes option(s) {unknown}; the policies' options are {sorted(known)}")
    policy = POLICIES[name]
    return policy(budget, **{k: v for k, v in options.items() if k in policy.options()})
