"""Extraction of a MIMIC-IV directory (``hosp/``, ``icu/``; ``.csv`` or ``.csv.gz``) or of a MEDS dataset into
the event store, itself a valid MEDS dataset (layout and columns: :mod:`pipeline.meds`). Besides it::

    stays.parquet                      the ICU stays (stay_id, subject_id, hadm_id, first_careunit, intime,
                                       outtime, anchor_age, gender): MIMIC-IV's icustays, or a MEDS source's
                                       stay table, or stays derived from its admission/discharge codes
    quarantine/run-<id>.parquet        rejected rows with the rule that rejected them (never silently dropped)
    manifest.json                      per source file: size, mtime, sha256, rows seen; and the run history

A table is a file (``icu/chartevents.csv.gz``) or a folder of files with one header (``icu/chartevents/*.csv.gz``,
e.g. one per day as hospital extracts arrive); a rerun reads only a folder's new or changed files.

Incremental runs: a source file whose size, mtime and sha256 match the manifest is skipped. A changed file is
re-read in full, and only rows whose (event_hash, occurrence) pair is not already in the store (or in the
quarantine) are written: ``event_hash`` is the md5 of the row's content, ``occurrence`` numbers repeats of
identical rows, so appended rows are added once and a re-run never double-counts.

Out of core: the changed files are read side by side (one gzip stream is one thread's work) and their typed rows
written once to parquet under ``.work/staged``, partitioned by the subject's shard; then shard by shard the rows
are checked against the rules, the store's shard and the quarantine, and the shard is written. No step holds or
scans a whole changed table, so memory grows with the largest shard and time with the rows. DuckDB runs with
``memory_limit`` and ``temp_directory`` set; nothing is collected into Python.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import json
import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import duckdb
import polars as pl
import pyarrow.parquet as pq

from . import progress
from .extract_rules import (EVENT_TABLES, HASHED_CODE, HASHED_TEXT, ONE_EVENT_PER_ROW, REQUIRED_TABLES, TABLES,
                            bigint, csv_reader, dictionary_selects, event_selects, header_names,
                            quarantine_reason, sql_literal, table_view, ts)
from .meds import (EVENT_COLUMNS, SHARD_ORDER, STAY_COLUMNS, MedsSourceError, MedsStayCodes, ShardWriter,
                   code_tables_path, codes_metadata_path, codes_of, count_code_tables,
                   is_meds_dataset, meds_shards, quarantine_dir, quarantine_files, read_codes_metadata, shard_files,
                   shard_path, shard_table, splice_shard, stage_meds, stays_path, write_codes_metadata,
                   write_dataset_metadata)
from .migrate import check_format, mark_current
from .errors import ExtractionError
from .deleted import DeletedSubjects, deleted_subjects, suppression_files
from .privacy import HOW_TO, check_key, keyed_hash
from .transaction import atomic_write_text
from .shard_changes import file_state, record_splice
from .sharding import Sharding, is_recorded


@dataclass
class ExtractSummary:
    source: str
    out: str
    run_id: str
    tables: dict = field(default_factory=dict)   # table -> {rows, events, quarantined{reason: n}, new, skipped}
    missing_tables: list = field(default_factory=list)
    new_events: int = 0
    suppressed_rows: int = 0
    # the certificates of the deleted patients whose rows the source still held (left out), at most a few named
    suppressed_certificates: str = ""
    total_events: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def find_table(source: Path, name: str) -> Path | tuple[Path, ...] | None:
    """A table's file (``hosp/name.csv.gz`` or ``.csv``), or its folder's files in name order (``hosp/name/``,
    ``*.csv.gz`` and ``*.csv``), or None."""
    folder, _ = TABLES[name]
    for ext in (".csv.gz", ".csv"):
        p = Path(source) / folder / f"{name}{ext}"
        if p.exists():
            return p
    d = Path(source) / folder / name
    files = tuple(sorted(f for f in d.iterdir() if f.is_file() and not f.name.startswith(".")
                         and f.name.endswith((".csv.gz", ".csv")))) if d.is_dir() else ()
    return files or None


def table_files(table: str, found: Path | tuple[Path, ...]) -> dict[str, Path]:
    """A table's files by their manifest key: the table's name for a file, ``name/file`` for a folder's files."""
    return {f"{table}/{f.name}": f for f in found} if isinstance(found, tuple) else {table: found}


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _where(path: Path | tuple) -> str:
    """A table's place in a message: its file, or its folder (a folder of files)."""
    return f"{path[0].parent}/" if isinstance(path, tuple) else str(path)


