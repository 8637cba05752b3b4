"""A MIMIC-IV-shaped source at real per-stay volumes: the open demo's subjects cloned with fresh ids.

Clone 0 is the demo itself; clone c > 0 adds ``c * ID_OFFSET`` to every subject, admission and stay id (so
ids never collide and the subject-level split differs between clones) and multiplies each chart and lab
``valuenum`` by a deterministic factor within 1 % (so clones are not byte-identical streams). Tables without
patient ids (the ``d_`` dictionaries, ``provider``, ``caregiver``) are copied once. Written with DuckDB,
table by table, without holding any table in Python.

    python bench/scale_source.py --demo ../shared/data/mimic-iv-demo --stays 730 --out /tmp/src
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
from pathlib import Path
from typing import Iterator

import duckdb

# Above every MIMIC-IV id (subject 1e7.., hadm 2e7.., stay 3e7..), and odd: the store puts a subject in shard
# subject_id % count (a power of two), so an offset divisible by it would put every copy of a patient in one shard,
# where MIMIC-IV's ids spread over them all.
ID_OFFSET = 100_000_007
ID_COLUMNS = ("subject_id", "hadm_id", "stay_id")
PERTURBED = {"chartevents": "valuenum", "labevents": "valuenum"}
MIMIC_IV_ICU_STAYS = 94_458        # MIMIC-IV v3.1 icustays (mimic-code's validate.sql): the reference
MIMIC_IV_2_2_ICU_STAYS = 73_181    # MIMIC-IV 2.2 icustays, the earlier reference (a second line)


def _lit(p: Path) -> str:
    return "'" + str(p).replace("'", "''") + "'"


def clones_for(demo: Path, stays: int) -> int:
    """How many copies of the demo give at least ``stays`` ICU stays."""
    con = duckdb.connect()
    n = con.execute(f"SELECT count(*) FROM read_csv({_lit(demo / 'icu' / 'icustays.csv.gz')})").fetchall()[0][0]
    return max(1, math.ceil(stays / n))


def _columns(con, path: Path) -> list[str]:
    return [r[0] for r in con.execute(f"DESCRIBE SELECT * FROM read_csv({_lit(path)}, all_varchar=true)").fetchall()]


def _shifted(c: str, by: str) -> str:
    """An id column moved by ``by`` (an SQL expression), empty ids left as they are."""
    return f"CASE WHEN {c} IS NULL OR {c} = '' THEN {c} ELSE CAST(CAST({c} AS BIGINT) + {by} AS VARCHAR) END AS {c}"


def _clone_table(con, src: Path, dst: Path, clones: int) -> None:
    cols = _columns(con, src)
    table = src.name.split(".")[0]
    if not any(c in ID_COLUMNS for c in cols):
        shutil.copyfile(src, dst)
        return

    def expr(c: str) -> str:
        if c in ID_COLUMNS:
            return _shifted(c, f"k * {ID_OFFSET}")
        if PERTURBED.get(table) == c:
            # a factor in [0.99, 1.01] from the row's own content: deterministic, different per clone
            f = "(1 + 0.01 * ((hash(k, subject_id, charttime, itemid) % 2001)::DOUBLE - 1000) / 1000)"
            return (f"CASE WHEN k = 0 OR TRY_CAST({c} AS DOUBLE) IS NULL THEN {c} "
                    f"ELSE CAST(round(CAST({c} AS DOUBLE) * {f}, 4) AS VARCHAR) END AS {c}")
        return c
    select = ", ".join(expr(c) for c in cols)
    con.execute(f"""COPY (SELECT {select} FROM read_csv({_lit(src)}, all_varchar=true),
                                 range(0, {clones}) r(k) ORDER BY k)
                    TO {_lit(dst)} (FORMAT csv, HEADER, COMPRESSION gzip)""")


def _each_table(src: Path, dst: Path) -> Iterator[tuple[duckdb.DuckDBPyConnection, Path, Path]]:
    """Each table of the source and where its copy goes (``dst`` emptied first), with one DuckDB connection."""
    shutil.rmtree(dst, ignore_errors=True)
    con = duckdb.connect()
    con.execute("SET preserve_insertion_order = true")
    for sub in ("hosp", "icu"):
        (dst / sub).mkdir(parents=True, exist_ok=True)
        for f in sorted(p for p in (src / sub).iterdir() if p.name.endswith(".csv.gz") or p.is_dir()):
            yield con, f, dst / sub / f.name


FIRST_PART = "part-0000.csv.gz"


def _as_folders(out: Path) -> None:
    """Each table with patient ids moved into a folder of its own, as its first file (``icu/chartevents.csv.gz``
    -> ``icu/chartevents/part-0000.csv.gz``): the layout of a source whose extracts arrive as files."""
    con = duckdb.connect()
    for sub in ("hosp", "icu"):
        for f in sorted((out / sub).glob("*.csv.gz")):
            if any(c in ID_COLUMNS for c in _columns(con, f)):
                folder = out / sub / f.name.removesuffix(".csv.gz")
                folder.mkdir()
                f.rename(folder / FIRST_PART)


def make_source(demo: Path, out: Path, clones: int, folders: bool = False) -> Path:
    """``clones`` copies of the demo at ``out`` (kept when it already holds that many: the bench reruns).
    ``folders``: each table with patient ids a folder holding one file (:func:`_as_folders`), so that
    :func:`add_new_rows` can deliver a night's rows as a new file."""
    demo, out = Path(demo), Path(out)
    marker = out / f".clones-{ID_OFFSET}"        # a source cloned with another offset is made again
    done = marker.read_text().split() if marker.exists() else []
    if done == [str(clones)] and folders:
        _as_folders(out)            # the same clones as whole files: moved, not written again
    elif done[:1] != [str(clones)]:
        for con, src, dst in _each_table(demo, out):
            _clone_table(con, src, dst, clones)
        if folders:
            _as_folders(out)
    elif (len(done) > 1) != folders:
        raise SystemExit(f"{out} holds {clones} clones in the other layout: remove it to build this one")
    marker.write_text(f"{clones} folders" if folders else str(clones))
    return out


