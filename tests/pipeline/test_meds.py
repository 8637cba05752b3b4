"""MEDS in and out: the store is a valid MEDS dataset (checked with the ``meds`` package), a MEDS dataset is a
source (stays from its admission/discharge codes, codes matched by ACES-style predicates), and runs write MEDS
label files and subject splits that a deletion rewrites."""
import json
import shutil
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import meds
import polars as pl
import pyarrow.parquet as pq
import pytest

from cohorts.definitions import load_config, resolve_config
from cohorts.predicates import code_expr, matching_codes, value_expr
from run.reference import prepare_token_streams
from deletion import delete_subject, scan_subject
from pipeline.extract import ExtractionError, extract
from pipeline.store_reader import quarantine_reasons, scan_events
from pipeline.extract_rules import DEATH_DATE_ONLY
from pipeline.generate import GeneratorConfig, generate
from pipeline.meds import ADMISSION_WITHOUT_DISCHARGE, MedsStayCodes, shard_files, validate_dataset
from pipeline.privacy import load_key
from pipeline.workspace import Workspace
from tests.builders import meds_dataset

DEMO = Path(__file__).resolve().parents[3] / "shared" / "data" / "mimic-iv-demo"
MEDS_CONFIG = load_config(resolve_config("mimic-iv-meds"))


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """A workspace extracted from the embedded generator's data, with the run's hourly-token step done."""
    ws = Workspace(tmp_path_factory.mktemp("meds-ws"))
    generate(ws.source, GeneratorConfig(n_patients=24, seed=5))
    extract(ws.source, ws.store, key=load_key(ws.root))
    prepare_token_streams(ws.store, load_config(), labels_dir=ws.labels)
    return ws


def _as_etl(store: Path, out: Path) -> Path:
    """The store's events rewritten in the MIMIC-IV MEDS ETL's code conventions, as a MEDS dataset of two shards
    with no stay table: chart items LAB//<itemid>//<unit>, INFUSION_START//<itemid>, PROCEDURE//START//<itemid>,
    ICU_ADMISSION//<careunit> / ICU_DISCHARGE//<careunit>, MEDS_DEATH, MEDS_BIRTH and GENDER//<sex>."""
    stays = pl.read_parquet(store / "stays.parquet")
    ev = scan_events(store).collect()
    unit = pl.col("unit").fill_null("UNK")
    item = pl.col("code").str.split("//").list.get(1, null_on_oob=True)
    code = (pl.when(pl.col("code").str.starts_with("CHART//") | pl.col("code").str.starts_with("LAB//"))
            .then(pl.lit("LAB//") + item + pl.lit("//") + unit)
            .when(pl.col("code").str.starts_with("INPUT//")).then(pl.lit("INFUSION_START//") + item)
            .when(pl.col("code").str.starts_with("PROCEDURE//")).then(pl.lit("PROCEDURE//START//") + item)
            .otherwise(pl.col("code")))
    # stays, sex and birth are written below as the ETL writes them (birth: age at the first stay = anchor_age)
    body = (ev.filter(~pl.col("code").str.starts_with("ICU_") & ~pl.col("code").str.starts_with("GENDER//")
                      & (pl.col("code") != "MEDS_BIRTH"))
            .select("subject_id", "time", code.alias("code"), pl.col("numeric_value").cast(pl.Float32)))
    icu = pl.concat([
        stays.select("subject_id", pl.col("intime").alias("time"),
                     (pl.lit("ICU_ADMISSION//") + pl.col("first_careunit")).alias("code")),
        stays.select("subject_id", pl.col("outtime").alias("time"),
                     (pl.lit("ICU_DISCHARGE//") + pl.col("first_careunit")).alias("code"))]).with_columns(
        pl.lit(None, dtype=pl.Float32).alias("numeric_value"))
    people = stays.sort("intime").unique("subject_id", keep="first")
    static = pl.concat([
        people.select("subject_id", pl.datetime(pl.col("intime").dt.year() - pl.col("anchor_age"), 1, 1)
                      .alias("time"), pl.lit("MEDS_BIRTH").alias("code")),
        people.select("subject_id", pl.lit(None, dtype=pl.Datetime("us")).alias("time"),
                      (pl.lit("GENDER//") + pl.col("gender")).alias("code"))]).with_columns(
        pl.lit(None, dtype=pl.Float32).alias("numeric_value"))
    allrows = pl.concat([body, icu.with_columns(pl.col("time").cast(pl.Datetime("us"))),
                         static.with_columns(pl.col("time").cast(pl.Datetime("us")))])
    (out / "data" / "train").mkdir(parents=True)
    (out / "metadata").mkdir()
    for k, part in enumerate((allrows.filter(pl.col("subject_id") % 2 == r) for r in (0, 1))):
        part.sort("subject_id", "time", nulls_last=False).write_parquet(out / "data" / "train" / f"{k}.parquet")
    (out / "metadata" / "dataset.json").write_text(json.dumps({"dataset_name": "etl-shaped", "meds_version": "0.4"}))
    return out