def _read_problem(path, err: Exception) -> ExtractionError:
    """One line naming the file (a folder table's folder) and what is wrong with it, from DuckDB's multi-line
    error."""
    msg = str(err)
    path = _where(path)
    if "Unexpected end of GZIP stream" in msg:
        what = "the gzip stream ends early: the file is truncated (copy it again)"
    elif "not a GZIP stream" in msg or "Input is not a GZIP" in msg:
        what = "named .gz but not gzip-compressed (rename it to .csv, or compress it)"
    elif "Invalid unicode" in msg or "not utf-8" in msg:
        line = next((x for x in msg.splitlines() if x.startswith("CSV Error on Line")), "").replace("CSV Error on ", "")
        what = f"not UTF-8 text{f' ({line.lower()})' if line else ''}: convert it, e.g. iconv -f latin1 -t utf-8"
    elif ("Expected Number of Columns" in msg or "too many columns" in msg.lower()
          or "does not match the number of columns" in msg):
        line = next((x for x in msg.splitlines() if x.startswith("CSV Error on Line")), "").replace("CSV Error on ", "")
        what = f"a row has more or fewer fields than the header{f' ({line.lower()})' if line else ''}"
    elif "not possible to automatically detect the CSV parsing dialect" in msg:
        what = "not comma-separated text with a header line (a binary or otherwise damaged file?)"
    else:
        what = f"cannot be read as CSV: {msg.splitlines()[0] if msg else type(err).__name__}"
    return ExtractionError(f"{path}: {what}")


