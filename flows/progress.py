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


def configure(enabled: bool) -> None:
    _state["enabled"] = bool(enabled)


def _plain(name, total, unit):
    t0 = time.perf_counter()
    done = [0]
    next_mark = [0.1]
    print(f"{name}...", file=sys.stderr, flush=True)

    def advance(n=1):
        done[0] += n
        if total and done[0] / total >= next_mark[0]:
            print(f"{name}: {done[0]}/{total} {unit}", file=sys.stderr, flush=True)
            next_mark[0] = min(1.0, next_mark[0] + 0.1) if done[0] < total else 2.0
    return advance, lambda: print(f"{name}: done in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
                                  flush=True)


@contextmanager
def step(name: str, total: int | None = None, unit: str = "items") -> Iterator:
    """A long step; yields ``advance(n=1)`` to count finished items (ignored without a ``total``)."""
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
