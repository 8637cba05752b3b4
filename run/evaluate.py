"""The run's evaluation, once: what the scheduled flow runs and what a replay deletion reruns over its view of the
workspace.

:func:`prepare` does the cohort's phases (hourly tokens: per-stay facts, labels, MEDS label files, token scaling,
the streaming setting; raw events: the evaluation streams); :meth:`PreparedRun.score` scores what is not cached,
takes the statistics and writes the metadata, giving a :class:`run.result.RunResult`. Per-stay scoring goes
through a :data:`ChunkMap`: the flow maps chunks of stays over its Prefect task runner, a deletion and the
benches over a local process pool (:func:`process_pool_map`). The split lets a deletion replay the cohort memory
under the recomputed token scaling between the two.
"""
from __future__ import annotations

import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cohorts.definitions import workspace_config
from cohorts.evaluation import EventStream, aggregate, balanced_chunks, long_rows, run_sweep
from cohorts.protocols import StreamingSettings, TokenStream, score_token_streams
from cohorts.stream_mode import StreamMode
from pipeline import progress

from .params import RunParams
from .provenance import provenance
from .result import RunResult
from .steps import (EMBEDDED_SOURCE, label_phase, run_metadata, run_statistics, save_results, score_pending,
                    scoring_plan, token_phase, workspace_event_streams)

if TYPE_CHECKING:
    from cohorts.config import CohortConfig
    from collections.abc import Callable
    from pathlib import Path

    from pipeline.workspace import Workspace

    from .token_run import StayIndex


class ChunkMap(Protocol):
    """``map(fn, parts, advance, **common)``: ``fn(part, **common)`` for every part, told ``advance(len(part))`` as
    each finishes; the results in the parts' order."""

    def __call__(self, fn: Callable, parts: list[list], advance: Callable, **common) -> list:
        ...


def score_event_chunk(streams: list[EventStream], budgets: tuple, fractions: tuple,
                      memory_budget: int | None) -> list[dict]:
    """Raw-events mode: the budget sweep over a chunk of stays, in this process."""
    return run_sweep(streams, budgets=budgets, fractions=fractions, workers=1, memory_budget=memory_budget)


# Fewer stays than this are scored in the run's own process, whatever its map: a worker process starts in ~4 s
# (its imports, the solver's compiled loops), the time of scoring some 40 stays at ~0.1 s each, and a night's
# rerun scores a handful (at 10 % of v3.1, 14 stays after ~1 % new rows: 8.5 s in the pool).
IN_PROCESS_BELOW = 40


def in_process_map(fn: Callable, parts: list[list], advance: Callable, **common) -> list:
    """A :data:`ChunkMap` in this process, one part after the other (small workspaces, tests)."""
    out = []
    for p in parts:
        out.append(fn(p, **common))
        advance(len(p))
    return out


def process_pool_map(fn: Callable, parts: list[list], advance: Callable, **common) -> list:
    """A :data:`ChunkMap` over a local process pool, one worker per core (outside any Prefect task runner)."""
    if not parts:
        return []
    with ProcessPoolExecutor(max_workers=min(os.cpu_count() or 1, len(parts))) as pool:
        futures = [pool.submit(fn, p, **common) for p in parts]
        out = []
        for f, p in zip(futures, parts):
            out.append(f.result())
            advance(len(p))
    return out


@dataclass
class PreparedRun:
    """A run after its cohort phases, before scoring: the index of stays (hourly tokens) or the evaluation
    streams (raw events), and the cohort's summary. Patient-level: it stays in the process."""
    ws: Workspace
    params: RunParams
    cfg: CohortConfig
    cohort: dict
    started: float
    index: StayIndex | None = None
    streams: list[EventStream] | None = None

    @property
    def settings(self) -> StreamingSettings | None:
        """The streaming setting chosen on the training split (hourly tokens)."""
        return self.index.settings if self.index is not None else None

    @property
    def evaluation_stays(self) -> int:
        return self.cohort["eval_stays"] if self.index is not None else len(self.streams)

    def score(self, map_chunks: ChunkMap, chunks: int | None = None,
              described: Workspace | None = None) -> tuple[RunResult, int]:
        """Score the stays whose scores are not cached, in ``chunks`` parts per batch (default: 4 per core),
        and take the statistics: the result, with the provenance of ``described`` (default: the run's
        workspace), and the number of stays scored now."""
        n_chunks = chunks or (os.cpu_count() or 1) * 4
        plan = scoring_plan(self.params)
        if self.index is not None:
            common = dict(budgets=plan.budgets, fractions=plan.fractions, settings=self.settings,
                          fixed=self.cfg.fixed_context, memory_budget=plan.memory_budget,
                          fraction_cap=plan.fraction_cap)

            def score_batch(batch: list[TokenStream], advance: Callable) -> list[dict]:
                parts = balanced_chunks(batch, n_chunks, size=len)
                mapped = in_process_map if len(batch) < IN_PROCESS_BELOW else map_chunks
                return [r for rows in mapped(score_token_streams, parts, advance, **common) for r in rows]
            scored = score_pending(self.ws, self.index, self.cfg, plan, score_batch)
            summary, paired = run_statistics(self.ws, self.cfg)
        else:
            parts = balanced_chunks(self.streams, n_chunks)
            with progress.step("scoring", total=len(self.streams), unit="stays") as advance:
                done = map_chunks(score_event_chunk, parts, advance, budgets=plan.budgets,
                                  fractions=plan.fractions, memory_budget=plan.memory_budget)
            # rows in chunk order, not completion order: the bootstrap draws over stays in row order
            rows = long_rows([r for part in done for r in part])
            save_results(self.ws, rows)
            with progress.step("statistics"):
                summary, paired = aggregate(rows, endpoints=self.cfg.endpoints)
            scored = len(self.streams)
        metadata = run_metadata(self.ws, self.params, self.cfg, time.perf_counter() - self.started, self.settings)
        described = described or self.ws
        origin = provenance(described.store, described.root, metadata["data_source"])
        return RunResult(tuple(summary), tuple(paired), self.cohort, metadata, origin), scored


