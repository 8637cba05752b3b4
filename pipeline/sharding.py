"""How the event store splits its subjects into shards: ``subject_id % count``, the count fixed when the store is
created (``store/sharding.json``) and chosen from the size of the source it is created from.

A deletion rewrites its patients' shards and a night's late rows rewrite the shards of their patients, so a
shard's size is what those cost: with a count that grows with the source they cost about the same at 1 % of
MIMIC-IV as at 100 %, where sixteen fixed shards made each one a sixteenth of the store. Counts are powers of
two from 16, so any two stores' shards nest (shard k of the smaller count holds the subjects of the larger one's
shards j with j % smaller == k).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import polars as pl

SHARDING_FILE = "sharding.json"
LEGACY_COUNT = 16            # every store of format 4 or before
MIN_COUNT = 16
MAX_COUNT = 4096
# Of the source read when the store is created (gzip CSV or MEDS parquet); about twice that in the store's
# parquet. At 10 % of MIMIC-IV v3.1 (~0.7 GB of gzip CSV) this gives 128 shards, at 100 % 2,048.
SOURCE_BYTES_PER_SHARD = 6 * 2**20


@dataclass(frozen=True)
class Sharding:
    """The store's shard count; which shard holds a subject, in Python, Polars and SQL alike (a modulo that is
    never negative)."""
    count: int

    def __post_init__(self):
        if self.count < 1 or self.count & (self.count - 1):
            raise ValueError(f"a store's shard count is a power of two, not {self.count}")

    def shard(self, subject_id: int) -> int:
        return int(subject_id) % self.count

    def expr(self, subject: pl.Expr) -> pl.Expr:
        return (subject % self.count).cast(pl.Int64)

    def sql(self, subject: str) -> str:
        return f"((({subject}) % {self.count}) + {self.count}) % {self.count}"

    def shards(self) -> range:
        return range(self.count)

    @classmethod
    def for_source(cls, source_bytes: int) -> Sharding:
        """The count for a store created from ``source_bytes`` of source: the least power of two from
        MIN_COUNT that keeps SOURCE_BYTES_PER_SHARD or less per shard, at most MAX_COUNT."""
        n = MIN_COUNT
        while n < MAX_COUNT and n * SOURCE_BYTES_PER_SHARD < source_bytes:
            n *= 2
        return cls(n)

    @classmethod
    def of_store(cls, store: Path) -> Sharding:
        """The store's recorded count (LEGACY_COUNT for a store made before counts were recorded)."""
        f = Path(store) / SHARDING_FILE
        return cls(int(json.loads(f.read_text())["count"])) if f.exists() else cls(LEGACY_COUNT)

    def record(self, store: Path) -> None:
        """Fix the count of a new store (written once, atomically)."""
        f = Path(store) / SHARDING_FILE
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_name(f.name + ".tmp")
        tmp.write_text(json.dumps({"count": self.count, "rule": "subject_id % count"}))
        os.replace(tmp, f)


def is_recorded(store: Path) -> bool:
    return (Path(store) / SHARDING_FILE).exists()