def _keep(f: Path, out: Path) -> None:
    """An unchanged file of the source in the new one: a hard link (same size and mtime, as a night leaves
    yesterday's files), a copy across file systems."""
    try:
        os.link(f, out)
    except OSError:
        shutil.copy2(f, out)


def add_new_rows(demo: Path, src: Path, dst: Path, clones: int, fraction: float = 0.01) -> Path:
    """``src`` (``clones`` copies of ``demo``) plus about ``fraction`` new rows, as a night brings them: the
    stays of a few new patients (the first subjects of one more clone, about ``fraction`` of the stays) and
    late chart rows for about ``fraction`` of the existing stays (a charting backlog: a copy of each such
    stay's chart rows, one minute later). A table that is a file is written again whole with them; a table
    that is a folder (:func:`make_source`'s ``folders``) keeps its files and gets them as one new file."""
    demo, src, dst = Path(demo), Path(src), Path(dst)
    subjects = [r[0] for r in duckdb.sql(
        f"SELECT DISTINCT subject_id FROM read_csv({_lit(demo / 'icu' / 'icustays.csv.gz')}) ORDER BY 1").fetchall()]
    new = subjects[:max(1, round(fraction * len(subjects)))]
    offset = clones * ID_OFFSET
    for con, f, out in _each_table(src, dst):
        folder = f.is_dir()
        files = sorted(f.glob("*.csv.gz")) if folder else [f]
        cols = _columns(con, files[0])
        if "subject_id" not in cols:
            shutil.copytree(f, out) if folder else shutil.copyfile(f, out)
            continue
        name = f.name if folder else f.name.removesuffix(".csv.gz")
        shifted = ", ".join(_shifted(c, str(offset)) if c in ID_COLUMNS else c for c in cols)
        reads = "[" + ", ".join(map(_lit, files)) + "]"
        parts = [f"SELECT {shifted} FROM read_csv({_lit(demo / f.parent.name / (name + '.csv.gz'))}, "
                 f"all_varchar=true) WHERE CAST(subject_id AS BIGINT) IN ({', '.join(map(str, new))})"]
        if name == "chartevents":
            late = ", ".join("strftime(CAST(charttime AS TIMESTAMP) + INTERVAL 1 MINUTE, '%Y-%m-%d %H:%M:%S') "
                             "AS charttime" if c == "charttime" else c for c in cols)
            parts.append(f"SELECT {late} FROM read_csv({reads}, all_varchar=true) "
                         f"WHERE hash(stay_id) % {round(1 / fraction)} = 0")
        if folder:
            out.mkdir()
            for part in files:
                _keep(part, out / part.name)
            target = out / f"part-{len(files):04d}.csv.gz"
        else:
            parts.insert(0, f"SELECT * FROM read_csv({reads}, all_varchar=true)")
            target = out
        con.execute(f"COPY ({' UNION ALL '.join(parts)}) TO {_lit(target)} (FORMAT csv, HEADER, COMPRESSION gzip)")
    return dst


def without_subject(src: Path, dst: Path, subject_id: int) -> Path:
    """A copy of the source with none of the subject's rows in any table (the source a run that never saw them
    reads)."""
    for con, f, out in _each_table(Path(src), Path(dst)):
        if "subject_id" not in _columns(con, f):
            shutil.copyfile(f, out)
            continue
        con.execute(f"COPY (SELECT * FROM read_csv({_lit(f)}, all_varchar=true) "
                    f"WHERE subject_id IS NULL OR subject_id <> '{int(subject_id)}') "
                    f"TO {_lit(out)} (FORMAT csv, HEADER, COMPRESSION gzip)")
    return Path(dst)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--demo", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/mimic-iv-demo")
    ap.add_argument("--stays", type=int, default=730)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    k = clones_for(a.demo, a.stays)
    make_source(a.demo, a.out, k)
    print(f"{k} clones of {a.demo} at {a.out}")


if __name__ == "__main__":
    main()
