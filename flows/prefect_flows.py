"""Prefect 3 flows. Thin: each task calls one plain, separately tested function.

``scheduled_run`` = ``ingest`` -> ``evaluate`` -> cohort memory update -> ``report``; ``delete_patient`` serves
ad-hoc deletion requests. Task results that hold patient-level data (streams, per-stay rows) are never
persisted (``persist_result=False``); nothing is cached by Prefect (the workspace's per-stay caches are).
"""
import os
import time
from pathlib import Path

from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State, TaskRun
from prefect.states import Failed
from prefect.futures import as_completed
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner
from prefect.tasks import Task
from prefect.utilities.annotations import quote

from cohorts.definitions import CohortConfigError, install_config, workspace_config
from cohorts.endpoints import endpoints_from_config
from cohorts.evaluation import (DEFAULT_BUDGETS, DEFAULT_FRACTIONS, EventStream, aggregate, balanced_chunks,
                                headline_rows, long_rows, run_sweep)
from cohorts.protocols import StreamingSettings, TokenStream, score_token_streams
from cohorts.provenance import Provenance, provenance
from cohorts.runs import (TOKEN_MODES, prepare_token_run, run_metadata, run_statistics, save_results, score_pending,
                          scoring_plan, train_key_encoder, update_cohort_memory, workspace_event_streams, write_phases)
from cohorts.token_run import StayIndex
from deletion import AlreadyDeleted, DeletionFailed, delete_subject, resolve_subject
from memory.warmup import compile_solver, is_compiled
from pipeline import progress
from pipeline.extract import ExtractionError, UnknownSubjectError, extract
from pipeline.generate import GeneratorConfig, generate
from pipeline.locking import WorkspaceLocked, workspace_lock
from pipeline.meds import MedsStayCodes
from pipeline.privacy import load_key
from pipeline.transaction import recover
from pipeline.workspace import Workspace
from reports.disclosure import disclosed
from reports.html import render_report

TASK_RUNNERS = ("process", "thread", "dask")


def make_task_runner(kind: str = "process", workers: int | None = None) -> TaskRunner:
    """'process' (default: a local process pool, one worker per core), 'thread', or 'dask' (prefect-dask)."""
    workers = workers or os.cpu_count() or 1
    if kind == "process":
        return ProcessPoolTaskRunner(max_workers=workers)
    if kind == "thread":
        return ThreadPoolTaskRunner(max_workers=workers)
    if kind == "dask":
        from prefect_dask import DaskTaskRunner
        # A local cluster here; pass address= of a running scheduler to use an existing Dask cluster.
        address = os.environ.get("FORGETFUL_DASK_ADDRESS")
        if address:
            return DaskTaskRunner(address=address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True,
                                              "dashboard_address": None})
    raise ValueError(f"task runner must be one of {TASK_RUNNERS}, got {kind!r}")


def retry_unless_bad_input(task: Task, task_run: TaskRun, state: State) -> bool:
    """Retry what can succeed on retry (I/O, a busy file), never bad input: it fails the same way again."""
    try:
        state.result()
    except (ExtractionError, CohortConfigError):   # UnknownSubjectError is an ExtractionError
        return False
    except Exception:
        return True
    return True


@task(retries=2, retry_delay_seconds=2, retry_condition_fn=retry_unless_bad_input, cache_policy=NO_CACHE)
def extract_task(source: str, store: str, root: str, memory_limit: str = "4GB") -> dict:
    s = extract(source, store, key=load_key(root), memory_limit=memory_limit,
                stay_codes=MedsStayCodes.from_config(workspace_config(root)))
    get_run_logger().info("extracted %d new events (%d in store, %d suppressed rows)", s.new_events,
                          s.total_events, s.suppressed_rows)
    return {"new_events": s.new_events, "total_events": s.total_events, "suppressed_rows": s.suppressed_rows,
            "quarantined": {t: v.get("quarantined_total", 0) for t, v in s.tables.items()}}


