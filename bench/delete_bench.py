"""Per-patient deletion vs re-running the pipeline without the patient, measured side by side.

    python bench/delete_bench.py [--patients 40] [--deletions 5]

Both sides call the run the flows call (``run.evaluate``, raw-events mode; no Prefect server start in either
timing): the re-run extracts the source without the patient, re-scores every evaluation stay and rebuilds the
cohort memory.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("FORGETFUL_HASH_KEY", "bench-key-not-secret-0123456789abcdef")

from cohorts.definitions import load_config  # noqa: E402
from deletion import delete_subject  # noqa: E402
from deletion.plan import scored_subjects  # noqa: E402
from pipeline.evidence import SIGNING_KEY_ENV, write_signing_key  # noqa: E402
from pipeline.extract import extract  # noqa: E402
from pipeline.generate import GeneratorConfig, generate  # noqa: E402
from pipeline.privacy import SUPPRESSED_FILE, keyed_hash, load_key  # noqa: E402
from pipeline.workspace import Workspace  # noqa: E402
from run.cohort_memory import update_cohort_memory  # noqa: E402
from run.evaluate import evaluate  # noqa: E402
from run.params import RunParams  # noqa: E402

PARAMS = RunParams(budgets=(16, 64), fractions=(), tokens="events", encoder_steps=0, cohort_budget=128)


def pipeline(ws, source, key, deleted=None):
    """The run's steps; ``deleted``: a subject on the store's suppression list, as a deletion leaves it."""
    if deleted is not None:
        ws.store.mkdir(parents=True)
        (ws.store / SUPPRESSED_FILE).write_text(json.dumps([keyed_hash(deleted, key)]))
    extract(source, ws.store, key=key)
    cfg = load_config()
    evaluate(ws, PARAMS, cfg=cfg)
    update_cohort_memory(ws, cfg, budget=PARAMS.cohort_budget, tokens=PARAMS.tokens)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--patients", type=int, default=40)
    ap.add_argument("--deletions", type=int, default=5)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="delete-bench-"))
    if not os.environ.get(SIGNING_KEY_ENV):       # the log's signing key, outside every workspace of the bench
        os.environ[SIGNING_KEY_ENV] = str(write_signing_key(work / "keys" / "signing.pem"))
    source = generate(work / "source", GeneratorConfig(n_patients=args.patients, seed=11))
    base = Workspace(work / "base")
    t0 = time.perf_counter()
    key = load_key()
    pipeline(base, source, key)
    t_full = time.perf_counter() - t0
    subjects = scored_subjects(base)[:args.deletions]
    t_del, t_rerun = [], []
    for i, sid in enumerate(subjects):
        ws = Workspace(work / f"del{i}")
        shutil.copytree(base.root, ws.root)
        t0 = time.perf_counter()
        cert, _ = delete_subject(ws, sid)
        t_del.append(time.perf_counter() - t0)
        assert all(v["passed"] for v in cert.verification.values())
        fresh = Workspace(work / f"rerun{i}")
        t0 = time.perf_counter()
        pipeline(fresh, source, key, deleted=sid)
        t_rerun.append(time.perf_counter() - t0)
    d, r = sorted(t_del)[len(t_del) // 2], sorted(t_rerun)[len(t_rerun) // 2]
    print(f"{args.patients} patients, budgets {PARAMS.budgets}, cohort memory budget {PARAMS.cohort_budget}; first "
          f"full run {t_full:.1f} s")
    print(f"deletion per patient (median of {len(t_del)}): {d:.2f} s   re-run without the patient: {r:.2f} s   "
          f"ratio re-run/deletion: {r / d:.1f}x")
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