def test_the_store_is_a_valid_meds_dataset(ws):
    assert validate_dataset(ws.store) == []
    assert len(shard_files(ws.store)) > 1
    meta = json.loads((ws.store / meds.dataset_metadata_filepath).read_text())
    assert meta["etl_name"] == "forgetful" and meta["meds_version"] == meds.__version__
    splits = pl.read_parquet(ws.store / meds.subject_splits_filepath)
    assert set(splits["split"]) == {meds.train_split, meds.held_out_split}
    assert splits["subject_id"].n_unique() == splits.height == scan_events(ws.store).select(
        pl.col("subject_id").n_unique()).collect().item()
    for shard in shard_files(ws.store):            # MEDS: a subject in one shard, contiguous and in time order
        frame = pl.read_parquet(shard)
        assert frame.equals(frame.sort("subject_id", "time", "code", "event_hash", "occurrence"))
        # the random event hashes are written plain and uncompressed (nothing to gain, a write's time to lose)
        columns = pq.ParquetFile(shard).metadata.row_group(0)
        chunks = {columns.column(i).path_in_schema: columns.column(i) for i in range(columns.num_columns)}
        assert chunks["event_hash"].compression == "UNCOMPRESSED"
        assert not any("DICTIONARY" in e for e in chunks["event_hash"].encodings)
        assert chunks["code"].compression == "SNAPPY" and any("DICTIONARY" in e for e in chunks["code"].encodings)
    codes = pl.read_parquet(ws.store / meds.code_metadata_filepath)
    assert codes["code"].n_unique() == codes.height and codes["count"].sum() == scan_events(ws.store).select(
        pl.len()).collect().item()
    # a code several tables write names one of them, the same whatever order the shards were read in
    first = scan_events(ws.store).group_by("code").agg(pl.col("source_table").min()).collect()
    assert codes.select("code", "source_table").sort("code").equals(first.sort("code"))


def test_a_shard_spliced_with_some_subjects_rows_is_the_file_a_sort_of_the_whole_shard_gives(ws, tmp_path):
    """A night's new rows rewrite a shard by splicing: the changed subjects' rows (old and new, sorted) put in
    their place among the others' rows as they were. Subjects first, last, between two others and new at both
    ends give the same rows in the same order as sorting the whole shard, with the shard's schema, write
    options and row groups."""
    import duckdb

    from pipeline.meds import EVENT_COLUMNS, EVENT_SCHEMA, ROW_GROUP_ROWS, SHARD_ORDER, splice_shard, write_shard
    cols = ", ".join(EVENT_COLUMNS)
    con = duckdb.connect()
    shard = tmp_path / "all.parquet"        # the store's subjects in one shard
    write_shard(con, f"SELECT {cols} FROM read_parquet('{ws.store / 'data' / '*.parquet'}') ORDER BY {SHARD_ORDER}",
                shard)
    ids = pl.read_parquet(shard, columns=["subject_id"])["subject_id"].unique().sort().to_list()
    assert len(ids) >= 5
    new = f"""SELECT * REPLACE (time + INTERVAL 1 MINUTE AS time, md5(event_hash) AS event_hash,
                               CASE WHEN subject_id = {ids[1]} THEN {ids[0] - 1}
                                    WHEN subject_id = {ids[2]} THEN {ids[-1] + 7} ELSE subject_id END AS subject_id)
              FROM read_parquet('{shard}') WHERE subject_id IN ({ids[0]}, {ids[1]}, {ids[2]}, {ids[-1]})
                                             AND hash(event_hash) % 3 = 0"""
    con.execute(f"CREATE TABLE numbered AS {new}")
    touched = [r[0] for r in con.execute("SELECT DISTINCT subject_id FROM numbered").fetchall()]
    assert {ids[0] - 1, ids[0], ids[-1], ids[-1] + 7} <= set(touched)
    spliced, whole = tmp_path / "spliced.parquet", tmp_path / "whole.parquet"
    shutil.copyfile(shard, spliced)
    splice_shard(con, spliced, touched, f"SELECT {cols} FROM read_parquet('{shard}') WHERE subject_id IN "
                                        f"({', '.join(map(str, touched))}) UNION ALL SELECT {cols} FROM numbered")
    write_shard(con, f"SELECT * FROM (SELECT {cols} FROM read_parquet('{shard}') UNION ALL SELECT {cols} FROM "
                     f"numbered) ORDER BY {SHARD_ORDER}", whole)
    a, b = pq.read_table(spliced), pq.read_table(whole)
    assert a.schema == b.schema == EVENT_SCHEMA and a.num_rows > pq.ParquetFile(shard).metadata.num_rows
    assert a.equals(b)
    meta = pq.ParquetFile(spliced).metadata
    assert all(meta.row_group(i).num_rows <= ROW_GROUP_ROWS for i in range(meta.num_row_groups))
    hashes = {meta.row_group(0).column(i).path_in_schema: meta.row_group(0).column(i)
              for i in range(meta.row_group(0).num_columns)}["event_hash"]
    assert hashes.compression == "UNCOMPRESSED"


