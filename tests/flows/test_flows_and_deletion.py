"""Prefect flows end to end on a real ephemeral server, certified deletion, tamper detection, crash safety."""
import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cohorts.definitions import workspace_config
from deletion import AlreadyDeleted, delete_subject, scan_subject
from memory.cohort import CohortMemory
from pipeline.certificate import Certificate
from pipeline.evidence import verify_certificate
from pipeline.store_reader import UnknownSubjectError
from pipeline.generate import GeneratorConfig, generate
from pipeline.locking import WorkspaceLocked, workspace_lock
from pipeline.privacy import keyed_hash, load_key
from pipeline.workspace import Workspace
from run.params import RunParams
from tests.workspaces import copy_ws, raw_id_hits, ref, scored_subjects, subject_with_memory_tokens

ROOT = Path(__file__).resolve().parents[2]
RUN = dict(budgets=(8, 16), fractions=(0.1,), cohort_budget=24, max_events=150, encoder_steps=20, tokens="events")


@pytest.fixture(scope="session")
def source(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("source"), GeneratorConfig(n_patients=14, seed=3))


@pytest.fixture(scope="session")
def workspace(prefect_server, source, tmp_path_factory):
    from flows.prefect_flows import scheduled_run
    root = tmp_path_factory.mktemp("ws")
    out = scheduled_run(root=str(root), source=str(source), **RUN)
    return Workspace(root), out


def hash_of(subject_id):
    """What the CLI hands the delete flow: the subject's keyed hash, never the raw id."""
    return keyed_hash(subject_id, load_key())


def test_scheduled_run_end_to_end(workspace):
    ws, out = workspace
    assert Path(out["report"]).exists() and ws.report_json.exists()
    data = json.loads(ws.report_json.read_text())
    assert {r["budget"] for r in data["summary"]} == {"8", "16", "f0.1"}
    assert data["metadata"]["cohort_memory"]["tokens"] <= 24
    assert "sv_learned" in {r["policy"] for r in data["summary"]} and ws.encoder.exists()
    assert ws.results.exists() and len(ws.checkpoints()) == 1
    assert any(ws.stay_memories.glob("*.npz"))
    text = ws.report_html.read_text()
    for sid in scored_subjects(ws):
        assert str(sid) not in text  # no identifiers in the report


def test_second_run_resumes_the_cohort_memory(workspace, source, tmp_path):
    from flows.prefect_flows import scheduled_run
    ws = copy_ws(workspace[0], tmp_path / "ws")
    before = CohortMemory.load(ws.checkpoints()[-1])
    out = scheduled_run(root=str(ws.root), source=str(source), **RUN)
    after = CohortMemory.load(ws.checkpoints()[-1])
    assert len(ws.checkpoints()) == 2
    assert out["result"].metadata["cohort_memory"]["fed"] == 0  # nothing new in the source
    assert after.memory.state_digest() == before.memory.state_digest()


def test_deletion_end_to_end_with_certificate(workspace, source, tmp_path):
    from flows.prefect_flows import delete_patients, ingest
    ws = copy_ws(workspace[0], tmp_path / "ws")
    sid = subject_with_memory_tokens(ws)
    found, _ = scan_subject(ws, sid)
    assert found["events"] > 0 and found["cohort_memory_tokens"] > 0
    (path,) = map(Path, delete_patients(str(ws.root), [hash_of(sid)])["certificates"])
    cert = Certificate.read(path)
    assert str(sid) not in path.read_text()  # only the keyed hash
    assert cert.mode == "decrement" and cert.residual_scan["rows_remaining"] == 0
    for v in cert.verification.values():
        assert v["passed"] and v["max_decision_deviation"] <= 1e-8 and v["nondegenerate_mismatches"] == 0
    assert sum(cert.removed["events_by_table"].values()) == found["events"]
    assert verify_certificate(path) == []
    after, _ = scan_subject(ws, sid)
    assert not any(after.values())
    assert json.loads(ws.report_json.read_text())["stale"]["certificates"] == [path.name]
    assert not ws.encoder.exists() and "learned_key_encoder" in cert.removed
    assert "Stale:" in ws.report_html.read_text()
    with pytest.raises(AlreadyDeleted, match="already deleted"):
        delete_subject(ws, sid)
    with pytest.raises(UnknownSubjectError, match="not in the workspace"):
        delete_subject(ws, 424242)
    # the source still holds the patient; an incremental run with new rows must not bring them back
    src = tmp_path / "src"
    shutil.copytree(source, src)
    p = src / "icu" / "chartevents.csv.gz"
    lines = gzip.open(p, "rt").read().splitlines()
    mine = [ln for ln in lines[1:] if ln.startswith(f"{sid},")][:3]
    with gzip.open(p, "wt") as fh:
        fh.write("\n".join(lines + [m.replace(",220045,", ",220210,") for m in mine]) + "\n")
    info = ingest(str(ws.root), RunParams(source=str(src)), workspace_config(ws.root))
    assert info["suppressed_rows"] > 0
    assert not any(scan_subject(ws, sid)[0].values())


