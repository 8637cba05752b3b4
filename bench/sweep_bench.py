"""Matched-budget sweep cost: per-event time of every policy at each budget, side by side, and the wall time of
the whole sweep on the evaluation stays.

    python bench/sweep_bench.py [--source MIMIC_DIR] [--sample-stays 6] [--workers 2] [--skip-full]

Default source: the MIMIC-IV demo at ../shared/data/mimic-iv-demo when present, else the embedded generator.
The per-policy table times ``score_stay`` on a sample of stays (the same events for every policy, one process);
the full sweep is ``run_sweep`` with the default budgets and fractions over every evaluation stay on
``--workers`` processes (SV selection on learned keys is not in it: that needs a trained encoder).
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cohorts.definitions import load_config  # noqa: E402
from cohorts.evaluation import DEFAULT_BUDGETS, run_sweep, score_stay  # noqa: E402
from cohorts.streams import evaluation_streams  # noqa: E402
from memory.policies import POLICIES  # noqa: E402
from pipeline.extract import extract  # noqa: E402
from pipeline.generate import GeneratorConfig, generate  # noqa: E402

DEMO = ROOT.parent / "shared" / "data" / "mimic-iv-demo"
TABLE_BUDGETS = (8, 32, 64, 256)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--source", default=None)
    ap.add_argument("--sample-stays", type=int, default=6)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip-full", action="store_true", help="only the per-policy table")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(args.source) if args.source else DEMO if DEMO.exists() else None
        if source is None:
            source = generate(Path(tmp) / "source", GeneratorConfig())
        print(f"source: {source}")
        extract(source, Path(tmp) / "store")
        streams, _ = evaluation_streams(Path(tmp) / "store", load_config())
    n_events = sum(len(s["keys"]) for s in streams)
    print(f"{len(streams)} evaluation stays, {n_events} events (median "
          f"{int(np.median([len(s['keys']) for s in streams]))} per stay)")

    # A sample spread over the stay lengths, so the table is not the shortest stays only.
    by_len = sorted(streams, key=lambda s: len(s["keys"]))
    sample = [by_len[i] for i in np.linspace(0, len(by_len) - 1, min(args.sample_stays, len(by_len))).astype(int)]
    sample_events = sum(len(s["keys"]) for s in sample)
    names = [p for p in POLICIES if p != "sv_learned"]
    score_stay(sample[0], 8, policy_names=("sv_certified",))  # compiled code loaded outside the timings
    print(f"\n## microseconds per event, {len(sample)} stays ({sample_events} events), one process")
    print(f"{'policy':<16}" + "".join(f"{'B=' + str(b):>10}" for b in TABLE_BUDGETS))
    per = {}
    for name in names:
        row = []
        for b in TABLE_BUDGETS:
            t0 = time.perf_counter()
            for s in sample:
                score_stay(s, b, policy_names=(name,))
            row.append((time.perf_counter() - t0) / sample_events * 1e6)
        per[name] = row
        print(f"{name:<16}" + "".join(f"{v:>10.1f}" for v in row))
    print("SV certified / baseline, per event: " + ", ".join(
        f"{n} x{np.mean(np.array(per['sv_certified']) / np.array(per[n])):.1f}" for n in names if n != "sv_certified"))

    if not args.skip_full:
        t0 = time.perf_counter()
        rows = run_sweep(streams, workers=args.workers, policies=tuple(names))
        wall = time.perf_counter() - t0
        print(f"\n## full sweep: budgets {DEFAULT_BUDGETS} + fractions, {len(names)} policies, {len(streams)} stays, "
              f"{args.workers} workers: {wall:.0f} s wall ({len(rows)} result rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
