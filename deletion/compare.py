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
from pipeline.meds import shard_path
from pipeline.sharding import Sharding
from pipeline.workspace import Workspace

# report.json numbers that describe the run, not the cohort: when and how long, how many stays this run
# recomputed (caches), the store's deletion count, the extraction's source counts
RUN_BOOKKEEPING = frozenset({"generated_at", "seconds", "store_generation", "computed_stays", "ingest",
                             "provenance", "stale", "recomputed_by", "data_source", "code_version", "checkpoint"})
RESULT_KEY = ["stay_ref", "subject_ref", "protocol", "tokens", "keys", "label", "budget", "policy", "metric"]
STORE_TABLES = ("stays.parquet", "metadata/codes.parquet", "code_tables.parquet", "metadata/subject_splits.parquet")


@dataclass(frozen=True)
class ArtifactDifference:
    """One artifact of two workspaces: how many of its items were compared and how many differ.

    An item is a row (tables, counted as a multiset), a value (per-stay results, token statistics, report
    numbers) or a token (cohort memory); ``max_abs`` is the largest absolute difference of a number both hold;
    ``out_of_order`` counts, where both hold the same items, those at another position (a table's row order, the
    memory's arrival order).
    """

    artifact: str
    compared: int
    differing: int
    max_abs: float = 0.0
    out_of_order: int = 0

    @property
    def equal(self) -> bool:
        return self.differing == 0 and self.out_of_order == 0

    def describe(self) -> str:
        """"equal", or how many of its items differ (and by how much), or are out of order."""
        gap = f" (max {self.max_abs:.3g})" if self.max_abs else ""
        return ("equal" if self.equal else f"{self.differing:,} of {self.compared:,} differ{gap}" if self.differing
                else f"same; {self.out_of_order:,} of {self.compared:,} out of order")


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


def _out_of_place(a: list, b: list) -> int:
    """Positions at which two sequences of the same items differ (the same items in another order)."""
    return sum(x != y for x, y in zip(a, b))


def _table(name: str, a: Path | list[Path], b: Path | list[Path], drop: tuple = (),
           ordered: bool = True) -> ArtifactDifference:
    """Rows one file (or list of files) holds more often than the other; with the same rows, ``ordered`` counts
    the rows out of place (a file's row order is part of what its writer makes)."""
    def read(p):
        files = [f for f in ([p] if isinstance(p, Path) else p) if f.exists()]
        return pl.read_parquet(files).drop(drop, strict=False) if files else pl.DataFrame()
    fa, fb = read(a), read(b)
    differing, out_of_order = _rows_differing(fa, fb), 0
    if ordered and differing == 0 and not fa.equals(fb):
        out_of_order = _out_of_place(fa.hash_rows().to_list(), fb.hash_rows().to_list())
    return ArtifactDifference(name, max(fa.height, fb.height), differing, out_of_order=out_of_order)


def _summed(name: str, parts: list[ArtifactDifference]) -> ArtifactDifference:
    """One artifact made of several files (the store's shards, the label files)."""
    return ArtifactDifference(name, sum(d.compared for d in parts), sum(d.differing for d in parts),
                              out_of_order=sum(d.out_of_order for d in parts))


def event_store(a: Workspace, b: Workspace) -> ArtifactDifference:
    """Event rows, shard by shard of the store with fewer shards (one in memory at a time): the stores' shard
    counts are powers of two, so its shard k holds the subjects of the other's shards j with j % count == k (two
    sources of different sizes may have made stores of different counts)."""
    sharding = {ws: Sharding.of_store(ws.store) for ws in (a, b)}
    coarse = min(s.count for s in sharding.values())

    def group(ws: Workspace, k: int) -> list[Path]:
        return [shard_path(ws.store, j) for j in range(k, sharding[ws].count, coarse)]
    # the row's hash and occurrence number are the store's bookkeeping, not the event; a shard's rows are in the
    # order its subjects' rows arrived, not part of the event either
    return _summed("event store rows", [_table(f"shard {k}", group(a, k), group(b, k),
                                               drop=("event_hash", "occurrence"), ordered=False)
                                        for k in range(coarse)])


