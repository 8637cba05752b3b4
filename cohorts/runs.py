"""The steps of a scheduled run as plain functions over a workspace: evaluate, update the cohort memory.

Each persists what it produces (per-stay results and memories, cohort-memory checkpoints) and returns only
aggregates or paths, so the flows that compose them carry no patient-level data in their results.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import polars as pl
from meds import held_out_split, train_split

from memory.cohort import DIGEST_MOD, CohortMemory, history_digest, row_hash
from pipeline import progress
from pipeline.extract import scan_events
from pipeline.keys import EventKeyer
from pipeline.meds import atomic_write_text, subject_splits_path, write_label_file, write_subject_splits
from pipeline.privacy import id_refs, store_key

from .characteristics import death_stays, describe_cohort, token_counts
from .coverage import check_run_has_data
from .definitions import (build_cohort, deterioration_hours, is_eval_subject, small_cell_threshold, stay_events,
                          workspace_config, workspace_config_path)
from .endpoints import endpoints_from_config
from .evaluation import aggregate
from .protocols import StreamingSettings, TokenStream, choose_streaming_settings, token_streams
from .provenance import code_version
from .streams import cohort_stream, evaluation_streams, hour_token_names
from .stay_chunks import code_digest
from .token_run import (OrderedTokens, ScoringPlan, StayIndex, fit_scaling, label_run,
                        pending_streams, stay_facts, store_scores, write_results)
from .tokens import TokenScaling, build_tokens, channels_from_config, declared_scaling, label_specs, label_tokens

if TYPE_CHECKING:
    from collections.abc import Callable

    from pipeline.workspace import Workspace

# Per-stay SV memories are persisted at this budget (or at the largest fixed budget of a run without it).
HEADLINE_BUDGET = 64


def run_metadata(ws: Workspace, budgets: tuple, fractions: tuple, max_events: int | None, memory_budget: int,
                 seconds: float, tokens: str = "events", settings: StreamingSettings | None = None,
                 cfg: dict | None = None) -> dict:
    if tokens == "hourly":
        fixed = cfg["protocols"]["fixed_context"]
        rules = {"tokens": "hourly patient-state tokens (cohort config: tokens)",
                 "fixed_context_rule": f"per stay: exact solve with C = 1/(nu n), nu = {fixed['nu']}, sigma = "
                                       f"{fixed['sigma']}; k = |S u E|; every baseline keeps k; stays with k = 0 "
                                       f"or k >= n dropped (support_size_boundary rows)",
                 "sv_rule": f"streaming: C = 1/(nu_B B), nu_B = {settings.nu}, sigma = {settings.sigma} (chosen on "
                            f"the training split); evict the reserve token with the largest slack; fallback: exact "
                            f"decrement of the smallest-coefficient active token (uncertified)",
                 "streaming_selection_grid": settings.selection}
    else:
        rules = {"tokens": "raw events", "max_events_per_stay": max_events,
                 "sv_rule": "C = 1/(0.5 B); evict the reserve token with the largest slack; fallback: exact "
                            "decrement of the smallest-coefficient active token (uncertified)"}
    cfg = cfg or workspace_config(ws.root)
    endpoints = endpoints_from_config(cfg).as_settings()
    return {"data_source": str(ws.store), "code_version": code_version(), "budgets": list(budgets),
            "declared_endpoints": endpoints, "small_cell_threshold": small_cell_threshold(cfg), "tokens_mode": tokens,
            "fractions": list(fractions),
            "fraction_budget_rule": f"round(fraction * stream length), at least 4, at most {max(budgets)} "
                                    "(the largest fixed budget)" if len(budgets) else "round(fraction * stream length)",
            "per_stay_memories_budget": memory_budget, "store_generation": ws.generation(),
            "seconds": round(seconds, 2), "generated_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"), **rules}


TOKEN_MODES = ("hourly", "events")
STREAM_FILE = "stream.json"          # a checkpoint's stream mode
SCALER_FILES = {"events": "keyer.parquet", "hourly": "token_scaling.json"}


def checkpoint_tokens(ckpt: Path) -> str:
    """The stream mode a cohort-memory checkpoint was fed ('events' for checkpoints from before token mode)."""
    f = Path(ckpt) / STREAM_FILE
    return json.loads(f.read_text())["tokens"] if f.exists() else "events"


def load_scaler(ckpt: Path) -> TokenScaling | EventKeyer:
    """The key statistics persisted with a checkpoint: an EventKeyer or a TokenScaling."""
    tokens = checkpoint_tokens(ckpt)
    path = Path(ckpt) / SCALER_FILES[tokens]
    return EventKeyer.load(path) if tokens == "events" else TokenScaling.load(path)


def save_scaler(scaler: TokenScaling | EventKeyer, ckpt: Path, tokens: str) -> None:
    scaler.save(Path(ckpt) / SCALER_FILES[tokens])
    (Path(ckpt) / STREAM_FILE).write_text(json.dumps({"tokens": tokens}))


def copy_checkpoint_extras(src: Path, dst: Path) -> None:
    """Carry a checkpoint's key statistics and stream mode into a rewritten copy of it."""
    for f in Path(src).iterdir():
        if f.is_file() and f.name not in ("memory.npz", "meta.json"):
            shutil.copyfile(f, Path(dst) / f.name)


