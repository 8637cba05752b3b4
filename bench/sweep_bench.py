"""Matched-budget sweep cost: per-token (or per-event) time of every policy at each budget, side by side, and the
wall time of a whole run's steps on the evaluation stays.

    python bench/sweep_bench.py [--tokens hourly|events] [--source MIMIC_DIR] [--sample-stays 6] [--workers 2]
                                [--skip-full]

``--tokens hourly`` (default): the run's steps without Prefect, each timed: extraction, token building and
labelling with the training-split choice of nu_B and sigma (``prepare_token_streams``), both protocols over
every evaluation stay on ``--workers`` processes (``score_token_streams``), the cohort memory over the whole
cohort's tokens; their sum is the token-mode run's wall time. The per-policy table streams every evaluation
stay's tokens at each budget in one process.

Default source: the MIMIC-IV demo at ../shared/data/mimic-iv-demo when present, else the embedded generator.
The per-policy table times ``score_stay`` on a sample of stays (the same events for every policy, one process);
the full sweep is ``run_sweep`` with the default budgets and fractions over every evaluation stay on
``--workers`` processes (SV selection on learned keys is not in it: that needs a trained encoder).
"""
import argparse
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cohorts.definitions import load_config  # noqa: E402
from cohorts.evaluation import balanced_chunks, run_sweep, score_stay  # noqa: E402
from cohorts.protocols import (STREAMING_POLICIES, StreamingSettings, online_kept,  # noqa: E402
                               score_token_streams, streaming_sv)
from run.cohort_memory import update_cohort_memory  # noqa: E402
from run.params import RunParams  # noqa: E402
from run.reference import prepare_token_streams  # noqa: E402
from cohorts.streams import evaluation_streams  # noqa: E402
from memory.policies import POLICIES  # noqa: E402
from pipeline.extract import extract  # noqa: E402
from pipeline.generate import GeneratorConfig, generate  # noqa: E402
from pipeline.workspace import Workspace  # noqa: E402

DEFAULTS = RunParams()     # the run's budgets and fractions

DEMO = ROOT.parent / "shared" / "data" / "mimic-iv-demo"
TABLE_BUDGETS = (8, 32, 64, 256)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--source", default=None)
    ap.add_argument("--sample-stays", type=int, default=6)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip-full", action="store_true", help="only the per-policy table")
    ap.add_argument("--tokens", choices=("hourly", "events"), default="hourly")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(args.source) if args.source else DEMO if DEMO.exists() else None
        if source is None:
            source = generate(Path(tmp) / "source", GeneratorConfig())
        print(f"source: {source}")
        t0 = time.perf_counter()
        extract(source, Path(tmp) / "store")
        t_extract = time.perf_counter() - t0
        if args.tokens == "hourly":
            return token_bench(Workspace(tmp), args, t_extract)
        streams, _ = evaluation_streams(Path(tmp) / "store", load_config())
    n_events = sum(len(s) for s in streams)
    print(f"{len(streams)} evaluation stays, {n_events} events (median "
          f"{int(np.median([len(s['keys']) for s in streams]))} per stay)")

    # A sample spread over the stay lengths, so the table is not the shortest stays only.
    by_len = sorted(streams, key=len)
    sample = [by_len[i] for i in np.linspace(0, len(by_len) - 1, min(args.sample_stays, len(by_len))).astype(int)]
    sample_events = sum(len(s) for s in sample)
    names = [p for p in POLICIES if p != "sv_learned"]
    score_stay(sample[0], 8, policy_names=("sv_certified",))  # compiled code loaded outside the timings
    print(f"\n## microseconds per event, {len(sample)} stays ({sample_events} events), one process")
    cost_table(names, lambda name, b: [score_stay(s, b, policy_names=(name,)) for s in sample], sample_events,
               "SV certified / baseline, per event")

    if not args.skip_full:
        t0 = time.perf_counter()
        rows = run_sweep(streams, DEFAULTS.budgets, DEFAULTS.fractions, workers=args.workers, policies=tuple(names))
        wall = time.perf_counter() - t0
        print(f"\n## full sweep: budgets {DEFAULTS.budgets} + fractions, {len(names)} policies, {len(streams)} stays, "
              f"{args.workers} workers: {wall:.0f} s wall ({len(rows)} result rows)")
    return 0


def cost_table(names, run, n_items, ratio_title):
    """Microseconds per item of ``run(name, budget)`` for each policy and table budget, and SV's ratios."""
    print(f"{'policy':<16}" + "".join(f"{'B=' + str(b):>10}" for b in TABLE_BUDGETS))
    per = {}
    for name in names:
        row = []
        for b in TABLE_BUDGETS:
            t0 = time.perf_counter()
            run(name, b)
            row.append((time.perf_counter() - t0) / n_items * 1e6)
        per[name] = row
        print(f"{name:<16}" + "".join(f"{v:>10.1f}" for v in row))
    print(f"{ratio_title}: " + ", ".join(f"{n} x{np.mean(np.array(per['sv_certified']) / np.array(per[n])):.1f}"
                                        for n in names if n != "sv_certified"))


def _score_chunk(chunk, settings, fixed):
    return score_token_streams(chunk, DEFAULTS.budgets, DEFAULTS.fractions, settings,
                               fixed, fraction_cap=DEFAULTS.fraction_cap)


def token_bench(ws, args, t_extract):
    cfg = load_config()
    # the compiled solver is loaded outside the timings
    streaming_sv(np.random.default_rng(0).standard_normal((40, 6)), 8, StreamingSettings())
    t0 = time.perf_counter()
    streams, settings, cohort = prepare_token_streams(ws.store, cfg)
    t_prep = time.perf_counter() - t0
    n_tokens = sum(len(s) for s in streams)
    median = int(np.median([len(s) for s in streams]))
    print(f"{len(streams)} evaluation stays, {n_tokens} hourly tokens (median {median} per stay); streaming "
          f"setting chosen on the training split: nu_B = {settings.nu}, sigma = {settings.sigma}")
    print(f"\n## microseconds per token, every evaluation stay ({n_tokens} tokens, keys: all channels), one process")

    def one(name, b):
        for s in streams:
            X = s.keys["all_channels"]
            streaming_sv(X, b, settings) if name == "sv_certified" else online_kept(name, X, b, 0)
    cost_table(STREAMING_POLICIES, one, n_tokens, "SV certified (with its certificate-expiry solve) / baseline, "
               "per token")
    if args.skip_full:
        return 0
    t0 = time.perf_counter()
    work = partial(_score_chunk, settings=settings, fixed=cfg.fixed_context)
    with ProcessPoolExecutor(max_workers=args.workers) as ex:
        rows = [r for part in ex.map(work, balanced_chunks(streams, args.workers * 4, size=len)) for r in part]
    t_score = time.perf_counter() - t0
    t0 = time.perf_counter()
    info = update_cohort_memory(ws, cfg, budget=128, tokens="hourly")
    t_cohort = time.perf_counter() - t0
    total = t_extract + t_prep + t_score + t_cohort
    print(f"\n## token-mode run steps, {args.workers} workers (no Prefect)")
    print(f"extract {t_extract:.1f} s | tokens, labels, nu_B/sigma choice {t_prep:.1f} s | both protocols, budgets "
          f"{DEFAULTS.budgets} + fractions, {len(rows)} rows {t_score:.1f} s | cohort memory ({info['fed']} tokens) "
          f"{t_cohort:.1f} s | total {total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
