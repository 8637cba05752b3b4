"""The deletion desk: ``forgetful serve`` takes a workspace's deletion requests in its own, already running process.

Why: a ``forgetful delete`` command pays a fixed cost before its first step: Prefect's temporary server (~4 s
to boot on 2 cores), the imports of Prefect, scikit-learn (the refit check) and the deletion's modules (~3 s),
the flow's start. On the demo cloned 4x that is more than the replay's own work, and a week's requests sent one
by one pay it each time. The serving process has the server up and every module loaded, so a request sent to
it costs its work: the same ``delete_patients`` flow, run there (:func:`flows.prefect_flows.serve_deletion`).

The request travels as files in ``WS/deletion_desk/`` (:attr:`pipeline.workspace.Workspace.desk`), so whoever
may write the workspace may ask:

- ``desk.lock``: an exclusive flock the serving process holds while it takes requests (an ended process holds
  none: no stale desk outlives its process); ``desk.json`` names its pid;
- ``requests/<id>.json``: a :class:`DeletionRequest` (keyed hashes, never a raw id), written whole (rename);
- ``taken/<id>.json``: the request once the desk claimed it (a rename, so it is taken once, and a command that
  withdraws it first runs it itself);
- ``replies/<id>.json``: the :class:`DeletionOutcome`, read and removed by the command.

A request the desk did not take before it stopped is withdrawn and run by the command itself; one it took when it
stopped is refused in one line (the deletion's transaction leaves all of it or nothing, settled at the
workspace's next use).
"""
from __future__ import annotations

import contextvars
import fcntl
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.transaction import atomic_write_text
from pipeline.workspace import Workspace

POLL_SECONDS = 0.05
KEEP_REPLIES_SECONDS = 24 * 3600      # a reply no command read (it was killed) is removed after a day


class DeskStopped(RuntimeError):
    """The serving process ended while it held the command's request."""


@dataclass(frozen=True)
class DeletionRequest:
    """What ``forgetful delete`` asks: subjects by keyed hash (:func:`pipeline.privacy.keyed_hash`)."""
    subject_hashes: tuple[str, ...]
    mode: str = "decrement"
    wait_seconds: float = 60.0
    compare_with_replay: bool = True
    skip_unknown: bool = False

    @classmethod
    def read(cls, path: Path) -> DeletionRequest:
        raw = json.loads(path.read_text())
        return cls(**{**raw, "subject_hashes": tuple(raw["subject_hashes"])})


@dataclass(frozen=True)
class DeletionOutcome:
    """How a deletion request ended: certificates (ascending subject id), the subjects skipped (hash prefix ->
    why), "nothing to do" (every subject deleted before), a refusal's one-line reason, or a failure's line and
    the exit status the command gives it."""
    certificates: tuple[str, ...] = ()
    skipped: dict[str, str] = field(default_factory=dict)
    already_deleted: str | None = None
    refusal: str | None = None
    failure: str | None = None
    failure_status: int = 1

    @classmethod
    def read(cls, path: Path) -> DeletionOutcome:
        raw = json.loads(path.read_text())
        return cls(**{**raw, "certificates": tuple(raw["certificates"])})


def _write_whole(path: Path, record) -> None:
    atomic_write_text(path, json.dumps(asdict(record)))      # its temporary name is no *.json: never taken half


def _folders(ws: Workspace) -> tuple[Path, Path, Path]:
    return ws.desk / "requests", ws.desk / "taken", ws.desk / "replies"


