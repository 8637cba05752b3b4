"""The ``forgetful`` command line."""
import argparse
import json
import sys

from pipeline.extract import ExtractionError, extract


def _budgets(text):
    return tuple(int(b) for b in text.split(",") if b)


def _fractions(text):
    return tuple(float(f) for f in text.split(",") if f)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="forgetful", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("extract", help="extract a MIMIC-IV directory into a parquet event store")
    ex.add_argument("--source", required=True)
    ex.add_argument("--out", required=True)
    ex.add_argument("--memory-limit", default="4GB")
    run = sub.add_parser("run", help="main job: (generate) -> extract -> budget sweep -> HTML report")
    run.add_argument("--out", default="out")
    run.add_argument("--source", default=None, help="MIMIC-IV directory (default: the embedded generator)")
    run.add_argument("--budgets", type=_budgets, default=(8, 16, 32, 64, 128, 256))
    run.add_argument("--fractions", type=_fractions, default=(0.05, 0.1, 0.2))
    run.add_argument("--max-events", type=int, default=None, help="keep the first N events of each stay")
    run.add_argument("--workers", type=int, default=None)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "extract":
            s = extract(args.source, args.out, memory_limit=args.memory_limit)
            print(json.dumps({"new_events": s.new_events, "total_events": s.total_events,
                              "quarantined": {t: v.get("quarantined", {}) for t, v in s.tables.items()}}, indent=1))
        elif args.cmd == "run":
            from flows.jobs import run_main
            path, result = run_main(args.out, source=args.source, budgets=args.budgets, fractions=args.fractions,
                                    max_events=args.max_events, workers=args.workers)
            print(f"report: {path}")
            for r in result["summary"]:
                if r["metric"] in ("det_retention_end", "rare_recall") and r["budget"] in ("32", "64"):
                    print(f"  B={r['budget']:>3} {r['policy']:<15} {r['metric']:<20} {r['mean']:.3f} "
                          f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}] n={r['n']}")
    except (ExtractionError, ValueError) as e:
        print(f"forgetful: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
