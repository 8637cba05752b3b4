"""The hash key lives outside the workspace and is checked against the store; suppression holds on every path
that writes the store (defects 2 and 4 of the deletion issue)."""
import json

import polars as pl
import pytest

from pipeline.extract import ExtractionError, extract
from pipeline.generate import GeneratorConfig, generate
from pipeline.privacy import (FINGERPRINT_FILE, SUPPRESSED_FILE, HashKeyError, check_key, keyed_hash, load_key,
                              write_new_key)

KEY = b"k" * 64


@pytest.fixture
def no_key_env(monkeypatch):
    monkeypatch.delenv("FORGETFUL_HASH_KEY", raising=False)
    monkeypatch.delenv("FORGETFUL_HASH_KEY_FILE", raising=False)
    return monkeypatch


def test_without_a_key_nothing_starts_and_the_message_says_how_to_make_one(no_key_env, tmp_path):
    with pytest.raises(HashKeyError, match="forgetful keygen"):
        load_key(tmp_path / "ws")
    legacy = tmp_path / "ws" / ".secrets" / "hash.key"
    legacy.parent.mkdir(parents=True)
    legacy.write_text("0" * 64)
    with pytest.raises(HashKeyError, match="move the file outside the workspace"):
        load_key(tmp_path / "ws")


def test_a_key_file_inside_the_workspace_or_too_short_is_refused(no_key_env, tmp_path):
    inside = write_new_key(tmp_path / "ws" / "key")
    no_key_env.setenv("FORGETFUL_HASH_KEY_FILE", str(inside))
    with pytest.raises(HashKeyError, match="inside the workspace"):
        load_key(tmp_path / "ws")
    short = tmp_path / "short.key"
    short.write_text("abc")
    no_key_env.setenv("FORGETFUL_HASH_KEY_FILE", str(short))
    with pytest.raises(HashKeyError, match="at least 32"):
        load_key(tmp_path / "ws")
    outside = write_new_key(tmp_path / "keys" / "hash.key")
    no_key_env.setenv("FORGETFUL_HASH_KEY_FILE", str(outside))
    assert load_key(tmp_path / "ws") == outside.read_text().strip().encode()
    assert oct(outside.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(HashKeyError, match="never overwritten"):
        write_new_key(outside)


def test_a_changed_key_is_detected_not_silently_accepted(tmp_path):
    check_key(tmp_path, KEY)                       # first use records the fingerprint
    assert KEY.decode() not in (tmp_path / FINGERPRINT_FILE).read_text()
    check_key(tmp_path, KEY)
    with pytest.raises(HashKeyError, match="not the one the store"):
        check_key(tmp_path, b"x" * 64)


def test_a_deleted_subject_stays_out_of_events_and_stays_on_a_rerun_of_the_unchanged_source(tmp_path):
    src = generate(tmp_path / "src", GeneratorConfig(n_patients=8, seed=2))
    out = tmp_path / "store"
    extract(src, out, key=KEY)
    sid = int(pl.read_parquet(out / "stays.parquet")["subject_id"][0])
    # what a deletion leaves: the subject's rows gone, their keyed hash on the suppression list
    (out / SUPPRESSED_FILE).write_text(json.dumps([keyed_hash(sid, KEY)]))
    for f in (out / "data").glob("*.parquet"):
        pl.read_parquet(f).filter(pl.col("subject_id") != sid).write_parquet(f)
    again = extract(src, out, key=KEY)              # every source file unchanged: all skipped
    assert again.new_events == 0
    assert sid not in pl.read_parquet(out / "stays.parquet")["subject_id"].to_list()
    with pytest.raises(ExtractionError, match="suppression list"):
        extract(src, out)                           # a hand-run extract without the key is refused
    with pytest.raises(HashKeyError):
        extract(src, out, key=b"y" * 64)


def test_no_scratch_database_outlives_an_extraction(tmp_path):
    src = generate(tmp_path / "src", GeneratorConfig(n_patients=4, seed=1))
    (tmp_path / "store" / ".work").mkdir(parents=True)
    (tmp_path / "store" / ".work" / "extract.duckdb").write_bytes(b"old scratch")
    extract(src, tmp_path / "store", key=KEY)
    assert [p.name for p in (tmp_path / "store" / ".work").rglob("*") if p.is_file()] == []
