"""The extraction's SQL rules: MIMIC-IV tables and their columns, how each becomes MEDS-style events, and the
rule that quarantines a row. Paths enter SQL only through :func:`sql_literal` (quoted, quotes doubled)."""
from __future__ import annotations

import csv
import gzip
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

N_BUCKETS = 16

# table -> (folder, required columns)
TABLES = {
    "patients": ("hosp", ["subject_id", "gender", "anchor_age", "anchor_year", "dod"]),
    "admissions": ("hosp", ["subject_id", "hadm_id", "admittime", "dischtime", "deathtime"]),
    "transfers": ("hosp", ["subject_id", "hadm_id", "eventtype", "careunit", "intime"]),
    "labevents": ("hosp", ["subject_id", "hadm_id", "itemid", "charttime", "value", "valuenum", "valueuom"]),
    "d_labitems": ("hosp", ["itemid", "label"]),
    "icustays": ("icu", ["subject_id", "hadm_id", "stay_id", "first_careunit", "intime", "outtime"]),
    "chartevents": ("icu", ["subject_id", "hadm_id", "stay_id", "charttime", "itemid", "value", "valuenum",
                            "valueuom"]),
    "inputevents": ("icu", ["subject_id", "hadm_id", "stay_id", "starttime", "itemid", "amount", "amountuom"]),
    "outputevents": ("icu", ["subject_id", "hadm_id", "stay_id", "charttime", "itemid", "value", "valueuom"]),
    "procedureevents": ("icu", ["subject_id", "hadm_id", "stay_id", "starttime", "itemid", "value", "valueuom"]),
    "d_items": ("icu", ["itemid", "label", "linksto"]),
}
REQUIRED_TABLES = ("patients", "admissions", "icustays")
EVENT_TABLES = ("admissions", "transfers", "icustays", "labevents", "chartevents", "inputevents", "outputevents",
                "procedureevents")

# Items whose values may legitimately be negative (base excess, net balances); every other measured value of
# these sources is quarantined when negative.
SIGNED_ITEMS = {50802, 224828, 226627, 226631, 227489, 51466}
NONNEGATIVE_SOURCES = ("chartevents", "labevents", "outputevents", "inputevents")
# Events charted slightly outside their ICU stay (documentation delay) are common in MIMIC-IV; beyond this
# tolerance they are quarantined as outside their stay.
STAY_TOLERANCE_HOURS = 6
# No measured quantity of these tables comes near this magnitude (the largest are counts and volumes of order
# 1e6); a value beyond it is a unit or entry error that would turn per-code means to inf and sds to NaN.
MAX_MAGNITUDE = 1e9


def sql_literal(value: Path | str) -> str:
    """A string (a path) as a SQL literal: a quote in a path is doubled, not a broken query."""
    return "'" + str(value).replace("'", "''") + "'"


def header_names(path: Path | str) -> list[str] | None:
    """The header line's fields (None when the file cannot be opened as text: DuckDB then names the problem)."""
    try:
        with (gzip.open(path, "rt", encoding="utf-8", newline="") if str(path).endswith(".gz")
              else open(path, encoding="utf-8", newline="")) as fh:
            return next(csv.reader(fh), None)
    except (OSError, EOFError, UnicodeDecodeError, csv.Error):
        return None


def csv_reader(path: Path | str) -> str:
    """DuckDB's reader of a source table with MIMIC-IV's dialect and the header's columns stated, not sniffed,
    so a ragged row or a binary file is an error naming its line rather than a guessed dialect."""
    names = header_names(path)
    cols = ", columns={" + ", ".join(f"'{n.replace(chr(39), '')}': 'VARCHAR'" for n in names) + "}" if names else ""
    return (f"read_csv({sql_literal(path)}, header=true, all_varchar=true, delim=',', quote='\"', escape='\"', "
            f"strict_mode=true{cols})")


def ts(col: str) -> str:
    return f"TRY_CAST(NULLIF({col}, '') AS TIMESTAMP)"


def bigint(col: str) -> str:
    return f"TRY_CAST(NULLIF({col}, '') AS BIGINT)"


def dbl(col: str) -> str:
    return f"TRY_CAST(NULLIF({col}, '') AS DOUBLE)"


def txt(col: str) -> str:
    return f"NULLIF({col}, '')"


