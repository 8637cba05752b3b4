"""Certified, all-or-nothing deletion of one patient from a workspace.

What is removed, and how:

* event store: the patient's bucket is rewritten without them; quarantine files holding their rows are
  rewritten; ``stays.parquet`` is rewritten; ``codes.parquet`` (counts) is recomputed;
* per-stay artifacts: their rows of ``results/per_stay.parquet`` are dropped and their per-stay memory files
  deleted (those memories hold only that patient);
* the cohort memory: in ``decrement`` mode every checkpoint holding their tokens is exactly decremented and
  verified against a scikit-learn refit of its retained tokens; in ``replay`` mode the memory is re-streamed
  without them from the latest checkpoint that predates their first event, and later checkpoints are removed;
* aggregate reports (``report.html``/``report.json``) are **marked stale** (a banner and a ``stale`` field
  naming the certificate); the next scheduled run regenerates them; the learned-key encoder (trained on the
  training split) is deleted and retrained by the next run;
* the patient's keyed hash joins ``store/suppressed.json`` so an incremental run never re-ingests them from a
  source that still holds them; ``store/generation.json`` is bumped so no cached evaluation is reused.

Every new file is staged and committed through :mod:`pipeline.transaction`; the certificate, its page, its
inclusion proof, its log entry and the newly signed checkpoint (:mod:`pipeline.evidence`) are part of the same
transaction. A crash leaves the old state or (after recovery) the new one.
"""
import gzip
import json
import time
from pathlib import Path

import numpy as np
import polars as pl

from memory.cohort import CohortMemory, subject_of
from memory.errors import InfeasibleError
from memory.refit import verify_against_refit
from reports.certificate_page import render_certificate_html

from .evidence import CHECKPOINT, canonical, load_signing_key, new_entry, read_log, receipt_path
from .extract import N_BUCKETS, UnknownSubjectError
from .locking import workspace_lock
from .privacy import SUPPRESSED_FILE, keyed_hash, store_key, suppressed_hashes
from .transaction import Transaction, _crash_point, recover

MODES = ("decrement", "replay")
VERIFY_MAX_DEV = 1e-8


class AlreadyDeleted(Exception):
    """The subject was deleted before: nothing of them remains and the ledger holds their certificate."""


class DeletionFailed(RuntimeError):
    """Verification failed; nothing was changed."""


def scan_subject(ws, subject_id):
    """Everything of the subject still present: counts per place (all zero after a deletion)."""
    sid = int(subject_id)
    found = {}
    bucket = ws.store / "events" / f"bucket={sid % N_BUCKETS}"
    files = sorted(bucket.glob("*.parquet")) if bucket.exists() else []
    found["events"] = pl.scan_parquet(files).filter(pl.col("subject_id") == sid).select(pl.len()).collect().item() \
        if files else 0
    qfiles = sorted((ws.store / "quarantine").glob("*.parquet"))
    found["quarantine"] = pl.scan_parquet(qfiles).filter(pl.col("subject_id") == sid).select(pl.len()).collect() \
        .item() if qfiles else 0
    stays_file = ws.store / "stays.parquet"
    stay_ids = []
    if stays_file.exists():
        stays = pl.read_parquet(stays_file).filter(pl.col("subject_id") == sid)
        stay_ids = stays["stay_id"].to_list()
        found["stays"] = stays.height
    found["per_stay_results"] = pl.read_parquet(ws.results).filter(pl.col("subject_id") == sid).height \
        if ws.results.exists() else 0
    found["cohort_memory_tokens"] = sum(len(CohortMemory.load(c).tokens_of(sid)) for c in ws.checkpoints())
    return found, stay_ids


