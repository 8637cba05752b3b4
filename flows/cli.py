"""The forgetful command line: every command runs the same Prefect flows a deployment schedules.

Argument parsing imports nothing heavy, so ``--help`` and ``--version`` answer at once; bad input found before
a flow would start (a missing source, an unknown or already-deleted subject, an invalid cohort config) is
reported in one line with exit 2 (0 for "already deleted"), without importing Prefect. A deletion checks its
subjects (seconds) while the command's temporary server boots: a refusal then stops that server as it exits; the
other refusals come before any server starts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING

from flows.failures import CommandLineError
from run.params import DEFAULT_CRON, TASK_RUNNERS, RunParams, StreamMode

if TYPE_CHECKING:
    from flows.deletion_desk import DeletionOutcome

DEFAULTS = RunParams()
BIG_REQUEST = 1000          # a deletion request of more subjects shows its checks' progress
BIG_LISTING = 20            # more certificates than this are summed up in one line, not listed
LAST_RUN = "the workspace's last run's (WS/run.json), else"


def _budgets(text):
    return tuple(int(b) for b in text.split(",") if b)


def _fractions(text):
    return tuple(float(f) for f in text.split(",") if f)


def _version():
    try:
        return version("forgetful")
    except PackageNotFoundError:
        return "unknown"


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """The options of a run (run, serve): the cohort config and the run parameters (:class:`RunParams`)."""
    p.add_argument("--out", default="out", help="workspace folder")
    p.add_argument("--source", default=None,
                   help=f"MIMIC-IV directory or MEDS dataset (default: {LAST_RUN} the embedded deterministic "
                        f"MIMIC-IV-shaped data)")
    p.add_argument("--config", default=None,
                   help="cohort config: a shipped name (default, mimic-iv-meds) or a YAML path; it becomes the "
                        "workspace's (default: the workspace's own, else the shipped default)")
    p.add_argument("--tokens", choices=[m.value for m in StreamMode], default=None,
                   help=f"stream hourly patient-state tokens or raw events (default: {LAST_RUN} "
                        f"{DEFAULTS.tokens})")
    p.add_argument("--budgets", type=_budgets, default=None,
                   help=f"fixed memory budgets, comma-separated (default: {LAST_RUN} "
                        f"{','.join(map(str, DEFAULTS.budgets))})")
    p.add_argument("--fractions", type=_fractions, default=None,
                   help=f"budgets as fractions of each stream, comma-separated, capped at the largest budget "
                        f"(default: {LAST_RUN} {','.join(map(str, DEFAULTS.fractions))})")
    p.add_argument("--max-events", type=int, default=None,
                   help=f"keep the first N events of each stay, events mode (default: {LAST_RUN} all)")
    p.add_argument("--cohort-budget", type=int, default=None,
                   help=f"budget of the cohort memory (default: {LAST_RUN} {DEFAULTS.cohort_budget})")
    p.add_argument("--task-runner", choices=TASK_RUNNERS, default=None,
                   help=f"where per-stay scoring runs (default: {LAST_RUN} {DEFAULTS.task_runner})")
    p.add_argument("--workers", type=int, default=None,
                   help=f"task-runner workers (default: {LAST_RUN} the CPU count)")
    p.add_argument("--encoder-steps", type=int, default=None,
                   help=f"learned-key encoder training steps, events mode only, 0: off (default: {LAST_RUN} "
                        f"{DEFAULTS.encoder_steps})")
    p.add_argument("--memory-limit", default=None,
                   help=f"DuckDB memory limit of the extraction (default: {LAST_RUN} "
                        f"pipeline.extract.DEFAULT_MEMORY_LIMIT)")


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, except None: such an option says in its help what not giving it means."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="forgetful", description=__doc__.split("\n")[0], formatter_class=_Defaults)
    ap.add_argument("--version", action="version", version=f"forgetful {_version()}")
    ap.add_argument("--verbose", action="store_true", help="show Prefect's per-task log lines on the console")
    sub = ap.add_subparsers(dest="cmd", required=True)
    fmt = _Defaults
    ex = sub.add_parser("extract", help="extract a MIMIC-IV directory or a MEDS dataset into the event store (itself "
                                        "a MEDS dataset)", formatter_class=fmt)
    ex.add_argument("--source", required=True, help="MIMIC-IV directory (hosp/, icu/) or MEDS dataset "
                                                    "(metadata/dataset.json, data/)")
    ex.add_argument("--config", default=None, help="cohort config (a shipped name or a YAML path) whose meds_source "
                                                   "section says how a MEDS source's ICU stays are read; none: the "
                                                   "MIMIC-IV MEDS ETL's conventions")
    ex.add_argument("--out", required=True, help="event store folder (created or updated incrementally)")
    ex.add_argument("--memory-limit", default=None,
                    help="DuckDB memory limit, spills to disk past it (default: pipeline.extract.DEFAULT_MEMORY_LIMIT)")
    for name, help_ in (("run", "main job: ingest -> both protocols -> cohort memory -> HTML report"),
                        ("serve", "register the scheduled run with a cron schedule and serve it")):
        p = sub.add_parser(name, help=help_, formatter_class=fmt)
        _add_run_options(p)
    sub.choices["serve"].add_argument("--cron", default=DEFAULT_CRON, help="cron schedule")
    de = sub.add_parser("delete", help="delete patients, one or a batch in one transaction, a deletion certificate "
                                       "each", formatter_class=fmt)
    de.add_argument("--out", default="out", help="workspace folder")
    de.add_argument("--subject-id", type=int, action="append", default=None,
                    help="a patient's subject_id (repeat it for several)")
    de.add_argument("--subjects-file", type=Path, default=None,
                    help="a file of subject_ids, one a line (blank lines and lines starting with # are skipped)")
    de.add_argument("--skip-unknown", action="store_true",
                    help="delete the rest when some ids are unknown or deleted before (each is reported); without "
                         "it such an id refuses the whole request")
    de.add_argument("--mode", choices=("decrement", "replay"), default="decrement",
                    help="cohort memory: exact decrement, or re-stream without the patient")
    de.add_argument("--wait", type=float, default=60.0, help="seconds to wait for a running scheduled run")
    de.add_argument("--no-replay-comparison", action="store_true",
                    help="decrement: do not measure the memory's distance to a replay without the patient (the "
                         "certificate then says it was not measured; measuring costs that replay)")
    ve = sub.add_parser("verify", help="re-check a deletion certificate and the whole ledger chain",
                        formatter_class=fmt)
    ve.add_argument("certificate", help="path of a certificate (WS/certificates/NNNNNN.json)")
    ve.add_argument("--checkpoint", default=None,
                    help="a signed checkpoint saved earlier (a copy of WS/checkpoint.json): the log must extend it "
                         "(catches truncation or rewriting before it); its key is trusted when no other is given")
    ve.add_argument("--public-key", default=None,
                    help="the log signer's Ed25519 public key (hex, or a file outside the workspace holding it; as "
                         "`keygen --signing` prints it); default: $FORGETFUL_LOG_PUBLIC_KEY, else the public half of "
                         "$FORGETFUL_SIGNING_KEY_FILE, else the --checkpoint copy's key")
    mg = sub.add_parser("migrate", help="upgrade a workspace written by an earlier release to this one's format",
                        formatter_class=fmt)
    mg.add_argument("workspace", help="the workspace folder (or a stand-alone store)")
    kg = sub.add_parser("keygen", help="write a new key to a file (keep it outside every workspace)",
                        formatter_class=fmt)
    kg.add_argument("path", help="the key file to create (never overwritten)")
    kg.add_argument("--signing", action="store_true",
                    help="an Ed25519 signing key for the deletion log (FORGETFUL_SIGNING_KEY_FILE) instead of the "
                         "keyed-hash secret (FORGETFUL_HASH_KEY_FILE)")
    return ap


def _quiet_prefect(verbose):
    from flows.api_server import default_startup_wait
    # Offline machines: Prefect's server would log an error for every failed telemetry call (users can opt in).
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    default_startup_wait()
    if not verbose:
        # Prefect's log lines off the console, its tracebacks of a failed flow included (the command prints the
        # reason in one line); they still reach the API (the UI shows them) and --verbose shows them.
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")


@dataclass(frozen=True)
class RunCommand:
    """A run or serve command as parsed and checked once: the workspace, the cohort config it names (None: the
    workspace's, else the default), the run parameters given (None: not given; the flow takes the workspace's last
    run's, :meth:`RunParams.resolve`), the cron schedule of ``serve`` (None: a run)."""
    out: str
    config: str | None
    given: dict
    cron: str | None = None

    def flow_parameters(self) -> dict:
        """The scheduled run's parameters, as a deployment names them (only those given)."""
        return {k: v for k, v in dict(root=self.out, config=self.config, **self.given).items() if v is not None}


@dataclass(frozen=True)
class DeleteCommand:
    """A delete command as parsed and checked once: the workspace, the subjects by id, how to delete them."""
    out: str
    subject_ids: tuple[int, ...]
    mode: str
    wait_seconds: float
    compare_with_replay: bool
    skip_unknown: bool


def _given_run_params(args) -> dict:
    """The run parameters given on the command line (None: not given; the flow takes the workspace's last run's)."""
    # a source is saved with the workspace's parameters, for reruns from any folder: its absolute path
    source = str(Path(args.source).resolve()) if args.source is not None else None
    return dict(source=source, budgets=args.budgets, fractions=args.fractions, max_events=args.max_events,
                cohort_budget=args.cohort_budget, task_runner=args.task_runner, workers=args.workers,
                encoder_steps=args.encoder_steps, tokens=args.tokens, memory_limit=args.memory_limit)


def _preflight(args) -> RunCommand | DeleteCommand:
    """The command's request, checked where no server is needed: raise the error a flow would otherwise fail with."""
    from pipeline.workspace import Workspace
    ws = Workspace(args.out)
    if args.cmd in ("run", "serve"):
        from cohorts.definitions import load_config, resolve_config
        from pipeline.extract import check_source
        from pipeline.privacy import store_key
        store_key(ws.store, ws.root)
        given = _given_run_params(args)
        # a rerun without --source reads the workspace's last run's source: check that one
        source = RunParams.resolve(RunParams.load(ws.run_params), **given).source
        if source is not None:
            check_source(source)
        load_config(resolve_config(args.config))
        config = _check_meds_codes(source, args.config, ws)
        return RunCommand(args.out, config, given | {"source": source}, args.cron if args.cmd == "serve" else None)
    from pipeline.evidence import load_signing_key
    request = DeleteCommand(args.out, tuple(_requested_ids(args)), args.mode, args.wait,
                            not args.no_replay_comparison, args.skip_unknown)
    load_signing_key(ws.root)
    return request


def _requested_ids(args) -> list[int]:
    """The subject ids of a delete command: each --subject-id, then each line of --subjects-file."""
    ids = list(args.subject_id or [])
    if args.subjects_file is not None:
        try:
            lines = args.subjects_file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise CommandLineError(f"--subjects-file {args.subjects_file} cannot be read: {why}") from None
        for n, line in enumerate(lines, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            if not text.isdigit():
                raise CommandLineError(f"--subjects-file {args.subjects_file}, line {n}: {text[:40]!r} is not a "
                                       f"subject_id (one integer a line)")
            ids.append(int(text))
    if not ids:
        raise CommandLineError("delete needs --subject-id (repeatable) or --subjects-file")
    return sorted(set(ids))


def _deletable(command: DeleteCommand, ws) -> list[int]:
    """The requested subjects the workspace holds. One that it does not (unknown, or deleted before) is named,
    with why, and refuses the request unless --skip-unknown; when none is left because every one was deleted
    before, AlreadyDeleted (nothing to do, exit 0). Messages name a few subjects and count the rest."""
    from deletion import AlreadyDeleted, check_subjects, triage
    from pipeline import progress
    progress.configure(True)
    n = len(command.subject_ids)
    with progress.step(f"checking the {n} requested subjects", total=n, unit="subjects") if n > BIG_REQUEST \
            else nullcontext() as advance:
        status = check_subjects(ws, list(command.subject_ids), advance)
    decided = triage(status, command.skip_unknown, lambda sid, why: f"subject {sid}: {why}")
    if decided.already_deleted is not None:
        raise AlreadyDeleted(decided.already_deleted)
    if decided.refusal is not None:
        raise CommandLineError(decided.refusal)
    _print_skipped([f"subject {sid}: {why}" for sid, why in decided.skipped.items()])
    return list(decided.left)


def _print_skipped(lines: list[str], shown: int = 3) -> None:
    for line in lines[:shown]:
        print(f"forgetful: skipped {line}", file=sys.stderr)
    if len(lines) > shown:
        print(f"forgetful: skipped {len(lines) - shown} more subject(s) for the same reasons", file=sys.stderr)


def _check_meds_codes(source: str | None, config: str | None, ws) -> str | None:
    """A MEDS source must carry the codes of the config the run reads: without --config (and no workspace config
    yet) the shipped config whose codes it carries is taken, saying so; with one that reads nothing of it, one
    line naming the config, what it looked for and the source's most frequent codes. The config the run takes."""
    from pipeline.meds import is_meds_dataset, meds_shards
    if source is None or not is_meds_dataset(Path(source)):
        return config
    from cohorts.coverage import check_channels_read, code_counts, suggest_config
    from cohorts.definitions import WORKSPACE_CONFIG, load_config, resolve_config
    counts = code_counts(meds_shards(Path(source)))
    in_workspace = (ws.root / WORKSPACE_CONFIG).exists()
    if config is None and not in_workspace:
        chosen = suggest_config(counts)
        if chosen not in (None, "default"):
            print(f"forgetful: {source} carries the codes of the shipped config {chosen!r} (not the default's): "
                  f"using --config {chosen}", file=sys.stderr)
            config = chosen
    name = config or (str(ws.root / WORKSPACE_CONFIG) if in_workspace else "default")
    path = resolve_config(config) if config or not in_workspace else ws.root / WORKSPACE_CONFIG
    check_channels_read(load_config(path), counts, name, f"the MEDS dataset {source}")
    return config


def _print_headline(result):
    """The headline rows on the console, small counts of stays hidden as in the report."""
    from cohorts.evaluation import headline_rows
    from reports.disclosure import disclosed
    for r in headline_rows(disclosed(result).summary):
        label = r.label if r.label != "none" else f"keys {r.keys}"
        print(f"  {r.protocol:<13} {label:<22} B={str(r.budget):>3} {r.policy:<15} {r.metric:<18} "
              f"{r.mean:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}] n={r.n}")


def _migrate(args):
    from pipeline.migrate import migrate
    for step in migrate(Path(args.workspace)):
        print(f"migrate: {step}")
    return 0


def _workspace_root(args):
    """The workspace a command reads (None for keygen): a certificate's, a store's parent, or --out."""
    if args.cmd == "migrate":
        return Path(args.workspace)
    if args.cmd == "verify":
        return Path(args.certificate).resolve().parent.parent
    if args.cmd == "extract":
        return Path(args.out).resolve().parent
    return Path(args.out) if args.cmd != "keygen" else None


def _keygen(args):
    from pipeline.evidence import PUBLIC_KEY_ENV, SIGNING_KEY_ENV, public_hex, write_signing_key
    from pipeline.privacy import KEY_FILE_ENV, write_new_key
    path, env = (write_signing_key(args.path), SIGNING_KEY_ENV) if args.signing else \
        (write_new_key(args.path), KEY_FILE_ENV)
    print(f"wrote a new key to {path}; use it with: export {env}={path}")
    if args.signing:
        from cryptography.hazmat.primitives import serialization
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        print(f"its public key, for auditors to pin (verify --public-key, or {PUBLIC_KEY_ENV}): {public_hex(key)}")
    return 0


def _extract(args):
    from contextlib import nullcontext

    from cohorts.definitions import load_config, resolve_config
    from pipeline.extract import extract
    from pipeline.locking import workspace_lock
    from pipeline.meds import MedsStayCodes
    from pipeline.privacy import load_key
    from run.params import check_memory_limit
    if args.memory_limit is not None:
        check_memory_limit(args.memory_limit)
    ws = Path(args.out).resolve().parent
    stay_codes = MedsStayCodes.from_spec(load_config(resolve_config(args.config)).section("meds_source")
                                         if args.config else None)
    # a store inside a workspace is written under the workspace's lock, as runs and deletions write it
    in_ws = (ws / ".lock").exists() or (ws / "ledger.jsonl").exists()
    with workspace_lock(ws, wait_seconds=60, purpose="extraction") if in_ws else nullcontext():
        s = extract(args.source, args.out, key=load_key(ws if in_ws else args.out), memory_limit=args.memory_limit,
                    stay_codes=stay_codes)
    print(json.dumps({"new_events": s.new_events, "total_events": s.total_events,
                      "quarantined": {t: v.get("quarantined", {}) for t, v in s.tables.items()}}, indent=1))
    return 0


def _verify(args):
    from pipeline.evidence import read_saved_checkpoint, trust_anchor, verify_certificate
    root = Path(args.certificate).resolve().parent.parent
    saved = read_saved_checkpoint(args.checkpoint) if args.checkpoint else None
    anchor = trust_anchor(root, args.public_key, saved)
    problems = verify_certificate(args.certificate, args.checkpoint, anchor)
    for p in problems:
        print(f"FAILED: {p}")
    if problems:
        return 1
    print(f"ok: {args.certificate}, its inclusion proof and the log's entries verify; the log is signed by the "
          f"trusted key {anchor.public_key[:16]}... (from {anchor.source})"
          + (f", and it extends {args.checkpoint}" if args.checkpoint else
             "; without --checkpoint, a truncation signed by the same key is not excluded"))
    return 0


def _delete(command: DeleteCommand, server, subject_ids: list[int]):
    from flows.api_server import shared_api_server
    from flows.prefect_flows import delete_patients, deletion_outcome
    from pipeline.workspace import Workspace
    by_hash = _ids_by_hash(Workspace(command.out), subject_ids)
    with shared_api_server(server):
        state = delete_patients(command.out, list(by_hash), mode=command.mode, wait_seconds=command.wait_seconds,
                                compare_with_replay=command.compare_with_replay, return_state=True)
    return _report_outcome(deletion_outcome(state), by_hash)


def _ids_by_hash(ws, subject_ids: list[int]) -> dict[str, int]:
    """The subjects' keyed hashes (what a deletion flow, Prefect's database and a desk's request see: the raw ids
    stay in this process), each with its id."""
    from pipeline.privacy import keyed_hash, store_key
    key = store_key(ws.store, ws.root)
    return {keyed_hash(sid, key): sid for sid in subject_ids}


def _send_to_desk(command: DeleteCommand) -> int | None:
    """The deletion handed to the process serving the workspace (``forgetful serve``, its deletion desk) when
    one does: no server to start, nothing to import, the same flow run there. Its exit status, or None when no
    desk takes it (the command runs it itself)."""
    from flows.deletion_desk import DeletionRequest, desk_pid, submit
    from pipeline.workspace import Workspace
    ws = Workspace(command.out)
    pid = desk_pid(ws)
    if pid is None or not ws.store.exists():
        return None
    by_hash = _ids_by_hash(ws, list(command.subject_ids))
    print(f"forgetful: sent to the process serving {ws.root} (pid {pid})")
    outcome = submit(ws, DeletionRequest(tuple(by_hash), mode=command.mode, wait_seconds=command.wait_seconds,
                                         compare_with_replay=command.compare_with_replay,
                                         skip_unknown=command.skip_unknown))
    return None if outcome is None else _report_outcome(outcome, by_hash)


def _report_outcome(outcome: DeletionOutcome, by_hash: dict[str, int]) -> int:
    """A deletion's outcome in the command's lines and exit status.
    The flow names subjects by hash prefix; the command, which holds the ids it was given, adds whose each is."""
    def named(text: str) -> str:
        return text + "".join(f" [hash {h[:12]}... is subject {sid}]" for h, sid in by_hash.items() if h[:12] in text)
    if outcome.refusal is not None or outcome.failure_status == 2 and outcome.failure is not None:
        print(f"forgetful: error: {named(outcome.refusal or outcome.failure)}", file=sys.stderr)
        return 2
    if outcome.failure is not None:
        print(f"forgetful: internal error: {outcome.failure} (the serving process's log has the traceback)",
              file=sys.stderr)
        return outcome.failure_status
    if outcome.already_deleted is not None:
        print(f"forgetful: nothing to do: {named(outcome.already_deleted)}")
        return 0
    skipped = {h: outcome.skipped[h[:12]] for h in by_hash if h[:12] in outcome.skipped}
    _print_skipped([f"subject {by_hash[h]}: {why}" for h, why in skipped.items()])
    left = sorted(sid for h, sid in by_hash.items() if h not in skipped)
    certified = list(zip(left, outcome.certificates))
    for sid, path in certified if len(certified) <= BIG_LISTING else []:
        print(f"certificate: {path}" + (f" (subject {sid})" if len(by_hash) > 1 else ""))
    if len(certified) > BIG_LISTING:
        (first_sid, first), (last_sid, last) = certified[0], certified[-1]
        print(f"certificates: {len(certified)}, from {first} (subject {first_sid}) to {last} (subject {last_sid}), "
              f"one a subject in ascending subject id")
    return 0


def _scheduled(command: RunCommand, server):
    from flows.api_server import shared_api_server
    from flows.prefect_flows import scheduled_run
    params = command.flow_parameters()
    fresh = not Path(command.out).exists()
    try:
        with shared_api_server(server):
            if command.cron is not None:
                _serve(command, params)
                return 0
            out = scheduled_run(**params)
    except Exception:
        if fresh:
            _remove_unstarted_workspace(Path(command.out))
        raise
    _print_deleted_left_out(out["result"].metadata.get("ingest") or {})
    print(f"report: {out['report']}")
    _print_headline(out["result"])
    return 0


def _print_deleted_left_out(ingest: dict) -> None:
    """What a run kept out of deleted patients: rows the source still holds, and a store that held them again."""
    if ingest.get("deletions_reapplied"):
        print(f"forgetful: {ingest['deletions_reapplied']}")
    if ingest.get("suppressed_rows"):
        print(f"forgetful: left out {ingest['suppressed_rows']} source row(s) of deleted patients (certificates "
              f"{ingest.get('suppressed_certificates') or 'on the suppression list'}): they never return")


def _serve(command: RunCommand, params: dict) -> None:
    """The scheduled run served on its cron schedule, and the workspace's deletion requests taken in this process
    meanwhile (:mod:`flows.deletion_desk`)."""
    from functools import partial

    from flows.deletion_desk import open_desk
    from flows.prefect_flows import scheduled_run, serve_deletion
    from memory.warmup import compile_solver
    from pipeline.workspace import Workspace
    ws = Workspace(command.out)

    def warm() -> None:
        compile_solver()
        print("forgetful: the deletion desk answers", flush=True)
    with open_desk(ws, partial(serve_deletion, str(ws.root)), warm=warm) as desk:
        print(f"forgetful: deletion requests for {ws.root} are taken by this process (pid {os.getpid()})"
              if desk is not None else f"forgetful: another process takes the deletion requests for {ws.root}",
              flush=True)
        scheduled_run.serve(name="forgetful-scheduled", cron=command.cron, parameters=params)


def _remove_unstarted_workspace(root: Path) -> None:
    """A first run that failed before its store existed leaves no workspace behind (it held only the lock file
    and the config it was given, or the embedded data it generated): the next run starts clean. One that got
    further keeps its workspace, which the next run resumes (extraction is incremental)."""
    import shutil

    from pipeline.workspace import Workspace
    if root.is_dir() and not Workspace(root).store.exists():
        shutil.rmtree(root, ignore_errors=True)


def _check_out(args) -> None:
    """--out must be a folder (or not exist yet): one line, before a server starts or a lock is taken."""
    out = getattr(args, "out", None)
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        what = "store" if args.cmd == "extract" else "workspace"
        raise CommandLineError(f"--out {out} is a file, not a folder (the {what} is a folder)")
    if args.cmd == "extract" and Path(out).resolve().parent.exists() and not Path(out).resolve().parent.is_dir():
        raise CommandLineError(f"--out {out}: its parent is a file, not a folder")


def _run(args):
    _check_out(args)
    root = _workspace_root(args)
    if root is not None and root.exists():
        from pipeline.transaction import settle
        settle(root)
    if root is not None and args.cmd != "migrate":
        from pipeline.migrate import check_format
        check_format(Path(args.out) if args.cmd == "extract" else root / "store")
    offline = {"keygen": _keygen, "extract": _extract, "verify": _verify, "migrate": _migrate}   # no flow, server
    if args.cmd in offline:
        return offline[args.cmd](args)
    command = _preflight(args)
    if isinstance(command, DeleteCommand):
        sent = _send_to_desk(command)
        if sent is not None:
            return sent
    from flows.api_server import begin, launch_early
    serving = isinstance(command, RunCommand) and command.cron is not None
    early = launch_early(scheduler=serving)
    # While the server boots: a deletion's check of its subjects (it imports the deletion's modules and reads
    # the workspace's memories: seconds, which the server used to wait for), Prefect's import, the flows'
    # imports, scikit-learn's among them (memory.libsvm imports it on first use so that the checks above, before
    # the server starts, do not wait ~1.2 s for it).
    if isinstance(command, DeleteCommand):
        from pipeline.workspace import Workspace
        left = _deletable(command, Workspace(command.out))
    server = begin(early, scheduler=serving)
    import flows.prefect_flows  # noqa: F401
    import sklearn.svm  # noqa: F401
    from pipeline import progress
    progress.configure(True)
    return _delete(command, server, left) if isinstance(command, DeleteCommand) else _scheduled(command, server)


def _os_error_line(e: OSError, args) -> str:
    """A file-system failure in one line: which file, why, and for a full disk the folder and its free space."""
    import errno
    import shutil
    where = e.filename or getattr(args, "out", None) or "."
    if e.errno == errno.ENOSPC:
        folder = Path(where).resolve()
        while not folder.exists():
            folder = folder.parent
        free = shutil.disk_usage(folder).free
        return (f"no space left on the device holding {folder} ({free / 2**20:.0f} MiB free) while writing {where}: "
                f"free space (a run needs about the source's size again, for the store and its spill files) and "
                f"run the command again: it resumes from what it completed")
    return f"cannot {'write' if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM) else 'use'} {where}: " \
           f"{e.strerror or e}"


def _failure(e: Exception, args) -> int:
    """The exit status of a command that raised ``e`` (:func:`flows.failures.failure_status`), its reason printed
    in one line."""
    from flows.failures import failure_status
    status = failure_status(e)
    if status == 0:
        print(f"forgetful: nothing to do: {e}")
        return 0
    if status == 2:
        print(f"forgetful: error: {_os_error_line(e, args) if isinstance(e, OSError) else e}", file=sys.stderr)
        return 2
    if args.verbose:        # a defect of ours: the traceback with --verbose, one line without
        raise e
    print(f"forgetful: internal error: {type(e).__name__}: {e} (run again with --verbose for the traceback; "
          f"Prefect's UI has the failed flow run's log)", file=sys.stderr)
    return 1


def main(argv: list | None = None) -> int | None:
    args = build_parser().parse_args(argv)
    _quiet_prefect(args.verbose)
    try:
        return _run(args)
    except Exception as e:  # noqa: BLE001 -- every failure ends in one line (see _failure)
        return _failure(e, args)


if __name__ == "__main__":
    sys.exit(main())