def event_selects(table: str) -> list:
    """SELECT lists producing (subject_id, raw_time, time, code, numeric_value, text_value, unit, hadm_id,
    stay_id, raw_numeric) from the raw all-varchar table ``t``."""
    def sel(time_col, code, num, text, unit, stay="stay_id", hadm="hadm_id"):
        return (f"SELECT {bigint('subject_id')} AS subject_id, {time_col} AS raw_time, {ts(time_col)} AS time, "
                f"{code} AS code, {dbl(num) if num else 'NULL::DOUBLE'} AS numeric_value, "
                f"{text if text else 'NULL::VARCHAR'} AS text_value, {unit if unit else 'NULL::VARCHAR'} AS unit, "
                f"{bigint(hadm) if hadm else 'NULL::BIGINT'} AS hadm_id, "
                f"{bigint(stay) if stay else 'NULL::BIGINT'} AS stay_id, "
                f"{num if num else 'NULL::VARCHAR'} AS raw_numeric FROM t")
    if table == "chartevents":
        return [sel("charttime", "'CHART//' || itemid", "valuenum",
                    f"CASE WHEN {dbl('valuenum')} IS NULL THEN {txt('value')} END", txt("valueuom"))]
    if table == "labevents":
        return [sel("charttime", "'LAB//' || itemid", "valuenum",
                    f"CASE WHEN {dbl('valuenum')} IS NULL THEN {txt('value')} END", txt("valueuom"), stay=None)]
    if table == "inputevents":
        return [sel("starttime", "'INPUT//' || itemid", "amount", None, txt("amountuom"))]
    if table == "outputevents":
        return [sel("charttime", "'OUTPUT//' || itemid", "value", None, txt("valueuom"))]
    if table == "procedureevents":
        return [sel("starttime", "'PROCEDURE//' || itemid", "value", None, txt("valueuom"))]
    if table == "transfers":
        return [sel("intime", "'TRANSFER//' || COALESCE(NULLIF(careunit, ''), eventtype)", None, None, None,
                    stay=None)]
    if table == "admissions":
        return [sel("admittime", "'HOSPITAL_ADMISSION'", None, None, None, stay=None),
                sel("dischtime", "'HOSPITAL_DISCHARGE'", None, None, None, stay=None),
                sel("deathtime", "'DEATH'", None, None, None, stay=None) + " WHERE NULLIF(deathtime, '') IS NOT NULL"]
    if table == "icustays":
        return [sel("intime", "'ICU_ADMISSION//' || first_careunit", None, None, None),
                sel("outtime", "'ICU_DISCHARGE'", None, None, None)]
    raise KeyError(table)


def quarantine_reason() -> str:
    signed = ", ".join(f"'LAB//{i}', 'CHART//{i}', 'OUTPUT//{i}', 'INPUT//{i}'" for i in sorted(SIGNED_ITEMS))
    nonneg = ", ".join(f"'{s}'" for s in NONNEGATIVE_SOURCES)
    tol = f"INTERVAL {STAY_TOLERANCE_HOURS} HOUR"
    return f"""CASE
        WHEN e.subject_id IS NULL THEN 'bad_subject_id'
        WHEN (e.raw_time IS NULL OR e.raw_time = '') AND e.source_table <> 'meds_static' THEN 'missing_time'
        WHEN e.time IS NULL AND e.source_table <> 'meds_static' THEN 'unparsable_time'
        WHEN e.raw_numeric IS NOT NULL AND e.raw_numeric <> '' AND e.numeric_value IS NULL THEN 'unparsable_value'
        WHEN isnan(e.numeric_value) THEN 'nan_value'
        WHEN isinf(e.numeric_value) THEN 'non_finite_value'
        WHEN abs(e.numeric_value) > {MAX_MAGNITUDE:.0f} THEN 'implausible_magnitude'
        WHEN e.numeric_value < 0 AND e.source_table IN ({nonneg}) AND e.code NOT IN ({signed}) THEN 'negative_value'
        WHEN e.stay_id IS NOT NULL AND s.stay_id IS NULL THEN 'unknown_stay'
        WHEN e.stay_id IS NOT NULL AND e.source_table <> 'icustays'
             AND (e.time < s.intime - {tol} OR e.time > s.outtime + {tol}) THEN 'outside_stay'
    END"""