def check_subject(ws, subject_id):
    """What the workspace holds of the subject: (counts per place, per-stay memory files). Read-only, so the
    CLI can answer before any flow starts. Raises AlreadyDeleted when nothing is left and the ledger holds the
    subject's certificate, UnknownSubjectError when nothing is left and it never did."""
    sid = int(subject_id)
    if not ws.store.exists():
        raise UnknownSubjectError(f"workspace {ws.root} has no event store (run `forgetful run --out {ws.root}` "
                                  f"first)")
    key = store_key(ws.store, ws.root)
    found, stay_ids = scan_subject(ws, sid)
    stay_ids = sorted(set(stay_ids) | set(_stay_ids_from_results(ws, sid)))
    stay_files = [p for p in (ws.stay_memory(s, key) for s in stay_ids) if p.exists()]
    if any(found.values()) or stay_files:
        return found, stay_files
    subject_hash = keyed_hash(sid, key)
    cert = _certificate_of(ws, subject_hash)
    if cert:
        raise AlreadyDeleted(f"subject (hash {subject_hash[:12]}...) was already deleted; certificate {cert}")
    raise UnknownSubjectError(f"subject {sid} is not in the workspace {ws.root}")


def _certificate_of(ws, subject_hash):
    for entry in read_log(ws.root).entries:
        path = ws.certificates / str(entry.get("certificate"))
        if path.is_file() and json.loads(path.read_text()).get("subject_hash") == subject_hash:
            return entry["certificate"]
    return None


def resolve_subject(ws, subject_hash: str) -> int:
    """The subject id behind a keyed hash, found by hashing the store's subject ids, so that a deletion
    request can travel (through Prefect's database, logs and results) as the hash alone.

    Raises AlreadyDeleted for a deleted subject's hash and UnknownSubjectError (naming only the hash) for a
    hash no stored subject has."""
    if not ws.store.exists():
        raise UnknownSubjectError(f"workspace {ws.root} has no event store")
    key = store_key(ws.store, ws.root)
    frames = [pl.scan_parquet(f).select("subject_id") for f in
              [ws.store / "stays.parquet", *sorted((ws.store / "events").glob("*/*.parquet")),
               *sorted((ws.store / "quarantine").glob("*.parquet"))] if f.exists()]
    ids = pl.concat(frames).unique().collect()["subject_id"].drop_nulls().to_list() if frames else []
    match = [s for s in ids if keyed_hash(int(s), key) == subject_hash]
    if match:
        return int(match[0])
    cert = _certificate_of(ws, subject_hash)
    if cert or subject_hash in suppressed_hashes(ws.store):
        raise AlreadyDeleted(f"subject (hash {subject_hash[:12]}...) was already deleted; certificate {cert}")
    raise UnknownSubjectError(f"no subject with keyed hash {subject_hash[:12]}... is in the workspace {ws.root}")


def _stay_ids_from_results(ws, sid):
    if not ws.results.exists():
        return []
    return pl.read_parquet(ws.results).filter(pl.col("subject_id") == sid)["stay_id"].unique().to_list()


def _source_files(ws):
    """The embedded generator's CSVs in the workspace: the workspace's own copy of patients' raw rows."""
    return sorted(ws.source.rglob("*.csv*")) if ws.source.exists() else []


def _read_source(path) -> pl.DataFrame:
    return pl.read_csv(path, infer_schema=False)     # every field as text: rewritten rows keep their content


def _purge_source(ws, txn, sid) -> int:
    """Rewrite the workspace's generated source without the subject; the rows removed."""
    removed = 0
    for f in _source_files(ws):
        frame = _read_source(f)
        if "subject_id" not in frame.columns:
            continue
        mine = frame["subject_id"] == str(sid)
        n = int(mine.sum())
        if n:
            removed += n
            data = frame.filter(~mine).write_csv().encode()
            txn.stage(f).write_bytes(gzip.compress(data, mtime=0) if f.name.endswith(".gz") else data)
    return removed


def _write_staged_parquet(txn, frame, final):
    staged = txn.stage(final)
    frame.write_parquet(staged)
    return staged


