"""The two scoring protocols on hourly token streams: the paper's fixed context, and streaming.

* ``fixed_context`` (Forgetful Attention, arXiv:2607.12204, section 5; design note 8.4): per stay, the exact
  solve over all n tokens with C = 1/(nu n); the budget is k = |S u E| of that solve and every baseline keeps
  exactly k tokens: ``recency`` (the last k), ``random`` (seeded per stay), ``h2o_proxy`` (top k by kernel mass:
  column sums of K with a zeroed diagonal), ``softmax_h2o`` and ``residual_delta`` (their online rules at budget
  k). Stays with k = 0 or k >= n are dropped and counted.
* ``streaming``: tokens in time order through each policy at budget B; SV with C = 1/(nu_B B). Besides what each
  policy keeps: the certified fraction of SV evictions and the **certificate expiry**: the fraction of
  certified evictions whose token is active (alpha > 0) in the exact full-history solve of the whole stay at
  the same C (design note 2.3: a certificate holds for the solve it was issued against, not for the future).

Metrics per label: ``retention`` (labelled tokens kept / labelled tokens) and ``retrieval`` (for each labelled
token, is the kept token nearest to it, the argmax of the RBF over the kept keys queried at its key, labelled: the
nearest-token readout; the paper's synthetic benchmark instead sums the kernel weight per group, see
bench/rare_items_bench.py). Every policy gets the same readout, so only selection differs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from memory.kernels import rbf
from memory.policies import SVSelection, make_policy
from memory.svmemory import SVMemory

from .evaluation import fraction_budget
from .config import CohortConfig, FixedContext, StreamingProtocol
from .tokens import KEYSET_ALL, TokenScaling, keyset_of

if TYPE_CHECKING:
    import polars as pl

STREAMING_POLICIES = ("sv_certified", "recency", "random", "softmax_h2o", "residual_delta")


@dataclass
class TokenStream:
    """One evaluation stay's tokens in time order: keys per key set, labels, and where its memory is kept."""
    stay_id: int
    subject_id: int
    keys: dict[str, np.ndarray]
    labels: dict[str, np.ndarray]
    label_keyset: dict[str, str]
    memory_path: str | None = None
    score_key: str | None = None      # its cached scores' key, in a run (run.token_run)

    def __len__(self) -> int:
        return len(next(iter(self.keys.values())))


@dataclass(frozen=True)
class StreamingSettings:
    """SV streaming hyper-parameters (chosen on the training split, see :func:`choose_streaming_settings`)."""
    nu: float = 0.5
    sigma: float = 3.0
    selection: list = field(default_factory=list, compare=False)   # the grid's training-split results

    @property
    def gamma(self) -> float:
        return 1.0 / self.sigma ** 2


def token_streams(labelled: pl.DataFrame, scaling: TokenScaling, cfg: CohortConfig, split: str | None = "eval"
                  ) -> list[TokenStream]:
    """Typed streams of one split's stays (None: every stay) from labelled tokens
    (:func:`cohorts.tokens.label_tokens`), keys standardised by ``scaling``."""
    specs = cfg.labels
    names = scaling.channels
    keysets = {keyset_of(s) for s in specs.values()} | {KEYSET_ALL}
    cols = {ks: [i for i, c in enumerate(names) if ks == KEYSET_ALL or ks != f"without_{c}"] for ks in keysets}
    frame = labelled if split is None else labelled.filter(labelled["split"] == split)
    out = []
    for (stay_id,), g in frame.group_by(["stay_id"], maintain_order=True):
        g = g.sort("hour")
        keys = scaling.keys(g)
        out.append(TokenStream(int(stay_id), int(g["subject_id"][0]),
                               {ks: np.ascontiguousarray(keys[:, c]) for ks, c in cols.items()},
                               {n: g[n].to_numpy().astype(bool) for n in specs},
                               {n: keyset_of(s) for n, s in specs.items()}))
    out.sort(key=lambda s: s.stay_id)
    return out


def exact_alpha(X: np.ndarray, C: float, gamma: float) -> np.ndarray:
    """Coefficients of the exact fixed-C solve over all rows of ``X`` (an exact KKT state, so zeros are exact)."""
    a = SVMemory(C=C, gamma=gamma, capacity=len(X) + 1).fit(X).alpha_
    return np.array([a[i] for i in range(len(X))])


def online_kept(name: str, X: np.ndarray, budget: int, seed: int) -> np.ndarray:
    pol = make_policy(name, budget, seed=seed)
    for i, x in enumerate(X):
        pol.learn_one(x, x, i)
    return np.array(sorted(pol.kept()), dtype=np.int64)


