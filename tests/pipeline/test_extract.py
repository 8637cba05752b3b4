"""Extraction, generator, cohorts, labels and keys on generated data (and on the MIMIC-IV demo where present)."""
import gzip
import shutil
from collections import Counter
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pytest

from cohorts.definitions import (build_cohort, deterioration_hours, is_eval_subject, label_events, load_config,
                                 rare_codes, stay_events)
from pipeline.extract import ExtractionError, extract
from pipeline.store_reader import UnknownSubjectError, read_subject, scan_events
from pipeline.generate import GeneratorConfig, generate
from pipeline.keys import KEY_DIM, EventKeyer
from pipeline.meds import shard_files
from pipeline.sharding import Sharding

DEMO = Path(__file__).resolve().parents[3] / "shared" / "data" / "mimic-iv-demo"


def csv_rows(path):
    with gzip.open(path, "rt") if str(path).endswith(".gz") else open(path) as fh:
        return sum(1 for _ in fh) - 1


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("src"), GeneratorConfig(n_patients=24, seed=5))


@pytest.fixture(scope="module")
def store(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("store")
    return out, extract(source, out)


def test_generator_is_deterministic(tmp_path):
    a = generate(tmp_path / "a", GeneratorConfig(n_patients=5, seed=1))
    b = generate(tmp_path / "b", GeneratorConfig(n_patients=5, seed=1))
    for f in sorted(a.rglob("*.csv.gz")):
        assert f.read_bytes() == (b / f.relative_to(a)).read_bytes()


def test_row_counts_per_source_table_match_the_input(source, store):
    _, summary = store
    single_row_tables = ["transfers", "labevents", "chartevents", "outputevents"]
    for t in single_row_tables:
        folder = "hosp" if t in ("transfers", "labevents") else "icu"
        n = csv_rows(source / folder / f"{t}.csv.gz")
        info = summary.tables[t]
        assert info["rows"] == n
        assert info["events"] + info["quarantined_total"] == n
    counts = scan_events(store[0]).group_by("source_table").len().collect()
    for t in single_row_tables:
        assert counts.filter(pl.col("source_table") == t)["len"].item() == summary.tables[t]["events"]
    # infusions and procedures: one start event per row (and end events, and the charted weight, beside them)
    rejected = sorted((store[0] / "quarantine").glob("*.parquet"))
    quarantine = pl.read_parquet(rejected) if rejected else pl.DataFrame({"code": []}, schema={"code": pl.String})
    for t, start in (("inputevents", "INPUT//"), ("procedureevents", "PROCEDURE//")):
        n = csv_rows(source / "icu" / f"{t}.csv.gz")
        starts = scan_events(store[0]).filter(pl.col("code").str.starts_with(start)).select(pl.len()).collect().item()
        assert summary.tables[t]["rows"] == n
        assert starts + quarantine.filter(pl.col("code").str.starts_with(start)).height == n
    # admissions: admission + discharge + one death per deceased patient + ED registration and exit when charted
    adm = pl.read_csv(source / "hosp" / "admissions.csv.gz", infer_schema_length=0)
    charted = [adm.filter(pl.col(c).is_not_null() & (pl.col(c) != "")).height
               for c in ("deathtime", "edregtime", "edouttime")]
    assert summary.tables["admissions"]["events"] == 2 * adm.height + sum(charted)


def test_each_stream_comes_back_in_time_order(store):
    out, _ = store
    stays = pl.read_parquet(out / "stays.parquet")
    for sid in stays["subject_id"].unique().to_list()[:8]:
        ev = read_subject(out, sid)
        assert ev["subject_id"].unique().to_list() == [sid]
        assert ev["time"].is_sorted()
    with pytest.raises(UnknownSubjectError, match="subject 1 has no events"):
        read_subject(out, 1)


def test_readers_do_not_depend_on_the_row_order_of_the_store_files(source, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(source, tmp_path / "src")
    extract(tmp_path / "src", out)
    cfg = load_config()
    cohort = build_cohort(out, cfg)
    sid = int(cohort["subject_id"][0])
    before, events_before = read_subject(out, sid), stay_events(out, cohort)
    for f in (out / "data").glob("*.parquet"):       # the same rows, shuffled within every file
        pl.read_parquet(f).sample(fraction=1.0, shuffle=True, seed=3).write_parquet(f)
    # ties in (time, code) are broken by content hash and occurrence: the same stream, value for value
    assert read_subject(out, sid).equals(before)
    assert stay_events(out, cohort).equals(events_before)


def test_a_quote_in_a_path_is_a_path_not_broken_sql(source, tmp_path):
    src, out = tmp_path / "o'brien's source", tmp_path / "st'ore"
    shutil.copytree(source, src)
    first = extract(src, out)
    assert first.new_events > 0 and extract(src, out).new_events == 0
    assert first.total_events == sum(t["events"] for t in first.tables.values())


def test_incremental_run_adds_only_new_rows(source, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(source, src)
    out = tmp_path / "out"
    first = extract(src, out)
    again = extract(src, out)
    assert again.new_events == 0 and all(t["skipped"] for t in again.tables.values())
    assert again.total_events == first.total_events
    # append three chart rows (one an exact repeat of an existing row: a real second measurement)
    path = src / "icu" / "chartevents.csv.gz"
    lines = gzip.open(path, "rt").read().splitlines()
    extra = [lines[1], lines[1].replace(",220045,", ",220210,"), lines[2]]
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(lines + extra) + "\n")
    third = extract(src, out)
    assert third.new_events == 3
    assert third.tables["chartevents"]["new_events"] == 3
    assert third.tables["labevents"]["skipped"]
    assert third.total_events == first.total_events + 3
    assert extract(src, out).new_events == 0


def test_the_shard_count_grows_with_the_source_and_stays_with_the_store(source, tmp_path, monkeypatch):
    """A new store's shard count comes from its source's size (16 at least, powers of two, at most 4,096) and is
    recorded: a later run keeps it whatever its files' sizes; Python, Polars and SQL put a subject in one shard."""
    assert [Sharding.for_source(b).count for b in (0, 13 * 2**20, 715 * 10**6, 7 * 10**9, 10**15)] == \
        [16, 16, 128, 2048, 4096]
    with pytest.raises(ValueError, match="power of two"):
        Sharding(48)
    ids = [0, 1, 17, 10001217, 6_810_001_217, -5]
    sharding = Sharding(128)
    in_sql = [r[0] for r in duckdb.sql(f"SELECT {sharding.sql('x')} FROM unnest({ids}) t(x)").fetchall()]
    assert in_sql == [sharding.shard(i) for i in ids] == pl.select(sharding.expr(pl.Series(ids))).to_series().to_list()
    size = sum(f.stat().st_size for f in source.rglob("*.csv.gz") if "d_" not in f.name)
    monkeypatch.setattr("pipeline.sharding.SOURCE_BYTES_PER_SHARD", size // 20)
    out = tmp_path / "out"
    extract(source, out)
    assert Sharding.of_store(out) == Sharding(32)
    for f in shard_files(out):                      # each subject in its shard
        assert set(pl.read_parquet(f, columns=["subject_id"])["subject_id"].unique() % 32) == {int(f.stem)}
    monkeypatch.setattr("pipeline.sharding.SOURCE_BYTES_PER_SHARD", size)
    assert extract(source, out).new_events == 0 and Sharding.of_store(out) == Sharding(32)


def test_a_rerun_reads_no_unchanged_source_file(source, tmp_path, monkeypatch):
    """A file at its path with its recorded size and time is not read; one touched but not changed is read once."""
    import os

    from pipeline import extract as extract_module
    src = tmp_path / "src"
    shutil.copytree(source, src)
    out = tmp_path / "out"
    extract(src, out)
    read = Counter()
    real = extract_module._sha256
    monkeypatch.setattr(extract_module, "_sha256", lambda p: read.update([p.name]) or real(p))
    assert extract(src, out).new_events == 0 and not read
    labs = src / "hosp" / "labevents.csv.gz"
    os.utime(labs, ns=(labs.stat().st_atime_ns, labs.stat().st_mtime_ns + 10**9))
    assert extract(src, out).new_events == 0 and read == Counter({"labevents.csv.gz": 1})
    assert extract(src, out).new_events == 0 and read == Counter({"labevents.csv.gz": 1})   # its time recorded


def _event_rows(out):
    return (scan_events(out).drop("event_hash", "occurrence").collect()
            .sort("subject_id", "time", "code", "numeric_value", "text_value", nulls_last=True))


def test_a_table_may_be_a_folder_of_files_and_a_rerun_reads_only_the_new_ones(source, tmp_path, monkeypatch):
    """icu/chartevents/ as files, one per part of the rows (as daily extracts arrive): the store equals the one
    file's; a new file is the only one a rerun reads, and the store then equals the one file with its rows."""
    from pipeline import extract as extract_module
    lines = gzip.open(source / "icu" / "chartevents.csv.gz", "rt").read().splitlines()
    head, rows = lines[0], lines[1:]
    parts = [rows[i::4] for i in range(4)]          # every row in exactly one part

    def source_with(files):
        src = tmp_path / f"src-{len(files)}"
        shutil.copytree(source, src)
        (src / "icu" / "chartevents.csv.gz").unlink()
        (src / "icu" / "chartevents").mkdir()
        for i, part in enumerate(files):
            _write_gz(src / "icu" / "chartevents" / f"day-{i}.csv.gz", "\n".join([head] + part) + "\n")
        return src
    whole = tmp_path / "whole"
    extract(source, whole)
    src = source_with(parts[:3])
    out = tmp_path / "folder"
    first = extract(src, out)
    assert first.tables["chartevents"]["rows"] == sum(len(p) for p in parts[:3])
    _write_gz(src / "icu" / "chartevents" / "day-3.csv.gz", "\n".join([head] + parts[3]) + "\n")
    read = Counter()
    real = extract_module._sha256
    monkeypatch.setattr(extract_module, "_sha256", lambda p: read.update([p.name]) or real(p))
    later = extract(src, out)
    assert read == Counter({"day-3.csv.gz": 1}) and later.new_events > 0
    assert later.tables["chartevents"]["rows"] == len(parts[3])
    assert _event_rows(out).equals(_event_rows(whole))
    bad = src / "icu" / "chartevents" / "day-4.csv.gz"
    _write_gz(bad, head.replace("valuenum", "value") + "\n")
    with pytest.raises(ExtractionError, match="day-4.csv.gz"):
        extract(src, out)


def _write_gz(path, text):
    with gzip.open(path, "wt") as fh:
        fh.write(text)


def test_missing_table_and_column_are_clear_errors(source, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(source, src)
    (src / "icu" / "icustays.csv.gz").unlink()
    with pytest.raises(ExtractionError, match=r"lacks required table\(s\) \['icu/icustays'\]"):
        extract(src, tmp_path / "o1")
    shutil.copy(source / "icu" / "icustays.csv.gz", src / "icu" / "icustays.csv.gz")
    lines = gzip.open(src / "icu" / "chartevents.csv.gz", "rt").read().splitlines()
    _write_gz(src / "icu" / "chartevents.csv.gz",
              "\n".join([lines[0].replace("valuenum", "vnum")] + lines[1:]) + "\n")
    with pytest.raises(ExtractionError, match=r"chartevents.csv.gz lacks required column\(s\) \['valuenum'\]"):
        extract(src, tmp_path / "o2")
    assert not (tmp_path / "o2" / "data").exists()
    with pytest.raises(ExtractionError, match="does not exist"):
        extract(tmp_path / "nowhere", tmp_path / "o3")


def test_bad_rows_are_quarantined_and_counted(source, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(source, src)
    lines = gzip.open(src / "icu" / "chartevents.csv.gz", "rt").read().splitlines()
    f = lines[1].split(",")  # subject,hadm,stay,caregiver,charttime,storetime,itemid,value,valuenum,uom,warning
    bad_time = f[:4] + ["20xx-13-45 99:00:00"] + f[5:]
    negative = f[:6] + ["220045", "-12", "-12"] + f[9:]
    nan_value = f[:6] + ["220045", "NaN", "NaN"] + f[9:]
    outside = f[:4] + ["2300-01-01 00:00:00"] + f[5:]
    # values that would turn per-code means to inf and sds to NaN
    huge = [f[:6] + ["220045", v, v] + f[9:] for v in ("inf", "1e308", "1e309", "-inf")]
    _write_gz(src / "icu" / "chartevents.csv.gz",
              "\n".join(lines + [",".join(r) for r in (bad_time, negative, nan_value, outside, *huge)]) + "\n")
    out = tmp_path / "out"
    s = extract(src, out)
    q = s.tables["chartevents"]["quarantined"]
    assert q == {"unparsable_time": 1, "negative_value": 1, "nan_value": 1, "outside_stay": 1,
                 "non_finite_value": 3, "implausible_magnitude": 1}
    assert s.tables["chartevents"]["events"] + 8 == s.tables["chartevents"]["rows"]
    hr = scan_events(out).filter(pl.col("code") == "CHART//220045").select("numeric_value").collect()
    assert hr["numeric_value"].is_finite().all() and hr["numeric_value"].abs().max() < 1e9
    quarantine = pl.read_parquet(out / "quarantine" / "*.parquet")
    assert dict(Counter(quarantine["reason"].to_list())) == q
    assert "20xx-13-45 99:00:00" in quarantine["raw_time"].to_list()


def test_cohort_labels_and_split(store):
    out, _ = store
    cfg = load_config()
    cohort = build_cohort(out, cfg)
    assert (cohort["anchor_age"] >= 18).all() and (cohort["stay_hours"] >= 12).all()
    all_stays = pl.read_parquet(out / "stays.parquet")
    assert cohort.height < all_stays.height  # minors and short stays are excluded
    assert cohort["split"].to_list() == [("eval" if is_eval_subject(s, cfg) else "train")
                                         for s in cohort["subject_id"]]
    events = stay_events(out, cohort)
    assert events.group_by("stay_id").agg(pl.col("time").is_sorted().alias("ok"))["ok"].all()
    labelled = label_events(events, cohort, cfg)
    hours = deterioration_hours(events, cfg)
    # hand check: every MAP < 65 reading flags its own hour, and no flagged hour lacks a firing criterion
    low_map = events.filter((pl.col("code") == "CHART//220052") & (pl.col("numeric_value") < 65))
    assert low_map.height > 0
    flagged = set(zip(hours["stay_id"], hours["hour"]))
    assert all((s, h) in flagged for s, h in zip(low_map["stay_id"], low_map["hour"]))
    first_vaso = (events.filter(pl.col("code").str.starts_with("INPUT//221906")).sort("time")
                  .group_by("stay_id").first())
    for s, h in zip(first_vaso["stay_id"], first_vaso["hour"]):
        assert ((hours["stay_id"] == s) & (hours["hour"] == h) & (hours["criterion"] == "vasopressor_start")).any()
    ev_flag = labelled.filter(pl.col("deteriorating"))
    assert set(zip(ev_flag["stay_id"], ev_flag["hour"])) <= flagged
    rare, threshold = rare_codes(events, cohort, cfg)
    train_counts = (events.filter(pl.col("stay_id").is_in(cohort.filter(pl.col("split") == "train")["stay_id"]
                                                         .implode())).group_by("code").len())
    for code, n in zip(train_counts["code"], train_counts["len"]):
        assert (code in rare) == (n <= threshold)
    assert "CHART//220045" not in rare


def test_event_keys_are_deterministic_and_standardised(store):
    out, _ = store
    cfg = load_config()
    cohort = build_cohort(out, cfg)
    events = stay_events(out, cohort)
    keyer = EventKeyer().fit(events)
    K1, K2 = keyer.transform(events), EventKeyer().fit(events).transform(events)
    assert K1.shape == (events.height, KEY_DIM) and K1.dtype == np.float64
    assert np.array_equal(K1, K2) and np.all(np.isfinite(K1))
    hr = (events["code"] == "CHART//220045").to_numpy()
    z = K1[hr, 8]
    assert abs(z.mean()) < 1e-9 and abs(z.std(ddof=1) - 1) < 1e-9


@pytest.mark.skipif(not DEMO.exists(), reason="shared/data/mimic-iv-demo is not present on this machine")
def test_extraction_on_the_mimic_iv_demo(tmp_path):
    s = extract(DEMO, tmp_path / "demo")
    for t in ("labevents", "chartevents", "outputevents", "emar", "diagnoses_icd", "omr", "microbiologyevents"):
        info = s.tables[t]
        assert info["events"] + info["quarantined_total"] == info["rows"]
    # two events per infusion and procedure (start, end) with a quarantined row's pair counted as it is
    for t in ("inputevents", "procedureevents"):
        assert s.tables[t]["events"] + s.tables[t]["quarantined_total"] >= 2 * s.tables[t]["rows"]
    assert s.tables["chartevents"]["rows"] == 668_862
    assert s.tables["labevents"]["rows"] == 107_727
    cfg = load_config()
    cohort = build_cohort(tmp_path / "demo", cfg)
    assert 50 < cohort.height <= 140
    events = stay_events(tmp_path / "demo", cohort)
    hours = deterioration_hours(events, cfg)
    assert hours["stay_id"].n_unique() > 10
    ev = read_subject(tmp_path / "demo", int(cohort["subject_id"][0]))
    assert ev["time"].is_sorted()


def test_acute_sofa_rise_hand_checked():
    cfg = load_config()
    crit = [c for c in cfg.section("deterioration")["criteria"] if c["name"] == "acute_sofa_rise"][0]
    rows = [(0, "LAB//51265", 200.0), (0, "LAB//50912", 1.0), (1, "CHART//220052", 80.0),
            (10, "LAB//51265", 90.0),            # platelets < 100: coagulation 2 points
            (12, "INPUT//221906", 2.0),          # norepinephrine: cardiovascular 3 points
            (40, "CHART//220052", 60.0)]         # MAP < 70: 1 point, long after the rest expired
    ev = pl.DataFrame({"stay_id": [1] * len(rows), "hour": [r[0] for r in rows], "code": [r[1] for r in rows],
                       "numeric_value": [r[2] for r in rows]})
    from cohorts.definitions import hourly_sofa
    sofa = dict(zip(*hourly_sofa(ev, crit).select("hour", "sofa").to_dict(as_series=False).values()))
    assert ([sofa[h] for h in (9, 10, 12, 33, 34, 35, 36, 40)] == [0, 2, 5, 5, 3, 3, 0, 1])
    hours = deterioration_hours(ev.with_columns(pl.lit(None, dtype=pl.Datetime).alias("time")), cfg)
    assert hours.filter(pl.col("criterion") == "acute_sofa_rise")["hour"].to_list() == [10]


def test_bad_cohort_configs_are_clear_errors(tmp_path):
    import yaml

    from cohorts.definitions import CohortConfigError
    cfg = load_config().raw
    broken = dict(cfg, split={"salt": "x"})
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(broken))
    with pytest.raises(CohortConfigError, match="lacks split.eval_fraction"):
        load_config(tmp_path / "a.yaml")
    crit = [dict(c) for c in cfg["deterioration"]["criteria"]]
    for c in crit:
        if c["name"] == "acute_sofa_rise":
            del c["components"]
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(dict(cfg, deterioration={"criteria": crit})))
    with pytest.raises(CohortConfigError, match="needs components and window_hours"):
        load_config(tmp_path / "b.yaml")


def test_a_source_without_event_tables_and_the_cli_error_exit(source, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(source, src)
    for t in ("hosp/transfers", "hosp/labevents", "icu/chartevents", "icu/inputevents", "icu/outputevents",
              "icu/procedureevents"):
        (src / f"{t}.csv.gz").unlink()
    with pytest.raises(ExtractionError, match="has no event table"):
        extract(src, tmp_path / "o")
    from flows.cli import main
    assert main(["extract", "--source", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o2")]) == 2


def _rewrite_gz(path, edit):
    text = gzip.decompress(path.read_bytes()).decode()
    path.write_bytes(gzip.compress(edit(text.splitlines())))


def _ragged(lines):
    return "\n".join(lines + [lines[1] + ",extra,fields"]).encode()


def _latin1(lines):
    f = lines[1].split(",")
    f[-3] = "caf\xe9"
    return "\n".join(lines + [",".join(f)]).encode("latin-1")


def _bad_stay_subject(lines):
    f = lines[1].split(",")
    f[0] = "abc"
    return "\n".join([lines[0], ",".join(f), *lines[2:]]).encode()


BAD_INPUTS = {
    "truncated gzip": ("icu/chartevents.csv.gz", lambda p: p.write_bytes(p.read_bytes()[:len(p.read_bytes()) // 2]),
                       "truncated"),
    "not gzip": ("icu/chartevents.csv.gz", lambda p: p.write_bytes(gzip.decompress(p.read_bytes())),
                 "not gzip-compressed"),
    "binary": ("hosp/labevents.csv.gz", lambda p: p.write_bytes(gzip.compress(bytes(range(256)) * 50)),
               "not comma-separated text"),
    "latin-1": ("hosp/labevents.csv.gz", lambda p: _rewrite_gz(p, _latin1), "not UTF-8"),
    "ragged row": ("icu/chartevents.csv.gz", lambda p: _rewrite_gz(p, _ragged), "more or fewer fields"),
    "empty file": ("icu/outputevents.csv.gz", lambda p: p.write_bytes(gzip.compress(b"")), "the file is empty"),
    "no usable stay": ("icu/icustays.csv.gz",
                       lambda p: _rewrite_gz(p, lambda lines: "\n".join([lines[0], lines[0]]).encode()),
                       "no usable ICU stay: 1 with a non-numeric or missing subject_id"),
    "no stays": ("icu/icustays.csv.gz", lambda p: _rewrite_gz(p, lambda lines: (lines[0] + "\n").encode()),
                 "no ICU stays"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_a_damaged_source_file_is_one_message_naming_it_and_nothing_is_written(source, tmp_path, case):
    rel, damage, message = BAD_INPUTS[case]
    src = tmp_path / "src"
    shutil.copytree(source, src)
    damage(src / rel)
    with pytest.raises(ExtractionError) as e:
        extract(src, tmp_path / "out")
    assert str(e.value).startswith(str(src / rel)) and message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


def _repeated_header(lines):
    return "\n".join(lines + [lines[0]]).encode()


def test_a_malformed_row_goes_to_the_quarantine_and_never_stops_a_run(source, tmp_path):
    """The audit's case: a non-numeric subject_id (or a repeated header line) fell in DuckDB 2's null partition,
    named __HIVE_DEFAULT_PARTITION__, and every run failed on int() of it; a bad stay row refused the run."""
    src = tmp_path / "src"
    shutil.copytree(source, src)
    for rel in ("icu/chartevents.csv.gz", "icu/icustays.csv.gz"):
        _rewrite_gz(src / rel, lambda lines: _repeated_header(_bad_stay_subject(lines).decode().splitlines()))
    s = extract(src, tmp_path / "out")
    assert s.tables["chartevents"]["quarantined"]["bad_subject_id"] == 2
    assert s.tables["icustays"]["quarantined"]["bad_subject_id"] == 4     # two rows, two events each
    quarantine = pl.read_parquet(tmp_path / "out" / "quarantine" / "*.parquet")
    assert "abc" not in quarantine["raw_time"].to_list() and quarantine["subject_id"].null_count() == 6
    stays = pl.read_parquet(tmp_path / "out" / "stays.parquet")
    assert stays["subject_id"].null_count() == 0 and stays.height == csv_rows(source / "icu" / "icustays.csv.gz") - 1
    again = extract(src, tmp_path / "out")          # a rerun reads nothing new and quarantines nothing twice
    assert again.new_events == 0
    assert pl.read_parquet(tmp_path / "out" / "quarantine" / "*.parquet").height == quarantine.height
