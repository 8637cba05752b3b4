"""Step: the certificate, its page, its receipt and its entry in the signed log; stale reports stamped."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pipeline.certificate import Certificate
from pipeline.evidence import CHECKPOINT, new_entry, receipt_path
from pipeline.versions import code_version
from reports.certificate_page import render_certificate_html
from reports.html import mark_stale

from .plan import DeletionFailed

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from pipeline.evidence import Log
    from pipeline.transaction import Transaction
    from pipeline.workspace import Workspace

MODE_MEANING = {"decrement": "memories equal the fixed-C refit of their retained tokens",
                "replay": "cohort memory re-streamed as if the patient had never been seen"}
# What a deletion leaves equal to a run that never saw the patient, by mode (what the certificate states; the
# equivalence of replay is tested against such a run: tests/deletion/test_never_saw.py)
STORE_EQUAL = ["event store rows", "stay table", "MEDS subject splits", "code metadata counts",
               "the patient's label rows, per-stay results and per-stay memories (removed)"]
DECREMENT_NOT_EQUAL = [
    "cohort memory: it equals the fixed-C refit of its retained tokens, but tokens evicted while the patient was "
    "present do not come back (the difference to a replay without them is measured in the verification)",
    "rare-item vocabulary, streaming setting and token scaling fitted to the training split (when the config fits "
    "it), and what was computed from them: other patients' label rows and per-stay results, statistics, report "
    "(the reports are marked stale; the next run or a replay deletion recomputes them without the patient)"]


def scope(mode: str, recomputed: list) -> dict:
    """Which artifacts equal a run that never saw the patient, and which do not (and why)."""
    if mode == "replay" and recomputed:
        return {"equal": STORE_EQUAL + ["cohort memory (re-streamed without the patient)"] + recomputed,
                "not_equal": []}
    if mode == "replay":
        return {"equal": list(STORE_EQUAL),
                "not_equal": ["cohort memory: re-streamed without the patient, but under the key statistics "
                              "persisted with it, which a raw-events run fitted with the patient",
                              "aggregates of the last run (a raw-events run): reports marked stale, recomputed by "
                              "the next run"]}
    return {"equal": list(STORE_EQUAL), "not_equal": list(DECREMENT_NOT_EQUAL)}


@dataclass(frozen=True)
class DeletionChange:
    """What one deletion transaction did for all its patients: the mode, each memory's refit check and state
    digests, the reports marked stale, what a replay recomputed without them, its seconds, how many patients."""
    mode: str
    verification: dict
    digests: dict
    stale: list
    recomputed: list
    seconds: float
    batch: int = 1


def certificate(log: Log, subject_hash: str, removed: dict, residual: dict, change: DeletionChange) -> Certificate:
    """The certificate of one patient: only what was done and checked (``removed``: their rows and tokens per
    place; ``change``: the transaction's, whose memory digests and checks are of that one change). Its place in
    the log is set when it is staged (:func:`stage_certificates`)."""
    recomputed = list(change.recomputed)
    return Certificate(
        certificate_id=log.size, subject_hash=subject_hash,
        deleted_together={"patients": change.batch, "meaning": "deleted in one transaction; the memory digests and "
                          "refit checks are of that change, the removed counts this patient's"},
        hash="HMAC-SHA256 (the deployment's hash key, kept outside the workspace)",
        mode=change.mode, mode_meaning=MODE_MEANING[change.mode], removed=removed, memory_digests=change.digests,
        verification=change.verification, residual_scan=residual, artifacts_marked_stale=change.stale,
        recomputed_without_the_patient=recomputed, never_saw_equivalence=scope(change.mode, recomputed),
        code_version=code_version(), issued_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        seconds=round(change.seconds, 3), log_size_before=log.size, log_root_before=log.root_hex())


def stale_reports(ws: Workspace) -> list[str]:
    """The aggregate reports computed before this deletion (the next scheduled run regenerates them)."""
    return [p.name for p in (ws.report_json, ws.report_html) if p.exists()]


def _stamp_stale(ws, txn, stale, names) -> None:
    said = (f"a patient was deleted after this report was computed (certificate {names[0]})" if len(names) == 1 else
            f"{len(names)} patients were deleted after this report was computed (certificates {', '.join(names)})")
    if "report.json" in stale:
        rep = json.loads(ws.report_json.read_text())
        rep["stale"] = {"reason": said, "certificates": names}
        txn.stage(ws.report_json).write_text(json.dumps(rep, indent=1, default=str))
    if "report.html" in stale:
        txn.stage(ws.report_html).write_text(mark_stale(ws.report_html.read_text(), said))


def stage_certificates(ws: Workspace, txn: Transaction, log: Log, signing_key: Ed25519PrivateKey,
                       certs: list[Certificate], small_cell_threshold: int) -> list[tuple[Certificate, str]]:
    """Stage each certificate, its page, its receipt and its log entry, in order, and the newly signed checkpoint
    after the last; mark the reports stale naming them. Returns each certificate as issued (its place in the log
    set) with its file name."""
    issued, lines = [], []
    for cert in certs:
        cert = replace(cert, certificate_id=log.size, log_size_before=log.size, log_root_before=log.root_hex())
        name = f"{log.size:06d}.json"
        if (ws.certificates / name).exists() or receipt_path(ws.certificates / name).exists():
            # never overwrite another patient's certificate (read_log names a rolled-back log before this)
            raise DeletionFailed(f"certificate {name} exists already but the log has {log.size} entries: the log "
                                 f"was rolled back; nothing is appended")
        text, page = cert.text(), render_certificate_html(cert, name, small_cell_threshold)
        line, checkpoint, receipt = new_entry(log, name, text, page, signing_key)
        log.entries.append(json.loads(line))
        txn.stage(ws.certificates / name).write_text(text)
        txn.stage(ws.certificates / name.replace(".json", ".html")).write_text(page)
        txn.stage(receipt_path(ws.certificates / name)).write_text(receipt)
        issued.append((cert, name))
        lines.append(line)
    old = ws.ledger.read_text() if ws.ledger.exists() else ""
    txn.stage(ws.ledger).write_text(old + "".join(f"{line}\n" for line in lines))
    txn.stage(ws.root / CHECKPOINT).write_text(checkpoint)
    _stamp_stale(ws, txn, certs[0].artifacts_marked_stale, [name for _, name in issued])
    return issued
