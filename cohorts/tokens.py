"""Hourly patient-state tokens: one token per ICU stay and time bin, built out of core with Polars.

The clinical protocol of "Forgetful Attention" (arXiv:2607.12204, design note 9.7), declared in the cohort
YAML (``tokens:``):

1. readings of each channel's codes inside the stay's window, converted to the channel's unit; readings
   outside the channel's plausible range (or non-finite) are artifacts, counted and not used;
2. per stay and bin ``floor((t - intime) / bin)``: each channel's mean over the bin's plausible readings, on a
   grid from the stay's first to its last observed bin;
3. forward-fill, then backward-fill within the stay; then the training split's median per channel;
4. keys: each channel standardised with the training split's mean and sd (no statistic from an evaluation
   stay). ``TokenScaling`` holds those statistics and is persisted with the cohort memory.

Each token keeps the ids (event_hash, occurrence) of the readings it summarises, so deletion, rare items and
provenance stay exact at event level.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

from pipeline.store_reader import scan_events, store_codes

from .channels import Channel
from .config import CohortConfig
from .definitions import CohortConfigError, build_cohort, label_events, stay_events
from .predicates import matching_codes

KEYSET_ALL = "all_channels"
SCALINGS = ("reference", "training_split")


@dataclass
class TokenScaling:
    """Training-split statistics per channel: the imputation median and the standardisation mean and sd."""
    channels: list[str]
    median: np.ndarray
    mean: np.ndarray
    sd: np.ndarray

    @classmethod
    def fit(cls, filled_train: pl.DataFrame, channels: list[str]) -> "TokenScaling":
        med, mu, sd = [], [], []
        for c in channels:
            col = filled_train[c].drop_nulls() if filled_train.height else pl.Series(c, [], dtype=pl.Float64)
            if col.len() == 0:
                raise CohortConfigError(f"token channel {c!r} has no plausible reading in any training-split stay: "
                                        f"its codes may not match this data (see the cohort config)")
            m = float(col.median())
            v = filled_train[c].fill_null(m).to_numpy().astype(np.float64)
            s = float(v.std(ddof=1)) if v.size > 1 else 0.0
            med.append(m)
            mu.append(float(v.mean()))
            sd.append(s if np.isfinite(s) and s > 1e-12 else 1.0)
        return cls(list(channels), np.array(med), np.array(mu), np.array(sd))

    def as_dict(self) -> dict:
        return {"channels": list(self.channels), "median": self.median.tolist(), "mean": self.mean.tolist(),
                "sd": self.sd.tolist()}

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.as_dict()))

    @classmethod
    def load(cls, path: Path) -> "TokenScaling":
        d = json.loads(Path(path).read_text())
        return cls(d["channels"], np.array(d["median"]), np.array(d["mean"]), np.array(d["sd"]))

    def impute(self, frame: pl.DataFrame) -> pl.DataFrame:
        return frame.with_columns(pl.col(c).fill_null(float(m)) for c, m in zip(self.channels, self.median))

    def keys(self, frame: pl.DataFrame) -> np.ndarray:
        """(n, channels) fp64 standardised keys of imputed token rows."""
        raw = frame.select(self.channels).to_numpy().astype(np.float64) if frame.height else \
            np.empty((0, len(self.channels)))
        return (raw - self.mean) / self.sd


def declared_scaling(cfg: CohortConfig, names: list[str]) -> TokenScaling | None:
    """Token scaling declared in the cohort config (``tokens.scaling: reference`` with per-channel
    ``reference: {median, mean, sd}``): independent of the patients; None when the config asks for the
    training split's statistics."""
    spec = cfg.section("tokens")
    how = spec.get("scaling", "training_split")
    if how not in SCALINGS:
        raise CohortConfigError(f"tokens.scaling must be one of {SCALINGS}, got {how!r}")
    if how != "reference":
        return None
    ref = {c["name"]: c.get("reference") for c in spec["channels"]}
    missing = [n for n in names if not ref.get(n) or not all(k in ref[n] for k in ("median", "mean", "sd"))]
    if missing:
        raise CohortConfigError(f"tokens.scaling is 'reference' but channel(s) {missing} lack reference: "
                                f"{{median, mean, sd}}")
    return TokenScaling(list(names), np.array([float(ref[n]["median"]) for n in names]),
                        np.array([float(ref[n]["mean"]) for n in names]),
                        np.array([float(ref[n]["sd"]) for n in names]))