def label_files(a: Workspace, b: Workspace) -> ArtifactDifference:
    names = sorted({p.name for ws in (a, b) for p in ws.labels.glob("*.parquet")})
    return _summed("MEDS label files", [_table(name, a.labels / name, b.labels / name) for name in names])


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


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _flat(o, path: str = "", skip: frozenset = frozenset()) -> Iterator[tuple[str, object]]:
    """Every leaf (number, string, bool, null) of a JSON document, by its path, leaving out keys in ``skip``."""
    if isinstance(o, dict):
        for k, v in o.items():
            if k not in skip:
                yield from _flat(v, f"{path}/{k}", skip)
    elif isinstance(o, list):
        for i, v in enumerate(o):
            yield from _flat(v, f"{path}[{i}]", skip)
    else:
        yield path, o


def json_leaves(name: str, a: Path, b: Path, atol: float, skip: frozenset = frozenset(),
            numbers_only: bool = False) -> ArtifactDifference:
    """A JSON file's leaves by path: numbers within ``atol`` (NaN beside NaN equal), other leaves exactly;
    ``numbers_only`` compares the numbers alone."""
    na, nb = ({k: v for k, v in _flat(json.loads(p.read_text()), skip=skip) if _is_number(v) or not numbers_only}
              if p.exists() else {} for p in (a, b))
    differing, worst = len(na.keys() ^ nb.keys()), 0.0
    for k in na.keys() & nb.keys():
        x, y = na[k], nb[k]
        if not (_is_number(x) and _is_number(y)):
            differing += x != y
            continue
        if math.isnan(x) and math.isnan(y):
            continue
        gap = abs(x - y)
        worst = max(worst, gap) if not math.isnan(gap) else worst
        differing += not gap <= atol
    return ArtifactDifference(name, len(na.keys() | nb.keys()), differing, worst)


def cohort_memory(a: Workspace, b: Workspace, atol: float) -> list[ArtifactDifference]:
    """The latest checkpoint's token statistics and memory: tokens only one holds, and weights beyond ``atol``."""
    ca, cb = a.checkpoints()[-1], b.checkpoints()[-1]
    scaling = json_leaves("token statistics (token_scaling.json)", ca / "token_scaling.json",
                      cb / "token_scaling.json", atol=0.0)
    ma, mb = (CohortMemory.load(c).memory for c in (ca, cb))
    wa, wb = ma.alpha_, mb.alpha_
    gaps = [abs(wa[t] - wb[t]) for t in wa.keys() & wb.keys()]
    differing = len(wa.keys() ^ wb.keys()) + sum(g > atol for g in gaps)
    # the same tokens and weights: their arrival order must match too
    out_of_order = _out_of_place(ma.token_ids(), mb.token_ids()) if differing == 0 else 0
    return [scaling, ArtifactDifference("cohort memory tokens", len(wa.keys() | wb.keys()), differing,
                                        max(gaps, default=0.0), out_of_order)]


def compare_workspaces(a: Workspace, b: Workspace, atol: float = 1e-12) -> list[ArtifactDifference]:
    """Every derived artifact of ``a`` against ``b``: tables (in their order, event rows in any), results and
    token statistics exactly, the cohort memory's tokens in arrival order with weights within ``atol``, and
    report numbers within ``atol`` (the run's bookkeeping in report.json left out)."""
    memories = [sorted(p.name for p in ws.stay_memories.glob("*.npz")) for ws in (a, b)]
    return [event_store(a, b),
            *(_table(rel, a.store / rel, b.store / rel) for rel in STORE_TABLES),
            label_files(a, b),
            per_stay_results(a, b),
            ArtifactDifference("per-stay memory files", len(set(memories[0]) | set(memories[1])),
                               len(set(memories[0]) ^ set(memories[1]))),
            *cohort_memory(a, b, atol),
            json_leaves("report.json numbers", a.report_json, b.report_json, atol, skip=RUN_BOOKKEEPING,
                    numbers_only=True)]
