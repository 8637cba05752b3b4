"""Ends the temporary Prefect server when the command that started it ends, however it ends.

Prefect stops its temporary server from an exit hook, which a killed command (SIGKILL, an out-of-memory kill,
SIGTERM without a handler) never runs, leaving the server behind. This watcher runs in a session of its own
(so a Ctrl-C aimed at the command's process group does not end it first), polls the command, and terminates
the server once the command is gone; it ends by itself when the server does.

    python -m flows.server_watch COMMAND_PID SERVER_PID
"""
from __future__ import annotations

import os
import signal
import sys
import time

POLL_SECONDS = 0.5
GRACE_SECONDS = 5.0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:        # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def watch(command: int, server: int) -> None:
    while alive(server):
        if not alive(command):
            os.kill(server, signal.SIGTERM)
            deadline = time.monotonic() + GRACE_SECONDS
            while alive(server) and time.monotonic() < deadline:
                time.sleep(0.1)
            if alive(server):
                os.kill(server, signal.SIGKILL)
            return
        time.sleep(POLL_SECONDS)


if __name__ == "__main__":
    watch(int(sys.argv[1]), int(sys.argv[2]))
