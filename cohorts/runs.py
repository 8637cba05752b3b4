"""The steps of a scheduled run as plain functions over a workspace: evaluate, update the cohort memory.

Each persists what it produces (per-stay results and memories, cohort-memory checkpoints) and returns only
aggregates or paths, so the flows that compose them carry no patient-level data in their results.
"""
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from memory.cohort import CohortMemory
from pipeline.keys import EventKeyer

from .definitions import load_config
from .streams import cohort_event_stream

# Per-stay SV memories are persisted at this budget (or at the largest fixed budget of a run without it).
HEADLINE_BUDGET = 64


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


def run_metadata(ws, budgets, fractions, max_events, memory_budget, seconds):
    return {"data_source": str(ws.store), "code_version": code_version(), "budgets": list(budgets),
            "fractions": list(fractions),
            "fraction_budget_rule": f"round(fraction * stay events), at least 4, at most {max(budgets)} "
                                    "(the largest fixed budget)" if len(budgets) else "round(fraction * stay events)",
            "per_stay_memories_budget": memory_budget,
            "max_events_per_stay": max_events, "store_generation": ws.generation(), "seconds": round(seconds, 2),
            "generated_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "sv_rule": "C = 1/(0.5 B); evict the reserve token with the largest slack; fallback: exact decrement "
                       "of the smallest-coefficient active token (uncertified)"}


def update_cohort_memory(ws, cfg=None, budget=128, gamma=0.5):
    """Resume the cohort memory from its latest checkpoint, feed the events it has not seen, checkpoint it."""
    cfg = cfg or load_config()
    ckpts = ws.checkpoints()
    if ckpts:
        mem = CohortMemory.load(ckpts[-1])
        keyer = EventKeyer.load(ckpts[-1] / "keyer.parquet")
    else:
        mem, keyer = CohortMemory(budget=budget, gamma=gamma), None
    keyer, keys, ids, order, _ = cohort_event_stream(ws.store, cfg, keyer=keyer, after=mem.watermark)
    mem.feed(keys, ids, order)
    seq = int(ckpts[-1].name.split("-")[0]) + 1 if ckpts else 0
    target = ws.cohort_checkpoints / f"{seq:06d}-{time.strftime('%Y%m%dT%H%M%S')}"
    target.parent.mkdir(parents=True, exist_ok=True)
    mem.save(target)
    keyer.save(target / "keyer.parquet")
    return {"checkpoint": target.name, "fed": len(ids), "tokens": mem.memory.n_tokens,
            "certified_evictions": mem.policy.certified, "uncertified_evictions": mem.policy.uncertified}
