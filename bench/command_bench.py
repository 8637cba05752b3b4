"""What a command costs before and around its work, on the real MIMIC-IV demo through the CLI.

    python bench/command_bench.py [--repeats 3] [--work DIR]

``forgetful run`` on the demo (defaults, as a user runs it), then ``--repeats`` times each: a rerun with no new
rows, and a decrement deletion of a scored patient (a different one each time), both as ``forgetful delete``
prints its certificate by default and with ``--no-replay-comparison``. Printed: wall seconds of each command
(median, min, max) beside the first run's, and for the rerun the seconds of its phases (work) and the rest
(start-up, Prefect's server and flow runs, exit). Each command starts its own temporary Prefect server, as a
command does on a workstation without a configured PREFECT_API_URL.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scale_bench import DEMO, demo_run, forgetful  # noqa: E402

from deletion.plan import scored_subjects  # noqa: E402
from pipeline.workspace import Workspace  # noqa: E402


def phase_seconds(ws: Path) -> float:
    """Seconds inside the last run's recorded phases (its work)."""
    return sum(p["end"] - p["start"] for p in json.loads((ws / "run_phases.json").read_text()))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.1f} s (min {min(values):.1f}, max {max(values):.1f})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=None, help="where workspaces go (default: a temp dir)")
    a = ap.parse_args(argv)
    made = demo_run(a.work, "forgetful-command-bench-")
    if made is None:
        return
    work, env, full, first = made
    reruns, work_s = [], []
    for _ in range(a.repeats):
        secs, _, _ = forgetful(["run", "--out", str(full), "--source", str(DEMO)], env)
        reruns.append(secs)
        work_s.append(phase_seconds(full))
    subjects = scored_subjects(Workspace(full))
    deletions = {"decrement": [], "decrement --no-replay-comparison": []}
    for i in range(a.repeats):
        for j, (name, extra) in enumerate((("decrement", []),
                                           ("decrement --no-replay-comparison", ["--no-replay-comparison"]))):
            ws = work / f"delete-{i}-{j}"
            shutil.rmtree(ws, ignore_errors=True)
            shutil.copytree(full, ws)
            secs, _, _ = forgetful(["delete", "--out", str(ws), "--subject-id", str(subjects[i]), "--mode",
                                    "decrement", *extra], env)
            deletions[name].append(secs)
            shutil.rmtree(ws)
    print(f"\nforgetful on the MIMIC-IV demo, wall seconds, {a.repeats} repeats:")
    print(f"  first run                               {first:6.1f} s  (1.00)")
    print(f"  rerun, no new rows                      {spread(reruns)}  ({statistics.median(reruns) / first:.2f} of "
          f"the first run; its phases {statistics.median(work_s):.1f} s, the rest "
          f"{statistics.median(reruns) - statistics.median(work_s):.1f} s)")
    for name, values in deletions.items():
        print(f"  delete --mode {name:26s}{spread(values)}  ({statistics.median(values) / first:.2f} of the first "
              f"run)")


if __name__ == "__main__":
    main()
