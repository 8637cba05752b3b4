"""Deletion evidence no one can rewrite unseen: a transparency log of certificates in the manner of RFC 6962/9162.

* Each certificate is canonical JSON (RFC 8785, the ``rfc8785`` package). The log (``WS/ledger.jsonl``) holds one
  canonical entry per certificate: its sequence number, file name and the SHA-256 of the certificate's JSON
  and of its HTML page.
* The entries are the leaves of a Merkle tree (``pymerkle``, RFC 6962 leaf/node prefixes). ``WS/checkpoint.json``
  is the signed tree head: size and root signed with Ed25519 (``cryptography``) by a key kept outside the
  workspace (``FORGETFUL_SIGNING_KEY_FILE``, made with ``forgetful keygen --signing``).
* Each certificate has a receipt (``certificates/proofs/NNNNNN.json``): the inclusion proof of its entry in
  the tree as it was issued, with the signed checkpoint of that tree.
* :func:`verify_certificate` recomputes every leaf from the files, the root, the checkpoint's signature, the
  certificate's inclusion proof, and that the receipt's (and an auditor's saved) earlier tree is a prefix of
  today's (consistency), so editing, dropping, reordering or truncating entries before a saved checkpoint is
  caught. Whoever holds the workspace but not the signing key cannot re-sign a rewritten log.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import rfc8785
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pymerkle import InclusionProof, InmemoryTree, verify_consistency, verify_inclusion
from pymerkle.proof import InvalidProof

from .errors import InputError
from .privacy import write_secret_file

SIGNING_KEY_ENV = "FORGETFUL_SIGNING_KEY_FILE"
# The log signer's public key pinned outside the workspace: hex, or a file holding the hex (what
# `forgetful keygen --signing` prints), for auditors who do not hold the private key.
PUBLIC_KEY_ENV = "FORGETFUL_LOG_PUBLIC_KEY"
LEDGER, CHECKPOINT = "ledger.jsonl", "checkpoint.json"
LOG_ID = "forgetful deletion log v2"


class EvidenceError(InputError):
    """No usable signing key, or a log that cannot be appended to."""


def read_json_object(path: Path, what: str) -> dict:
    """A JSON object file of the evidence (checkpoint, receipt, certificate); an EvidenceError in one line naming
    the file when it is empty, truncated or not an object (a damaged file is not a verdict on the log)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise EvidenceError(f"{what} {path} cannot be read: {e.strerror or e}") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise EvidenceError(f"{what} {path} is damaged: {'empty' if not text.strip() else 'not JSON'} ({e.msg}, "
                            f"character {e.pos}); restore it from a backup") from None
    if not isinstance(value, dict):
        raise EvidenceError(f"{what} {path} is damaged: a JSON {type(value).__name__}, not an object; restore it "
                            f"from a backup")
    return value


def canonical(obj: dict) -> str:
    return rfc8785.dumps(obj).decode()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def receipt_path(cert_path: Path) -> Path:
    return Path(cert_path).parent / "proofs" / Path(cert_path).name


def page_path(cert_path: Path) -> Path:
    return Path(cert_path).with_suffix(".html")


# -- signing key -----------------------------------------------------------------------------------------------

def write_signing_key(path: Path) -> Path:
    """A new Ed25519 private key (PEM) in a new owner-only file; never overwrites one."""
    pem = Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption())
    try:
        return write_secret_file(path, pem)
    except FileExistsError:
        raise EvidenceError(f"{Path(path).expanduser()} exists already: a signing key is never overwritten") \
            from None


