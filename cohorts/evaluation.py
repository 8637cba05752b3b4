"""Matched-budget retention: stream each evaluation stay through every policy and score what it keeps.

Metrics per stay, policy and budget B:

* ``det_retention_end``: fraction of the stay's deterioration hours with at least one event still in memory
  at the end of the stream;
* ``det_retention_hour_end``: the same, checked at the end of each deterioration hour (just after its last
  event): how much of the current episode the memory holds while it happens;
* ``rare_recall``: fraction of the stay's rare events kept at the end;
* ``certified_fraction``: certified evictions / all evictions (SV selection only);
* ``output_deviation``: mean distance between a uniform RBF readout over the kept events and over the whole
  stream, at the stay's own event keys as queries (every policy gets the same readout, so only selection
  differs).

Aggregates: mean with a percentile bootstrap CI over stays, and paired SV-minus-baseline differences with a
bootstrap CI and a two-sided sign-flip permutation p-value (10,000 resamples, seed 0).
"""
from __future__ import annotations

import functools
import os
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from memory.kernels import rbf
from memory.policies import POLICIES, make_policy

from .endpoints import EXPLORATORY, NO_ENDPOINTS, Endpoints
from .resampling import flipped_means, resampled_means
from .results import SUPPORT, Budget, PairedRow, SummaryRow

if TYPE_CHECKING:
    from collections.abc import Callable

# The policy whose memory is a stay's persisted SV memory, and whose certified fraction the report gives (the
# learned-key variant is a comparison row, not the product's memory).
STAY_MEMORY_POLICY = "sv_certified"


@dataclass(frozen=True)
class EventStream:
    """One evaluation stay's raw events in time order (events mode), one row per event.

    ``keys``: fp64 event keys (``pipeline.keys.EventKeyer``); ``learned_keys``: the trained encoder's keys, when
    the run has one; ``memory_path``: where the stay's SV memory is persisted, when it is.
    """
    stay_id: int
    subject_id: int | None
    keys: np.ndarray
    hours: np.ndarray
    deteriorating: np.ndarray
    rare: np.ndarray
    learned_keys: np.ndarray | None = None
    memory_path: str | None = None

    def __len__(self) -> int:
        return len(self.keys)


def _uniform_readout(Q, X, gamma):
    W = rbf(Q, X, gamma)
    return (W @ X) / np.maximum(W.sum(1, keepdims=True), 1e-300)


def score_stay(stay: EventStream, budget: int, policy_names: tuple = tuple(POLICIES), gamma: float = 0.5, seed: int = 0,
               n_probe: int = 32, save_memory_to: str | None = None) -> dict:
    """Metrics of every policy on one stay.

    ``save_memory_to``: a path where the SV policy's final memory state is persisted (the per-stay memory).
    """
    keys, hours = stay.keys, stay.hours
    det, rare = stay.deteriorating, stay.rare
    n = len(keys)
    det_hours = np.unique(hours[det])
    last_of_hour = {h: int(np.flatnonzero(hours == h).max()) for h in det_hours}
    checkpoints = {i: h for h, i in last_of_hour.items()}
    rng = np.random.default_rng(seed)
    probes = keys[rng.choice(n, size=min(n_probe, n), replace=False)]
    full = _uniform_readout(probes, keys, gamma)
    out = {}
    for name in policy_names:
        policy = POLICIES[name]
        own = stay.learned_keys if policy.key_source == "learned" else keys
        if own is None:
            continue  # no trained encoder in this run
        pol = make_policy(name, budget, gamma=gamma, seed=seed)
        held_at_hour_end = []
        for i in range(n):
            pol.learn_one(own[i], own[i], i)
            if i in checkpoints:
                kept = np.fromiter(pol.kept(), dtype=np.int64)
                held_at_hour_end.append(bool(np.any(hours[kept] == checkpoints[i])))
        kept = np.array(sorted(pol.kept()), dtype=np.int64)
        m = {}
        if len(det_hours):
            m["det_retention_end"] = float(np.isin(det_hours, hours[kept][det[kept]]).mean())
            m["det_retention_hour_end"] = float(np.mean(held_at_hour_end))
        if rare.any():
            m["rare_recall"] = float(rare[kept].sum() / rare.sum())
        if name == STAY_MEMORY_POLICY:
            if save_memory_to is not None:
                pol.memory.save(save_memory_to)
            m["certified_fraction"] = float(pol.certified_fraction)
        m["output_deviation"] = float(np.linalg.norm(_uniform_readout(probes, keys[kept], gamma) - full,
                                                     axis=1).mean())
        m["kept"] = int(len(kept))
        out[name] = m
    return out


