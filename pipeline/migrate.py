"""Workspaces that outlive a release: the workspace's format version, and ``forgetful migrate`` from each older one.

Formats (``store/format.json``, in the store every workspace has; one written before the file existed is
recognised by its layout):

1. the first releases: the store's events in ``store/events/bucket=K/run-*.parquet`` with ``store/codes.parquet``,
   and an unsigned hash-chain ledger (entries chained by ``prev`` / ``entry_hash``);
2. the store as a MEDS dataset (``store/data/K.parquet``, ``store/metadata/``) and the signed transparency log;
   text values could be ``""``, death was coded ``DEATH``, and derived files named stays by their raw id;
3. null for an empty text value, ``MEDS_DEATH`` / ``MEDS_DEATH//DOD``, no raw id outside the store;
4. every death ``MEDS_DEATH`` (a date of death alone says so in its text value), so that MEDS tools matching
   ``MEDS_DEATH`` find every death;
5. this release: the store records its shard count (``store/sharding.json``; format 4's stores have 16, a new store
   gets a count that grows with its source) and its code counts per source table (``store/code_tables.parquet``,
   which a deletion updates by subtraction).

A migration keeps every event and every piece of deletion evidence: the old ledger and its certificates are kept
as they were, checked, and sealed by a migration certificate that is the first entry of the signed log (it names
the old ledger's digest, its chain head and each old certificate's digest). Caches are dropped (the next run
rebuilds them); per-stay results and cohort-memory token ids are rewritten to name stays by keyed reference.
"""
from __future__ import annotations

import hashlib
import html
import json
import shutil
import time
from pathlib import Path

import duckdb
import numpy as np
import polars as pl

from .errors import InputError
from .evidence import CHECKPOINT, LEDGER, canonical, load_signing_key, new_entry, read_log, receipt_path, sha256_text
from .extract_rules import DEATH_CODE, DEATH_DATE_ONLY, LEGACY_DEATH_DATE_CODE, sql_literal
from .locking import workspace_lock
from .meds import (EVENT_COLUMNS, SHARD_ORDER, codes_metadata_path, count_code_tables, quarantine_files, shard_files,
                   shard_path, write_codes_metadata, write_dataset_metadata, write_shard)
from .privacy import id_refs, stay_ref, store_key
from .sharding import LEGACY_COUNT, Sharding

FORMAT = 5
FORMAT_FILE = "format.json"
LEGACY_LEDGER = "ledger-v1.jsonl"
LEGACY_CERTIFICATES = "legacy-v1"
OLD_DEATH = {"DEATH": DEATH_CODE, "DEATH//DOD": LEGACY_DEATH_DATE_CODE}


class MigrationError(InputError):
    """A workspace of another format than this release's, or one that cannot be migrated as it is."""


def store_format(store: Path) -> int | None:
    """The format of the workspace whose event store is ``store`` (recorded in the store, which every workspace
    and every stand-alone store has); None for a new, empty one."""
    store = Path(store)
    f = store / FORMAT_FILE
    if f.exists():
        return int(json.loads(f.read_text())["format"])
    if (store / "events").is_dir():
        return 1
    # a store of format 2 had no format file; one with no data yet was recognised by its workspace's log. No
    # store at all is a new one (lost, or an auditor's copy without it): the log is no sign of its format
    if (store / "data").is_dir() or (store.is_dir() and (store.parent / LEDGER).exists()):
        return 2
    return None


def check_format(store: Path) -> None:
    """Every command but ``migrate``: refuse a store (and its workspace) of another format, saying what to do."""
    v = store_format(store)
    where = Path(store).parent if Path(store).name == "store" else Path(store)
    if v is not None and v < FORMAT:
        raise MigrationError(f"{where} was written by an earlier release (format {v}; this release reads format "
                             f"{FORMAT}): run `forgetful migrate {where}` first")
    if v is not None and v > FORMAT:
        raise MigrationError(f"{where} was written by a newer release (format {v}; this release reads format "
                             f"{FORMAT}): upgrade forgetful")


