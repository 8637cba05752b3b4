"""The extraction's SQL rules: MIMIC-IV tables and their columns, how each becomes MEDS-style events, and the
rule that quarantines a row. Paths enter SQL only through :func:`sql_literal` (quoted, quotes doubled)."""
from __future__ import annotations

import csv
import gzip
from typing import TYPE_CHECKING

import meds

if TYPE_CHECKING:
    from pathlib import Path

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
    # optional: read when present (the community MEDS ETL's tables, and more a clinical user would want)
    "emar": ("hosp", ["subject_id", "hadm_id", "charttime", "medication", "event_txt"]),
    "prescriptions": ("hosp", ["subject_id", "hadm_id", "starttime", "stoptime", "drug", "dose_val_rx",
                               "dose_unit_rx"]),
    "pharmacy": ("hosp", ["subject_id", "hadm_id", "starttime", "medication", "route", "frequency"]),
    "diagnoses_icd": ("hosp", ["subject_id", "hadm_id", "icd_code", "icd_version"]),
    "procedures_icd": ("hosp", ["subject_id", "hadm_id", "chartdate", "icd_code", "icd_version"]),
    "drgcodes": ("hosp", ["subject_id", "hadm_id", "drg_type", "drg_code", "description"]),
    "hcpcsevents": ("hosp", ["subject_id", "hadm_id", "chartdate", "hcpcs_cd", "short_description"]),
    "omr": ("hosp", ["subject_id", "chartdate", "result_name", "result_value"]),
    "services": ("hosp", ["subject_id", "hadm_id", "transfertime", "curr_service"]),
    "microbiologyevents": ("hosp", ["subject_id", "hadm_id", "chartdate", "charttime", "spec_itemid", "test_itemid",
                                    "org_name", "interpretation"]),
    "datetimeevents": ("icu", ["subject_id", "hadm_id", "stay_id", "charttime", "itemid", "value", "valueuom"]),
    "ingredientevents": ("icu", ["subject_id", "hadm_id", "stay_id", "starttime", "itemid", "amount", "amountuom"]),
    "d_icd_diagnoses": ("hosp", ["icd_code", "icd_version", "long_title"]),
    "d_icd_procedures": ("hosp", ["icd_code", "icd_version", "long_title"]),
    "d_hcpcs": ("hosp", ["code", "short_description"]),
}
REQUIRED_TABLES = ("patients", "admissions", "icustays")
EVENT_TABLES = ("patients", "admissions", "transfers", "icustays", "labevents", "chartevents", "inputevents",
                "outputevents", "procedureevents", "datetimeevents", "ingredientevents", "emar", "prescriptions",
                "pharmacy", "diagnoses_icd", "procedures_icd", "drgcodes", "hcpcsevents", "omr", "services",
                "microbiologyevents")
# Tables whose one event select turns each row into one event (no filter, no join): the rows read are the
# events staged, so the extraction does not read the file a second time only to count its rows.
ONE_EVENT_PER_ROW = ("chartevents", "labevents", "outputevents", "datetimeevents", "ingredientevents", "transfers",
                     "emar", "pharmacy", "procedures_icd", "hcpcsevents", "omr", "services", "microbiologyevents")
# Tables without event times of their own, dated by their admission's discharge (as the community ETL does).
DATED_BY_DISCHARGE = ("diagnoses_icd", "drgcodes")
# MEDS's death code for every death, so that a MEDS tool matching MEDS_DEATH exactly (an ACES task) finds them
# all; a death known only as a date (patients.dod) says so in its text value.
DEATH_CODE = meds.death_code
DEATH_DATE_ONLY = "date of death only (patients.dod)"
# Format 3 coded the date of death alone MEDS_DEATH//DOD: ACES's `code: MEDS_DEATH` missed those deaths.
LEGACY_DEATH_DATE_CODE = f"{DEATH_CODE}//DOD"
# An event's content hash reads death under the first releases' names (DEATH, DEATH//DOD with no text), so a
# migrated store, whose codes were renamed in place, still recognises the rows it already holds.
_DATE_ONLY = f"(e.code = '{DEATH_CODE}' AND e.text_value = '{DEATH_DATE_ONLY}')"
HASHED_CODE = f"CASE WHEN {_DATE_ONLY} THEN 'DEATH//DOD' WHEN e.code = '{DEATH_CODE}' THEN 'DEATH' ELSE e.code END"
HASHED_TEXT = f"CASE WHEN {_DATE_ONLY} THEN NULL ELSE e.text_value END"
# Static measurements (MEDS: no time): the only events not quarantined for a missing time.
STATIC_CODE_PREFIX = "GENDER//"

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