def test_a_shard_writer_writes_in_the_background_what_a_write_here_gives_and_raises_a_failed_write(ws, tmp_path):
    """Extraction hands each shard to a ShardWriter (its write overlaps the next shard's work): the files are
    the ones written at once, every pending write is done when it closes, and a write that fails is raised
    (at the next put or at close), not lost; under an error of the caller's own, the caller's is raised."""
    from pipeline.meds import ShardWriter, write_shard_table
    tables = [pq.read_table(f) for f in sorted((ws.store / "data").glob("*.parquet"))[:3]]
    with ShardWriter() as writer:
        for i, t in enumerate(tables):
            writer.put(t, tmp_path / "bg" / f"{i}.parquet")
    for i, t in enumerate(tables):
        write_shard_table(t, tmp_path / "here" / f"{i}.parquet")
        assert (tmp_path / "bg" / f"{i}.parquet").read_bytes() == (tmp_path / "here" / f"{i}.parquet").read_bytes()
    blocked = tmp_path / "a file"
    blocked.write_text("not a folder")
    with pytest.raises(OSError):
        with ShardWriter() as writer:
            writer.put(tables[0], blocked / "0.parquet")
    with pytest.raises(OSError):
        with ShardWriter() as writer:
            writer.put(tables[0], blocked / "0.parquet")
            writer.put(tables[1], tmp_path / "later.parquet")
    assert not (tmp_path / "later.parquet").exists()
    with pytest.raises(KeyError, match="the caller's"):
        with ShardWriter() as writer:
            writer.put(tables[0], blocked / "0.parquet")
            raise KeyError("the caller's")


def test_runs_write_meds_label_files_and_a_deletion_rewrites_them(ws, tmp_path):
    files = sorted(ws.labels.glob("*.parquet"))
    assert {f.stem for f in files} == set(load_config().labels)
    for f in files:
        table = pq.read_table(f)
        meds.LabelSchema.validate(table)
        assert table.num_rows > 0
    stays = pl.read_parquet(ws.store / "stays.parquet")
    first = pl.read_parquet(files[0]).join(stays.select("subject_id", "intime").group_by("subject_id").min(),
                                           on="subject_id")
    # each token's label is dated at the end of its hour, after the stay began
    assert (first["prediction_time"] > first["intime"]).all()
    copy = Workspace(shutil.copytree(ws.root, tmp_path / "copy"))
    sid = int(pl.read_parquet(files[0])["subject_id"][0])
    cert, _ = delete_subject(copy, sid)
    assert cert.removed["label_rows"] > 0 and not any(scan_subject(copy, sid)[0].values())
    assert cert.residual_scan["rows_remaining"] == 0 and "labels" in cert.residual_scan["scanned"]
    for f in sorted(copy.labels.glob("*.parquet")):
        assert sid not in pl.read_parquet(f)["subject_id"].to_list()
    assert sid not in pl.read_parquet(copy.store / meds.subject_splits_filepath)["subject_id"].to_list()
    assert validate_dataset(copy.store) == []


