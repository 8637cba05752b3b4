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


def _answer_to(ws, name, request: dict, timeout=10.0):
    """Write a request file by hand (as anyone who may write the workspace can) and wait for its reply."""
    atomic = ws.desk / "requests" / f"{name}.json.part"
    atomic.write_text(json.dumps(request))
    atomic.rename(ws.desk / "requests" / f"{name}.json")
    reply = ws.desk / "replies" / f"{name}.json"
    deadline = time.monotonic() + timeout
    def written():
        return reply.is_file() and not reply.is_symlink()
    while not written() and time.monotonic() < deadline:
        time.sleep(0.02)
    return json.loads(reply.read_text()) if written() else None


def _rejected(ws):
    return sorted(p.name.split(".json")[0] for p in (ws.desk / "rejected").iterdir()) \
        if (ws.desk / "rejected").exists() else []


def test_the_desk_is_a_hardened_door(tmp_path, capfd):
    """The audit's cases: a symlink planted at a reply's temporary name made the desk write outside the workspace;
    a FIFO in requests/ hung the desk (and the command); a folder named <id>.json killed the desk's thread
    silently and blocked the next serve; a failed request's traceback never reached serve's output; a request
    naming a raw id reached Prefect's database and the reply."""
    import os
    ws = Workspace(tmp_path / "ws")
    outside = tmp_path / "outside.txt"
    outside.write_text("untouched")
    handled = []

    def handle(request):
        handled.append(request.subject_hashes)
        if request.mode == "replay":
            raise RuntimeError("a defect of ours")
        return DeletionOutcome(certificates=("000000.json",))
    with open_desk(ws, handle) as desk:
        replies = ws.desk / "replies"
        for planted in ("link.json.tmp", "link.json"):         # links at the reply's names, pointing outside
            os.symlink(outside, replies / planted)
        assert _answer_to(ws, "link", {"subject_hashes": [HASHES[0]]})["certificates"] == ["000000.json"]
        assert outside.read_text() == "untouched" and not (replies / "link.json").is_symlink()
        os.mkfifo(ws.desk / "requests" / "fifo.json")          # would block an open() for ever
        (ws.desk / "requests" / "folder.json").mkdir()
        os.symlink(outside, ws.desk / "requests" / "symlink.json")
        assert _answer_to(ws, "after", {"subject_hashes": [HASHES[1]]})["certificates"] == ["000000.json"]
        assert desk.thread.is_alive() and {"fifo", "folder", "symlink"} <= set(_rejected(ws))
        raw = _answer_to(ws, "raw", {"subject_hashes": ["10006"]})
        assert raw["failure_status"] == 2 and "not keyed hashes" in raw["failure"] and "10006" not in raw["failure"]
        assert not any("10006" in p.read_text() for p in ws.desk.rglob("*") if p.is_file() and not p.is_symlink())
        garbled = _answer_to(ws, "garbled", {"subject_hashes": [HASHES[0]], "mode": "everything"})
        assert garbled["failure_status"] == 2 and "mode" in garbled["failure"]
        failed = _answer_to(ws, "failed", {"subject_hashes": [HASHES[0]], "mode": "replay"})
        assert failed["failure_status"] == 1 and "a defect of ours" in failed["failure"]
        assert handled == [(HASHES[0],), (HASHES[1],), (HASHES[0],)]     # nothing malformed reached the handler
    err = capfd.readouterr().err
    assert "set aside requests/fifo.json: not a regular file (a FIFO)" in err
    assert "set aside requests/folder.json: not a regular file (a folder)" in err
    assert "Traceback" in err and "RuntimeError: a defect of ours" in err and "10006" not in err
    assert outside.read_text() == "untouched"
    (ws.desk / "taken" / "left.json").mkdir()           # blocked the next serve until cleaned by hand
    with open_desk(ws, handle) as again:
        assert again is not None and again.thread.is_alive()
        assert _answer_to(ws, "next", {"subject_hashes": [HASHES[0]]})["certificates"] == ["000000.json"]


def test_a_command_killed_while_waiting_withdraws_its_request_and_a_dead_command_s_request_is_not_run(tmp_path):
    """The audit's FIFO case: once unblocked, the desk deleted with no command waiting (SIGTERM left the
    request behind)."""
    import os
    import signal
    ws = Workspace(tmp_path / "ws")
    handled = []
    gate = threading.Event()

    def warm():
        gate.wait(30)           # open, not answering yet: the request waits in requests/
    with open_desk(ws, lambda r: handled.append(r) or DeletionOutcome(), warm=warm):
        code = ("import sys; from flows.deletion_desk import submit, DeletionRequest; "
                "from pipeline.workspace import Workspace; submit(Workspace(sys.argv[1]), DeletionRequest(('"
                + HASHES[0] + "',)))")
        proc = subprocess.Popen([sys.executable, "-c", code, str(ws.root)], cwd=ROOT)
        deadline = time.monotonic() + 30
        while not list((ws.desk / "requests").glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list((ws.desk / "requests").glob("*.json"))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert list((ws.desk / "requests").glob("*.json")) == []          # withdrawn
        # a command killed outright (SIGKILL) cannot withdraw: the desk sees that it has ended
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        (ws.desk / "requests" / "orphan.json").write_text(json.dumps({"subject_hashes": [HASHES[1]],
                                                                       "requester_pid": dead.pid}))
        gate.set()
        deadline = time.monotonic() + 10
        while (ws.desk / "requests" / "orphan.json").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
    assert handled == [] and "orphan" in _rejected(ws) and not (ws.desk / "replies" / "orphan.json").exists()


@pytest.mark.parametrize("raised, status", [(KeyError("fingerprint"), 1), (ValueError("a defect"), 1),
                                            ("hash key", 2), ("locked", 2)])
def test_the_desk_answers_with_the_exit_class_of_the_cause(tmp_path, monkeypatch, capfd, raised, status):
    """The same classes through the desk as through the command: our builtin KeyError/ValueError is a defect
    (exit 1, its traceback in serve's output), the project's own error types are the user's (exit 2)."""
    import flows.prefect_flows as pf
    from pipeline.locking import WorkspaceLocked
    from pipeline.privacy import HashKeyError
    error = {"hash key": HashKeyError("store/key_fingerprint.json is damaged"),
             "locked": WorkspaceLocked("a scheduled run holds the workspace")}.get(raised, raised)

    def fails(*args, **kwargs):
        raise error
    monkeypatch.setattr(pf, "delete_patients", fails)
    out = pf.serve_deletion(tmp_path, DeletionRequest(HASHES))
    assert out.failure_status == status
    err = capfd.readouterr().err
    assert ("Traceback" in err) == (status == 1) and str(error) in out.failure
