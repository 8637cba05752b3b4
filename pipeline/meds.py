"""The event store as a MEDS dataset (Medical Event Data Standard, the ``meds`` package, 0.4), and MEDS datasets
as a source.

Store layout (``store/``), a valid MEDS dataset::

    data/<K>.parquet               the events of subjects with subject_id % count == K (the store's shard
                                   count, :mod:`pipeline.sharding`), sorted by subject, time, code: each subject
                                   lies in one shard, contiguous and in time order (as MEDS requires); an
                                   incremental run or a deletion rewrites a shard whole
    metadata/dataset.json          dataset_name, dataset_version, etl_name, etl_version, meds_version, created_at
    metadata/codes.parquet         code, description, parent_codes; and the store's count, source_table
    code_tables.parquet            code, source_table, count: the counts per table that codes.parquet sums (so
                                   a deletion updates them by subtraction; not part of MEDS)
    sharding.json                  the shard count (not part of MEDS)
    shard_changes/<K>.json         the subjects each splice of shard K changed (:mod:`pipeline.shard_changes`;
                                   not part of MEDS)
    metadata/subject_splits.parquet  the cohort's subject-level split (train / held_out), written by a run

Event columns: MEDS's subject_id (int64), time (timestamp[us]), code, numeric_value (float32) and text_value
(large_string); extra columns unit, hadm_id, stay_id, source_table, event_hash, occurrence. MEDS stores values
in single precision; every quantity this product reads (vital signs, labs, volumes, doses) is charted with far
fewer significant digits than float32's 7, so nothing measured is lost, and the solver's fp64 starts from
these values.
"""
from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import meds
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import InputError
from .extract_rules import sql_literal
from .sharding import Sharding
from .transaction import atomic_write_text

if TYPE_CHECKING:
    from collections.abc import Callable

DATA = "data"
METADATA = "metadata"
ETL_NAME = "forgetful"

EVENT_SCHEMA = pa.schema([
    pa.field("subject_id", pa.int64(), nullable=False), ("time", pa.timestamp("us")),
    pa.field("code", pa.string(), nullable=False), ("numeric_value", pa.float32()),
    ("text_value", pa.large_string()), ("unit", pa.string()), ("hadm_id", pa.int64()), ("stay_id", pa.int64()),
    ("source_table", pa.string()), ("event_hash", pa.string()), ("occurrence", pa.int64())])
EVENT_COLUMNS = EVENT_SCHEMA.names
SHARD_SORT = ["subject_id", "time", "code", "event_hash", "occurrence"]   # static (no time) rows first
SHARD_ORDER = "subject_id, time NULLS FIRST, code, event_hash, occurrence"  # the same order in SQL
CODE_COLUMNS = ("code", "description", "parent_codes", "count", "source_table")   # metadata/codes.parquet


class MedsSourceError(InputError):
    """A MEDS source directory that cannot be read as one (missing metadata, a wrong column type)."""


def shard_of(store: Path, subject_id: int) -> Path:
    """The shard that holds (or would hold) a subject's events."""
    return shard_path(store, Sharding.of_store(store).shard(subject_id))


def shard_path(store: Path, shard: int) -> Path:
    """The file of shard number ``shard``."""
    return Path(store) / DATA / f"{int(shard)}.parquet"


def shard_files(store: Path) -> list[Path]:
    d = Path(store) / DATA
    return sorted(d.glob("*.parquet"), key=lambda p: int(p.stem)) if d.exists() else []


def events_glob(store: Path) -> Path:
    return Path(store) / DATA / "*.parquet"


def stays_path(store: Path) -> Path:
    """The store's ICU stay table (one row per stay; not part of MEDS, beside it)."""
    return Path(store) / "stays.parquet"


def quarantine_dir(store: Path) -> Path:
    """Rows the extraction set aside, with their reason, one file per source table."""
    return Path(store) / "quarantine"


def quarantine_files(store: Path) -> list[Path]:
    return sorted(quarantine_dir(store).glob("*.parquet"))


# A shard's event_hash is 32 random hex characters a row: dictionary encoding gives up on it and snappy finds
# nothing to compress, yet both were tried on every page, most of a shard's write time (a 710k-row shard: 0.80 s
# with both, 0.29 s without; the file 17 % larger). Every other column keeps pyarrow's defaults.
SHARD_WRITE_OPTIONS = {"use_dictionary": [c for c in EVENT_SCHEMA.names if c != "event_hash"],
                       "compression": {c: "none" if c == "event_hash" else "snappy" for c in EVENT_SCHEMA.names}}


