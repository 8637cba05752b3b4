"""What a deletion request finds before it changes anything: the subject behind a hash, what the workspace holds
of them, or that they were deleted before."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import duckdb
import polars as pl

from memory.cohort import CohortMemory, owner_of
from pipeline.errors import Refusal
from pipeline.deleted import certified_hashes, deleted_subjects
from pipeline.store_reader import UnknownSubjectError
from pipeline.extract_rules import sql_literal
from pipeline.meds import quarantine_files, shard_files, shard_of, stays_path
from pipeline.privacy import keyed_hash, store_key, subject_ref
from pipeline.progress import a_few

if TYPE_CHECKING:
    from pipeline.workspace import Workspace

K = TypeVar("K")


class AlreadyDeleted(Exception):
    """The subject was deleted before: nothing of them remains and the log holds their certificate."""


class DeletionFailed(Refusal, RuntimeError):
    """A check failed (refit verification, residual scan, the log); nothing was changed."""


def owner(ws: Workspace, sid: int) -> str:
    """The subject's owner reference in the memories' token ids (their keyed hash, never their id)."""
    return subject_ref(sid, store_key(ws.store, ws.root))


def scan_subject(ws: Workspace, subject_id: int) -> tuple:
    """Everything of the subject still present: counts per place (all zero after a deletion)."""
    sid = int(subject_id)
    found = {}
    shard = shard_of(ws.store, sid)
    found["events"] = pl.scan_parquet(shard).filter(pl.col("subject_id") == sid).select(pl.len()).collect().item() \
        if shard.exists() else 0
    qfiles = quarantine_files(ws.store)
    found["quarantine"] = pl.scan_parquet(qfiles).filter(pl.col("subject_id") == sid).select(pl.len()).collect() \
        .item() if qfiles else 0
    stays_file = stays_path(ws.store)
    stay_ids = []
    if stays_file.exists():
        stays = pl.read_parquet(stays_file).filter(pl.col("subject_id") == sid)
        stay_ids = stays["stay_id"].to_list()
        found["stays"] = stays.height
    found["per_stay_results"] = results_of(ws, sid).select(pl.len()).collect().item() if ws.results.exists() else 0
    ref = owner(ws, sid) if ws.checkpoints() else None
    found["cohort_memory_tokens"] = sum(len(CohortMemory.load(c).tokens_of(ref))
                                        for c in [*ws.checkpoints(), *ws.snapshots()])
    return found, stay_ids


def check_subject(ws: Workspace, subject_id: int) -> tuple | None:
    """What the workspace holds of the subject: (counts per place, per-stay memory files). Read-only, so the
    CLI can answer before any flow starts. Raises AlreadyDeleted when nothing is left and the log holds the
    subject's certificate, UnknownSubjectError when nothing is left and it never did."""
    sid = int(subject_id)
    if not ws.store.exists():
        raise UnknownSubjectError(f"workspace {ws.root} has no event store (run `forgetful run --out {ws.root}` "
                                  f"first)")
    key = store_key(ws.store, ws.root)
    found, stay_ids = scan_subject(ws, sid)
    stay_files = [p for p in sorted({ws.stay_memory(s, key) for s in stay_ids} | set(_stay_files_from_results(ws, sid)))
                  if p.exists()]
    if any(found.values()) or stay_files:
        return found, stay_files
    subject_hash = keyed_hash(sid, key)
    cert = certificate_of(ws, subject_hash)
    if cert:
        raise AlreadyDeleted(f"subject (hash {subject_hash[:12]}...) was already deleted; certificate {cert}")
    raise UnknownSubjectError(f"subject {sid} is not in the workspace {ws.root}")