def load_signing_key(workspace: Path) -> Ed25519PrivateKey:
    path = os.environ.get(SIGNING_KEY_ENV)
    if not path:
        raise EvidenceError(f"no signing key for the deletion log: create one with `forgetful keygen --signing PATH` "
                            f"(a path outside the workspace) and set {SIGNING_KEY_ENV}=PATH")
    p = Path(path).expanduser().resolve()
    if p.is_relative_to(Path(workspace).resolve()):
        raise EvidenceError(f"the signing key {p} lies inside the workspace {workspace}: keep it outside")
    try:
        key = serialization.load_pem_private_key(p.read_bytes(), password=None)
    except (OSError, ValueError) as e:
        raise EvidenceError(f"signing key {p} cannot be read as a PEM private key: {e}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise EvidenceError(f"signing key {p} is not an Ed25519 key")
    return key


def public_hex(key: Ed25519PrivateKey) -> str:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


@dataclass(frozen=True)
class TrustAnchor:
    """The public key a verification holds the log's signatures to, and where it came from (never the
    workspace: whoever rewrites a log can put any key there)."""
    public_key: str
    source: str


def _public_key_text(value: str, workspace: Path, what: str) -> str:
    """A hex public key given as itself or as a file outside ``workspace`` holding it."""
    text = value.strip()
    path = Path(text).expanduser()
    if len(text) != 64 or not all(c in "0123456789abcdef" for c in text.lower()):
        if not path.is_file():
            raise EvidenceError(f"{what} {value!r} is neither a hex Ed25519 public key nor a readable file")
        if path.resolve().is_relative_to(Path(workspace).resolve()):
            raise EvidenceError(f"{what} {path} lies inside the workspace it is to check: keep it outside")
        text = path.read_text().strip()
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(text))
    except ValueError:
        raise EvidenceError(f"{what} {value!r} does not hold a hex Ed25519 public key") from None
    return text.lower()


def trust_anchor(workspace: Path, public_key: str | None = None,
                 saved_checkpoint: dict | None = None) -> TrustAnchor | None:
    """The signer's public key from outside the workspace: ``public_key`` (hex or a file), else
    $FORGETFUL_LOG_PUBLIC_KEY, else the public half of $FORGETFUL_SIGNING_KEY_FILE, else the key of an auditor's
    saved checkpoint; None when there is none."""
    if public_key:
        return TrustAnchor(_public_key_text(public_key, workspace, "--public-key"), "--public-key")
    if os.environ.get(PUBLIC_KEY_ENV):
        return TrustAnchor(_public_key_text(os.environ[PUBLIC_KEY_ENV], workspace, PUBLIC_KEY_ENV), PUBLIC_KEY_ENV)
    if os.environ.get(SIGNING_KEY_ENV):
        return TrustAnchor(public_hex(load_signing_key(workspace)), f"the public half of ${SIGNING_KEY_ENV}")
    if saved_checkpoint and saved_checkpoint.get("public_key"):
        return TrustAnchor(str(saved_checkpoint["public_key"]), "the saved checkpoint")
    return None


# -- the log ---------------------------------------------------------------------------------------------------

@dataclass
class Log:
    """The log of a workspace as read from its files: entries (parsed), their canonical texts, the tree."""
    root: Path
    entries: list
    tree: InmemoryTree
    problems: list

    @property
    def size(self) -> int:
        return len(self.entries)

    def root_hex(self, size: int | None = None) -> str:
        size = self.size if size is None else size
        return self.tree.get_root(size).hex() if size else ""


def _tree(leaves) -> InmemoryTree:
    tree = InmemoryTree(algorithm="sha256")
    for leaf in leaves:
        tree.append_entry(leaf.encode())
    return tree


def read_log(root: Path) -> Log:
    """Read ``WS/ledger.jsonl`` and check each entry against the files it names; problems are listed, never
    raised, so a broken log is reported in full."""
    root = Path(root)
    path, entries, texts, problems = root / LEDGER, [], [], []
    lines = path.read_text().splitlines() if path.exists() else []
    for i, line in enumerate(lines):
        try:
            e = json.loads(line)
        except json.JSONDecodeError as err:
            problems.append(f"ledger line {i + 1} is not JSON ({err.msg}); the log is corrupt")
            continue
        if not isinstance(e, dict):
            problems.append(f"ledger line {i + 1} is a JSON {type(e).__name__}, not an entry; the log is corrupt")
            continue
        if canonical(e) != line:
            problems.append(f"ledger line {i + 1} is not canonical JSON (edited)")
        if e.get("seq") != len(entries):
            problems.append(f"ledger line {i + 1} has seq {e.get('seq')}, expected {len(entries)}: entries were "
                            f"dropped or reordered")
        cert = root / "certificates" / str(e.get("certificate", ""))
        if not cert.is_file():
            problems.append(f"certificate {e.get('certificate')} of ledger line {i + 1} is missing")
        elif sha256_text(cert.read_text()) != e.get("certificate_sha256"):
            problems.append(f"certificate {e.get('certificate')} was edited after it was issued")
        page = page_path(cert)
        if not page.is_file() or sha256_text(page.read_text()) != e.get("page_sha256"):
            problems.append(f"the HTML page of certificate {e.get('certificate')} is missing or was edited")
        entries.append(e)
        texts.append(line)
    log = Log(root, entries, _tree(texts), problems)
    problems += _check_checkpoint(log) + _evidence_of_a_longer_log(log)
    return log