def _score_task(args):
    stay, budget, policies, gamma, save_to = args
    return stay.stay_id, budget, score_stay(stay, budget, policies, gamma=gamma, seed=int(stay.stay_id),
                                               save_memory_to=save_to)


def fraction_budget(fraction: float, n_events: int, cap: int | None) -> int:
    """Budget of a fraction-of-stream point: round(fraction * n), at least 4, at most ``cap``.

    The cap (by default the largest fixed budget) bounds the cost of the exact memories: K and the KKT inverse
    take O(B^2) space and each event O(B |S|) time, so 20 % of a 40,000-event stay would be an 8,000-token
    memory. Stays short enough stay below the cap and get their true fraction.
    """
    b = max(4, int(round(fraction * n_events)))
    return min(b, int(cap)) if cap is not None else b


def run_sweep(stays: list, budgets: tuple, fractions: tuple,
              policies: tuple = tuple(POLICIES), gamma: float = 0.5,
              workers: int | None = None, memory_budget: int | None = None, fraction_cap: str = "max_budget") -> list:
    """Per-stay results for every (budget, policy); fraction budgets are labelled 'f0.1' etc.

    ``fraction_cap``: the largest fraction budget (see :func:`fraction_budget`); "max_budget" (default) means
    ``max(budgets)``, None no cap.

    Stays are scored in parallel processes (``workers`` defaults to the machine's cores). At ``memory_budget``
    the SV memory of every stay that has a ``memory_path`` is persisted there.
    """
    if fraction_cap == "max_budget":
        fraction_cap = max(budgets) if len(budgets) else None
    # Each distinct (stay, budget) is scored once: a fraction point that lands on a fixed budget (or on the
    # cap) is the same deterministic computation, so its rows are copies under its own label.
    tasks, task_of, labels = [], {}, []
    for stay in stays:
        n = len(stay)
        points = [(str(int(b)), int(b)) for b in budgets]
        points += [(f"f{f:g}", fraction_budget(f, n, fraction_cap)) for f in fractions]
        for label, b in points:
            key = (stay.stay_id, b)
            if key not in task_of:
                task_of[key] = len(tasks)
                save_to = stay.memory_path if memory_budget == b else None
                tasks.append((stay, b, policies, gamma, save_to))
            labels.append((label, task_of[key]))
    workers = workers or os.cpu_count() or 1
    if workers > 1:
        with ProcessPoolExecutor(max_workers=workers) as ex:
            results = list(ex.map(_score_task, tasks, chunksize=4))
    else:
        results = [_score_task(t) for t in tasks]
    subject = {s.stay_id: s.subject_id for s in stays}
    out = []
    for label, i in labels:
        stay_id, _, per_policy = results[i]
        for pol, m in per_policy.items():
            out.append({"stay_id": stay_id, "subject_id": subject[stay_id], "budget": label, "policy": pol, **m})
    return out


def balanced_chunks(stays: list, n_chunks: int, size: Callable = len) -> list:
    """Split stays into at most ``n_chunks`` lists of about equal work (``size``: events), heaviest list first.

    Longest-processing-time greedy: a round-robin split put the demo's one 40,000-event stay in a chunk that
    ran minutes after the others had finished.
    """
    order = sorted(range(len(stays)), key=lambda i: -size(stays[i]))
    chunks = [[] for _ in range(max(1, min(n_chunks, len(stays))))]
    load = [0] * len(chunks)
    for i in order:
        k = load.index(min(load))
        chunks[k].append(stays[i])
        load[k] += size(stays[i])
    return [c for _, c in sorted(zip(load, chunks), key=lambda lc: -lc[0]) if c]


RESAMPLE_CELLS = 1 << 22     # resampled values drawn at a time (32 MiB of indices), whatever the stays
# Above this many stays the resampling distributions are replaced by their normal limit: resampling costs
# n_resamples x n draws per comparison (hours over a full MIMIC-IV run's ~600 comparisons), while the limit
# agrees with 10,000 resamples within their Monte Carlo error there (tests/cohorts/test_token_run.py).
RESAMPLE_MAX_N = 2000