def test_a_meds_dataset_runs_end_to_end_like_the_csv_source(ws, tmp_path):
    src = _as_etl(ws.store, tmp_path / "etl")
    out = tmp_path / "store"
    summary = extract(src, out, stay_codes=MedsStayCodes.from_spec(MEDS_CONFIG.section("meds_source")))
    assert validate_dataset(out) == []
    stays, mine = pl.read_parquet(out / "stays.parquet"), pl.read_parquet(ws.store / "stays.parquet")
    assert stays.height == mine.height
    assert stays.select("subject_id", "intime", "outtime", "gender").sort("subject_id", "intime").equals(
        mine.select("subject_id", "intime", "outtime", "gender").sort("subject_id", "intime"))
    events = scan_events(out).collect()
    assert summary.total_events == events.height and events.filter(pl.col("code").str.starts_with("GENDER//")) \
        .height == mine["subject_id"].n_unique()        # static events (no time) are kept
    assert events.filter(pl.col("code").str.starts_with("LAB//220045//"))["stay_id"].null_count() == 0
    # the same tokens, labels and streams as the CSV source's under the default config
    ours, _, ours_summary = prepare_token_streams(ws.store, load_config())
    theirs, _, theirs_summary = prepare_token_streams(out, MEDS_CONFIG, labels_dir=tmp_path / "labels")
    assert theirs_summary["tokens"] == ours_summary["tokens"] and len(theirs) == len(ours)
    for name in load_config().labels:
        if name != "rare_items":     # rare codes depend on the code vocabulary, which differs by construction
            assert theirs_summary[f"eval_tokens_{name}"] == ours_summary[f"eval_tokens_{name}"], name
    again = extract(src, out, stay_codes=MedsStayCodes.from_spec(MEDS_CONFIG.section("meds_source")))
    assert again.new_events == 0 and all(t.get("skipped") for t in again.tables.values())


def test_a_meds_source_s_code_metadata_gives_descriptions_and_may_omit_its_optional_columns(ws, tmp_path):
    src = _as_etl(ws.store, tmp_path / "etl")
    pl.DataFrame({"code": ["MEDS_BIRTH"], "description": ["born"], "parent_codes": [["SNOMED/3950001"]]}) \
        .write_parquet(src / meds.code_metadata_filepath)
    extract(src, tmp_path / "full", stay_codes=MedsStayCodes.from_spec(MEDS_CONFIG.section("meds_source")))
    codes = pl.read_parquet(tmp_path / "full" / meds.code_metadata_filepath)
    assert codes.filter(pl.col("code") == "MEDS_BIRTH").select("description", "parent_codes").rows() == [
        ("born", ["SNOMED/3950001"])]
    pl.DataFrame({"code": ["MEDS_BIRTH"]}).write_parquet(src / meds.code_metadata_filepath)   # code only
    extract(src, tmp_path / "bare", stay_codes=MedsStayCodes.from_spec(MEDS_CONFIG.section("meds_source")))
    assert validate_dataset(tmp_path / "bare") == []


def test_a_meds_source_missing_its_metadata_or_with_a_wrong_type_is_named(ws, tmp_path):
    src = _as_etl(ws.store, tmp_path / "etl")
    (src / "metadata" / "dataset.json").unlink()
    with pytest.raises(ExtractionError, match=r"etl: a MEDS dataset needs metadata/dataset.json"):
        extract(src, tmp_path / "o1")
    assert not (tmp_path / "o1").exists()
    (src / "metadata" / "dataset.json").write_text(json.dumps({"dataset_name": "x"}))
    shard = src / "data" / "train" / "0.parquet"
    pl.read_parquet(shard).with_columns(pl.col("subject_id").cast(pl.String)).write_parquet(shard)
    with pytest.raises(ExtractionError, match=r"0.parquet: column 'subject_id' is (string|large_string), MEDS "
                                              r"wants int64"):
        extract(src, tmp_path / "o2")
    assert not (tmp_path / "o2").exists()
    shard.write_bytes(shard.read_bytes()[:200])                      # a truncated copy
    with pytest.raises(ExtractionError, match=r"0.parquet: not a readable parquet file"):
        extract(src, tmp_path / "o3")
    assert not (tmp_path / "o3").exists()


def test_aces_style_predicates_match_codes_and_values():
    frame = pl.DataFrame({"code": ["LAB//220045//bpm", "LAB//220045//UNK", "CHART//220045", "LAB//50813//mmol/L"],
                          "numeric_value": [120.0, 65.0, 64.0, 4.5]})
    assert frame.filter(code_expr({"regex": "^LAB//220045//"}))["numeric_value"].to_list() == [120.0, 65.0]
    assert frame.filter(code_expr({"any": ["CHART//220045", {"regex": "50813"}]})).height == 2
    assert frame.filter(code_expr(["CHART//220045"]) | code_expr("LAB//220045//bpm")).height == 2
    assert matching_codes([{"regex": "^LAB//"}, "ABSENT"], frame["code"].to_list()) == [
        "ABSENT", "LAB//220045//UNK", "LAB//220045//bpm", "LAB//50813//mmol/L"]
    bounds = {"value_min": 65, "value_max": 120, "value_max_inclusive": False}
    assert frame.filter(value_expr(bounds))["numeric_value"].to_list() == [65.0]
    assert frame.filter(value_expr({"below": 65}))["numeric_value"].to_list() == [64.0, 4.5]


