"""Cohort, deterioration hours, rare items and the subject-level split, from a declarative YAML config."""
import hashlib
from pathlib import Path

import polars as pl
import yaml

from pipeline.extract import scan_events

DEFAULT_CONFIG = Path(__file__).parent / "config" / "default.yaml"


class CohortConfigError(ValueError):
    """The cohort configuration is missing a field or has an invalid one."""


def load_config(path=None):
    cfg = yaml.safe_load(Path(path or DEFAULT_CONFIG).read_text())
    for section, keys in (("cohort", ("min_age", "min_stay_hours")), ("deterioration", ("criteria",)),
                          ("rare_items", ("quantile",)), ("split", ("eval_fraction", "salt"))):
        for k in keys:
            if k not in (cfg.get(section) or {}):
                raise CohortConfigError(f"cohort config {path or DEFAULT_CONFIG} lacks {section}.{k}")
    for c in cfg["deterioration"]["criteria"]:
        rules = [k for k in ("below", "above", "first_event") if k in c]
        if len(rules) != 1 or not c.get("codes"):
            raise CohortConfigError(f"criterion {c.get('name')!r} needs codes and exactly one of below/above/"
                                    f"first_event")
    if not 0.0 <= cfg["split"]["eval_fraction"] <= 1.0:
        raise CohortConfigError("split.eval_fraction must lie in [0, 1]")
    return cfg


def is_eval_subject(subject_id, cfg):
    """Stable subject-level split: a keyed hash of the subject id, never Python's salted hash()."""
    h = hashlib.sha256(f"{cfg['split']['salt']}:{int(subject_id)}".encode()).digest()
    return int.from_bytes(h[:8], "big") % 10_000 < cfg["split"]["eval_fraction"] * 10_000


def build_cohort(store, cfg):
    """ICU stays of adults lasting at least ``min_stay_hours``, with their split."""
    stays = pl.read_parquet(Path(store) / "stays.parquet")
    hours = (pl.col("outtime") - pl.col("intime")).dt.total_seconds() / 3600.0
    stays = stays.with_columns(hours.alias("stay_hours")).filter(
        (pl.col("anchor_age") >= cfg["cohort"]["min_age"]) &
        (pl.col("stay_hours") >= cfg["cohort"]["min_stay_hours"]))
    split = [("eval" if is_eval_subject(s, cfg) else "train") for s in stays["subject_id"]]
    return stays.with_columns(pl.Series("split", split, dtype=pl.String)).sort("stay_id")


def stay_events(store, cohort):
    """Every event inside each cohort stay's window, in time order, with its hour of stay.

    Events carrying the stay's id are kept as they are; hospital-level events without one (deaths, transfers)
    are attached to the stay whose window contains them.
    """
    win = cohort.select("stay_id", "subject_id", "intime", "outtime").lazy()
    ev = scan_events(store).filter(pl.col("subject_id").is_in(cohort["subject_id"].implode()))
    with_stay = ev.filter(pl.col("stay_id").is_not_null()).join(win.drop("subject_id"), on="stay_id")
    without = (ev.filter(pl.col("stay_id").is_null()).drop("stay_id").join(win, on="subject_id")
               .filter((pl.col("time") >= pl.col("intime")) & (pl.col("time") <= pl.col("outtime"))))
    cols = ["stay_id", "subject_id", "time", "code", "numeric_value", "unit", "source_table", "event_hash",
            "occurrence", "intime"]
    out = pl.concat([with_stay.select(cols), without.select(cols)])
    hour = ((pl.col("time") - pl.col("intime")).dt.total_seconds() // 3600).cast(pl.Int64).clip(lower_bound=0)
    return (out.with_columns(hour.alias("hour")).drop("intime")
            .sort(["stay_id", "time", "code"]).collect())


def deterioration_hours(events, cfg):
    """(stay_id, hour, criterion) rows: the hours in which each criterion fires."""
    frames = []
    for c in cfg["deterioration"]["criteria"]:
        sel = events.filter(pl.col("code").is_in(c["codes"]))
        if "below" in c:
            sel = sel.filter(pl.col("numeric_value") < c["below"])
        elif "above" in c:
            sel = sel.filter(pl.col("numeric_value") > c["above"])
        else:
            sel = sel.sort("time").group_by("stay_id").first()
        frames.append(sel.select("stay_id", "hour", pl.lit(c["name"]).alias("criterion")))
    return pl.concat(frames).unique().sort(["stay_id", "hour", "criterion"])


def rare_codes(events, cohort, cfg):
    """Codes rare in the training split: count <= the configured quantile of per-code counts."""
    train = cohort.filter(pl.col("split") == "train")["stay_id"]
    counts = events.filter(pl.col("stay_id").is_in(train.implode())).group_by("code").len()
    if counts.height == 0:
        return set(), 0.0
    threshold = float(counts["len"].quantile(cfg["rare_items"]["quantile"], interpolation="lower"))
    rare = set(counts.filter(pl.col("len") <= threshold)["code"])
    unseen = set(events["code"].unique()) - set(counts["code"])
    return rare | unseen, threshold


def label_events(events, cohort, cfg):
    """Events with their ``deteriorating`` (the flag of their hour) and ``rare`` flags."""
    hours = deterioration_hours(events, cfg).select("stay_id", "hour").unique().with_columns(
        pl.lit(True).alias("deteriorating"))
    rare, _ = rare_codes(events, cohort, cfg)
    return (events.join(hours, on=["stay_id", "hour"], how="left")
            .with_columns(pl.col("deteriorating").fill_null(False),
                          pl.col("code").is_in(list(rare)).alias("rare")))
