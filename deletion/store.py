"""Step: the event store and the workspace's files without the subject, staged in the deletion's transaction."""
from __future__ import annotations

import gzip
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import polars as pl
import pyarrow.parquet as pq

from pipeline.extract import scratch_paths
from pipeline.extract_rules import sql_literal
from pipeline.meds import (code_tables_path, codes_metadata_path, codes_of, quarantine_files, read_codes_metadata,
                           shard_of, stays_path, subject_splits_path, write_code_tables, write_codes_metadata,
                           write_label_file, write_shard, write_subject_splits)
from pipeline.deleted import deleted_subjects, suppression_files
from pipeline.shard_changes import changes_path
from pipeline.sharding import Sharding

from .plan import DeletionFailed, owner

if TYPE_CHECKING:
    from pipeline.transaction import Transaction
    from pipeline.workspace import Workspace


def write_staged_parquet(txn: Transaction, frame: pl.DataFrame, final: Path) -> None:
    frame.write_parquet(txn.stage(final))


def _per_subject(frame: pl.DataFrame, sids: list[int], column: str = "subject_id") -> dict[int, int]:
    """Rows of each subject in ``frame`` (its ``column`` holds their ids)."""
    counts = frame.group_by(column).len() if frame.height else None
    found = dict(counts.iter_rows()) if counts is not None else {}
    return {sid: int(found.get(sid, 0)) for sid in sids}


def _write_without(shard: Path, gone: str, staged: Path) -> None:
    """``shard``'s rows of every subject but those in ``gone`` (ids, SQL) into ``staged``, streamed by DuckDB."""
    con = duckdb.connect()
    try:
        write_shard(con, f"SELECT * FROM read_parquet({sql_literal(shard)}) WHERE subject_id NOT IN ({gone})", staged)
    finally:
        con.close()


def _events(ws, txn, sids) -> tuple[dict[int, dict], pl.DataFrame]:
    """Each subject's shard rewritten without the deleted subjects (a shard is already sorted, so the kept rows
    stay a valid MEDS shard); per subject, the events removed per table, and the events removed per code and
    table (all subjects together). The shards are written side by side: a batch's subjects may touch many of
    them, and one shard's write is mostly a single thread's parquet encoding."""
    removed = {sid: {} for sid in sids}
    per_code = []
    gone = ", ".join(str(int(sid)) for sid in sids)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        writes = []
        for shard in sorted({shard_of(ws.store, sid) for sid in sids}):
            if not shard.exists():
                continue
            # an IN list of literals lets DuckDB skip the row groups (sorted by subject) that hold none of them
            found = duckdb.sql(f"SELECT subject_id, code, source_table, count(*) FROM read_parquet("
                               f"{sql_literal(shard)}) WHERE subject_id IN ({gone}) GROUP BY ALL").fetchall()
            for sid, code, table, n in found:
                removed[int(sid)][table] = removed[int(sid)].get(table, 0) + int(n)
                per_code.append((code, table, int(n)))
            if pq.ParquetFile(shard).metadata.num_rows > sum(n for *_, n in found):
                writes.append(pool.submit(_write_without, shard, gone, txn.stage(shard)))
            else:
                txn.delete(shard)
        for w in writes:
            w.result()
    return removed, pl.DataFrame(per_code, schema={"code": pl.String, "source_table": pl.String, "count": pl.Int64},
                                 orient="row")


def _without(frame: pl.DataFrame, sids: list[int], column: str = "subject_id") -> pl.DataFrame:
    return frame.filter(~pl.col(column).is_in(pl.Series(sids, dtype=frame.schema[column]).implode()))


def _quarantine(ws, txn, sids) -> dict[int, int]:
    removed = dict.fromkeys(sids, 0)
    for q in quarantine_files(ws.store):
        qf = pl.read_parquet(q)
        found = _per_subject(qf, sids)
        if any(found.values()):
            removed = {sid: removed[sid] + found[sid] for sid in sids}
            write_staged_parquet(txn, _without(qf, sids), q)
    return removed


def _codes(ws, txn, removed: pl.DataFrame) -> None:
    """The code counts without the removed events (``removed``: code, source_table, count), by subtraction from
    the counts per code and table; the codes metadata summed from them (descriptions and parent codes kept; a code
    only deleted subjects had leaves it)."""
    old = read_codes_metadata(ws.store)
    if old is None:
        return
    per_table_path = code_tables_path(ws.store)
    recount = "run `forgetful extract` on the source again, which counts them from the events when the file is gone"
    if not per_table_path.exists():
        raise DeletionFailed(f"{per_table_path}: missing, so the code counts cannot lose the patients' events; "
                             f"{recount}")
    gone = removed.group_by("code", "source_table").agg(pl.col("count").sum().alias("removed"))
    per_table = (pl.read_parquet(per_table_path).join(gone, on=["code", "source_table"], how="left")
                 .with_columns(pl.col("count") - pl.col("removed").fill_null(0)).drop("removed"))
    if gone.join(per_table, on=["code", "source_table"], how="anti").height or (per_table["count"] < 0).any():
        raise DeletionFailed(f"{per_table_path}: counts fewer events of a code than the store holds; delete it and "
                             f"{recount}")
    write_code_tables(txn.stage(per_table_path), per_table)
    new = codes_of(per_table).join(old.select("code", "description", "parent_codes"), on="code", how="left")
    write_codes_metadata(txn.stage(codes_metadata_path(ws.store)), new)


def label_files(ws: Workspace) -> list[Path]:
    """The runs' MEDS label files (they name subjects by their raw id, as MEDS does)."""
    return sorted(ws.labels.glob("*.parquet")) if ws.labels.exists() else []


