"""What an audit of the deletion evidence found, each fixed: verification holds the log to a key the workspace
cannot change; a rolled-back log is never appended to (no certificate is overwritten); bad arguments are one
line."""
import json
import shutil

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from deletion import DeletionFailed, delete_subject, scan_subject
from flows.cli import main
from pipeline.evidence import (CHECKPOINT, LEDGER, PUBLIC_KEY_ENV, SIGNING_KEY_ENV, load_signing_key,
                               public_hex, read_log, verify_certificate)
from tests.deletion.test_deletion import plain_ws  # noqa: F401  (the module's workspace fixture)
from tests.workspaces import copy_ws, scored_subjects


def _rebuild_without_first_entry(ws, key):
    """What an attacker holding the workspace but not the signing key can do: drop entry 0, renumber the rest,
    re-sign the log with a key of their own (stored in the workspace's checkpoint and receipts)."""
    from pipeline.evidence import Log, _tree, new_entry
    entries = [json.loads(x) for x in ws.ledger.read_text().splitlines()]
    (ws.certificates / entries[0]["certificate"]).unlink()
    log = Log(ws.root, [], _tree([]), [])
    lines = []
    for e in entries[1:]:
        cert = ws.certificates / e["certificate"]
        name = f"{len(lines):06d}.json"
        text, page = cert.read_text(), cert.with_suffix(".html").read_text()
        for f in (cert, cert.with_suffix(".html"), ws.certificates / "proofs" / cert.name):
            f.unlink()
        line, checkpoint, receipt = new_entry(log, name, text, page, key)
        log.entries.append(json.loads(line))
        (ws.certificates / name).write_text(text)
        (ws.certificates / name).with_suffix(".html").write_text(page)
        (ws.certificates / "proofs" / name).write_text(receipt)
        lines.append(line)
        (ws.root / CHECKPOINT).write_text(checkpoint)
    ws.ledger.write_text("\n".join(lines) + "\n")


def test_a_log_rebuilt_without_an_entry_and_re_signed_by_another_key_fails_verification(plain_ws, tmp_path,  # noqa: F811
                                                                                         monkeypatch, capsys):
    ws = copy_ws(plain_ws, tmp_path / "ws")
    for sid in scored_subjects(ws)[:2]:
        delete_subject(ws, sid, mode="replay")
    owner = public_hex(load_signing_key(ws.root))
    _rebuild_without_first_entry(ws, Ed25519PrivateKey.generate())
    assert read_log(ws.root).problems == []                  # internally consistent: the old check said "ok"
    cert = ws.certificates / "000000.json"
    assert any("another key than the trusted one" in p for p in verify_certificate(cert))
    # an auditor without the private key pins the public key (printed by keygen)
    monkeypatch.delenv(SIGNING_KEY_ENV)
    monkeypatch.setenv(PUBLIC_KEY_ENV, owner)
    assert main(["verify", str(cert)]) == 1
    assert "another key than the trusted one" in capsys.readouterr().out
    # with no trusted key at all, nothing is called ok
    monkeypatch.delenv(PUBLIC_KEY_ENV)
    assert any("no trusted public key" in p for p in verify_certificate(cert))
    assert main(["verify", str(cert), "--public-key", owner]) == 1