def check_subjects(ws: Workspace, subject_ids: list[int],
                   advance: Callable[[int], object] | None = None) -> dict[int, Exception | None]:
    """Per subject, why they cannot be deleted (UnknownSubjectError, or AlreadyDeleted naming the certificate),
    or None when the workspace holds them. Read-only, as :func:`check_subject`, and in one pass over each place
    for the whole request: a request of 100,000 ids took ~10 ms an id one at a time. ``advance``: called with
    the subjects checked so far (a progress bar's)."""
    sids = sorted({int(s) for s in subject_ids})
    if not ws.store.exists():
        raise UnknownSubjectError(f"workspace {ws.root} has no event store (run `forgetful run --out {ws.root}` "
                                  f"first)")
    key = store_key(ws.store, ws.root)
    held = _held(ws, sids, key)
    if advance is not None:
        advance(len(sids))
    # every certificate is read only for a request naming someone the workspace does not hold
    certified = deleted_subjects(ws.store, ws.root).certificates if len(held) < len(sids) else {}
    out = {}
    for sid in sids:
        h = keyed_hash(sid, key)
        out[sid] = None if sid in held else AlreadyDeleted(
            f"subject (hash {h[:12]}...) was already deleted; certificate {certified[h]}") if certified.get(h) \
            else UnknownSubjectError(f"subject {sid} is not in the workspace {ws.root}")
    return out


@dataclass(frozen=True)
class Triage(Generic[K]):
    """What a request of several subjects comes to, decided once for the command and the flow: the subjects to
    delete (``left``), those skipped and why, or nothing to do (``already_deleted``: every one was deleted
    before), or a refusal naming a few of those it cannot delete."""
    left: tuple[K, ...]
    skipped: dict[K, str]
    already_deleted: str | None = None
    refusal: str | None = None


def triage(status: dict[K, object], skip_unknown: bool, named: Callable[[K, str], str]) -> Triage[K]:
    """``status``: per subject (an id, or a keyed hash) None or what they resolved to when the workspace holds them,
    else why not (UnknownSubjectError, AlreadyDeleted). One the workspace does not hold refuses the request
    unless ``skip_unknown`` and some are left; ``named(subject, why)`` is how a message names one."""
    missing = {k: why for k, why in status.items() if isinstance(why, Exception)}
    left = tuple(k for k in status if k not in missing)
    skipped = {k: str(why) for k, why in missing.items()}
    if missing and not left and all(isinstance(why, AlreadyDeleted) for why in missing.values()):
        return Triage((), skipped, already_deleted=a_few(skipped.values()))
    if missing and not (skip_unknown and left):
        listed = a_few(named(k, why) for k, why in skipped.items())
        return Triage((), skipped, refusal=f"{len(missing)} of {len(status)} subject(s) cannot be deleted, so none "
                                           f"is (--skip-unknown deletes the rest): {listed}")
    return Triage(left, skipped)


def _held(ws: Workspace, sids: list[int], key: bytes) -> set[int]:
    """The subjects of ``sids`` of whom the workspace holds anything (:func:`scan_subject`'s places), each place
    read once: their shards, the quarantine and the stays by id, the results and the cohort memories by
    reference."""
    wanted = pl.Series("subject_id", sids, dtype=pl.Int64).implode()
    shards = sorted({p for sid in sids if (p := shard_of(ws.store, sid)).exists()})
    files = [*shards, *quarantine_files(ws.store)] + ([stays_path(ws.store)] if stays_path(ws.store).exists() else [])
    held = set()
    for f in files:
        found = pl.scan_parquet(f).select("subject_id").filter(pl.col("subject_id").is_in(wanted)).unique().collect()
        held |= set(found["subject_id"].to_list())
    rest = [sid for sid in sids if sid not in held]
    if not rest:
        return held
    refs = {subject_ref(sid, key): sid for sid in rest}
    if ws.results.exists():
        found = pl.scan_parquet(ws.results).select("subject_ref").filter(
            pl.col("subject_ref").is_in(pl.Series(list(refs), dtype=pl.String).implode())).unique().collect()
        held |= {refs[r] for r in found["subject_ref"].to_list()}
    for c in [*ws.checkpoints(), *ws.snapshots()] if len(held) < len(sids) else []:
        owners = {owner_of(t) for t in CohortMemory.load(c).memory.token_ids()}
        held |= {sid for ref, sid in refs.items() if ref in owners}
    return held


