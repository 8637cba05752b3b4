"""Small-cell suppression: no count of 1 to 10 people or stays shows in a report, its JSON or the console, and no
hidden count can be worked back from the cells around it (the demo's report: tests/test_demo_workspace.py)."""
from cohorts.characteristics import CohortTable, Count, Row
from cohorts.results import SummaryRow
from reports.disclosure import Hidden, disclosed, suppress_table
from run.result import RunResult


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
    rows = tuple(SummaryRow("streaming", "hourly", "all_channels", "none", "32", "retention", "sv_certified", n=n)
                 for n in (0, 7, 12))
    shown = disclosed(RunResult(rows, (), {"stays": 12}, {"small_cell_threshold": 13}))
    assert [r.n for r in shown.summary] == [0, "<13", "<13"] and shown.cohort["stays"] == "<13"