def cohort_memory_gamma(cfg: dict, tokens: str) -> float:
    """Kernel width of the cohort memory: the fixed-context sigma on token keys, 0.5 on 13-d event keys."""
    return 1.0 / float(cfg["protocols"]["fixed_context"]["sigma"]) ** 2 if tokens == "hourly" else 0.5


FEED_BLOCK = 2048   # tokens fed between progress reports


def _unchanged_base(ckpts, history_upto):
    """The latest checkpoint whose fed history is still the store's history up to its watermark (None: none).
    ``history_upto(watermark)``: the digest of the store's rows up to a watermark."""
    for c in reversed(ckpts):
        cm = CohortMemory.load(c)
        if cm.history is not None and history_upto(cm.watermark) == cm.history:
            return c, cm
    return None, None


def _event_rows(ws, cfg, scaler):
    """Events mode: the cohort's keyed events in memory (the events-mode memory is for small stores), as a
    history function and a feed of the rows after a watermark."""
    scaler, keys, ids, order, _ = cohort_stream(ws.store, cfg, "events", store_key(ws.store, ws.root), scaler=scaler)

    def feed(mem, on_fed):
        todo = [i for i, o in enumerate(order) if o > mem.watermark]
        if on_fed is not None:
            on_fed.set_total(len(todo))
        for lo in range(0, len(todo), FEED_BLOCK):
            block = todo[lo:lo + FEED_BLOCK]
            mem.feed(keys[block], [ids[i] for i in block], [order[i] for i in block])
            if on_fed is not None:
                on_fed(len(block))
    return scaler, lambda upto: history_digest(order, keys, upto), feed


def _token_rows(ws, cfg, scaler):
    """Hourly mode: the cohort's tokens streamed in order from the run's token cache (never all at once)."""
    index = stay_facts(ws, cfg)
    if scaler is None:
        names = [c.name for c in channels_from_config(cfg)]
        scaler = declared_scaling(cfg, names) or fit_scaling(ws, index, names)
    names = hour_token_names(store_key(ws.store, ws.root))

    def history(upto):
        total = 0
        for b in OrderedTokens(ws, index, cfg, scaler, names, upto=upto).batches():
            total += sum(row_hash(o, k) for o, k in zip(b.order_keys, b.keys))
        return total % DIGEST_MOD

    def feed(mem, on_fed):
        todo = OrderedTokens(ws, index, cfg, scaler, names, after=mem.watermark)
        if on_fed is not None:
            on_fed.set_total(todo.count())
        for b in todo.batches(FEED_BLOCK):
            mem.feed(b.keys, b.token_ids, b.order_keys)
            if on_fed is not None:
                on_fed(len(b.order_keys))
    return scaler, history, feed


def update_cohort_memory(ws: Workspace, cfg: dict | None = None, budget: int = 128, tokens: str = "hourly",
                         on_fed: Callable | None = None) -> dict:
    """Resume the cohort memory from its latest checkpoint of the same stream mode, feed what it has not
    seen, checkpoint it. A run in the other mode starts a new memory (its checkpoints follow the old ones).

    Rows dated before the memory's watermark that arrived since (late rows, or changed ones) change the
    store's history up to the watermark: the memory is then rebuilt from the latest checkpoint whose history
    is unchanged (or from empty), as if the rows had arrived in time order, and the result says so.
    ``on_fed(n)`` is told every block of tokens fed (progress)."""
    cfg = cfg or workspace_config(ws.root)
    ckpts = ws.checkpoints()
    same = [c for c in ckpts if checkpoint_tokens(c) == tokens]
    if same:
        mem, scaler = CohortMemory.load(same[-1]), load_scaler(same[-1])
    else:
        mem, scaler = CohortMemory(budget=budget, gamma=cohort_memory_gamma(cfg, tokens)), None
    scaler, history_upto, feed = (_token_rows if tokens == "hourly" else _event_rows)(ws, cfg, scaler)
    history = ({"checked": mem.history is not None, "changed_before_watermark": False} if same else
               {"checked": False, "new_memory": True})
    if same and mem.history is not None and history_upto(mem.watermark) != mem.history:
        base, base_mem = _unchanged_base(same[:-1], history_upto)
        history = {"checked": True, "changed_before_watermark": True,
                   "rebuilt_from": base.name if base else "empty memory"}
        mem = base_mem or CohortMemory(budget=mem.policy.budget, gamma=mem.gamma, nu=mem.policy.nu)
    fed_before = mem.fed
    feed(mem, on_fed)
    seq = int(ckpts[-1].name.split("-")[0]) + 1 if ckpts else 0
    target = ws.cohort_checkpoints / f"{seq:06d}-{time.strftime('%Y%m%dT%H%M%S')}"
    target.parent.mkdir(parents=True, exist_ok=True)
    mem.save(target)
    save_scaler(scaler, target, tokens)
    return memory_info(mem, target.name, tokens, mem.fed - fed_before, history)