@dataclass
class TokenTable:
    """The cohort's hourly tokens (imputed raw channel values, one row per stay and bin) and their statistics.

    ``tokens`` columns: stay_id, subject_id, split, hour (the bin), time (bin start), one column per channel
    (filled and imputed, in the channel's unit), readings (plausible readings in the bin), event_hash and
    occurrence (lists: the readings the token summarises), and a boolean column per label once labelled.
    """
    tokens: pl.DataFrame
    scaling: TokenScaling
    channels: list[Channel]
    artifacts: dict[str, int]
    readings: dict[str, int]
    bin_hours: float


def bin_time(hours_per_bin: float) -> pl.Expr:
    """A token's time, the start of its bin: the stay's ``intime`` plus ``hour`` bins (every place that dates a
    token, a cached one included, computes it so, to the microsecond)."""
    return (pl.col("intime") + pl.duration(seconds=pl.col("hour") * int(3600 * hours_per_bin))).alias("time")


def reading_spec(channels: list[Channel], vocabulary: list[str]) -> pl.DataFrame:
    """(code, channel, scale, offset, lo, hi) per store code a channel reads: patterns become the store's codes
    they match, so readings join on exact codes."""
    return pl.DataFrame([{"code": code, "channel": ch.name, "scale": ch.convert.get(code, (1.0, 0.0))[0],
                          "offset": ch.convert.get(code, (1.0, 0.0))[1], "lo": ch.lo, "hi": ch.hi}
                         for ch in channels for code in matching_codes(list(ch.codes), vocabulary)],
                        schema={"code": pl.String, "channel": pl.String, "scale": pl.Float64, "offset": pl.Float64,
                                "lo": pl.Float64, "hi": pl.Float64})


