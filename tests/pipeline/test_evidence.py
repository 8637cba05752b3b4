"""The deletion log: each way of rewriting it is caught (edit with a recomputed chain, truncation, reordering,
an edited page, a forged checkpoint), and a broken log is never appended to."""
import json
import shutil

import pytest

from pipeline.evidence import (CHECKPOINT, LEDGER, EvidenceError, canonical, load_signing_key, new_entry, read_log,
                               receipt_path, sha256_text, verify_certificate, write_signing_key)


def issue(ws, key, n, mode="decrement"):
    """Issue ``n`` certificates into workspace ``ws`` the way a deletion does (without the transaction)."""
    (ws / "certificates").mkdir(parents=True, exist_ok=True)
    for _ in range(n):
        log = read_log(ws)
        assert log.problems == []
        name = f"{log.size:06d}.json"
        cert = {"certificate_id": log.size, "subject_hash": f"{log.size:064x}", "mode": mode,
                "residual_scan": {"rows_remaining": 0}, "verification": {}}
        text, page = canonical(cert), f"<html>certificate {log.size}</html>"
        line, checkpoint, receipt = new_entry(log, name, text, page, key)
        (ws / "certificates" / name).write_text(text)
        (ws / "certificates" / name).with_suffix(".html").write_text(page)
        receipt_path(ws / "certificates" / name).parent.mkdir(exist_ok=True)
        receipt_path(ws / "certificates" / name).write_text(receipt)
        with open(ws / LEDGER, "a") as fh:
            fh.write(line + "\n")
        (ws / CHECKPOINT).write_text(checkpoint)


@pytest.fixture
def signed(tmp_path, monkeypatch):
    key = load_signing_key_from(write_signing_key(tmp_path / "keys" / "signing.pem"), monkeypatch)
    ws = tmp_path / "ws"
    issue(ws, key, 4)
    saved = tmp_path / "auditor-checkpoint.json"          # an auditor's copy of the signed head at 4 entries
    shutil.copy(ws / CHECKPOINT, saved)
    return ws, key, saved


def load_signing_key_from(path, monkeypatch):
    monkeypatch.setenv("FORGETFUL_SIGNING_KEY_FILE", str(path))
    return load_signing_key(path.parent.parent / "ws")


def cert(ws, i):
    return ws / "certificates" / f"{i:06d}.json"


def test_an_untouched_log_verifies_with_proofs_and_an_auditor_checkpoint(signed):
    ws, key, saved = signed
    for i in range(4):
        assert verify_certificate(cert(ws, i), saved) == []
    issue(ws, key, 2)                                       # the log grows: the old checkpoint is a prefix
    assert verify_certificate(cert(ws, 5), saved) == [] and verify_certificate(cert(ws, 1), saved) == []


def test_an_edited_certificate_with_the_chain_recomputed_is_caught(signed):
    ws, _, _ = signed
    c = json.loads(cert(ws, 1).read_text()) | {"mode": "replay"}
    text = canonical(c)
    cert(ws, 1).write_text(text)
    lines = (ws / LEDGER).read_text().splitlines()        # the attacker fixes the digest in the entry too
    e = json.loads(lines[1]) | {"certificate_sha256": sha256_text(text)}
    lines[1] = canonical(e)
    (ws / LEDGER).write_text("\n".join(lines) + "\n")
    problems = verify_certificate(cert(ws, 3))
    assert any("does not match its signed checkpoint" in p for p in problems)


def test_truncation_is_caught_by_the_checkpoint_or_the_auditor_copy(signed, tmp_path):
    ws, _, saved = signed
    before = (ws / CHECKPOINT).read_text()
    lines = (ws / LEDGER).read_text().splitlines()
    (ws / LEDGER).write_text("\n".join(lines[:3]) + "\n")  # drop the last entry and its files
    for f in ws.glob("certificates/000003*"):
        f.unlink()
    assert any("does not match its signed checkpoint" in p for p in verify_certificate(cert(ws, 2)))
    # the receipt left behind was signed for a longer log
    assert any("rolled back" in p for p in verify_certificate(cert(ws, 2)))
    receipt_path(cert(ws, 3)).unlink()
    # the attacker also puts back the checkpoint signed when the log had 3 entries
    old = json.loads(receipt_path(cert(ws, 2)).read_text())["checkpoint"]
    (ws / CHECKPOINT).write_text(canonical(old))
    assert verify_certificate(cert(ws, 2)) == []          # self-consistent: only an earlier copy catches it
    assert any("truncated" in p for p in verify_certificate(cert(ws, 2), saved))
    assert before != (ws / CHECKPOINT).read_text()


def test_reordering_an_edited_page_and_a_forged_checkpoint_are_caught(signed, tmp_path, monkeypatch):
    ws, _, saved = signed
    lines = (ws / LEDGER).read_text().splitlines()
    (ws / LEDGER).write_text("\n".join([lines[1], lines[0], *lines[2:]]) + "\n")
    assert any("dropped or reordered" in p for p in verify_certificate(cert(ws, 2)))
    (ws / LEDGER).write_text("\n".join(lines) + "\n")
    page = cert(ws, 2).with_suffix(".html")
    page.write_text(page.read_text().replace("certificate", "CERTIFICATE"))
    assert any("HTML page" in p for p in verify_certificate(cert(ws, 2)))
    page.write_text(page.read_text().replace("CERTIFICATE", "certificate"))
    # a rewritten log re-signed with another key: the signature checks, the auditor's copy does not
    other = load_signing_key_from(write_signing_key(tmp_path / "keys2" / "signing.pem"), monkeypatch)
    shutil.rmtree(ws)
    issue(ws, other, 4, mode="replay")
    assert verify_certificate(cert(ws, 3)) == []
    problems = verify_certificate(cert(ws, 3), saved)
    assert any("rewritten" in p for p in problems) and any("another key" in p for p in problems)


def test_a_corrupt_line_is_named_and_the_signing_key_must_live_outside(signed, monkeypatch):
    ws, _, _ = signed
    with open(ws / LEDGER, "a") as fh:
        fh.write("{not json\n")
    problems = read_log(ws).problems
    assert any("ledger line 5 is not JSON" in p for p in problems)
    monkeypatch.setenv("FORGETFUL_SIGNING_KEY_FILE", str(write_signing_key(ws / "signing.pem")))
    with pytest.raises(EvidenceError, match="inside the workspace"):
        load_signing_key(ws)


@pytest.mark.parametrize("damage, finding", [
    (lambda ws: (ws / LEDGER).write_text("5\n"), "ledger line 1 is a JSON int, not an entry"),
    (lambda ws: receipt_path(cert(ws, 1)).write_text(json.dumps({"index": 2, "proof": {}})),
     "receipt proofs/000001.json cannot be read: no signed checkpoint in it"),
])
def test_the_audit_s_damaged_logs_are_a_verdict_not_an_internal_error(signed, capsys, damage, finding):
    """A ledger line `5` gave "internal error: AttributeError", a receipt without `checkpoint` "error:
    'checkpoint'": both are findings about the log (verify's exit 1 with FAILED lines), never our defect."""
    from flows.cli import main
    ws, _, _ = signed
    damage(ws)
    assert main(["verify", str(cert(ws, 1))]) == 1
    out = capsys.readouterr()
    assert finding in out.out and "internal error" not in out.err and "Traceback" not in out.err
