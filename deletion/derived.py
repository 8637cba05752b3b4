"""Step (replay): what a run derives from many patients, recomputed as if the patient had never been seen.

The rare-item vocabulary (training-split code counts), the streaming setting (chosen on training stays), the token
scaling when the config fits it to the training split, and everything computed from them (MEDS label files,
per-stay results and memories, statistics, the cohort table, the report) depend on every patient of the cohort.
A replay deletion reruns the workspace's last run (:func:`run.evaluate.rerun`: its parameters and config)
over a *view* of the workspace as it will be after the commit: the store with the deletion's staged files, the
per-stay caches of every shard but the patients' (content-keyed, so an entry the view adds is valid for the
workspace too). Its outputs are staged into the deletion's transaction, so they land with the deletion or not at
all.

Hourly-token workspaces only: a workspace whose last run was of raw events keeps its reports marked stale.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from cohorts.definitions import workspace_config_path
from pipeline.sharding import Sharding
from pipeline.workspace import Workspace
from reports.html import render_report
from run.evaluate import PreparedRun, process_pool_map, rerun, rerun_params

if TYPE_CHECKING:
    from pipeline.transaction import Transaction

RECOMPUTED = ("MEDS label files", "per-stay results and memories", "rare-item vocabulary", "streaming setting",
              "token scaling", "statistics", "cohort table", "report.html", "report.json",
              "per-stay caches of the patients' shards (compacted without their stays)")


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.symlink_to(src)


def reruns(ws: Workspace) -> bool:
    """Whether a replay deletion reruns the workspace's last run (:func:`run.evaluate.rerun_params`)."""
    return rerun_params(ws) is not None


def _touched_cache(ws: Workspace, subjects: list[int]) -> list[Path]:
    """The per-stay cache entries of the subjects' shards (folders of parts, index files)."""
    sharding = Sharding.of_store(ws.store)
    touched = {str(sharding.shard(s)) for s in subjects}
    kinds = sorted(d for d in ws.cache.iterdir() if d.is_dir()) if ws.cache.exists() else []
    return [e for kind in kinds for e in sorted(kind.iterdir())
            if (e.name if e.is_dir() else e.stem) in touched and not e.name.endswith(".tmp")]


def open_view(ws: Workspace, txn: Transaction, subjects: list[int]) -> Workspace:
    """The workspace as it will be after the deletion commits, as links (every writer of the run replaces
    files atomically, so a write in the view never reaches the file a link points to). The per-stay caches of
    the subjects' shards are copies: the rerun compacts them to the stays still there (the subjects' entries
    go), and :func:`finish` stages them back, so the other stays of those shards are not recomputed. Per-stay
    memory files are not linked: the view looks them up in the workspace (``Workspace.stay_memories_of``), and
    those it writes (its rescored stays) are its own."""
    view = Workspace(txn.dir / "view", stay_memories_of=ws.stay_memories)
    staged = {str(ws.root / op["final"]): ws.root / op["staged"] for op in txn.ops if op["op"] == "replace"}
    deleted = {str(ws.root / op["final"]) for op in txn.ops if op["op"] == "delete"}
    files = {str(f) for f in ws.store.rglob("*") if f.is_file()} | {f for f in staged if f.startswith(str(ws.store))}
    for f in sorted(files - deleted):
        _link(staged.get(f, Path(f)), view.store / Path(f).relative_to(ws.store))
    _link(workspace_config_path(ws.root), view.config)
    touched = set(_touched_cache(ws, subjects))
    for kind in sorted(d for d in ws.cache.iterdir() if d.is_dir()) if ws.cache.exists() else []:
        for entry in sorted(kind.iterdir()):
            if entry.name.endswith(".tmp"):
                continue
            target = view.cache / kind.name / entry.name
            if entry not in touched:
                _link(entry, target)
            elif entry.is_dir():
                shutil.copytree(entry, target)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(entry, target)
    return view


def prepare(ws: Workspace, txn: Transaction, subjects: list[int]) -> PreparedRun | None:
    """The last run's cohort phases over the view: the rare vocabulary, label files, token scaling and streaming
    setting without the patients (the cohort memory's replay reads the scaling from here); None when the last
    run cannot be rerun (raw events, or no run yet)."""
    return rerun(open_view(ws, txn, subjects), last_run_of=ws)


def finish(ws: Workspace, txn: Transaction, run: PreparedRun, memory_info: dict | None,
           subjects: list[int]) -> list[str]:
    """Scoring (only the stays whose streams or setting changed), statistics and the report over the view,
    then every output staged into the transaction, the subjects' shards of the per-stay caches compacted
    without them. Returns what was recomputed."""
    view = run.ws
    result, _ = run.score(process_pool_map, described=ws)
    result = result.with_metadata(recomputed_by="a deletion (replay): every number is as a run without the patient")
    if memory_info is not None:
        result = result.with_metadata(cohort_memory=memory_info)
    render_report(result, view.root)
    outputs = [(view.report_html, ws.report_html), (view.report_json, ws.report_json), (view.results, ws.results),
               (view.statistics, ws.statistics)]
    outputs += [(f, ws.labels / f.name) for f in sorted(view.labels.glob("*.parquet"))]
    outputs += [(f, ws.stay_memories / f.name) for f in sorted(view.stay_memories.glob("*.npz"))]
    for entry in _touched_cache(ws, subjects):
        copy = view.cache / entry.relative_to(ws.cache)
        if copy.exists():
            outputs.append((copy, entry))
        else:
            txn.delete(entry)
    for src, final in outputs:
        os.replace(src, txn.stage(final))
    return list(RECOMPUTED)