def mark_current(store: Path) -> None:
    """Record this release's format in a new store (an older one is migrated, never marked)."""
    store = Path(store)
    if store_format(store) is None:
        store.mkdir(parents=True, exist_ok=True)
        (store / FORMAT_FILE).write_text(json.dumps({"format": FORMAT}))


def migrate(root: Path) -> list[str]:
    """Upgrade the workspace (or stand-alone store) at ``root`` to this release's format, under the workspace's
    lock; the steps done."""
    root = Path(root)
    store = root / "store" if (root / "store").is_dir() or not (root / "data").is_dir() else root
    v = store_format(store)
    if v is None:
        return ["nothing to migrate: no store yet"]
    if v == FORMAT:
        return [f"already format {FORMAT}"]
    if v > FORMAT:
        check_format(store)
    done = []
    with workspace_lock(store.parent if store != root else root, wait_seconds=60, purpose="migration"):
        if v == 1:
            done += _store_from_buckets(store)
            done += _seal_hash_chain_ledger(root, v) if store != root else []
        if v < 3:
            done += _meds_conventions(store)
            done += _derived_without_raw_ids(root) if store != root else []
        if v < 4:
            done += _death_dates_as_meds_death(store)
        done += _recorded_layout(store)
        (store / FORMAT_FILE).write_text(json.dumps({"format": FORMAT, "migrated_from": v,
                                                     "migrated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}))
    return done + [f"format {v} -> {FORMAT}"]


# -- format 1 -> 2 ----------------------------------------------------------------------------------------------

def _store_from_buckets(store: Path) -> list[str]:
    """``events/bucket=K/run-*.parquet`` into the MEDS shards ``data/K.parquet`` (sorted as the extraction writes
    them), ``codes.parquet`` into ``metadata/codes.parquet``, plus ``metadata/dataset.json``."""
    con = duckdb.connect()
    cols = ", ".join(EVENT_COLUMNS)
    n = 0
    for k in range(LEGACY_COUNT):
        files = sorted((store / "events" / f"bucket={k}").glob("*.parquet"))
        if files:
            src = "[" + ", ".join(sql_literal(f) for f in files) + "]"
            write_shard(con, f"SELECT {cols} FROM read_parquet({src}, union_by_name=true) ORDER BY {SHARD_ORDER}",
                        shard_path(store, k))
            n += len(files)
    con.close()
    old_codes = store / "codes.parquet"
    if old_codes.exists():
        codes = pl.read_parquet(old_codes)
        if "parent_codes" not in codes.columns:
            codes = codes.with_columns(pl.lit(None, dtype=pl.List(pl.String)).alias("parent_codes"))
        write_codes_metadata(codes_metadata_path(store), codes)
        old_codes.unlink()
    write_dataset_metadata(store, dataset_name="forgetful store (migrated)",
                           dataset_version=time.strftime("%Y-%m-%d"), etl_version="migrated from format 1")
    shutil.rmtree(store / "events")
    return [f"store: {n} bucket file(s) of events/ rewritten as MEDS shards data/K.parquet"]


def _legacy_chain(root: Path) -> list[dict]:
    """The unsigned ledger's entries, each checked against its chain and its certificate; refuse a broken one
    (migrating it would seal a rewritten history)."""
    entries = [json.loads(x) for x in (root / LEDGER).read_text().splitlines() if x.strip()] \
        if (root / LEDGER).exists() else []
    prev = "0" * 64
    for i, e in enumerate(entries):
        cert = root / "certificates" / str(e.get("certificate"))
        if (e.get("seq") != i or e.get("prev") != prev or
                e.get("entry_hash") != sha256_text(prev + e.get("certificate_sha256", "") + str(i))):
            raise MigrationError(f"{root / LEDGER}: entry {i} breaks the hash chain; the ledger was edited, so it is "
                                 f"not migrated (restore it from a backup)")
        if not cert.is_file() or sha256_text(cert.read_text()) != e["certificate_sha256"]:
            raise MigrationError(f"certificate {cert.name} of ledger entry {i} is missing or was edited; not migrated")
        prev = e["entry_hash"]
    return entries


def _seal_hash_chain_ledger(root: Path, version: int) -> list[str]:
    """Keep the unsigned ledger and its certificates as they are (moved aside), and issue the signed log's
    first entry: a migration certificate naming their digests and the chain's head."""
    entries = _legacy_chain(root)
    if not entries:
        return []
    key = load_signing_key(root)
    legacy = root / "certificates" / LEGACY_CERTIFICATES
    legacy.mkdir(parents=True)
    digests = {}
    for e in entries:
        src = root / "certificates" / e["certificate"]
        digests[e["certificate"]] = sha256_text(src.read_text())
        for f in (src, src.with_suffix(".html")):
            if f.exists():
                f.rename(legacy / f.name)
    ledger_text = (root / LEDGER).read_text()
    (root / LEDGER).rename(root / LEGACY_LEDGER)
    cert = {"certificate_id": 0, "kind": "migration", "from_format": version, "to_format": FORMAT,
            "legacy_ledger": LEGACY_LEDGER, "legacy_ledger_sha256": hashlib.sha256(ledger_text.encode()).hexdigest(),
            "legacy_entries": len(entries), "legacy_chain_head": entries[-1]["entry_hash"],
            "legacy_certificates": {f"{LEGACY_CERTIFICATES}/{k}": v for k, v in digests.items()},
            "checked": "every legacy entry chains to the one before and matches its certificate's SHA-256",
            "issued_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    text = canonical(cert)
    page = (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>Migration certificate</title></head>"
            f"<body><h1>Migration of the deletion log (format {version} to {FORMAT})</h1><p>The unsigned hash-chain "
            f"ledger (<code>{LEGACY_LEDGER}</code>, {len(entries)} entries, chain head "
            f"<code>{html.escape(cert['legacy_chain_head'])}</code>) and its certificates "
            f"(<code>certificates/{LEGACY_CERTIFICATES}/</code>) are kept unchanged; each was checked and its "
            f"SHA-256 is sealed in this certificate, the first entry of the signed log.</p></body></html>")
    log = read_log(root)
    line, checkpoint, receipt = new_entry(log, "000000.json", text, page, key)
    (root / "certificates" / "000000.json").write_text(text)
    (root / "certificates" / "000000.html").write_text(page)
    receipt_path(root / "certificates" / "000000.json").parent.mkdir(parents=True, exist_ok=True)
    receipt_path(root / "certificates" / "000000.json").write_text(receipt)
    (root / LEDGER).write_text(line + "\n")
    (root / CHECKPOINT).write_text(checkpoint)
    return [f"deletion log: the unsigned ledger ({len(entries)} entries) kept as {LEGACY_LEDGER} and sealed by a "
            f"signed migration entry"]


# -- shared by the steps below ----------------------------------------------------------------------------

def _rewrite_events(store: Path, fix: str) -> None:
    """Every shard and quarantine file of the store with ``fix`` (a DuckDB REPLACE list) applied."""
    con = duckdb.connect()
    for f in sorted((store / "data").glob("*.parquet")):
        write_shard(con, f"SELECT * REPLACE ({fix}) FROM read_parquet({sql_literal(f)}) ORDER BY {SHARD_ORDER}", f)
    for f in quarantine_files(store):
        tmp = f.with_suffix(".tmp")
        con.execute(f"COPY (SELECT * REPLACE ({fix}) FROM read_parquet({sql_literal(f)})) TO {sql_literal(tmp)} "
                    f"(FORMAT parquet)")
        tmp.replace(f)
    con.close()


def _merge_codes(store: Path, renamed: dict) -> None:
    """The code metadata with codes renamed and the counts of codes now equal summed."""
    path = codes_metadata_path(store)
    if path.exists():
        codes = pl.read_parquet(path).with_columns(pl.col("code").replace(renamed))
        extra = [c for c in codes.columns if c not in ("code", "count")]
        merged = codes.group_by("code", maintain_order=True).agg(pl.col("count").sum(), *[pl.col(c).first()
                                                                                        for c in extra])
        write_codes_metadata(path, merged)


# -- format 2 -> 3 ----------------------------------------------------------------------------------------------

def _meds_conventions(store: Path) -> list[str]:
    """Null for an empty text value and MEDS's death codes, in every shard, the quarantine and the code
    metadata (event hashes stay: the extraction hashes death under its old name)."""
    rename = " ".join(f"WHEN '{a}' THEN '{b}'" for a, b in OLD_DEATH.items())
    _rewrite_events(store, f"CASE code {rename} ELSE code END AS code, NULLIF(text_value, '') AS text_value")
    _merge_codes(store, OLD_DEATH)
    return ["store: empty text values made null, death coded MEDS_DEATH and MEDS_DEATH//DOD"]


def _derived_without_raw_ids(root: Path) -> list[str]:
    """Per-stay results and cohort-memory token ids name stays by keyed reference; caches are dropped (their keys
    cover the code, which changed)."""
    done = []
    store = root / "store"
    key = store_key(store, root) if (store / "key_fingerprint.json").exists() else None
    results = root / "results" / "per_stay.parquet"
    if results.exists() and key is not None and "stay_id" in pl.read_parquet_schema(results):
        id_refs(pl.read_parquet(results), key).write_parquet(results)
        done.append("per-stay results: stays and patients by keyed reference")
    for npz in sorted((root / "memories" / "cohort" / "checkpoints").glob("*/memory.npz")) if key else []:
        if _rename_hour_tokens(npz, key):
            done.append(f"cohort memory {npz.parent.name}: token ids name stays by keyed reference")
    if (root / "cache").exists():
        shutil.rmtree(root / "cache")
        done.append("caches dropped (the next run rebuilds them)")
    return done


def _rename_hour_tokens(npz: Path, key: bytes) -> bool:
    """``<owner>:<stay_id>-h<hour>:0`` -> ``<owner>:<stay ref>-h<hour>:0`` in a saved memory."""
    with np.load(npz, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(str(arrays["meta"]))
    changed = False
    for tok in meta["tokens"]:
        owner, item, occ = str(tok[0]).rsplit(":", 2)
        stay, sep, hour = item.partition("-h")
        if sep and stay.isdigit():
            tok[0] = f"{owner}:{stay_ref(int(stay), key)}-h{hour}:{occ}"
            changed = True
    if changed:
        arrays["meta"] = np.array(json.dumps(meta))
        tmp = npz.with_name(npz.stem + ".tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(npz)
    return changed


# -- format 3 -> 4 ----------------------------------------------------------------------------------------------

def _death_dates_as_meds_death(store: Path) -> list[str]:
    """``MEDS_DEATH//DOD`` -> ``MEDS_DEATH`` with the text value saying it is a date only (event hashes stay:
    the extraction hashes such a row under its old name)."""
    _rewrite_events(store, f"CASE WHEN code = '{LEGACY_DEATH_DATE_CODE}' THEN '{DEATH_CODE}' ELSE code END AS code, "
                           f"CASE WHEN code = '{LEGACY_DEATH_DATE_CODE}' THEN '{DEATH_DATE_ONLY}' ELSE text_value END "
                           f"AS text_value")
    _merge_codes(store, {LEGACY_DEATH_DATE_CODE: DEATH_CODE})
    return [f"store: a date of death alone coded {DEATH_CODE} (was {LEGACY_DEATH_DATE_CODE}), its text value "
            f"'{DEATH_DATE_ONLY}'"]


# -- format 4 -> 5 ----------------------------------------------------------------------------------------------

def _recorded_layout(store: Path) -> list[str]:
    """The store's shard count recorded (the 16 every earlier store has: the shards stay as they are) and its
    code counts per source table counted."""
    Sharding(LEGACY_COUNT).record(store)
    done = [f"store: its shard count ({LEGACY_COUNT}) recorded"]
    if shard_files(store):
        con = duckdb.connect()
        count_code_tables(con, store)
        con.close()
        done.append("store: code counts per source table counted")
    return done
