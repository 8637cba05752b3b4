"""The benches' sources built from the real demo: clones with fresh ids, a night's new rows, and the source
without one patient (what a never-saw run reads)."""
import importlib.util
import sys
from pathlib import Path

import duckdb
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
DEMO = BENCH.parents[1] / "shared" / "data" / "mimic-iv-demo"
sys.path.insert(0, str(BENCH))
spec = importlib.util.spec_from_file_location("scale_source", BENCH / "scale_source.py")
source = importlib.util.module_from_spec(spec)
spec.loader.exec_module(source)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not DEMO.exists(), reason=f"the MIMIC-IV demo is not at {DEMO} "
                                                           "(see shared/data/README.md)")]


def _subjects(path):
    return duckdb.sql(f"SELECT subject_id FROM read_csv('{path}', all_varchar=true)").fetchall()


def test_clones_new_rows_and_a_source_without_one_patient(tmp_path):
    src = source.make_source(DEMO, tmp_path / "src", 2)
    demo_stays = _subjects(DEMO / "icu" / "icustays.csv.gz")
    stays = _subjects(src / "icu" / "icustays.csv.gz")
    assert len(stays) == 2 * len(demo_stays)
    assert {int(s) for (s,) in stays} == {int(s) + k * source.ID_OFFSET for (s,) in demo_stays for k in (0, 1)}

    newer = source.add_new_rows(DEMO, src, tmp_path / "plus", 2)
    assert len(_subjects(newer / "icu" / "icustays.csv.gz")) > len(stays)

    sid = int(demo_stays[0][0])
    without = source.without_subject(src, tmp_path / "without", sid)
    for table in ("icu/icustays.csv.gz", "icu/chartevents.csv.gz", "hosp/patients.csv.gz", "hosp/labevents.csv.gz"):
        before, after = _subjects(src / table), _subjects(without / table)
        assert (str(sid),) not in after
        assert len(after) == len(before) - before.count((str(sid),)) and len(after) < len(before), table
    assert (without / "icu" / "d_items.csv.gz").read_bytes() == (DEMO / "icu" / "d_items.csv.gz").read_bytes()


def test_as_folders_a_night_s_rows_arrive_as_one_new_file_per_table(tmp_path):
    src = source.make_source(DEMO, tmp_path / "src", 2)
    files = _subjects(src / "icu" / "chartevents.csv.gz")
    assert source.make_source(DEMO, tmp_path / "src", 2, folders=True) == src       # moved into folders
    first = src / "icu" / "chartevents" / source.FIRST_PART
    assert _subjects(first) == files and (src / "icu" / "d_items.csv.gz").exists()
    newer = source.add_new_rows(DEMO, src, tmp_path / "plus", 2)
    kept, night = newer / "icu" / "chartevents" / source.FIRST_PART, newer / "icu" / "chartevents" / "part-0001.csv.gz"
    assert kept.stat().st_mtime_ns == first.stat().st_mtime_ns and kept.read_bytes() == first.read_bytes()
    stays, new_stays = _subjects(src / "icu" / "icustays" / source.FIRST_PART), \
        _subjects(newer / "icu" / "icustays" / "part-0001.csv.gz")
    assert new_stays and not set(new_stays) & set(stays)
    assert len(_subjects(night)) > 0
