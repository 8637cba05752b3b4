"""Step: scan the workspace as it will be after commit (staged files, plus unchanged ones) for the subject."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl

from memory.cohort import CohortMemory, owner_of
from pipeline.meds import shard_files, subject_splits_path

from .plan import owner
from .store import label_files, read_source, source_files

if TYPE_CHECKING:
    from pipeline.transaction import Transaction
    from pipeline.workspace import Workspace

SCANNED = ["events", "quarantine", "stays", "per_stay_results", "labels", "cohort_memory_checkpoints",
           "per_stay_memories", "generated_source", "extraction_scratch"]


def _rows_in(path, sid, ref) -> int:
    """The subject's rows in a parquet file naming them by id, or by keyed reference (the per-stay results)."""
    frame = pl.scan_parquet(path)
    mine = pl.col("subject_ref") == ref if "subject_ref" in frame.collect_schema().names() else \
        pl.col("subject_id") == sid
    return frame.filter(mine).select(pl.len()).collect().item()


def residual_scan(ws: Workspace, txn: Transaction, sid: int, stay_files: list) -> dict:
    staged = {str(ws.root / op["final"]): ws.root / op["staged"] for op in txn.ops if op["op"] == "replace"}
    deleted = {str(ws.root / op["final"]) for op in txn.ops if op["op"] == "delete"}
    rows, ref = sum(1 for p in stay_files if str(p) not in deleted), owner(ws, sid)
    for f in [*shard_files(ws.store), *(ws.store / "quarantine").glob("*.parquet"), ws.store / "stays.parquet",
              ws.results, *label_files(ws), subject_splits_path(ws.store)]:
        if str(f) not in deleted and f.exists():
            rows += _rows_in(staged.get(str(f), f), sid, ref)
    for final, src in staged.items():
        if Path(src).is_dir() and (Path(src) / "memory.npz").exists():
            rows += sum(1 for t in CohortMemory.load(src).memory.token_ids() if owner_of(t) == ref)
    for c in ws.checkpoints():
        if str(c) not in deleted and str(c) not in staged:
            rows += len(CohortMemory.load(c).tokens_of(ref))
    for f in source_files(ws):
        frame = read_source(staged.get(str(f), f))
        rows += int((frame["subject_id"] == str(sid)).sum()) if "subject_id" in frame.columns else 0
    # a scratch database may hold any patient's rows: it must be gone
    rows += sum(1 for f in (ws.store / ".work").glob("extract.duckdb*") if str(f) not in deleted)
    return {"rows_remaining": int(rows), "scanned": list(SCANNED)}
