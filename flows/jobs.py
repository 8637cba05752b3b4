"""The main job as plain functions: generate (if needed) -> extract -> evaluate -> report."""
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from cohorts.definitions import load_config
from cohorts.evaluation import DEFAULT_BUDGETS, DEFAULT_FRACTIONS, aggregate, run_sweep
from cohorts.streams import evaluation_streams
from pipeline.extract import extract
from pipeline.generate import GeneratorConfig, generate
from reports.html import render_report


def code_version():
    try:
        v = version("forgetful")
    except PackageNotFoundError:
        v = "unknown"
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return f"{v}+{rev}" if rev else v


def evaluate_store(store, cfg=None, budgets=DEFAULT_BUDGETS, fractions=DEFAULT_FRACTIONS, workers=None,
                   max_events=None, gamma=0.5, source_label=""):
    cfg = cfg or load_config()
    t0 = time.perf_counter()
    streams, cohort = evaluation_streams(store, cfg, max_events=max_events)
    if not streams:
        raise ValueError(f"the cohort of {store} has no evaluation stay")
    rows = run_sweep(streams, budgets=budgets, fractions=fractions, gamma=gamma, workers=workers)
    summary, paired = aggregate(rows)
    metadata = {"data_source": source_label or str(store), "code_version": code_version(),
                "budgets": list(budgets), "fractions": list(fractions), "kernel_gamma": gamma,
                "sv_rule": "C = 1/(0.5 B); evict the reserve token with the largest slack; "
                           "fallback: exact decrement of the smallest-coefficient active token (uncertified)",
                "max_events_per_stay": max_events, "seconds": round(time.perf_counter() - t0, 2),
                "generated_at": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    return {"summary": summary, "paired": paired, "cohort": cohort, "metadata": metadata}


def run_main(out, source=None, n_patients=60, **evaluate_kwargs):
    """The README's main job. Without ``source`` the embedded generator writes the default data first."""
    out = Path(out)
    if source is None:
        source = generate(out / "source", GeneratorConfig(n_patients=n_patients))
        label = f"embedded generator ({n_patients} patients, deterministic)"
    else:
        label = str(source)
    store = out / "store"
    extract(source, store)
    result = evaluate_store(store, source_label=label, **evaluate_kwargs)
    return render_report(result, out), result
