"""The cohort's stays in chunks over the store's shards: what a run reads at a time, never the whole store.

A chunk is a run of whole subjects of one shard (``data/K.parquet`` holds the subjects with
``subject_id % count == K``, :mod:`pipeline.sharding`, sorted by subject), at most ``max_stays`` stays, so a chunk's events are one
shard's row groups between two subject ids: memory grows with the largest chunk, not with the cohort.
Each stay gets a **content digest** of the rows a run reads for it (its own events and the hospital-level
events inside its window, by event hash and occurrence, and its row of the stay table); with the cohort
config's and the code's digests it keys every per-stay cache (:mod:`run.stay_cache`).
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from pipeline.store_reader import scan_events_in
from pipeline.meds import shard_path
from pipeline.sharding import Sharding

DEFAULT_CHUNK_STAYS = 256
EVENT_COLUMNS = ["stay_id", "subject_id", "time", "code", "numeric_value", "unit", "source_table", "event_hash",
                 "occurrence", "intime"]
STAY_ROW = ["stay_id", "subject_id", "intime", "outtime", "anchor_age", "first_careunit"]


@dataclass(frozen=True)
class StayChunk:
    """Whole subjects of one shard: their cohort rows (stay_id, subject_id, split, intime, outtime, ...)."""
    shard: int
    stays: pl.DataFrame

    @property
    def subjects(self) -> pl.Series:
        return self.stays["subject_id"].unique().sort()

    def __len__(self) -> int:
        return self.stays.height


def plan_chunks(cohort: pl.DataFrame, sharding: Sharding, max_stays: int = DEFAULT_CHUNK_STAYS) -> list[StayChunk]:
    """The cohort split into chunks of whole subjects, shard by shard, at most ``max_stays`` stays each (a
    subject with more stays than that is one chunk)."""
    chunks = []
    frame = cohort.with_columns(sharding.expr(pl.col("subject_id")).alias("_shard")).sort("_shard", "subject_id",
                                                                                          "stay_id")
    for (k,), part in frame.group_by(["_shard"], maintain_order=True):
        part = part.drop("_shard")
        sizes = part.group_by("subject_id", maintain_order=True).len()
        start, count = 0, 0
        for n in sizes["len"].to_list():
            if count and count + n > max_stays:
                chunks.append(StayChunk(int(k), part.slice(start, count)))
                start, count = start + count, 0
            count += n
        if count:
            chunks.append(StayChunk(int(k), part.slice(start, count)))
    return chunks


def in_windows(events: pl.LazyFrame, stays: pl.DataFrame) -> pl.LazyFrame:
    """Every event inside each stay's window, with its hour of stay (the rule of a run: events carrying a
    cohort stay's id as they are; hospital-level events without one attached to the stay whose window
    contains them)."""
    win = stays.select("stay_id", "subject_id", "intime", "outtime").lazy()
    cols = [c for c in EVENT_COLUMNS if c in {*events.collect_schema().names(), "intime"}]
    with_stay = events.filter(pl.col("stay_id").is_not_null()).join(win.drop("subject_id"), on="stay_id")
    without = (events.filter(pl.col("stay_id").is_null()).drop("stay_id").join(win, on="subject_id")
               .filter((pl.col("time") >= pl.col("intime")) & (pl.col("time") <= pl.col("outtime"))))
    out = pl.concat([with_stay.select(cols), without.select(cols)])
    hour = ((pl.col("time") - pl.col("intime")).dt.total_seconds() // 3600).cast(pl.Int64).clip(lower_bound=0)
    return out.with_columns(hour.alias("hour")).drop("intime")


def chunk_scan(store: Path, chunk: StayChunk) -> pl.LazyFrame:
    """The chunk's subjects' rows: only its shard, between its first and last subject (row groups outside that
    range are skipped by their statistics)."""
    subjects = chunk.subjects
    return scan_events_in(shard_path(store, chunk.shard)).filter(
        pl.col("subject_id").is_between(int(subjects[0]), int(subjects[-1])) &
        pl.col("subject_id").is_in(subjects.implode()))


EVENT_ORDER = ["stay_id", "time", "code", "event_hash", "occurrence"]


def chunk_events(store: Path, chunk: StayChunk) -> pl.DataFrame:
    """The chunk's stay events in stay and time order."""
    return chunks_events(store, [chunk])


def chunks_events(store: Path, chunks: list[StayChunk]) -> pl.DataFrame:
    """The stay events of chunks (of one shard or several, each its shard's subjects), read in one query, in stay
    and time order."""
    return pl.concat([in_windows(chunk_scan(store, c), c.stays) for c in chunks]).sort(EVENT_ORDER).collect()


DIGEST_COLUMNS = ["stay_id", "subject_id", "time", "event_hash", "occurrence"]   # what a stay's digest reads


def chunk_digests(store: Path, chunk: StayChunk) -> dict[int, str]:
    """:func:`stay_digests` of the chunk's stays from the columns they read only (no sort): a fifth of the
    columns, for shards whose stays are mostly cached already."""
    return stay_digests(in_windows(chunk_scan(store, chunk).select(DIGEST_COLUMNS), chunk.stays).collect(),
                        chunk.stays)


def stay_digests(events: pl.DataFrame, stays: pl.DataFrame) -> dict[int, str]:
    """stay_id -> a digest of the stay's rows: every event the run reads for it (by content hash and
    occurrence, in any order: a multiset hash) and its row of the stay table."""
    # each column hashed alone, then mixed: no string is built per row (a rerun digests every stay of the shards
    # it touched; the joined string's hash took three times as long)
    h = pl.col("event_hash").hash(seed=7) ^ pl.col("occurrence").hash(seed=11)
    per_stay = (events.select("stay_id", h.alias("h")).group_by("stay_id")
                .agg(pl.col("h").sum().alias("sum"), pl.col("h").min().alias("min"), pl.len().alias("n")))
    agg = {r[0]: r[1:] for r in per_stay.iter_rows()}
    out = {}
    for row in stays.select(*[c for c in STAY_ROW if c in stays.columns]).iter_rows():
        content = repr((row, agg.get(row[0])))
        out[int(row[0])] = hashlib.sha256(content.encode()).hexdigest()[:32]
    return out


@functools.cache
def code_digest() -> str:
    """A digest of the code that computes per-stay results from the store's rows (``memory``, ``cohorts`` and
    ``run``;
    a change of extraction changes the rows, which the stays' digests see) and of the numerical libraries'
    versions: a change of either recomputes every cached stay. Once per process (every stay's cache key holds
    it: it was read again for each, every source file and five package versions)."""
    from importlib.metadata import PackageNotFoundError, version
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for pkg in ("memory", "cohorts", "run"):
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    for name in ("numpy", "scipy", "numba", "polars", "scikit-learn"):
        try:
            h.update(f"{name}={version(name)}".encode())
        except PackageNotFoundError:
            pass
    return h.hexdigest()[:32]