def desk_pid(ws: Workspace) -> int | None:
    """The pid of the process whose desk takes this workspace's requests now, or None."""
    lock = ws.desk / "desk.lock"
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            return int(json.loads((ws.desk / "desk.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return 0        # held, the pid not written yet
    finally:
        os.close(fd)
    return None


def submit(ws: Workspace, request: DeletionRequest, poll: float = POLL_SECONDS) -> DeletionOutcome | None:
    """Hand ``request`` to the workspace's desk and wait for its outcome; None when no desk takes it (none is
    open, or the one open ended before it took the request: the caller runs it). DeskStopped when the desk
    ended while it held the request."""
    if desk_pid(ws) is None:
        return None
    requests, taken, replies = _folders(ws)
    name = f"{uuid.uuid4().hex}.json"
    _write_whole(requests / name, request)
    try:
        while True:
            try:
                outcome = DeletionOutcome.read(replies / name)
            except FileNotFoundError:
                pass
            else:
                (replies / name).unlink()
                return outcome
            if desk_pid(ws) is None and not (replies / name).exists():
                try:
                    (requests / name).unlink()
                    return None             # withdrawn before the desk took it
                except FileNotFoundError:
                    raise DeskStopped(f"the process serving {ws.root} ended while it held this deletion request; "
                                      f"nothing or all of it is applied (settled when the workspace is next used): "
                                      f"run the command again") from None
            time.sleep(poll)
    except BaseException:
        # an interrupted command withdraws a request not taken yet (a taken one goes on in the desk)
        (requests / name).unlink(missing_ok=True)
        raise


class DeletionDesk:
    """Takes the requests of one workspace, one at a time, on a thread of the serving process, each answered by
    ``handle`` (run in the context the desk was opened in: the command's Prefect settings)."""

    def __init__(self, ws: Workspace, handle: Callable[[DeletionRequest], DeletionOutcome],
                 warm: Callable[[], object] | None = None, poll: float = POLL_SECONDS):
        self.ws, self.handle, self.warm, self.poll = ws, handle, warm, poll
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self._lock_fd: int | None = None
        self._releasing = threading.Lock()

    def open(self) -> bool:
        """Take the desk (False when another process holds it: that one answers) and start answering."""
        requests, taken, replies = _folders(self.ws)
        for d in (requests, taken, replies):
            d.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.ws.desk / "desk.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        _write_whole(self.ws.desk / "desk.json", _DeskInfo(os.getpid()))
        self._clear_leftovers(taken, replies)
        context = contextvars.copy_context()
        self.thread = threading.Thread(target=context.run, args=(self._answer,), name="forgetful-deletion-desk",
                                       daemon=True)
        self.thread.start()
        return True

    @staticmethod
    def _clear_leftovers(taken: Path, replies: Path) -> None:
        # a request taken by a desk that ended: its command was told so (DeskStopped)
        for f in taken.glob("*.json"):
            f.unlink(missing_ok=True)
        for f in replies.glob("*.json"):
            try:
                if time.time() - f.stat().st_mtime > KEEP_REPLIES_SECONDS:
                    f.unlink()
            except FileNotFoundError:
                pass

    def _answer(self) -> None:
        try:
            if self.warm is not None:
                self.warm()         # what a request's first steps would load (the compiled solver), loaded now
            requests, taken, replies = _folders(self.ws)
            while not self.stopping.is_set():
                for path in sorted(requests.glob("*.json"), key=_mtime):
                    claimed = taken / path.name
                    try:
                        os.rename(path, claimed)
                    except FileNotFoundError:
                        continue            # withdrawn by its command
                    _write_whole(replies / path.name, self._outcome(claimed))
                    claimed.unlink(missing_ok=True)
                    if self.stopping.is_set():
                        return
                self.stopping.wait(self.poll)
        except Exception:
            # a desk that cannot answer must not look open: commands would wait on it for ever
            logging.getLogger("forgetful").exception("the deletion desk of %s stopped", self.ws.root)
        finally:
            self._release()

    def _outcome(self, claimed: Path) -> DeletionOutcome:
        try:
            return self.handle(DeletionRequest.read(claimed))
        except Exception as e:  # noqa: BLE001 -- a handler answers its failures; one it raised is a defect
            logging.getLogger("forgetful").exception("deletion request %s failed", claimed.stem)
            return DeletionOutcome(failure=f"{type(e).__name__}: {e}")

    def close(self) -> None:
        """Stop taking requests; a deletion under way completes first."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join()
        self._release()

    def _release(self) -> None:
        with self._releasing:
            if self._lock_fd is not None:
                (self.ws.desk / "desk.json").unlink(missing_ok=True)
                os.close(self._lock_fd)
                self._lock_fd = None


@dataclass(frozen=True)
class _DeskInfo:
    pid: int


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:       # taken meanwhile
        return 0.0


@contextmanager
def open_desk(ws: Workspace, handle: Callable[[DeletionRequest], DeletionOutcome],
              warm: Callable[[], object] | None = None) -> Iterator[DeletionDesk | None]:
    """The workspace's desk for the duration of the block (None when another process already serves it)."""
    desk = DeletionDesk(ws, handle, warm)
    if not desk.open():
        yield None
        return
    try:
        yield desk
    finally:
        desk.close()
