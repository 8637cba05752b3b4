"""Step: the event store and the workspace's files without the subject, staged in the deletion's transaction."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import polars as pl

from pipeline.extract_rules import N_BUCKETS, sql_literal
from pipeline.meds import (codes_metadata_path, read_codes_metadata, shard_files, shard_of, subject_splits_path,
                           write_codes_metadata, write_label_file, write_shard, write_subject_splits)
from pipeline.privacy import SUPPRESSED_FILE, suppressed_hashes

from .plan import owner

if TYPE_CHECKING:
    from pipeline.transaction import Transaction
    from pipeline.workspace import Workspace


def write_staged_parquet(txn: Transaction, frame: pl.DataFrame, final: Path) -> None:
    frame.write_parquet(txn.stage(final))


def _events(ws, txn, sid) -> dict:
    """The subject's shard rewritten without them, streamed by DuckDB (a shard is already sorted, so the kept
    rows stay a valid MEDS shard); the events removed per table."""
    shard = shard_of(ws.store, sid)
    if not shard.exists():
        return {}
    con = duckdb.connect()
    try:
        src = f"read_parquet({sql_literal(shard)})"
        removed = {t: int(n) for t, n in con.execute(f"SELECT source_table, count(*) FROM {src} WHERE subject_id = ? "
                                                     f"GROUP BY ALL", [sid]).fetchall()}
        if con.execute(f"SELECT count(*) FROM {src} WHERE subject_id <> ?", [sid]).fetchall()[0][0]:
            write_shard(con, f"SELECT * FROM {src} WHERE subject_id <> ?", txn.stage(shard), [sid])
        else:
            txn.delete(shard)
    finally:
        con.close()
    return removed


def _quarantine(ws, txn, sid) -> int:
    removed = 0
    for q in sorted((ws.store / "quarantine").glob("*.parquet")):
        qf = pl.read_parquet(q)
        n = qf.filter(pl.col("subject_id") == sid).height
        if n:
            removed += n
            write_staged_parquet(txn, qf.filter(pl.col("subject_id") != sid), q)
    return removed


def _codes(ws, txn, sid) -> None:
    """Recount the codes metadata over the store as it will be (descriptions and parent codes kept; a code
    only the subject had leaves it); DuckDB aggregates the shards without holding them."""
    shard = shard_of(ws.store, sid)
    staged = {str(ws.root / op["final"]): ws.root / op["staged"] for op in txn.ops if op["op"] == "replace"}
    files = [staged.get(str(f), f) for f in shard_files(ws.store)]
    files = [f for f in files if f != shard or str(shard) in staged]
    old = read_codes_metadata(ws.store)
    if not files or old is None:
        return
    sources = ", ".join(map(sql_literal, files))
    new = pl.from_arrow(duckdb.sql(f"SELECT code, first(source_table) AS source_table, count(*) AS count "
                                   f"FROM read_parquet([{sources}]) GROUP BY code").arrow())
    new = new.join(old.select("code", "description", "parent_codes"), on="code", how="left")
    write_codes_metadata(txn.stage(codes_metadata_path(ws.store)), new)


def label_files(ws: Workspace) -> list[Path]:
    """The runs' MEDS label files (they name subjects by their raw id, as MEDS does)."""
    return sorted(ws.labels.glob("*.parquet")) if ws.labels.exists() else []


def _labels(ws, txn, sid) -> int:
    """The label files rewritten without the subject; the rows removed."""
    removed = 0
    for f in label_files(ws):
        frame = pl.read_parquet(f)
        n = frame.filter(pl.col("subject_id") == sid).height
        if n:
            removed += n
            write_label_file(frame.filter(pl.col("subject_id") != sid), txn.stage(f))
    return removed


def source_files(ws: Workspace) -> list:
    """The embedded generator's CSVs in the workspace: the workspace's own copy of patients' raw rows."""
    return sorted(ws.source.rglob("*.csv*")) if ws.source.exists() else []


def read_source(path: Path) -> pl.DataFrame:
    return pl.read_csv(path, infer_schema=False)     # every field as text: rewritten rows keep their content


def _source(ws, txn, sid) -> int:
    """The workspace's generated source rewritten without the subject; the rows removed."""
    removed = 0
    for f in source_files(ws):
        frame = read_source(f)
        if "subject_id" not in frame.columns:
            continue
        mine = frame["subject_id"] == str(sid)
        n = int(mine.sum())
        if n:
            removed += n
            data = frame.filter(~mine).write_csv().encode()
            txn.stage(f).write_bytes(gzip.compress(data, mtime=0) if f.name.endswith(".gz") else data)
    return removed


def rewrite_store(ws: Workspace, txn: Transaction, sid: int, subject_hash: str) -> dict:
    """Events, quarantine, generated source, stays, code counts and split without the subject; the subject's hash on
    the suppression list; the store's generation bumped (no cache over the old content is reused)."""
    removed = {}
    removed["events_by_table"] = _events(ws, txn, sid)
    removed["quarantine_rows"] = _quarantine(ws, txn, sid)
    removed["source_rows"] = _source(ws, txn, sid)
    for scratch in (ws.store / ".work").glob("extract.duckdb*"):     # earlier versions' scratch tables
        txn.delete(scratch)
    stays = pl.read_parquet(ws.store / "stays.parquet")
    removed["stays"] = stays.filter(pl.col("subject_id") == sid).height
    write_staged_parquet(txn, stays.filter(pl.col("subject_id") != sid), ws.store / "stays.parquet")
    _codes(ws, txn, sid)
    splits = subject_splits_path(ws.store)
    if splits.exists():
        frame = pl.read_parquet(splits)
        write_subject_splits(txn.stage(splits), frame.filter(pl.col("subject_id") != sid))
    txn.stage(ws.store / SUPPRESSED_FILE).write_text(json.dumps(sorted(suppressed_hashes(ws.store) | {subject_hash})))
    txn.stage(ws.generation_file).write_text(json.dumps({"generation": ws.generation() + 1}))
    return removed


def remove_stay_artifacts(ws: Workspace, txn: Transaction, sid: int, stay_files: list) -> dict:
    """Per-stay results and memories (they hold only this patient); the learned-key encoder, trained on the
    training split and so possibly on this patient (the next run retrains it)."""
    removed = {"label_rows": _labels(ws, txn, sid)}
    if ws.results.exists():
        mine = pl.col("subject_ref") == owner(ws, sid)
        res = pl.scan_parquet(ws.results)
        removed["per_stay_result_rows"] = int(res.filter(mine).select(pl.len()).collect().item())
        res.filter(~mine).sink_parquet(txn.stage(ws.results))
    # The per-stay caches are keyed by content, not by patient: the subject's whole shard of them goes (the
    # next run recomputes that shard's stays), so nothing computed from their rows survives in the cache.
    shard = int(sid) % N_BUCKETS
    dropped = [d for d in sorted(ws.cache.glob(f"*/{shard}")) + sorted(ws.cache.glob(f"*/{shard}.json"))
               if d.exists()]
    for d in dropped:
        txn.delete(d)
    removed["cache_shard_entries"] = len(dropped)
    removed["per_stay_memories"] = len(stay_files)
    for p in stay_files:
        txn.delete(p)
    if ws.encoder.exists():
        txn.delete(ws.encoder)
        removed["learned_key_encoder"] = "deleted; retrained by the next scheduled run"
    return removed