def delete_subject(ws, subject_id, mode="decrement", wait_seconds=0.0, budget_refit_probes=64):
    """Delete one subject from the workspace; returns the certificate (dict) and its path.

    Raises UnknownSubjectError when the subject is not in the workspace (and was never deleted), AlreadyDeleted
    when it was deleted before, WorkspaceLocked when a run holds the workspace, DeletionFailed when a memory
    fails its refit verification (nothing is changed then).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    sid = int(subject_id)
    with workspace_lock(ws.root, wait_seconds=wait_seconds, purpose=f"deletion ({mode})"):
        recover(ws.root)
        key = store_key(ws.store, ws.root)
        subject_hash = keyed_hash(sid, key)
        found, stay_files = check_subject(ws, sid)
        log, signing_key = read_log(ws.root), load_signing_key(ws.root)
        if log.problems:
            raise DeletionFailed(f"the deletion log fails verification, so nothing is appended to it: "
                                 f"{'; '.join(log.problems)}")

        t0 = time.perf_counter()
        txn = Transaction(ws.root)
        try:
            removed = {}
            # 1. event store
            bucket = ws.store / "events" / f"bucket={sid % N_BUCKETS}"
            files = sorted(bucket.glob("*.parquet"))
            if files:
                ev = pl.read_parquet(files, hive_partitioning=False)
                mine = ev.filter(pl.col("subject_id") == sid)
                removed["events_by_table"] = {r["source_table"]: int(r["len"]) for r in
                                              mine.group_by("source_table").len().iter_rows(named=True)}
                keep = ev.filter(pl.col("subject_id") != sid).sort(["subject_id", "time", "code", "event_hash",
                                                                    "occurrence"])
                for f in files:
                    txn.delete(f)
                if keep.height:
                    _write_staged_parquet(txn, keep, bucket / f"deletion-{txn.name}.parquet")
            removed["quarantine_rows"] = 0
            for q in sorted((ws.store / "quarantine").glob("*.parquet")):
                qf = pl.read_parquet(q)
                n = qf.filter(pl.col("subject_id") == sid).height
                if n:
                    removed["quarantine_rows"] += n
                    _write_staged_parquet(txn, qf.filter(pl.col("subject_id") != sid), q)
            removed["source_rows"] = _purge_source(ws, txn, sid)
            for scratch in (ws.store / ".work").glob("extract.duckdb*"):   # earlier versions' scratch tables
                txn.delete(scratch)
            stays = pl.read_parquet(ws.store / "stays.parquet")
            removed["stays"] = stays.filter(pl.col("subject_id") == sid).height
            _write_staged_parquet(txn, stays.filter(pl.col("subject_id") != sid), ws.store / "stays.parquet")
            other = [f for f in (ws.store / "events").glob("*/*.parquet") if f.parent != bucket]
            counts = []
            if other:
                counts.append(pl.scan_parquet(other, hive_partitioning=False).select("code", "source_table"))
            if files and keep.height:
                counts.append(keep.lazy().select("code", "source_table"))
            if counts and (ws.store / "codes.parquet").exists():
                old_codes = pl.read_parquet(ws.store / "codes.parquet")
                new_codes = (pl.concat(counts).group_by("code").agg(pl.col("source_table").first(),
                                                                    pl.len().alias("count")).collect())
                if "description" in old_codes.columns:
                    new_codes = new_codes.join(old_codes.select("code", "description"), on="code", how="left")
                _write_staged_parquet(txn, new_codes.sort("code"), ws.store / "codes.parquet")
            supp = suppressed_hashes(ws.store) | {subject_hash}
            txn.stage(ws.store / SUPPRESSED_FILE).write_text(json.dumps(sorted(supp)))
            txn.stage(ws.generation_file).write_text(json.dumps({"generation": ws.generation() + 1}))
            _crash_point("staged_store")

            # 2. per-stay artifacts
            if ws.results.exists():
                res = pl.read_parquet(ws.results)
                removed["per_stay_result_rows"] = res.filter(pl.col("subject_id") == sid).height
                _write_staged_parquet(txn, res.filter(pl.col("subject_id") != sid), ws.results)
            removed["per_stay_memories"] = len(stay_files)
            for p in stay_files:
                txn.delete(p)
            if ws.encoder.exists():
                # trained on the training split, possibly on this patient: removed, the next run retrains it
                txn.delete(ws.encoder)
                removed["learned_key_encoder"] = "deleted; retrained by the next scheduled run"

            # 3. cohort memory checkpoints
            memories, verification, digests = {}, {}, {}
            ckpts = ws.checkpoints()
            if mode == "decrement":
                rows_of = {}
                for c in ckpts:
                    cm = CohortMemory.load(c)
                    tokens = cm.tokens_of(sid)
                    order, keys = _subject_rows(ws, c, sid, rows_of)
                    if not tokens:
                        if any(o <= cm.watermark for o in order):   # fed and evicted: out of the digest
                            cm.forget_history(order, keys)
                            staged_dir = txn.stage(c)
                            cm.save(staged_dir)
                            copy_checkpoint_extras(c, staged_dir)
                        continue
                    cm.forget_history(order, keys)
                    before = cm.memory.state_digest()
                    removed_keys = np.stack([cm.memory.key_of(t) for t in tokens])
                    try:
                        cm.memory.remove_many(tokens)
                    except InfeasibleError as e:
                        raise DeletionFailed(f"checkpoint {c.name}: {e}; the fixed-C memory cannot lose that many "
                                             f"tokens by decrement -- use mode 'replay'") from None
                    memories[c.name] = len(tokens)
                    digests[c.name] = {"before": before, "after": cm.memory.state_digest()}
                    verification[c.name] = _verify(cm, removed_keys, budget_refit_probes)
                    staged_dir = txn.stage(c)
                    cm.save(staged_dir)
                    copy_checkpoint_extras(c, staged_dir)
            else:
                memories, verification, digests = _replay(ws, ckpts, sid, txn, budget_refit_probes)
            removed["cohort_memory_tokens"] = memories
            failed = [n for n, v in verification.items() if not v["passed"]]
            if failed:
                raise DeletionFailed(f"refit verification failed for cohort memory checkpoint(s) {failed}: "
                                     f"{[verification[n] for n in failed]}")
            _crash_point("staged_memories")

            # 4. aggregate reports: marked stale
            stale = []
            if ws.report_json.exists():
                rep = json.loads(ws.report_json.read_text())
                rep["stale"] = {"reason": "a patient was deleted after this report was computed",
                                "certificate": None}
                stale.append("report.json")
                stale_report = rep
            if ws.report_html.exists():
                stale.append("report.html")

            # 5. residual scan over the staged state
            residual = _residual_scan(ws, txn, sid, bucket, stay_files)
            if residual["rows_remaining"]:
                raise DeletionFailed(f"post-deletion scan still finds the subject: {residual}")

            # 6. certificate, its page, and its entry in the signed log
            seq = log.size
            name = f"{seq:06d}.json"
            cert = {
                "certificate_id": seq, "subject_hash": subject_hash,
                "hash": "HMAC-SHA256 (the deployment's hash key, kept outside the workspace)",
                "mode": mode,
                "mode_meaning": ("memories equal the fixed-C refit of their retained tokens" if mode == "decrement"
                                 else "cohort memory re-streamed as if the patient had never been seen"),
                "removed": removed, "memory_digests": digests, "verification": verification,
                "residual_scan": residual, "artifacts_marked_stale": stale,
                "aggregates_kept": ("per-code value statistics used to standardise event keys and per-channel "
                                    "token statistics (training-split medians, means and standard deviations) "
                                    "persisted with the cohort memory, and aggregate report numbers"),
                "code_version": _code_version(), "issued_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "seconds": round(time.perf_counter() - t0, 3),
                "log_size_before": log.size, "log_root_before": log.root_hex(),
            }
            text, page = canonical(cert), render_certificate_html(cert, name)
            line, checkpoint, receipt = new_entry(log, name, text, page, signing_key)
            txn.stage(ws.certificates / name).write_text(text)
            txn.stage(ws.certificates / name.replace(".json", ".html")).write_text(page)
            txn.stage(receipt_path(ws.certificates / name)).write_text(receipt)
            old = ws.ledger.read_text() if ws.ledger.exists() else ""
            txn.stage(ws.ledger).write_text(old + line + "\n")
            txn.stage(ws.root / CHECKPOINT).write_text(checkpoint)
            if "report.json" in stale:
                stale_report["stale"]["certificate"] = name
                txn.stage(ws.report_json).write_text(json.dumps(stale_report, indent=1, default=str))
            if "report.html" in stale:
                html_text = ws.report_html.read_text()
                banner = (f"<p style='background:#fde;border:2px solid #c00;padding:8px'><b>Stale:</b> a patient "
                          f"was deleted after this report was computed (certificate {name}); the next "
                          f"scheduled run regenerates it.</p>")
                txn.stage(ws.report_html).write_text(html_text.replace("<body>", "<body>" + banner, 1))
            _crash_point("staged_certificate")
        except BaseException:
            txn.abort()
            raise
        txn.commit()
        _crash_point("committed")
        after, _ = scan_subject(ws, sid)
        if any(after.values()):
            raise DeletionFailed(f"after commit the subject is still found: {after}")
        return cert, ws.certificates / name


def _code_version():
    from cohorts.provenance import code_version
    return code_version()


def copy_checkpoint_extras(src, dst):
    from cohorts.runs import copy_checkpoint_extras as copy
    copy(src, dst)


def _subject_rows(ws, ckpt, sid, cache):
    """The subject's rows as checkpoint ``ckpt`` was fed them (its stream mode and key statistics), read from
    the store before the deletion commits: (order keys, keys). ``cache``: by mode and key statistics."""
    from cohorts.definitions import workspace_config
    from cohorts.runs import SCALER_FILES, checkpoint_tokens, load_scaler
    from cohorts.streams import cohort_stream
    mode = checkpoint_tokens(ckpt)
    stats = (ckpt / SCALER_FILES[mode]).read_bytes()
    if (mode, stats) not in cache:
        _, keys, _, order, _ = cohort_stream(ws.store, workspace_config(ws.root), mode, scaler=load_scaler(ckpt),
                                             subject_id=sid)
        cache[(mode, stats)] = (order, keys)
    return cache[(mode, stats)]


def _verify(cm, removed_keys, n_jitter):
    if not cm.memory.is_feasible:
        return {"passed": True, "note": "memory below ceil(1/C) tokens: no solution to verify", "tokens":
                cm.memory.n_tokens}
    rep = verify_against_refit(cm.memory, probes=removed_keys, n_jitter=n_jitter)
    passed = rep.max_dev <= VERIFY_MAX_DEV and rep.nondegenerate_mismatches == 0
    return {"passed": bool(passed), "max_decision_deviation": rep.max_dev, "median_decision_deviation":
            rep.median_dev, "partition_agreement": rep.partition_agreement,
            "nondegenerate_mismatches": rep.nondegenerate_mismatches,
            "kkt_residual": rep.kkt_residual_memory, "tolerance": VERIFY_MAX_DEV, "tokens": rep.n_tokens}


def _replay(ws, ckpts, sid, txn, n_jitter):
    """Re-stream the cohort memory without the subject from the last checkpoint that never saw them."""
    from cohorts.definitions import workspace_config
    from cohorts.runs import checkpoint_tokens, load_scaler
    from cohorts.streams import cohort_stream

    if not ckpts:
        return {}, {}, {}
    latest = CohortMemory.load(ckpts[-1])
    tokens = checkpoint_tokens(ckpts[-1])
    _, K, ids, order, subjects = cohort_stream(ws.store, workspace_config(ws.root), tokens,
                                               scaler=load_scaler(ckpts[-1]))
    # the checkpoints that saw the subject: their watermark is at or past the subject's first event; a
    # checkpoint of the other stream mode is never a replay base
    first = next((o for o, s in zip(order, subjects) if int(s) == sid), None)
    clean = [c for c in ckpts if checkpoint_tokens(c) == tokens and (first is None or
                                                                      CohortMemory.load(c).watermark < first)]
    base = CohortMemory.load(clean[-1]) if clean else CohortMemory(budget=latest.policy.budget,
                                                                   gamma=latest.gamma, nu=latest.policy.nu)
    before = latest.memory.state_digest()
    sel = [i for i, (o, s) in enumerate(zip(order, subjects))
           if int(s) != sid and base.watermark < o <= latest.watermark]
    base.feed(K[sel], [ids[i] for i in sel], [order[i] for i in sel])
    # the other mode's checkpoints are history: removed only where they hold the subject
    tainted = [c for c in ckpts if c not in clean and (checkpoint_tokens(c) == tokens or
                                                       CohortMemory.load(c).tokens_of(sid))]
    for c in tainted:
        txn.delete(c)
    target = ckpts[-1]
    staged = txn.stage(target)
    base.save(staged)
    copy_checkpoint_extras(ckpts[-1], staged)
    removed_tokens = len(latest.tokens_of(sid))
    verification = {target.name: _verify(base, None, n_jitter)}
    verification[target.name]["replayed_from"] = clean[-1].name if clean else "empty memory"
    verification[target.name]["checkpoints_removed"] = [c.name for c in tainted if c != target]
    return ({target.name: removed_tokens}, verification,
            {target.name: {"before": before, "after": base.memory.state_digest()}})


def _residual_scan(ws, txn, sid, bucket, stay_files):
    """Scan the state as it will be after commit (staged files, plus unchanged ones) for the subject."""
    staged = {str(ws.root / op["final"]): ws.root / op["staged"] for op in txn.ops if op["op"] == "replace"}
    deleted = {str(ws.root / op["final"]) for op in txn.ops if op["op"] == "delete"}
    rows = sum(1 for p in stay_files if str(p) not in deleted)
    for f in list((ws.store / "events").glob("*/*.parquet")) + list((ws.store / "quarantine").glob("*.parquet")) \
            + [ws.store / "stays.parquet", ws.results]:
        if str(f) in deleted or not f.exists():
            continue
        src = staged.get(str(f), f)
        rows += pl.scan_parquet(src).filter(pl.col("subject_id") == sid).select(pl.len()).collect().item()
    for final, src in staged.items():
        if final.endswith(".parquet") and Path(final).parent == bucket:
            rows += pl.scan_parquet(src).filter(pl.col("subject_id") == sid).select(pl.len()).collect().item()
        if Path(src).is_dir() and (Path(src) / "memory.npz").exists():
            rows += sum(1 for t in CohortMemory.load(src).memory.token_ids() if subject_of(t) == sid)
    for c in ws.checkpoints():
        if str(c) not in deleted and str(c) not in staged:
            rows += len(CohortMemory.load(c).tokens_of(sid))
    for f in _source_files(ws):
        frame = _read_source(staged.get(str(f), f))
        rows += int((frame["subject_id"] == str(sid)).sum()) if "subject_id" in frame.columns else 0
    scratch = [f for f in (ws.store / ".work").glob("extract.duckdb*") if str(f) not in deleted]
    rows += len(scratch)     # a scratch database may hold any patient's rows: it must be gone
    return {"rows_remaining": int(rows), "scanned": ["events", "quarantine", "stays", "per_stay_results",
                                                      "cohort_memory_checkpoints", "per_stay_memories",
                                                      "generated_source", "extraction_scratch"]}