def h2o_proxy_kept(X: np.ndarray, k: int, gamma: float) -> np.ndarray:
    """Top-k tokens by kernel mass (column sums of K with its diagonal zeroed): the paper's similarity proxy."""
    K = rbf(X, X, gamma)
    np.fill_diagonal(K, 0.0)
    return np.sort(np.argsort(-K.sum(0), kind="stable")[:k])


def fixed_context_selections(X: np.ndarray, nu: float, gamma: float, seed: int) -> tuple:
    """(k, {policy: kept indices}) of one stay, or (k, None) when k = 0 or k >= n (dropped)."""
    n = len(X)
    alpha = exact_alpha(X, 1.0 / (nu * n), gamma)
    sv = np.flatnonzero(alpha > 0.0)
    k = len(sv)
    if k == 0 or k >= n:
        return k, None
    return k, {"sv_certified": sv, "recency": np.arange(n - k, n),
               "random": np.sort(np.random.default_rng(seed).choice(n, k, replace=False)),
               "h2o_proxy": h2o_proxy_kept(X, k, gamma),
               "softmax_h2o": online_kept("softmax_h2o", X, k, seed),
               "residual_delta": online_kept("residual_delta", X, k, seed)}


def streaming_sv(X: np.ndarray, budget: int, settings: StreamingSettings, save_to: str | None = None,
                 expiry: bool = True) -> tuple:
    """SV selection streamed at ``budget``: (kept indices, {certified_fraction, certificate_expiry} where defined).
    ``expiry``: whether to measure the certificate expiry (an exact full-history solve of the whole stream)."""
    pol = SVSelection(budget, gamma=settings.gamma, nu=settings.nu)
    for i, x in enumerate(X):
        pol.learn_one(x, x, i)
    if save_to is not None:
        pol.memory.save(save_to)
    extra = {}
    if pol.certified + pol.uncertified:    # no row at all for a stream that never evicted
        extra["certified_fraction"] = pol.certified_fraction
    if expiry and pol.certified_ids:
        active = exact_alpha(X, pol.C, settings.gamma) > 0.0
        extra["certificate_expiry"] = float(active[np.array(pol.certified_ids)].mean())
    return np.array(sorted(pol.kept()), dtype=np.int64), extra


def retention(kept: np.ndarray, label: np.ndarray) -> float:
    return float(label[kept].sum() / label.sum())


def retrieval(kept: np.ndarray, label: np.ndarray, X: np.ndarray, gamma: float) -> float:
    if len(kept) == 0:
        return 0.0
    nearest = np.argmax(rbf(X[label], X[kept], gamma), axis=1)
    return float(label[kept][nearest].mean())


def _label_rows(stream, keyset, X, selections, gamma, base):
    rows = []
    for label, y in stream.labels.items():
        if stream.label_keyset[label] != keyset or not y.any():
            continue
        for pol, kept in selections.items():
            for metric, v in (("retention", retention(kept, y)), ("retrieval", retrieval(kept, y, X, gamma))):
                rows.append({**base, "label": label, "policy": pol, "metric": metric, "value": v})
    return rows


def score_fixed_context(stream: TokenStream, nu: float, sigma: float) -> list[dict]:
    """Rows of the fixed-context protocol for one stay. A stay whose k is 0 or >= n gets only a
    ``support_size_boundary`` row (its k), so the dropped stays are counted."""
    gamma = 1.0 / sigma ** 2
    rows = []
    for keyset, X in stream.keys.items():
        k, selections = fixed_context_selections(X, nu, gamma, seed=stream.stay_id)
        base = {"stay_id": stream.stay_id, "subject_id": stream.subject_id, "protocol": "fixed_context",
                "tokens": "hourly", "keys": keyset, "budget": "k", "label": "none", "policy": "sv_certified"}
        if selections is None:
            rows.append({**base, "metric": "support_size_boundary", "value": float(k)})
            continue
        rows += _label_rows(stream, keyset, X, selections, gamma, base)
        rows.append({**base, "metric": "budget_k", "value": float(k)})
    return rows


