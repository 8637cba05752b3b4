"""Which subjects each splice of a shard changed, so that a run after a night's rows digests those subjects' stays
only (a night's ~1 % of rows touches nearly every shard, and digesting every stay of each touched shard read
every shard's hashes again).

``store/shard_changes/<K>.json`` holds the last :data:`KEPT` splices of shard ``K``, each the file's
``(size, mtime_ns)`` before and after it and the subjects whose rows it replaced. A reader that knows the file
as it was at some ``(size, mtime_ns)`` follows the splices from there to the file as it is now; where the chain
breaks (a writer that records nothing, such as a deletion, or older splices than are kept) it learns nothing
and digests the shard whole, as before. The records name subjects by id, so they are part of the event store:
a deletion removes the records of the shards it rewrites.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from .meds import shard_path

CHANGES = "shard_changes"
KEPT = 16


def file_state(path: Path) -> list[int] | None:
    """A file's ``[size, mtime_ns]`` (what a splice's record names it by), None when it does not exist."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns]


def changes_path(store: Path, shard: int) -> Path:
    return Path(store) / CHANGES / f"{int(shard)}.json"


def change_files(store: Path) -> list[Path]:
    d = Path(store) / CHANGES
    return sorted(d.glob("*.json")) if d.exists() else []


def _records(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())["splices"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return []       # unreadable: nothing is learnt from it, the shard is digested whole


def record_splice(store: Path, shard: int, before: list[int], subjects: list[int]) -> None:
    """After shard ``shard``'s file, ``before`` as it was, was rewritten with the rows of ``subjects`` replaced
    (and those only)."""
    path = changes_path(store, shard)
    after = file_state(shard_path(store, shard))
    splices = (_records(path) + [{"from": before, "to": after, "subjects": sorted(int(s) for s in subjects)}])[-KEPT:]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"splices": splices}))
    os.replace(tmp, path)


def changed_since(store: Path, shard: int, state: list[int] | None) -> set[int] | None:
    """The subjects whose rows in shard ``shard`` changed since its file was at ``state``: none when it still
    is, None when the records cannot tell (then any subject may have changed)."""
    now = file_state(shard_path(store, shard))
    if state is None or now is None:
        return None
    at, changed = list(state), set()
    for splice in _records(changes_path(store, shard)):
        if at == now:
            break
        if splice.get("from") == at:
            changed.update(int(s) for s in splice["subjects"])
            at = splice["to"]
    return changed if at == now else None


def named_subjects(path: Path) -> set[int]:
    """Every subject a shard's change record names (what a deletion's residual scan looks for)."""
    return {int(s) for splice in _records(path) for s in splice.get("subjects", [])}