@task(retries=1, retry_condition_fn=retry_unless_bad_input, cache_policy=NO_CACHE)
def train_encoder_task(root: str, steps: int) -> dict:
    """Learned event keys: train the encoder on the training split's windows (CUDA when present)."""
    with progress.step(f"training the key encoder ({steps} steps)"):
        info = train_key_encoder(Workspace(root), steps)
    get_run_logger().info("encoder trained on %d windows: selection loss %.3f -> %.3f", info["windows"],
                          info["loss_first"], info["loss_last"])
    return info


@task(cache_policy=NO_CACHE, persist_result=False)
def prepare_streams(root: str, max_events: int | None) -> tuple[list[EventStream], dict]:
    return workspace_event_streams(Workspace(root), max_events)


@task(cache_policy=NO_CACHE, persist_result=False)
def prepare_token_run_task(root: str) -> tuple[StayIndex, dict]:
    return prepare_token_run(Workspace(root))


@task(cache_policy=NO_CACHE, persist_result=False)
def score_chunk(streams: list[EventStream], budgets: tuple, fractions: tuple,
                memory_budget: int | None) -> list[dict]:
    return run_sweep(streams, budgets=budgets, fractions=fractions, workers=1, memory_budget=memory_budget)


@task(cache_policy=NO_CACHE, persist_result=False)
def score_token_chunk(streams: list[TokenStream], budgets: tuple, fractions: tuple, settings: StreamingSettings,
                      fixed: bool, memory_budget: int | None) -> list[dict]:
    return score_token_streams(streams, budgets, fractions, settings, fixed, memory_budget=memory_budget,
                               fraction_cap=max(budgets) if budgets else None)


@task(retries=2, retry_delay_seconds=1, cache_policy=NO_CACHE, persist_result=False)
def save_results_task(rows: list[dict], root: str) -> str:
    return str(save_results(Workspace(root), rows))


@task(cache_policy=NO_CACHE, persist_result=False)
def provenance_task(root: str, source: str | None) -> Provenance:
    ws = Workspace(root)
    return provenance(ws.store, ws.root, source)


@task(retries=2, retry_delay_seconds=2, retry_condition_fn=retry_unless_bad_input, cache_policy=NO_CACHE)
def cohort_memory_task(root: str, budget: int, tokens: str) -> dict:
    with progress.step("cohort memory", unit="tokens") as advance:
        info = update_cohort_memory(Workspace(root), budget=budget, tokens=tokens, on_fed=advance)
    get_run_logger().info("cohort memory %s: fed %d events, %d tokens", info["checkpoint"], info["fed"],
                          info["tokens"])
    return info


@flow(name="forgetful-ingest")
def ingest(root: str | Path, source: str | Path | None = None, memory_limit: str = "4GB") -> dict:
    """Extract new data into the workspace's store (the embedded generator's data when no source is given)."""
    ws = Workspace(root)
    if source is None:
        if not ws.source.exists():
            with progress.step("generating the embedded MIMIC-IV-shaped data"):
                generate(ws.source, GeneratorConfig())
        source = ws.source
    with progress.phase("extract"):
        return extract_task(str(source), str(ws.store), str(ws.root), memory_limit)


def _completed(futures: list, parts: list, advance) -> list:
    """Wait for mapped futures, telling ``advance`` the stays of each as it finishes; the futures in order."""
    stays_of = {f.task_run_id: len(p) for f, p in zip(futures, parts)}
    for f in as_completed(futures):
        advance(stays_of[f.task_run_id])
    return futures