def _is_empty(path) -> bool:
    try:
        with (gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb")) as fh:
            return fh.read(1) == b""
    except (OSError, EOFError):          # not gzip, or truncated: DuckDB's read names the problem
        return False


def _read_whole_tables(con, paths) -> None:
    """Read every table that is not an event table in full before anything is written, so a damaged
    dictionary or patients file fails the extraction up front."""
    for name, path in paths.items():
        if name not in EVENT_TABLES:
            try:
                con.execute(f"SELECT count(*) FROM {csv_reader(path)}").fetchall()
            except duckdb.Error as e:
                raise _read_problem(path, e) from None


def _check_stays(con, path, empty: str = "no ICU stays (a header only): every ICU event would be quarantined "
                                             "as unknown_stay") -> None:
    """The stay table defines every ICU event's stay. An empty one is an error (it would quarantine every ICU
    event); a row without a numeric stay and subject id or a parsable window (a malformed row, a repeated header
    line) is left out of it, its events quarantined with their reason (``bad_subject_id``, ``bad_stay_id``,
    ``unparsable_time``, or ``unknown_stay`` for the events it would have held): one row never stops a run."""
    n, = con.execute("SELECT count(*) FROM stays").fetchone()
    if n == 0:
        raise ExtractionError(f"{path}: {empty}")
    counts = con.execute("SELECT count(*) FILTER (WHERE subject_id IS NULL), count(*) FILTER (WHERE stay_id IS NULL), "
                         "count(*) FILTER (WHERE intime IS NULL OR outtime IS NULL) FROM stays").fetchone()
    bad = {f: k for f, k in zip(("non-numeric or missing subject_id", "non-numeric or missing stay_id",
                                 "unparsable or missing intime/outtime"), counts) if k}
    if bad:
        con.execute("DELETE FROM stays WHERE subject_id IS NULL OR stay_id IS NULL OR intime IS NULL "
                    "OR outtime IS NULL")
        if not con.execute("SELECT count(*) FROM stays").fetchone()[0]:
            # counts per field, no values: an id in a message would reach logs and Prefect's database
            raise ExtractionError(f"{path}: no usable ICU stay: "
                                  + ", ".join(f"{k} with a {f}" for f, k in bad.items()))


def _header(con, path):
    if _is_empty(path):
        raise ExtractionError(f"{path}: the file is empty (not even a header line)")
    names = header_names(path)
    if names is not None:       # the header line as text: DuckDB opening ~30 files cost every command ~0.5 s
        return [c.lower() for c in names]
    try:                        # not readable as text: DuckDB's read names the problem
        rel = con.sql(f"SELECT * FROM {csv_reader(path)} LIMIT 0")
    except duckdb.Error as e:
        raise _read_problem(path, e) from None
    return [c.lower() for c in rel.columns]


DEFAULT_MEMORY_LIMIT = "4GB"    # DuckDB's memory limit of an extraction unless a run sets one (it spills past it)


def staging_dir(store: Path) -> Path:
    """Where an extraction stages the changed tables' rows by shard (removed when it ends, and at its start)."""
    return Path(store) / ".work" / "staged"


def scratch_paths(store: Path) -> list[Path]:
    """What an interrupted extraction may have left that holds patients' rows: its staged rows, DuckDB's spill
    files and earlier versions' scratch database (a deletion removes them)."""
    work = Path(store) / ".work"
    return [p for p in (staging_dir(store), work / "spill") if p.exists()] + sorted(work.glob("extract.duckdb*"))


def connect(workdir: Path, memory_limit: str | None = None, threads: int | None = None) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB spilling to ``workdir/spill``: scratch tables (which hold patients' rows) never
    outlive the connection, so no deleted patient survives in a scratch database."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for stale in workdir.glob("extract.duckdb*"):    # the scratch database file of earlier versions
        stale.unlink()
    con = duckdb.connect()
    con.execute(f"SET memory_limit={sql_literal(memory_limit or DEFAULT_MEMORY_LIMIT)}")
    con.execute(f"SET temp_directory={sql_literal(workdir / 'spill')}")
    con.execute("SET preserve_insertion_order=false")
    if threads:
        con.execute(f"SET threads={int(threads)}")
    return con


def check_source(source: Path | str) -> tuple[dict, list]:
    """(table -> path, missing optional tables); raise ExtractionError when ``source`` lacks a required table
    or column (reads headers only). A MEDS dataset (no tables: ({}, [])) is checked by :func:`meds_source`."""
    if is_meds_dataset(Path(source)):
        meds_source(source)
        return {}, []
    con = duckdb.connect()
    try:
        return _check_source(con, source)
    finally:
        con.close()


def _check_source(con, source):
    source = Path(source)
    if not source.is_dir():
        raise ExtractionError(f"source directory {source} does not exist")
    paths, missing = {}, []
    for name, (folder, required) in TABLES.items():
        p = find_table(source, name)
        if p is None:
            missing.append(f"{folder}/{name}")
            continue
        first = None
        for key, f in table_files(name, p).items():
            cols = _header(con, f)
            absent = [c for c in required if c not in cols]
            if absent:
                raise ExtractionError(f"{folder}/{key if isinstance(p, tuple) else f.name} lacks required "
                                      f"column(s) {absent}")
            if first is not None and cols != first:
                raise ExtractionError(f"{f}: its header differs from the first file's of {folder}/{name}/ (the "
                                      f"files of a table's folder share one header)")
            first = cols
        paths[name] = p
    lacking = [f"{TABLES[t][0]}/{t}" for t in REQUIRED_TABLES if t not in paths]
    if lacking:
        raise ExtractionError(f"source {source} lacks required table(s) {lacking} (.csv or .csv.gz)")
    if not any(t in paths for t in EVENT_TABLES if t not in REQUIRED_TABLES):
        raise ExtractionError(f"source {source} has no event table (one of labevents, chartevents, ...)")
    return paths, missing


def meds_source(source: Path | str) -> list[Path]:
    """The data shards of a MEDS dataset, checked (:func:`pipeline.meds.meds_shards`), or an ExtractionError."""
    try:
        return meds_shards(Path(source))
    except MedsSourceError as e:
        raise ExtractionError(str(e)) from None


def load_manifest(out: Path) -> dict:
    """The store's manifest: per source file its path, size, mtime, sha256 and rows; the run history."""
    p = Path(out) / "manifest.json"
    return json.loads(p.read_text()) if p.exists() else {"files": {}, "runs": []}


def _changed_files(files: dict, manifest: dict, summary: ExtractSummary) -> dict:
    """The source files (name -> path) that differ from the manifest's; unchanged ones are skipped. A file at the
    same path with the size and modification time recorded is unchanged without reading it (a nightly rerun
    hashed every source file, gigabytes at full scale); any other is compared by sha256 (a file touched but not
    changed records its new time, so the next run does not read it either). A table's skipped files are counted
    under the table (a folder's files' keys are ``table/file``)."""
    changed = {}

    def skipped(name, rows):
        table = "meds" if name.startswith("meds:") else name.split("/")[0]
        summary.tables[table] = {"skipped": True, "rows": summary.tables.get(table, {}).get("rows", 0) + rows}
    for name, p in files.items():
        prev, st = manifest["files"].get(name), p.stat()
        same_file = prev and prev.get("path") == str(p) and prev["size"] == st.st_size
        if same_file and prev.get("mtime_ns") == st.st_mtime_ns:
            skipped(name, prev["rows"])
            continue
        digest = _sha256(p)
        if prev and prev["sha256"] == digest and prev["size"] == st.st_size:
            skipped(name, prev["rows"])
            if same_file:
                prev["mtime_ns"] = st.st_mtime_ns
        else:
            changed[name] = {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    return changed


# what every source's events are typed into before the rules judge them
STAGED_COLUMNS = ("subject_id", "raw_time", "time", "code", "numeric_value", "text_value", "unit", "hadm_id",
                  "stay_id", "raw_numeric", "source_table")


def _stage_rows(con, select: str, staging: Path, sharding: Sharding, params: list | None = None) -> int:
    """Write ``select``'s rows (the staged columns) once into ``staging``, partitioned by the subject's shard
    (``bucket=K/``; rows without a subject in DuckDB's null partition); the rows written. Every later step reads one
    shard's rows at a time, so no step holds or scans the whole of a changed table."""
    staging.mkdir(parents=True, exist_ok=True)
    n = con.execute(f"""COPY (SELECT *, {sharding.sql('subject_id')} AS bucket FROM ({select}))
                        TO {sql_literal(staging)} (FORMAT parquet, PARTITION_BY (bucket), APPEND,
                                                   FILENAME_PATTERN 'rows_{{uuid}}')""", params or []).fetchall()
    return int(n[0][0]) if n else 0


STAGING_WORKERS = 4      # source files staged at once: each gzip stream is read by one thread


def _stage_file(con, table: str, info: dict, paths: dict, staging: Path, sharding: Sharding) -> None:
    """One changed source file's events into ``staging`` (its rows counted into ``info``), on its own cursor."""
    cur = con.cursor()
    try:
        cur.execute(f"CREATE OR REPLACE TEMP VIEW t AS {table_view(table, info['path'], paths)}")
        staged = sum(_stage_rows(cur, f"SELECT *, ? AS source_table FROM ({q})", staging, sharding, [table])
                     for q in event_selects(table))
        # a table of one event per row was counted by staging it; any other is read once more to count
        info["rows"] = staged if table in ONE_EVENT_PER_ROW else cur.execute("SELECT count(*) FROM t").fetchall()[0][0]
    except duckdb.Error as e:
        raise _read_problem(info["path"], e) from None
    finally:
        cur.close()


def _stage(con, paths, changed, staging: Path, sharding: Sharding) -> None:
    """Temp table ``stays`` (validated); every event of the changed tables, typed, into ``staging`` by shard.
    Files are read side by side, largest first: decompressing one gzip stream is one thread's work, so one file
    at a time left the other cores idle."""
    with progress.phase("reading the patient, stay and dictionary tables"):
        _read_whole_tables(con, paths)
        _stage_stays(con, paths)
    order = sorted(changed.items(), key=lambda kv: -kv[1]["size"])
    workers = max(1, min(STAGING_WORKERS, os.cpu_count() or 1, len(order)))
    with progress.step("reading changed source files", total=len(changed), unit="files") as advance, \
            ThreadPoolExecutor(max_workers=workers) as pool:
        # each file into its own folder: writers of one partitioned folder would race on its files
        futures = [pool.submit(_stage_file, con, key.split("/")[0], info, paths, staging / f"file-{i}", sharding)
                   for i, (key, info) in enumerate(order)]
        try:
            for f in as_completed(futures):
                f.result()
                advance()
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def _stage_stays(con, paths) -> None:
    """Temp table ``stays``: the ICU stays with their patient's age and gender, validated."""
    con.execute(f"""CREATE TEMP TABLE stays AS SELECT {bigint('i.stay_id')} AS stay_id,
                        {bigint('i.subject_id')} AS subject_id, {bigint('i.hadm_id')} AS hadm_id, i.first_careunit,
                        {ts('i.intime')} AS intime, {ts('i.outtime')} AS outtime,
                        {bigint('p.anchor_age')} AS anchor_age, p.gender AS gender
                    FROM {csv_reader(paths['icustays'])} i
                    LEFT JOIN {csv_reader(paths['patients'])} p ON i.subject_id = p.subject_id""")
    _check_stays(con, _where(paths["icustays"]))


def _staged_buckets(staging: Path) -> list[tuple[int | None, list[Path]]]:
    """The shards the staged rows fall in (None: rows without a subject), each with its folders of rows."""
    found = {}
    for d in staging.glob("*/bucket=*") if staging.exists() else []:
        value = d.name.split("=", 1)[1]
        # the null partition's name changed with DuckDB 2 ("NULL" before): any name not a shard number is it
        found.setdefault(int(value) if value.isdigit() else None, []).append(d)
    return sorted(found.items(), key=lambda kv: -1 if kv[0] is None else kv[0])


@dataclass
class _Suppression:
    """The deleted subjects an extraction leaves out (by keyed hash under ``key``), and whom it met."""
    deleted: DeletedSubjects
    key: bytes
    met: set = field(default_factory=set)

    def drop(self, con, table: str) -> int:
        """Drop deleted subjects from ``table`` (the staged events of one shard, or the stay table, which is
        rewritten at every run, changed or not); the rows dropped."""
        if not len(self.deleted):
            return 0
        subjects = [r[0] for r in con.execute(f"SELECT DISTINCT subject_id FROM {table} "
                                              f"WHERE subject_id IS NOT NULL").fetchall()]
        gone = {int(s): h for s in subjects if (h := keyed_hash(int(s), self.key)) in self.deleted}
        if not gone:
            return 0
        self.met |= set(gone.values())
        ids = list(gone)
        n = con.execute(f"SELECT count(*) FROM {table} WHERE subject_id IN (SELECT unnest(?::BIGINT[]))", [ids]
                        ).fetchall()[0][0]
        con.execute(f"DELETE FROM {table} WHERE subject_id IN (SELECT unnest(?::BIGINT[]))", [ids])
        return int(n)


def _judge(con, out, bucket: int | None) -> None:
    """Temp table ``numbered``: every staged event of one shard (``bucket``; None: rows without a subject) with
    its quarantine reason, content hash, occurrence and whether it is new (not already in the store's shard or
    the quarantine). Identical rows share their subject, so numbering them within the shard is numbering them
    in the whole table."""
    # Labs (and a MEDS source's events) carry no stay_id: give them the ICU stay whose window contains them.
    con.execute("""UPDATE staged SET stay_id = s.stay_id FROM stays s
                   WHERE staged.source_table IN ('labevents', 'meds') AND staged.stay_id IS NULL
                     AND staged.subject_id = s.subject_id AND staged.time >= s.intime
                     AND staged.time <= s.outtime""")
    con.execute(f"""CREATE TEMP TABLE judged AS
        SELECT e.* REPLACE (NULLIF(e.text_value, '') AS text_value), {quarantine_reason()} AS reason,
               md5(concat_ws('|', e.source_table, e.subject_id, e.raw_time, {HASHED_CODE}, e.raw_numeric,
                                    {HASHED_TEXT}, e.unit, e.hadm_id, e.stay_id)) AS event_hash
        FROM staged e LEFT JOIN stays s ON e.stay_id = s.stay_id""")
    if con.execute("SELECT count(*) FROM duckdb_tables() WHERE table_name = 'unusable_stays'").fetchone()[0]:
        # a MEDS source's stays that have no window: their admission event is quarantined with the reason
        con.execute("""UPDATE judged SET reason = u.reason FROM unusable_stays u
                       WHERE judged.source_table = 'meds' AND judged.subject_id = u.subject_id
                         AND judged.time = u.intime AND judged.code = u.code AND judged.reason IS NULL""")
    # identical rows share their subject: only the staged subjects' rows can be seen already, and a list of
    # them skips the other subjects' row groups of the shard and the quarantine (a night touches few subjects)
    subjects = [int(r[0]) for r in con.execute("SELECT DISTINCT subject_id FROM judged WHERE subject_id IS NOT NULL"
                                               ).fetchall()]
    mine = "subject_id IS NULL" if bucket is None else f"subject_id IN ({', '.join(map(str, subjects)) or 'NULL'})"
    seen = [f"SELECT event_hash, occurrence FROM read_parquet({sql_literal(q)}) WHERE {mine}"
            for q in quarantine_files(out)]
    shard = shard_path(out, bucket) if bucket is not None else None
    if shard is not None and shard.exists():
        seen.append(f"SELECT event_hash, occurrence FROM read_parquet({sql_literal(shard)}) WHERE {mine}")
    is_new = (f"NOT EXISTS (SELECT 1 FROM ({' UNION ALL '.join(seen)}) x "
              f"WHERE x.event_hash = j.event_hash AND x.occurrence = j.occurrence)") if seen else "TRUE"
    con.execute(f"""CREATE TEMP TABLE numbered AS SELECT *, {is_new} AS is_new FROM (SELECT *,
                   row_number() OVER (PARTITION BY event_hash ORDER BY raw_time) AS occurrence FROM judged) j""")
    con.execute("DROP TABLE judged")


def _write_new(con, out, bucket: int | None, writer: ShardWriter) -> int:
    """One shard's new events into its file (rewritten whole and sorted: a subject stays in one file, contiguous
    and in time order; an existing shard is spliced, :func:`pipeline.meds.splice_shard`), handed to ``writer``,
    and its new rejected rows into the temp table ``rejected``; the new events written."""
    n_new = con.execute("SELECT count(*) FROM numbered WHERE is_new AND reason IS NULL").fetchall()[0][0]
    if n_new:
        shard = shard_path(out, bucket)
        cols = ", ".join(EVENT_COLUMNS)
        new = f"SELECT {cols} FROM numbered WHERE is_new AND reason IS NULL"
        if shard.exists():
            subjects = [int(r[0]) for r in con.execute(f"SELECT DISTINCT subject_id FROM ({new})").fetchall()]
            splice_shard(con, shard, subjects, f"SELECT {cols} FROM read_parquet({sql_literal(shard)}) WHERE "
                                               f"subject_id IN ({', '.join(map(str, subjects))}) UNION ALL {new}",
                         writer, partial(record_splice, out, bucket, file_state(shard), subjects))
        else:
            writer.put(shard_table(con, f"{new} ORDER BY {SHARD_ORDER}"), shard)
    con.execute("""INSERT INTO rejected SELECT subject_id, raw_time, code, numeric_value, text_value, unit, hadm_id,
                          stay_id, source_table, reason, event_hash, occurrence FROM numbered
                   WHERE is_new AND reason IS NOT NULL""")
    con.execute("""INSERT INTO tally SELECT source_table, reason, count(*), count(*) FILTER (WHERE is_new)
                   FROM numbered GROUP BY ALL""")
    return int(n_new)


def _check_and_write(con, out, run_id, staging: Path, suppressed: _Suppression | None,
                     sharding: Sharding) -> tuple[int, int]:
    """Shard by shard: the staged rows checked against the rules and the store, new events written into the
    shard and rejected rows kept for the quarantine (written last, one file for the run); per table and reason
    the rows seen and new into temp table ``tally``. Returns (new events, rows of deleted patients dropped)."""
    con.execute("CREATE TEMP TABLE tally (source_table VARCHAR, reason VARCHAR, n BIGINT, new BIGINT)")
    con.execute("CREATE TEMP TABLE rejected (subject_id BIGINT, raw_time VARCHAR, code VARCHAR, numeric_value DOUBLE, "
                "text_value VARCHAR, unit VARCHAR, hadm_id BIGINT, stay_id BIGINT, source_table VARCHAR, "
                "reason VARCHAR, event_hash VARCHAR, occurrence BIGINT)")
    new = dropped = 0
    buckets = _staged_buckets(staging)
    with progress.step("checking rows against the store and writing shards", total=len(buckets),
                       unit="shards") as advance, ShardWriter() as writer:
        for bucket, folders in buckets:
            files = ", ".join(sql_literal(d / "*.parquet") for d in folders)
            con.execute(f"CREATE TEMP TABLE staged AS SELECT {', '.join(STAGED_COLUMNS)} "
                        f"FROM read_parquet([{files}], hive_partitioning=false)")
            dropped += suppressed.drop(con, "staged") if suppressed is not None else 0
            _judge(con, out, bucket)
            new += _write_new(con, out, bucket, writer)
            con.execute("DROP TABLE staged")
            con.execute("DROP TABLE numbered")
            advance()
    if con.execute("SELECT count(*) FROM rejected").fetchall()[0][0]:
        quarantine_dir(out).mkdir(exist_ok=True)
        con.execute(f"COPY rejected TO {sql_literal(quarantine_dir(out) / f'run-{run_id}.parquet')} (FORMAT parquet)")
    return new, dropped


def _summarise(con, changed, summary, manifest, groups: dict) -> None:
    """Per changed table (``groups``: name -> (its source_table values, rows read)): rows, events, quarantined
    by reason, new events; the manifest entries of the changed files."""
    stats = con.sql("""SELECT source_table, sum(n) FILTER (WHERE reason IS NULL) AS events,
                              sum(n) FILTER (WHERE reason IS NOT NULL) AS quarantined
                       FROM tally GROUP BY ALL""").pl()
    reasons = con.sql("SELECT source_table, reason, sum(n) AS n FROM tally WHERE reason IS NOT NULL "
                      "GROUP BY ALL").pl()
    new = con.sql("SELECT source_table, sum(new) AS n FROM tally WHERE reason IS NULL GROUP BY ALL").pl()
    for name, (tables, rows) in groups.items():
        mine = pl.col("source_table").is_in(tables)
        row = stats.filter(mine)
        quarantined = reasons.filter(mine).group_by("reason").agg(pl.col("n").sum()).sort("reason")
        summary.tables[name] = {
            "skipped": False, "rows": rows,
            "events": int(row["events"].sum()), "quarantined_total": int(row["quarantined"].sum()),
            "quarantined": {r: int(n) for r, n in quarantined.iter_rows()},
            "new_events": int(new.filter(mine)["n"].sum()),
        }
    manifest["files"].update(changed)


def _write_stays(con, out) -> None:
    """The stay table for cohorts (all stays not suppressed, rewritten at every run)."""
    con.execute(f"COPY (SELECT {', '.join(STAY_COLUMNS)} FROM stays ORDER BY subject_id, intime) "
                f"TO {sql_literal(f'{stays_path(out)}.tmp')} (FORMAT parquet)")
    os.replace(f"{stays_path(out)}.tmp", stays_path(out))


def _sharding(out: Path, changed: dict) -> Sharding:
    """The store's shard count; a store with no shard yet gets one from the size of the source files it is
    made from (``changed``: every one of them, for a new store), recorded for every later run."""
    if is_recorded(out) or shard_files(out):
        return Sharding.of_store(out)
    sharding = Sharding.for_source(sum(int(info["size"]) for info in changed.values()))
    sharding.record(out)
    return sharding


def _open_store(out: Path, key: bytes | None) -> tuple[bool, _Suppression | None]:
    """Create or check the store directory; (created by this call, whom to leave out). The deleted subjects are
    read from the store and its workspace (:func:`pipeline.deleted.deleted_subjects`): a store rebuilt after a
    loss starts with none of its own, and its workspace still names them."""
    deleted = deleted_subjects(out)
    if key is None and len(deleted):
        raise ExtractionError(f"the store {out} has deleted patients on its suppression list; extracting into it "
                              f"needs the hash key that recognises them ({HOW_TO})")
    created = not out.exists()
    mark_current(out)       # before anything else is in it: a store beside a log is otherwise taken for format 2
    if key is None:
        return created, None
    check_key(out, key)
    if created and deleted.missing_from_store():
        # a new store holds no one yet, and leaves every deleted subject out: its list says so from the start
        hashes = json.dumps(sorted(deleted.certificates))
        atomic_write_text(suppression_files(out, None)[0], hashes)
    return created, _Suppression(deleted, key)


def extract(source: Path | str, out: Path | str, key: bytes | None = None, memory_limit: str | None = None,
            threads: int | None = None, stay_codes: MedsStayCodes | None = None) -> ExtractSummary | None:
    """Extract (or incrementally update) the event store in ``out`` from ``source``: a MIMIC-IV directory, or a
    MEDS dataset (recognised by ``metadata/dataset.json``; ``stay_codes`` says how its ICU stays are read).

    Returns an :class:`ExtractSummary`; rows rejected by a rule land in ``quarantine/`` with their reason and
    are counted per table and reason. Subjects on the store's suppression list (deleted patients, by keyed
    hash under ``key``) are dropped before anything is written, from events and stays alike (counted as
    ``suppressed_rows``), so a deleted patient never returns from a source that still holds them. A store
    with a suppression list is not extracted into without its key.
    """
    t0, out, source = time.perf_counter(), Path(out), Path(source)
    # headers only: a missing table, column or metadata file fails before out exists
    shards = meds_source(source) if is_meds_dataset(source) else []
    paths, missing = ({}, []) if shards else check_source(source)
    check_format(out)
    created, suppressed = _open_store(out, key)
    run_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]
    con = connect(out / ".work", memory_limit=memory_limit, threads=threads)
    staging = staging_dir(out)      # patients' rows (of deleted ones too, before suppression): never kept
    shutil.rmtree(staging, ignore_errors=True)
    try:
        manifest = load_manifest(out)
        summary = ExtractSummary(source=str(source), out=str(out), run_id=run_id, missing_tables=missing)
        if shards:
            changed, sharding, groups = _stage_meds_source(con, source, out, shards, manifest, summary,
                                                           stay_codes or MedsStayCodes())
        else:
            changed, sharding, groups = _stage_mimic_source(con, paths, out, manifest, summary)
        with progress.phase("dropping deleted patients' stays"):
            if suppressed is not None:
                suppressed.drop(con, "stays")
        summary.new_events, summary.suppressed_rows = _check_and_write(con, out, run_id, staging, suppressed,
                                                                                sharding)
        if suppressed is not None and suppressed.met:
            summary.suppressed_certificates = suppressed.deleted.named(suppressed.met)
        _finish(con, out, source, paths, (changed, groups, manifest), summary)
        summary.seconds = time.perf_counter() - t0
        atomic_write_text(out / "manifest.json", json.dumps(manifest, indent=1))
        atomic_write_text(out / "extract_summary.json", json.dumps(summary.to_dict(), indent=1, default=str))
        return summary
    except (ExtractionError, MedsSourceError) as e:
        if created:                      # a store this call began: nothing of it stays behind
            con.close()
            shutil.rmtree(out, ignore_errors=True)
        raise e if isinstance(e, ExtractionError) else ExtractionError(str(e)) from None
    finally:
        con.close()
        shutil.rmtree(staging, ignore_errors=True)


def _stage_meds_source(con, source: Path, out: Path, shards: list[Path], manifest: dict, summary: ExtractSummary,
                       stay_codes: MedsStayCodes) -> tuple[dict, Sharding, dict]:
    """A MEDS source's changed shards staged by subject's shard, and its stay table (temp table ``stays``);
    (changed files, the store's sharding, the table groups to summarise)."""
    changed = _changed_files({f"meds:{p.relative_to(source)}": p for p in shards}, manifest, summary)
    for info in changed.values():
        info["rows"] = pq.ParquetFile(info["path"]).metadata.num_rows
    sharding = _sharding(out, changed)
    events = stage_meds(con, source, shards, [Path(i["path"]) for i in changed.values()], stay_codes)
    _check_stays(con, source, "no ICU stays: no stays.parquet, and no code matches the ICU admission "
                              "pattern (meds_source.admission in the cohort config)")
    if events is not None:
        with progress.step("reading changed source files"):
            _stage_rows(con, events, staging_dir(out) / "file-0", sharding)
    groups = {"meds": (["meds", "meds_static"], sum(i["rows"] for i in changed.values()))} if changed else {}
    return changed, sharding, groups


def _stage_mimic_source(con, paths: dict, out: Path, manifest: dict,
                        summary: ExtractSummary) -> tuple[dict, Sharding, dict]:
    """A MIMIC-IV directory's changed event files staged by subject's shard, and its stay table (temp table
    ``stays``); (changed files, the store's sharding, the table groups to summarise)."""
    files = {k: f for t in EVENT_TABLES if t in paths for k, f in table_files(t, paths[t]).items()}
    changed = _changed_files(files, manifest, summary)
    sharding = _sharding(out, changed)
    _stage(con, paths, changed, staging_dir(out), sharding)
    groups = {}
    for name, info in changed.items():
        table = name.split("/")[0]
        groups[table] = ([table], groups.get(table, ([], 0))[1] + info["rows"])
    return changed, sharding, groups


def _finish(con, out: Path, source: Path, paths: dict, seen: tuple, summary: ExtractSummary) -> None:
    """After the shards: the counts per table and rule, the store's codes (when anything changed), the stay
    table, the store's event count and the manifest's run entry (``seen``: changed files, table groups,
    manifest)."""
    changed, groups, manifest = seen
    with progress.phase("counting rows per table and rule"):
        _summarise(con, changed, summary, manifest, groups)
    if changed or summary.new_events or not _metadata_current(out):
        with progress.step("counting the store's codes"):
            _write_metadata(con, out, source, paths)
    with progress.phase("writing the stay table"):
        _write_stays(con, out)
    # from the shards' footers: a count over every row cost a nightly rerun with nothing new a full scan
    summary.total_events = sum(pq.ParquetFile(f).metadata.num_rows for f in shard_files(out))
    manifest["runs"].append({"run_id": summary.run_id, "new_events": summary.new_events, "tables": sorted(changed)})


def _descriptions(con, source: Path, paths: dict) -> pl.DataFrame | None:
    """(code, description, parent_codes) known for the source's codes: from MIMIC-IV's dictionaries
    (:func:`pipeline.extract_rules.dictionary_selects`), or a MEDS source's own codes metadata."""
    if not paths:
        meta = read_codes_metadata(source)
        if meta is None:
            return None
        # description and parent_codes are optional columns of MEDS's code metadata
        return meta.select("code", (pl.col("description") if "description" in meta.columns
                                    else pl.lit(None, dtype=pl.String).alias("description")).cast(pl.String),
                           (pl.col("parent_codes") if "parent_codes" in meta.columns
                            else pl.lit(None).alias("parent_codes")).cast(pl.List(pl.String)))
    frames = [pl.from_arrow(con.sql(q).arrow()) for table, q in dictionary_selects(paths).items() if table in paths]
    if not frames:
        return None
    return (pl.concat(frames).unique("code", keep="first")
            .with_columns(pl.when(pl.col("parent").is_not_null()).then(pl.concat_list("parent"))
                          .otherwise(pl.lit(None, dtype=pl.List(pl.String))).alias("parent_codes"))
            .drop("parent"))


def _metadata_current(out: Path) -> bool:
    """Whether the store's code counts were written after its last shard was (a deletion rewrites them all)."""
    meta = [codes_metadata_path(out), code_tables_path(out)]
    return all(m.exists() for m in meta) and all(f.stat().st_mtime_ns <= m.stat().st_mtime_ns
                                                  for f in shard_files(out) for m in meta)


def _write_metadata(con, out: Path, source: Path, paths: dict) -> None:
    """``code_tables.parquet`` (every code in the store with its count per source table), ``metadata/codes.parquet``
    (every code with its count, source table, description and parent codes where known) and
    ``metadata/dataset.json``.

    Counts come from DuckDB and descriptions are joined in Polars, handed over as Arrow without copying.
    """
    if not shard_files(out):
        return
    counts = codes_of(count_code_tables(con, out))
    known = _descriptions(con, source, paths)
    codes = (counts.join(known, on="code", how="left") if known is not None else
             counts.with_columns(pl.lit(None, dtype=pl.String).alias("description"),
                                 pl.lit(None, dtype=pl.List(pl.String)).alias("parent_codes")))
    write_codes_metadata(codes_metadata_path(out), codes)
    write_dataset_metadata(out, dataset_name=f"forgetful store of {source.name}",
                           dataset_version=time.strftime("%Y-%m-%d"), etl_version=_version())


def _version() -> str:
    try:
        return importlib.metadata.version("forgetful")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
