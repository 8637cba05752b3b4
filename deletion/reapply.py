"""Deletions applied again to a store that lost them: rebuilt after a loss, or restored from an older backup.

The workspace's suppression list and its certificates outlive the store (:mod:`pipeline.deleted`). A store whose
own list lacks a subject they name predates that deletion: any row it holds of them goes again, in one
transaction, before a run or a deletion reads it; no new certificate is issued (the subject's certificate stands,
and still verifies), and the store's list is made whole, so the next check is a comparison of two lists.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import polars as pl

from pipeline.deleted import deleted_subjects, suppression_files
from pipeline.privacy import keyed_hash, store_key
from pipeline.transaction import Transaction

from .plan import check_subject, subjects_by_hash
from .store import read_source, remove_from_source, remove_stay_artifacts, rewrite_store, source_files

if TYPE_CHECKING:
    from pipeline.workspace import Workspace


@dataclass(frozen=True)
class Reapplied:
    """What a store held again of deleted subjects: how many, their rows, and their certificates (a few named)."""
    subjects: int
    rows: int
    certificates: str

    def line(self) -> str:
        return (f"the store held {self.rows} row(s) of {self.subjects} deleted patient(s) again (restored from a "
                f"backup older than their deletion?); removed again, under their certificates {self.certificates}")


def reapply_deletions(ws: Workspace) -> Reapplied | None:
    """Remove again every deleted subject the store holds but its own suppression list lacks (the caller holds the
    workspace lock); None when the store's list names everyone the workspace does."""
    if not ws.store.exists():
        return None
    deleted = deleted_subjects(ws.store, ws.root)
    missing = deleted.missing_from_store()
    if not missing:
        return None
    back = {sid: h for h, sid in subjects_by_hash(ws, set(missing)).items()}
    txn = Transaction(ws.root)
    try:
        if back:
            removed = rewrite_store(ws, txn, back)
            remove_stay_artifacts(ws, txn, {sid: check_subject(ws, sid)[1] for sid in back})
        else:
            hashes = json.dumps(sorted(deleted.certificates))
            for f in suppression_files(ws.store, ws.root):
                txn.stage(f).write_text(hashes)
    except BaseException:
        txn.abort()
        raise
    txn.commit()
    if not back:
        return None
    rows = sum(sum(r["events_by_table"].values()) + r["quarantine_rows"] for r in removed.values())
    return Reapplied(len(back), rows, deleted.named(back.values()))


def reapply_to_generated_source(ws: Workspace) -> int:
    """The embedded data generated anew (the workspace's copy was lost with its store) holds the deleted patients
    again: their rows are removed, as their deletion removed them from the copy it found. The rows removed."""
    deleted = deleted_subjects(ws.store, ws.root)
    files = source_files(ws)
    if not len(deleted) or not files:
        return 0
    key = store_key(ws.store, ws.root)
    ids = {int(s) for f in files if "subject_id" in (frame := read_source(f)).columns
           for s in frame["subject_id"].cast(pl.Int64, strict=False).drop_nulls().unique().to_list()}
    back = sorted(sid for sid in ids if keyed_hash(sid, key) in deleted)
    if not back:
        return 0
    txn = Transaction(ws.root)
    try:
        removed = remove_from_source(ws, txn, back)
    except BaseException:
        txn.abort()
        raise
    txn.commit()
    return sum(removed.values())
