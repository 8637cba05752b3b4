"""Deletion without a Prefect server (the fast loop): a workspace built by the run's plain step functions."""
import json
import shutil

import polars as pl
import pytest

from cohorts.definitions import load_config
from cohorts.evaluation import run_sweep
from cohorts.runs import update_cohort_memory
from cohorts.streams import evaluation_streams
from memory.cohort import CohortMemory
from pipeline.deletion import AlreadyDeleted, delete_subject, resolve_subject, scan_subject
from pipeline.evidence import verify_certificate
from pipeline.extract import UnknownSubjectError, extract
from pipeline.generate import GeneratorConfig, generate
from pipeline.privacy import keyed_hash, load_key
from pipeline.workspace import Workspace


@pytest.fixture(scope="module")
def plain_ws(tmp_path_factory):
    """extract -> events-mode sweep (results) -> cohort memory, from the workspace's own generated source."""
    ws = Workspace(tmp_path_factory.mktemp("plain"))
    generate(ws.source, GeneratorConfig(n_patients=12, seed=4))
    extract(ws.source, ws.store, key=load_key(ws.root))
    streams, _ = evaluation_streams(ws.store, load_config(), max_events=120)
    ws.results.parent.mkdir(parents=True)
    pl.DataFrame(run_sweep(streams, budgets=(8,), fractions=(), workers=1)).write_parquet(ws.results)
    update_cohort_memory(ws, budget=24, tokens="events")
    return ws


def a_copy(ws, dest):
    shutil.copytree(ws.root, dest)
    return Workspace(dest)


def held_subject(ws):
    cm = CohortMemory.load(ws.checkpoints()[-1])
    return next(s for s in sorted(pl.read_parquet(ws.results)["subject_id"].unique()) if cm.tokens_of(s))


@pytest.mark.parametrize("mode", ["decrement", "replay"])
def test_a_deletion_removes_every_row_and_its_certificate_verifies(plain_ws, tmp_path, mode):
    ws = a_copy(plain_ws, tmp_path / "ws")
    sid = held_subject(ws)
    cert, path = delete_subject(ws, sid, mode=mode)
    assert not any(scan_subject(ws, sid)[0].values()) and verify_certificate(path) == []
    assert cert["removed"]["source_rows"] > 0 and cert["residual_scan"]["rows_remaining"] == 0
    assert all(v["passed"] for v in cert["verification"].values())
    with pytest.raises(AlreadyDeleted):
        delete_subject(ws, sid)
    # the workspace's own source no longer holds the patient, and a re-extraction does not bring them back
    extract(ws.source, ws.store, key=load_key(ws.root))
    assert not any(scan_subject(ws, sid)[0].values())


def test_a_request_travels_as_the_keyed_hash(plain_ws, tmp_path):
    ws = a_copy(plain_ws, tmp_path / "ws")
    sid = held_subject(ws)
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
    ws = a_copy(plain_ws, tmp_path / "ws")
    subjects = sorted(pl.read_parquet(ws.results)["subject_id"].unique())
    delete_subject(ws, subjects[0])
    entry = json.loads(ws.ledger.read_text())
    ws.ledger.write_text(json.dumps(entry | {"certificate_sha256": "0" * 64}, separators=(",", ":")) + "\n")
    from pipeline.deletion import DeletionFailed
    with pytest.raises(DeletionFailed, match="log fails verification"):
        delete_subject(ws, subjects[1])
    assert any(scan_subject(ws, subjects[1])[0].values())       # nothing was deleted