def test_tampering_is_detected(workspace, tmp_path):
    ws = copy_ws(workspace[0], tmp_path / "ws")
    res = scored_subjects(ws)
    _, p1 = delete_subject(ws, res[0])
    _, p2 = delete_subject(ws, res[1])
    assert verify_certificate(p1) == [] and verify_certificate(p2) == []
    original = p1.read_text()
    p1.write_text(original.replace('"mode":"decrement"', '"mode":"replay"'))
    assert any("edited after it was issued" in m for m in verify_certificate(p2))
    p1.write_text(original)
    lines = ws.ledger.read_text().splitlines()
    ws.ledger.write_text(lines[1] + "\n")  # drop the first entry
    problems = verify_certificate(p2)
    assert any("dropped or reordered" in m or "does not chain" in m for m in problems)
    assert subprocess.run([sys.executable, "-m", "flows.cli", "verify", str(p2)], cwd=ROOT,
                          capture_output=True).returncode == 1


def test_replay_mode_equals_a_memory_that_never_saw_the_patient(workspace, tmp_path):
    from cohorts.definitions import load_config
    from cohorts.streams import cohort_event_stream
    from pipeline.keys import EventKeyer
    ws = copy_ws(workspace[0], tmp_path / "ws")
    sid = subject_with_memory_tokens(ws)
    ckpt = ws.checkpoints()[-1]
    keyer = EventKeyer.load(ckpt / "keyer.parquet")
    _, K, ids, order, subj = cohort_event_stream(ws.store, load_config(), load_key(), keyer=keyer)
    cert, path = delete_subject(ws, sid, mode="replay")
    assert cert.mode == "replay" and verify_certificate(path) == []
    fresh = CohortMemory(budget=24)
    keep = [i for i, s in enumerate(subj) if int(s) != sid]
    fresh.feed(K[keep], [ids[i] for i in keep], [order[i] for i in keep])
    replayed = CohortMemory.load(ws.checkpoints()[-1])
    assert replayed.memory.state_digest() == fresh.memory.state_digest()
    assert not replayed.tokens_of(ref(sid))


def test_a_deletion_refuses_while_a_run_holds_the_lock(workspace, tmp_path):
    ws = copy_ws(workspace[0], tmp_path / "ws")
    sid = scored_subjects(ws)[0]
    with workspace_lock(ws.root, purpose="scheduled run"):
        with pytest.raises(WorkspaceLocked, match="locked by another run"):
            delete_subject(ws, sid, wait_seconds=0.3)
    assert scan_subject(ws, sid)[0]["events"] > 0


def _state(ws):
    """Content of everything a deletion may touch (not the lock)."""
    out = {}
    for p in sorted(ws.root.rglob("*")):
        rel = p.relative_to(ws.root)
        if p.is_file() and rel.parts[0] not in (".txn", "source") and p.name != ".lock":
            out[str(rel)] = p.read_bytes()
    return out


CRASH_POINTS = ["staged_store", "staged_memories", "staged_certificate", "journal_written",
                "journal_half_applied", "committed"]


def _deletion_process(ws, sid):
    """A deletion in its own process that says 'ready' once imported, then its duration when done."""
    code = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); from deletion import delete_subject; "
            f"from pipeline.workspace import Workspace; print('ready', flush=True); t = time.perf_counter(); "
            f"delete_subject(Workspace({str(ws.root)!r}), {sid}); print(time.perf_counter() - t, flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.slow