@flow(name="forgetful-evaluate")
def evaluate(root: str | Path, budgets: tuple[int, ...] = DEFAULT_BUDGETS,
             fractions: tuple[float, ...] = DEFAULT_FRACTIONS, max_events: int | None = None,
             chunks: int | None = None, tokens: str = "hourly") -> dict:
    """Both protocols over the evaluation stays' hourly tokens (``tokens='hourly'``), or the streaming budget
    sweep over their raw events ('events'); parallel over chunks of stays on the flow's task runner."""
    t0 = time.perf_counter()
    ws = Workspace(root)
    if not is_compiled():       # in the workers, it would stall the first items of scoring, in each at once
        with progress.step("compiling the exact solver's inner loops (once after an install or upgrade)"):
            compile_solver()
    n_chunks = chunks or (os.cpu_count() or 1) * 4
    plan = scoring_plan(budgets, fractions)
    memory_budget = plan.memory_budget
    common = dict(budgets=unmapped(tuple(budgets)), fractions=unmapped(tuple(fractions)),
                  memory_budget=unmapped(memory_budget))
    settings, cfg = None, workspace_config(ws.root)
    if tokens == "hourly":
        index, cohort = prepare_token_run_task(str(ws.root))
        settings, fixed = index.settings, cfg["protocols"]["fixed_context"]

        def score_batch(batch: list[TokenStream], advance) -> list[dict]:
            parts = balanced_chunks(batch, n_chunks, size=len)
            futures = score_token_chunk.map(parts, settings=unmapped(settings), fixed=unmapped(fixed), **common)
            return [r for f in _completed(futures, parts, advance) for r in f.result()]
        scored = score_pending(ws, index, cfg, plan, score_batch)
        n_stays = cohort["eval_stays"]
        summary, paired = run_statistics(ws)
    else:
        streams, cohort = prepare_streams(str(ws.root), max_events)
        parts = balanced_chunks(streams, n_chunks)
        futures = score_chunk.map(parts, **common)
        with progress.step("scoring", total=len(streams), unit="stays") as advance:
            _completed(futures, parts, advance)
        # rows in chunk order, not completion order: the bootstrap draws over stays in row order
        rows = long_rows([r for f in futures for r in f.result()])
        save_results_task(rows, str(ws.root))
        with progress.step("statistics"):
            summary, paired = aggregate(rows, endpoints=endpoints_from_config(cfg))
        n_stays, scored = len(streams), len(streams)
    metadata = run_metadata(ws, budgets, fractions, max_events, memory_budget, time.perf_counter() - t0,
                            tokens=tokens, settings=settings, cfg=cfg)
    get_run_logger().info("%d evaluation stays (%s) at %d budgets, %d scored now (the rest cached)", n_stays, tokens,
                          len(budgets) + len(fractions), scored)
    return {"summary": summary, "paired": paired, "cohort": cohort, "metadata": metadata}


@task(cache_policy=NO_CACHE, persist_result=False)
def report(root: str, result: dict) -> str:
    """Render WS/report.html and report.json and publish the headline as Prefect artifacts. A task, not a flow,
    called with the result quoted: a flow's parameters go to the API whole, and Prefect walks a task's inputs
    for futures; both cost ~1 s on the result's thousands of summary rows, for a step of 0.2 s."""
    with progress.step("report"):
        path = str(render_report(result, root))
    result = disclosed(result)
    headline = [{"protocol": r["protocol"], "tokens": r["tokens"], "label": r["label"], "budget": r["budget"],
                 "policy": r["policy"], "metric": r["metric"], "mean": round(r["mean"], 4),
                 "ci": f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]", "n": r["n"]}
                for r in headline_rows(result["summary"])]
    create_table_artifact(key="forgetful-headline", table=headline,
                          description="Fixed-context retention (budget k) and streaming at B = 32 and 64")
    create_markdown_artifact(key="forgetful-report", markdown=f"Report written to `{path}` "
                             f"({result['cohort']['stays']} ICU stays, {result['cohort']['eval_stays']} "
                             f"scored).", description="Forgetful HTML report")
    return path