def prepare(ws: Workspace, params: RunParams, cfg: CohortConfig | None = None,
            removed_from: Path | None = None, tokenised: Tokenised | None = None) -> PreparedRun:
    """The cohort's phases of a run over ``ws`` (its config unless ``cfg`` is given); ``removed_from``: see
    :func:`run.token_run.stay_facts`; ``tokenised``: the first phase done already (hourly tokens), by
    :func:`tokenise`."""
    cfg = cfg or workspace_config(ws.root)
    if params.tokens is StreamMode.HOURLY:
        tokenised = tokenised or tokenise(ws, params, cfg, removed_from)
        cohort = label_phase(ws, tokenised.index, cfg, chunk_stays=params.chunk_stays)
        return PreparedRun(ws, params, cfg, cohort, tokenised.started, index=tokenised.index)
    started = time.perf_counter()
    streams, cohort = workspace_event_streams(ws, cfg, params.max_events)
    return PreparedRun(ws, params, cfg, cohort, started, streams=streams)


@dataclass
class Tokenised:
    """An hourly-token run after its first phase: every stay's tokens cached (what the cohort memory reads),
    the labels not yet made; ``started``: when the run's evaluation began."""
    index: StayIndex
    started: float


def tokenise(ws: Workspace, params: RunParams, cfg: CohortConfig | None = None,
             removed_from: Path | None = None) -> Tokenised:
    """The first phase of an hourly-token run over ``ws`` (:func:`run.steps.token_phase`)."""
    started = time.perf_counter()
    index = token_phase(ws, cfg or workspace_config(ws.root), params.chunk_stays, removed_from)
    return Tokenised(index, started)


def saved_params(ws: Workspace) -> RunParams | None:
    """The parameters of the workspace's last run (``WS/run.json``; for a workspace from before it, those its
    report records), or None when it has had no run."""
    params = RunParams.load(ws.run_params)
    if params is not None or not ws.report_json.exists():
        return params
    meta = json.loads(ws.report_json.read_text()).get("metadata") or {}
    if not meta.get("budgets") or meta.get("tokens_mode") not in {m.value for m in StreamMode}:
        return None
    source = meta.get("data_source")
    return RunParams(budgets=meta["budgets"], fractions=meta.get("fractions") or (), tokens=meta["tokens_mode"],
                     source=None if source in (None, EMBEDDED_SOURCE) else source)


def rerun_params(ws: Workspace) -> RunParams | None:
    """The parameters of the workspace's last run when a recomputation can rerun it; None when it had no run or
    one of raw events (a raw-events run keys its events with statistics that a deletion does not refit)."""
    params = saved_params(ws)
    return params if params is not None and params.tokens is StreamMode.HOURLY else None


def rerun(ws: Workspace, last_run_of: Workspace | None = None) -> PreparedRun | None:
    """The last run of ``last_run_of`` (default: ``ws``) prepared again, with its parameters, over ``ws`` as it
    is now (a deletion's view of the workspace, whose store is ``last_run_of``'s with whole subjects removed)
    under ``ws``'s config: None when it cannot be rerun (:func:`rerun_params`)."""
    params = rerun_params(last_run_of or ws)
    removed_from = last_run_of.store if last_run_of is not None else None
    return prepare(ws, params, removed_from=removed_from) if params is not None else None


def evaluate(ws: Workspace, params: RunParams, map_chunks: ChunkMap = process_pool_map,
             cfg: CohortConfig | None = None) -> RunResult:
    """A run's evaluation over ``ws``: :func:`prepare`, then :meth:`PreparedRun.score`."""
    return prepare(ws, params, cfg).score(map_chunks)[0]
