"""Progress of a run's long steps for the person at the terminal.

A rich bar with counts and ETA when stderr is a terminal, plain lines ("step: 12/56 stays") otherwise, nothing
when disabled (the default: a deployment's worker logs through Prefect instead). The CLI enables it; the flows
report their steps here, so the same code serves both.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator

_state = {"enabled": False}
# Every step of this process, as it ran: (name, wall-clock start, end) -- the scale bench reads a run's phases.
phases: list[tuple[str, float, float]] = []
PLAIN_EVERY_S = 10.0       # a plain progress line at least this often during a long step


def configure(enabled: bool) -> None:
    _state["enabled"] = bool(enabled)


def _plain(name, total, unit):
    t0 = time.perf_counter()
    done = [0]
    next_mark = [0.1]
    last = [t0]
    print(f"{name}...", file=sys.stderr, flush=True)

    def advance(n=1):
        done[0] += n
        now = time.perf_counter()
        if total and (done[0] / total >= next_mark[0] or now - last[0] >= PLAIN_EVERY_S):
            eta = (now - t0) / done[0] * (total - done[0]) if done[0] else float("nan")
            print(f"{name}: {done[0]}/{total} {unit}, {now - t0:.0f} s, ETA {eta:.0f} s", file=sys.stderr, flush=True)
            last[0] = now
            while next_mark[0] <= done[0] / total:
                next_mark[0] += 0.1
    return advance, lambda: print(f"{name}: done in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                                  flush=True)


@contextmanager
def step(name: str, total: int | None = None, unit: str = "items") -> Iterator:
    """A long step; yields ``advance(n=1)`` to count finished items (ignored without a ``total``)."""
    start = time.time()
    try:
        with _shown(name, total, unit) as advance:
            yield advance
    finally:
        phases.append((name, start, time.time()))


@contextmanager
def _shown(name, total, unit):
    if not _state["enabled"]:
        yield lambda n=1: None
        return
    if not sys.stderr.isatty():
        advance, finish = _plain(name, total, unit)
        yield advance
        finish()
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)
    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    if total:
        columns += [BarColumn(), MofNCompleteColumn(), TextColumn(unit), TimeRemainingColumn()]
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(name, total=total)
        yield lambda n=1: bar.advance(task, n)
        if total:
            bar.update(task, completed=total)
