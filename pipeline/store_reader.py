"""The event store's read API: its events as lazy frames (values in fp64), its codes, its quarantine's reasons, one
patient's events. The writer is :mod:`pipeline.extract`; readers need neither DuckDB nor the extraction's rules."""
from __future__ import annotations

from pathlib import Path

import polars as pl

from .errors import UnknownSubjectError
from .meds import events_glob, quarantine_files, read_codes_metadata, shard_of

__all__ = ["UnknownSubjectError", "quarantine_reasons", "read_subject", "scan_events", "scan_events_in",
           "store_codes"]


def scan_events(store: Path) -> pl.LazyFrame:
    """Lazy frame over the whole event store, values in double precision (stored as MEDS's float32; every
    computation over them is fp64)."""
    return scan_events_in(events_glob(store))


def scan_events_in(files: Path) -> pl.LazyFrame:
    return pl.scan_parquet(files).with_columns(pl.col("numeric_value").cast(pl.Float64))


def store_codes(store: Path) -> list[str]:
    """Every code in the store (from its codes metadata when it has one)."""
    meta = read_codes_metadata(store)
    codes = meta["code"] if meta is not None else scan_events(store).select("code").unique().collect()["code"]
    return codes.to_list()


def quarantine_reasons(store: Path) -> dict[str, int]:
    """Rows the extraction rejected, by the rule that rejected them (empty when nothing was rejected)."""
    files = quarantine_files(store)
    if not files:
        return {}
    counts = pl.scan_parquet(files).group_by("reason").len().sort("reason").collect()
    return {r: int(n) for r, n in counts.iter_rows()}


def read_subject(store: Path, subject_id: int) -> pl.DataFrame | None:
    """One patient's events in time order, reading only that patient's shard."""
    shard = shard_of(store, subject_id)
    frame = None
    if shard.exists():
        frame = (scan_events_in(shard).filter(pl.col("subject_id") == int(subject_id))
                 .sort(["time", "code", "event_hash", "occurrence"]).collect())
    if frame is None or frame.height == 0:
        raise UnknownSubjectError(f"subject {subject_id} has no events in the store {store}")
    return frame