def certificate_of(ws: Workspace, subject_hash: str) -> str | None:
    """The name of the certificate issued for ``subject_hash``, or None."""
    return certified_hashes(ws.root).get(subject_hash)


def subjects_by_hash(ws: Workspace, hashes: set[str]) -> dict[str, int]:
    """The store's subjects whose keyed hash is one of ``hashes`` (hash -> id), found by hashing every subject id
    of its stays, shards and quarantine once."""
    key = store_key(ws.store, ws.root)
    files = [f for f in [stays_path(ws.store), *shard_files(ws.store), *quarantine_files(ws.store)] if f.exists()]
    # DuckDB's distinct streams the column: the store's hundreds of millions of rows are never held at once
    sources = ", ".join(map(sql_literal, files))
    ids = [r[0] for r in duckdb.sql(f"SELECT DISTINCT subject_id FROM read_parquet([{sources}], union_by_name = true) "
                                    f"WHERE subject_id IS NOT NULL").fetchall()] if files else []
    return {h: int(s) for s in ids if (h := keyed_hash(int(s), key)) in hashes}


def resolve_subjects(ws: Workspace, subject_hashes: list[str]) -> dict[str, int | Exception]:
    """Per keyed hash, the subject id behind it, found by hashing the store's subject ids once, so that deletion
    requests can travel (through Prefect's database, logs and results) as hashes alone; for a hash no stored
    subject has, AlreadyDeleted (a deleted subject's) or UnknownSubjectError (naming only the hash)."""
    if not ws.store.exists():
        raise UnknownSubjectError(f"workspace {ws.root} has no event store")
    found = subjects_by_hash(ws, set(subject_hashes))
    deleted = deleted_subjects(ws.store, ws.root) if len(found) < len(set(subject_hashes)) else None
    out = {}
    for h in subject_hashes:
        if h in found:
            out[h] = found[h]
            continue
        cert = deleted.certificates.get(h)
        out[h] = AlreadyDeleted(f"subject (hash {h[:12]}...) was already deleted; certificate {cert}") \
            if cert else AlreadyDeleted(f"subject (hash {h[:12]}...) was already deleted (on the suppression "
                                        f"list)") if h in deleted else \
            UnknownSubjectError(f"no subject with keyed hash {h[:12]}... is in the workspace {ws.root}")
    return out


def resolve_subject(ws: Workspace, subject_hash: str) -> int:
    """The subject id behind one keyed hash (:func:`resolve_subjects`); raises what it reports for it."""
    found = resolve_subjects(ws, [subject_hash])[subject_hash]
    if isinstance(found, Exception):
        raise found
    return found


def scored_subjects(ws: Workspace) -> list[int]:
    """The store's subjects (by id, ascending) with rows in the per-stay results, which name them by reference
    only: the patients whose deletion reaches results and the cohort memory."""
    refs = set(pl.scan_parquet(ws.results).select(pl.col("subject_ref").unique()).collect()["subject_ref"].to_list())
    key = store_key(ws.store, ws.root)
    subjects = pl.scan_parquet(stays_path(ws.store)).select(pl.col("subject_id").unique().sort()).collect()
    return [s for s in subjects["subject_id"].to_list() if subject_ref(s, key) in refs]


def results_of(ws: Workspace, sid: int) -> pl.LazyFrame:
    """The subject's rows of the per-stay results, which name them by keyed reference only."""
    return pl.scan_parquet(ws.results).filter(pl.col("subject_ref") == owner(ws, sid))


def _stay_files_from_results(ws, sid):
    """Per-stay memory files of the subject's scored stays (a memory file is named by its stay's reference)."""
    if not ws.results.exists():
        return []
    refs = results_of(ws, sid).select(pl.col("stay_ref").unique()).collect()["stay_ref"].to_list()
    return [ws.stay_memories / f"{r}.npz" for r in refs]
