"""Deletion equals never having seen the patient: a run on the full source followed by ``delete --mode replay``
leaves every derived artifact as a run on the source without the patient makes it, for a training-split and an
evaluation-split patient. Decrement states, and measures, what it leaves different."""
import gzip
import json
import shutil

import numpy as np
import polars as pl
import pytest

from cohorts.definitions import install_config, is_eval_subject, resolve_config, workspace_config
from deletion import DeletionFailed, delete_subject, delete_subjects
from deletion.compare import RUN_BOOKKEEPING, compare_workspaces, json_leaves
from memory.cohort import CohortMemory, owner_of
from pipeline.extract import extract
from pipeline.generate import GeneratorConfig, generate
from pipeline.evidence import TrustAnchor, load_signing_key, public_hex, verify_certificate
from pipeline.meds import shard_files
from pipeline.privacy import keyed_hash, load_key, stay_ref, subject_ref
from pipeline.sharding import Sharding
from pipeline.workspace import Workspace
from reports.html import render_report
from run.cohort_memory import update_cohort_memory
from run.evaluate import evaluate, in_process_map
from run.params import RunParams
from tests.workspaces import copy_ws, scored_subjects

PARAMS = RunParams(budgets=(8, 32), fractions=(0.1,), cohort_budget=24, chunk_stays=4, source="the generator")


def run(ws):
    """The scheduled run's evaluation (hourly tokens), cohort memory and report, as the flow runs them (without
    Prefect), its parameters saved with the workspace as the flow saves them."""
    cfg = workspace_config(ws.root)
    PARAMS.save(ws.run_params)
    result = evaluate(ws, PARAMS, in_process_map, cfg)
    memory = update_cohort_memory(ws, cfg, budget=PARAMS.cohort_budget, tokens=PARAMS.tokens)
    render_report(result.with_metadata(cohort_memory=memory), ws.root)


def without(source, dest, sids):
    """A copy of the source with none of the subjects' rows in any table."""
    gone = {str(s) for s in sids}
    for f in sorted(source.rglob("*.csv.gz")):
        out = dest / f.relative_to(source)
        out.parent.mkdir(parents=True, exist_ok=True)
        lines = gzip.decompress(f.read_bytes()).decode().splitlines()
        head = lines[0].split(",")
        if "subject_id" in head:
            col = head.index("subject_id")
            lines = [lines[0]] + [r for r in lines[1:] if r.split(",")[col] not in gone]
        out.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    return dest


def assert_equal_workspaces(a, b):
    """Store rows, stays, MEDS metadata and label files, per-stay results and memories exactly; token statistics,
    the cohort memory's token ids and weights (1e-12) and every number of report.json but the run's bookkeeping."""
    assert [d for d in compare_workspaces(a, b, atol=1e-12) if not d.equal] == []


def never_saw(source, tmp_path, sids, config=None):
    """A workspace run on the source without the subjects (with ``config`` installed when given)."""
    never = Workspace(tmp_path / "never")
    if config is not None:
        install_config(never.root, str(config))
    extract(without(source, tmp_path / "source-without", sids), never.store, key=load_key())
    run(never)
    return never


def first_subject(ws, eval_split):
    """The workspace's first subject (by id) of the evaluation split, or of the training split."""
    cfg = workspace_config(ws.root)
    return next(s for s in pl.read_parquet(ws.store / "stays.parquet")["subject_id"].unique().sort().to_list()
                if is_eval_subject(s, cfg) == eval_split)


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    root = tmp_path_factory.mktemp("never-saw")
    source = generate(root / "source", GeneratorConfig(n_patients=16, seed=5))
    ws = Workspace(root / "full")
    extract(source, ws.store, key=load_key())
    run(ws)
    return source, ws


@pytest.mark.slow
@pytest.mark.parametrize("split", ["train", "eval"])
def test_replay_leaves_what_a_run_that_never_saw_the_patient_makes(full, tmp_path, split):
    source, ws = full
    sid = first_subject(ws, split == "eval")
    deleted = copy_ws(ws, tmp_path / "deleted")
    cert, _ = delete_subject(deleted, sid, mode="replay")
    assert cert.never_saw_equivalence["not_equal"] == [] and cert.artifacts_marked_stale == []
    assert "rare-item vocabulary" in cert.recomputed_without_the_patient
    assert_equal_workspaces(deleted, never_saw(source, tmp_path, [sid]))