ROW_GROUP_ROWS = 100_000   # rows of a written file's row groups (a shard's subject filters skip the others)


def write_shard(con: duckdb.DuckDBPyConnection, query: str, path: Path, params: list | None = None) -> None:
    """Stream ``query``'s rows (the event columns) into ``path`` with the MEDS schema, atomically."""
    write_query(con, query, path, EVENT_SCHEMA, params, SHARD_WRITE_OPTIONS)


def splice_shard(con: duckdb.DuckDBPyConnection, path: Path, subjects: list[int], rows: str,
                 writer: ShardWriter | None = None, then: Callable[[], None] | None = None) -> None:
    """Rewrite shard ``path`` with the rows of ``subjects`` replaced by ``rows`` (a query of all their event
    columns' rows, old and new): the other subjects' rows are copied in their order and theirs, sorted, put in
    their place. The file a sort of the whole shard gives, without sorting the whole shard: a night changes few
    of a shard's subjects, and the sort was a third of rewriting it. ``writer``: writes it (default: here, at once);
    ``then``: called once the file is in place."""
    names = EVENT_SCHEMA.names
    old = pq.read_table(path).select(names).cast(EVENT_SCHEMA)
    new = shard_table(con, f"SELECT * FROM ({rows}) ORDER BY {SHARD_ORDER}")
    at = np.unique(np.asarray(subjects, dtype=np.int64))
    old_ids, new_ids = old.column("subject_id").to_numpy(), new.column("subject_id").to_numpy()
    pieces, copied = [], 0
    for lo, hi, first, last in zip(np.searchsorted(old_ids, at, "left"), np.searchsorted(old_ids, at, "right"),
                                   np.searchsorted(new_ids, at, "left"), np.searchsorted(new_ids, at, "right")):
        pieces += [old.slice(copied, lo - copied), new.slice(first, last - first)]
        copied = hi
    pieces.append(old.slice(copied))
    (writer.put if writer is not None else write_shard_table)(pa.concat_tables(pieces), Path(path), then)


def write_shard_table(table: pa.Table, path: Path, then: Callable[[], None] | None = None) -> None:
    """A shard from a table with the MEDS schema, in its order, atomically (row groups of ROW_GROUP_ROWS);
    ``then``: called once the file is in place."""
    _atomic_table(table, path, {**SHARD_WRITE_OPTIONS, "row_group_size": ROW_GROUP_ROWS})
    if then is not None:
        then()


def shard_table(con: duckdb.DuckDBPyConnection, query: str) -> pa.Table:
    """``query``'s rows (the event columns, in its order) as a table with the MEDS schema."""
    return con.sql(query).to_arrow_table().select(EVENT_SCHEMA.names).cast(EVENT_SCHEMA)


