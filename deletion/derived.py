"""Step (replay): what a run derives from many patients, recomputed as if the patient had never been seen.

The rare-item vocabulary (training-split code counts), the streaming setting (chosen on training stays), the token
scaling when the config fits it to the training split, and everything computed from them (MEDS label files,
per-stay results and memories, statistics, the cohort table, the report) depend on every patient of the cohort.
A replay deletion recomputes them with the run's own step functions over a *view* of the workspace as it will be
after the commit: the store with the deletion's staged files, the per-stay caches of every shard but the
patient's (content-keyed, so an entry the view adds is valid for the workspace too), the workspace's config.
Its outputs are staged into the deletion's transaction, so they land with the deletion or not at all.

Hourly-token workspaces only: a workspace whose last report was of raw events keeps its reports marked stale.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cohorts.definitions import workspace_config, workspace_config_path
from cohorts.evaluation import balanced_chunks
from cohorts.protocols import score_token_streams
from cohorts.provenance import provenance
from cohorts.runs import prepare_token_run, run_metadata, run_statistics, score_pending, scoring_plan
from cohorts.stay_cache import CACHE_DIR
from pipeline.extract_rules import N_BUCKETS
from pipeline.workspace import Workspace
from reports.html import render_report

if TYPE_CHECKING:
    from cohorts.token_run import StayIndex
    from pipeline.transaction import Transaction

RECOMPUTED = ("MEDS label files", "per-stay results and memories", "rare-item vocabulary", "streaming setting",
              "token scaling", "statistics", "cohort table", "report.html", "report.json")
# report metadata a recomputation does not reproduce: the last extraction's counts read the source, which
# still holds the patient (the store does not)
NOT_CARRIED = ("ingest", "seconds", "generated_at")


def recomputable(ws: Workspace) -> dict | None:
    """The last run's parameters (from its report) when it was an hourly-token run; None otherwise."""
    if not ws.report_json.exists():
        return None
    meta = json.loads(ws.report_json.read_text()).get("metadata") or {}
    return meta if meta.get("tokens_mode") == "hourly" and meta.get("budgets") else None


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.symlink_to(src)


def open_view(ws: Workspace, txn: Transaction, sid: int) -> Workspace:
    """The workspace as it will be after the deletion commits, as links (every writer of the run replaces
    files atomically, so a write in the view never reaches the file a link points to)."""
    view = Workspace(txn.dir / "view")
    staged = {str(ws.root / op["final"]): ws.root / op["staged"] for op in txn.ops if op["op"] == "replace"}
    deleted = {str(ws.root / op["final"]) for op in txn.ops if op["op"] == "delete"}
    files = {str(f) for f in ws.store.rglob("*") if f.is_file()} | {f for f in staged if f.startswith(str(ws.store))}
    for f in sorted(files - deleted):
        _link(staged.get(f, Path(f)), view.store / Path(f).relative_to(ws.store))
    _link(workspace_config_path(ws.root), view.root / "config.yaml")
    shard = str(int(sid) % N_BUCKETS)
    cache = ws.root / CACHE_DIR
    for kind in sorted(d for d in cache.iterdir() if d.is_dir()) if cache.exists() else []:
        for entry in sorted(kind.iterdir()):
            if entry.is_dir() and entry.name != shard:
                _link(entry, view.root / CACHE_DIR / kind.name / entry.name)
            elif entry.is_file() and entry.stem != shard and not entry.name.endswith(".tmp"):
                _link(entry, view.root / CACHE_DIR / kind.name / entry.name)
    for f in sorted(ws.stay_memories.glob("*.npz")) if ws.stay_memories.exists() else []:
        if str(f) not in deleted:
            _link(f, view.stay_memories / f.name)
    return view


def _score_in_processes(settings, fixed, plan):
    """Score a batch of streams over a local process pool (a deletion runs outside any Prefect task runner)."""
    def score(batch, advance):
        workers = min(os.cpu_count() or 1, max(1, len(batch)))
        parts = balanced_chunks(batch, workers * 4, size=len)
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(score_token_streams, p, plan.budgets, plan.fractions, settings, fixed,
                                   plan.memory_budget, plan.fraction_cap) for p in parts]
            rows = []
            for f, p in zip(futures, parts):
                rows += f.result()
                advance(len(p))
        return rows
    return score


@dataclass
class DerivedRun:
    """A recomputation in progress: the view, the run's index over it, its cohort summary and parameters."""
    view: Workspace
    index: StayIndex
    cohort: dict
    params: dict
    cfg: dict


def prepare(ws: Workspace, txn: Transaction, sid: int, params: dict) -> DerivedRun:
    """Tokens and labels over the view: the rare vocabulary, label files, token scaling and streaming setting
    without the patient (the cohort memory's replay reads the scaling from here)."""
    view = open_view(ws, txn, sid)
    cfg = workspace_config(view.root)
    index, cohort = prepare_token_run(view, cfg)
    return DerivedRun(view, index, cohort, params, cfg)


def finish(ws: Workspace, txn: Transaction, run: DerivedRun, memory_info: dict | None) -> list[str]:
    """Scoring (only the stays whose streams or setting changed), statistics and the report over the view,
    then every output staged into the transaction. Returns what was recomputed."""
    view, params, cfg = run.view, run.params, run.cfg
    plan = scoring_plan(params["budgets"], params["fractions"])
    score_pending(view, run.index, cfg, plan,
                  _score_in_processes(run.index.settings, cfg["protocols"]["fixed_context"], plan))
    summary, paired = run_statistics(view)
    metadata = run_metadata(view, plan.budgets, plan.fractions, None, plan.memory_budget, 0.0, tokens="hourly",
                            settings=run.index.settings, cfg=cfg)
    metadata |= {k: v for k, v in params.items() if k not in metadata and k not in NOT_CARRIED}
    metadata |= {"data_source": params.get("data_source"),
                 "recomputed_by": "a deletion (replay): every number is as a run without the patient"}
    if memory_info is not None:
        metadata["cohort_memory"] = memory_info
    result = {"summary": summary, "paired": paired, "cohort": run.cohort, "metadata": metadata,
              "provenance": provenance(ws.store, ws.root, str(params.get("data_source")))}
    render_report(result, view.root)
    outputs = [(view.report_html, ws.report_html), (view.report_json, ws.report_json), (view.results, ws.results),
               (view.root / CACHE_DIR / "statistics.json", ws.root / CACHE_DIR / "statistics.json")]
    outputs += [(f, ws.labels / f.name) for f in sorted(view.labels.glob("*.parquet"))]
    outputs += [(f, ws.stay_memories / f.name) for f in sorted(view.stay_memories.glob("*.npz"))
                if not f.is_symlink()]
    for src, final in outputs:
        os.replace(src, txn.stage(final))
    return list(RECOMPUTED)
