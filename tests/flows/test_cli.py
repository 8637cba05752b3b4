"""The command line: fast help, one-line errors with exit 2 and no server, version and defaults."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import psutil
import pytest

from flows.api_server import DEFAULT_STARTUP_SECONDS, STARTUP_TIMEOUT_SETTING
from flows.cli import build_parser, main
from pipeline.extract import extract
from pipeline.generate import GeneratorConfig, generate
from pipeline.locking import workspace_lock
from pipeline.privacy import load_key
from pipeline.workspace import Workspace
from run.params import RunParams, RunParamsError
from tests.builders import meds_dataset

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args, env=None):
    code = ("import sys; from flows.cli import main; rc = main(sys.argv[1:]); "
            "print('prefect imported' if 'prefect' in sys.modules else 'no prefect', file=sys.stderr); "
            "sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_every_option_has_help_and_defaults_are_shown(capsys):
    parser = build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.help, f"{name} {action.option_strings or action.dest} has no help text"
    with pytest.raises(SystemExit) as e:
        main(["run", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--tokens" in out and "else hourly)" in out and "(default: None)" not in out
    assert "--config" in out and "--memory-limit" in out


@pytest.mark.slow
def test_help_and_version_import_nothing_heavy():
    p = subprocess.run([sys.executable, "-c", "import sys; from flows.cli import main\ntry:\n main(['--help'])\n"
                        "except SystemExit: pass\nprint(sorted({'polars', 'prefect', 'torch', 'numpy'} & "
                        "set(sys.modules)))"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.stdout.strip().endswith("[]"), p.stdout
    v = subprocess.run([sys.executable, "-m", "flows.cli", "--version"], cwd=ROOT, capture_output=True, text=True)
    assert v.returncode == 0 and v.stdout.startswith("forgetful ")


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["run", "--source", "/no/such/mimic", "--out", "{tmp}/ws"], "source directory /no/such/mimic does not exist"),
    (["run", "--config", "no-such-config", "--out", "{tmp}/ws"], "neither a shipped config"),
    (["delete", "--out", "{tmp}/ws", "--subject-id", "1"], "has no event store"),
    # the audit's options: each refused before anything is written (issue 44.5)
    (["run", "--out", "{tmp}/ws", "--workers", "-3"], "workers must be a whole number of at least 1, got -3"),
    (["run", "--out", "{tmp}/ws", "--memory-limit", "abc"], "memory limit 'abc' is not a size"),
    (["run", "--out", "{tmp}/ws", "--workers", "0"], "workers must be a whole number of at least 1, got 0"),
    (["run", "--out", "{tmp}/ws", "--max-events", "0"], "max events must be a whole number of at least 1"),
    (["serve", "--out", "{tmp}/ws", "--cohort-budget", "0"], "cohort budget must be a whole number of at least 1"),
    (["extract", "--source", "{tmp}/src", "--out", "{tmp}/ws", "--memory-limit", "12"], "memory limit '12'"),
])
def test_user_errors_are_one_line_exit_2_without_a_server(tmp_path, args, message):
    p = _cli(*[a.format(tmp=tmp_path) for a in args])
    assert p.returncode == 2, p.stderr
    *lines, marker = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("forgetful: error:") and message in lines[0]
    assert "Traceback" not in p.stderr + p.stdout
    assert marker == "no prefect"               # no flow, no server: Prefect was never imported
    assert not (tmp_path / "ws").exists()       # nothing written, not even a key


@pytest.mark.slow
def test_commands_that_hash_or_sign_refuse_to_start_without_their_key_outside_the_workspace(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("FORGETFUL_HASH_KEY", "FORGETFUL_SIGNING_KEY_FILE")}
    run = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--out", str(tmp_path / "ws")], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "no hash key" in run.stderr and "forgetful keygen" in run.stderr
    assert "Traceback" not in run.stderr and not (tmp_path / "ws").exists()
    made = subprocess.run([sys.executable, "-m", "flows.cli", "keygen", str(tmp_path / "keys" / "hash.key")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and "FORGETFUL_HASH_KEY_FILE=" in made.stdout
    again = subprocess.run([sys.executable, "-m", "flows.cli", "keygen", str(tmp_path / "keys" / "hash.key")],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "never overwritten" in again.stderr
    signing = subprocess.run([sys.executable, "-m", "flows.cli", "keygen", "--signing",
                              str(tmp_path / "keys" / "signing.pem")], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)
    assert signing.returncode == 0 and "FORGETFUL_SIGNING_KEY_FILE=" in signing.stdout
    assert (tmp_path / "keys" / "signing.pem").read_text().startswith("-----BEGIN PRIVATE KEY-----")


@pytest.mark.slow
def test_commands_started_together_on_a_fresh_prefect_home_all_start(tmp_path):
    """They used to race on creating Prefect's database (sqlite3.OperationalError: index ... already exists)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "fresh-prefect-home")
    # the wait every command gives a server (flows.api_server.default_startup_wait): six fresh ones on two cores
    # took more than Prefect's own 20 s
    env[STARTUP_TIMEOUT_SETTING] = str(DEFAULT_STARTUP_SECONDS)
    code = ("from prefect import flow\nfrom flows.api_server import shared_api_server\n"
            "@flow\ndef hello():\n    return 1\nwith shared_api_server():\n    assert hello() == 1\n")
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(6)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, "\n".join(o[-1500:] for o in outs)
    assert not any("OperationalError" in o for o in outs)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_temporary_prefect_server_ends_with_a_killed_command(tmp_path, sig):
    """14 of 29 killed commands used to leave their temporary server running: its exit hook never ran."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    env[STARTUP_TIMEOUT_SETTING] = str(DEFAULT_STARTUP_SECONDS)     # as every command gives it
    code = ("import time\nfrom flows.api_server import shared_api_server\n"
            "with shared_api_server():\n    print('up', flush=True)\n    time.sleep(600)\n")
    cmd = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    assert cmd.stdout.readline().strip() == "up"
    servers = [p for p in psutil.Process(cmd.pid).children(recursive=True) if "uvicorn" in " ".join(p.cmdline())]
    assert len(servers) == 1
    cmd.send_signal(sig)
    cmd.wait(timeout=30)
    gone, alive = psutil.wait_procs(servers, timeout=20)
    assert alive == [], f"the server (pid {servers[0].pid}) outlived the command"


@pytest.mark.slow
def test_a_delete_refused_by_the_lock_inside_the_flow_is_one_line(tmp_path):
    ws = Workspace(tmp_path / "ws")
    generate(ws.source, GeneratorConfig(n_patients=4, seed=2))
    extract(ws.source, ws.store, key=load_key(ws.root))
    sid = str(pl.read_parquet(ws.store / "stays.parquet")["subject_id"][0])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    with workspace_lock(ws.root, purpose="a scheduled run"):
        p = subprocess.run([sys.executable, "-m", "flows.cli", "delete", "--out", str(ws.root), "--subject-id", sid,
                            "--wait", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "locked" in p.stderr and p.stderr.strip().count("\n") == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stdout + p.stderr


def _meds_without_icu_stays(root: Path) -> Path:
    """A MEDS dataset carrying every channel of mimic-iv-meds but no ICU admission code."""
    from datetime import datetime, timedelta
    codes = ["LAB//220045//bpm", "LAB//220050//mmHg", "LAB//220051//mmHg", "LAB//220210//insp/min", "LAB//220277//%",
             "LAB//223762//°C"]
    rows = [(s, datetime(2150, 1, 1) + timedelta(hours=h), c, 80.0) for s in (1, 2) for h in range(3) for c in codes]
    return meds_dataset(root, pl.DataFrame(rows, schema={"subject_id": pl.Int64, "time": pl.Datetime("us"),
                                                         "code": pl.String, "numeric_value": pl.Float32},
                                           orient="row"))


@pytest.mark.slow
def test_a_refusal_inside_the_flow_is_one_line_and_leaves_no_workspace(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_LOGGING"))}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    source = _meds_without_icu_stays(tmp_path / "meds")
    p = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--source", str(source), "--config",
                        "mimic-iv-meds", "--out", str(tmp_path / "ws")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip().count("\n") == 0 and "no ICU stays" in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stdout + p.stderr
    assert not (tmp_path / "ws").exists()


@pytest.mark.slow
def test_the_temporary_server_starts_under_a_cpu_hog_and_a_start_too_slow_is_one_line(tmp_path):
    """Three CPU-bound processes beside the command (a busy workstation): the server's start waits long enough.
    A wait shorter than any start fails in one line naming the setting, exit 2, nothing written."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_LOGGING",
                                                                     "PREFECT_SERVER_EPHEMERAL"))}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    code = ("from prefect import flow\nfrom flows.api_server import shared_api_server\n"
            "@flow\ndef hello():\n    return 1\nwith shared_api_server():\n    assert hello() == 1\nprint('ran')\n")
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        ok = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env | {
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}, capture_output=True, text=True, timeout=400)
    finally:
        for h in hogs:
            h.kill()
    assert ok.returncode == 0 and ok.stdout.strip().endswith("ran"), ok.stderr[-3000:]
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "1"
    slow = subprocess.run([sys.executable, "-m", "flows.cli", "run", "--out", str(tmp_path / "ws")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert slow.returncode == 2, slow.stderr[-3000:]
    assert slow.stderr.strip().count("\n") == 0, slow.stderr[-3000:]
    assert "did not answer within 1 s" in slow.stderr and "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in \
        slow.stderr
    assert not (tmp_path / "ws").exists()


def test_a_full_disk_names_the_folder_and_its_free_space_and_a_defect_is_one_line(tmp_path, capsys, monkeypatch):
    import errno
    import argparse as ap
    from flows import cli
    args = ap.Namespace(out=str(tmp_path / "ws" / "store"), verbose=False)
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ws" / "store" / "data" / "3.parquet"))
    assert cli._failure(full, args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no space left on the device holding {tmp_path}" in err and "MiB free" in err
    assert "run the command again: it resumes" in err
    assert cli._failure(ZeroDivisionError("float division by zero"), args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "internal error: ZeroDivisionError" in err and "--verbose" in err


def _servers() -> set:
    """Prefect API servers running on this machine (their pids)."""
    return {p.pid for p in psutil.process_iter(["cmdline"])
            if "prefect.server.api.server:create_app" in " ".join(p.info["cmdline"] or [])}


@pytest.mark.slow
def test_a_deletion_refused_while_its_early_server_boots_is_one_line_and_leaves_no_server(tmp_path):
    """A deletion checks its subjects while the command's server boots (the server starts before the checks
    when its home's database exists): an unknown subject is still one line, exit 2, without Prefect imported in
    the command, and the server it started is gone when the command is."""
    ws = Workspace(tmp_path / "ws")
    generate(ws.source, GeneratorConfig(n_patients=4, seed=2))
    extract(ws.source, ws.store, key=load_key(ws.root))
    home = tmp_path / "prefect-home"
    home.mkdir()
    (home / "prefect.db").touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env["PREFECT_HOME"] = str(home)
    before = _servers()
    p = _cli("delete", "--out", str(ws.root), "--subject-id", "987654321", env=env)
    assert p.returncode == 2, p.stderr[-2000:]
    *lines, marker = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("forgetful: error:") and "987654321" in lines[0], p.stderr
    assert marker == "no prefect"
    assert (home / ".forgetful-server-start.lock").exists()      # the server did start early
    assert _servers() <= before


@pytest.mark.slow
def test_the_cohort_memory_s_worker_process_ends_when_the_run_s_process_is_killed(tmp_path):
    """The cohort memory is fed in a worker process that writes into the workspace (checkpoints, snapshots):
    when the run's process is killed (its lock released), the worker ends too, instead of writing on while a
    next run holds the workspace."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import multiprocessing as mp, sys, time\n"
        "def child(path):\n"
        "    from flows.prefect_flows import end_with_parent\n"
        "    end_with_parent(0.05)\n"
        "    open(path, 'w').write('started')\n"
        "    time.sleep(120)\n"
        "if __name__ == '__main__':\n"
        "    p = mp.get_context('spawn').Process(target=child, args=(sys.argv[1],))\n"
        "    p.start()\n"
        "    print(p.pid, flush=True)\n"
        "    time.sleep(120)\n")
    started = tmp_path / "started"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    parent = subprocess.Popen([sys.executable, str(script), str(started)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              text=True)
    try:
        worker = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 120
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert started.exists() and worker.is_running()
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.1)
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE


def test_an_invalid_option_leaves_the_workspace_s_saved_parameters_as_they_were(tmp_path, capsys):
    """After `--workers -3` the audit's run.json held it and every later plain rerun and scheduled run failed."""
    ws = Workspace(tmp_path / "ws")
    ws.root.mkdir()
    RunParams(workers=2).save(ws.run_params)
    before = ws.run_params.read_text()
    for bad in (["--workers", "-3"], ["--memory-limit", "abc"], ["--cohort-budget", "0"]):
        assert main(["run", "--out", str(ws.root), *bad]) == 2
        assert ws.run_params.read_text() == before
        assert sorted(p.name for p in ws.root.iterdir()) == ["run.json"]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("forgetful: error: ") for line in err)


def test_a_deployment_s_parameters_get_the_cli_s_checks_before_anything_is_written(tmp_path):
    from flows.prefect_flows import scheduled_run
    with pytest.raises(RunParamsError, match="workers must be a whole number"):
        scheduled_run.fn(root=str(tmp_path / "ws"), workers=-3)
    ws = Workspace(tmp_path / "ws2")
    ws.root.mkdir()
    ws.run_params.write_text('{"memory_limit": "abc"}')
    with pytest.raises(RunParamsError, match="run.json: memory limit 'abc'"):
        scheduled_run.fn(root=str(ws.root))
    assert not (tmp_path / "ws").exists() and sorted(p.name for p in ws.root.iterdir()) == ["run.json"]


def test_exit_classes_follow_the_cause(tmp_path, capsys, monkeypatch):
    """The audit's wrong exit classes: a damaged key_fingerprint.json said "error: 'fingerprint'" (a KeyError
    taken for input); a builtin KeyError or ValueError of ours is a defect (exit 1), our own types input (2)."""
    from flows.failures import failure_status
    from pipeline.errors import EnvironmentProblem, InputError, Refusal
    ws = Workspace(tmp_path / "ws")
    ws.store.mkdir(parents=True)
    (ws.store / "key_fingerprint.json").write_text("{}")
    assert main(["run", "--out", str(ws.root)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("forgetful: error: ") and "key_fingerprint.json is damaged" in err
    assert [failure_status(e) for e in (KeyError("fingerprint"), ValueError("x"), AttributeError("y"),
                                        InputError("a"), Refusal("b"), EnvironmentProblem("c"),
                                        OSError(28, "No space left on device"))] == [1, 1, 1, 2, 2, 2, 2]
    monkeypatch.setattr("flows.cli._run", lambda args: {}["a key our code expected"])
    assert main(["run", "--out", str(ws.root)]) == 1
    assert capsys.readouterr().err.startswith("forgetful: internal error: KeyError")


@pytest.mark.slow
def test_a_configured_api_that_does_not_answer_is_one_line_exit_2(tmp_path):
    """A closed PREFECT_API_URL port gave "internal error: RuntimeError" (exit 1)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]           # closed once the block ends: nothing listens there
    env = dict(os.environ, PREFECT_API_URL=f"http://127.0.0.1:{port}/api")
    p = _cli("run", "--out", str(tmp_path / "ws"), "--budgets", "8", env=env)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.splitlines()[:-1]
    assert lines[-1].startswith("forgetful: error: the Prefect API configured in PREFECT_API_URL") and \
        f":{port}/api" in lines[-1] and "Traceback" not in p.stderr
    assert not (tmp_path / "ws").exists()
