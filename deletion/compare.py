"""How far apart two workspaces' derived artifacts are: a workspace after a deletion against one that never saw
the patient, artifact by artifact (what the never-saw test asserts equal and ``bench/never_saw_bench.py``
measures on the real demo)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import polars as pl

from memory.cohort import CohortMemory
from pipeline.meds import shard_files
from pipeline.workspace import Workspace

# report.json numbers that describe the run, not the cohort: when and how long, how many stays this run
# recomputed (caches), the store's deletion count, the extraction's source counts
RUN_BOOKKEEPING = frozenset({"generated_at", "seconds", "store_generation", "computed_stays", "ingest",
                             "provenance", "stale", "recomputed_by", "data_source", "code_version", "checkpoint"})
RESULT_KEY = ["stay_ref", "subject_ref", "protocol", "tokens", "keys", "label", "budget", "policy", "metric"]
STORE_TABLES = ("stays.parquet", "metadata/codes.parquet", "metadata/subject_splits.parquet")


@dataclass(frozen=True)
class ArtifactDifference:
    """One artifact of two workspaces: how many of its items were compared and how many differ.

    An item is a row (tables, counted as a multiset), a value (per-stay results, token statistics, report
    numbers) or a token (cohort memory); ``max_abs`` is the largest absolute difference of a number both hold.
    """

    artifact: str
    compared: int
    differing: int
    max_abs: float = 0.0

    @property
    def equal(self) -> bool:
        return self.differing == 0


def _rows_differing(a: pl.DataFrame, b: pl.DataFrame) -> int:
    """Rows one frame holds more often than the other (the frames as multisets of rows)."""
    if a.columns != b.columns:
        return max(a.height, b.height)
    if not a.columns:
        return 0
    cols = a.columns
    ca, cb = a.group_by(cols).len("n_a"), b.group_by(cols).len("n_b")
    both = ca.join(cb, on=cols, how="full", coalesce=True, nulls_equal=True)
    # counts are unsigned: signed before subtracting
    n_a, n_b = (pl.col(c).fill_null(0).cast(pl.Int64) for c in ("n_a", "n_b"))
    return int(both.select((n_a - n_b).abs().sum()).item())


def _table(name: str, a: Path, b: Path, drop: tuple = ()) -> ArtifactDifference:
    fa, fb = (pl.read_parquet(p).drop(drop, strict=False) if p.exists() else pl.DataFrame() for p in (a, b))
    return ArtifactDifference(name, max(fa.height, fb.height), _rows_differing(fa, fb))


def event_store(a: Workspace, b: Workspace) -> ArtifactDifference:
    """Event rows, shard by shard (a subject's shard is the same in both; one shard in memory at a time)."""
    names = sorted({p.name for ws in (a, b) for p in shard_files(ws.store)}, key=lambda n: int(Path(n).stem))
    compared = differing = 0
    for name in names:
        # the row's hash and occurrence number are the store's bookkeeping, not the event
        d = _table("events", a.store / "data" / name, b.store / "data" / name, drop=("event_hash", "occurrence"))
        compared, differing = compared + d.compared, differing + d.differing
    return ArtifactDifference("event store rows", compared, differing)


def label_files(a: Workspace, b: Workspace) -> ArtifactDifference:
    compared = differing = 0
    for name in sorted({p.name for ws in (a, b) for p in ws.labels.glob("*.parquet")}):
        d = _table(name, a.labels / name, b.labels / name)
        compared, differing = compared + d.compared, differing + d.differing
    return ArtifactDifference("MEDS label files", compared, differing)


def per_stay_results(a: Workspace, b: Workspace) -> ArtifactDifference:
    """Result values by their key (stay, protocol, label, budget, policy, metric); a key only one holds differs."""
    ra, rb = (pl.read_parquet(ws.results) for ws in (a, b))
    both = ra.join(rb, on=RESULT_KEY, how="full", coalesce=True, nulls_equal=True, suffix="_b")
    gap = (pl.col("value") - pl.col("value_b")).abs()
    # NaN beside NaN is the same value (a metric undefined for the stay in both)
    same = (pl.col("value") == pl.col("value_b")) | (pl.col("value").is_nan() & pl.col("value_b").is_nan())
    stats = both.select(differing=(~same.fill_null(False)).sum(), max_abs=gap.filter(gap.is_not_nan()).max())
    return ArtifactDifference("per-stay results", both.height, int(stats["differing"].item()),
                              float(stats["max_abs"].item() or 0.0))


def _flat(o, path: str = "", skip: frozenset = frozenset()) -> Iterator[tuple[str, float]]:
    """Every number of a JSON document, by its path, leaving out keys in ``skip``."""
    if isinstance(o, dict):
        for k, v in o.items():
            if k not in skip:
                yield from _flat(v, f"{path}/{k}", skip)
    elif isinstance(o, list):
        for i, v in enumerate(o):
            yield from _flat(v, f"{path}[{i}]", skip)
    elif isinstance(o, (int, float)) and not isinstance(o, bool):
        yield path, float(o)


def _numbers(name: str, a: Path, b: Path, atol: float, skip: frozenset = frozenset()) -> ArtifactDifference:
    na, nb = (dict(_flat(json.loads(p.read_text()), skip=skip)) if p.exists() else {} for p in (a, b))
    differing, worst = len(na.keys() ^ nb.keys()), 0.0
    for k in na.keys() & nb.keys():
        x, y = na[k], nb[k]
        if math.isnan(x) and math.isnan(y):
            continue
        gap = abs(x - y)
        worst = max(worst, gap) if not math.isnan(gap) else worst
        differing += not gap <= atol
    return ArtifactDifference(name, len(na.keys() | nb.keys()), differing, worst)


def cohort_memory(a: Workspace, b: Workspace, atol: float) -> list[ArtifactDifference]:
    """The latest checkpoint's token statistics and memory: tokens only one holds, and weights beyond ``atol``."""
    ca, cb = a.checkpoints()[-1], b.checkpoints()[-1]
    scaling = _numbers("token statistics (token_scaling.json)", ca / "token_scaling.json",
                       cb / "token_scaling.json", atol=0.0)
    wa, wb = (CohortMemory.load(c).memory.alpha_ for c in (ca, cb))
    common = wa.keys() & wb.keys()
    gaps = [abs(wa[t] - wb[t]) for t in common]
    differing = len(wa.keys() ^ wb.keys()) + sum(g > atol for g in gaps)
    return [scaling, ArtifactDifference("cohort memory tokens", len(wa.keys() | wb.keys()), differing,
                                        max(gaps, default=0.0))]


def compare_workspaces(a: Workspace, b: Workspace, atol: float = 1e-12) -> list[ArtifactDifference]:
    """Every derived artifact of ``a`` against ``b``: tables and results exactly, cohort-memory weights and
    report numbers within ``atol`` (the run's bookkeeping in report.json left out)."""
    memories = [sorted(p.name for p in ws.stay_memories.glob("*.npz")) for ws in (a, b)]
    return [event_store(a, b),
            *(_table(rel, a.store / rel, b.store / rel) for rel in STORE_TABLES),
            label_files(a, b),
            per_stay_results(a, b),
            ArtifactDifference("per-stay memory files", len(set(memories[0]) | set(memories[1])),
                               len(set(memories[0]) ^ set(memories[1]))),
            *cohort_memory(a, b, atol),
            _numbers("report.json numbers", a.report_json, b.report_json, atol, skip=RUN_BOOKKEEPING)]
