"""The keyed hash that stands for a patient, its key (kept outside the workspace), and the suppression list.

A subject is named outside the event store only by ``HMAC-SHA256(key, subject_id)``. The key is read from
``FORGETFUL_HASH_KEY`` (the secret itself) or ``FORGETFUL_HASH_KEY_FILE`` (a file outside the workspace); with
neither, nothing that hashes a subject starts. Whoever holds a copy of the workspace but not the key cannot
reverse a hash by enumerating ids. The store and its workspace record the key's fingerprint (an HMAC of a
constant, which does not reveal the key), so a run or deletion under a different key is refused instead of
silently failing to recognise deleted patients, even after the store is lost and rebuilt.

What keeps deleted patients out never lives only in what can be lost or rebuilt: the suppression list is kept
in the store and beside the deletion log in its workspace (``WS/suppressed.json``), and every certificate names
its subject's hash (:mod:`pipeline.deleted` reads all three).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

import polars as pl

from .errors import InputError
from .transaction import atomic_write_text

KEY_ENV = "FORGETFUL_HASH_KEY"
KEY_FILE_ENV = "FORGETFUL_HASH_KEY_FILE"
FINGERPRINT_FILE = "key_fingerprint.json"
SUPPRESSED_FILE = "suppressed.json"
HOW_TO = (f"create a key with `forgetful keygen PATH` (a path outside the workspace) and set {KEY_FILE_ENV}=PATH "
          f"(or {KEY_ENV} to the secret itself)")


class HashKeyError(InputError):
    """No usable hash key, a key kept inside the workspace, or a key other than the store's."""


def keyed_hash(value: int | str, key: bytes) -> str:
    return hmac.new(key, str(value).encode(), hashlib.sha256).hexdigest()


def subject_ref(subject_id: int, key: bytes) -> str:
    """The opaque owner reference of a patient's tokens in the memories (a prefix of their keyed hash)."""
    return keyed_hash(int(subject_id), key)[:32]


def id_refs(frame: pl.DataFrame, key: bytes) -> pl.DataFrame:
    """``frame`` with its ``stay_id`` and ``subject_id`` columns replaced by ``stay_ref`` and ``subject_ref``
    (what a derived file holds instead of an identifier); each reference computed once per id."""
    stays = {s: stay_ref(s, key) for s in frame["stay_id"].unique().to_list()}
    subjects = {s: subject_ref(s, key) for s in frame["subject_id"].unique().to_list()}
    return frame.with_columns(pl.col("stay_id").replace_strict(stays, return_dtype=pl.String).alias("stay_ref"),
                              pl.col("subject_id").replace_strict(subjects, return_dtype=pl.String)
                              .alias("subject_ref")).drop("stay_id", "subject_id")


def stay_ref(stay_id: int, key: bytes) -> str:
    """The opaque reference of an ICU stay in memory token ids, per-stay results and the per-stay memory's file
    name (keyed, domain-separated from the subject hash, so neither reveals the other)."""
    return keyed_hash(f"stay:{int(stay_id)}", key)[:32]


MIN_KEY_CHARS = 32


def load_key(workspace: Path | str | None = None) -> bytes:
    """The hash key from the environment; ``workspace``: refuse a key file inside it. A key shorter than
    :data:`MIN_KEY_CHARS` is refused, from the environment as from a file: a short secret can be guessed, and
    with it every hash reversed by enumerating ids."""
    if os.environ.get(KEY_ENV):
        key = os.environ[KEY_ENV].strip()
        if len(key) < MIN_KEY_CHARS:
            raise HashKeyError(f"{KEY_ENV} holds {len(key)} characters; use at least {MIN_KEY_CHARS} (`forgetful "
                               f"keygen PATH` writes 64 hex digits to a file for {KEY_FILE_ENV})")
        return key.encode()
    path = os.environ.get(KEY_FILE_ENV)
    legacy = Path(workspace) / ".secrets" / "hash.key" if workspace is not None else None
    if not path:
        if legacy is not None and legacy.exists():
            raise HashKeyError(f"the workspace keeps its hash key inside it ({legacy}), where a copy of the workspace "
                               f"carries it: move the file outside the workspace and set {KEY_FILE_ENV} to its path")
        raise HashKeyError(f"no hash key: {HOW_TO}")
    p = Path(path).expanduser().resolve()
    if workspace is not None and p.is_relative_to(Path(workspace).resolve()):
        raise HashKeyError(f"the hash key file {p} lies inside the workspace {workspace}: keep it outside, where a "
                           f"copy of the workspace does not carry it")
    if not p.is_file():
        raise HashKeyError(f"hash key file {p} does not exist: {HOW_TO}")
    key = p.read_text().strip()
    if len(key) < MIN_KEY_CHARS:
        raise HashKeyError(f"hash key file {p} holds {len(key)} characters; use at least {MIN_KEY_CHARS} "
                           f"(`forgetful keygen` writes 64 hex digits)")
    return key.encode()


