"""Deletion without a Prefect server (the fast loop): a workspace built by the run's plain step functions."""
import json
import shutil

import polars as pl
import pytest

from cohorts.definitions import build_cohort, load_config
from cohorts.evaluation import run_sweep
from run.cohort_memory import update_cohort_memory
from run.steps import save_results
from cohorts.streams import evaluation_streams
from deletion import AlreadyDeleted, DeletionFailed, delete_subject, resolve_subject, scan_subject
from memory.cohort import CohortMemory
from pipeline.evidence import verify_certificate
from pipeline.extract import extract, staging_dir
from pipeline.store_reader import UnknownSubjectError
from pipeline.generate import GeneratorConfig, generate
from pipeline.meds import code_tables_path
from pipeline.privacy import keyed_hash, load_key
from pipeline.workspace import Workspace
from tests.workspaces import copy_ws, ref, scored_subjects, subject_with_memory_tokens


@pytest.fixture(scope="module")
def plain_ws(tmp_path_factory):
    """extract -> events-mode sweep (results) -> cohort memory, from the workspace's own generated source."""
    ws = Workspace(tmp_path_factory.mktemp("plain"))
    generate(ws.source, GeneratorConfig(n_patients=12, seed=4))
    extract(ws.source, ws.store, key=load_key(ws.root))
    streams, _ = evaluation_streams(ws.store, load_config(), max_events=120)
    save_results(ws, run_sweep(streams, budgets=(8,), fractions=(), workers=1))
    update_cohort_memory(ws, budget=24, tokens="events")
    return ws


@pytest.mark.parametrize("mode", ["decrement", "replay"])
def test_a_deletion_removes_every_row_and_its_certificate_verifies(plain_ws, tmp_path, mode):
    ws = copy_ws(plain_ws, tmp_path / "ws")
    sid = subject_with_memory_tokens(ws)
    cert, path = delete_subject(ws, sid, mode=mode)
    assert not any(scan_subject(ws, sid)[0].values()) and verify_certificate(path) == []
    assert cert.removed["source_rows"] > 0 and cert.residual_scan["rows_remaining"] == 0
    assert all(v["passed"] for v in cert.verification.values())
    with pytest.raises(AlreadyDeleted):
        delete_subject(ws, sid)
    # the workspace's own source no longer holds the patient, and a re-extraction does not bring them back
    extract(ws.source, ws.store, key=load_key(ws.root))
    assert not any(scan_subject(ws, sid)[0].values())


def test_an_interrupted_extraction_s_staged_rows_and_spill_files_go_with_a_deletion(plain_ws, tmp_path):
    ws = copy_ws(plain_ws, tmp_path / "ws")
    sid = subject_with_memory_tokens(ws)
    staged = staging_dir(ws.store) / "file-0" / "bucket=0"
    staged.mkdir(parents=True)
    shutil.copyfile(next(ws.store.glob("data/*.parquet")), staged / "rows_x.parquet")   # patients' rows, by id
    (ws.store / ".work" / "spill").mkdir()
    (ws.store / ".work" / "spill" / "duckdb_temp_block-1.block").write_bytes(b"spilled rows")
    cert, _ = delete_subject(ws, sid)
    assert cert.residual_scan["rows_remaining"] == 0
    assert not staging_dir(ws.store).exists() and not (ws.store / ".work" / "spill").exists()


def test_a_request_travels_as_the_keyed_hash(plain_ws, tmp_path):
    ws = copy_ws(plain_ws, tmp_path / "ws")
    sid = subject_with_memory_tokens(ws)
    h = keyed_hash(sid, load_key(ws.root))
    assert resolve_subject(ws, h) == sid
    delete_subject(ws, sid)
    with pytest.raises(AlreadyDeleted) as e:
        resolve_subject(ws, h)
    assert str(sid) not in str(e.value)
    with pytest.raises(UnknownSubjectError) as e:
        resolve_subject(ws, "0" * 64)
    assert "000000000000..." in str(e.value)


def test_a_broken_log_is_never_appended_to(plain_ws, tmp_path):
    ws = copy_ws(plain_ws, tmp_path / "ws")
    subjects = scored_subjects(ws)
    delete_subject(ws, subjects[0])
    entry = json.loads(ws.ledger.read_text())
    ws.ledger.write_text(json.dumps(entry | {"certificate_sha256": "0" * 64}, separators=(",", ":")) + "\n")
    with pytest.raises(DeletionFailed, match="log fails verification"):
        delete_subject(ws, subjects[1])
    assert any(scan_subject(ws, subjects[1])[0].values())       # nothing was deleted


