"""Helpers the deletion tests share: a workspace copy, a patient's owner reference, a patient the memory holds."""
import shutil

import polars as pl

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
    for sid in pl.read_parquet(ws.results)["subject_id"].unique().sort().to_list():
        if cm.tokens_of(ref(sid)):
            return sid
    raise AssertionError("no evaluation subject has tokens in the cohort memory")