@pytest.mark.skipif(not DEMO.exists(), reason="shared/data/mimic-iv-demo is not present on this machine")
def test_the_demo_store_validates_with_meds_and_follows_its_conventions(tmp_path):
    extract(DEMO, tmp_path / "store")
    assert validate_dataset(tmp_path / "store") == []
    events = pl.scan_parquet(shard_files(tmp_path / "store"))
    # an empty source field is a null text value, never "" (meds_reader's verify rejects "")
    assert events.filter(pl.col("text_value") == "").select(pl.len()).collect().item() == 0
    assert events.filter(pl.col("text_value").is_not_null()).select(pl.len()).collect().item() > 0
    # every death is MEDS_DEATH (ACES's `code: MEDS_DEATH` finds them all); a date of death alone says so in text
    deaths = events.filter(pl.col("code").str.contains("DEATH")).group_by("code", "text_value").len().collect()
    assert set(deaths["code"]) == {meds.death_code}
    assert set(deaths["text_value"]) == {None, DEATH_DATE_ONLY}


@pytest.mark.slow
@pytest.mark.skipif(not DEMO.exists(), reason="shared/data/mimic-iv-demo is not present on this machine")
@pytest.mark.skipif(shutil.which("meds_reader_verify", path=str(Path(sys.executable).parent)) is None,
                    reason="meds_reader is not installed (pip install meds_reader)")
def test_meds_reader_converts_and_verifies_the_demo_store(tmp_path):
    extract(DEMO, tmp_path / "store")
    bin_dir = Path(sys.executable).parent
    subprocess.run([bin_dir / "meds_reader_convert", tmp_path / "store", tmp_path / "db", "--num_threads", "2"],
                   check=True, capture_output=True)
    verify = subprocess.run([bin_dir / "meds_reader_verify", tmp_path / "store", tmp_path / "db"],
                            capture_output=True, text=True)
    assert verify.returncode == 0 and "Test passed" in verify.stdout + verify.stderr, verify.stderr[-2000:]


def test_derived_stay_ids_that_would_collide_are_refused_and_nothing_is_written(tmp_path):
    t0 = datetime(2150, 1, 1)
    times = [t0 + timedelta(days=k) for k in range(1000)]
    src = meds_dataset(tmp_path / "many", pl.DataFrame(
        {"subject_id": [7] * 2000, "time": times + [t + timedelta(hours=1) for t in times],
         "code": ["ICU_ADMISSION//MICU"] * 1000 + ["ICU_DISCHARGE//MICU"] * 1000}).with_columns(
        pl.col("time").cast(pl.Datetime("us"))))
    with pytest.raises(ExtractionError, match="1,000 or more ICU admissions"):
        extract(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_meds_stay_without_a_discharge_is_quarantined_with_its_reason_and_the_rest_extracted(tmp_path):
    """Such stays used to reject the whole dataset, in MIMIC's words ("unparsable or missing intime/outtime")."""
    t0 = datetime(2150, 1, 1)
    rows = [(1, t0, "ICU_ADMISSION//MICU"), (1, t0 + timedelta(hours=20), "ICU_DISCHARGE//MICU"),
            (1, t0 + timedelta(hours=2), "LAB//220045//bpm"),
            (2, t0, "ICU_ADMISSION//SICU"), (2, t0 + timedelta(hours=3), "LAB//220045//bpm")]   # never discharged
    src = meds_dataset(tmp_path / "meds", pl.DataFrame(
        rows, schema={"subject_id": pl.Int64, "time": pl.Datetime("us"), "code": pl.String}, orient="row"))
    summary = extract(src, tmp_path / "store")
    stays = pl.read_parquet(tmp_path / "store" / "stays.parquet")
    assert stays["subject_id"].to_list() == [1] and summary.new_events > 0
    assert quarantine_reasons(tmp_path / "store") == {ADMISSION_WITHOUT_DISCHARGE: 1}