def _append_late_rows(ws, at=0.0):
    """Chart rows dated inside an early stay (``at``: that far into the cohort's chart rows in time) but arriving
    after the memory was fed (a late-charted batch)."""
    import gzip
    path = ws.source / "icu" / "chartevents.csv.gz"
    lines = gzip.decompress(path.read_bytes()).decode().splitlines()
    head = lines[0].split(",")
    t, v, st = head.index("charttime"), head.index("valuenum"), head.index("stay_id")
    cohort = {str(s) for s in build_cohort(ws.store, load_config())["stay_id"]}
    rows = sorted((f for f in (r.split(",") for r in lines[1:]) if f[st] in cohort), key=lambda f: f[t])
    rows = rows[int(at * len(rows)):][:5]
    for f in rows:
        f[v] = f"{float(f[v] or 0) + 0.5:g}"          # a new content hash: a new row, not a repeat
    path.write_bytes(gzip.compress(("\n".join(lines + [",".join(f) for f in rows]) + "\n").encode()))


def test_rows_arriving_late_rebuild_the_cohort_memory_as_if_they_had_come_in_order(plain_ws, tmp_path):
    from run.cohort_memory import load_scaler
    from cohorts.streams import cohort_stream
    ws = copy_ws(plain_ws, tmp_path / "ws")
    again = update_cohort_memory(ws, budget=24, tokens="events")
    assert again["fed"] == 0 and again["history"] == {"checked": True, "changed_before_watermark": False}
    watermark = CohortMemory.load(ws.checkpoints()[-1]).watermark
    _append_late_rows(ws)
    assert extract(ws.source, ws.store, key=load_key(ws.root)).new_events == 5
    info = update_cohort_memory(ws, budget=24, tokens="events")
    assert info["history"]["changed_before_watermark"] and info["history"]["rebuilt_from"] == "empty memory"
    rebuilt = CohortMemory.load(ws.checkpoints()[-1])
    _, keys, ids, order, _ = cohort_stream(ws.store, load_config(), "events", load_key(),
                                           scaler=load_scaler(ws.checkpoints()[-1]))
    assert sum(o <= watermark for o in order) > 0
    fresh = CohortMemory(budget=24, gamma=rebuilt.gamma)
    fresh.feed(keys, ids, order)
    assert rebuilt.memory.state_digest() == fresh.memory.state_digest() and rebuilt.history == fresh.history


def test_rows_arriving_late_near_the_end_rebuild_from_the_latest_unchanged_snapshot(plain_ws, tmp_path,
                                                                                     monkeypatch):
    from run.cohort_memory import load_scaler
    from cohorts.streams import cohort_stream
    ws = copy_ws(plain_ws, tmp_path / "ws")
    shutil.rmtree(ws.cohort_memories)
    monkeypatch.setattr("run.cohort_memory.FEED_BLOCK", 64)              # snapshots every 1/16 of the feed
    monkeypatch.setattr("run.cohort_memory.SNAPSHOT_MIN_TOKENS", 64)
    update_cohort_memory(ws, budget=24, tokens="events")
    update_cohort_memory(ws, budget=24, tokens="events")                   # a second checkpoint, same history
    before = {s: CohortMemory.saved_watermark(s) for s in ws.snapshots()}
    assert len(before) >= 8
    _append_late_rows(ws, at=0.85)
    assert extract(ws.source, ws.store, key=load_key(ws.root)).new_events == 5
    _, keys, ids, order, _ = cohort_stream(ws.store, load_config(), "events", load_key(),
                                           scaler=load_scaler(ws.checkpoints()[-1]))
    info = update_cohort_memory(ws, budget=24, tokens="events")
    assert info["history"]["changed_before_watermark"]
    base = ws.cohort_memories / info["history"]["rebuilt_from"]
    assert base.parent.parent == ws.cohort_snapshots and info["fed"] < len(order) // 4
    # the snapshots fed only rows before the late ones stay bases; the later ones are gone
    kept = [s for s in before if s.exists()]
    assert base in kept and all(before[s] <= before[base] for s in kept) and len(kept) < len(before)
    rebuilt = CohortMemory.load(ws.checkpoints()[-1])
    fresh = CohortMemory(budget=24, gamma=rebuilt.gamma)
    fresh.feed(keys, ids, order)
    assert rebuilt.memory.state_digest() == fresh.memory.state_digest() and rebuilt.history == fresh.history