class ShardWriter:
    """Writes shard tables (atomically, in row groups of ROW_GROUP_ROWS) on one thread of its own while its
    caller builds the next: pyarrow's writer releases the GIL, so a shard's write overlaps the next shard's
    checks and query instead of following them (a night's rerun rewrites many shards). At most one write is
    pending; a write's error is raised at the next ``put`` or at ``close``, which waits for the last write.
    ``put``'s ``then`` runs on the same thread once its file is in place (not when the write failed)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-writer")
        self._pending: Future | None = None

    def put(self, table: pa.Table, path: Path, then: Callable[[], None] | None = None) -> None:
        self._wait()
        self._pending = self._pool.submit(write_shard_table, table, path, then)

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self._wait()
        finally:
            self._pool.shutdown()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
            return
        try:        # the caller's error is the one reported; the pending write ends either way (atomically)
            self.close()
        except Exception:
            pass


def write_query(con: duckdb.DuckDBPyConnection, query: str, path: Path, schema: pa.Schema,
                params: list | None = None, options: dict | None = None) -> None:
    """Stream ``query``'s rows (``schema``'s columns) into ``path`` with ``schema`` (and pyarrow's writer
    ``options``), atomically. Batches flow from DuckDB to the file without collecting the result in Python."""
    tmp = Path(str(path) + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    reader = con.sql(query, params=params or []).to_arrow_reader(ROW_GROUP_ROWS)
    with pq.ParquetWriter(tmp, schema, **(options or {})) as writer:
        for batch in reader:
            writer.write_batch(batch.select(schema.names).cast(schema))
    os.replace(tmp, path)


def write_frame_shard(frame: pl.DataFrame, path: Path) -> None:
    """A shard from a data frame (hand-built stores), sorted and with the MEDS schema."""
    table = frame.sort(SHARD_SORT, nulls_last=False).select(EVENT_COLUMNS).to_arrow().cast(EVENT_SCHEMA)
    _atomic_table(table, Path(path), SHARD_WRITE_OPTIONS)


def write_dataset_metadata(store: Path, dataset_name: str, dataset_version: str, etl_version: str) -> None:
    meta = {"dataset_name": dataset_name, "dataset_version": dataset_version, "etl_name": ETL_NAME,
            "etl_version": etl_version, "meds_version": meds.__version__,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            "raw_source_id_columns": ["hadm_id", "stay_id"], "code_modifier_columns": ["unit"],
            "other_extension_columns": ["source_table", "event_hash", "occurrence"]}
    meds.DatasetMetadataSchema.validate(meta)
    atomic_write_text(Path(store) / METADATA / "dataset.json", json.dumps(meta, indent=1))


def codes_metadata_path(store: Path) -> Path:
    return Path(store) / meds.code_metadata_filepath


def code_tables_path(store: Path) -> Path:
    """Per code and source table its count of events (what the codes metadata's counts sum)."""
    return Path(store) / "code_tables.parquet"


def count_code_tables(con: duckdb.DuckDBPyConnection, store: Path) -> pl.DataFrame:
    """Per code and source table its count over the store's shards, written to :func:`code_tables_path`; DuckDB
    aggregates the shards without holding them."""
    per_table = con.sql(f"SELECT code, source_table, count(*) AS count FROM read_parquet("
                        f"{sql_literal(events_glob(store))}) GROUP BY code, source_table").pl()
    write_code_tables(code_tables_path(store), per_table)
    return per_table


def write_code_tables(path: Path, per_table: pl.DataFrame) -> None:
    """``per_table`` (code, source_table, count; codes with no event left dropped) to ``path``
    (:func:`code_tables_path`, or a deletion's staged copy of it)."""
    table = (per_table.filter(pl.col("count") > 0).select("code", "source_table", pl.col("count").cast(pl.Int64))
             .sort("code", "source_table").to_arrow())
    _atomic_table(table, Path(path))


def codes_of(per_table: pl.DataFrame) -> pl.DataFrame:
    """Per code its count and one source table: the first by name, so that a code several tables write
    (``MEDS_DEATH``: patients and admissions) names the same table whatever order the shards were read in."""
    return (per_table.filter(pl.col("count") > 0).group_by("code")
            .agg(pl.col("source_table").min(), pl.col("count").sum().cast(pl.Int64)))


def write_codes_metadata(path: Path, codes: pl.DataFrame) -> None:
    """Write ``codes`` (code, description, parent_codes as a list of str, and any extra columns) to ``path``
    (:func:`codes_metadata_path`, or a deletion's staged copy of it)."""
    table = meds.CodeMetadataSchema.align(codes.select(CODE_COLUMNS).sort("code").to_arrow())
    meds.CodeMetadataSchema.validate(table)
    _atomic_table(table, Path(path))


def subject_splits_path(store: Path) -> Path:
    return Path(store) / meds.subject_splits_filepath


def write_subject_splits(path: Path, splits: pl.DataFrame) -> None:
    """``splits``: subject_id, split (one row per subject), to ``path`` (:func:`subject_splits_path`, or a
    deletion's staged copy of it)."""
    table = meds.SubjectSplitSchema.align(splits.select("subject_id", "split").sort("subject_id").to_arrow())
    meds.SubjectSplitSchema.validate(table)
    _atomic_table(table, Path(path))


# a label file's row order (a subject's labels in time order; the value last, so that ties are identical rows)
LABEL_ORDER = ("subject_id", "prediction_time", "boolean_value")


def write_label_file(labels: pl.DataFrame, path: Path) -> None:
    """A MEDS label file (``meds.LabelSchema``: subject_id, prediction_time, boolean_value) at ``path``."""
    table = meds.LabelSchema.align(labels.select(LABEL_ORDER).sort(LABEL_ORDER).to_arrow())
    meds.LabelSchema.validate(table)
    _atomic_table(table, Path(path))


class LabelFiles:
    """MEDS label files written part by part (a run's labels, shard by shard), each made atomically on close."""

    def __init__(self, paths: dict[str, Path]):
        self.paths = {n: Path(p) for n, p in paths.items()}
        self._writers = {}

    def write(self, name: str, labels: pl.DataFrame) -> None:
        table = meds.LabelSchema.align(labels.select(LABEL_ORDER).to_arrow())     # sorted at close
        meds.LabelSchema.validate(table)
        if name not in self._writers:
            parts = self._parts(name)
            parts.parent.mkdir(parents=True, exist_ok=True)
            self._writers[name] = pq.ParquetWriter(parts, table.schema)
        self._writers[name].write_table(table)

    def _parts(self, name: str) -> Path:
        return Path(str(self.paths[name]) + ".parts.tmp")

    def close(self) -> list[Path]:
        """Each file made: its parts (written shard by shard) merged in :data:`LABEL_ORDER` by DuckDB's sort, which
        spills rather than holding the file, so that its rows' order does not depend on the store's shard count."""
        for name, path in self.paths.items():
            if name not in self._writers:       # no token at all: an empty, valid label file
                write_label_file(pl.DataFrame(schema={"subject_id": pl.Int64, "prediction_time": pl.Datetime("us"),
                                                      "boolean_value": pl.Boolean}), path)
                continue
            self._writers.pop(name).close()
            parts = self._parts(name)
            con = duckdb.connect()
            try:        # MEDS's schema, as the parts were written
                write_query(con, f"SELECT * FROM read_parquet({sql_literal(parts)}) ORDER BY {', '.join(LABEL_ORDER)}",
                            path, pq.read_schema(parts))
            finally:
                con.close()
            parts.unlink()
        return list(self.paths.values())


def read_codes_metadata(store: Path) -> pl.DataFrame | None:
    p = codes_metadata_path(store)
    return pl.read_parquet(p) if p.exists() else None


def validate_dataset(root: Path) -> list[str]:
    """Every shard and metadata file of the MEDS dataset at ``root`` checked with the ``meds`` schemas; the
    problems found, each naming its file (empty: valid)."""
    root = Path(root)
    problems = []
    shards = sorted((root / DATA).rglob("*.parquet"))
    if not shards:
        problems.append(f"{root / DATA}: no data shards")
    checks = [(p, meds.DataSchema) for p in shards]
    checks += [(root / meds.code_metadata_filepath, meds.CodeMetadataSchema),
               (root / meds.subject_splits_filepath, meds.SubjectSplitSchema)]
    for path, schema in checks:
        if not path.exists():
            if schema is meds.CodeMetadataSchema:
                problems.append(f"{path}: missing")
            continue
        try:
            schema.validate(pq.read_table(path))
        except Exception as e:  # noqa: BLE001 -- flexible_schema raises several kinds; each is a finding
            problems.append(f"{path}: {e}")
    ds = root / meds.dataset_metadata_filepath
    try:
        meds.DatasetMetadataSchema.validate(json.loads(ds.read_text()))
    except FileNotFoundError:
        problems.append(f"{ds}: missing")
    except Exception as e:  # noqa: BLE001
        problems.append(f"{ds}: {e}")
    return problems


def is_meds_dataset(source: Path) -> bool:
    """A MEDS dataset announces itself with ``metadata/dataset.json``; a ``data/`` folder of parquet files
    without it is a MEDS dataset missing its metadata (an error, see :func:`meds_shards`)."""
    source = Path(source)
    return (source / meds.dataset_metadata_filepath).exists() or any((source / DATA).rglob("*.parquet"))


_REQUIRED_TYPES = {"subject_id": (pa.types.is_integer, "int64"), "time": (pa.types.is_timestamp, "timestamp[us]"),
                   "code": (lambda t: pa.types.is_string(t) or pa.types.is_large_string(t), "string"),
                   "numeric_value": (pa.types.is_floating, "float32"),
                   "text_value": (lambda t: pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t),
                                  "large_string")}


