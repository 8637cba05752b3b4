"""Per-stay results cached in the workspace, so a nightly run recomputes only stays whose rows, config or code
changed.

One folder of parquet parts per kind and shard, ``WS/cache/<kind>/<K>/`` (:attr:`Workspace.cache`), whose rows
carry a ``key`` column: a content key (a digest of the stay's rows, the config and the code, see
:mod:`cohorts.stay_chunks`), never an identifier. A run reads the keys present, computes the missing ones, and
rewrites the shard's table with the keys still wanted (entries of stays that changed or left, a deleted
patient's among them, are dropped).
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

if TYPE_CHECKING:
    from pipeline.workspace import Workspace


class StayCache:
    """The cached rows of one kind (``tokens``, ``scores``, ...) of a workspace: per shard, a folder of parts
    (a run appends a part per batch; :meth:`update` compacts the shard to the keys still wanted)."""

    def __init__(self, ws: Workspace, kind: str):
        self.dir = ws.cache / kind
        # shard -> (its parts, their keys): a part is never changed once written (an update writes a new one
        # under a new name), so the same parts hold the same keys; a run asks a shard's keys, then updates it
        self._keys: dict[int, tuple[list[Path], frozenset[str]]] = {}

    def parts(self, shard: int) -> list[Path]:
        d = self.dir / str(int(shard))
        return sorted(d.glob("*.parquet")) if d.exists() else []

    def keys(self, shard: int) -> set[str]:
        parts = self.parts(shard)
        if not parts:
            return set()
        known = self._keys.get(int(shard))
        if known is None or known[0] != parts:
            known = (parts, frozenset(pl.scan_parquet(parts).select("key").unique().collect()["key"].to_list()))
            self._keys[int(shard)] = known
        return set(known[1])

    def read(self, shard: int, keys: set[str] | list[str] | None = None) -> pl.DataFrame | None:
        parts = self.parts(shard)
        if not parts:
            return None
        scan = pl.scan_parquet(parts)
        if keys is not None:
            scan = scan.filter(pl.col("key").is_in(pl.Series(list(keys), dtype=pl.String).implode()))
        return scan.collect()

    def scan(self) -> pl.LazyFrame | None:
        files = sorted(self.dir.glob("*/*.parquet"))
        return pl.scan_parquet(files) if files else None

    def append(self, shard: int, frames: list[pl.DataFrame]) -> None:
        frames = [f for f in frames if f is not None and f.height]
        if not frames:
            return
        d = self.dir / str(int(shard))
        d.mkdir(parents=True, exist_ok=True)
        target = d / f"part-{uuid.uuid4().hex[:8]}.parquet"
        tmp = target.with_suffix(".tmp")
        pl.concat(frames, how="diagonal_relaxed").write_parquet(tmp)
        os.replace(tmp, target)

    def update(self, shard: int, keep: set[str], new: list[pl.DataFrame] = ()) -> None:
        """The shard's rows become those whose key is in ``keep`` plus ``new``. Without stale rows (every
        cached key kept) ``new`` is appended as a part; otherwise the shard is rewritten as one part, streamed
        (the kept rows are never all in memory)."""
        stale = self.parts(shard)
        if not stale or self.keys(shard) <= set(keep):
            self.append(shard, list(new))
            return
        frames = [pl.scan_parquet(stale).filter(pl.col("key").is_in(pl.Series(list(keep), dtype=pl.String).implode()))]
        frames += [f.lazy() for f in new if f is not None and f.height]
        target = self.dir / str(int(shard)) / f"part-{uuid.uuid4().hex[:8]}.parquet"
        tmp = target.with_suffix(".tmp")
        pl.concat(frames, how="diagonal_relaxed").sink_parquet(tmp)
        os.replace(tmp, target)
        for p in stale:
            p.unlink()

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