def _evidence_of_a_longer_log(log: Log) -> list:
    """Certificates or receipts the log does not account for: the log was rolled back (an older copy of it
    restored) or entries were dropped. Appending then would reuse a certificate's number."""
    listed = {e.get("certificate") for e in log.entries}
    certs = log.root / "certificates"
    problems = [f"certificate {f.name} is in the workspace but not in the log ({log.size} entries): the log was "
                f"rolled back or an entry dropped" for f in sorted(certs.glob("[0-9]*.json")) if f.name not in listed]
    for r in sorted((certs / "proofs").glob("[0-9]*.json")):
        try:
            size = int(json.loads(r.read_text())["checkpoint"]["size"])
        except (OSError, ValueError, KeyError, TypeError):
            problems.append(f"receipt proofs/{r.name} cannot be read: no signed checkpoint in it (damaged or "
                            f"edited)")
            continue
        if size > log.size:
            problems.append(f"receipt proofs/{r.name} was signed for a log of {size} entries, longer than the "
                            f"log's {log.size}: the log was rolled back")
    return problems


def _signed(payload: dict, key: Ed25519PrivateKey) -> dict:
    return payload | {"signature": key.sign(canonical(payload).encode()).hex()}


def _signature_ok(checkpoint: dict) -> bool:
    payload = {k: v for k, v in checkpoint.items() if k != "signature"}
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(checkpoint["public_key"])).verify(
            bytes.fromhex(checkpoint["signature"]), canonical(payload).encode())
    except (InvalidSignature, KeyError, ValueError):
        return False
    return True


def _check_checkpoint(log: Log) -> list:
    path = log.root / CHECKPOINT
    if not path.exists():
        return [] if log.size == 0 else [f"the log has {log.size} entries but no signed checkpoint"]
    cp = read_json_object(path, "the log's signed checkpoint")
    problems = [] if _signature_ok(cp) else ["the log's checkpoint signature does not verify (forged or edited)"]
    if cp.get("size") != log.size or cp.get("root") != log.root_hex():
        problems.append(f"the log ({log.size} entries) does not match its signed checkpoint ({cp.get('size')} "
                        f"entries): entries were added, edited or removed without signing")
    return problems


def check_consistency(log: Log, checkpoint: dict, what: str) -> list:
    """An earlier signed tree head must be a prefix of today's log (RFC 6962 consistency)."""
    if not _signature_ok(checkpoint):
        return [f"{what}: its signature does not verify"]
    size = int(checkpoint.get("size", -1))
    if size > log.size:
        return [f"{what} covers {size} entries but the log has {log.size}: the log was truncated"]
    if size == 0:
        return []
    try:
        proof = log.tree.prove_consistency(size, log.size)
        verify_consistency(bytes.fromhex(checkpoint["root"]), log.tree.get_root(log.size), proof)
    except (InvalidProof, ValueError):
        return [f"{what} (size {size}) is not a prefix of today's log: entries before it were rewritten"]
    return []


def new_entry(log: Log, cert_name: str, cert_text: str, page_text: str, key: Ed25519PrivateKey) -> tuple:
    """The ledger line, the signed checkpoint and the receipt of a new certificate (written by the caller, in
    its transaction)."""
    entry = {"seq": log.size, "certificate": cert_name, "certificate_sha256": sha256_text(cert_text),
             "page_sha256": sha256_text(page_text)}
    line = canonical(entry)
    log.tree.append_entry(line.encode())
    size = log.size + 1
    checkpoint = _signed({"log": LOG_ID, "size": size, "root": log.tree.get_root(size).hex(),
                          "public_key": public_hex(key)}, key)
    proof = log.tree.prove_inclusion(size, size)
    receipt = {"index": size, "leaf_sha256": log.tree.get_leaf(size).hex(), "proof": proof.serialize(),
               "checkpoint": checkpoint}
    return line, canonical(checkpoint), canonical(receipt)