def write_secret_file(path: Path, data: bytes) -> Path:
    """``data`` in a new file readable by its owner only. Raises FileExistsError rather than overwrite a key
    (what it recognises or signs would be lost)."""
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    return p


def write_new_key(path: Path) -> Path:
    """A fresh 256-bit key in a new owner-only file; never overwrites one."""
    try:
        return write_secret_file(path, (secrets.token_hex(32) + "\n").encode())
    except FileExistsError:
        raise HashKeyError(f"{Path(path).expanduser()} exists already: a key is never overwritten (deleted "
                           f"patients are recognised by it)") from None


def fingerprint(key: bytes) -> str:
    return hmac.new(key, b"forgetful hash-key fingerprint v1", hashlib.sha256).hexdigest()[:32]


def workspace_of(store: Path) -> Path | None:
    """The workspace a store belongs to (its parent, when the store is a workspace's ``store/``), else None."""
    store = Path(store).resolve()
    root = store.parent
    marks = (".lock", "ledger.jsonl", "run.json", SUPPRESSED_FILE, FINGERPRINT_FILE)
    return root if store.name == "store" and any((root / m).exists() for m in marks) else None


def _recorded_fingerprint(f: Path) -> str | None:
    if not f.exists():
        return None
    try:
        recorded = json.loads(f.read_text())["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        raise HashKeyError(f"{f} is damaged (it should hold the hash key's fingerprint): restore it from a backup "
                           f"or from the workspace's other copy (store/{FINGERPRINT_FILE} or {FINGERPRINT_FILE})"
                           ) from None
    if not isinstance(recorded, str):
        raise HashKeyError(f"{f} is damaged (its fingerprint is not text): restore it from a backup")
    return recorded


def check_key(store: Path, key: bytes, workspace: Path | None = None) -> None:
    """Refuse a key other than the one ``store`` (and ``workspace``, default :func:`workspace_of`) was built with;
    record the key's fingerprint on first use, in both, so a store lost and rebuilt keeps its key."""
    store = Path(store)
    workspace = workspace if workspace is not None else workspace_of(store)
    files = [store / FINGERPRINT_FILE] + ([Path(workspace) / FINGERPRINT_FILE] if workspace is not None else [])
    mine = fingerprint(key)
    for f in files:
        recorded = _recorded_fingerprint(f)
        if recorded is not None and recorded != mine:
            what = "the store" if f.parent == store else "the workspace"
            raise HashKeyError(f"the hash key is not the one {what} {f.parent} was built with (fingerprint "
                               f"{mine[:12]}..., recorded {recorded[:12]}... in {f}): under another key deleted "
                               f"patients are not recognised and would be re-ingested; use the original key")
    for f in files if store.exists() else []:       # nothing is written before the store is
        if f.parent.exists() and not f.exists():
            atomic_write_text(f, json.dumps({"fingerprint": mine}))


def store_key(store: Path, workspace: Path | None = None) -> bytes:
    """The hash key, checked against the store's (and its workspace's) fingerprint."""
    key = load_key(workspace)
    check_key(store, key, Path(workspace) if workspace is not None else None)
    return key


def suppressed_hashes(store: Path) -> set[str]:
    """Keyed hashes on the suppression list kept in ``store`` (:mod:`pipeline.deleted` adds the workspace's own
    list and its certificates)."""
    f = Path(store) / SUPPRESSED_FILE
    if not f.exists():
        return set()
    try:
        hashes = json.loads(f.read_text())
    except (OSError, ValueError):
        hashes = None
    if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
        raise InputError(f"{f} is damaged (it should list the deleted subjects' keyed hashes): restore it from a "
                         f"backup; the workspace's certificates and its own {SUPPRESSED_FILE} name them too")
    return set(hashes)