def header_names(path: Path | str | tuple) -> list[str] | None:
    """The header line's fields (None when the file cannot be opened as text: DuckDB then names the problem);
    of a table's first file when it is a folder of files (a tuple: they share one header)."""
    path = path[0] if isinstance(path, tuple) else path
    try:
        with (gzip.open(path, "rt", encoding="utf-8", newline="") if str(path).endswith(".gz")
              else open(path, encoding="utf-8", newline="")) as fh:
            return next(csv.reader(fh), None)
    except (OSError, EOFError, UnicodeDecodeError, csv.Error):
        return None


def csv_reader(path: Path | str | tuple) -> str:
    """DuckDB's reader of a source table (a file, or a tuple of files: a table as a folder of files) with
    MIMIC-IV's dialect and the header's columns stated, not sniffed, so a ragged row or a binary file is an error
    naming its line rather than a guessed dialect."""
    names = header_names(path)
    cols = ", columns={" + ", ".join(f"'{n.replace(chr(39), '')}': 'VARCHAR'" for n in names) + "}" if names else ""
    src = "[" + ", ".join(map(sql_literal, path)) + "]" if isinstance(path, tuple) else sql_literal(path)
    return (f"read_csv({src}, header=true, all_varchar=true, delim=',', quote='\"', escape='\"', "
            f"strict_mode=true{cols})")


def ts(col: str) -> str:
    return f"TRY_CAST(NULLIF({col}, '') AS TIMESTAMP)"


def bigint(col: str) -> str:
    return f"TRY_CAST(NULLIF({col}, '') AS BIGINT)"


def dbl(col: str) -> str:
    return f"TRY_CAST(NULLIF({col}, '') AS DOUBLE)"


def txt(col: str) -> str:
    return f"NULLIF({col}, '')"


def table_view(table: str, path: Path | str, paths: dict) -> str:
    """The SELECT that the event selects of ``table`` read as view ``t``: the raw table, joined with what it
    needs from admissions (a discharge time, or whether the subject has an in-hospital death time)."""
    if table in DATED_BY_DISCHARGE:
        return (f"SELECT d.*, a.dischtime FROM {csv_reader(path)} d LEFT JOIN "
                f"(SELECT hadm_id, any_value(dischtime) AS dischtime FROM {csv_reader(paths['admissions'])} "
                f"GROUP BY hadm_id) a USING (hadm_id)")
    if table == "patients":
        return (f"SELECT p.*, p.subject_id IN (SELECT subject_id FROM {csv_reader(paths['admissions'])} "
                f"WHERE NULLIF(deathtime, '') IS NOT NULL) AS died_in_hospital FROM {csv_reader(path)} p")
    return f"SELECT * FROM {csv_reader(path)}"


