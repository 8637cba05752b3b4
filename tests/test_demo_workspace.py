"""A workspace built on the real MIMIC-IV demo by the run's plain step functions (tokens, scoring, statistics,
cohort memory, report): the shared report shows no small cell, and no raw identifier of the demo is in any
derived file (only in the event store, its MEDS label files and the source)."""
import json
import re
import shutil
from pathlib import Path

import polars as pl
import pytest

from cohorts.definitions import load_config
from pipeline.extract import extract
from pipeline.privacy import load_key
from pipeline.workspace import Workspace
from reports.html import render_report
from run.cohort_memory import update_cohort_memory
from run.evaluate import evaluate, in_process_map
from run.params import RunParams
from tests.workspaces import raw_id_hits

DEMO = Path(__file__).resolve().parents[2] / "shared" / "data" / "mimic-iv-demo"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not DEMO.exists(), reason="shared/data/mimic-iv-demo is not present on this machine")]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    cfg = load_config()
    ws = Workspace(tmp_path_factory.mktemp("demo") / "ws")
    extract(DEMO, ws.store, key=load_key())
    params = RunParams(budgets=(32,), fractions=(), source=str(DEMO))
    result = evaluate(ws, params, in_process_map, cfg)
    update_cohort_memory(ws, cfg, budget=64, tokens=params.tokens)
    render_report(result, ws.root)
    return ws


def _people_counts(o):
    """Every count of stays or patients in report.json's cohort table (a hidden one: {"n": "<11"})."""
    if isinstance(o, dict):
        if o.get("unit") in ("stays", "patients") or str(o.get("n")).startswith("<"):
            yield o["n"]
        for v in o.values():
            yield from _people_counts(v)
    elif isinstance(o, list):
        for v in o:
            yield from _people_counts(v)


def test_no_count_of_1_to_10_stays_or_patients_shows_in_the_report(demo):
    html = demo.report_html.read_text()
    report = json.loads(demo.report_json.read_text())
    counts = list(_people_counts(report["cohort"]["characteristics"]))
    assert counts and "<11" in counts and not any(isinstance(n, int) and 0 < n < 11 for n in counts)
    assert not any(isinstance(r["n"], int) and 0 < r["n"] < 11 for r in report["summary"] + report["paired"])
    assert not any(isinstance(v, int) and 0 < v < 11 for k, v in report["cohort"].items() if "stays" in k)
    visible = re.sub(r"<[^>]+>", " ", html)
    for pattern in (r"n=(\d+)", r"over (\d+) stays", r"\((\d+) stays", r"(\d+) stays\b"):
        assert not [n for n in re.findall(pattern, visible) if 0 < int(n) < 11], pattern
    cohort_section = html[html.index('<section id="cohort">'):html.index("<h3>Clinical deterioration")]
    assert not [c for c in re.findall(r"<td>(\d+)(?: \(\d+%\))?</td>", cohort_section) if 0 < int(c) < 11]


def test_no_raw_subject_admission_or_stay_id_outside_the_store_and_its_label_files(demo):
    ids = set()
    for table, cols in (("hosp/patients", ["subject_id"]), ("hosp/admissions", ["subject_id", "hadm_id"]),
                        ("icu/icustays", ["subject_id", "hadm_id", "stay_id"])):
        frame = pl.read_csv(DEMO / f"{table}.csv.gz", infer_schema=False)
        ids |= {int(v) for c in cols for v in frame[c].drop_nulls()}
    assert raw_id_hits(demo.root / "store", ids)              # the scanner finds them where they belong
    assert raw_id_hits(demo.root, ids, skip=("store", "labels", "source")) == []
    assert any(demo.root.glob("memories/cohort/checkpoints/*/memory.npz")) and demo.results.exists()


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed on this machine")
def test_the_demo_reports_first_screen_names_data_date_cohort_and_the_primary_finding(demo, tmp_path):
    from tests.reports.test_report_screenshot import first_screen
    report = json.loads(demo.report_json.read_text())
    rows = {r["name"]: r["cells"] for r in report["cohort"]["characteristics"]["rows"]}
    stays, patients = rows["ICU stays"][0]["n"], rows["patients"][0]["n"]
    screen = first_screen(demo.report_html, tmp_path)
    assert screen["bottom"] <= screen["height"], screen
    text = screen["text"]
    assert f"cohort {stays:,} ICU stays of {patients:,} patients" in text, text
    assert "Primary finding. With the paper's fixed context" in text and "SV memory kept" in text, text
    assert report["metadata"]["generated_at"] in text


DEMO_MEDS = DEMO.parent / "mimic-iv-demo-meds" / "mimic_iv_demo_meds_events.parquet"


def _post_discharge_mortality(events: pl.DataFrame) -> pl.DataFrame:
    """ACES's standard 30-day post-discharge mortality task: one label per hospital discharge (the trigger),
    true when an event with code exactly MEDS_DEATH (ACES's `code: MEDS_DEATH` predicate) falls in (discharge,
    discharge + 30 days]. Evaluated with Polars: es-aces pins polars < 2, this project runs polars 2."""
    disch = (events.filter(pl.col("code").str.starts_with("HOSPITAL_DISCHARGE"))
             .select("subject_id", pl.col("time").alias("discharge")).unique())
    deaths = events.filter(pl.col("code") == "MEDS_DEATH").select("subject_id", pl.col("time").alias("death"))
    inside = (pl.col("death") > pl.col("discharge")) & (pl.col("death") <= pl.col("discharge") + pl.duration(days=30))
    return (disch.join(deaths, on="subject_id", how="left").with_columns(inside.fill_null(False).alias("label"))
            .group_by("subject_id", "discharge").agg(pl.col("label").any()).sort("subject_id", "discharge"))


@pytest.mark.skipif(not DEMO_MEDS.exists(), reason="the demo's independent MEDS conversion is not in shared/data")
def test_every_death_is_meds_death_and_aces_mortality_labels_equal_the_independent_conversion(demo):
    ours = pl.read_parquet(sorted((demo.store / "data").glob("*.parquet")))
    theirs = pl.read_parquet(DEMO_MEDS)
    died = {name: set(e.filter(pl.col("code") == "MEDS_DEATH")["subject_id"]) for name, e in
            (("ours", ours), ("theirs", theirs))}
    assert died["ours"] == died["theirs"] and len(died["ours"]) == 31
    assert ours.filter(pl.col("code").str.starts_with("MEDS_DEATH//")).height == 0
    a, b = _post_discharge_mortality(ours), _post_discharge_mortality(theirs)
    assert a.equals(b) and a["label"].sum() == 13, (a["label"].sum(), b["label"].sum())
