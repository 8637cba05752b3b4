"""The ``forgetful`` command line: every command runs the same Prefect flows a deployment schedules."""
import argparse
import json
import os
import sys

# The machines this runs on are often offline: Prefect's server would log an error for every failed
# telemetry call. Users can still opt in by setting the variable themselves.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

from cohorts.evaluation import headline_rows
from pipeline.deletion import AlreadyDeleted, DeletionFailed
from pipeline.extract import ExtractionError, extract
from pipeline.locking import WorkspaceLocked


def _budgets(text):
    return tuple(int(b) for b in text.split(",") if b)


def _fractions(text):
    return tuple(float(f) for f in text.split(",") if f)


def build_parser():
    ap = argparse.ArgumentParser(prog="forgetful", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("extract", help="extract a MIMIC-IV directory into a parquet event store")
    ex.add_argument("--source", required=True)
    ex.add_argument("--out", required=True)
    ex.add_argument("--memory-limit", default="4GB")
    for name, help_ in (("run", "main job: ingest -> budget sweep -> cohort memory -> HTML report"),
                        ("serve", "register the scheduled run with a cron schedule and serve it")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--out", default="out", help="workspace folder")
        p.add_argument("--source", default=None, help="MIMIC-IV directory (default: the embedded generator)")
        p.add_argument("--budgets", type=_budgets, default=(8, 16, 32, 64, 128, 256))
        p.add_argument("--fractions", type=_fractions, default=(0.05, 0.1, 0.2))
        p.add_argument("--max-events", type=int, default=None,
                       help="keep the first N events of each stay (events mode)")
        p.add_argument("--cohort-budget", type=int, default=128)
        p.add_argument("--task-runner", choices=("process", "thread", "dask"), default="process")
        p.add_argument("--workers", type=int, default=None)
        p.add_argument("--encoder-steps", type=int, default=100,
                       help="learned-key encoder training steps, events mode only (0: off; default 100)")
        p.add_argument("--tokens", choices=("hourly", "events"), default="hourly",
                       help="stream hourly patient-state tokens (default) or raw events")
    sub.choices["serve"].add_argument("--cron", default="0 3 * * *", help="cron schedule (default: daily 03:00)")
    de = sub.add_parser("delete", help="delete one patient, with a deletion certificate")
    de.add_argument("--out", default="out")
    de.add_argument("--subject-id", type=int, required=True)
    de.add_argument("--mode", choices=("decrement", "replay"), default="decrement")
    de.add_argument("--wait", type=float, default=60.0, help="seconds to wait for a running scheduled run")
    ve = sub.add_parser("verify", help="re-check a deletion certificate and the whole ledger chain")
    ve.add_argument("certificate")
    ve.add_argument("--ledger", default=None)
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "extract":
            s = extract(args.source, args.out, memory_limit=args.memory_limit)
            print(json.dumps({"new_events": s.new_events, "total_events": s.total_events,
                              "quarantined": {t: v.get("quarantined", {}) for t, v in s.tables.items()}}, indent=1))
        elif args.cmd == "verify":
            from reports.certificates import verify_certificate
            problems = verify_certificate(args.certificate, args.ledger)
            for p in problems:
                print(f"FAILED: {p}")
            if problems:
                return 1
            print(f"ok: {args.certificate} and the ledger chain verify")
        elif args.cmd == "delete":
            from flows.prefect_flows import delete_patient, shared_api_server
            with shared_api_server():
                path = delete_patient(args.out, args.subject_id, mode=args.mode, wait_seconds=args.wait)
            print(f"certificate: {path}")
        else:
            from flows.prefect_flows import scheduled_run, shared_api_server
            params = dict(root=args.out, source=args.source, budgets=args.budgets, fractions=args.fractions,
                          max_events=args.max_events, cohort_budget=args.cohort_budget,
                          task_runner=args.task_runner, workers=args.workers,
                          encoder_steps=args.encoder_steps, tokens=args.tokens)
            with shared_api_server():
                if args.cmd == "serve":
                    scheduled_run.serve(name="forgetful-scheduled", cron=args.cron, parameters=params)
                    return 0
                out = scheduled_run(**params)
            print(f"report: {out['report']}")
            for r in headline_rows(out["result"]["summary"]):
                label = r["label"] if r["label"] != "none" else f"keys {r['keys']}"
                print(f"  {r['protocol']:<13} {label:<22} B={r['budget']:>3} {r['policy']:<15} {r['metric']:<18} "
                      f"{r['mean']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}] n={r['n']}")
    except AlreadyDeleted as e:
        print(f"forgetful: nothing to do: {e}")
        return 0
    except (ExtractionError, ValueError, WorkspaceLocked, DeletionFailed, KeyError) as e:
        print(f"forgetful: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
