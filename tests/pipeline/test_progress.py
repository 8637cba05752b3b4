"""Progress of long steps: plain lines with counts and ETA, a heartbeat while nothing finishes, phases recorded."""
import time

from pipeline import progress


def test_plain_progress_shows_counts_eta_and_a_heartbeat_and_records_the_phase(capsys, monkeypatch):
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.0)
    progress.configure(True)
    try:
        with progress.phase("outer"):
            with progress.step("inner", unit="stays") as advance:
                advance.set_total(4)
                time.sleep(1.5)         # nothing finishes: the heartbeat still speaks
                advance(4)
    finally:
        progress.configure(False)
    err = capsys.readouterr().err
    assert "inner: 0/4 stays" in err                       # a heartbeat line before any item finished
    assert "inner: 4/4 stays" in err and "ETA 0 s" in err and "inner: done in" in err
    names = [n for n, _, _ in progress.phases[-2:]]
    assert names == ["inner", "outer"]


def test_the_eta_counts_from_the_first_finished_item_not_the_start(capsys, monkeypatch):
    """Workers starting up (seconds before the first item) made the first ETAs of a step several times too long."""
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 100.0)
    progress.configure(True)
    try:
        with progress.step("scoring", total=20, unit="stays") as advance:
            time.sleep(1.2)             # start-up: nothing finishes
            advance(2)
            for _ in range(8):
                time.sleep(0.02)
                advance(1)
    finally:
        progress.configure(False)
    etas = [int(line.rsplit("ETA ", 1)[1].split()[0]) for line in capsys.readouterr().err.splitlines()
            if "ETA" in line]
    assert etas and max(etas) <= 1, etas          # counted from the start, the first would read ~10 s