@pytest.mark.slow
def test_one_replay_of_several_patients_of_both_splits_leaves_what_a_run_that_never_saw_any_makes(full, tmp_path):
    source, ws = full
    cfg = workspace_config(ws.root)
    subjects = pl.read_parquet(ws.store / "stays.parquet")["subject_id"].unique().sort().to_list()
    sids = [s for s in subjects if is_eval_subject(s, cfg)][:2] + \
        [s for s in subjects if not is_eval_subject(s, cfg)][:2]
    deleted = copy_ws(ws, tmp_path / "deleted")
    gone = {stay_ref(s, load_key()) for s in pl.read_parquet(ws.store / "stays.parquet")
            .filter(pl.col("subject_id").is_in(sids))["stay_id"].to_list()}
    cached = {k for f in ws.cache.glob("index/*.json") for r, k in json.loads(f.read_text())["keys"].items()
              if r in gone}
    issued = delete_subjects(deleted, sids, mode="replay")
    assert len(issued) == 4 and len({path for _, path in issued}) == 4
    for (cert, path), sid in zip(issued, sorted(sids)):
        assert cert.subject_hash == keyed_hash(sid, load_key()) and cert.deleted_together["patients"] == 4
        assert verify_certificate(path, None, TrustAnchor(public_hex(load_signing_key(deleted.root)), "test")) == []
    assert_equal_workspaces(deleted, never_saw(source, tmp_path, sids))
    # their shards of the per-stay caches were compacted, not dropped: no entry of their stays is left
    left = {k for kind in ("tokens", "facts", "fired", "codes") for p in (deleted.cache / kind).glob("*/*.parquet")
            for k in pl.read_parquet(p, columns=["key"])["key"].to_list()}
    assert cached and not cached & left and left


@pytest.mark.slow
def test_with_scaling_fitted_to_the_training_split_replay_refits_it_and_replays_the_memory_under_it(full, tmp_path):
    source, _ = full
    fitted = tmp_path / "fitted.yaml"
    fitted.write_text(resolve_config(None).read_text().replace("scaling: reference", "scaling: training_split"))
    ws = Workspace(tmp_path / "full")
    install_config(ws.root, str(fitted))
    extract(source, ws.store, key=load_key())
    run(ws)
    sid = first_subject(ws, eval_split=False)
    before = json.loads((ws.checkpoints()[-1] / "token_scaling.json").read_text())
    delete_subject(ws, sid, mode="replay")
    assert json.loads((ws.checkpoints()[-1] / "token_scaling.json").read_text()) != before
    assert_equal_workspaces(ws, never_saw(source, tmp_path, [sid], config=fitted))


@pytest.mark.slow
def test_decrement_states_what_it_leaves_different_and_measures_the_memory_s_distance(full, tmp_path):
    source, ws = full
    deleted = copy_ws(ws, tmp_path / "deleted")
    owners = {owner_of(t) for t in CohortMemory.load(ws.checkpoints()[-1]).memory.token_ids()}
    sid = next(s for s in pl.read_parquet(ws.store / "stays.parquet")["subject_id"].unique().sort().to_list()
               if subject_ref(s, load_key()) in owners)
    try:
        cert, _ = delete_subject(deleted, sid, mode="decrement")
    except Exception as e:          # the fixed-C memory may be unable to lose that many tokens
        pytest.skip(f"decrement refused here: {e}")
    scope = cert.never_saw_equivalence
    assert scope["not_equal"] and any("cohort memory" in x for x in scope["not_equal"])
    difference = next(v["never_saw_difference"] for v in cert.verification.values() if "never_saw_difference" in v)
    assert difference["probe_queries"] > 0 and np.isfinite(difference["max_output_deviation"])
    assert cert.artifacts_marked_stale
    shutil.rmtree(deleted.root)


