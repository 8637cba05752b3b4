"""Event keys: a documented, deterministic map from an event to a fixed-dimension fp64 vector.

key = [ code embedding (CODE_DIM) * CODE_SCALE | standardised value, has-value flag | time features ]

* code embedding: a unit vector drawn from a normal generator seeded by sha256(code): fixed across runs and
  machines, near-orthogonal between codes;
* value: (x - mean_code) / sd_code with mean and sd from the training split, clipped to [-CLIP, CLIP]; 0 and
  flag 0 when the event has no numeric value (or the code had none in training);
* time: hours since the stay's start / 24, and the hour of day on the unit circle (sin, cos).
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

if TYPE_CHECKING:
    from pathlib import Path

CODE_DIM = 8
CODE_SCALE = 1.0
CLIP = 5.0
KEY_DIM = CODE_DIM + 2 + 3


def code_embedding(code: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(code.encode()).digest()[:8], "little")
    v = np.random.default_rng(seed).standard_normal(CODE_DIM)
    return CODE_SCALE * v / np.linalg.norm(v)


class EventKeyer:
    """Fit per-code value statistics on training events, then map events to keys (``transform``)."""

    def fit(self, train_events: pl.DataFrame) -> EventKeyer:
        stats = (train_events.filter(pl.col("numeric_value").is_not_null())
                 .group_by("code").agg(pl.col("numeric_value").mean().alias("mean"),
                                       pl.col("numeric_value").std().alias("sd")))
        self.stats_ = stats.with_columns(
            pl.when(pl.col("sd").is_null() | (pl.col("sd") <= 1e-12)).then(1.0).otherwise(pl.col("sd"))
            .alias("sd"))
        return self

    def save(self, path: Path) -> None:
        self.stats_.write_parquet(path)

    @classmethod
    def load(cls, path: Path) -> EventKeyer:
        k = cls()
        k.stats_ = pl.read_parquet(path)
        return k

    def transform(self, events: pl.DataFrame) -> np.ndarray:
        """(n, KEY_DIM) float64 keys of ``events`` (columns code, numeric_value, time, hour)."""
        ev = events.select("code", "numeric_value", "time", "hour").join(self.stats_, on="code", how="left",
                                                                           maintain_order="left")
        codes = ev["code"].to_list()
        cache = {c: code_embedding(c) for c in set(codes)}
        emb = np.stack([cache[c] for c in codes]) if codes else np.empty((0, CODE_DIM))
        x = ev["numeric_value"].to_numpy().astype(np.float64)
        mu = ev["mean"].to_numpy().astype(np.float64)
        sd = ev["sd"].to_numpy().astype(np.float64)
        has = np.isfinite(x) & np.isfinite(mu)
        z = np.where(has, np.clip((x - np.where(has, mu, 0.0)) / np.where(has, sd, 1.0), -CLIP, CLIP), 0.0)
        t = ev["hour"].to_numpy().astype(np.float64) / 24.0
        hod = ev["time"].dt.hour().to_numpy().astype(np.float64) * (2 * np.pi / 24)
        return np.column_stack([emb, z, has.astype(np.float64), t, np.sin(hod), np.cos(hod)])
