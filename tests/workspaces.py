"""Helpers the deletion tests share: a workspace copy, a patient's owner reference, a patient the memory holds, a
scan of files for raw identifiers."""
import gzip
import re
import shutil
import sqlite3
from pathlib import Path

import numpy as np

import polars as pl

from deletion.plan import scored_subjects
from memory.cohort import CohortMemory
from pipeline.privacy import load_key, subject_ref
from pipeline.workspace import Workspace


def ref(subject_id):
    """The patient's owner reference in memory token ids (a keyed hash)."""
    return subject_ref(subject_id, load_key())


def copy_ws(ws, dest):
    shutil.copytree(ws.root, dest)
    return Workspace(dest)


def subject_with_memory_tokens(ws):
    """The first evaluation subject (by id) with tokens in the latest cohort-memory checkpoint."""
    cm = CohortMemory.load(ws.checkpoints()[-1])
    for sid in scored_subjects(ws):
        if cm.tokens_of(ref(sid)):
            return sid
    raise AssertionError("no evaluation subject has tokens in the cohort memory")


NUMBER = re.compile(r"(?<![0-9.])([0-9]+)(?![0-9])")


def _holds(text, ids):
    return any(m in ids for m in NUMBER.findall(text))


def raw_id_hits(root, ids, skip=()):
    """Every place under ``root`` (but the top-level folders in ``skip``) that holds one of the raw ids ``ids``:
    parquet columns, arrays in .npz files, SQLite databases (dumped), any other file as text (gzip opened)."""
    ints, texts = {int(i) for i in ids}, {str(i) for i in ids}
    hits = []
    for f in sorted(Path(root).rglob("*")):
        if not f.is_file() or f.relative_to(root).parts[0] in skip:
            continue
        head = f.read_bytes()[:16]
        if f.suffix == ".parquet":
            df = pl.read_parquet(f)
            hits += [f"{f}:{c}" for c, t in df.schema.items() if (t.is_integer() and df[c].is_in(ints).any()) or
                     (t == pl.String and any(_holds(x, texts) for x in df[c].drop_nulls().unique()))]
        elif f.suffix == ".npz":
            with np.load(f, allow_pickle=False) as z:
                hits += [f"{f}:{n}" for n in z.files if (z[n].dtype.kind in "iu" and np.isin(z[n], list(ints)).any())
                         or (z[n].dtype.kind == "U" and any(_holds(str(x), texts) for x in z[n].ravel()))]
        elif head.startswith(b"SQLite format 3"):
            con = sqlite3.connect(f)
            if any(_holds(line, texts) for line in con.iterdump()):
                hits.append(str(f))
            con.close()
        else:
            data = gzip.decompress(f.read_bytes()) if head[:2] == b"\x1f\x8b" else f.read_bytes()
            if _holds(data.decode("latin-1"), texts):
                hits.append(str(f))
    return hits
