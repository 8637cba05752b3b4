"""The deletion desk's hand-over (flows.deletion_desk): a request is answered once, by the process holding the desk;
a command whose desk ended before taking its request runs it itself; one whose desk ended holding it is told so.
End to end through `forgetful serve` and `forgetful delete` in tests/flows/test_flows_and_deletion.py."""
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flows.deletion_desk import DeletionOutcome, DeletionRequest, DeskStopped, desk_pid, open_desk, submit
from pipeline.workspace import Workspace

ROOT = Path(__file__).resolve().parents[2]
HASHES = ("a" * 64, "b" * 64)


def test_a_request_is_answered_by_the_desk_and_leaves_no_file(tmp_path):
    ws = Workspace(tmp_path / "ws")
    seen = []

    def handle(request):
        seen.append(request)
        return DeletionOutcome(certificates=("c0.json", "c1.json"), skipped={"cccccccccccc": "unknown"})
    assert desk_pid(ws) is None and submit(ws, DeletionRequest(HASHES)) is None     # no desk: the command runs it
    with open_desk(ws, handle) as desk:
        assert desk is not None and desk_pid(ws) > 0
        out = submit(ws, DeletionRequest(HASHES, mode="replay", wait_seconds=5.0, skip_unknown=True))
    assert out == DeletionOutcome(certificates=("c0.json", "c1.json"), skipped={"cccccccccccc": "unknown"})
    assert seen == [DeletionRequest(HASHES, mode="replay", wait_seconds=5.0, skip_unknown=True)]
    assert desk_pid(ws) is None
    assert [p for p in ws.desk.rglob("*") if p.is_file() and p.name != "desk.lock"] == []


def test_requests_are_answered_one_at_a_time_in_the_order_sent(tmp_path):
    ws = Workspace(tmp_path / "ws")
    running, order = [], []

    def handle(request):
        running.append(request.subject_hashes)
        assert len(running) == 1        # one deletion at a time
        time.sleep(0.2)
        order.append(request.subject_hashes[0])
        running.pop()
        return DeletionOutcome(certificates=request.subject_hashes)
    with open_desk(ws, handle):
        outs = {}
        threads = [threading.Thread(target=lambda h=h: outs.setdefault(h, submit(ws, DeletionRequest((h,)))))
                   for h in HASHES]
        for t in threads:
            t.start()
            time.sleep(0.05)
        for t in threads:
            t.join()
    assert order == list(HASHES) and {h: o.certificates for h, o in outs.items()} == {h: (h,) for h in HASHES}


def test_a_desk_whose_thread_fails_stops_looking_open_and_the_command_runs_the_request(tmp_path):
    ws = Workspace(tmp_path / "ws")

    def warm():
        raise OSError("cannot load the compiled solver")
    with open_desk(ws, lambda r: DeletionOutcome(), warm=warm) as desk:
        desk.thread.join(timeout=10)
        assert desk_pid(ws) is None and submit(ws, DeletionRequest(HASHES)) is None


def test_a_second_desk_on_the_same_workspace_is_refused(tmp_path):
    ws = Workspace(tmp_path / "ws")
    with open_desk(ws, lambda r: DeletionOutcome()) as first, open_desk(ws, lambda r: DeletionOutcome()) as second:
        assert first is not None and second is None
    with open_desk(ws, lambda r: DeletionOutcome()) as again:       # free once the first closed
        assert again is not None


def test_a_handler_that_raises_is_answered_as_a_defect_in_one_line_and_the_desk_goes_on(tmp_path):
    ws = Workspace(tmp_path / "ws")

    def handle(request):
        if request.mode == "replay":
            raise RuntimeError("a defect")
        return DeletionOutcome(certificates=("c.json",))
    with open_desk(ws, handle):
        out = submit(ws, DeletionRequest(HASHES, mode="replay"))
        after = submit(ws, DeletionRequest(HASHES))
    assert out.failure == "RuntimeError: a defect" and out.failure_status == 1
    assert after.certificates == ("c.json",)


DESK_PROCESS = """
import os, sys, time
from flows.deletion_desk import open_desk, DeletionOutcome
from pipeline.workspace import Workspace
def handle(request):
    if os.environ.get("DIE_HOLDING"):
        os._exit(9)                 # the serving process killed during the deletion
    return DeletionOutcome()
with open_desk(Workspace(sys.argv[1]), handle, warm=lambda: time.sleep(float(os.environ.get("WARM", "0")))):
    print("open", flush=True)
    time.sleep(600)
"""


def _desk_process(ws, **env):
    import os
    proc = subprocess.Popen([sys.executable, "-c", DESK_PROCESS, str(ws.root)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, **env})
    assert proc.stdout.readline().strip() == "open"
    return proc


def test_a_desk_that_ends_before_taking_the_request_leaves_it_to_the_command(tmp_path):
    """The request waits as keyed hashes only (never a raw id); withdrawn when the desk ends untaken."""
    ws = Workspace(tmp_path / "ws")
    proc = _desk_process(ws, WARM="600")        # open, but not answering yet
    outs = []
    try:
        assert desk_pid(ws) == proc.pid
        t = threading.Thread(target=lambda: outs.append(submit(ws, DeletionRequest(HASHES))))
        t.start()
        deadline = time.monotonic() + 10
        while not list((ws.desk / "requests").glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.02)
        (waiting,) = (ws.desk / "requests").glob("*.json")
        assert json.loads(waiting.read_text())["subject_hashes"] == list(HASHES)
        proc.kill()
        t.join(timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert outs == [None]
    assert desk_pid(ws) is None and list((ws.desk / "requests").glob("*.json")) == []


def test_a_desk_that_ends_holding_the_request_is_one_line_and_the_next_desk_clears_it(tmp_path):
    ws = Workspace(tmp_path / "ws")
    proc = _desk_process(ws, DIE_HOLDING="1")
    with pytest.raises(DeskStopped, match="ended while it held this deletion request"):
        submit(ws, DeletionRequest(HASHES))
    proc.wait()
    assert len(list((ws.desk / "taken").glob("*.json"))) == 1
    with open_desk(ws, lambda r: DeletionOutcome()):
        assert list((ws.desk / "taken").glob("*.json")) == []