def score_streaming(stream: TokenStream, points: list[tuple[str, int]], settings: StreamingSettings,
                    memory_budget: int | None = None, policies: tuple = STREAMING_POLICIES) -> list[dict]:
    """Rows of the streaming protocol for one stay at each (label, budget) point."""
    rows, done = [], {}
    for keyset, X in stream.keys.items():
        for label, budget in points:
            save = stream.memory_path if (keyset == KEYSET_ALL and budget == memory_budget) else None
            if (keyset, budget) not in done and len(X) <= budget and save is None:
                # Every policy evicts only past its budget (``memory.policies``), so a stream no longer than
                # the budget is kept whole by each, with no eviction and so no certificate rows: running the
                # memories would only confirm it (a fifth of the streamed tokens on the demo).
                done[(keyset, budget)] = {pol: np.arange(len(X), dtype=np.int64) for pol in policies}, {}
            if (keyset, budget) not in done:
                selections, extra = {}, {}
                for pol in policies:
                    if pol == "sv_certified":
                        selections[pol], extra = streaming_sv(X, budget, settings, save_to=save)
                    else:
                        selections[pol] = online_kept(pol, X, budget, seed=stream.stay_id)
                done[(keyset, budget)] = selections, extra
            selections, extra = done[(keyset, budget)]
            base = {"stay_id": stream.stay_id, "subject_id": stream.subject_id, "protocol": "streaming",
                    "tokens": "hourly", "keys": keyset, "budget": label}
            rows += _label_rows(stream, keyset, X, selections, settings.gamma, base)
            rows += [{**base, "label": "none", "policy": "sv_certified", "metric": m, "value": float(v)}
                     for m, v in extra.items()]
    return rows


def selection_grid(protocol: StreamingProtocol) -> list[StreamingSettings]:
    return [StreamingSettings(nu, sigma) for nu in protocol.nu_grid for sigma in protocol.sigma_grid]


def selects_on(stream: TokenStream, protocol: StreamingProtocol) -> bool:
    """Whether a training stay takes part in the choice: longer than the budget, with a labelled token."""
    return len(stream) > protocol.select_budget and bool(stream.labels[protocol.select_label].any())


def grid_scores(stream: TokenStream, protocol: StreamingProtocol) -> list[tuple[float, float]]:
    """(retention of ``select_label``, certified fraction) of SV streaming on one training stay, per setting
    of :func:`selection_grid`."""
    budget, label = protocol.select_budget, protocol.select_label
    out = []
    for st in selection_grid(protocol):
        kept, extra = streaming_sv(stream.keys[stream.label_keyset[label]], budget, st, expiry=False)
        out.append((retention(kept, stream.labels[label]), extra.get("certified_fraction", 1.0)))
    return out


def choose_settings(per_stay: list[list[tuple[float, float]]], protocol: StreamingProtocol) -> StreamingSettings:
    """The setting with the best mean retention among those whose mean certified fraction reaches
    ``min_certified`` (the largest certified fraction when none does), from the stays' :func:`grid_scores`."""
    results = []
    for j, st in enumerate(selection_grid(protocol)):
        ret = [s[j][0] for s in per_stay]
        cert = [s[j][1] for s in per_stay]
        results.append({"nu": st.nu, "sigma": st.sigma, "train_stays": len(per_stay),
                        "retention": float(np.mean(ret)) if ret else float("nan"),
                        "certified_fraction": float(np.mean(cert)) if cert else float("nan")})
    ok = [r for r in results if r["certified_fraction"] >= protocol.min_certified]
    best = max(ok, key=lambda r: r["retention"]) if ok else max(results, key=lambda r: r["certified_fraction"])
    return StreamingSettings(best["nu"], best["sigma"], selection=results)


def choose_streaming_settings(train: list[TokenStream], protocol: StreamingProtocol) -> StreamingSettings:
    """nu_B and sigma from the config's grid, scored on training-split stays only (longer than the budget).

    The setting with the best mean retention of ``select_label`` among those whose mean certified fraction
    reaches ``min_certified``; the largest certified fraction when none does.
    """
    return choose_settings([grid_scores(s, protocol) for s in train if selects_on(s, protocol)], protocol)


def score_token_streams(streams: list[TokenStream], budgets: tuple, fractions: tuple, settings: StreamingSettings,
                        fixed: FixedContext, memory_budget: int | None = None,
                        fraction_cap: int | None = None) -> list[dict]:
    """Both protocols over ``streams``: the per-stay long rows of a run (``fixed``: the fixed-context config)."""
    rows = []
    for s in streams:
        rows += score_fixed_context(s, fixed.nu, fixed.sigma)
        points = [(str(int(b)), int(b)) for b in budgets]
        points += [(f"f{f:g}", fraction_budget(f, len(s), fraction_cap)) for f in fractions]
        rows += score_streaming(s, points, settings, memory_budget=memory_budget)
    return rows
