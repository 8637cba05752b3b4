"""Prefect 3 flows. Thin: each task calls one plain, separately tested function.

``scheduled_run`` = ``ingest`` -> ``evaluate`` (:mod:`run.evaluate`) -> cohort memory update -> ``report``;
``delete_patients`` serves deletion requests, one patient or a batch. Task results that hold patient-level data
(streams, per-stay rows) are never persisted (``persist_result=False``); nothing is cached by Prefect (the
workspace's per-stay caches are).
"""
import os
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State, TaskRun
from prefect.states import Failed
from prefect.futures import PrefectFuture, as_completed
from prefect.task_runners import ProcessPoolTaskRunner, TaskRunner, ThreadPoolTaskRunner
from prefect.tasks import Task
from prefect.utilities.annotations import quote

from cohorts.config import CohortConfig
from cohorts.definitions import CohortConfigError, install_config
from cohorts.evaluation import EventStream, headline_rows
from cohorts.protocols import StreamingSettings, TokenStream, score_token_streams
from deletion import (AlreadyDeleted, DeletionFailed, delete_subjects, reapply_deletions, reapply_to_generated_source,
                      resolve_subjects, triage)
from flows.deletion_desk import DeletionOutcome, DeletionRequest, say
from flows.failures import failure_status
from memory.warmup import compile_solver, is_compiled
from pipeline import progress
from pipeline.extract import ExtractionError, extract
from pipeline.store_reader import UnknownSubjectError
from pipeline.generate import GeneratorConfig, generate
from pipeline.locking import WorkspaceLocked, workspace_lock
from pipeline.meds import MedsStayCodes
from pipeline.privacy import load_key
from pipeline.transaction import recover
from pipeline.workspace import Workspace
from reports.disclosure import disclosed
from reports.html import render_report
from run.cohort_memory import update_cohort_memory
from run.evaluate import PreparedRun, Tokenised, prepare, score_event_chunk, tokenise
from run.params import TASK_RUNNERS, RunParams, StreamMode
from run.result import RunResult
from run.steps import ENCODER_NOT_TRAINED, train_key_encoder, write_phases
from run.token_run import StayIndex



def make_task_runner(kind: str, workers: int | None = None) -> TaskRunner:
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
def extract_task(source: str, store: str, root: str, memory_limit: str, stay_codes: MedsStayCodes) -> dict:
    s = extract(source, store, key=load_key(root), memory_limit=memory_limit, stay_codes=stay_codes)
    get_run_logger().info("extracted %d new events (%d in store, %d suppressed rows)", s.new_events,
                          s.total_events, s.suppressed_rows)
    return {"new_events": s.new_events, "total_events": s.total_events, "suppressed_rows": s.suppressed_rows,
            "suppressed_certificates": s.suppressed_certificates,
            "quarantined": {t: v.get("quarantined_total", 0) for t, v in s.tables.items()}}


@task(retries=1, retry_condition_fn=retry_unless_bad_input, cache_policy=NO_CACHE)
def train_encoder_task(root: str, steps: int, cfg: CohortConfig) -> dict:
    """Learned event keys: train the encoder on the training split's windows (CUDA when present)."""
    with progress.step(f"training the key encoder ({steps} steps)"):
        info = train_key_encoder(Workspace(root), steps, cfg)
    get_run_logger().info("encoder trained on %d windows: selection loss %.3f -> %.3f", info["windows"],
                          info["loss_first"], info["loss_last"])
    return info


@task(cache_policy=NO_CACHE, persist_result=False)
def prepare_task(root: str, params: RunParams, cfg: CohortConfig, tokenised: Tokenised | None = None) -> PreparedRun:
    return prepare(Workspace(root), params, cfg, tokenised=tokenised)


@task(cache_policy=NO_CACHE, persist_result=False)
def tokenise_task(root: str, params: RunParams, cfg: CohortConfig) -> Tokenised:
    return tokenise(Workspace(root), params, cfg)


# Per-stay scoring as Prefect tasks: each wraps the plain function :mod:`run.evaluate` maps over chunks of stays.
@task(cache_policy=NO_CACHE, persist_result=False)
def score_token_chunk(streams: list[TokenStream], budgets: tuple, fractions: tuple, settings: StreamingSettings,
                      fixed: dict, memory_budget: int | None, fraction_cap: int | None) -> list[dict]:
    return score_token_streams(streams, budgets, fractions, settings, fixed, memory_budget, fraction_cap)


