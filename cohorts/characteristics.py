"""The cohort as clinical papers describe it ("Table 1"): per split, aggregates only, no identifiers.

The unit is the ICU stay: a patient with two stays counts twice in the age, sex, length-of-stay and mortality
rows (the patients row counts each once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import polars as pl

from pipeline.store_reader import quarantine_reasons

from .predicates import code_expr, describe_codes

if TYPE_CHECKING:
    from .config import CohortConfig
    from pathlib import Path

SPLITS = ("all", "train", "eval")


@dataclass(frozen=True)
class Count:
    """``n`` of ``of`` (``of`` = 0: a plain count with no percentage) ``unit``s: stays, patients (the counts of
    people that a shared report suppresses when small), tokens or hours."""
    n: int
    of: int = 0
    unit: str = "stays"


@dataclass(frozen=True)
class Spread:
    """Median and interquartile range (``n`` values; all None when there are none)."""
    median: float | None
    q1: float | None
    q3: float | None
    n: int


@dataclass(frozen=True)
class Row:
    """One characteristic: one cell per split of :data:`SPLITS`, under a ``group`` heading ('' for none);
    ``partition``: the group's rows split one total (each stay in one row), so one row's count follows from the
    others'."""
    name: str
    cells: tuple
    group: str = ""
    partition: bool = False


@dataclass(frozen=True)
class CohortTable:
    rows: tuple[Row, ...]
    criteria: tuple[Row, ...]            # per deterioration criterion: hours in which it fires, stays with one
    quarantine: dict[str, int]           # rows the extraction rejected (whole store), by rule
    notes: tuple[str, ...]               # how the rows are measured
    splits: tuple[str, ...] = SPLITS


def _by_split(frame: pl.DataFrame, cell) -> tuple:
    return tuple(cell(frame if s == "all" else frame.filter(pl.col("split") == s)) for s in SPLITS)


def _spread(values: pl.Series) -> Spread:
    v = values.drop_nulls()
    if v.len() == 0:
        return Spread(None, None, None, 0)
    return Spread(float(v.median()), float(v.quantile(0.25, "linear")), float(v.quantile(0.75, "linear")),
                  int(v.len()))


def _stays_with(cohort: pl.DataFrame, stay_ids: pl.Series) -> tuple:
    flagged = cohort.with_columns(pl.col("stay_id").is_in(stay_ids.implode()).alias("flag"))
    return _by_split(flagged, lambda f: Count(int(f["flag"].sum()), f.height))


def _demographics(cohort: pl.DataFrame, deaths: pl.Series) -> list[Row]:
    rows = [Row("ICU stays", _by_split(cohort, lambda f: Count(f.height))),
            Row("patients", _by_split(cohort, lambda f: Count(int(f["subject_id"].n_unique()), unit="patients"))),
            Row("age, years", _by_split(cohort, lambda f: _spread(f["anchor_age"])))]
    if "gender" in cohort.columns:
        rows.append(Row("female", _by_split(cohort, lambda f: Count(int((f["gender"] == "F").sum()), f.height))))
    rows += [Row("ICU length of stay, days", _by_split(cohort, lambda f: _spread(f["stay_hours"] / 24.0))),
             Row("ICU mortality", _stays_with(cohort, deaths))]
    for unit in sorted(cohort["first_careunit"].drop_nulls().unique()):
        rows.append(Row(unit, _by_split(cohort, lambda f, u=unit: Count(int((f["first_careunit"] == u).sum()),
                                                                          f.height)), group="first care unit",
                        partition=True))
    return rows


def _token_rows(per_stay: pl.DataFrame, labels: list[str]) -> list[Row]:
    """``per_stay``: one row per stay with tokens (stay_id, split, tokens, and per label its labelled tokens)."""
    rows = [Row("stays with vital-sign tokens", _by_split(per_stay, lambda f: Count(f.height))),
            Row("hourly tokens", _by_split(per_stay, lambda f: Count(int(f["tokens"].sum()), unit="tokens")))]
    for name in labels:
        rows.append(Row(name, _by_split(per_stay, lambda f, n=name: Count(int(f[n].sum()), int(f["tokens"].sum()),
                                                                          unit="tokens")),
                        group="labelled tokens (% of tokens)"))
    for name in labels:
        rows.append(Row(name, _by_split(per_stay, lambda f, n=name: Count(int((f[n] > 0).sum()), f.height)),
                        group="stays with a labelled token (% of stays with tokens)"))
    return rows


def token_counts(labelled: pl.DataFrame, labels: list[str]) -> pl.DataFrame:
    """Labelled tokens summed per stay: the token rows of :func:`describe_cohort`."""
    return labelled.group_by("stay_id", "split").agg(pl.len().alias("tokens"),
                                                     *[pl.col(n).cast(pl.Int64).sum() for n in labels])


def _criterion_rows(cohort: pl.DataFrame, fired: pl.DataFrame, cfg: CohortConfig) -> list[Row]:
    fired = fired.join(cohort.select("stay_id", "split"), on="stay_id")
    rows = []
    for c in cfg.section("deterioration")["criteria"]:
        mine = fired.filter(pl.col("criterion") == c["name"])
        rows += [Row("hours in which it fires", _by_split(mine, lambda f: Count(f.height, unit="hours")),
                     group=c["name"]),
                 Row("stays (% of stays)", _stays_with(cohort, mine["stay_id"].unique()), group=c["name"])]
    return rows


def death_stays(events: pl.DataFrame, cfg: CohortConfig) -> pl.Series:
    """The stays with a death code dated inside their window (ICU mortality)."""
    return events.filter(code_expr(list(cfg.cohort.death_codes)))["stay_id"].unique()


def describe_cohort(store: Path, cfg: CohortConfig, cohort: pl.DataFrame, deaths: pl.Series, fired: pl.DataFrame,
                    token_stays: pl.DataFrame | None = None) -> CohortTable:
    """Table 1 of the cohort, from per-stay facts a run gathers chunk by chunk: ``deaths`` (stay ids,
    :func:`death_stays`), ``fired`` (stay_id, hour, criterion: :func:`cohorts.definitions.deterioration_hours`)
    and ``token_stays`` (:func:`token_counts`; None in events mode)."""
    death_codes = list(cfg.cohort.death_codes)
    rows = _demographics(cohort, deaths)
    if token_stays is not None:
        rows += _token_rows(token_stays, [n for n in cfg.section("token_labels") if n in token_stays.columns])
    notes = ("unit: the ICU stay of an adult (anchor_age >= {min_age}) lasting at least {min_hours} h; "
             "median [interquartile range] or n (%)".format(min_age=cfg.cohort.min_age,
                                                            min_hours=cfg.cohort.min_stay_hours),
             f"ICU mortality: a death code ({describe_codes(death_codes)}) dated inside the stay's window",
             "age: MIMIC-IV anchor_age (ages above 89 are shifted to 91 in the source)",
             "quarantined rows: every row of the store the extraction rejected, by its rule (all patients)")
    return CohortTable(tuple(rows), tuple(_criterion_rows(cohort, fired, cfg)), quarantine_reasons(store), notes)