def memory_info(mem: CohortMemory, checkpoint: str, tokens: str, fed: int, history: dict) -> dict:
    """What the report says of the cohort memory after a run fed it ``fed`` tokens (or a deletion replayed it)."""
    return {"checkpoint": checkpoint, "tokens_mode": tokens, "fed": int(fed), "tokens": mem.memory.n_tokens,
            "certified_evictions": mem.policy.certified, "uncertified_evictions": mem.policy.uncertified,
            "history": history}


def prepare_token_streams(store: Path, cfg: dict, labels_dir: Path | None = None) -> tuple[list, StreamingSettings,
                                                                                        dict]:
    """The whole cohort in memory at once (small stores, and the reference the chunked, cached run of
    :mod:`cohorts.token_run` is tested against): hourly tokens of the cohort, labelled; the evaluation split's
    streams, the streaming settings chosen on
    the training split, and the cohort's summary (aggregates only). With ``labels_dir``, the token labels are
    also written there as MEDS label files and the subject-level split into the store's MEDS metadata."""
    cohort = build_cohort(store, cfg)
    events = stay_events(store, cohort)
    table = build_tokens(store, cfg, cohort=cohort)
    labelled = label_tokens(table, store, cfg, cohort=cohort, events=events)
    if labels_dir is not None:
        write_meds_labels(labelled, cohort, cfg, table.bin_hours, labels_dir)
        write_subject_splits(subject_splits_path(store), subject_splits(store, cfg))
    evaluation = token_streams(labelled, table.scaling, cfg, split="eval")
    settings = choose_streaming_settings(token_streams(labelled, table.scaling, cfg, split="train"),
                                         cfg["protocols"]["streaming"])
    ev = labelled.filter(pl.col("split") == "eval")
    summary = {"stays": int(cohort.height), "train_stays": int(cohort.height - len(evaluation)),
               "eval_stays": len(evaluation),
               "stays_without_vitals": int(cohort.height - labelled["stay_id"].n_unique()),
               "tokens": int(labelled.height), "eval_tokens": int(ev.height), "bin_hours": table.bin_hours,
               "readings_by_channel": table.readings, "artifacts_by_channel": table.artifacts}
    for name in label_specs(cfg):
        summary[f"eval_tokens_{name}"] = int(ev[name].sum())
        summary[f"eval_stays_with_{name}"] = int(ev.group_by("stay_id").agg(pl.col(name).any())[name].sum())
    summary["characteristics"] = describe_cohort(store, cfg, cohort, death_stays(events, cfg),
                                                 deterioration_hours(events, cfg),
                                                 token_counts(labelled, list(label_specs(cfg))))
    return evaluation, settings, summary


def write_meds_labels(labelled: pl.DataFrame, cohort: pl.DataFrame, cfg: dict, bin_hours: float,
                      labels_dir: Path) -> list[Path]:
    """One MEDS label file per token label (``meds.LabelSchema``): each token's label at the end of its bin, the
    last moment whose data the token summarises (MEDS: data up to and including prediction_time may be used)."""
    ends = (labelled.join(cohort.select("stay_id", "intime"), on="stay_id")
            .with_columns((pl.col("intime") + pl.duration(
                microseconds=((pl.col("hour") + 1) * round(bin_hours * 3_600_000_000)))).alias("prediction_time")))
    labels_dir = Path(labels_dir)
    labels_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name in label_specs(cfg):
        path = labels_dir / f"{name}.parquet"
        write_label_file(ends.select("subject_id", "prediction_time", pl.col(name).alias("boolean_value")), path)
        written.append(path)
    for stale in set(labels_dir.glob("*.parquet")) - set(written):     # a label the config no longer has
        stale.unlink()
    return written


def subject_splits(store: Path, cfg: dict) -> pl.DataFrame:
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


