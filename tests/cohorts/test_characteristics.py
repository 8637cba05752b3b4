"""The report's cohort table, criterion breakdown, quarantine and provenance, checked by hand."""
import hashlib
import json
from dataclasses import replace
from datetime import datetime, timedelta

import polars as pl

from cohorts.characteristics import Count, Spread, death_stays, describe_cohort, token_counts
from cohorts.definitions import deterioration_hours
from reports.html import render_report
from run.provenance import provenance
from tests.builders import edited_config, hand_result

T0 = datetime(2150, 1, 1)
CFG = edited_config(lambda raw: raw.update(
    cohort={"min_age": 18, "min_stay_hours": 12, "death_codes": ["MEDS_DEATH"]},
    deterioration={"criteria": [{"name": "low_map", "codes": ["MAP"], "below": 65},
                                {"name": "icu_death", "codes": ["MEDS_DEATH"], "first_event": True}]},
    token_labels={"composite": {}}, endpoints={}))


def cohort():
    return pl.DataFrame({"stay_id": [1, 2, 3], "subject_id": [10, 10, 20], "anchor_age": [60, 62, 80],
                         "gender": ["F", "F", "M"], "stay_hours": [24.0, 48.0, 72.0],
                         "first_careunit": ["MICU", "SICU", "MICU"], "split": ["train", "train", "eval"]})


def events():
    rows = [(1, "MAP", 60.0, 1), (1, "MAP", 50.0, 1), (1, "MAP", 55.0, 2), (1, "MAP", 80.0, 3),
            (3, "MAP", 70.0, 5), (3, "MEDS_DEATH", None, 70)]
    return pl.DataFrame({"stay_id": [r[0] for r in rows], "code": [r[1] for r in rows],
                         "numeric_value": [r[2] for r in rows], "hour": [r[3] for r in rows],
                         "time": [T0 + timedelta(hours=r[3]) for r in rows]})


def labelled():
    return pl.DataFrame({"stay_id": [1, 1, 1, 1, 3, 3], "split": ["train"] * 4 + ["eval"] * 2,
                         "composite": [True, False, False, False, False, False]})


def describe(root, with_tokens=True):
    ev = events()
    return describe_cohort(root, CFG, cohort(), death_stays(ev, CFG), deterioration_hours(ev, CFG),
                           token_counts(labelled(), ["composite"]) if with_tokens else None)


def test_table_one_by_split(tmp_path):
    q = tmp_path / "quarantine"
    q.mkdir()
    pl.DataFrame({"subject_id": [1, 2, 3], "reason": ["negative_value", "negative_value", "outside_stay"]}) \
        .write_parquet(q / "run-1.parquet")
    t = describe(tmp_path)
    rows = {(r.group, r.name): r.cells for r in t.rows}
    assert rows[("", "ICU stays")] == (Count(3), Count(2), Count(1))
    assert rows[("", "patients")] == (Count(2, unit="patients"), Count(1, unit="patients"), Count(1, unit="patients"))
    assert rows[("", "female")] == (Count(2, 3), Count(2, 2), Count(0, 1))
    assert rows[("", "ICU mortality")] == (Count(1, 3), Count(0, 2), Count(1, 1))
    assert rows[("", "ICU length of stay, days")][0] == Spread(2.0, 1.5, 2.5, 3)
    assert rows[("", "age, years")][1] == Spread(61.0, 60.5, 61.5, 2)
    assert rows[("first care unit", "MICU")] == (Count(2, 3), Count(1, 2), Count(1, 1))
    assert rows[("", "hourly tokens")] == (Count(6, unit="tokens"), Count(4, unit="tokens"), Count(2, unit="tokens"))
    assert rows[("labelled tokens (% of tokens)", "composite")] == (Count(1, 6, "tokens"), Count(1, 4, "tokens"),
                                                                     Count(0, 2, "tokens"))
    assert rows[("stays with a labelled token (% of stays with tokens)", "composite")] == \
        (Count(1, 2), Count(1, 1), Count(0, 1))
    crit = {(r.group, r.name): r.cells for r in t.criteria}
    assert crit[("low_map", "hours in which it fires")] == (Count(2, unit="hours"), Count(2, unit="hours"),
                                                           Count(0, unit="hours"))   # hours 1 and 2
    assert crit[("low_map", "stays (% of stays)")] == (Count(1, 3), Count(1, 2), Count(0, 1))
    assert crit[("icu_death", "stays (% of stays)")] == (Count(1, 3), Count(0, 2), Count(1, 1))
    assert t.quarantine == {"negative_value": 2, "outside_stay": 1}
    assert describe(tmp_path / "empty", False).quarantine == {}


def test_provenance_names_files_code_packages_and_config(tmp_path):
    store, root = tmp_path / "store", tmp_path / "ws"
    store.mkdir()
    root.mkdir()
    (store / "manifest.json").write_text(json.dumps({"files": {"icustays": {
        "path": "/data/icu/icustays.csv.gz", "size": 10, "mtime_ns": 0, "sha256": "ab" * 32, "rows": 3}},
        "runs": [{"run_id": "r1"}, {"run_id": "r2"}]}))
    (root / "config.yaml").write_text("cohort: {min_age: 18}\n")
    p = provenance(store, root, "hand-built source")
    assert [(f.table, f.sha256, f.rows) for f in p.files] == [("icustays", "ab" * 32, 3)]
    assert p.extractions == 2 and p.source == "hand-built source"
    assert p.config_sha256 == hashlib.sha256(b"cohort: {min_age: 18}\n").hexdigest()
    assert p.packages["numpy"] != "not installed" and "python" in p.packages


def test_report_shows_the_cohort_and_provenance_and_keeps_them_in_its_json(tmp_path):
    result = hand_result()
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "manifest.json").write_text(json.dumps({"files": {}, "runs": []}))
    result = replace(result, cohort={**result.cohort, "characteristics": describe(tmp_path)},
                     provenance=provenance(tmp_path / "store", tmp_path, "hand-built"))
    assert "2 (67%)" not in render_report(result, tmp_path / "shared").read_text()    # a small cell: hidden
    result = result.with_metadata(small_cell_threshold=1)                               # shows every count
    text = render_report(result, tmp_path / "out").read_text()
    assert '<section id="cohort">' in text and '<section id="provenance">' in text
    assert "2 (67%)" in text                      # female, all stays
    assert "2.0 [1.5, 2.5]" in text               # length of stay, days
    assert "negative value" not in text and "no row was rejected" in text
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["cohort"]["characteristics"]["rows"][0]["name"] == "ICU stays"
    assert data["provenance"]["source"] == "hand-built"