def _labels(ws, txn, sids) -> dict[int, int]:
    """The label files rewritten without the subjects; per subject, the rows removed."""
    removed = dict.fromkeys(sids, 0)
    for f in label_files(ws):
        frame = pl.read_parquet(f)
        found = _per_subject(frame, sids)
        if any(found.values()):
            removed = {sid: removed[sid] + found[sid] for sid in sids}
            write_label_file(_without(frame, sids), txn.stage(f))
    return removed


def source_files(ws: Workspace) -> list:
    """The embedded generator's CSVs in the workspace: the workspace's own copy of patients' raw rows."""
    return sorted(ws.source.rglob("*.csv*")) if ws.source.exists() else []


def read_source(path: Path) -> pl.DataFrame:
    return pl.read_csv(path, infer_schema=False)     # every field as text: rewritten rows keep their content


def remove_from_source(ws: Workspace, txn: Transaction, sids: list[int]) -> dict[int, int]:
    """The workspace's generated source rewritten without the subjects; per subject, the rows removed."""
    removed = dict.fromkeys(sids, 0)
    for f in source_files(ws):
        frame = read_source(f)
        if "subject_id" not in frame.columns:
            continue
        found = _per_subject(frame, [str(sid) for sid in sids])
        if any(found.values()):
            removed = {sid: removed[sid] + found[str(sid)] for sid in sids}
            data = _without(frame, [str(sid) for sid in sids]).write_csv().encode()
            txn.stage(f).write_bytes(gzip.compress(data, mtime=0) if f.name.endswith(".gz") else data)
    return removed


def rewrite_store(ws: Workspace, txn: Transaction, subjects: dict[int, str]) -> dict[int, dict]:
    """Events, quarantine, generated source, stays, code counts and split without the subjects (``subjects``:
    id -> keyed hash); their hashes on the suppression lists (the store's and the workspace's); the store's
    generation bumped once (no cache over the old content is reused). Per subject, what was removed."""
    sids = sorted(subjects)
    (events, removed_codes), quarantine, source = _events(ws, txn, sids), _quarantine(ws, txn, sids), \
        remove_from_source(ws, txn, sids)
    for scratch in scratch_paths(ws.store):     # an interrupted extraction's rows of any patient
        txn.delete(scratch)
    sharding = Sharding.of_store(ws.store)
    for record in sorted({changes_path(ws.store, sharding.shard(sid)) for sid in sids}):
        if record.exists():     # names the subjects its shard's splices changed; the shard is rewritten anyway
            txn.delete(record)
    stays = pl.read_parquet(stays_path(ws.store))
    in_stays = _per_subject(stays, sids)
    write_staged_parquet(txn, _without(stays, sids), stays_path(ws.store))
    _codes(ws, txn, removed_codes)
    splits = subject_splits_path(ws.store)
    if splits.exists():
        write_subject_splits(txn.stage(splits), _without(pl.read_parquet(splits), sids))
    # the store's list and the workspace's, beside the log: a store lost or restored from an older backup
    # leaves the workspace's (and the certificates) to say who never comes back
    hashes = json.dumps(sorted(set(deleted_subjects(ws.store, ws.root).certificates) | set(subjects.values())))
    for f in suppression_files(ws.store, ws.root):
        txn.stage(f).write_text(hashes)
    txn.stage(ws.generation_file).write_text(json.dumps({"generation": ws.generation() + 1}))
    return {sid: {"events_by_table": events[sid], "quarantine_rows": quarantine[sid], "source_rows": source[sid],
                  "stays": in_stays[sid]} for sid in sids}


def remove_stay_artifacts(ws: Workspace, txn: Transaction, stay_files: dict[int, list],
                          drop_cache: bool = True) -> dict[int, dict]:
    """Per-stay results and memories (each holds one patient); the learned-key encoder, trained on the training
    split and so possibly on these patients (the next run retrains it). ``stay_files``: per subject, their stays'
    memory files. ``drop_cache``: drop the subjects' shards of the per-stay caches (a replay that reruns the run
    compacts them instead, :mod:`.derived`). Per subject, what was removed."""
    sids = sorted(stay_files)
    labels = _labels(ws, txn, sids)
    results = dict.fromkeys(sids, 0)
    if ws.results.exists():
        refs = {owner(ws, sid): sid for sid in sids}
        res = pl.scan_parquet(ws.results)
        mine = pl.col("subject_ref").is_in(pl.Series(list(refs), dtype=pl.String).implode())
        for ref, n in res.filter(mine).group_by("subject_ref").len().collect().iter_rows():
            results[refs[ref]] = int(n)
        res.filter(~mine).sink_parquet(txn.stage(ws.results))
    # The per-stay caches are keyed by content, not by patient: each subject's whole shard of them goes (the
    # next run recomputes that shard's stays), so nothing computed from their rows survives in the cache.
    dropped = dict.fromkeys(sids, [])
    sharding = Sharding.of_store(ws.store)
    for sid in sids if drop_cache else []:
        shard = sharding.shard(sid)
        dropped[sid] = [d for d in sorted(ws.cache.glob(f"*/{shard}")) + sorted(ws.cache.glob(f"*/{shard}.json"))
                        if d.exists()]
    for d in sorted({d for ds in dropped.values() for d in ds}):
        txn.delete(d)
    for p in (p for files in stay_files.values() for p in files):
        txn.delete(p)
    encoder = ws.encoder.exists()
    if encoder:
        txn.delete(ws.encoder)
    return {sid: {"label_rows": labels[sid], "per_stay_result_rows": results[sid],
                  "cache_shard_entries_dropped": len(dropped[sid]), "per_stay_memories": len(stay_files[sid]),
                  **({"learned_key_encoder": "deleted; retrained by the next scheduled run"} if encoder else {})}
            for sid in sids}
