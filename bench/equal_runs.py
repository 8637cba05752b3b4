"""Two workspaces' derived artifacts side by side: what a change of code left equal (``deletion.compare``).

    python bench/equal_runs.py BEFORE AFTER [--atol 1e-12]

Run the same command with two versions of the code into BEFORE and AFTER (``forgetful run --out ...`` on the same
source, and the same deletions after it), then this: every artifact's items compared and how many differ (store
rows, stay table, MEDS splits and codes, label files, per-stay results, per-stay memory files, token statistics,
the cohort memory's tokens and weights, report.json's numbers without the run's bookkeeping). Exit 1 when any
differs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deletion.compare import compare_workspaces  # noqa: E402
from pipeline.workspace import Workspace  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--atol", type=float, default=1e-12, help="largest difference of a number counted equal")
    a = ap.parse_args(argv)
    diffs = compare_workspaces(Workspace(a.after), Workspace(a.before), atol=a.atol)
    print(f"{'artifact':40s} {'items':>10s}  after vs before")
    for d in diffs:
        print(f"{d.artifact:40s} {d.compared:>10,}  {d.describe()}")
    return 0 if all(d.equal for d in diffs) else 1


if __name__ == "__main__":
    sys.exit(main())
