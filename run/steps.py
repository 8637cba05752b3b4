"""The steps of a run as plain functions over a workspace: tokens and labels, scoring, statistics, metadata.

Each persists what it produces (per-stay results and memories, caches) and returns only aggregates or paths, so
the flows that compose them carry no patient-level data in their results. :mod:`run.evaluate` puts them in order.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl
from meds import held_out_split, train_split

from cohorts.coverage import check_run_has_data
from cohorts.definitions import build_cohort, is_eval_subject, workspace_config_path
from cohorts.evaluation import aggregate
from cohorts.results import PairedRow, SummaryRow
from cohorts.stay_chunks import code_digest
from cohorts.stream_mode import StreamMode
from cohorts.streams import evaluation_streams
from pipeline import progress
from pipeline.store_reader import scan_events
from pipeline.meds import subject_splits_path, write_subject_splits
from pipeline.privacy import id_refs, store_key
from pipeline.transaction import atomic_write_text
from pipeline.versions import code_version

from .token_run import ScoringPlan, StayIndex, label_run, pending_streams, stay_facts, store_scores, write_results

if TYPE_CHECKING:
    from cohorts.config import CohortConfig
    from collections.abc import Callable

    from cohorts.protocols import StreamingSettings, TokenStream
    from pipeline.workspace import Workspace

    from .params import RunParams

EMBEDDED_SOURCE = "embedded generator (deterministic)"     # the data a run without a source reads
ENCODER_NOT_TRAINED = "not trained: learned keys are for raw events (--tokens events with encoder steps > 0)"


def run_metadata(ws: Workspace, params: RunParams, cfg: CohortConfig, seconds: float,
                 settings: StreamingSettings | None = None) -> dict:
    """What the report says of how its numbers were made: the parameters, the rules, the code, the store."""
    if params.tokens is StreamMode.HOURLY:
        fixed = cfg.fixed_context
        rules = {"tokens": "hourly patient-state tokens (cohort config: tokens)",
                 "fixed_context_rule": f"per stay: exact solve with C = 1/(nu n), nu = {fixed.nu}, sigma = "
                                       f"{fixed.sigma}; k = |S u E|; every baseline keeps k; stays with k = 0 "
                                       f"or k >= n dropped (support_size_boundary rows)",
                 "sv_rule": f"streaming: C = 1/(nu_B B), nu_B = {settings.nu}, sigma = {settings.sigma} (chosen on "
                            f"the training split); evict the reserve token with the largest slack; fallback: exact "
                            f"decrement of the smallest-coefficient active token (uncertified)",
                 "streaming_selection_grid": settings.selection, "learned_keys_encoder": ENCODER_NOT_TRAINED}
    else:
        rules = {"tokens": "raw events", "max_events_per_stay": params.max_events,
                 "sv_rule": "C = 1/(0.5 B); evict the reserve token with the largest slack; fallback: exact "
                            "decrement of the smallest-coefficient active token (uncertified)"}
    endpoints = cfg.endpoints.as_settings()
    return {"data_source": params.source or EMBEDDED_SOURCE, "code_version": code_version(),
            "budgets": list(params.budgets), "declared_endpoints": endpoints,
            "small_cell_threshold": cfg.small_cell_threshold, "tokens_mode": params.tokens.value,
            "fractions": list(params.fractions),
            "fraction_budget_rule": f"round(fraction * stream length), at least 4, at most {params.fraction_cap} "
                                    "(the largest fixed budget)",
            "per_stay_memories_budget": params.memory_budget, "store_generation": ws.generation(),
            "seconds": round(seconds, 2), "generated_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"), **rules}


def subject_splits(store: Path, cfg: CohortConfig) -> pl.DataFrame:
    """Every subject of the store in the config's subject-level split, named as MEDS names splits."""
    subjects = (scan_events(store).select("subject_id").unique().collect(engine="streaming")["subject_id"]
                .sort().to_list())
    return pl.DataFrame({"subject_id": subjects,
                         "split": [held_out_split if is_eval_subject(s, cfg) else train_split for s in subjects]},
                        schema={"subject_id": pl.Int64, "split": pl.String})


def stay_memory_paths(ws: Workspace, stay_ids: list) -> list[str]:
    """Where each stay's SV memory is persisted (file names are keyed hashes of the stay ids)."""
    key = store_key(ws.store, ws.root)
    ws.stay_memories.mkdir(parents=True, exist_ok=True)
    return [str(ws.stay_memory(s, key)) for s in stay_ids]


def workspace_event_streams(ws: Workspace, cfg: CohortConfig, max_events: int | None = None) -> tuple[list, dict]:
    """The events-mode evaluation streams of a workspace (with learned keys when its encoder exists), each
    with the path its per-stay memory is persisted to."""
    encoder = None
    if ws.encoder.exists():
        from memory.encoder import EventEncoder     # torch: ~1.5 s to import, for learned keys only
        encoder = EventEncoder.load(ws.encoder)
    streams, cohort = evaluation_streams(ws.store, cfg, max_events=max_events, encoder=encoder)
    paths = stay_memory_paths(ws, [s.stay_id for s in streams])
    return [replace(s, memory_path=path) for s, path in zip(streams, paths)], cohort