def test_an_untouched_log_verifies_against_the_pinned_key_and_says_what_was_checked(plain_ws, tmp_path,  # noqa: F811
                                                                                    monkeypatch, capsys):
    ws = copy_ws(plain_ws, tmp_path / "ws")
    _, path = delete_subject(ws, scored_subjects(ws)[0], mode="replay")
    owner = public_hex(load_signing_key(ws.root))
    monkeypatch.delenv(SIGNING_KEY_ENV)
    pinned = tmp_path / "pinned.pub"
    pinned.write_text(owner + "\n")
    assert main(["verify", str(path), "--public-key", str(pinned)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok:") and "trusted key" in out and "--public-key" in out
    saved = tmp_path / "saved.json"
    shutil.copy(ws.root / CHECKPOINT, saved)
    assert main(["verify", str(path), "--checkpoint", str(saved)]) == 0
    assert "the saved checkpoint" in capsys.readouterr().out


@pytest.mark.parametrize("content", [None, "not json {", "[1, 2]"])
def test_a_missing_or_malformed_saved_checkpoint_is_one_line_naming_the_file(plain_ws, tmp_path, content,  # noqa: F811
                                                                             capsys):
    ws = copy_ws(plain_ws, tmp_path / "ws")
    _, path = delete_subject(ws, scored_subjects(ws)[0], mode="replay")
    saved = tmp_path / "saved.json"
    if content is not None:
        saved.write_text(content)
    assert main(["verify", str(path), "--checkpoint", str(saved)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(saved) in err and "Traceback" not in err


def test_after_a_rollback_delete_refuses_to_append_and_overwrites_no_certificate(plain_ws, tmp_path):  # noqa: F811
    ws = copy_ws(plain_ws, tmp_path / "ws")
    subjects = scored_subjects(ws)
    delete_subject(ws, subjects[0], mode="replay")
    backup = {f: (ws.root / f).read_text() for f in (LEDGER, CHECKPOINT)}      # a backup taken here
    delete_subject(ws, subjects[1], mode="replay")
    second = (ws.certificates / "000001.json").read_text()
    for f, text in backup.items():                                           # ... restored later
        (ws.root / f).write_text(text)
    assert any("rolled back" in p for p in read_log(ws.root).problems)
    with pytest.raises(DeletionFailed, match="rolled back"):
        delete_subject(ws, subjects[2], mode="replay")
    assert (ws.certificates / "000001.json").read_text() == second
    assert any(scan_subject(ws, subjects[2])[0].values())                     # nothing was deleted


def test_a_config_that_is_not_yaml_and_an_out_that_is_a_file_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cohort: [\n  min_age")
    afile = tmp_path / "afile"
    afile.write_text("x")
    for argv, named in ((["run", "--out", str(tmp_path / "ws"), "--config", str(bad)], "not valid YAML"),
                        (["extract", "--source", str(tmp_path), "--out", str(tmp_path / "s"), "--config", str(bad)],
                         "not valid YAML"),
                        (["run", "--out", str(afile)], "is a file, not a folder"),
                        (["extract", "--source", str(tmp_path), "--out", str(afile)], "is a file, not a folder")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and named in err and "Traceback" not in err


def test_keygen_prints_the_public_key_to_pin(tmp_path, capsys):
    assert main(["keygen", "--signing", str(tmp_path / "k.pem")]) == 0
    from cryptography.hazmat.primitives import serialization
    key = serialization.load_pem_private_key((tmp_path / "k.pem").read_bytes(), password=None)
    assert public_hex(key) in capsys.readouterr().out


@pytest.mark.parametrize("damage, what", [
    (lambda ws: (ws.root / CHECKPOINT).write_text((ws.root / CHECKPOINT).read_text()[:40]),
     "the log's signed checkpoint .*checkpoint.json is damaged: not JSON"),
    (lambda ws: (ws.root / CHECKPOINT).write_text(""), "the log's signed checkpoint .* is damaged: empty"),
    (lambda ws: (ws.certificates / "000000.json").write_text(""), "certificate .*000000.json is damaged: empty"),
    (lambda ws: (ws.certificates / "000000.json").write_text("[1, 2]"),
     "certificate .*000000.json is damaged: a JSON list, not an object"),
    (lambda ws: (ws.certificates / "proofs" / "000000.json").write_text("{\"checkpoint\": "),
     "the certificate's receipt .*proofs/000000.json is damaged: not JSON"),
])
def test_a_damaged_checkpoint_certificate_or_receipt_is_one_line_exit_2(plain_ws, tmp_path, capsys,  # noqa: F811
                                                                        damage, what):
    import re
    ws = copy_ws(plain_ws, tmp_path / "ws")
    delete_subject(ws, scored_subjects(ws)[0], mode="decrement", compare_with_replay=False)
    damage(ws)
    assert main(["verify", str(ws.certificates / "000000.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(f"^forgetful: error: {what}", err), err
