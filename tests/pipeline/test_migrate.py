"""Workspaces that outlive a release: a workspace of the first format (events/ buckets, an unsigned hash-chain
ledger) and one of the second (DEATH codes, empty text values, raw ids in results) are migrated, every command
on an old workspace says to migrate, and a migrated workspace keeps its evidence and takes new deletions."""
import gzip
import hashlib
import json
import shutil

import polars as pl
import pytest

from deletion import delete_subject
from flows.cli import main
from pipeline.evidence import LEDGER, read_log, verify_certificate
from pipeline.extract import extract
from pipeline.extract_rules import DEATH_CODE, DEATH_DATE_ONLY, LEGACY_DEATH_DATE_CODE
from pipeline.generate import GeneratorConfig, generate
from pipeline.meds import code_tables_path, codes_metadata_path, shard_files
from pipeline.migrate import FORMAT, FORMAT_FILE, LEGACY_LEDGER, MigrationError, check_format, migrate, store_format
from pipeline.privacy import load_key
from pipeline.sharding import SHARDING_FILE, Sharding
from pipeline.workspace import Workspace

OLD_CODES = {"MEDS_DEATH": "DEATH", "MEDS_DEATH//DOD": "DEATH//DOD"}
DATE_ONLY = (pl.col("code") == DEATH_CODE) & (pl.col("text_value") == DEATH_DATE_ONLY)


def _format_3(frame: pl.DataFrame) -> pl.DataFrame:
    """Events as format 3 coded them: a date of death alone as MEDS_DEATH//DOD with no text."""
    return frame.with_columns(pl.when(DATE_ONLY).then(pl.lit(LEGACY_DEATH_DATE_CODE)).otherwise(pl.col("code"))
                              .alias("code"),
                              pl.when(DATE_ONLY).then(pl.lit(None)).otherwise(pl.col("text_value")).alias("text_value"))


@pytest.fixture(scope="module")
def current(tmp_path_factory):
    root = tmp_path_factory.mktemp("migrate")
    source = generate(root / "source", GeneratorConfig(n_patients=16, seed=5))   # with deaths
    _death_after_discharge(source)
    ws = Workspace(root / "current")
    extract(source, ws.store, key=load_key())
    return source, ws


def _death_after_discharge(source):
    """A surviving patient's date of death, after discharge (patients.dod alone, as MIMIC-IV records deaths
    outside the hospital): the generated data has in-hospital deaths only."""
    path = next((source / "hosp").glob("patients.csv*"))
    patients = pl.read_csv(path, infer_schema_length=0)
    first = patients.with_row_index().filter(pl.col("dod").is_null() | (pl.col("dod") == ""))["index"][0]
    patients = patients.with_columns(pl.when(pl.int_range(pl.len()) == first).then(pl.lit("2199-12-31"))
                                     .otherwise(pl.col("dod")).alias("dod"))
    text = patients.write_csv()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)


def _old_events(ws):
    """The store's events as the old releases wrote them: death under its old codes, "" for empty text."""
    return (_format_3(pl.read_parquet(shard_files(ws.store)))
            .with_columns(pl.col("code").replace(OLD_CODES),
                          pl.when(pl.col("code").str.starts_with("TRANSFER//")).then(pl.lit(""))
                          .otherwise(pl.col("text_value")).alias("text_value")))


def _hash_chain_ledger(root, n):
    """``n`` certificates under the first releases' unsigned ledger (sha256(prev + digest + seq) chained)."""
    (root / "certificates").mkdir(parents=True)
    prev, lines = "0" * 64, []
    for i in range(n):
        text = json.dumps({"certificate_id": i, "subject_hash": f"{i:064x}", "mode": "decrement"},
                          sort_keys=True, separators=(",", ":"))
        (root / "certificates" / f"{i:06d}.json").write_text(text)
        digest = hashlib.sha256(text.encode()).hexdigest()
        entry_hash = hashlib.sha256((prev + digest + str(i)).encode()).hexdigest()
        lines.append(json.dumps({"seq": i, "certificate": f"{i:06d}.json", "certificate_sha256": digest,
                                 "prev": prev, "entry_hash": entry_hash}, sort_keys=True))
        prev = entry_hash
    (root / LEDGER).write_text("\n".join(lines) + "\n")


def _without_format_5_files(store):
    """A store as releases before format 5 left it: no recorded shard count, no code counts per table."""
    (store / SHARDING_FILE).unlink()
    code_tables_path(store).unlink()