def _readings(events: pl.LazyFrame, spec: pl.DataFrame, cohort: pl.DataFrame, hours_per_bin: float) -> pl.LazyFrame:
    win = cohort.select("stay_id", "intime", "outtime").lazy()
    seconds = (pl.col("time") - pl.col("intime")).dt.total_seconds()
    return (events.filter(pl.col("code").is_in(spec["code"].implode()) & pl.col("numeric_value").is_not_null())
            .select("stay_id", "time", "code", "numeric_value", "event_hash", pl.col("occurrence").cast(pl.Int64))
            .join(win, on="stay_id")
            .filter((pl.col("time") >= pl.col("intime")) & (pl.col("time") <= pl.col("outtime")))
            .join(spec.lazy(), on="code")
            .with_columns((pl.col("numeric_value") * pl.col("scale") + pl.col("offset")).alias("value"),
                          (seconds // (3600.0 * hours_per_bin)).cast(pl.Int64).alias("hour")))


def filled_tokens(events: pl.LazyFrame, spec: pl.DataFrame, cohort: pl.DataFrame, names: list[str],
                  hours_per_bin: float) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Steps 1-3 of the protocol but the training-split median, on ``events`` (the store, or one chunk's
    events) for ``cohort``'s stays: (tokens filled within each stay, still null where a stay never measured
    a channel; per stay and channel, its readings and artifacts)."""
    rd = _readings(events, spec, cohort, hours_per_bin)
    plausible = pl.col("value").is_finite() & (pl.col("value") >= pl.col("lo")) & (pl.col("value") <= pl.col("hi"))
    counts = (rd.group_by("stay_id", "channel").agg(pl.len().alias("readings"), (~plausible).sum().alias("artifacts"))
              .collect())
    ok = rd.filter(plausible)
    per_bin = ok.group_by("stay_id", "hour").agg(
        *[pl.col("value").filter(pl.col("channel") == c).mean().alias(c) for c in names],
        pl.len().alias("readings"), pl.col("event_hash"), pl.col("occurrence"))
    grid = (ok.group_by("stay_id").agg(pl.int_ranges(pl.col("hour").min(), pl.col("hour").max() + 1)
                                       .alias("hour")).explode("hour"))
    filled = (grid.join(per_bin, on=["stay_id", "hour"], how="left").sort("stay_id", "hour")
              .with_columns(pl.col(c).forward_fill().over("stay_id") for c in names)
              .with_columns(pl.col(c).backward_fill().over("stay_id") for c in names)
              .with_columns(pl.col("readings").fill_null(0),
                            pl.col("event_hash").fill_null(pl.lit([], dtype=pl.List(pl.String))),
                            pl.col("occurrence").fill_null(pl.lit([], dtype=pl.List(pl.Int64))))
              .join(cohort.select("stay_id", "subject_id", "split", "intime").lazy(), on="stay_id")
              .with_columns(bin_time(hours_per_bin))
              .select("stay_id", "subject_id", "split", "hour", "time", *names, "readings", "event_hash",
                      "occurrence")
              .sort("stay_id", "hour")
              .collect())
    return filled, counts


def build_tokens(store: Path, cfg: CohortConfig, scaling: TokenScaling | None = None,
                 cohort: pl.DataFrame | None = None, events: pl.LazyFrame | None = None) -> TokenTable:
    """Hourly tokens of every cohort stay at once (small stores, one subject's stays; a run builds them chunk by
    chunk, :mod:`run.token_run`). ``scaling`` (from a persisted memory) is used as given; otherwise it
    is fitted on the training split's stays. ``events``: the rows to read (default: the whole store)."""
    channels = cfg.channels
    names = [c.name for c in channels]
    hours_per_bin = cfg.bin_hours
    cohort = build_cohort(store, cfg) if cohort is None else cohort
    rows = scan_events(store) if events is None else events
    filled, counts = filled_tokens(rows, reading_spec(channels, store_codes(store)), cohort, names, hours_per_bin)
    scaling = scaling or declared_scaling(cfg, names) or TokenScaling.fit(filled.filter(pl.col("split") == "train"),
                                                                          names)
    check_scaling(scaling, names)
    totals = counts.group_by("channel").agg(pl.col("readings").sum(), pl.col("artifacts").sum())
    idx = {r["channel"]: r for r in totals.iter_rows(named=True)}
    return TokenTable(scaling.impute(filled), scaling, channels,
                      artifacts={c: int(idx.get(c, {}).get("artifacts", 0)) for c in names},
                      readings={c: int(idx.get(c, {}).get("readings", 0)) for c in names},
                      bin_hours=hours_per_bin)


def check_scaling(scaling: TokenScaling, names: list[str]) -> None:
    if scaling.channels != names:
        raise CohortConfigError(f"persisted token statistics are for channels {scaling.channels}, the config "
                                f"declares {names}")


def threshold_expr(thresholds: dict) -> pl.Expr:
    fired = pl.lit(False)
    for ch, rule in thresholds.items():
        if "above" in rule:
            fired = fired | (pl.col(ch) > rule["above"])
        if "below" in rule:
            fired = fired | (pl.col(ch) < rule["below"])
    return fired


def keyset_of(spec: dict) -> str:
    """The key set a label is scored on: all channels, or all but its held-out channel."""
    return f"without_{spec['heldout_channel']}" if spec.get("heldout_channel") else KEYSET_ALL


def label_tokens(table: TokenTable, store: Path, cfg: CohortConfig, cohort: pl.DataFrame | None = None,
                 events: pl.DataFrame | None = None) -> pl.DataFrame:
    """The token frame with one boolean column per label of ``token_labels``.

    Threshold labels read the filled raw values; ``from: deterioration`` and ``from: rare_items`` mark the bins
    in which a deterioration criterion fires or a rare-code event occurs (events of the whole stay, not only
    the channels). ``events``: the cohort's stay events when the caller has them already.
    """
    specs = cfg.labels
    tok = table.tokens
    exprs = [threshold_expr(s["thresholds"]).alias(n) for n, s in specs.items() if "thresholds" in s]
    tok = tok.with_columns(exprs) if exprs else tok
    event_labels = {n: s["from"] for n, s in specs.items() if "thresholds" not in s}
    if event_labels:
        cohort = build_cohort(store, cfg) if cohort is None else cohort
        ev = label_events(stay_events(store, cohort) if events is None else events, cohort, cfg)
        col = {"deterioration": "deteriorating", "rare_items": "rare"}
        per_bin = (ev.with_columns((pl.col("hour") // table.bin_hours).cast(pl.Int64).alias("hour"))
                   .group_by("stay_id", "hour")
                   .agg(*[pl.col(col[src]).any().alias(n) for n, src in event_labels.items()]))
        tok = (tok.join(per_bin, on=["stay_id", "hour"], how="left")
               .with_columns(pl.col(n).fill_null(False) for n in event_labels))
    return tok.sort("stay_id", "hour")