def _blocks(n_resamples: int, n: int):
    """Row counts of the resampling blocks: memory stays at RESAMPLE_CELLS draws however many stays there are."""
    rows = max(1, RESAMPLE_CELLS // max(n, 1))
    for lo in range(0, n_resamples, rows):
        yield min(rows, n_resamples - lo)


@functools.lru_cache(maxsize=4)
def _resample_indices(n: int, n_boot: int, seed: int) -> tuple[np.ndarray, ...]:
    """The bootstrap's draws for ``n`` values, block by block, as the seeded generator gives them: every group of a
    run with ``n`` stays draws these same indices, so they are drawn once (drawing cost ~3x the resampling
    itself); int16 where ``n`` allows, to bound the cache."""
    rng = np.random.default_rng(seed)
    dtype = np.int16 if n <= np.iinfo(np.int16).max else np.int64
    return tuple(rng.integers(0, n, size=(m, n)).astype(dtype) for m in _blocks(n_boot, n))


@functools.lru_cache(maxsize=4)
def _sign_flips(n: int, n_perm: int, seed: int) -> tuple[np.ndarray, ...]:
    """The sign-flip test's flips for ``n`` differences, block by block (drawn once, as the bootstrap's draws)."""
    rng = np.random.default_rng(seed)
    return tuple(rng.choice([-1.0, 1.0], size=(m, n)).astype(np.int8) for m in _blocks(n_perm, n))


def bootstrap_ci(x: list | np.ndarray, n_boot: int = 10_000, seed: int = 0, level: float = 0.95) -> tuple:
    """Percentile bootstrap CI of the mean, resampled in blocks (bounded memory); its normal limit above
    RESAMPLE_MAX_N values."""
    return bootstrap_cis([x], n_boot, seed, level)[0]


def bootstrap_cis(samples: list, n_boot: int = 10_000, seed: int = 0, level: float = 0.95) -> list[tuple]:
    """:func:`bootstrap_ci` of each sample, the same numbers; samples of one size share the cached draws, each
    block of them read once for all those samples (as the columns of one matrix)."""
    out = [None] * len(samples)
    by_size = {}
    for i, x in enumerate(samples):
        x = np.asarray(x, dtype=np.float64)
        if len(x) == 0:
            out[i] = float("nan"), float("nan")
        elif len(x) > RESAMPLE_MAX_N:   # the bootstrap distribution of the mean: normal, sd = plug-in sd / sqrt(n)
            half = NormalDist().inv_cdf(1 - (1 - level) / 2) * x.std() / np.sqrt(len(x))
            out[i] = float(x.mean() - half), float(x.mean() + half)
        else:
            by_size.setdefault(len(x), []).append((i, x))
    for n, group in by_size.items():
        blocks = _resample_indices(n, n_boot, seed)
        X = np.column_stack([x for _, x in group])

        def resampled(cols: slice) -> np.ndarray:
            block = np.ascontiguousarray(X[:, cols])
            return np.concatenate([resampled_means(block, b) for b in blocks])
        means = _by_columns(resampled, X.shape[1])
        # every column's quantiles at once: the same partition and interpolation per column as one by one
        limits = np.quantile(means, [(1 - level) / 2, 1 - (1 - level) / 2], axis=0)
        for j, (i, _) in enumerate(group):
            out[i] = float(limits[0, j]), float(limits[1, j])
    return out


def _by_columns(fn: Callable, n_cols: int) -> np.ndarray:
    """``fn(columns)`` over blocks of ``n_cols`` columns (slices), one thread per core, joined side by side: the
    resampling's compiled loops release the GIL, and a column's numbers are the same bits in any block."""
    blocks = [slice(int(b[0]), int(b[-1]) + 1) for b in np.array_split(np.arange(n_cols),
                                                                        min(os.cpu_count() or 1, n_cols))]
    if len(blocks) <= 1:
        return fn(blocks[0])
    with ThreadPoolExecutor(max_workers=len(blocks)) as pool:
        return np.concatenate(list(pool.map(fn, blocks)), axis=-1)


def _side_by_side(fn: Callable, items: list) -> list:
    """``[fn(x) for x in items]``, one thread per core (each result the same bits as alone)."""
    workers = min(os.cpu_count() or 1, len(items))
    if workers <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


def sign_flip_p(d: list | np.ndarray, n_perm: int = 10_000, seed: int = 0) -> float:
    """Two-sided sign-flip permutation p-value of a paired mean difference, flips drawn in blocks; its normal
    limit above RESAMPLE_MAX_N differences."""
    return sign_flip_ps([d], [n_perm], seed)[0]


def sign_flip_ps(samples: list, n_perms: list[int], seed: int = 0) -> list[float]:
    """:func:`sign_flip_p` of each sample under its number of flips, the same numbers; samples of one size and
    number share the cached flips, each block read once for all of them (as for :func:`bootstrap_cis`)."""
    out, tested = [None] * len(samples), {}
    for i, (d, n_perm) in enumerate(zip(samples, n_perms)):
        d = np.asarray(d, dtype=np.float64)
        if len(d) == 0 or np.allclose(d, 0):
            out[i] = 1.0
        elif len(d) > RESAMPLE_MAX_N:   # the sign-flip distribution of the mean: normal, sd = sqrt(sum d^2) / n
            out[i] = float(2 * NormalDist().cdf(-abs(d.mean()) / (np.sqrt(np.sum(d * d)) / len(d))))
        else:
            tested.setdefault((len(d), n_perm), []).append((i, d))
    for (n, n_perm), group in tested.items():
        flips = _sign_flips(n, n_perm, seed)
        D = np.column_stack([d for _, d in group])
        obs = np.array([abs(d.mean()) for _, d in group])

        def hits(cols: slice) -> np.ndarray:
            block, limit = np.ascontiguousarray(D[:, cols]), obs[cols] - 1e-15
            return sum((np.abs(flipped_means(block, f)) >= limit).sum(0) for f in flips)
        for (i, _), count in zip(group, _by_columns(hits, D.shape[1])):
            # (count + 1) / (n + 1): a Monte Carlo p-value is never 0
            out[i] = float((int(count) + 1) / (n_perm + 1))
    return out


# Events-mode metrics as (label, metric) of the long rows every protocol shares.
EVENT_METRICS = {"det_retention_end": ("clinical_criteria", "retention"),
                 "det_retention_hour_end": ("clinical_criteria", "retention_hour_end"),
                 "rare_recall": ("rare_items", "retention"), "certified_fraction": ("none", "certified_fraction"),
                 "output_deviation": ("none", "output_deviation")}
GROUP = ("protocol", "tokens", "keys", "label", "budget", "policy", "metric")
PAIRED_METRICS = ("retention", "retrieval", "retention_hour_end", "output_deviation")


def long_rows(rows: list) -> list:
    """Per-stay rows in the long form of every protocol: stay_id, subject_id, protocol, tokens, keys, label,
    budget, policy, metric, value. Events-mode rows of :func:`run_sweep` (one column per metric) are
    converted; rows already long pass through."""
    out = []
    for r in rows:
        if "metric" in r:
            out.append(r)
            continue
        base = {"stay_id": r["stay_id"], "subject_id": r.get("subject_id"), "protocol": "streaming",
                "tokens": "events", "keys": "learned_keys" if r["policy"] == "sv_learned" else "event_keys",
                "budget": r["budget"], "policy": r["policy"]}
        out += [{**base, "label": label, "metric": metric, "value": float(r[m])}
                for m, (label, metric) in EVENT_METRICS.items() if m in r]
    return out


def holm(p_values: list) -> list:
    """Holm-Bonferroni adjusted p-values (step-down; monotone; capped at 1), in the input order."""
    p = np.asarray(p_values, dtype=np.float64)
    order = np.argsort(p, kind="stable")
    adj = np.maximum.accumulate((len(p) - np.arange(len(p))) * p[order]) if len(p) else p
    out = np.empty_like(p)
    out[order] = np.minimum(adj, 1.0)
    return out.tolist()


def aggregate(rows: list | pl.DataFrame | pl.LazyFrame, reference: str = "sv_certified",
              endpoints: Endpoints = NO_ENDPOINTS) -> tuple:
    """Per (protocol, tokens, keys, label, budget, policy, metric): mean, CI, n; and paired differences of
    ``reference`` minus each other policy on the same stays, with a sign-flip p-value (``p_value``), the
    Wilcoxon signed-rank p beside it (``p_wilcoxon``), the comparison's ``family`` under ``endpoints`` and its
    Holm adjustment within that family (``p_holm``; None for an exploratory comparison).

    ``rows``: per-stay rows (a list, as :func:`long_rows` takes them) or a frame of long rows, such as a
    lazy scan of a run's results file. Values are held per group as arrays, in stay order (the order the
    resampling draws over), never as one object per row."""
    frame = rows.lazy() if isinstance(rows, pl.DataFrame) else rows
    if isinstance(rows, list):
        frame = pl.DataFrame(long_rows(rows), infer_schema_length=None).lazy() if rows else None
    if frame is None:
        return [], []
    # a results file names stays by keyed reference; rows fresh from scoring by id
    stay = "stay_ref" if "stay_ref" in frame.collect_schema().names() else "stay_id"
    # stays as their dense rank (the same order, so the same draws): integer arrays, taken per group without a
    # Python object per row (the per-row lists were a quarter of a 10 % rerun's statistics)
    grouped = (frame.select(*GROUP, stay, "value").with_columns(pl.col(g).cast(pl.String) for g in GROUP)
               .with_columns(pl.col(stay).rank("dense").cast(pl.Int64))
               .group_by(GROUP).agg(pl.col(stay).sort_by(stay), pl.col("value").sort_by(stay)).collect())
    stays_of, values_of = grouped[stay], grouped["value"]
    by = {group: (stays_of[i].to_numpy(), values_of[i].to_numpy().astype(np.float64, copy=False))
          for i, group in enumerate(grouped.select(GROUP).rows())}
    summary, values, pairs, diffs = [], [], [], []
    for group, (stays, v) in sorted(by.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        fields = dict(zip(GROUP, group))
        summary.append(SummaryRow(**fields, mean=float(v.mean()), n=int(len(v))))
        values.append(v)
        ref_key = group[:5] + (reference,) + group[6:]
        if fields["policy"] != reference and fields["metric"] in PAIRED_METRICS and ref_key in by:
            ref_stays, ref_v = by[ref_key]
            _, i, j = np.intersect1d(ref_stays, stays, assume_unique=True, return_indices=True)
            diffs.append(ref_v[i] - v[j])
            pairs.append(fields)
    paired = _side_by_side(lambda k: _paired_row(pairs[k], diffs[k], endpoints), range(len(pairs)))
    # at once: tests of one size share the resampling's draws
    ps = sign_flip_ps(diffs, [endpoints.resamples(r.family) for r in paired])
    paired = [replace(r, p_value=p) for r, p in zip(paired, ps)]
    cis = bootstrap_cis(values + diffs)
    summary = [replace(r, ci_low=lo, ci_high=hi) for r, (lo, hi) in zip(summary, cis)]
    paired = [replace(r, ci_low=lo, ci_high=hi) for r, (lo, hi) in zip(paired, cis[len(values):])]
    for family in {r.family for r in paired} - {EXPLORATORY}:
        at = [k for k, r in enumerate(paired) if r.family == family]
        for k, p in zip(at, holm([paired[k].p_value for k in at])):
            paired[k] = replace(paired[k], p_holm=p)
    return summary, paired


def _paired_row(fields: dict, d: np.ndarray, endpoints: Endpoints) -> PairedRow:
    row = PairedRow(**{k: fields[k] for k in GROUP if k != "policy"}, baseline=fields["policy"])
    family = endpoints.family_of(row)
    return replace(row, mean_diff=float(d.mean()) if len(d) else float("nan"), p_wilcoxon=wilcoxon_p(d),
                   n=int(len(d)), family=family, p_holm=None)


def wilcoxon_p(d: np.ndarray) -> float:
    """Two-sided Wilcoxon signed-rank p of paired differences (exact for small n without ties, else its
    normal approximation): a p-value with no resampling floor, beside the sign-flip test."""
    # imported here: scipy.stats takes ~1 s to import, and every module that reads this one's stream types (a
    # decrement deletion's command among them) would wait for it without computing a statistic
    from scipy.stats import wilcoxon
    d = np.asarray(d, dtype=np.float64)
    if len(d) == 0 or np.allclose(d, 0):
        return 1.0
    return float(wilcoxon(d, zero_method="wilcox", alternative="two-sided").pvalue)


HEADLINE_METRICS = ("retention", "certified_fraction", "certificate_expiry")


HEADLINE_BUDGETS = (SUPPORT, Budget("tokens", 32), Budget("tokens", 64))


def headline_rows(summary: list[SummaryRow]) -> list[SummaryRow]:
    """The rows a user reads first: fixed-context retention (budget k) and streaming retention and
    certification at B = 32 and 64."""
    return [r for r in summary if r.metric in HEADLINE_METRICS and r.budget in HEADLINE_BUDGETS]