def format_1(current, dest):
    """A workspace as the first releases left it: events/bucket=K/run-*.parquet, store/codes.parquet, an
    unsigned ledger with two certificates."""
    _, ws = current
    shutil.copytree(ws.store, dest / "store")
    _without_format_5_files(dest / "store")
    old = _old_events(ws)
    for (k,), part in old.with_columns((pl.col("subject_id") % 16).alias("bucket")).group_by(["bucket"]):
        d = dest / "store" / "events" / f"bucket={k}"
        d.mkdir(parents=True)
        part.drop("bucket").write_parquet(d / "run-20261101T000000-0.parquet")
    codes = pl.read_parquet(codes_metadata_path(ws.store)).with_columns(pl.col("code").replace(OLD_CODES))
    dod = old.filter(pl.col("code") == "DEATH//DOD").height
    codes = pl.concat([codes.with_columns(pl.when(pl.col("code") == "DEATH").then(pl.col("count") - dod)
                                          .otherwise(pl.col("count")).alias("count")),
                       codes.filter(pl.col("code") == "DEATH").with_columns(pl.lit("DEATH//DOD").alias("code"),
                                                                          pl.lit(dod, dtype=pl.UInt32).alias("count")
                                                                          .cast(codes.schema["count"]))])
    codes.select("code", "description", "source_table", "count").write_parquet(dest / "store" / "codes.parquet")
    shutil.rmtree(dest / "store" / "data")
    shutil.rmtree(dest / "store" / "metadata")
    (dest / "store" / FORMAT_FILE).unlink()
    _hash_chain_ledger(dest, 2)
    return Workspace(dest)


