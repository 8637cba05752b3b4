"""One Prefect API for every process of a command, started early and waited for late.

With no ``PREFECT_API_URL`` configured, Prefect starts a temporary server per interpreter on a flow's first call
and waits 20 s for it: on a busy workstation that start failed with a traceback, and each process-pool worker (a
fresh interpreter) started a server of its own. A command here starts one server as soon as its input is
checked, imports the flows while the server boots (the two took ~4 s each, one after the other), and waits for
it when the first flow needs it, for ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` (Prefect's own
setting; 120 s unless the user sets it). Its URL is exported to the workers. A configured URL (a running
``prefect server start``, or Prefect Cloud) is used as it is and starts nothing.

The server is launched with Prefect's own command for its temporary server (uvicorn on
``prefect.server.api.server:create_app`` with the ephemeral flags) rather than through
``SubprocessASGIServer.start``, because that call blocks until the server answers and its module alone takes
~3 s to import, which the command's process never otherwise needs.

A command launches the server from the environment alone (:func:`launch_early`), before Prefect is imported here
(~3 s), and a deletion before it checks its subjects (it reads the workspace's memories: seconds), so the server
boots meanwhile; :func:`begin` then holds it to Prefect's settings (a configured API or another home ends it and
goes on as before). A command that refuses after it leaves with the server stopped, as at any exit.
"""
from __future__ import annotations

import atexit
import fcntl
import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pipeline.errors import EnvironmentProblem

STARTUP_TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
DEFAULT_STARTUP_SECONDS = 120
PORT_IN_USE_EXIT = 3        # uvicorn's exit status when its port was taken between our check and its bind


class ServerStartError(EnvironmentProblem):
    """The temporary API server did not answer in time, or exited: one line naming the setting to change."""


def default_startup_wait() -> None:
    """Give the temporary server a start a busy machine can meet, unless the user chose one (before Prefect's
    settings are first read)."""
    os.environ.setdefault(STARTUP_TIMEOUT_SETTING, str(DEFAULT_STARTUP_SECONDS))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PendingServer:
    """A temporary server on its way up (``process``, under PREFECT_HOME ``home``), or a configured API
    (``configured_url``)."""
    configured_url: str | None = None
    process: subprocess.Popen | None = None
    port: int = 0
    started: float = field(default_factory=time.monotonic)
    start_lock: IO | None = None
    home: Path | None = None
    settings_env: dict | None = None
    # Prefect's services (its scheduler among them) on: a server that lives as long as ``serve``, whose
    # deployment's cron must fire. An ephemeral server runs none of them, so a schedule never made a flow run.
    scheduler: bool = False

    @property
    def api_url(self) -> str:
        return self.configured_url or f"http://127.0.0.1:{self.port}/api"


def _launch(pending: PendingServer) -> None:
    """Start the server process on a free port, and its watcher: the server must end with this command even
    when no exit path of ours runs (a kill). Prefect's settings as this process resolved them are passed on
    (``settings_env``; None: the server resolves them itself, from the same environment and files)."""
    pending.port = _free_port()
    env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1",
           **(pending.settings_env or {})}
    if pending.scheduler:
        env.pop("PREFECT__SERVER_EPHEMERAL")
    # Prefect's package folder, found without importing Prefect (its import is what the early launch saves)
    app_dir = Path(importlib.util.find_spec("prefect").origin).parent.parent
    pending.process = subprocess.Popen([sys.executable, "-m", "uvicorn", "--app-dir", str(app_dir), "--factory",
                                        "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port",
                                        str(pending.port), "--log-level", "error", "--lifespan", "on"],
                                       env=env, stdin=subprocess.DEVNULL)
    subprocess.Popen([sys.executable, "-m", "flows.server_watch", str(os.getpid()), str(pending.process.pid)],
                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)