def event_selects(table: str) -> list:
    """SELECT lists producing (subject_id, raw_time, time, code, numeric_value, text_value, unit, hadm_id,
    stay_id, raw_numeric) from the raw all-varchar table ``t``."""
    def sel(time_col, code, num, text, unit, stay="stay_id", hadm="hadm_id", distinct=False):
        return (f"SELECT {'DISTINCT ' if distinct else ''}{bigint('subject_id')} AS subject_id, "
                f"{time_col} AS raw_time, {ts(time_col)} AS time, "
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
        # the patient's charted weight, once per (start, weight) rather than on every line of an order
        weight = sel("starttime", "'WEIGHT_AT_INFUSION'", "patientweight", None, "'kg'", distinct=True) \
            + " WHERE NULLIF(patientweight, '') IS NOT NULL"
        return [sel("starttime", "'INPUT//' || itemid", "amount", None, txt("amountuom")),
                sel("endtime", "'INPUT_END//' || itemid", None, None, None) + " WHERE NULLIF(endtime, '') IS NOT NULL",
                weight]
    if table == "ingredientevents":
        return [sel("starttime", "'INGREDIENT//' || itemid", "amount", None, txt("amountuom"))]
    if table == "outputevents":
        return [sel("charttime", "'OUTPUT//' || itemid", "value", None, txt("valueuom"))]
    if table == "procedureevents":
        return [sel("starttime", "'PROCEDURE//' || itemid", "value", None, txt("valueuom")),
                sel("endtime", "'PROCEDURE_END//' || itemid", None, None, None)
                + " WHERE NULLIF(endtime, '') IS NOT NULL"]
    if table == "datetimeevents":     # the value is itself a date (e.g. of a line's insertion): kept as text
        return [sel("charttime", "'DATETIME//' || itemid", None, txt("value"), txt("valueuom"))]
    return _hospital_selects(table, sel)


def _hospital_selects(table: str, sel) -> list:
    """The selects of the hosp module's tables (besides labs), MIMIC-IV's admission- and patient-level record."""
    if table == "transfers":
        return [sel("intime", "'TRANSFER//' || COALESCE(NULLIF(careunit, ''), eventtype)", None, None, None,
                    stay=None)]
    if table == "admissions":
        return [sel("admittime", "'HOSPITAL_ADMISSION'", None, None, None, stay=None),
                sel("dischtime", "'HOSPITAL_DISCHARGE'", None, None, None, stay=None),
                sel("deathtime", f"'{DEATH_CODE}'", None, None, None, stay=None)
                + " WHERE NULLIF(deathtime, '') IS NOT NULL",
                sel("edregtime", "'ED_REGISTRATION'", None, None, None, stay=None)
                + " WHERE NULLIF(edregtime, '') IS NOT NULL",
                sel("edouttime", "'ED_OUT'", None, None, None, stay=None) + " WHERE NULLIF(edouttime, '') IS NOT NULL"]
    if table == "patients":
        # sex (static: no time), birth at the start of the year anchor_year - anchor_age (MIMIC-IV shifts dates
        # per patient and states the age only at the anchor year), and the date of death where no admission
        # recorded a death time: MEDS_DEATH at the date's midnight (as the MIMIC-IV MEDS ETL dates it), its text
        # value saying it is a date only; after discharge, so outside every ICU stay but a same-day one
        birth = "CAST(TRY_CAST(anchor_year AS INT) - TRY_CAST(anchor_age AS INT) AS VARCHAR) || '-01-01 00:00:00'"
        return [sel("NULL::VARCHAR", f"'{STATIC_CODE_PREFIX}' || gender", None, None, None, stay=None, hadm=None)
                + " WHERE NULLIF(gender, '') IS NOT NULL",
                sel(birth, "'MEDS_BIRTH'", None, None, None, stay=None, hadm=None),
                sel("dod", f"'{DEATH_CODE}'", None, f"'{DEATH_DATE_ONLY}'", None, stay=None, hadm=None)
                + " WHERE NULLIF(dod, '') IS NOT NULL AND NOT died_in_hospital"]
    if table == "emar":
        return [sel("charttime", "'EMAR//' || COALESCE(NULLIF(event_txt, ''), 'UNK') || '//' || "
                                 "COALESCE(NULLIF(medication, ''), 'UNK')", None, None, None, stay=None)]
    if table == "prescriptions":
        dose = txt("dose_val_rx")     # a dose is often a range ("1-2"): kept as text, its unit as the unit
        return [sel("starttime", "'PRESCRIPTION//START//' || drug", None, dose, txt("dose_unit_rx"), stay=None),
                sel("stoptime", "'PRESCRIPTION//STOP//' || drug", None, dose, txt("dose_unit_rx"), stay=None)
                + " WHERE NULLIF(stoptime, '') IS NOT NULL"]
    if table == "pharmacy":
        return [sel("starttime", "'PHARMACY//START//' || COALESCE(NULLIF(medication, ''), 'UNK')", None,
                    "concat_ws(' ', NULLIF(route, ''), NULLIF(frequency, ''))", None, stay=None)]
    if table in ("diagnoses_icd", "procedures_icd"):
        kind, when = ("DIAGNOSIS", "dischtime") if table == "diagnoses_icd" else ("PROCEDURE", "chartdate")
        return [sel(when, f"'{kind}//ICD//' || icd_version || '//' || icd_code", None, None, None, stay=None)]
    if table == "drgcodes":
        return [sel("dischtime", "'DRG//' || drg_type || '//' || drg_code", None, txt("description"), None, stay=None)]
    if table == "hcpcsevents":
        return [sel("chartdate", "'HCPCS//' || hcpcs_cd", None, txt("short_description"), None, stay=None)]
    if table == "omr":                # outpatient measurements; blood pressure ("120/80") is kept as text
        num = "CASE WHEN TRY_CAST(result_value AS DOUBLE) IS NOT NULL THEN result_value END"
        text = "CASE WHEN TRY_CAST(result_value AS DOUBLE) IS NULL THEN NULLIF(result_value, '') END"
        return [sel("chartdate", "'OMR//' || result_name", num, text, None, stay=None, hadm=None)]
    if table == "services":
        return [sel("transfertime", "'SERVICE//' || curr_service", None, None, None, stay=None)]
    if table == "microbiologyevents":
        when = "COALESCE(NULLIF(charttime, ''), chartdate)"
        return [sel(when, "'MICRO//' || spec_itemid || '//' || COALESCE(NULLIF(test_itemid, ''), 'UNK')", None,
                    "concat_ws(' ', NULLIF(org_name, ''), NULLIF(interpretation, ''))", None, stay=None)]
    if table == "icustays":
        return [sel("intime", "'ICU_ADMISSION//' || first_careunit", None, None, None),
                sel("outtime", "'ICU_DISCHARGE'", None, None, None)]
    raise KeyError(table)


def dictionary_selects(paths: dict) -> dict:
    """Per dictionary table, a SELECT of (code, description, parent) for the codes its items become: item labels
    from d_items (parent: the item's category) and d_labitems (parent: its fluid and category); ICD titles with
    the OMOP vocabulary code as parent (ICD9CM/..., ICD10CM/..., ICD9Proc/..., ICD10PCS/...); HCPCS
    descriptions."""
    def items(table, prefixes, parent):
        return " UNION ALL ".join(
            f"SELECT '{pre}//' || itemid AS code, label AS description, {parent} AS parent "
            f"FROM {csv_reader(paths[table])}" for pre in prefixes)

    def icd(table, kind, vocab9, vocab10):
        return (f"SELECT '{kind}//ICD//' || icd_version || '//' || icd_code AS code, long_title AS description, "
                f"CASE icd_version WHEN '9' THEN '{vocab9}/' ELSE '{vocab10}/' END || icd_code AS parent "
                f"FROM {csv_reader(paths[table])}")
    out = {}
    if "d_items" in paths:
        out["d_items"] = items("d_items", ("CHART", "INPUT", "INPUT_END", "OUTPUT", "PROCEDURE", "PROCEDURE_END",
                                           "DATETIME", "INGREDIENT"),
                               "'MIMIC_IV_ITEM_CATEGORY//' || NULLIF(category, '')")
    if "d_labitems" in paths:
        # the real d_labitems has fluid and category; a source with only itemid and label gets no parent
        lab_parent = ("'MIMIC_IV_LAB//' || concat_ws('//', NULLIF(fluid, ''), NULLIF(category, ''))"
                      if _has(paths, "d_labitems", "fluid") else "NULL")
        out["d_labitems"] = items("d_labitems", ("LAB",), lab_parent)
    if "d_icd_diagnoses" in paths:
        out["d_icd_diagnoses"] = icd("d_icd_diagnoses", "DIAGNOSIS", "ICD9CM", "ICD10CM")
    if "d_icd_procedures" in paths:
        out["d_icd_procedures"] = icd("d_icd_procedures", "PROCEDURE", "ICD9Proc", "ICD10PCS")
    if "d_hcpcs" in paths:
        out["d_hcpcs"] = (f"SELECT 'HCPCS//' || code AS code, short_description AS description, NULL AS parent "
                          f"FROM {csv_reader(paths['d_hcpcs'])}")
    return out


def _has(paths: dict, table: str, column: str) -> bool:
    return column in (header_names(paths[table]) or [])


def quarantine_reason() -> str:
    signed = ", ".join(f"'LAB//{i}', 'CHART//{i}', 'OUTPUT//{i}', 'INPUT//{i}'" for i in sorted(SIGNED_ITEMS))
    nonneg = ", ".join(f"'{s}'" for s in NONNEGATIVE_SOURCES)
    tol = f"INTERVAL {STAY_TOLERANCE_HOURS} HOUR"
    static = f"(e.source_table = 'meds_static' OR starts_with(e.code, '{STATIC_CODE_PREFIX}'))"
    return f"""CASE
        WHEN e.subject_id IS NULL THEN 'bad_subject_id'
        WHEN e.source_table = 'icustays' AND e.stay_id IS NULL THEN 'bad_stay_id'
        WHEN (e.raw_time IS NULL OR e.raw_time = '') AND NOT {static} THEN 'missing_time'
        WHEN e.time IS NULL AND NOT {static} THEN 'unparsable_time'
        WHEN e.raw_numeric IS NOT NULL AND e.raw_numeric <> '' AND e.numeric_value IS NULL THEN 'unparsable_value'
        WHEN isnan(e.numeric_value) THEN 'nan_value'
        WHEN isinf(e.numeric_value) THEN 'non_finite_value'
        WHEN abs(e.numeric_value) > {MAX_MAGNITUDE:.0f} THEN 'implausible_magnitude'
        WHEN e.numeric_value < 0 AND e.source_table IN ({nonneg}) AND e.code NOT IN ({signed}) THEN 'negative_value'
        WHEN e.stay_id IS NOT NULL AND s.stay_id IS NULL THEN 'unknown_stay'
        WHEN e.stay_id IS NOT NULL AND e.source_table <> 'icustays'
             AND (e.time < s.intime - {tol} OR e.time > s.outtime + {tol}) THEN 'outside_stay'
    END"""