@pytest.mark.slow
def test_replay_starts_from_the_latest_snapshot_before_the_patient_and_equals_a_run_that_never_saw_them(
        full, tmp_path, monkeypatch):
    from run import cohort_memory
    monkeypatch.setattr(cohort_memory, "SNAPSHOT_MIN_TOKENS", 64)       # snapshots even in a small cohort
    monkeypatch.setattr(cohort_memory, "FEED_BLOCK", 32)
    source, _ = full
    ws = Workspace(tmp_path / "snapped")
    extract(source, ws.store, key=load_key())
    run(ws)
    assert len(ws.snapshots()) >= 4
    cfg, ckpt = workspace_config(ws.root), ws.checkpoints()[-1]
    rows = cohort_memory.CohortRows(ws, "hourly", cohort_memory.load_scaler(ckpt), cfg)
    first = {s: min(rows.of_subjects({s})[0]) for s in pl.read_parquet(ws.store / "stays.parquet")["subject_id"]
             .unique().to_list() if rows.of_subjects({s})[0]}
    sid = max(first, key=first.get)                 # their first row comes last: a late snapshot never saw them
    decremented = copy_ws(ws, tmp_path / "decremented")
    try:
        cert, _ = delete_subject(decremented, sid, mode="decrement", compare_with_replay=False)
        assert cert.residual_scan["rows_remaining"] == 0
        assert all(CohortMemory.load(s).watermark < first[sid] for s in decremented.snapshots())
    except DeletionFailed as e:     # the fixed-C memory may be unable to lose that many tokens
        assert "use mode 'replay'" in str(e)
    cert, _ = delete_subject(ws, sid, mode="replay")
    (check,) = cert.verification.values()
    assert check["replayed_from"].startswith("snapshot ") and check["passed"]
    for s in ws.snapshots():                        # what is left never saw them; the re-feed wrote new ones
        assert CohortMemory.load(s).watermark < first[sid] or not CohortMemory.load(s).tokens_of(
            subject_ref(sid, load_key()))
    assert_equal_workspaces(ws, never_saw(source, tmp_path, [sid]))


@pytest.mark.slow
def test_a_replay_keeps_the_content_keys_of_the_other_stays_of_the_patients_shards(tmp_path, monkeypatch):
    """Patients who share their shards with others: the deletion's rerun carries those others' content keys over
    (their events are the same rows) instead of reading the shards' events again, and ends with the keys a run
    that never saw the patients computes."""
    import run.token_run as token_run
    source = generate(tmp_path / "source", GeneratorConfig(n_patients=24, seed=6))
    ws = Workspace(tmp_path / "full")
    extract(source, ws.store, key=load_key())
    run(ws)
    stays = pl.read_parquet(ws.store / "stays.parquet")
    shared = (stays.group_by((pl.col("subject_id") % 16).alias("shard")).agg(pl.col("subject_id").unique().sort())
              .filter(pl.col("subject_id").list.len() > 1).sort("shard")["subject_id"].to_list())
    sids = [group[0] for group in shared[:2]]
    assert len(sids) == 2
    digested = []
    real = token_run.stay_digests
    monkeypatch.setattr(token_run, "stay_digests", lambda events, chunk: digested.append(chunk.height) or
                        real(events, chunk))
    delete_subjects(ws, sids, mode="replay")
    assert digested == []
    never = never_saw(source, tmp_path, sids)
    assert_equal_workspaces(ws, never)
    keys = {f.name: json.loads(f.read_text())["keys"] for f in sorted(ws.cache.glob("index/*.json"))}
    assert keys == {f.name: json.loads(f.read_text())["keys"] for f in sorted(never.cache.glob("index/*.json"))}


