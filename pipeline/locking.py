"""An exclusive lock on a workspace, shared by scheduled runs and deletions (fcntl.flock on ROOT/.lock)."""
from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import Refusal

if TYPE_CHECKING:
    from collections.abc import Iterator


class WorkspaceLocked(Refusal, RuntimeError):
    """Another run or deletion holds the workspace lock."""


@contextmanager
def workspace_lock(root: Path, wait_seconds: float = 0.0, purpose: str = "") -> Iterator:
    """Hold the workspace's lock; wait up to ``wait_seconds`` for it, then refuse with WorkspaceLocked."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_seconds
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
                    raise WorkspaceLocked(f"workspace {root} is locked by another run ({holder or 'unknown'}); "
                                          f"waited {wait_seconds:g} s before refusing {purpose}".strip()) from None
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} {purpose}".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock
