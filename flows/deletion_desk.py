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

The folders are a door anyone who may write the workspace can knock on, so the desk trusts nothing in them: it
never follows a link nor opens anything but a regular file (a FIFO would block it), never writes through a name
it did not create (:func:`pipeline.transaction.atomic_write_text`), refuses a request that names a raw id instead
of keyed hashes before anything stores it, and takes no request whose command has ended (killed while waiting:
its request is withdrawn, or left for no one). Whatever it cannot take is moved to ``rejected/`` with one line
in the serving process's output, and the desk goes on.
"""
from __future__ import annotations

import contextvars
import fcntl
import json
import os
import re
import signal
import stat
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flows.server_watch import alive
from pipeline.errors import InputError, Refusal
from pipeline.transaction import atomic_write_text
from pipeline.workspace import Workspace

POLL_SECONDS = 0.05
KEEP_REPLIES_SECONDS = 24 * 3600      # a reply no command read (it was killed) is removed after a day
MAX_REQUEST_BYTES = 64 * 2**20        # a million subjects' hashes; a larger file is no request of ours
MODES = ("decrement", "replay")       # deletion.MODES (this module is imported by a command before the deletion's)
KEYED_HASH = re.compile(r"[0-9a-f]{64}")


class DeskStopped(Refusal, RuntimeError):
    """The serving process ended while it held the command's request."""


class MalformedRequest(InputError):
    """A request file the desk cannot take: not a regular file, not a request, or naming raw ids (``names_ids``:
    then the file is removed, not kept aside)."""

    def __init__(self, message: str, names_ids: bool = False):
        super().__init__(message)
        self.names_ids = names_ids


@dataclass(frozen=True)
class DeletionRequest:
    """What ``forgetful delete`` asks: subjects by keyed hash (:func:`pipeline.privacy.keyed_hash`), never by id;
    ``requester_pid``: the command waiting for the answer (the desk takes no request whose command has ended)."""
    subject_hashes: tuple[str, ...]
    mode: str = "decrement"
    wait_seconds: float = 60.0
    compare_with_replay: bool = True
    skip_unknown: bool = False
    requester_pid: int = field(default=0, compare=False)

    @classmethod
    def parse(cls, text: bytes) -> DeletionRequest:
        """A request from a file's bytes, checked field by field; MalformedRequest names what is wrong (never a
        value: a raw id in a message would reach the reply file and the serving process's log)."""
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError):
            raise MalformedRequest("not a JSON deletion request") from None
        if not isinstance(raw, dict) or set(raw) - {f for f in cls.__dataclass_fields__}:
            raise MalformedRequest("not a deletion request (unknown or missing fields)")
        hashes = raw.get("subject_hashes")
        if not isinstance(hashes, list) or not hashes:
            raise MalformedRequest("subject_hashes must be a non-empty list of keyed hashes")
        bad = sum(1 for h in hashes if not (isinstance(h, str) and KEYED_HASH.fullmatch(h)))
        if bad:
            raise MalformedRequest(f"{bad} of {len(hashes)} subject(s) are not keyed hashes (64 hex digits): a "
                                   f"request names subjects by keyed hash only, never by id; refused before "
                                   f"anything stored it", names_ids=True)
        checks = {"mode": lambda v: v in MODES, "wait_seconds": lambda v: _number(v) and v >= 0,
                  "compare_with_replay": lambda v: isinstance(v, bool), "skip_unknown": lambda v: isinstance(v, bool),
                  "requester_pid": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0}
        wrong = [k for k, ok in checks.items() if k in raw and not ok(raw[k])]
        if wrong:
            raise MalformedRequest(f"field(s) {wrong} out of range (mode is one of {list(MODES)})")
        return cls(**{**raw, "subject_hashes": tuple(hashes)})


def _number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


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
        raw = json.loads(read_regular(path))
        return cls(**{**raw, "certificates": tuple(raw["certificates"])})


def read_regular(path: Path, limit: int = MAX_REQUEST_BYTES) -> bytes:
    """A regular file's bytes, opened without following a link and without blocking (a FIFO would wait for a
    writer for ever); MalformedRequest for anything else, FileNotFoundError when it is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise MalformedRequest(f"not a regular file ({e.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        mode = os.fstat(fh.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise MalformedRequest(f"not a regular file (a {_kind(mode)})")
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise MalformedRequest(f"larger than {limit // 2**20} MiB")
    return data


def _kind(mode: int) -> str:
    return next((k for test, k in ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISLNK, "link"),
                                   (stat.S_ISSOCK, "socket")) if test(mode)), "special file")


def _entry_problem(path: Path) -> str | None:
    """Why the entry at ``path`` is no request file (its own kind, never a link's target), or None."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    return None if stat.S_ISREG(mode) else f"not a regular file (a {_kind(mode)})"


def _write_whole(path: Path, record) -> None:
    atomic_write_text(path, json.dumps(asdict(record)))      # its temporary name is no *.json: never taken half


def _folders(ws: Workspace) -> tuple[Path, Path, Path]:
    return ws.desk / "requests", ws.desk / "taken", ws.desk / "replies"


def desk_pid(ws: Workspace) -> int | None:
    """The pid of the process whose desk takes this workspace's requests now, or None."""
    lock = ws.desk / "desk.lock"
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:
        return None         # a link or a FIFO planted there: no desk of ours
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            return int(json.loads(read_regular(ws.desk / "desk.json"))["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0        # held, the pid not written yet
    finally:
        os.close(fd)
    return None


@contextmanager
def _withdrawn_on_termination() -> Iterator[None]:
    """SIGTERM and SIGHUP raise in the waiting command (their default ends it at once, leaving its request
    waiting for a desk that would then delete with no one to answer): its request is withdrawn first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def end(signum, frame):
        raise SystemExit(128 + signum)
    old = {s: signal.signal(s, end) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def submit(ws: Workspace, request: DeletionRequest, poll: float = POLL_SECONDS) -> DeletionOutcome | None:
    """Hand ``request`` to the workspace's desk and wait for its outcome; None when no desk takes it (none is
    open, or the one open ended before it took the request: the caller runs it). DeskStopped when the desk
    ended while it held the request."""
    if desk_pid(ws) is None:
        return None
    requests, taken, replies = _folders(ws)
    name = f"{uuid.uuid4().hex}.json"
    with _withdrawn_on_termination():
        _write_whole(requests / name, DeletionRequest(**{**asdict(request), "requester_pid": os.getpid()}))
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
                        raise DeskStopped(f"the process serving {ws.root} ended while it held this deletion "
                                          f"request; nothing or all of it is applied (settled when the workspace "
                                          f"is next used): run the command again") from None
                time.sleep(poll)
        except BaseException:
            # an interrupted command withdraws a request not taken yet (a taken one goes on in the desk)
            (requests / name).unlink(missing_ok=True)
            raise


def say(line: str) -> None:
    """One line of the desk in the serving process's output."""
    print(f"forgetful: {line}", file=sys.stderr, flush=True)


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
            if _entry_problem(d) is not None:
                self._set_aside(d, _entry_problem(d))
            d.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.ws.desk / "desk.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise MalformedRequest(f"{self.ws.desk / 'desk.lock'} is not the desk's lock file ({e.strerror}): "
                                   f"remove it") from None
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

    def _clear_leftovers(self, taken: Path, replies: Path) -> None:
        # a request taken by a desk that ended: its command was told so (DeskStopped)
        for f in taken.glob("*.json"):
            self._remove(f)
        for f in replies.glob("*.json"):
            try:
                if time.time() - f.lstat().st_mtime > KEEP_REPLIES_SECONDS:
                    self._remove(f)
            except FileNotFoundError:
                pass

    def _remove(self, f: Path) -> None:
        problem = _entry_problem(f)
        if problem is None:
            f.unlink(missing_ok=True)
        else:
            self._set_aside(f, problem)

    def _set_aside(self, path: Path, why: str) -> None:
        """Move an entry the desk cannot take to ``rejected/`` (a rename: a link moves, never its target), with one
        line in the serving process's output."""
        rejected = self.ws.desk / "rejected"
        rejected.mkdir(parents=True, exist_ok=True)
        dest = rejected / f"{path.name}.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, dest)
        except FileNotFoundError:
            return
        say(f"the deletion desk set aside {path.relative_to(self.ws.desk)}: {why}; it is in "
            f"{dest.relative_to(self.ws.root)}")

    def _answer(self) -> None:
        try:
            if self.warm is not None:
                self.warm()         # what a request's first steps would load (the compiled solver), loaded now
            requests = _folders(self.ws)[0]
            while not self.stopping.is_set():
                for path in sorted(requests.glob("*.json"), key=_mtime):
                    self._take(path)
                    if self.stopping.is_set():
                        return
                self.stopping.wait(self.poll)
        except Exception:
            # a desk that cannot answer must not look open: commands would wait on it for ever
            say(f"the deletion desk of {self.ws.root} stopped:\n{traceback.format_exc().rstrip()}")
        finally:
            self._release()

    def _take(self, path: Path) -> None:
        """One entry of ``requests/``: claimed, answered and cleared, or set aside; whatever it holds, the desk
        goes on."""
        _, taken, replies = _folders(self.ws)
        claimed = taken / path.name
        try:
            problem = _entry_problem(path)
            if problem is not None:
                self._set_aside(path, problem)
                return
            try:
                os.rename(path, claimed)
            except FileNotFoundError:
                return              # withdrawn by its command
            outcome = self._outcome(claimed)
            if outcome is not None:
                self._reply(replies / path.name, outcome)
            self._remove(claimed)
        except Exception:   # noqa: BLE001 -- one entry never stops the desk
            say(f"the deletion desk could not take {path.name}:\n{traceback.format_exc().rstrip()}")
            for p in (path, claimed):
                if os.path.lexists(p):
                    self._set_aside(p, "it could not be taken (see the traceback above)")

    def _outcome(self, claimed: Path) -> DeletionOutcome | None:
        """The answer to a claimed request; None when no command waits for it (set aside)."""
        try:
            request = DeletionRequest.parse(read_regular(claimed))
        except MalformedRequest as e:
            if e.names_ids:         # kept nowhere: the file is removed, its subjects named in no line
                claimed.unlink(missing_ok=True)
                say(f"the deletion desk removed request {claimed.name}: {e}")
            else:
                self._set_aside(claimed, str(e))
            return DeletionOutcome(failure=f"the deletion request is malformed: {e}", failure_status=2)
        if request.requester_pid and not alive(request.requester_pid):
            self._set_aside(claimed, f"its command (pid {request.requester_pid}) ended before it was taken")
            return None
        try:
            return self.handle(request)
        except Exception as e:  # noqa: BLE001 -- a handler answers its failures; one it raised is a defect
            say(f"deletion request {claimed.stem} failed:\n{traceback.format_exc().rstrip()}")
            return DeletionOutcome(failure=f"{type(e).__name__}: {e}")

    def _reply(self, path: Path, outcome: DeletionOutcome) -> None:
        problem = _entry_problem(path)
        if problem is not None:         # something planted at the reply's name: moved, never written through
            self._set_aside(path, problem)
        _write_whole(path, outcome)

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
        return path.lstat().st_mtime
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
