"""Step: scan the workspace as it will be after commit (staged files, plus unchanged ones) for the subjects."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from memory.cohort import CohortMemory, owner_of
from pipeline.extract import scratch_paths
from pipeline.meds import quarantine_files, shard_files, stays_path, subject_splits_path
from pipeline.shard_changes import change_files, named_subjects

from .plan import owner
from .store import label_files, read_source, source_files

if TYPE_CHECKING:
    from pipeline.transaction import Transaction
    from pipeline.workspace import Workspace

SCANNED = ["events", "quarantine", "shard_change_records", "stays", "per_stay_results", "labels",
           "cohort_memory_checkpoints", "per_stay_memories", "generated_source", "extraction_scratch"]


def _rows_in(path, refs: dict[str, int]) -> dict[int, int]:
    """Each subject's rows in a parquet file naming them by id, or by keyed reference (the per-stay results)."""
    frame = pl.scan_parquet(path)
    by_ref = "subject_ref" in frame.collect_schema().names()
    column, keys = ("subject_ref", list(refs)) if by_ref else ("subject_id", list(refs.values()))
    found = (frame.filter(pl.col(column).is_in(pl.Series(keys).implode())).group_by(column).len().collect())
    return {(refs[k] if by_ref else int(k)): int(n) for k, n in found.iter_rows()}


def residual_scan(ws: Workspace, txn: Transaction, stay_files: dict[int, list]) -> dict[int, dict]:
    """Per subject (``stay_files``: their stays' memory files), the rows of theirs the workspace will still hold
    after commit, in every place a deletion changes: one pass over each file for every subject."""
    staged = {str(ws.root / op["final"]): ws.root / op["staged"] for op in txn.ops if op["op"] == "replace"}
    deleted = {str(ws.root / op["final"]) for op in txn.ops if op["op"] == "delete"}
    refs = {owner(ws, sid): sid for sid in stay_files}
    rows = {sid: sum(1 for p in files if str(p) not in deleted) for sid, files in stay_files.items()}

    def add(found: dict[int, int]) -> None:
        for sid, n in found.items():
            rows[sid] += n
    for f in [*shard_files(ws.store), *quarantine_files(ws.store), stays_path(ws.store), ws.results,
              *label_files(ws), subject_splits_path(ws.store)]:
        if str(f) not in deleted and f.exists():
            add(_rows_in(staged.get(str(f), f), refs))
    for f in change_files(ws.store):
        if str(f) not in deleted:
            add({sid: 1 for sid in named_subjects(f) if sid in rows})
    memories = [CohortMemory.load(src) for src in staged.values()
                if Path(src).is_dir() and (Path(src) / "memory.npz").exists()]
    memories += [CohortMemory.load(c) for c in [*ws.checkpoints(), *ws.snapshots()]
                 if str(c) not in deleted and str(c) not in staged]
    for cm in memories:
        for t in cm.memory.token_ids():
            if owner_of(t) in refs:
                rows[refs[owner_of(t)]] += 1
    for f in source_files(ws):
        frame = read_source(staged.get(str(f), f))
        if "subject_id" in frame.columns:
            ids = frame["subject_id"].value_counts()
            add({int(i): int(n) for i, n in ids.iter_rows() if i is not None and i.isdigit() and int(i) in rows})
    # a scratch database may hold any patient's rows: it must be gone
    scratch = sum(1 for f in scratch_paths(ws.store) if str(f) not in deleted)
    return {sid: {"rows_remaining": int(n + scratch), "scanned": list(SCANNED)} for sid, n in rows.items()}
