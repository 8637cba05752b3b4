"""Deletion certificates (canonical JSON) and their hash-chained, append-only ledger.

Each certificate is canonical JSON (sorted keys, no whitespace) hashed with SHA-256. The ledger
(``ledger.jsonl``) holds one entry per certificate: ``{"seq", "certificate", "certificate_sha256", "prev",
"entry_hash"}`` with ``entry_hash = sha256(prev + certificate_sha256 + seq)`` and ``prev`` the previous entry's
hash (64 zeros for the first). Editing any past certificate changes its hash; editing, dropping or reordering a
ledger line breaks the chain; both are reported by :func:`verify_certificate`.

Subjects appear only as a keyed hash (:mod:`pipeline.privacy`), never as the raw id.
"""
import hashlib
import json
from pathlib import Path

GENESIS = "0" * 64


def canonical(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def sha256_text(text):
    return hashlib.sha256(text.encode()).hexdigest()


def read_ledger(path):
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def next_entry(ledger_entries, cert_name, cert_text):
    prev = ledger_entries[-1]["entry_hash"] if ledger_entries else GENESIS
    seq = len(ledger_entries)
    digest = sha256_text(cert_text)
    return {"seq": seq, "certificate": cert_name, "certificate_sha256": digest, "prev": prev,
            "entry_hash": sha256_text(prev + digest + str(seq))}


def verify_certificate(cert_path, ledger_path=None):
    """Re-check one certificate against the ledger and the whole chain; returns a list of problems ([] = ok)."""
    cert_path = Path(cert_path)
    ledger_path = Path(ledger_path) if ledger_path else cert_path.parent.parent / "ledger.jsonl"
    problems = []
    entries = read_ledger(ledger_path)
    if not entries:
        return [f"ledger {ledger_path} is missing or empty"]
    prev = GENESIS
    for i, e in enumerate(entries):
        if e.get("seq") != i:
            problems.append(f"ledger entry {i} has seq {e.get('seq')}: entries were dropped or reordered")
        if e.get("prev") != prev:
            problems.append(f"ledger entry {i} does not chain to entry {i - 1}")
        if e.get("entry_hash") != sha256_text(e.get("prev", "") + e.get("certificate_sha256", "") + str(e.get("seq"))):
            problems.append(f"ledger entry {i} was edited (entry hash mismatch)")
        prev = e.get("entry_hash")
        other = ledger_path.parent / "certificates" / e.get("certificate", "")
        if not other.is_file():
            problems.append(f"certificate {e.get('certificate')} of ledger entry {i} is missing")
        elif sha256_text(other.read_text()) != e.get("certificate_sha256"):
            problems.append(f"certificate {e.get('certificate')} was edited after it was issued")
    if not cert_path.is_file():
        return problems + [f"certificate {cert_path} does not exist"]
    text = cert_path.read_text()
    mine = [e for e in entries if e.get("certificate") == cert_path.name]
    if not mine:
        problems.append(f"certificate {cert_path.name} is not in the ledger")
    try:
        cert = json.loads(text)
    except json.JSONDecodeError:
        return problems + [f"certificate {cert_path.name} is not valid JSON"]
    if canonical(cert) != text:
        problems.append(f"certificate {cert_path.name} is not in canonical form (edited)")
    for name, v in (cert.get("verification") or {}).items():
        if not v.get("passed"):
            problems.append(f"memory {name} failed its refit verification")
    if cert.get("residual_scan", {}).get("rows_remaining", 0):
        problems.append("the post-deletion scan found remaining rows")
    return problems
