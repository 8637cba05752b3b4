"""The shard splice records: followed from a known file state to the file as it is, or telling nothing."""
import os

from pipeline.meds import shard_path
from pipeline.shard_changes import KEPT, changed_since, changes_path, file_state, named_subjects, record_splice


def _rewrite(store, shard, content: bytes, subjects):
    path = shard_path(store, shard)
    before = file_state(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    os.utime(path, ns=(0, (before[1] if before else 0) + 1_000_000))    # a later mtime, whatever the clock
    if subjects is not None:
        record_splice(store, shard, before, subjects)
    return file_state(path)


def test_splices_are_followed_from_a_known_state_and_a_gap_tells_nothing(tmp_path):
    store = tmp_path / "store"
    first = _rewrite(store, 3, b"a", None)                     # the file a run indexed; no splice yet
    assert changed_since(store, 3, first) == set()
    second = _rewrite(store, 3, b"ab", [7, 5])
    _rewrite(store, 3, b"abc", [9])
    assert changed_since(store, 3, first) == {5, 7, 9}         # two splices since: both subjects' sets
    assert changed_since(store, 3, second) == {9}
    assert changed_since(store, 3, None) is None               # indexed before records were kept
    assert changed_since(store, 4, first) is None              # no such shard
    _rewrite(store, 3, b"abcd", None)                          # a writer that records nothing (a deletion)
    assert changed_since(store, 3, first) is None and changed_since(store, 3, second) is None
    assert named_subjects(changes_path(store, 3)) == {5, 7, 9}
    changes_path(store, 3).write_text("{not json")             # a damaged record tells nothing, breaks nothing
    assert changed_since(store, 3, first) is None


def test_only_the_last_splices_are_kept(tmp_path):
    store = tmp_path / "store"
    states = [_rewrite(store, 0, b"x", None)]
    for i in range(KEPT + 2):
        states.append(_rewrite(store, 0, b"x" * (i + 2), [i]))
    assert changed_since(store, 0, states[0]) is None          # older than the records kept
    assert changed_since(store, 0, states[2]) == set(range(2, KEPT + 2))