def workspace_event_streams(ws: Workspace, max_events: int | None = None) -> tuple[list, dict]:
    """The events-mode evaluation streams of a workspace (with learned keys when its encoder exists), each
    with the path its per-stay memory is persisted to."""
    encoder = None
    if ws.encoder.exists():
        from memory.encoder import EventEncoder     # torch: ~1.5 s to import, for learned keys only
        encoder = EventEncoder.load(ws.encoder)
    streams, cohort = evaluation_streams(ws.store, workspace_config(ws.root), max_events=max_events, encoder=encoder)
    paths = stay_memory_paths(ws, [s.stay_id for s in streams])
    return [replace(s, memory_path=path) for s, path in zip(streams, paths)], cohort


def prepare_token_run(ws: Workspace, cfg: dict | None = None, chunk_stays: int = 256) -> tuple[StayIndex, dict]:
    """The first two phases of an hourly-token run over a workspace (:mod:`cohorts.token_run`): per-stay facts
    chunk by chunk, then labels, MEDS label files and splits, token scaling and the streaming setting.
    Returns the run's index of stays (patient-level; it stays in the process) and the cohort's summary."""
    cfg = cfg or workspace_config(ws.root)
    total = build_cohort(ws.store, cfg).height
    with progress.step("tokens", total=total, unit="stays") as advance:
        index = stay_facts(ws, cfg, chunk_stays=chunk_stays, on_chunk=advance)
    with progress.step("labels", total=total, unit="stays") as advance:
        summary = label_run(ws, index, cfg, chunk_stays=chunk_stays, on_shard=advance)
        write_subject_splits(subject_splits_path(ws.store), subject_splits(ws.store, cfg))
    summary["computed_stays"] = dict(index.computed)
    check_run_has_data(summary, workspace_config_path(ws.root))
    return index, summary


def scoring_plan(budgets: tuple, fractions: tuple) -> ScoringPlan:
    """What a run's scores depend on besides the streams: its budgets, fractions (capped at the largest budget)
    and the budget whose per-stay SV memory is persisted (the headline budget when the run has it)."""
    budgets, fractions = tuple(int(b) for b in budgets), tuple(float(f) for f in fractions)
    memory_budget = HEADLINE_BUDGET if HEADLINE_BUDGET in budgets else max(budgets)
    return ScoringPlan(budgets, fractions, memory_budget, max(budgets) if budgets else None)


def score_pending(ws: Workspace, index: StayIndex, cfg: dict, plan: ScoringPlan,
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


def run_statistics(ws: Workspace) -> tuple[list, list]:
    """Means, CIs and paired comparisons of the run's per-stay results, read from its results file, under the
    config's declared endpoints; reused from the last run when the results file, the endpoints and the code are
    the same (aggregates only are kept)."""
    cached = ws.root / "cache" / "statistics.json"
    endpoints = endpoints_from_config(workspace_config(ws.root))
    h = hashlib.sha256((code_digest() + json.dumps(endpoints.as_settings(), sort_keys=True)).encode())
    with open(ws.results, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    key = h.hexdigest()
    if cached.exists():
        old = json.loads(cached.read_text())
        if old.get("key") == key:
            return old["summary"], old["paired"]
    with progress.step("statistics"):
        summary, paired = aggregate(pl.scan_parquet(ws.results), endpoints=endpoints)
    cached.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(cached, json.dumps({"key": key, "summary": summary, "paired": paired}))
    return summary, paired


def write_phases(ws: Workspace, since: float) -> Path:
    """The run's steps with their wall-clock start and end (``WS/run_phases.json``; what the scale bench reads)."""
    path = ws.root / "run_phases.json"
    path.write_text(json.dumps([{"phase": n, "start": a, "end": b} for n, a, b in progress.phases if a >= since],
                               indent=1))
    return path


def save_results(ws: Workspace, rows: list) -> Path:
    """The per-stay result rows of a run (patient-level: they stay in the workspace, naming stays and patients
    by keyed reference only)."""
    ws.results.parent.mkdir(parents=True, exist_ok=True)
    id_refs(pl.DataFrame(rows), store_key(ws.store, ws.root)).write_parquet(ws.results)
    return ws.results


def train_key_encoder(ws: Workspace, steps: int) -> dict:
    """Train the learned-key encoder on the training split's windows and save it; a summary of the loss."""
    from memory.encoder import train_encoder        # torch: ~1.5 s to import, for learned keys only

    from .encoder_data import training_windows
    (codes, feats, flags), _, _ = training_windows(ws.store, workspace_config(ws.root))
    encoder, history = train_encoder(codes, feats, flags, steps=steps)
    ws.encoder.parent.mkdir(parents=True, exist_ok=True)
    encoder.save(ws.encoder)
    k = max(1, len(history) // 10)
    return {"windows": len(codes), "steps": steps, "loss_first": sum(history[:k]) / k,
            "loss_last": sum(history[-k:]) / k}
