"""Progress of a run's long steps for the person at the terminal.

A rich bar with counts and ETA when stderr is a terminal, plain lines ("step: 12/56 stays") otherwise, nothing
when disabled (the default: a deployment's worker logs through Prefect instead). The CLI enables it; the flows
report their steps here, so the same code serves both.
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

_state = {"enabled": False}
# Every step of this process, as it ran: (name, wall-clock start, end) -- the scale bench reads a run's phases.
phases: list[tuple[str, float, float]] = []
PLAIN_EVERY_S = 10.0       # a plain progress line at least this often during a long step


def a_few(items: Iterable[object], shown: int = 3, joiner: str = "; ") -> str:
    """At most ``shown`` of ``items`` named, the rest counted: a message about a request of 100,000 subjects is
    one line a person reads, not 8 MB."""
    items = list(items)
    rest = len(items) - shown
    return joiner.join(map(str, items[:shown])) + (f"{joiner}and {rest} more" if rest > 0 else "")


def configure(enabled: bool) -> None:
    _state["enabled"] = bool(enabled)


class Advance:
    """What a step yields: ``advance(n=1)`` counts finished items; ``advance.set_total(n)`` gives a step
    whose size is known only once it has started its total (and so its ETA)."""

    def __init__(self, count: Callable[[int], None] | None = None, total: Callable[[int], None] | None = None):
        self._count, self._total = count or (lambda n: None), total or (lambda n: None)

    def __call__(self, n: int = 1) -> None:
        self._count(n)

    def set_total(self, total: int) -> None:
        self._total(total)


def _plain(name, total, unit):
    """(advance, finish) of a step shown as plain lines: every tenth of the total (once the step has run a
    second), and a line at least every PLAIN_EVERY_S seconds even while no item finishes (a heartbeat), so no
    long step is silent."""
    t0 = time.perf_counter()
    # the ETA counts from the first finished item: the time before it (workers starting, importing) is paid once,
    # and counted per item it made the first ETAs of a step several times too long
    state = {"done": 0, "total": total, "mark": 0.1, "last": t0, "first": None}
    lock, stop = threading.Lock(), threading.Event()
    print(f"{name}...", file=sys.stderr, flush=True)

    def line(now):
        done, total = state["done"], state["total"]
        counts = f"{done}/{total} {unit}, " if total else ""
        first_at, first_done = state["first"] or (now, done)
        rate = (now - first_at) / (done - first_done) if done > first_done else None
        left = max(total - done, 0) if total else None
        eta = "" if left is None or (rate is None and left) else f", ETA {(rate or 0.0) * left:.0f} s"
        print(f"{name}: {counts}{now - t0:.0f} s{eta}", file=sys.stderr, flush=True)
        state["last"] = now

    def advance(n=1):
        with lock:
            if state["first"] is None:
                state["first"] = (time.perf_counter(), n)
            state["done"] += n
            done, total, now = state["done"], state["total"], time.perf_counter()
            if total and done / total >= state["mark"] and now - t0 >= 1.0:
                line(now)
                while state["mark"] <= done / total:
                    state["mark"] += 0.1

    def heartbeat():
        while not stop.wait(1.0):
            with lock:
                if time.perf_counter() - state["last"] >= PLAIN_EVERY_S:
                    line(time.perf_counter())

    def set_total(n):
        state["total"] = n

    def finish():
        stop.set()
        print(f"{name}: done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    threading.Thread(target=heartbeat, daemon=True).start()
    return Advance(advance, set_total), finish


@contextmanager
def phase(name: str) -> Iterator[None]:
    """A run's phase, recorded (:data:`phases`) but not shown: its steps show themselves."""
    start = time.time()
    try:
        yield
    finally:
        phases.append((name, start, time.time()))


@contextmanager
def step(name: str, total: int | None = None, unit: str = "items") -> Iterator[Advance]:
    """A long step, shown and recorded; yields an :class:`Advance` (counts are ignored without a total)."""
    with phase(name), _shown(name, total, unit) as advance:
        yield advance


@contextmanager
def _shown(name, total, unit):
    if not _state["enabled"]:
        yield Advance()
        return
    if not sys.stderr.isatty():
        advance, finish = _plain(name, total, unit)
        try:
            yield advance
        finally:
            finish()
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)
    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
               TimeRemainingColumn()]
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(name, total=total)
        yield Advance(lambda n=1: bar.advance(task, n), lambda n: bar.update(task, total=n))
        bar.update(task, completed=bar.tasks[0].total or 0)