def meds_shards(source: Path) -> list[Path]:
    """The data shards of the MEDS dataset ``source``, their schemas checked (headers only); a MedsSourceError
    naming the file and the problem otherwise."""
    source = Path(source)
    if not (source / meds.dataset_metadata_filepath).exists():
        raise MedsSourceError(f"{source}: a MEDS dataset needs {meds.dataset_metadata_filepath} (at least "
                              f'{{"dataset_name": ..., "meds_version": ...}}); it is missing')
    try:
        meds.DatasetMetadataSchema.validate(json.loads((source / meds.dataset_metadata_filepath).read_text()))
    except Exception as e:  # noqa: BLE001
        raise MedsSourceError(f"{source / meds.dataset_metadata_filepath}: not valid MEDS dataset metadata ({e})") \
            from None
    shards = sorted((source / DATA).rglob("*.parquet"))
    if not shards:
        raise MedsSourceError(f"{source / DATA}: no data shards (*.parquet)")
    for p in shards:
        try:
            schema = pq.read_schema(p)
        except Exception as e:  # noqa: BLE001 -- pyarrow's errors for damaged files vary
            raise MedsSourceError(f"{p}: not a readable parquet file ({e})") from None
        for col, (ok, want) in _REQUIRED_TYPES.items():
            if col not in schema.names:
                if col in ("numeric_value", "text_value"):
                    continue
                raise MedsSourceError(f"{p}: lacks the MEDS column {col!r}")
            if not ok(schema.field(col).type):
                raise MedsSourceError(f"{p}: column {col!r} is {schema.field(col).type}, MEDS wants {want}")
    return shards