def test_nightly_runs_keep_the_newest_checkpoints_of_a_stream_mode_only(plain_ws, tmp_path, monkeypatch):
    from run.cohort_memory import checkpoint_tokens
    ws = copy_ws(plain_ws, tmp_path / "ws")
    monkeypatch.setattr("run.cohort_memory.CHECKPOINTS_KEPT", 3)
    first = ws.checkpoints()
    state = CohortMemory.load(first[-1]).memory.state_digest()
    for _ in range(4):
        update_cohort_memory(ws, budget=24, tokens="events")
    kept = ws.checkpoints()
    assert len(kept) == 3 and not any(c.exists() for c in first)
    assert CohortMemory.load(kept[-1]).memory.state_digest() == state
    update_cohort_memory(ws, budget=24, tokens="hourly")        # the other mode's history is its own
    assert [checkpoint_tokens(c).value for c in ws.checkpoints()] == ["events"] * 3 + ["hourly"]


@pytest.mark.parametrize("mode", ["decrement", "replay"])
def test_after_a_deletion_the_next_run_finds_the_history_unchanged(plain_ws, tmp_path, mode):
    ws = copy_ws(plain_ws, tmp_path / "ws")
    subjects = scored_subjects(ws)
    held = subject_with_memory_tokens(ws)
    evicted = next(s for s in subjects if s != held and not CohortMemory.load(ws.checkpoints()[-1]).tokens_of(ref(s)))
    for sid in (held, evicted):                       # one with tokens in the memory, one fed and evicted
        delete_subject(ws, sid, mode=mode)
    info = update_cohort_memory(ws, budget=24, tokens="events")
    assert info["history"] == {"checked": True, "changed_before_watermark": False} and info["fed"] == 0


def test_a_new_cohort_memory_claims_no_history_check(plain_ws, tmp_path):
    ws = copy_ws(plain_ws, tmp_path / "ws")
    shutil.rmtree(ws.cohort_checkpoints)
    assert update_cohort_memory(ws, budget=24, tokens="events")["history"] == {"checked": False, "new_memory": True}


def test_a_store_missing_its_code_counts_per_table_refuses_a_deletion_whole_and_extraction_recounts_them(
        plain_ws, tmp_path):
    """A deletion subtracts the patient's events from the code counts per table; without them it refuses (one
    message saying how to recount) and changes nothing; the next extraction counts them again."""
    ws = copy_ws(plain_ws, tmp_path / "ws")
    sid = subject_with_memory_tokens(ws)
    code_tables_path(ws.store).unlink()
    before = {p: p.read_bytes() for p in ws.root.rglob("*") if p.is_file() and ".lock" not in p.name}
    with pytest.raises(DeletionFailed, match="code_tables.parquet: missing.*forgetful extract"):
        delete_subject(ws, sid)
    assert {p: p.read_bytes() for p in ws.root.rglob("*") if p.is_file() and ".lock" not in p.name} == before
    extract(ws.source, ws.store, key=load_key(ws.root))
    counted = pl.read_parquet(code_tables_path(ws.store))
    assert counted.equals(pl.read_parquet(code_tables_path(plain_ws.store)))
    delete_subject(ws, sid)
    mine = pl.read_parquet(code_tables_path(ws.store))
    assert mine["count"].sum() == counted["count"].sum() - \
        pl.read_parquet(plain_ws.store / "data").filter(pl.col("subject_id") == sid).height


def test_a_lost_store_and_its_regenerated_data_keep_the_deleted_patient_out(plain_ws, tmp_path):
    """The workspace's copy of the embedded data, generated anew after it was lost with the store, holds the
    deleted patient again: their rows are removed from it, and the rebuilt store never holds them."""
    from deletion import reapply_to_generated_source
    ws = copy_ws(plain_ws, tmp_path / "ws")
    sid = subject_with_memory_tokens(ws)
    delete_subject(ws, sid, mode="decrement")
    shutil.rmtree(ws.store)
    shutil.rmtree(ws.source)
    generate(ws.source, GeneratorConfig(n_patients=12, seed=4))
    assert reapply_to_generated_source(ws) > 0
    assert reapply_to_generated_source(ws) == 0
    rebuilt = extract(ws.source, ws.store, key=load_key(ws.root))
    assert rebuilt.suppressed_rows == 0 and not any(scan_subject(ws, sid)[0].values())
    assert str(sid) not in {s for f in ws.source.rglob("patients.csv*")
                            for s in pl.read_csv(f, infer_schema=False)["subject_id"].to_list()}
