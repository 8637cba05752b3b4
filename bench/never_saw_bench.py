"""Deletion against never having seen the patient, on the real MIMIC-IV demo, artifact by artifact.

    python bench/never_saw_bench.py [--work DIR]

``forgetful run`` on the demo (the CLI with its defaults, as a user runs it); then, for the training-split subject
with most events and the evaluation-split subject with most tokens in the cohort memory: ``forgetful run`` on the
demo without any row of theirs, and ``forgetful delete`` of them in replay and in decrement mode on copies of the
first workspace. Printed per subject: each derived artifact's items compared and how many differ from the
never-saw run, for both modes (``deletion.compare``), and each command's seconds.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from collections import Counter
from pathlib import Path

import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scale_bench import DEMO, demo_run, forgetful  # noqa: E402
from scale_source import without_subject  # noqa: E402

from cohorts.definitions import is_eval_subject, workspace_config  # noqa: E402
from deletion.compare import compare_workspaces  # noqa: E402
from deletion.plan import scored_subjects  # noqa: E402
from memory.cohort import CohortMemory, owner_of  # noqa: E402
from pipeline.meds import shard_files  # noqa: E402
from pipeline.privacy import store_key, subject_ref  # noqa: E402
from pipeline.workspace import Workspace  # noqa: E402

MODES = ("replay", "decrement")


def subjects_that_matter(ws: Workspace) -> dict[str, int]:
    """Per split, the subject whose deletion reaches most: in the training split the one with most events (what
    the vocabulary and a fitted scaling are computed from), in the evaluation split the one with most tokens in
    the latest cohort memory."""
    cfg, key = workspace_config(ws.root), store_key(ws.store, ws.root)
    events = (pl.scan_parquet(shard_files(ws.store)).group_by("subject_id").len()
              .join(pl.scan_parquet(ws.store / "stays.parquet").select("subject_id").unique(), on="subject_id")
              .sort(["len", "subject_id"], descending=[True, False]).collect())
    training = next(s for s in events["subject_id"].to_list() if not is_eval_subject(s, cfg))
    held = Counter(owner_of(t) for t in CohortMemory.load(ws.checkpoints()[-1]).memory.token_ids())
    evaluation = max(scored_subjects(ws), key=lambda s: (held[subject_ref(s, key)], -s))
    return {"training": training, "evaluation": evaluation}


def deleted_copy(full: Path, dest: Path, sid: int, mode: str, env: dict) -> tuple[Workspace | None, str]:
    """A copy of ``full`` with the subject deleted in ``mode``, or None and the refusal's last line."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(full, dest)
    try:
        secs, _, _ = forgetful(["delete", "--out", str(dest), "--subject-id", str(sid), "--mode", mode], env)
    except SystemExit as refused:   # decrement may be refused (the fixed-C memory cannot lose that many tokens)
        return None, str(refused).strip().splitlines()[-1]
    return Workspace(dest), f"{secs:.1f} s"


def compare_subject(full: Path, work: Path, split: str, sid: int, env: dict) -> None:
    never = work / f"never-{split}"
    shutil.rmtree(never, ignore_errors=True)
    secs, _, _ = forgetful(["run", "--out", str(never), "--source",
                            str(without_subject(DEMO, work / f"source-without-{split}", sid))], env)
    print(f"\n{split}-split subject: run without them {secs:.1f} s", flush=True)
    table = {}
    for mode in MODES:
        ws, said = deleted_copy(full, work / f"deleted-{split}-{mode}", sid, mode, env)
        print(f"  forgetful delete --mode {mode}: {said}", flush=True)
        if ws is not None:
            table[mode] = {d.artifact: d for d in compare_workspaces(ws, Workspace(never))}
    artifacts = next(iter(table.values()), {})
    print(f"  {'artifact':40s}" + "".join(f"{m + ' vs never-saw':>36s}" for m in table))
    for name in artifacts:
        cells = []
        for mode in table:
            cells.append(table[mode][name].describe())
        print(f"  {name:40s}" + "".join(f"{c:>36s}" for c in cells), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=None, help="where sources and workspaces go (default: a temp dir)")
    a = ap.parse_args(argv)
    made = demo_run(a.work, "forgetful-never-saw-")
    if made is None:
        return
    work, env, full, secs = made
    print(f"run on the demo: {secs:.1f} s", flush=True)
    for split, sid in subjects_that_matter(Workspace(full)).items():
        compare_subject(full, work, split, sid, env)


if __name__ == "__main__":
    main()