def _atomic_table(table: pa.Table, path: Path, options: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(path) + ".tmp")
    pq.write_table(table, tmp, **(options or {}))
    os.replace(tmp, path)


STAY_COLUMNS = ("stay_id", "subject_id", "hadm_id", "first_careunit", "intime", "outtime", "anchor_age", "gender")


class MedsStayCodes:
    """How ICU stays, age and sex are read from a MEDS dataset that has no stay table: an ICU stay runs from an
    admission code to the subject's next discharge code (the MIMIC-IV MEDS ETL writes
    ``ICU_ADMISSION//<careunit>`` / ``ICU_DISCHARGE//<careunit>``); the care unit is what follows the
    admission code's prefix; age at admission comes from the birth code's time; sex from the sex code's suffix.
    Regular expressions in DuckDB's (RE2) syntax."""

    def __init__(self, admission: str = "^ICU_ADMISSION//", discharge: str = "^ICU_DISCHARGE//",
                 birth: str = "^MEDS_BIRTH$", sex: str = "^GENDER//"):
        self.admission, self.discharge, self.birth, self.sex = admission, discharge, birth, sex

    @classmethod
    def from_spec(cls, spec: dict | None) -> MedsStayCodes:
        """From a cohort config's ``meds_source`` section (None or empty: the MIMIC-IV MEDS ETL's conventions)."""
        spec = spec or {}
        return cls(**{k: spec[k] for k in ("admission", "discharge", "birth", "sex") if k in spec})


def _literal_list(paths: list[Path]) -> str:
    return "[" + ", ".join(sql_literal(p) for p in paths) + "]"


def _optional(schema_names: set, col: str, sql_type: str) -> str:
    return f"CAST({col} AS {sql_type})" if col in schema_names else f"NULL::{sql_type}"


def stage_meds(con: duckdb.DuckDBPyConnection, source: Path, shards: list[Path], changed: list[Path],
               codes: MedsStayCodes) -> str | None:
    """Temp table ``stays`` (from the source's ``stays.parquet`` when it has one, else from its admission and
    discharge codes); the SELECT of every event of the ``changed`` shards, typed as the CSV path types them
    (None when none changed).

    Events with no time (MEDS's static measurements) are staged with source_table 'meds_static' and kept."""
    names = set.intersection(*(set(pq.read_schema(p).names) for p in shards))
    con.execute("CREATE TEMP TABLE unusable_stays (subject_id BIGINT, intime TIMESTAMP, code VARCHAR, reason VARCHAR)")
    stay_table = Path(source) / "stays.parquet"
    if stay_table.exists():
        con.execute(f"CREATE TEMP TABLE stays AS SELECT {', '.join(STAY_COLUMNS)} "
                    f"FROM read_parquet({_literal_list([stay_table])})")
    else:
        _derive_stays(con, shards, codes)
    if not changed:
        return None
    return f"""SELECT CAST(subject_id AS BIGINT) AS subject_id, CAST(time AS VARCHAR) AS raw_time,
                      CAST(time AS TIMESTAMP) AS time, CAST(code AS VARCHAR) AS code,
                      {_optional(names, 'numeric_value', 'DOUBLE')} AS numeric_value,
                      {_optional(names, 'text_value', 'VARCHAR')} AS text_value,
                      {_optional(names, 'unit', 'VARCHAR')} AS unit, {_optional(names, 'hadm_id', 'BIGINT')} AS hadm_id,
                      {_optional(names, 'stay_id', 'BIGINT')} AS stay_id,
                      {_optional(names, 'numeric_value', 'VARCHAR')} AS raw_numeric,
                      CASE WHEN time IS NULL THEN 'meds_static' ELSE 'meds' END AS source_table
               FROM read_parquet({_literal_list(changed)}, union_by_name=true)"""