def token_phase(ws: Workspace, cfg: CohortConfig, chunk_stays: int = 256,
                removed_from: Path | None = None) -> StayIndex:
    """The first phase of an hourly-token run over a workspace (:mod:`run.token_run`): per-stay facts chunk by
    chunk. Returns the run's index of stays (patient-level; it stays in the process), every stay's tokens
    cached. ``removed_from``: see :func:`run.token_run.stay_facts`."""
    with progress.step("tokens", total=build_cohort(ws.store, cfg).height, unit="stays") as advance:
        return stay_facts(ws, cfg, chunk_stays=chunk_stays, on_chunk=advance, removed_from=removed_from)


def label_phase(ws: Workspace, index: StayIndex, cfg: CohortConfig, chunk_stays: int = 256) -> dict:
    """The second phase, over the stays of :func:`token_phase`: labels, MEDS label files and splits, token
    scaling and the streaming setting. Returns the cohort's summary."""
    with progress.step("labels", total=index.cohort.height, unit="stays") as advance:
        summary = label_run(ws, index, cfg, chunk_stays=chunk_stays, on_shard=advance)
        write_subject_splits(subject_splits_path(ws.store), subject_splits(ws.store, cfg))
    summary["computed_stays"] = dict(index.computed)
    check_run_has_data(summary, workspace_config_path(ws.root))
    return summary


def scoring_plan(params: RunParams) -> ScoringPlan:
    """What a run's scores depend on besides the streams: its budgets, fractions (capped at the largest budget)
    and the budget whose per-stay SV memory is persisted."""
    return ScoringPlan(params.budgets, params.fractions, params.memory_budget, params.fraction_cap)


def score_pending(ws: Workspace, index: StayIndex, cfg: CohortConfig, plan: ScoringPlan,
                  score_batch: Callable[[list[TokenStream]], list[dict]], batch_stays: int = 2048) -> int:
    """Score the evaluation streams whose scores are not cached, in batches (``score_batch(streams)`` gives
    their long rows: the flow maps it over its task runner), caching each batch; then write the run's
    per-stay results. Returns the stays scored now."""
    scored = 0
    total = int((index.cohort["split"] == "eval").sum())
    with progress.step("scoring", total=total, unit="stays") as advance:
        for batch in pending_streams(ws, index, cfg, plan, batch_stays=batch_stays, on_cached=advance):
            store_scores(ws, batch, score_batch(batch, advance))
            scored += len(batch)
    index.computed["scores"] = scored
    write_results(ws, index)
    return scored


def run_statistics(ws: Workspace, cfg: CohortConfig) -> tuple[list[SummaryRow], list[PairedRow]]:
    """Means, CIs and paired comparisons of the run's per-stay results, read from its results file, under the
    config's declared endpoints; reused from the last run when the results file, the endpoints and the code are
    the same (aggregates only are kept)."""
    cached = ws.statistics
    endpoints = cfg.endpoints
    h = hashlib.sha256((code_digest() + json.dumps(endpoints.as_settings(), sort_keys=True)).encode())
    with open(ws.results, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    key = h.hexdigest()
    if cached.exists():
        old = json.loads(cached.read_text())
        if old.get("key") == key:
            return [SummaryRow.from_json(r) for r in old["summary"]], [PairedRow.from_json(r) for r in old["paired"]]
    with progress.step("statistics"):
        summary, paired = aggregate(pl.scan_parquet(ws.results), endpoints=endpoints)
    cached.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(cached, json.dumps({"key": key, "summary": [r.as_json() for r in summary],
                                          "paired": [r.as_json() for r in paired]}))
    return summary, paired


def write_phases(ws: Workspace, since: float) -> Path:
    """The run's steps with their wall-clock start and end (``WS/run_phases.json``; what the scale bench reads)."""
    path = ws.phases
    path.write_text(json.dumps([{"phase": n, "start": a, "end": b} for n, a, b in progress.phases if a >= since],
                               indent=1))
    return path


def save_results(ws: Workspace, rows: list) -> Path:
    """The per-stay result rows of a run (patient-level: they stay in the workspace, naming stays and patients
    by keyed reference only)."""
    ws.results.parent.mkdir(parents=True, exist_ok=True)
    id_refs(pl.DataFrame(rows), store_key(ws.store, ws.root)).write_parquet(ws.results)
    return ws.results


def train_key_encoder(ws: Workspace, steps: int, cfg: CohortConfig) -> dict:
    """Train the learned-key encoder on the training split's windows and save it; a summary of the loss."""
    from memory.encoder import EncoderTraining, train_encoder   # torch: ~1.5 s to import, for learned keys only

    from cohorts.encoder_data import training_windows
    (codes, feats, flags), _, _ = training_windows(ws.store, cfg)
    encoder, history = train_encoder(codes, feats, flags, EncoderTraining(steps=steps))
    ws.encoder.parent.mkdir(parents=True, exist_ok=True)
    encoder.save(ws.encoder)
    k = max(1, len(history) // 10)
    return {"windows": len(codes), "steps": steps, "loss_first": sum(history[:k]) / k,
            "loss_last": sum(history[-k:]) / k}
