"""All-or-nothing file changes: stage every new file, write a journal, then apply it (roll-forward recovery).

A change is prepared in ``ROOT/.txn/<name>/`` (new versions of files, the list of files to delete). Writing
``journal.json`` is the commit point, done atomically with ``os.replace``. Applying a journal is idempotent:
each step checks what is already done. ``recover(root)`` therefore rolls a committed transaction forward and
discards an uncommitted one, so a crash at any point leaves the full old state or, after recovery, the full
new state.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from .locking import workspace_lock

TXN_DIR = ".txn"


def crash_point(step: str) -> None:
    """Test hook: FORGETFUL_CRASH_AT=<step> kills the process here, as a power cut would."""
    if os.environ.get("FORGETFUL_CRASH_AT") == step:
        os._exit(137)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename (readers see the old or the new file; the
    temporary name ends in ``.tmp``, so a glob of the final names never sees it). The temporary file is new and
    never a link: a symlink planted at its name (which is unique) cannot send the text outside the folder, and
    the rename replaces a link at ``path`` itself, never its target."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

class Transaction:
    def __init__(self, root: Path, name: str | None = None):
        self.root = Path(root)
        self.name = name or uuid.uuid4().hex
        self.dir = self.root / TXN_DIR / self.name
        self.dir.mkdir(parents=True, exist_ok=False)
        self.ops = []

    def stage(self, final_path: Path) -> Path:
        """A path to write the new version of ``final_path`` to; it replaces the final path on commit."""
        final = Path(final_path)
        staged = self.dir / f"{len(self.ops):05d}-{final.name}"
        self.ops.append({"op": "replace", "staged": str(staged.relative_to(self.root)),
                         "final": str(final.resolve().relative_to(self.root.resolve()))})
        return staged

    def delete(self, final_path: Path) -> None:
        final = Path(final_path)
        self.ops.append({"op": "delete", "final": str(final.resolve().relative_to(self.root.resolve()))})

    def commit(self) -> None:
        atomic_write_text(self.dir / "journal.json", json.dumps({"ops": self.ops}))
        crash_point("journal_written")
        apply_journal(self.root, self.dir)

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def apply_journal(root: Path, txn_dir: Path) -> None:
    root, txn_dir = Path(root), Path(txn_dir)
    ops = json.loads((txn_dir / "journal.json").read_text())["ops"]
    for i, op in enumerate(ops):
        final = root / op["final"]
        if op["op"] == "replace":
            staged = root / op["staged"]
            if staged.exists():
                final.parent.mkdir(parents=True, exist_ok=True)
                if staged.is_dir() and final.is_dir():
                    shutil.rmtree(final)  # a crash right here is redone: the staged directory still exists
                os.replace(staged, final)
        elif final.is_dir():
            shutil.rmtree(final)
        elif final.exists():
            final.unlink()
        if i == len(ops) // 2:
            crash_point("journal_half_applied")
    shutil.rmtree(txn_dir)


def recover(root: Path) -> tuple:
    """Finish committed transactions and discard uncommitted ones; returns (rolled_forward, rolled_back)."""
    base = Path(root) / TXN_DIR
    forward, back = [], []
    if not base.exists():
        return forward, back
    for d in sorted(p for p in base.iterdir() if p.is_dir()):
        if (d / "journal.json").exists():
            apply_journal(root, d)
            forward.append(d.name)
        else:
            shutil.rmtree(d)
            back.append(d.name)
    return forward, back


def pending(root: Path) -> bool:
    """Is a change of the workspace staged or half-applied (a crash left it)?"""
    base = Path(root) / TXN_DIR
    return base.exists() and any(p.is_dir() for p in base.iterdir())


def settle(root: Path, wait_seconds: float = 60.0) -> None:
    """Every entry point that reads a workspace calls this first: a change a crash interrupted is finished or
    undone, under the workspace lock, before anything is read (a running change holds the lock: we wait)."""
    if pending(root):
        with workspace_lock(root, wait_seconds=wait_seconds, purpose="recovery of an interrupted change"):
            recover(root)