@pytest.mark.slow
def test_a_store_of_many_shards_runs_and_deletes_as_one_of_sixteen(full, tmp_path, monkeypatch):
    """The shard count grows with the source (pipeline.sharding): a store made with 64 shards holds the same
    events and its run makes the same artifacts as the 16-shard one; a batch replay on it rewrites only the
    patients' shards and equals a run that never saw them (whose smaller source may get fewer shards)."""
    source, ws16 = full
    size = sum(f.stat().st_size for f in source.rglob("*.csv.gz"))
    monkeypatch.setattr("pipeline.sharding.SOURCE_BYTES_PER_SHARD", size // 40)
    ws = Workspace(tmp_path / "many")
    extract(source, ws.store, key=load_key())
    assert Sharding.of_store(ws.store) == Sharding(64) and Sharding.of_store(ws16.store) == Sharding(16)
    run(ws)
    assert_equal_workspaces(ws, ws16)
    cfg = workspace_config(ws.root)
    subjects = pl.read_parquet(ws.store / "stays.parquet")["subject_id"].unique().sort().to_list()
    sids = [next(s for s in subjects if is_eval_subject(s, cfg)), next(s for s in subjects
                                                                      if not is_eval_subject(s, cfg))]
    before = {f.name: f.stat().st_mtime_ns for f in shard_files(ws.store)}
    delete_subjects(ws, sids, mode="replay")
    touched = {f"{s % 64}.parquet" for s in sids}
    assert {n for n, t in before.items() if not (ws.store / "data" / n).exists()
            or (ws.store / "data" / n).stat().st_mtime_ns != t} <= touched
    assert_equal_workspaces(ws, never_saw(source, tmp_path, sids))


def test_a_replay_of_an_evaluation_patient_rescores_no_other_stay(full, tmp_path):
    """The training split is unchanged, so the rare vocabulary, the streaming setting and the scaling are: the
    rerun over the deletion's view finds every other stay's scores and memory file (looked up in the workspace,
    not linked into the view) and rewrites none of them."""
    source, base = full
    ws = copy_ws(base, tmp_path / "ws")
    sid = scored_subjects(ws)[0]                    # an evaluation patient with per-stay memories
    before = {f.name: f.stat().st_mtime_ns for f in ws.stay_memories.glob("*.npz")}
    cert, _ = delete_subject(ws, sid, mode="replay")
    after = {f.name: f.stat().st_mtime_ns for f in ws.stay_memories.glob("*.npz")}
    assert cert.removed["per_stay_memories"] > 0
    assert len(after) == len(before) - cert.removed["per_stay_memories"]
    assert after == {name: t for name, t in before.items() if name in after}


@pytest.mark.slow
def test_after_a_store_loss_and_a_rebuild_from_the_source_the_run_is_one_that_never_saw_the_patient(full, tmp_path):
    """The audit's case: with the store lost, a rebuild from the source (which still holds the patient) brought
    the deleted patient back while their certificate still verified. The workspace's list and the certificate
    keep them out; the run after the rebuild is the never-saw run."""
    source, ws = full
    sid = first_subject(ws, eval_split=True)
    deleted = copy_ws(ws, tmp_path / "deleted")
    _, path = delete_subject(deleted, sid, mode="replay")
    shutil.rmtree(deleted.store)
    rebuilt = extract(source, deleted.store, key=load_key())
    assert rebuilt.suppressed_rows > 0 and rebuilt.suppressed_certificates == path.name
    run(deleted)
    never = never_saw(source, tmp_path, [sid])
    # a rerun: the cohort memory (equal, compared above) is fed nothing new, where the never-saw run fed it all
    assert [d.artifact for d in compare_workspaces(deleted, never, atol=1e-12) if not d.equal] in \
        ([], ["report.json numbers"])
    assert json_leaves("report", deleted.report_json, never.report_json, 1e-12,
                   skip=RUN_BOOKKEEPING | {"fed"}, numbers_only=True).differing == 0
    assert verify_certificate(path, None, TrustAnchor(public_hex(load_signing_key(deleted.root)), "test")) == []


@pytest.mark.slow
def test_a_store_restored_from_a_backup_older_than_a_deletion_loses_the_patient_again(full, tmp_path):
    from deletion import reapply_deletions, scan_subject
    source, ws = full
    sid = first_subject(ws, eval_split=False)
    deleted = copy_ws(ws, tmp_path / "deleted")
    backup = tmp_path / "store-backup"
    shutil.copytree(deleted.store, backup)
    _, path = delete_subject(deleted, sid, mode="replay")
    shutil.rmtree(deleted.store)
    shutil.copytree(backup, deleted.store)             # the older store, the patient's rows in it
    assert scan_subject(deleted, sid)[0]["events"] > 0
    again = reapply_deletions(deleted)
    assert again.subjects == 1 and again.rows > 0 and again.certificates == path.name
    assert not any(scan_subject(deleted, sid)[0].values())
    assert reapply_deletions(deleted) is None       # the store's own list is whole again
    assert verify_certificate(path, None, TrustAnchor(public_hex(load_signing_key(deleted.root)), "test")) == []