def test_kills_at_random_moments_of_a_deletion_leave_the_full_old_or_new_state(workspace, tmp_path):
    import random
    import signal
    import time

    from pipeline.transaction import settle
    base = copy_ws(workspace[0], tmp_path / "base")
    sid = subject_with_memory_tokens(base)
    pre = _state(base)
    probe = _deletion_process(copy_ws(base, tmp_path / "probe"), sid)
    duration = float(probe.stdout.readline())
    assert probe.wait(timeout=120) == 0
    rng, outcomes = random.Random(7), []
    # one kill in each 24th of 1.2x the probe's duration, at a random moment there; on a machine that got slower
    # than the probe (every kill landed before the commit, once in a full suite), 8 more over 1.2x to 2.4x
    moments = [(k + rng.random()) / 24 * 1.2 for k in range(24)]
    for trial in range(32):
        if trial == 24 and "new" in outcomes:
            break
        ws = copy_ws(base, tmp_path / f"trial{trial}")
        proc = _deletion_process(ws, sid)
        time.sleep(duration * (moments[trial] if trial < 24 else 1.2 + (trial - 24 + rng.random()) / 8 * 1.2))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        settle(ws.root)
        if any(scan_subject(ws, sid)[0].values()):
            assert _state(ws) == pre, f"trial {trial}: the subject remains but the state is not the old one"
            outcomes.append("old")
        else:
            certs = sorted(ws.certificates.glob("*.json"))
            assert len(certs) == 1 and verify_certificate(certs[0]) == [], f"trial {trial}"
            outcomes.append("new")
        shutil.rmtree(ws.root)
    assert {"old", "new"} <= set(outcomes), outcomes     # the kills landed on both sides of the commit


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_crash_at_any_step_leaves_old_or_new_state_and_a_rerun_completes(workspace, tmp_path, point):
    ws = copy_ws(workspace[0], tmp_path / "ws")
    sid = subject_with_memory_tokens(ws)
    pre = _state(ws)
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from deletion import delete_subject; "
            f"from pipeline.workspace import Workspace; delete_subject(Workspace({str(ws.root)!r}), {sid})")
    env = dict(os.environ, FORGETFUL_CRASH_AT=point)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 137, proc.stderr
    if point in ("journal_written", "journal_half_applied", "committed"):
        # a reader is the first to come: `forgetful verify` finishes the interrupted change before it reads
        v = subprocess.run([sys.executable, "-m", "flows.cli", "verify", str(ws.certificates / "000000.json")],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert v.returncode == 0, v.stdout + v.stderr
    else:
        from pipeline.transaction import recover
        recover(ws.root)
    state = _state(ws)
    remaining = any(scan_subject(ws, sid)[0].values())
    if point in ("staged_store", "staged_memories", "staged_certificate"):
        assert state == pre and remaining  # rolled back: the full pre-deletion state
        cert, path = delete_subject(ws, sid)  # the rerun completes it
    else:
        assert not remaining  # rolled forward: the full post-deletion state
        with pytest.raises(AlreadyDeleted):
            delete_subject(ws, sid)
        path = ws.certificates / "000000.json"
    assert not any(scan_subject(ws, sid)[0].values())
    assert verify_certificate(path) == []
    assert len(ws.ledger.read_text().splitlines()) == 1


def test_dask_backed_run(prefect_server, source, tmp_path, monkeypatch):
    import run.evaluate
    from flows.prefect_flows import scheduled_run
    # this cohort's few stays would be scored in the flow's process: through the cluster here
    monkeypatch.setattr(run.evaluate, "IN_PROCESS_BELOW", 0)
    out = scheduled_run(root=str(tmp_path / "ws"), source=str(source), task_runner="dask", workers=2,
                        budgets=(8,), fractions=(), cohort_budget=16, max_events=80, encoder_steps=0)
    rows = json.loads(Path(tmp_path / "ws" / "report.json").read_text())["summary"]
    assert {r["policy"] for r in rows} >= {"sv_certified", "recency", "random"}
    assert Path(out["report"]).exists()


def test_certified_memory_states_survive_the_round_trip(workspace):
    ws, _ = workspace
    cm = CohortMemory.load(ws.checkpoints()[-1])
    if cm.memory.is_feasible:
        assert cm.memory.kkt_residual() <= 1e-10
    assert np.isfinite(cm.memory.rho_) or not cm.memory.is_feasible


def test_an_infeasible_decrement_changes_nothing_and_points_to_replay(workspace, tmp_path):
    from cohorts.definitions import load_config
    from cohorts.streams import cohort_event_stream
    from deletion import DeletionFailed
    from pipeline.keys import EventKeyer
    ws = copy_ws(workspace[0], tmp_path / "ws")
    ckpt = ws.checkpoints()[-1]
    keyer = EventKeyer.load(ckpt / "keyer.parquet")
    _, K, ids, order, subj = cohort_event_stream(ws.store, load_config(), load_key(), keyer=keyer)
    sid = int(subj[0])
    mine = [i for i, s in enumerate(subj) if int(s) == sid][:6]
    other = [i for i, s in enumerate(subj) if int(s) != sid][:2]
    pick = sorted(mine + other, key=lambda i: order[i])
    small = CohortMemory(budget=8)  # C = 1/4: at least 4 tokens must remain
    small.feed(K[pick], [ids[i] for i in pick], [order[i] for i in pick])
    small.save(ckpt)
    keyer.save(ckpt / "keyer.parquet")
    pre = _state(ws)
    with pytest.raises(DeletionFailed, match="use mode 'replay'"):
        delete_subject(ws, sid)
    assert _state(ws) == pre
    assert not any((ws.root / ".txn").glob("*"))  # the staged transaction was discarded
    cert, path = delete_subject(ws, sid, mode="replay")
    assert verify_certificate(path) == [] and not CohortMemory.load(ws.checkpoints()[-1]).tokens_of(ref(sid))


def test_serve_registers_the_scheduled_run_with_its_cron_schedule(prefect_server, tmp_path):
    import time

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL
    env = dict(os.environ, PREFECT_API_URL=PREFECT_API_URL.value())  # the harness's (configured) server
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--out", str(tmp_path / "ws"),
                             "--cron", "15 4 * * *", "--budgets", "8", "--fractions", ""], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline, dep = time.monotonic() + 120, None
        while time.monotonic() < deadline and dep is None:
            time.sleep(2)
            with get_client(sync_client=True) as client:
                try:
                    dep = client.read_deployment_by_name("forgetful-scheduled-run/forgetful-scheduled")
                except Exception:  # not registered yet
                    dep = None
        assert dep is not None, proc.stdout.read1().decode() if proc.poll() is not None else "serve did not register"
        assert [s.schedule.cron for s in dep.schedules] == ["15 4 * * *"]
        assert dep.parameters["budgets"] == [8]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
