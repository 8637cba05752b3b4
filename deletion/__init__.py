"""Certified, all-or-nothing deletion of one patient from a workspace, as a sequence of named steps.

1. **lock and plan** (:mod:`.plan`): hold the workspace lock, settle any interrupted change, find what the
   workspace holds of the subject (or that they were deleted before), check the signed log;
2. **rewrite the store** (:mod:`.store`): events, quarantine, the workspace's generated source, stays and code
   counts without them, their keyed hash on the suppression list; per-stay results and memories removed;
3. **memories** (:mod:`.memories`): every cohort-memory checkpoint holding their tokens exactly decremented and
   verified against a scikit-learn refit (``decrement``), or re-streamed without them (``replay``);
4. **scan** (:mod:`.scan`): the state as it will be after commit holds no row of them;
5. **certify** (:mod:`.certify`): the certificate, its page, its inclusion proof and its entry in the signed log
   (:mod:`pipeline.evidence`), the reports marked stale;
6. **commit** (:mod:`pipeline.transaction`): every change above was staged; the journal is the commit point, so a
   crash leaves the full old state or, after recovery, the full new one.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from cohorts.definitions import workspace_config
from pipeline.evidence import (SIGNING_KEY_ENV, TrustAnchor, load_signing_key, public_hex, read_log,
                               signer_problems)
from pipeline.locking import workspace_lock
from pipeline.migrate import check_format
from pipeline.privacy import keyed_hash, store_key
from pipeline.transaction import Transaction, crash_point, recover

from .certify import certificate, stage_certificate, stale_reports
from . import derived
from .memories import replayed_memory_info, rewrite_memories
from .plan import AlreadyDeleted, DeletionFailed, check_subject, resolve_subject, scan_subject
from .scan import residual_scan
from .store import remove_stay_artifacts, rewrite_store

if TYPE_CHECKING:
    from pipeline.workspace import Workspace

MODES = ("decrement", "replay")

__all__ = ["MODES", "AlreadyDeleted", "DeletionFailed", "check_subject", "delete_subject", "resolve_subject",
           "scan_subject"]


def _stage_deletion(ws, cfg, txn, sid, subject_hash, stay_files, mode, log, signing_key, n_jitter, compare):
    t0 = time.perf_counter()
    removed = rewrite_store(ws, txn, sid, subject_hash)
    removed |= remove_stay_artifacts(ws, txn, sid, stay_files)
    crash_point("staged_store")
    run = derived.prepare(ws, txn, [sid]) if mode == "replay" else None
    memories = rewrite_memories(ws, cfg, txn, sid, mode, n_jitter, scaler=run.index.scaling if run else None,
                                compare=compare)
    crash_point("staged_memories")
    recomputed = derived.finish(ws, txn, run, replayed_memory_info(ws, txn)) if run else []
    residual = residual_scan(ws, txn, sid, stay_files)
    if residual["rows_remaining"]:
        raise DeletionFailed(f"post-deletion scan still finds the subject: {residual}")
    cert = certificate(log, subject_hash, mode, removed, memories, residual, [] if run else stale_reports(ws),
                       time.perf_counter() - t0, recomputed)
    name = stage_certificate(ws, txn, log, signing_key, cert, cfg.small_cell_threshold)
    crash_point("staged_certificate")
    return cert, name


def delete_subject(ws: Workspace, subject_id: int, mode: str = "decrement", wait_seconds: float = 0.0,
                   budget_refit_probes: int = 64, compare_with_replay: bool = True) -> tuple | None:
    """Delete one subject from the workspace; returns the certificate (dict) and its path.
    ``compare_with_replay`` (decrement): measure the decremented memory's distance to a replay without the
    subject (it costs that replay).

    Raises UnknownSubjectError when the subject is not in the workspace (and was never deleted), AlreadyDeleted
    when it was deleted before, WorkspaceLocked when a run holds the workspace, DeletionFailed when a check fails
    (nothing is changed then).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    sid = int(subject_id)
    check_format(ws.store)
    with workspace_lock(ws.root, wait_seconds=wait_seconds, purpose=f"deletion ({mode})"):
        recover(ws.root)
        subject_hash = keyed_hash(sid, store_key(ws.store, ws.root))
        _, stay_files = check_subject(ws, sid)
        log, signing_key = read_log(ws.root), load_signing_key(ws.root)
        problems = log.problems + signer_problems(log, None, TrustAnchor(public_hex(signing_key), SIGNING_KEY_ENV))
        if problems:
            raise DeletionFailed(f"the deletion log fails verification, so nothing is appended to it: "
                                 f"{'; '.join(problems)}")
        txn = Transaction(ws.root)
        try:
            cert, name = _stage_deletion(ws, workspace_config(ws.root), txn, sid, subject_hash, stay_files, mode, log,
                                         signing_key, budget_refit_probes, compare_with_replay)
        except BaseException:
            txn.abort()
            raise
        txn.commit()
        crash_point("committed")
        after, _ = scan_subject(ws, sid)
        if any(after.values()):
            raise DeletionFailed(f"after commit the subject is still found: {after}")
        return cert, ws.certificates / name
