"""Small-cell suppression: what a report may show of counts of people.

Credentialed-data agreements (MIMIC-IV's among them) forbid publishing a count of fewer than 11 people. Every
count of patients or stays from 1 to ``threshold - 1`` becomes :class:`Hidden` ("<11", no percentage), and so
does every cell from which a hidden one could be worked back (complementary suppression; such a cell holds a
larger count and reads "suppressed", since "<11" beside a total it cannot add up to misleads):

* a count of part of a whole (``n`` of ``of``) is hidden when what is left, ``of - n``, is small;
* a row's splits add up (all = training + evaluation): one hidden split hides the smallest other;
* a partition's rows add up within a split (first care unit): one hidden row hides the next smallest.

Applied until nothing changes. Counts of tokens, hours and rows are not counts of people and stay as they are.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from typing import TYPE_CHECKING

from cohorts.characteristics import CohortTable, Count, Row

if TYPE_CHECKING:
    from run.result import RunResult

DEFAULT_THRESHOLD = 11
PEOPLE = ("stays", "patients")


SUPPRESSED = "suppressed"     # a count hidden because a small one could be worked back from it


@dataclass(frozen=True)
class Hidden:
    """A hidden count: ``n`` reads "<threshold" for a small count, "suppressed" for a complementary one (what
    report.json holds in its place)."""
    n: str

    @classmethod
    def below(cls, threshold: int) -> Hidden:
        return cls(f"<{threshold}")

    @classmethod
    def for_count(cls, n: int, threshold: int) -> Hidden:
        return cls.below(threshold) if is_small(n, threshold) else cls(SUPPRESSED)


def is_small(n: int | str, threshold: int) -> bool:
    return isinstance(n, int) and 0 < n < threshold


def shown_count(n: int | str, threshold: int = DEFAULT_THRESHOLD) -> int | str:
    """``n`` as a shared report may show it: the count, or "<threshold" when it is 1 to threshold - 1."""
    return f"<{threshold}" if is_small(n, threshold) else n


def _counts_people(cell) -> bool:
    return isinstance(cell, Count) and cell.unit in PEOPLE


def _smallest(cells, hidden, candidates) -> None:
    """Hide the smallest not-yet-hidden count of people among ``candidates`` (index tuples), if any."""
    left = [c for c in candidates if c not in hidden and cells[c].n > 0]
    if left:
        hidden.add(min(left, key=lambda c: cells[c].n))


def _hidden_cells(rows: tuple[Row, ...], threshold: int) -> set:
    """(row, split) of every cell to hide, complementary cells included."""
    cells = {(i, j): c for i, r in enumerate(rows) for j, c in enumerate(r.cells) if _counts_people(c)}
    hidden = {k for k, c in cells.items()
              if is_small(c.n, threshold) or (c.of and is_small(c.of - c.n, threshold))}
    partitions = {}
    for i, r in enumerate(rows):
        if r.partition:
            partitions.setdefault(r.group, []).append(i)
    while True:
        before = len(hidden)
        for i, r in enumerate(rows):
            row = [(i, j) for j in range(len(r.cells)) if (i, j) in cells]
            if len(row) == len(r.cells) and sum(k in hidden for k in row) == 1:
                _smallest(cells, hidden, row)
        for members in partitions.values():
            for j in range(max(len(rows[i].cells) for i in members)):
                column = [(i, j) for i in members if (i, j) in cells]
                if sum(k in hidden for k in column) == 1:
                    _smallest(cells, hidden, column)
        if len(hidden) == before:
            return hidden


def suppress_rows(rows: tuple[Row, ...], threshold: int = DEFAULT_THRESHOLD) -> tuple[Row, ...]:
    hidden = _hidden_cells(rows, threshold)
    return tuple(replace(r, cells=tuple(Hidden.for_count(c.n, threshold) if (i, j) in hidden else c
                                        for j, c in enumerate(r.cells))) for i, r in enumerate(rows))


def suppress_table(table: CohortTable | None, threshold: int = DEFAULT_THRESHOLD) -> CohortTable | None:
    """The cohort table with its small counts of people, and the cells that would reveal them, hidden."""
    if table is None:
        return None
    return replace(table, rows=suppress_rows(table.rows, threshold),
                   criteria=suppress_rows(table.criteria, threshold))


def _suppress_cohort(cohort: dict, threshold: int) -> dict:
    """The run's stream counts: stays of each split (all = training + evaluation) and evaluation stays with
    each label (their complement in the evaluation stays shows too)."""
    out = {}
    for k, v in cohort.items():
        if isinstance(v, dict) and k == "computed_stays":
            out[k] = {name: shown_count(n, threshold) for name, n in v.items()}
        elif k == "characteristics":
            out[k] = suppress_table(v, threshold) if isinstance(v, CohortTable) else v
        elif "stays" in k and isinstance(v, int):
            whole = cohort.get("eval_stays") if k.startswith("eval_stays_with") else None
            out[k] = f"<{threshold}" if is_small(v, threshold) else SUPPRESSED if (
                isinstance(whole, int) and is_small(whole - v, threshold)) else v
        else:
            out[k] = v
    trio = ("stays", "train_stays", "eval_stays")
    if all(k in out for k in trio) and sum(isinstance(out[k], str) for k in trio) == 1:
        shown = [k for k in trio if isinstance(out[k], int) and out[k] > 0]
        if shown:
            out[min(shown, key=lambda k: out[k])] = SUPPRESSED
    return out


def disclosed(result: RunResult, threshold: int | None = None) -> RunResult:
    """The run's result as a shared report may show it: the cohort table and counts with small cells hidden,
    and every summary and paired row's number of stays ``n`` the same way. ``threshold``: the result's
    metadata ``small_cell_threshold`` (the cohort config's ``report.small_cell_threshold``), else 11."""
    t = int(threshold or result.metadata.get("small_cell_threshold") or DEFAULT_THRESHOLD)
    return replace(result, cohort=_suppress_cohort(result.cohort, t),
                   summary=tuple(replace(r, n=shown_count(r.n, t)) for r in result.summary),
                   paired=tuple(replace(r, n=shown_count(r.n, t)) for r in result.paired))