ADMISSION_WITHOUT_DISCHARGE = "icu_admission_without_discharge"


def _derive_stays(con: duckdb.DuckDBPyConnection, shards: list[Path], codes: MedsStayCodes) -> None:
    """Stays from admission/discharge code pairs: each admission to the subject's first discharge at or after
    it (an ASOF join); stay ids subject_id * 1000 + the admission's rank within its subject."""
    src = f"read_parquet({_literal_list(shards)}, union_by_name=true)"
    con.execute(f"""CREATE TEMP TABLE marks AS SELECT CAST(subject_id AS BIGINT) AS subject_id,
                        CAST(time AS TIMESTAMP) AS time, CAST(code AS VARCHAR) AS code FROM {src}
                    WHERE regexp_matches(code, ?) OR regexp_matches(code, ?) OR regexp_matches(code, ?)
                       OR regexp_matches(code, ?)""", [codes.admission, codes.discharge, codes.birth, codes.sex])
    con.execute("""CREATE TEMP TABLE stays AS
        WITH adm AS (SELECT subject_id, time AS intime, regexp_replace(code, ?, '') AS first_careunit,
                            row_number() OVER (PARTITION BY subject_id ORDER BY time, code) AS k
                     FROM marks WHERE regexp_matches(code, ?) AND time IS NOT NULL),
             dis AS (SELECT subject_id, time AS outtime FROM marks WHERE regexp_matches(code, ?)
                     AND time IS NOT NULL),
             birth AS (SELECT subject_id, min(time) AS born FROM marks WHERE regexp_matches(code, ?) GROUP BY 1),
             sex AS (SELECT subject_id, any_value(regexp_replace(code, ?, '')) AS gender FROM marks
                     WHERE regexp_matches(code, ?) GROUP BY 1)
        SELECT a.subject_id * 1000 + a.k AS stay_id, a.subject_id, NULL::BIGINT AS hadm_id, a.first_careunit,
               a.intime, d.outtime, CAST(floor(date_diff('day', b.born, a.intime) / 365.2425) AS BIGINT) AS anchor_age,
               s.gender
        FROM adm a ASOF LEFT JOIN dis d ON a.subject_id = d.subject_id AND d.outtime >= a.intime
        LEFT JOIN birth b ON a.subject_id = b.subject_id LEFT JOIN sex s ON a.subject_id = s.subject_id""",
                [codes.admission, codes.admission, codes.discharge, codes.birth, codes.sex, codes.sex])
    too_many, = con.execute("SELECT count(*) FROM (SELECT subject_id FROM stays GROUP BY 1 HAVING count(*) >= 1000)"
                            ).fetchone()
    if too_many:
        raise MedsSourceError("a subject has 1,000 or more ICU admissions: derived stay ids would collide")
    # An admission without a later discharge has no window: the stay cannot be used, the rest
    # of the dataset can; its admission event goes to the quarantine with the reason (extract._judge).
    con.execute(f"""INSERT INTO unusable_stays SELECT DISTINCT m.subject_id, m.time, m.code,
                        '{ADMISSION_WITHOUT_DISCHARGE}' FROM marks m JOIN stays s
                        ON m.subject_id = s.subject_id AND m.time = s.intime
                    WHERE s.outtime IS NULL AND regexp_matches(m.code, ?)""", [codes.admission])
    con.execute("DELETE FROM stays WHERE outtime IS NULL")
    con.execute("DROP TABLE marks")
