"""Certified, all-or-nothing deletion of one patient, or of several at once, from a workspace, as a sequence of
named steps.

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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cohorts.definitions import workspace_config
from pipeline.evidence import (SIGNING_KEY_ENV, TrustAnchor, load_signing_key, public_hex, read_log,
                               signer_problems)
from pipeline.errors import InputError
from pipeline.locking import workspace_lock
from pipeline.migrate import check_format
from pipeline.privacy import keyed_hash, store_key
from pipeline.transaction import Transaction, crash_point, recover

from .certify import DeletionChange, certificate, stage_certificates, stale_reports
from . import derived
from .memories import replayed_memory_info, rewrite_memories
from .plan import (AlreadyDeleted, DeletionFailed, Triage, check_subject, check_subjects, resolve_subject,
                   resolve_subjects, scan_subject, triage)
from .reapply import Reapplied, reapply_deletions, reapply_to_generated_source
from .scan import residual_scan
from .store import remove_stay_artifacts, rewrite_store

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from cohorts.definitions import CohortConfig
    from pipeline.certificate import Certificate
    from pipeline.evidence import Log
    from pipeline.workspace import Workspace

MODES = ("decrement", "replay")

__all__ = ["MODES", "AlreadyDeleted", "DeletionFailed", "Reapplied", "Triage", "check_subject", "check_subjects",
           "delete_subject", "delete_subjects", "reapply_deletions", "reapply_to_generated_source", "resolve_subject",
           "resolve_subjects", "scan_subject", "triage"]


@dataclass(frozen=True)
class _DeletionPlan:
    """A deletion's scope once checked: the subjects (id -> keyed hash), their stays' memory files, the mode,
    the refit check's probes, whether a decrement measures its distance to a replay, the log and its key."""
    subjects: dict[int, str]
    stay_files: dict[int, list]
    mode: str
    refit_probes: int
    compare: bool
    log: Log
    signing_key: Ed25519PrivateKey


def _stage_deletion(ws: Workspace, cfg: CohortConfig, txn: Transaction,
                    plan: _DeletionPlan) -> list[tuple[Certificate, str]]:
    """Every step of a deletion of ``plan``'s subjects staged in ``txn``; their certificates and names."""
    t0 = time.perf_counter()
    subjects, stay_files, mode = plan.subjects, plan.stay_files, plan.mode
    sids = frozenset(subjects)
    removed = rewrite_store(ws, txn, subjects)
    rerun = mode == "replay" and derived.reruns(ws)
    for sid, r in remove_stay_artifacts(ws, txn, stay_files, drop_cache=not rerun).items():
        removed[sid] |= r
    crash_point("staged_store")
    run = derived.prepare(ws, txn, sorted(sids)) if rerun else None
    tokens, verification, digests = rewrite_memories(ws, cfg, txn, sids, mode, plan.refit_probes,
                                                     scaler=run.index.scaling if run else None, compare=plan.compare)
    crash_point("staged_memories")
    recomputed = derived.finish(ws, txn, run, replayed_memory_info(ws, txn), sorted(sids)) if run else []
    residual = residual_scan(ws, txn, stay_files)
    left = {subjects[sid][:12]: r for sid, r in residual.items() if r["rows_remaining"]}
    if left:
        raise DeletionFailed(f"post-deletion scan still finds subject(s) (by hash) {left}")
    change = DeletionChange(mode, verification, digests, [] if run else stale_reports(ws), recomputed,
                            time.perf_counter() - t0, batch=len(sids))
    certs = [certificate(plan.log, subjects[sid], removed[sid] | {"cohort_memory_tokens": {c: n[sid] for c, n in
                                                                                           tokens.items()}},
                         residual[sid], change) for sid in sorted(sids)]
    issued = stage_certificates(ws, txn, plan.log, plan.signing_key, certs, cfg.small_cell_threshold)
    crash_point("staged_certificate")
    return issued


def delete_subjects(ws: Workspace, subject_ids: list[int], mode: str = "decrement", wait_seconds: float = 0.0,
                    budget_refit_probes: int = 64, compare_with_replay: bool = True) -> list[tuple[Certificate, Path]]:
    """Delete several subjects from the workspace in one transaction (one store rewrite, one memory decrement or
    replay, one recomputation for all); each gets a certificate and a log entry of their own, verifiable alone.
    Returns (certificate, path) per subject, in ascending id order. ``compare_with_replay`` (decrement): measure
    the decremented memory's distance to a replay without them (it costs that replay).

    All or nothing: raises UnknownSubjectError when a subject is not in the workspace (and was never deleted),
    AlreadyDeleted when one was deleted before (the caller picks the rest, :func:`check_subjects`),
    WorkspaceLocked when a run holds the workspace, DeletionFailed when a check fails; nothing is changed then.
    """
    if mode not in MODES:
        raise InputError(f"mode must be one of {MODES}, got {mode!r}")
    sids = sorted({int(s) for s in subject_ids})
    if not sids:
        raise InputError("no subject to delete")
    check_format(ws.store)
    with workspace_lock(ws.root, wait_seconds=wait_seconds, purpose=f"deletion ({mode})"):
        recover(ws.root)
        reapply_deletions(ws)       # a store restored from an older backup: its deleted subjects go first
        key = store_key(ws.store, ws.root)
        subjects = {sid: keyed_hash(sid, key) for sid in sids}
        stay_files = {sid: check_subject(ws, sid)[1] for sid in sids}
        log, signing_key = read_log(ws.root), load_signing_key(ws.root)
        problems = log.problems + signer_problems(log, None, TrustAnchor(public_hex(signing_key), SIGNING_KEY_ENV))
        if problems:
            raise DeletionFailed(f"the deletion log fails verification, so nothing is appended to it: "
                                 f"{'; '.join(problems)}")
        txn = Transaction(ws.root)
        try:
            plan = _DeletionPlan(subjects, stay_files, mode, budget_refit_probes, compare_with_replay, log,
                                 signing_key)
            issued = _stage_deletion(ws, workspace_config(ws.root), txn, plan)
        except BaseException:
            txn.abort()
            raise
        txn.commit()
        crash_point("committed")
        for sid in sids:
            after, _ = scan_subject(ws, sid)
            if any(after.values()):
                raise DeletionFailed(f"after commit a subject (hash {subjects[sid][:12]}...) is still found: {after}")
        return [(cert, ws.certificates / name) for cert, name in issued]


def delete_subject(ws: Workspace, subject_id: int, mode: str = "decrement", wait_seconds: float = 0.0,
                   budget_refit_probes: int = 64, compare_with_replay: bool = True) -> tuple:
    """Delete one subject (:func:`delete_subjects` of one): their certificate and its path."""
    return delete_subjects(ws, [subject_id], mode, wait_seconds, budget_refit_probes, compare_with_replay)[0]