def _start(home: Path, settings_env: dict | None = None, scheduler: bool = False) -> PendingServer:
    # Servers started together on a fresh PREFECT_HOME race on creating its database ("index ... already
    # exists"): one at a time from launch until the server answers, i.e. until its migrations are done.
    home.mkdir(parents=True, exist_ok=True)
    lock = open(home / ".forgetful-server-start.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    pending = PendingServer(start_lock=lock, home=home, settings_env=settings_env, scheduler=scheduler)
    _launch(pending)
    # Stopped at exit, as Prefect stops its own: registered before Prefect's log and event services start, so
    # their exit hooks (which drain into the server) run first.
    atexit.register(stop, pending)
    return pending


def launch_early(scheduler: bool = False) -> PendingServer | None:
    """Start the temporary server from the environment alone, before Prefect is imported here; None when the
    environment names an API (PREFECT_API_URL) or the home's database is not made yet (a server stopped by a
    refusal while it creates one would leave it half made: the first command's server starts after its checks).
    :func:`begin` adopts it or ends it."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    # Prefect's own default home (its setting ``home``); :func:`begin` compares it with the resolved one
    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser().resolve()
    if not (home / "prefect.db").exists():
        return None
    return _start(home, scheduler=scheduler)


def begin(early: PendingServer | None = None, scheduler: bool = False) -> PendingServer:
    """The temporary server on its way up, without waiting for it: ``early``'s when Prefect's settings agree
    with the environment it was launched from, else one started now; nothing when an API URL is configured.
    ``scheduler``: with Prefect's services, its scheduler among them (``serve``: the schedule must fire)."""
    from prefect.settings import PREFECT_API_URL, get_current_settings
    settings = get_current_settings()
    home = Path(settings.home).expanduser().resolve()
    if early is not None and (PREFECT_API_URL.value() or early.home != home or early.scheduler != scheduler):
        stop(early)     # a profile or settings file names an API or another home than the environment did
        early = None
    if PREFECT_API_URL.value():
        return PendingServer(configured_url=PREFECT_API_URL.value())
    return early or _start(home, settings.to_environment_variables(exclude_unset=True), scheduler=scheduler)


def wait_until_up(pending: PendingServer) -> str:
    """Wait for the server's health check; its API URL. ServerStartError past the startup setting, or when a
    configured API does not answer (a closed port failed later, deep in Prefect's client, as a bare
    RuntimeError)."""
    import httpx
    if pending.configured_url:
        return _answering(pending.configured_url)
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
    limit = float(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    try:
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() - pending.started < limit:
                code = pending.process.poll()
                if code == PORT_IN_USE_EXIT:
                    _launch(pending)
                elif code is not None:
                    raise ServerStartError(f"Prefect's temporary API server exited with status {code} while "
                                           f"starting (PREFECT_HOME={_home()}); its messages are above")
                try:
                    if client.get(f"{pending.api_url}/health").status_code == 200:
                        from prefect.logging import get_logger
                        get_logger("forgetful").info("The command's temporary API server answers at %s (%.1f s "
                                                     "after its start)", pending.api_url,
                                                     time.monotonic() - pending.started)
                        return pending.api_url
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
    finally:
        _release_start_lock(pending)
    stop(pending)
    raise ServerStartError(f"Prefect's temporary API server did not answer within {limit:g} s (the machine may be "
                           f"busy): set {STARTUP_TIMEOUT_SETTING} to wait longer, or PREFECT_API_URL to a running "
                           f"server (`prefect server start`)")


CONFIGURED_API_WAIT_SECONDS = 10.0


def _answering(url: str) -> str:
    """``url`` once the configured API answers at all (any HTTP status: Prefect Cloud may ask for a key there);
    ServerStartError after :data:`CONFIGURED_API_WAIT_SECONDS` of refused or failed connections."""
    import httpx
    deadline, why = time.monotonic() + CONFIGURED_API_WAIT_SECONDS, ""
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            try:
                client.get(f"{url.rstrip('/')}/health")
                return url
            except httpx.TransportError as e:
                why = str(e) or type(e).__name__
            time.sleep(0.5)
    raise ServerStartError(f"the Prefect API configured in PREFECT_API_URL ({url}) does not answer ({why}): start "
                           f"that server (`prefect server start`), or unset PREFECT_API_URL and the command starts a "
                           f"temporary one of its own")


def _home() -> str:
    from prefect.settings import get_current_settings
    return str(get_current_settings().home)


def _release_start_lock(pending: PendingServer) -> None:
    if pending.start_lock is not None:
        pending.start_lock.close()
        pending.start_lock = None


def stop(pending: PendingServer) -> None:
    """End a temporary server this command started (a configured one is left alone), and let the next start
    on its home go on."""
    _release_start_lock(pending)
    if pending.process is not None and pending.process.poll() is None:
        pending.process.terminate()
        try:
            pending.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pending.process.kill()
            pending.process.wait()


@contextmanager
def shared_api_server(pending: PendingServer | None = None) -> Iterator[str]:
    """The command's API for every process of it: ``pending``'s server (started now when not given) once it
    answers; its URL in the settings and, for the workers, the environment."""
    from prefect.settings import PREFECT_API_URL, PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    pending = pending or begin()
    url = wait_until_up(pending)
    if pending.configured_url:
        yield url
        return
    from prefect.context import refresh_global_settings_context
    os.environ["PREFECT_API_URL"] = url
    # Prefect's process-wide settings were read when it was imported, before the URL existed, and a thread of
    # Prefect's own that starts without the settings context (its events worker, after the process pool's
    # work) reads those: it started a second temporary server. Re-read from the environment, which has the URL.
    refresh_global_settings_context()
    try:
        # No flow-run heartbeats: they let a lasting server mark a crashed run, and this server ends with the
        # command; Prefect joins its heartbeat thread at each flow's end after up to a second's sleep (four flows,
        # ~3 s of a command that does a few seconds of work).
        with temporary_settings({PREFECT_API_URL: url, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield url
    finally:
        os.environ.pop("PREFECT_API_URL", None)
        refresh_global_settings_context()
