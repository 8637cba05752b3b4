"""The workspace comparison counts what differs, so an equivalence asserted with it can fail."""
import json
import math

import polars as pl

from deletion.compare import RUN_BOOKKEEPING, json_leaves, _rows_differing, _table


def test_rows_are_compared_as_multisets_with_nulls_equal():
    a = pl.DataFrame({"code": ["HR", "HR", "SpO2"], "value": [80.0, 80.0, None]})
    assert _rows_differing(a, a.reverse()) == 0
    assert _rows_differing(a, a.head(2)) == 1            # the null row only in a
    assert _rows_differing(a, a.slice(1)) == 1           # a duplicate row once fewer
    assert _rows_differing(a, a.with_columns(pl.col("value").fill_null(1.0))) == 2


def test_report_numbers_within_atol_bookkeeping_left_out_nan_equals_nan(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"x": [1.0, 2.0], "p": math.nan, "seconds": 3, "only_a": 1}))
    b.write_text(json.dumps({"x": [1.0, 2.0 + 1e-13], "p": math.nan, "seconds": 9}))
    d = json_leaves("report", a, b, atol=1e-12, skip=RUN_BOOKKEEPING, numbers_only=True)
    assert (d.compared, d.differing) == (4, 1) and 0 < d.max_abs < 1e-12
    assert json_leaves("report", a, b, atol=0.0, skip=RUN_BOOKKEEPING, numbers_only=True).differing == 2


def test_other_leaves_compare_exactly_unless_numbers_only(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"scaling": "reference", "hr": {"mean": 90.0}, "fitted": False}))
    b.write_text(json.dumps({"scaling": "training_split", "hr": {"mean": 90.0}, "fitted": True}))
    assert json_leaves("s", a, b, atol=0.0).differing == 2
    assert json_leaves("s", a, b, atol=0.0, numbers_only=True).differing == 0


def test_a_table_s_row_order_counts_and_event_order_does_not(tmp_path):
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    frame = pl.DataFrame({"subject_id": [1, 2, 3], "code": ["x", "y", None]})
    frame.write_parquet(a)
    frame.reverse().write_parquet(b)
    d = _table("t", a, b)
    assert (d.differing, d.out_of_order, d.equal) == (0, 2, False)      # rows 0 and 2 swapped
    assert _table("t", a, b, ordered=False).equal
