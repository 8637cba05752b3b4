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