@task(cache_policy=NO_CACHE, persist_result=False)
def score_event_chunk_task(streams: list[EventStream], budgets: tuple, fractions: tuple,
                           memory_budget: int | None) -> list[dict]:
    return score_event_chunk(streams, budgets, fractions, memory_budget)


SCORING_TASKS = {score_token_streams: score_token_chunk, score_event_chunk: score_event_chunk_task}


def task_runner_map(fn: Callable, parts: list[list], advance: Callable, **common) -> list:
    """:class:`run.evaluate.ChunkMap` over the flow's task runner: ``fn``'s task mapped over the parts."""
    futures = SCORING_TASKS[fn].map(parts, **{k: unmapped(v) for k, v in common.items()})
    stays_of = {f.task_run_id: len(p) for f, p in zip(futures, parts)}
    for f in as_completed(futures):
        advance(stays_of[f.task_run_id])
    return [f.result() for f in futures]


def end_with_parent(every: float = 0.2) -> None:
    """End this process when the process that started it ends: a worker that writes into the workspace (the
    cohort memory's) must not go on writing after a killed run's lock is gone and the next run holds it."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        os._exit(1)
    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


@task(retries=2, retry_delay_seconds=2, retry_condition_fn=retry_unless_bad_input, cache_policy=NO_CACHE)
def cohort_memory_task(root: str, budget: int, tokens: StreamMode, cfg: CohortConfig,
                       index: StayIndex | None = None) -> tuple[dict, tuple[str, float, float]]:
    # in a process of its own beside the labels and scoring, whose bars are shown: no bar, a log line, and its
    # phase (name, start, end) returned for the run's record
    end_with_parent()
    start = time.time()
    info = update_cohort_memory(Workspace(root), cfg, budget=budget, tokens=tokens, index=index)
    get_run_logger().info("cohort memory %s: fed %d events, %d tokens", info["checkpoint"], info["fed"],
                          info["tokens"])
    return info, ("cohort memory", start, time.time())


# The run's typed parameters and config cross into these subflows in the process that parsed them; Prefect
# records them (as JSON) without re-validating them into new objects.
@flow(name="forgetful-ingest", validate_parameters=False)
def ingest(root: str | Path, params: RunParams, cfg: CohortConfig) -> dict:
    """Extract new data into the workspace's store (the embedded generator's data when the run has no source)."""
    ws = Workspace(root)
    source = params.source
    if source is None:
        if not ws.source.exists():
            with progress.step("generating the embedded MIMIC-IV-shaped data"):
                generate(ws.source, GeneratorConfig())
                reapply_to_generated_source(ws)
        source = ws.source
    with progress.phase("extract"):
        return extract_task(str(source), str(ws.store), str(ws.root), params.memory_limit,
                            MedsStayCodes.from_spec(cfg.section("meds_source")))


@flow(name="forgetful-evaluate", validate_parameters=False)
def evaluate(root: str | Path, params: RunParams, cfg: CohortConfig) -> RunResult:
    """:mod:`run.evaluate` over the workspace, per-stay scoring mapped over the flow's task runner, and the
    cohort memory's update in a process beside the labels and scoring, from the moment every stay's tokens are
    cached (raw events: after the cohort phases). It reads the token caches and the run's index of stays, and
    nothing the labels or scoring write; a process, since on a thread its Python loop and theirs took turns
    at the GIL (a night's rerun spent a sixth of its time feeding the memory after scoring had ended)."""
    if not is_compiled():       # in the workers, it would stall the first items of scoring, in each at once
        with progress.step("compiling the exact solver's inner loops (once after an install or upgrade)"):
            compile_solver()
    hourly = params.tokens is StreamMode.HOURLY
    tokenised = tokenise_task(str(root), params, cfg) if hourly else None
    with ProcessPoolTaskRunner(max_workers=1) as beside:
        def feed_memory(index: StayIndex | None) -> PrefectFuture:
            return beside.submit(cohort_memory_task, dict(root=str(root), budget=params.cohort_budget,
                                                          tokens=params.tokens, cfg=cfg, index=quote(index)))
        memory = feed_memory(tokenised.index) if hourly else None
        prepared = prepare_task(str(root), params, cfg, quote(tokenised))
        if memory is None:
            memory = feed_memory(None)
        result, scored = prepared.score(task_runner_map)
        info, phase = memory.result()
    progress.phases.append(phase)
    result = result.with_metadata(cohort_memory=info)
    get_run_logger().info("%d evaluation stays (%s) at %d budgets, %d scored now (the rest cached)",
                          prepared.evaluation_stays, params.tokens, len(params.budgets) + len(params.fractions),
                          scored)
    return result


@task(cache_policy=NO_CACHE, persist_result=False)
def report(root: str, result: RunResult) -> str:
    """Render WS/report.html and report.json and publish the headline as Prefect artifacts. A task, not a flow,
    called with the result quoted: a flow's parameters go to the API whole, and Prefect walks a task's inputs
    for futures; both cost ~1 s on the result's thousands of summary rows, for a step of 0.2 s."""
    with progress.step("report"):
        path = str(render_report(result, root))
    result = disclosed(result)
    headline = [{"protocol": r.protocol, "tokens": r.tokens.value, "label": r.label, "budget": str(r.budget),
                 "policy": r.policy, "metric": r.metric, "mean": round(r.mean, 4),
                 "ci": f"[{r.ci_low:.3f}, {r.ci_high:.3f}]", "n": r.n}
                for r in headline_rows(result.summary)]
    create_table_artifact(key="forgetful-headline", table=headline,
                          description="Fixed-context retention (budget k) and streaming at B = 32 and 64")
    create_markdown_artifact(key="forgetful-report", markdown=f"Report written to `{path}` "
                             f"({result.cohort['stays']} ICU stays, {result.cohort['eval_stays']} "
                             f"scored).", description="Forgetful HTML report")
    return path


@flow(name="forgetful-scheduled-run")
def scheduled_run(root: str | Path = "out", source: str | Path | None = None, budgets: tuple[int, ...] | None = None,
                  fractions: tuple[float, ...] | None = None, max_events: int | None = None,
                  cohort_budget: int | None = None, lock_wait_seconds: float | None = None,
                  task_runner: str | None = None, workers: int | None = None, encoder_steps: int | None = None,
                  tokens: StreamMode | None = None, config: str | None = None,
                  memory_limit: str | None = None) -> dict:
    """ingest -> (train the key encoder) -> evaluate (the cohort memory fed beside its labels and scoring) ->
    report, holding the workspace lock (deletions wait for it).

    Every parameter not given (None) is the workspace's last run's (``WS/run.json``), else
    :class:`run.params.RunParams`'s default; the run's parameters are saved back to ``WS/run.json``.
    ``config``: a shipped cohort config's name or a YAML path; it becomes the workspace's config (None: keep
    the workspace's, or the default).
    """
    ws, started = Workspace(root), time.time()
    params = RunParams.resolve(RunParams.load(ws.run_params), source=source, budgets=budgets, fractions=fractions,
                               max_events=max_events, cohort_budget=cohort_budget, tokens=tokens,
                               lock_wait_seconds=lock_wait_seconds, task_runner=task_runner, workers=workers,
                               encoder_steps=encoder_steps, memory_limit=memory_limit)
    with workspace_lock(ws.root, wait_seconds=params.lock_wait_seconds, purpose="scheduled run"):
        recover(ws.root)
        reapplied = reapply_deletions(ws)
        if reapplied is not None:
            get_run_logger().warning(reapplied.line())
        cfg = install_config(ws.root, config)
        params.save(ws.run_params)
        ingest_info = ingest(str(ws.root), params, cfg)
        ingest_info["deletions_reapplied"] = reapplied.line() if reapplied is not None else None
        events = params.tokens is StreamMode.EVENTS
        encoder = train_encoder_task(str(ws.root), params.encoder_steps, cfg) if events and params.encoder_steps \
            else None
        result = evaluate.with_options(task_runner=make_task_runner(params.task_runner, params.workers))(
            str(ws.root), params, cfg)
        result = result.with_metadata(ingest=ingest_info, learned_keys_encoder=encoder or ENCODER_NOT_TRAINED)
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


@flow(name="forgetful-delete-patients")
def delete_patients(root: str | Path, subject_hashes: list[str], mode: str = "decrement", wait_seconds: float = 60.0,
                    compare_with_replay: bool = True, skip_unknown: bool = False) -> dict | None:
    """Delete the subjects whose keyed hashes are ``subject_hashes`` (:func:`pipeline.privacy.keyed_hash` under the
    workspace's key) in one transaction, a certificate each: Prefect's database, logs and results see the hashes,
    never the raw ids.

    A hash of no stored subject (unknown, or deleted before) refuses the whole request, naming each, unless
    ``skip_unknown``: then the rest are deleted and the result names the skipped. Returns {"certificates": paths,
    "skipped": {hash prefix: reason}}, or {"already_deleted": message} when every subject was deleted before:
    deleting twice is an expected outcome (the flow run completes), not a failure. A refusal (the workspace is
    held by a run, a check failed, unknown subjects) is a Failed state carrying its one-line reason."""
    ws = Workspace(root)
    try:
        found = resolve_subjects(ws, list(dict.fromkeys(subject_hashes)))
    except REFUSALS as e:
        return Failed(message=f"{REFUSAL_PREFIX}{e}")
    decided = triage(found, skip_unknown, lambda h, why: why)      # the reason names the hash's prefix
    if decided.already_deleted is not None:
        get_run_logger().info("nothing to do: %s", decided.already_deleted)
        return {"already_deleted": decided.already_deleted}
    if decided.refusal is not None:
        return Failed(message=f"{REFUSAL_PREFIX}{decided.refusal}")
    sids = [found[h] for h in decided.left]
    missing = {h[:12]: why for h, why in decided.skipped.items()}
    try:
        issued = delete_subjects(ws, sids, mode=mode, wait_seconds=wait_seconds,
                                 compare_with_replay=compare_with_replay)
    except (*REFUSALS, AlreadyDeleted) as e:       # AlreadyDeleted: another request deleted one meanwhile
        return Failed(message=f"{REFUSAL_PREFIX}{e}")
    names = [Path(path).name for _, path in issued]
    get_run_logger().info("deletion certificate(s) %s issued (mode %s)", ", ".join(names), mode)
    create_markdown_artifact(key="forgetful-deletion", markdown="\n".join(
        f"- Certificate `{Path(path).name}` (subject hash `{cert.subject_hash[:16]}...`, mode {mode})"
        for cert, path in issued))
    return {"certificates": [str(path) for _, path in issued], "skipped": missing}


def deletion_outcome(state: State) -> DeletionOutcome:
    """How a ``delete_patients`` flow run ended; a failure that is not a refusal is raised (``state.result()``)."""
    reason = refusal_reason(state)
    if reason is not None:
        return DeletionOutcome(refusal=reason)
    out = state.result()
    if "already_deleted" in out:
        return DeletionOutcome(already_deleted=out["already_deleted"])
    return DeletionOutcome(certificates=tuple(out["certificates"]), skipped=out["skipped"])


def serve_deletion(root: str | Path, request: DeletionRequest) -> DeletionOutcome:
    """A request to the serving process's deletion desk (:mod:`flows.deletion_desk`): the same flow a
    ``forgetful delete`` command runs, run here; a failure is answered with the exit status the command would
    have given it (its traceback stays in this process's log)."""
    try:
        return deletion_outcome(delete_patients(root, list(request.subject_hashes), mode=request.mode,
                                                wait_seconds=request.wait_seconds,
                                                compare_with_replay=request.compare_with_replay,
                                                skip_unknown=request.skip_unknown, return_state=True))
    except Exception as e:  # noqa: BLE001 -- every failure reaches the command in one line
        status = failure_status(e)
        # the serving process's output has the traceback of a defect, as the command's line says
        say(f"a deletion request to the desk of {root} failed: {type(e).__name__}: {e}" if status != 1 else
            f"a deletion request to the desk of {root} failed:\n{traceback.format_exc().rstrip()}")
        return DeletionOutcome(failure=f"{type(e).__name__}: {e}" if status == 1 else str(e), failure_status=status)