def read_saved_checkpoint(path: Path) -> dict:
    """An auditor's saved copy of a signed checkpoint; one clear error naming the file when it is missing or
    not a checkpoint."""
    try:
        saved = json.loads(Path(path).read_text())
    except OSError as e:
        raise EvidenceError(f"saved checkpoint {path} cannot be read: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise EvidenceError(f"saved checkpoint {path} is not JSON (expected a copy of WS/checkpoint.json)") from None
    if not isinstance(saved, dict) or not {"size", "root", "public_key", "signature"} <= set(saved):
        raise EvidenceError(f"saved checkpoint {path} is not a signed checkpoint (size, root, public_key, signature)")
    return saved


def signer_problems(log: Log, receipt: dict | None, anchor: TrustAnchor | None) -> list:
    """The log's checkpoint and the receipt's must be signed by the anchor's key."""
    if anchor is None:
        return [f"no trusted public key to check who signed the log: pass --public-key (or set {PUBLIC_KEY_ENV}, "
                f"or {SIGNING_KEY_ENV} where the signing key is held) or --checkpoint with a copy saved earlier; "
                f"the key stored in the workspace proves nothing, since whoever rewrites the log can replace it"]
    problems = []
    current = log.root / CHECKPOINT
    if current.exists() and read_json_object(current, "the log's signed checkpoint").get("public_key") != \
            anchor.public_key:
        problems.append(f"the log's checkpoint is signed by another key than the trusted one ({anchor.source})")
    if receipt and receipt.get("checkpoint", {}).get("public_key") != anchor.public_key:
        problems.append(f"the certificate's receipt is signed by another key than the trusted one ({anchor.source})")
    return problems


def verify_certificate(cert_path: Path, saved_checkpoint: Path | None = None,
                       anchor: TrustAnchor | None = None) -> list:
    """Problems with one certificate and the whole log ([] = verified): every entry against its files, the
    signed checkpoint, its signer against the trusted key ``anchor`` (default: :func:`trust_anchor`), the
    certificate's inclusion proof, and the consistency of its receipt's (and of an auditor's
    ``saved_checkpoint`` file's) tree with today's log."""
    cert_path = Path(cert_path)
    log = read_log(cert_path.parent.parent)
    saved = read_saved_checkpoint(saved_checkpoint) if saved_checkpoint is not None else None
    anchor = anchor or trust_anchor(log.root, saved_checkpoint=saved)
    problems = list(log.problems)
    if not cert_path.is_file():
        return problems + [f"certificate {cert_path} does not exist"]
    mine = [e for e in log.entries if e.get("certificate") == cert_path.name]
    if not mine:
        problems.append(f"certificate {cert_path.name} is not in the log")
    rp = receipt_path(cert_path)
    receipt = read_json_object(rp, "the certificate's receipt") if rp.is_file() else None
    lacking = receipt is not None and not (isinstance(receipt.get("checkpoint"), dict) and
                                           {"root", "size"} <= set(receipt["checkpoint"]) and "proof" in receipt)
    if lacking:
        if not any(f"proofs/{rp.name}" in p for p in problems):     # the log's own check may have named it
            problems.append(f"the receipt proofs/{rp.name} lacks its checkpoint or proof (damaged or edited)")
        receipt = None
    problems += signer_problems(log, receipt, anchor)
    if receipt is None and not lacking:
        problems.append(f"the inclusion proof of {cert_path.name} (proofs/{rp.name}) is missing")
    elif receipt is not None and mine:
        problems += check_consistency(log, receipt["checkpoint"], f"the checkpoint in proofs/{rp.name}")
        leaf = log.tree.get_leaf(log.entries.index(mine[0]) + 1)
        try:
            verify_inclusion(leaf, bytes.fromhex(receipt["checkpoint"]["root"]),
                             InclusionProof.deserialize(receipt["proof"]))
        except (InvalidProof, ValueError, KeyError):
            problems.append(f"the inclusion proof of {cert_path.name} does not verify")
    if saved is not None:
        problems += check_consistency(log, saved, f"the saved checkpoint {saved_checkpoint}")
        current = log.root / CHECKPOINT
        if current.exists() and read_json_object(current, "the log's signed checkpoint").get("public_key") != \
                saved.get("public_key"):
            problems.append(f"the log is now signed by another key than the saved checkpoint {saved_checkpoint}")
    cert = read_json_object(cert_path, "certificate")
    verification, scan = cert.get("verification") or {}, cert.get("residual_scan") or {}
    if not isinstance(verification, dict) or not isinstance(scan, dict):
        return problems + [f"certificate {cert_path.name} is not a deletion certificate's shape (damaged or edited)"]
    for name, v in verification.items():
        if not (isinstance(v, dict) and v.get("passed")):
            problems.append(f"memory {name} failed its refit verification")
    if scan.get("rows_remaining", 0):
        problems.append("the post-deletion scan found remaining rows")
    return problems