@flow(name="forgetful-scheduled-run")
def scheduled_run(root: str | Path = "out", source: str | Path | None = None,
                  budgets: tuple[int, ...] = DEFAULT_BUDGETS, fractions: tuple[float, ...] = DEFAULT_FRACTIONS,
                  max_events: int | None = None,
                  cohort_budget: int = 128, lock_wait_seconds: float = 600.0, task_runner: str = "process",
                  workers: int | None = None, encoder_steps: int = 100, tokens: str = "hourly",
                  config: str | None = None, memory_limit: str = "4GB") -> dict:
    """ingest -> (train the key encoder) -> evaluate -> cohort memory -> report, holding the workspace lock
    (deletions wait for it).

    ``task_runner``: where per-stay scoring runs, 'process' (local pool), 'thread' or 'dask'.
    ``encoder_steps``: training steps of the learned-key encoder (0: no ``sv_learned`` policy row); it learns
    event keys, so it is trained only when ``tokens='events'``.
    ``tokens``: 'hourly' patient-state tokens (default) or raw 'events'.
    ``config``: a shipped cohort config's name or a YAML path; it becomes the workspace's config (None: keep
    the workspace's, or the default). ``memory_limit``: DuckDB's limit for the extraction.
    """
    if tokens not in TOKEN_MODES:
        raise ValueError(f"tokens must be one of {TOKEN_MODES}, got {tokens!r}")
    ws, started = Workspace(root), time.time()
    with workspace_lock(ws.root, wait_seconds=lock_wait_seconds, purpose="scheduled run"):
        recover(ws.root)
        install_config(ws.root, config)
        ingest_info = ingest(str(ws.root), source, memory_limit)
        encoder_info = train_encoder_task(str(ws.root), encoder_steps) if encoder_steps and tokens == "events" \
            else None
        result = evaluate.with_options(task_runner=make_task_runner(task_runner, workers))(
            str(ws.root), budgets=tuple(budgets), fractions=tuple(fractions), max_events=max_events, tokens=tokens)
        result["metadata"]["data_source"] = str(source or "embedded generator (deterministic)")
        result["provenance"] = provenance_task(str(ws.root), result["metadata"]["data_source"])
        result["metadata"]["ingest"] = ingest_info
        result["metadata"]["learned_keys_encoder"] = encoder_info or \
            "not trained: learned keys are for raw events (--tokens events with encoder steps > 0)"
        result["metadata"]["cohort_memory"] = cohort_memory_task(str(ws.root), cohort_budget, tokens)
        path = report(str(ws.root), quote(result))
        write_phases(ws, started)
    return {"report": path, "result": result}


# What a deletion refuses with a reason the user acts on: the flow ends Failed with it as the state's message.
REFUSALS = (WorkspaceLocked, DeletionFailed, UnknownSubjectError)
REFUSAL_PREFIX = "refused: "


def refusal_reason(state: State) -> str | None:
    """The one-line reason of a deletion flow run that ended refused; None for any other outcome."""
    message = state.message or ""
    return message[len(REFUSAL_PREFIX):] if state.is_failed() and message.startswith(REFUSAL_PREFIX) else None


@flow(name="forgetful-delete-patient")
def delete_patient(root: str | Path, subject_hash: str, mode: str = "decrement",
                   wait_seconds: float = 60.0, compare_with_replay: bool = True) -> dict | None:
    """Delete the subject whose keyed hash is ``subject_hash`` (:func:`pipeline.privacy.keyed_hash` under the
    workspace's key): Prefect's database, logs and results see the hash, never the raw id.

    Returns {"certificate": path}, or {"already_deleted": message}: deleting twice is an expected outcome
    (the flow run completes), not a failure. A refusal (the workspace is held by a run, a check failed, an
    unknown subject) is a Failed state carrying its one-line reason, not an exception's traceback."""
    ws = Workspace(root)
    try:
        cert, path = delete_subject(ws, resolve_subject(ws, subject_hash), mode=mode, wait_seconds=wait_seconds,
                                    compare_with_replay=compare_with_replay)
    except AlreadyDeleted as e:
        get_run_logger().info("nothing to do: %s", e)
        return {"already_deleted": str(e)}
    except REFUSALS as e:
        return Failed(message=f"{REFUSAL_PREFIX}{e}")
    get_run_logger().info("deletion certificate %s issued (mode %s)", Path(path).name, mode)
    create_markdown_artifact(key="forgetful-deletion", markdown=f"Certificate `{Path(path).name}` (subject hash "
                             f"`{cert['subject_hash'][:16]}...`, mode {mode}).")
    return {"certificate": str(path)}