def test_cli_run_without_a_configured_server_shares_one_and_exits(tmp_path):
    """The README's first command path: no PREFECT_API_URL. One temporary server serves the flow and its
    process-pool workers, and the process exits once Prefect's services have drained into it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_LOGGING"))}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "--verbose", "run", "--out", str(tmp_path / "ws"),
                           "--budgets", "8", "--fractions", "", "--max-events", "60", "--encoder-steps", "0",
                           "--cohort-budget", "16", "--workers", "2"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=420, check=False)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    assert (tmp_path / "ws" / "report.html").exists()
    assert log.count("The command's temporary API server answers at") == 1, log[-3000:]
    assert "Starting temporary server" not in log, log[-3000:]     # no worker started one of Prefect's own


@pytest.fixture(scope="session")
def token_workspace(prefect_server, source, tmp_path_factory):
    from flows.prefect_flows import scheduled_run
    root = tmp_path_factory.mktemp("ws-hourly")
    out = scheduled_run(root=str(root), source=str(source), budgets=(8, 16), fractions=(0.1,), cohort_budget=24)
    return Workspace(root), out


@pytest.mark.slow
def test_token_mode_run_reports_both_protocols(token_workspace):
    from run.cohort_memory import checkpoint_tokens
    ws, out = token_workspace
    data = json.loads(ws.report_json.read_text())
    rows = data["summary"]
    assert {r["protocol"] for r in rows} == {"fixed_context", "streaming"} and {r["tokens"] for r in rows} == {"hourly"}
    assert {"composite_vitals", "heldout_spo2", "clinical_criteria"} <= {r["label"] for r in rows}
    assert {r["budget"] for r in rows if r["protocol"] == "fixed_context"} == {"k"}
    assert {r["budget"] for r in rows if r["protocol"] == "streaming"} == {"8", "16", "f0.1"}
    assert {r["keys"] for r in rows if r["label"] == "heldout_spo2"} == {"without_spo2"}
    assert "h2o_proxy" in {r["policy"] for r in rows} and "sv_learned" not in {r["policy"] for r in rows}
    assert not ws.encoder.exists()   # the learned-key encoder learns event keys: not trained in token mode
    assert [checkpoint_tokens(c) for c in ws.checkpoints()] == ["hourly"]
    assert any(ws.stay_memories.glob("*.npz"))
    assert data["metadata"]["streaming_selection_grid"] and "nu_B" in data["metadata"]["sv_rule"]
    text = ws.report_html.read_text()
    assert '<section id="headline">' in text
    for sid in scored_subjects(ws):
        assert str(sid) not in text



@pytest.mark.slow
def test_token_mode_deletion_decrement_and_replay(token_workspace, tmp_path):
    from cohorts.definitions import load_config
    from run.cohort_memory import load_scaler
    from cohorts.streams import cohort_stream
    ws = copy_ws(token_workspace[0], tmp_path / "dec")
    sid = subject_with_memory_tokens(ws)
    cert, path = delete_subject(ws, sid)
    assert verify_certificate(path) == [] and cert.residual_scan["rows_remaining"] == 0
    assert all(v["passed"] for v in cert.verification.values())
    assert sum(cert.removed["cohort_memory_tokens"].values()) > 0
    assert not any(scan_subject(ws, sid)[0].values())

    ws = copy_ws(token_workspace[0], tmp_path / "rep")
    ckpt = ws.checkpoints()[-1]
    _, K, ids, order, subj = cohort_stream(ws.store, load_config(), "hourly", load_key(), scaler=load_scaler(ckpt))
    cert, path = delete_subject(ws, sid, mode="replay")
    assert cert.mode == "replay" and verify_certificate(path) == []
    fresh = CohortMemory(budget=24, gamma=CohortMemory.load(ckpt).gamma)
    keep = [i for i, s in enumerate(subj) if int(s) != sid]
    fresh.feed(K[keep], [ids[i] for i in keep], [order[i] for i in keep])
    replayed = CohortMemory.load(ws.checkpoints()[-1])
    assert replayed.memory.state_digest() == fresh.memory.state_digest() and not replayed.tokens_of(ref(sid))
    assert (ws.checkpoints()[-1] / "token_scaling.json").exists()


@pytest.mark.slow
def test_deleting_twice_is_a_completed_no_op_flow_run(token_workspace, tmp_path):
    from flows.prefect_flows import delete_patients
    ws = copy_ws(token_workspace[0], tmp_path / "twice")
    sid = subject_with_memory_tokens(ws)
    first = delete_patients(str(ws.root), [hash_of(sid)])
    assert Path(first["certificates"][0]).exists()
    state = delete_patients(str(ws.root), [hash_of(sid)], return_state=True)
    assert state.is_completed()
    again = state.result()
    assert "already deleted" in again["already_deleted"] and str(sid) not in again["already_deleted"]
    assert len(list(ws.certificates.glob("*.json"))) == 1
    cli = subprocess.run([sys.executable, "-m", "flows.cli", "delete", "--out", str(ws.root), "--subject-id",
                          str(sid)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0 and "nothing to do" in cli.stdout and "Traceback" not in cli.stderr
    unknown = subprocess.run([sys.executable, "-m", "flows.cli", "delete", "--out", str(ws.root), "--subject-id",
                              "424242"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert unknown.returncode == 2 and unknown.stderr.strip().startswith("forgetful: error:")
    assert "Traceback" not in unknown.stderr


@pytest.mark.slow
def test_after_a_deletion_no_raw_id_is_anywhere_and_a_rerun_does_not_bring_the_patient_back(workspace, source,
                                                                                             tmp_path):
    """The delete flow, then a scan of every file of the workspace and of Prefect (home, database, result
    storage); a rerun on the unchanged source; a second request."""
    from prefect.settings import get_current_settings

    from flows.prefect_flows import delete_patients, refusal_reason, scheduled_run
    ws = copy_ws(workspace[0], tmp_path / "ws")
    shutil.copytree(source, ws.source)           # the workspace's own copy of the raw rows, as `make demo` has
    sid = subject_with_memory_tokens(ws)
    assert raw_id_hits(ws.root, {sid})             # the scanner finds the patient before the deletion
    assert Path(delete_patients(str(ws.root), [hash_of(sid)])["certificates"][0]).exists()
    settings = get_current_settings()
    db = Path(settings.server.database.connection_url.get_secret_value().split("///")[-1])
    places = [ws.root, Path(settings.home), db.parent, Path(settings.results.local_storage_path)]
    assert [h for p in places if p.exists() for h in raw_id_hits(p, {sid})] == []
    # control: a value handed to a flow does reach Prefect's database, and the scan finds it there
    assert "no subject" in refusal_reason(delete_patients(str(ws.root), ["987654321"], return_state=True))
    assert any(str(db.parent) in h for h in raw_id_hits(db.parent, {987654321}))
    scheduled_run(root=str(ws.root), source=str(source), **RUN)
    assert not any(scan_subject(ws, sid)[0].values())
    assert [h for p in places if p.exists() for h in raw_id_hits(p, {sid})] == []
    assert "already_deleted" in delete_patients(str(ws.root), [hash_of(sid)])
    assert len(list(ws.certificates.glob("*.json"))) == 1


@pytest.mark.slow
def test_a_batch_deletion_is_one_command_a_certificate_each_and_an_unknown_id_is_named(token_workspace, tmp_path):
    """`forgetful delete` with several ids: an unknown one refuses the whole request and is named; with
    --skip-unknown the rest are deleted in one transaction, each with a certificate that verifies alone; asking
    again is nothing to do."""
    from pipeline.evidence import TrustAnchor, load_signing_key, public_hex
    ws = copy_ws(token_workspace[0], tmp_path / "batch")
    first, second = scored_subjects(ws)[:2]
    cli = [sys.executable, "-m", "flows.cli", "delete", "--out", str(ws.root), "--mode", "replay"]

    def delete(*args):
        return subprocess.run(cli + list(args), cwd=ROOT, capture_output=True, text=True, timeout=600)
    refused = delete("--subject-id", str(first), "--subject-id", "424242")
    assert refused.returncode == 2 and "subject 424242" in refused.stderr and "--skip-unknown" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1 and not list(ws.certificates.glob("*.json"))
    ids = tmp_path / "ids.txt"
    ids.write_text(f"# this week's requests\n{first}\n\n{second}\n")
    done = delete("--subjects-file", str(ids), "--subject-id", "424242", "--skip-unknown")
    assert done.returncode == 0, done.stderr
    assert "skipped subject 424242" in done.stderr
    certs = sorted(ws.certificates.glob("*.json"))
    assert [c.name for c in certs] == ["000000.json", "000001.json"] and done.stdout.count("certificate: ") == 2
    anchor = TrustAnchor(public_hex(load_signing_key(ws.root)), "the test's signing key")
    for path, sid in zip(certs, (first, second)):
        cert = Certificate.read(path)
        assert cert.subject_hash == hash_of(sid) and cert.deleted_together["patients"] == 2
        assert verify_certificate(path, None, anchor) == []
        assert not any(scan_subject(ws, sid)[0].values())
    again = delete("--subject-id", str(first), "--subject-id", str(second))
    assert again.returncode == 0 and "nothing to do" in again.stdout


@pytest.mark.slow
def test_serve_takes_the_workspaces_deletion_requests_in_its_own_process(token_workspace, tmp_path):
    """`forgetful delete` beside a running `forgetful serve`: sent to that process (the same flow, run there), a
    refusal names the user's id, the certificate verifies; with the serving process gone the command runs it."""
    import time

    from prefect.settings import PREFECT_API_URL

    from flows.deletion_desk import DeletionRequest, submit
    ws = copy_ws(token_workspace[0], tmp_path / "served")
    first, second = scored_subjects(ws)[:2]
    env = dict(os.environ, PREFECT_API_URL=PREFECT_API_URL.value())   # the harness's (configured) server
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        serve = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--out", str(ws.root), "--cron",
                                  "0 2 29 2 *"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    cli = [sys.executable, "-m", "flows.cli", "delete", "--out", str(ws.root), "--mode", "replay"]

    def delete(*args):
        return subprocess.run(cli + list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    try:
        deadline = time.monotonic() + 180
        while "taken by this process" not in log.read_text() and time.monotonic() < deadline:
            assert serve.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
        refused = delete("--subject-id", str(first), "--subject-id", "424242")
        assert refused.returncode == 2 and "subject 424242" in refused.stderr, refused.stdout + refused.stderr
        assert "sent to the process serving" in refused.stdout and not list(ws.certificates.glob("*.json"))
        done = delete("--subject-id", str(first))
        assert done.returncode == 0 and "sent to the process serving" in done.stdout, done.stdout + done.stderr
        assert done.stdout.count("certificate: ") == 1
        assert verify_certificate(ws.certificates / "000000.json") == [] and not any(scan_subject(ws, first)[0].values())
        again = delete("--subject-id", str(first))
        assert again.returncode == 0 and "nothing to do" in again.stdout
        # a request the command line would not let through (a mode it does not know): refused by the desk before
        # any flow sees it, in one line with exit status 2, and the desk goes on
        failed = submit(ws, DeletionRequest((hash_of(second),), mode="bogus"))
        assert failed.failure.startswith("the deletion request is malformed") and failed.failure_status == 2
        assert any(scan_subject(ws, second)[0].values())          # nothing of them was deleted
    finally:
        serve.terminate()
        serve.wait(timeout=60)
    alone = delete("--subject-id", str(second))
    assert alone.returncode == 0 and "sent to" not in alone.stdout, alone.stdout + alone.stderr
    assert verify_certificate(ws.certificates / "000001.json") == [] and not any(scan_subject(ws, second)[0].values())
    assert not raw_id_hits(ws.root, [first, second])


def test_a_lost_store_never_brings_a_deleted_patient_back(workspace, source, tmp_path, capsys):
    """The audit's case: with WS/store removed, every command said "written by an earlier release ... run forgetful
    migrate first", and `migrate` then `run` re-ingested the deleted patient while their certificate verified."""
    from flows.cli import main
    from flows.prefect_flows import delete_patients, scheduled_run
    from pipeline.evidence import load_signing_key, public_hex
    ws = copy_ws(workspace[0], tmp_path / "ws")
    sid = subject_with_memory_tokens(ws)
    cert = Path(delete_patients(str(ws.root), [hash_of(sid)])["certificates"][0])
    auditor = tmp_path / "auditor"             # what an auditor keeps: the log, its checkpoint, the certificates
    shutil.copytree(ws.certificates, auditor / "certificates")
    for f in ("ledger.jsonl", "checkpoint.json"):
        shutil.copy(ws.root / f, auditor / f)
    shutil.rmtree(ws.store)
    key = public_hex(load_signing_key(ws.root))
    assert main(["verify", str(auditor / "certificates" / cert.name), "--public-key", key]) == 0
    assert main(["migrate", str(ws.root)]) == 0
    assert "nothing to migrate" in capsys.readouterr().out
    out = scheduled_run(root=str(ws.root), source=str(source), **RUN)
    assert not any(scan_subject(ws, sid)[0].values())
    ingest = out["result"].metadata["ingest"]
    assert ingest["suppressed_rows"] > 0 and ingest["suppressed_certificates"] == cert.name
    assert main(["verify", str(cert), "--public-key", key]) == 0
    assert "already_deleted" in delete_patients(str(ws.root), [hash_of(sid)])


@pytest.mark.slow
def test_serve_without_a_configured_api_runs_its_cron_schedule(tmp_path):
    """The audit's case: `serve --cron "* * * * *"` ran no flow in 150 s without PREFECT_API_URL, its temporary
    server being ephemeral (Prefect runs no scheduler there). Two scheduled runs complete within four minutes."""
    import sqlite3
    import time
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_LOGGING"))}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    ws = tmp_path / "ws"
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "serve", "--out", str(ws), "--cron", "* * * * *",
                             "--budgets", "8", "--fractions", "", "--cohort-budget", "16", "--workers", "1",
                             "--task-runner", "thread"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    def completed() -> int:
        try:
            with sqlite3.connect(tmp_path / "prefect-home" / "prefect.db", timeout=5) as db:
                return db.execute("SELECT count(*) FROM flow_run r JOIN flow f ON r.flow_id = f.id WHERE f.name = "
                                  "'forgetful-scheduled-run' AND r.state_type = 'COMPLETED' AND "
                                  "r.deployment_id IS NOT NULL").fetchone()[0]
        except sqlite3.Error:
            return 0
    try:
        deadline = time.monotonic() + 240
        while completed() < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(5)
        assert completed() >= 2, proc.stdout.read() if proc.poll() is not None else "fewer than two runs"
        assert (ws / "report.html").exists()
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-3000:]
