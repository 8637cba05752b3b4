"""The whole cohort's hourly-token run in memory at once: the reference the chunked, cached run of
:mod:`run.token_run` is tested against, and the input of the sweep bench (small stores only)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pathlib import Path

import polars as pl

from cohorts.characteristics import death_stays, describe_cohort, token_counts
from cohorts.definitions import build_cohort, deterioration_hours, stay_events
from cohorts.protocols import StreamingSettings, choose_streaming_settings, token_streams
from cohorts.tokens import build_tokens, label_tokens
from pipeline.meds import subject_splits_path, write_label_file, write_subject_splits

from .steps import subject_splits

if TYPE_CHECKING:
    from cohorts.config import CohortConfig


def prepare_token_streams(store: Path, cfg: CohortConfig,
                          labels_dir: Path | None = None) -> tuple[list, StreamingSettings, dict]:
    """Hourly tokens of the whole cohort, labelled: the evaluation split's streams, the streaming settings
    chosen on the training split, and the cohort's summary (aggregates only). With ``labels_dir``, the token labels are
    also written there as MEDS label files and the subject-level split into the store's MEDS metadata."""
    cohort = build_cohort(store, cfg)
    events = stay_events(store, cohort)
    table = build_tokens(store, cfg, cohort=cohort)
    labelled = label_tokens(table, store, cfg, cohort=cohort, events=events)
    if labels_dir is not None:
        write_meds_labels(labelled, cohort, cfg, table.bin_hours, labels_dir)
        write_subject_splits(subject_splits_path(store), subject_splits(store, cfg))
    evaluation = token_streams(labelled, table.scaling, cfg, split="eval")
    settings = choose_streaming_settings(token_streams(labelled, table.scaling, cfg, split="train"),
                                         cfg.streaming)
    ev = labelled.filter(pl.col("split") == "eval")
    summary = {"stays": int(cohort.height), "train_stays": int(cohort.height - len(evaluation)),
               "eval_stays": len(evaluation),
               "stays_without_vitals": int(cohort.height - labelled["stay_id"].n_unique()),
               "tokens": int(labelled.height), "eval_tokens": int(ev.height), "bin_hours": table.bin_hours,
               "readings_by_channel": table.readings, "artifacts_by_channel": table.artifacts}
    for name in cfg.labels:
        summary[f"eval_tokens_{name}"] = int(ev[name].sum())
        summary[f"eval_stays_with_{name}"] = int(ev.group_by("stay_id").agg(pl.col(name).any())[name].sum())
    summary["characteristics"] = describe_cohort(store, cfg, cohort, death_stays(events, cfg),
                                                 deterioration_hours(events, cfg),
                                                 token_counts(labelled, list(cfg.labels)))
    return evaluation, settings, summary


def write_meds_labels(labelled: pl.DataFrame, cohort: pl.DataFrame, cfg: CohortConfig, bin_hours: float,
                      labels_dir: Path) -> list[Path]:
    """One MEDS label file per token label (``meds.LabelSchema``): each token's label at the end of its bin, the
    last moment whose data the token summarises (MEDS: data up to and including prediction_time may be used)."""
    ends = (labelled.join(cohort.select("stay_id", "intime"), on="stay_id")
            .with_columns((pl.col("intime") + pl.duration(
                microseconds=((pl.col("hour") + 1) * round(bin_hours * 3_600_000_000)))).alias("prediction_time")))
    labels_dir = Path(labels_dir)
    labels_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in cfg.labels:
        path = labels_dir / f"{name}.parquet"
        write_label_file(ends.select("subject_id", "prediction_time", pl.col(name).alias("boolean_value")), path)
        written.append(path)
    for stale in set(labels_dir.glob("*.parquet")) - set(written):     # a label the config no longer has
        stale.unlink()
    return written
