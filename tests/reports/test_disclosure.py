"""Small-cell suppression: no count of 1 to 10 people or stays shows in a report, its JSON or the console, and no
hidden count can be worked back from the cells around it."""
import json
import re
from pathlib import Path

import polars as pl
import pytest

from cohorts.characteristics import CohortTable, Count, Row
from cohorts.definitions import load_config
from cohorts.evaluation import aggregate
from cohorts.protocols import score_token_streams
from cohorts.runs import prepare_token_run, run_metadata, score_pending
from cohorts.token_run import ScoringPlan
from pipeline.extract import extract
from pipeline.privacy import load_key
from pipeline.workspace import Workspace
from reports.disclosure import Hidden, disclosed, suppress_table
from reports.html import render_report

DEMO = Path(__file__).resolve().parents[3] / "shared" / "data" / "mimic-iv-demo"


def _table(*rows):
    return CohortTable(tuple(rows), (), {}, ())


def test_a_small_split_hides_the_smallest_other_so_all_minus_eval_cannot_reveal_it():
    t = suppress_table(_table(Row("ICU mortality", (Count(30, 200), Count(25, 120), Count(5, 80)))))
    hidden = [isinstance(c, Hidden) for c in t.rows[0].cells]
    assert hidden[2] and sum(hidden) == 2          # eval hidden, and one more of all/train


def test_a_large_part_whose_complement_is_small_is_hidden():
    t = suppress_table(_table(Row("female", (Count(95, 100), Count(50, 50), Count(45, 50)))))
    assert all(isinstance(c, Hidden) for c in t.rows[0].cells[::2]) and isinstance(t.rows[0].cells[1], Count)


def test_a_partition_hides_a_second_row_and_counts_of_tokens_or_hours_stay():
    units = [Row(u, (Count(n, 100), Count(n // 2, 50), Count(n - n // 2, 50)), group="first care unit",
                 partition=True) for u, n in (("A", 60), ("B", 30), ("C", 10))]
    hours = Row("hours in which it fires", (Count(3, unit="hours"),) * 3, group="hypoxia")
    t = suppress_table(_table(*units, hours))
    for j in range(3):
        assert sum(isinstance(r.cells[j], Hidden) for r in t.rows[:3]) != 1
    assert isinstance(t.rows[2].cells[0], Hidden) and isinstance(t.rows[1].cells[0], Hidden)
    assert t.rows[3].cells == hours.cells


def test_zero_is_shown_and_the_threshold_comes_from_the_run():
    result = {"summary": [{"n": 0}, {"n": 7}, {"n": 12}], "paired": [], "cohort": {"stays": 12},
              "metadata": {"small_cell_threshold": 13}}
    shown = disclosed(result)
    assert [r["n"] for r in shown["summary"]] == [0, "<13", "<13"] and shown["cohort"]["stays"] == "<13"


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


@pytest.mark.slow
@pytest.mark.skipif(not DEMO.exists(), reason="shared/data/mimic-iv-demo is not present on this machine")
def test_no_count_of_1_to_10_stays_or_patients_shows_in_a_report_built_on_the_demo(tmp_path):
    cfg = load_config()
    ws = Workspace(tmp_path / "ws")
    extract(DEMO, ws.store, key=load_key())
    index, cohort = prepare_token_run(ws, cfg)
    budgets = (32,)

    def score(batch, advance):
        return score_token_streams(batch, budgets, (), index.settings, cfg["protocols"]["fixed_context"],
                                   memory_budget=32, fraction_cap=32)
    score_pending(ws, index, cfg, ScoringPlan(budgets, (), 32, 32), score)
    summary, paired = aggregate(pl.scan_parquet(ws.results))
    result = {"summary": summary, "paired": paired, "cohort": cohort,
              "metadata": run_metadata(ws, budgets, (), None, 32, 1.0, tokens="hourly", settings=index.settings,
                                       cfg=cfg)}
    html = render_report(result, tmp_path / "report").read_text()
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    counts = list(_people_counts(report["cohort"]["characteristics"]))
    assert counts and "<11" in counts and not any(isinstance(n, int) and 0 < n < 11 for n in counts)
    assert not any(isinstance(r["n"], int) and 0 < r["n"] < 11 for r in report["summary"] + report["paired"])
    assert not any(isinstance(v, int) and 0 < v < 11 for k, v in report["cohort"].items() if "stays" in k)
    visible = re.sub(r"<[^>]+>", " ", html)
    for pattern in (r"n=(\d+)", r"over (\d+) stays", r"\((\d+) stays", r"(\d+) stays\b"):
        assert not [n for n in re.findall(pattern, visible) if 0 < int(n) < 11], pattern
    cohort_section = html[html.index('<section id="cohort">'):html.index("<h3>Clinical deterioration")]
    assert not [c for c in re.findall(r"<td>(\d+)(?: \(\d+%\))?</td>", cohort_section) if 0 < int(c) < 11]