def test_every_command_on_an_old_workspace_says_to_migrate(current, tmp_path, capsys):
    ws = format_1(current, tmp_path / "old")
    assert store_format(ws.store) == 1
    with pytest.raises(MigrationError, match="forgetful migrate"):
        check_format(ws.store)
    for argv in (["run", "--out", str(ws.root)], ["delete", "--out", str(ws.root), "--subject-id", "1"],
                 ["verify", str(ws.certificates / "000000.json")],
                 ["extract", "--source", str(current[0]), "--out", str(ws.store)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "run `forgetful migrate" in err and err.count("\n") == 1, argv


def test_a_first_format_workspace_migrates_keeping_its_events_and_evidence(current, tmp_path):
    source, ws_now = current
    ws = format_1(current, tmp_path / "old")
    legacy = {f.name: f.read_bytes() for f in ws.certificates.glob("*.json")} | {LEDGER: ws.ledger.read_bytes()}
    old = pl.read_parquet(sorted(ws.store.glob("events/*/*.parquet")))
    assert old.filter(pl.col("text_value") == "").height and old.filter(pl.col("code") == "DEATH").height
    steps = migrate(ws.root)
    assert store_format(ws.store) == FORMAT and any("sealed" in s for s in steps)
    # the events, now MEDS shards with this release's conventions, equal a fresh extraction's
    order = ["subject_id", "time", "code", "event_hash", "occurrence"]
    migrated = pl.read_parquet(shard_files(ws.store)).sort(order)
    assert migrated.equals(pl.read_parquet(shard_files(ws_now.store)).sort(order))
    assert migrated.filter(pl.col("text_value") == "").height == 0
    assert pl.read_parquet(codes_metadata_path(ws.store)).filter(pl.col("code").str.starts_with("DEATH")).height == 0
    # the old ledger and certificates are kept byte for byte, and sealed by the signed log's first entry
    assert (ws.root / LEGACY_LEDGER).read_bytes() == legacy[LEDGER]
    for name in ("000000.json", "000001.json"):
        assert (ws.certificates / "legacy-v1" / name).read_bytes() == legacy[name]
    seal = json.loads((ws.certificates / "000000.json").read_text())
    assert seal["kind"] == "migration" and seal["legacy_entries"] == 2
    assert seal["legacy_certificates"]["legacy-v1/000001.json"] == hashlib.sha256(legacy["000001.json"]).hexdigest()
    assert read_log(ws.root).problems == [] and verify_certificate(ws.certificates / "000000.json") == []
    # the source read again adds nothing (event hashes read death under its old name), and deletions append
    assert extract(source, ws.store, key=load_key()).new_events == 0
    sid = pl.read_parquet(ws.store / "stays.parquet")["subject_id"][0]
    cert, path = delete_subject(ws, sid, mode="replay")
    assert path.name == "000001.json" and verify_certificate(path) == []
    assert migrate(ws.root) == [f"already format {FORMAT}"]


def test_an_edited_hash_chain_ledger_is_not_sealed(current, tmp_path):
    ws = format_1(current, tmp_path / "old")
    lines = ws.ledger.read_text().splitlines()
    e = json.loads(lines[1]) | {"certificate_sha256": "0" * 64}
    ws.ledger.write_text("\n".join([lines[0], json.dumps(e, sort_keys=True)]) + "\n")
    with pytest.raises(MigrationError, match="breaks the hash chain"):
        migrate(ws.root)


def test_a_second_format_workspace_migrates_its_conventions_and_raw_ids(current, tmp_path):
    _, ws_now = current
    ws = Workspace(tmp_path / "v2")
    shutil.copytree(ws_now.store, ws.store)
    _without_format_5_files(ws.store)
    for f in shard_files(ws.store):
        _format_3(pl.read_parquet(f)).with_columns(pl.col("code").replace(OLD_CODES)).write_parquet(f)
    (ws.store / FORMAT_FILE).unlink()
    stays = pl.read_parquet(ws.store / "stays.parquet")
    ws.results.parent.mkdir(parents=True)
    stays.select("stay_id", "subject_id", pl.lit(0.5).alias("value")).write_parquet(ws.results)
    (ws.root / "cache" / "tokens" / "0").mkdir(parents=True)
    assert store_format(ws.store) == 2
    migrate(ws.root)
    assert store_format(ws.store) == FORMAT and not (ws.root / "cache").exists()
    assert set(pl.read_parquet(ws.results).columns) == {"stay_ref", "subject_ref", "value"}
    assert pl.read_parquet(shard_files(ws.store)).sort(pl.all()).equals(
        pl.read_parquet(shard_files(ws_now.store)).sort(pl.all()))


def test_a_third_format_store_codes_every_death_meds_death(current, tmp_path):
    """Format 3 coded a date of death alone MEDS_DEATH//DOD, which ACES's `code: MEDS_DEATH` does not match."""
    source, ws_now = current
    ws = Workspace(tmp_path / "v3")
    shutil.copytree(ws_now.store, ws.store)
    _without_format_5_files(ws.store)
    for f in shard_files(ws.store):
        _format_3(pl.read_parquet(f)).write_parquet(f)
    (ws.store / FORMAT_FILE).write_text(json.dumps({"format": 3}))
    assert pl.read_parquet(shard_files(ws.store)).filter(pl.col("code") == LEGACY_DEATH_DATE_CODE).height
    steps = migrate(ws.root)
    assert store_format(ws.store) == FORMAT and any("MEDS_DEATH//DOD" in s for s in steps)
    order = ["subject_id", "time", "code", "event_hash", "occurrence"]
    assert pl.read_parquet(shard_files(ws.store)).sort(order).equals(
        pl.read_parquet(shard_files(ws_now.store)).sort(order))
    assert extract(source, ws.store, key=load_key()).new_events == 0     # the rows it holds are recognised


def test_a_fourth_format_store_records_its_sixteen_shards_and_counts_codes_per_table(current, tmp_path):
    """Format 4's stores have 16 shards, recorded nowhere; the migration records the count (the shards stay as
    they are) and counts the codes per table, which a deletion then updates by subtraction."""
    source, ws_now = current
    ws = Workspace(tmp_path / "v4")
    shutil.copytree(ws_now.store, ws.store)
    _without_format_5_files(ws.store)
    (ws.store / FORMAT_FILE).write_text(json.dumps({"format": 4}))
    shards = {f.name: f.read_bytes() for f in shard_files(ws.store)}
    with pytest.raises(MigrationError, match="forgetful migrate"):
        check_format(ws.store)
    steps = migrate(ws.root)
    assert store_format(ws.store) == FORMAT and any("shard count (16)" in s for s in steps)
    assert Sharding.of_store(ws.store) == Sharding(16)
    assert {f.name: f.read_bytes() for f in shard_files(ws.store)} == shards
    assert pl.read_parquet(code_tables_path(ws.store)).equals(pl.read_parquet(code_tables_path(ws_now.store)))
    assert extract(source, ws.store, key=load_key()).new_events == 0
