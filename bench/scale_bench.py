"""The whole scheduled run at real per-stay volumes and growing cohort sizes, phase by phase.

    python bench/scale_bench.py [--fractions 0.01,0.03] [--clones K] [--dask-at 0.03] [--no-delete]
                                [--batch 10] [--work DIR]

For each fraction of MIMIC-IV v3.1's 94,458 ICU stays (1 % is about 945), or at ``--clones`` copies of the demo,
the open demo cloned with fresh ids
(``bench/scale_source.py``) is run through ``forgetful run`` (the CLI, as a user runs it: its own Prefect
server, the process pool) while the RSS of the whole process tree (the CLI, its workers, the Prefect server)
is sampled every 0.2 s. Printed per size: each phase's seconds and peak RSS (from the run's
``run_phases.json``); then a rerun with no new rows and a rerun after about 1 % new rows (new patients and
late chart rows), beside the first run's time; at ``--dask-at`` the same first run on a local 2-worker Dask
cluster; at the largest size ``forgetful delete``: a decrement of one patient, a replay of one and one replay of
``--batch`` patients in one command, each as a command of its own and sent to a serving process (``forgetful
serve``'s deletion desk), beside the first run. Last, each phase's growth exponent (the log-log slope
between the two largest sizes; between the two smallest beside it) and its extrapolation to all of v3.1 (and to
2.2, a second line), the time on 16 and 64 cores with scoring on Dask, and every figure as JSON in WORK.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_source import (MIMIC_IV_2_2_ICU_STAYS, MIMIC_IV_ICU_STAYS, add_new_rows, clones_for,  # noqa: E402
                          make_source)

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT.parent / "shared" / "data" / "mimic-iv-demo"
PHASES = ("extract", "tokens", "labels", "scoring", "statistics", "cohort memory", "report")
FORGETFUL = [sys.executable, "-m", "flows.cli"]


class TreeRSS(threading.Thread):
    """Samples the summed RSS of a process and all its descendants."""

    def __init__(self, pid: int, every: float = 0.2):
        super().__init__(daemon=True)
        self.pid, self.every, self.samples, self.stop = pid, every, [], threading.Event()

    def run(self):
        try:
            root = psutil.Process(self.pid)
        except psutil.NoSuchProcess:
            return
        while not self.stop.is_set():
            total = 0
            try:
                for p in [root] + root.children(recursive=True):
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
            except psutil.Error:
                break
            self.samples.append((time.time(), total))
            time.sleep(self.every)

    def peak(self, start: float = 0.0, end: float = math.inf) -> float:
        vals = [r for t, r in self.samples if start <= t <= end]
        return max(vals) / 2**30 if vals else float("nan")


def forgetful(args: list[str], env: dict) -> tuple[float, TreeRSS, str]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(FORGETFUL + args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    mon = TreeRSS(proc.pid)
    mon.start()
    out, _ = proc.communicate()
    mon.stop.set()
    mon.join()
    if proc.returncode != 0:
        raise SystemExit(f"forgetful {' '.join(args)} failed ({proc.returncode}):\n{out[-3000:]}")
    return time.perf_counter() - t0, mon, out


def phase_table(ws: Path, mon: TreeRSS) -> dict:
    """phase -> (seconds, peak GiB of the process tree during it)."""
    out = {}
    for p in json.loads((ws / "run_phases.json").read_text()):
        name = next((ph for ph in PHASES if p["phase"].startswith(ph)), None)
        if name is None:
            continue
        s, g = out.get(name, (0.0, 0.0))
        out[name] = (s + p["end"] - p["start"], max(g, mon.peak(p["start"], p["end"])))
    return out


def extract_split(ws: Path) -> list[tuple[str, float]]:
    """The extraction's own steps (those recorded inside its phase) with their seconds, in the order they ran."""
    rows = json.loads((ws / "run_phases.json").read_text())
    outer = next((p for p in rows if p["phase"] == "extract"), None)
    if outer is None:
        return []
    inner = [p for p in rows if p is not outer and outer["start"] <= p["start"] and p["end"] <= outer["end"]]
    return [(p["phase"], p["end"] - p["start"]) for p in sorted(inner, key=lambda p: p["start"])]


def bench_env(work: Path) -> dict:
    """The environment the bench's commands run in: their own Prefect server and PREFECT_HOME, a hash key and a
    signing key made once in ``work`` (outside every workspace), this checkout on the path; the bench's own
    process reads the same hash key."""
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PREFECT_HOME=str(work / "prefect-home"), FORGETFUL_HASH_KEY_FILE=str(work / "hash.key"),
               FORGETFUL_SIGNING_KEY_FILE=str(work / "signing.key"), PYTHONPATH=str(ROOT))
    env.pop("PREFECT_API_URL", None)
    env.pop("FORGETFUL_HASH_KEY", None)
    if not (work / "hash.key").exists():
        subprocess.run(FORGETFUL + ["keygen", str(work / "hash.key")], cwd=ROOT, env=env, check=True)
    if not (work / "signing.key").exists():
        subprocess.run(FORGETFUL + ["keygen", str(work / "signing.key"), "--signing"], cwd=ROOT, env=env, check=True)
    # the bench itself names patients by the keyed reference the commands' workspaces use
    os.environ.pop("FORGETFUL_HASH_KEY", None)
    os.environ["FORGETFUL_HASH_KEY_FILE"] = env["FORGETFUL_HASH_KEY_FILE"]
    print(f"{os.cpu_count()} cores; work in {work}")
    return env


def demo_run(work: Path | None, prefix: str) -> tuple[Path, dict, Path, float] | None:
    """``forgetful run`` on the real demo into a fresh ``WORK/full`` (WORK: a temp dir when None): the work folder,
    the commands' environment, the workspace and the run's seconds; None, saying so, without the demo."""
    if not DEMO.exists():
        print(f"skipped: the MIMIC-IV demo is not at {DEMO} (see shared/data/README.md)")
        return None
    work = work or Path(tempfile.mkdtemp(prefix=prefix))
    env = bench_env(work)
    full = work / "full"
    shutil.rmtree(full, ignore_errors=True)
    secs, _, _ = forgetful(["run", "--out", str(full), "--source", str(DEMO)], env)
    return work, env, full, secs


def run_size(demo: Path, fraction: float, work: Path, env: dict, task_runner: str = "process",
             reruns: bool = True, clones: int | None = None) -> dict:
    k = clones or clones_for(demo, round(fraction * MIMIC_IV_ICU_STAYS))
    fraction = k * 140 / MIMIC_IV_ICU_STAYS
    src = make_source(demo, work / f"src-{k}", k, folders=True)
    ws = work / f"ws-{k}-{task_runner}"
    shutil.rmtree(ws, ignore_errors=True)
    args = ["run", "--out", str(ws), "--source", str(src), "--task-runner", task_runner]
    wall, mon, _ = forgetful(args, env)
    res = {"fraction": fraction, "clones": k, "stays": k * 140, "wall": wall, "peak": mon.peak(),
           "phases": phase_table(ws, mon), "ws": ws, "task_runner": task_runner}
    print(f"\n{fraction:.1%} of MIMIC-IV v3.1 ({k} demo copies, ~{k * 140} ICU stays), task runner {task_runner}: "
          f"whole run {wall:.1f} s, peak RSS {res['peak']:.2f} GiB", flush=True)
    for ph in PHASES:
        s, g = res["phases"].get(ph, (float("nan"), float("nan")))
        print(f"  {ph:14s} {s:8.1f} s   peak {g:5.2f} GiB", flush=True)
        if ph == "extract":
            res["extract_split"] = extract_split(ws)
            for name, secs in res["extract_split"]:
                print(f"      {name:55s} {secs:7.1f} s", flush=True)
    if reruns:
        again, mon2, _ = forgetful(args, env)
        newer = add_new_rows(demo, src, work / f"src-{k}-plus", k)
        later, mon3, _ = forgetful(["run", "--out", str(ws), "--source", str(newer), "--task-runner", task_runner],
                                   env)
        res.update(rerun=again, rerun_new=later)
        print(f"  rerun, no new rows:      {again:7.1f} s ({again / wall:.1%} of the first run), peak "
              f"{mon2.peak():.2f} GiB", flush=True)
        print(f"  rerun after ~1 % new rows: {later:7.1f} s ({later / wall:.1%} of the first run), peak "
              f"{mon3.peak():.2f} GiB", flush=True)
    return res


NEVER = "0 2 29 2 *"     # a cron schedule whose run never falls inside a bench (the night of a 29 February)


class Served:
    """``forgetful serve`` on a workspace until its deletion desk answers (:mod:`flows.deletion_desk`): a
    ``forgetful delete`` then runs in that process, warm."""

    def __init__(self, ws: Path, env: dict):
        self.log = ws.with_name(ws.name + ".serve.log")
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(FORGETFUL + ["serve", "--out", str(ws), "--cron", NEVER], cwd=ROOT, env=env,
                                         stdout=out, stderr=subprocess.STDOUT)
        # started: its desk answers and Prefect's runner polls for the scheduled run (a serving process runs for
        # months; its start, which would compete with the first request for the 2 cores, is not a deletion's)
        deadline = time.monotonic() + 600
        while not all(line in self.log.read_text() for line in ("deletion desk answers", "is being served")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"forgetful serve did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        time.sleep(1.0)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)
        self.log.unlink(missing_ok=True)


def time_deletions(ws: Path, env: dict, first_run: float, batch: int = 10) -> dict:
    """``forgetful delete`` on copies of ``ws``: a decrement of one evaluation patient (their tokens are in the
    cohort memory, so both modes have work to do), a replay of them, and one replay of ``batch`` patients in one
    command; each as a command of its own and sent to a serving process (``forgetful serve`` on the copy, its
    deletion desk open: the command hands the request over), beside the first run's ``first_run`` seconds.
    Peak RSS: of the command's process tree, and of the serving process's while it deletes."""
    from deletion.plan import scored_subjects
    from pipeline.workspace import Workspace
    subjects = scored_subjects(Workspace(ws))
    one, out = {}, {}
    for mode, sids in (("decrement", subjects[:1]), ("replay", subjects[:1]), ("replay", subjects[:batch])):
        for served in (False, True):
            copy = ws.with_name(ws.name + f"-del-{mode}-{len(sids)}")
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(ws, copy)
            server = Served(copy, env) if served else None
            serving = TreeRSS(server.proc.pid) if served else None
            if serving is not None:
                serving.start()
            ids = [a for s in sids for a in ("--subject-id", str(s))]
            try:
                secs, mon, text = forgetful(["delete", "--out", str(copy), *ids, "--mode", mode], env)
            finally:
                if server is not None:
                    serving.stop.set()
                    serving.join()
                    server.close()
            if served and "sent to the process serving" not in text:
                raise SystemExit(f"the deletion did not go to the serving process:\n{text[-2000:]}")
            how = "sent to a serving process" if served else "as a command"
            one[served] = secs if mode == "replay" and len(sids) == 1 else one.get(served)
            than_one = f", {secs / one[served]:.2f}x one replay" if mode == "replay" and len(sids) > 1 else ""
            peak = (serving if served else mon).peak()
            print(f"  forgetful delete --mode {mode:9s} of {len(sids):2d} patient(s), {how:25s}: {secs:6.1f} s "
                  f"({secs / first_run:.1%} of the first run{than_one}), peak RSS {peak:.2f} GiB", flush=True)
            out[f"{mode} {len(sids)} {'served' if served else 'command'}"] = secs
            shutil.rmtree(copy, ignore_errors=True)
    return out


def growth(results: list[dict]) -> dict:
    """Each phase's growth exponent between the two largest sizes (beside it, between the two smallest when
    there are three or more) and its extrapolation from the largest to 100 %; returns phase -> (exponent,
    seconds at v3.1)."""
    if len(results) < 2:
        return {}
    a, b = results[-2], results[-1]
    low = (results[0], results[1]) if len(results) > 2 else None

    def exponent(x: dict, y: dict, ph: str) -> float:
        tx = x["wall"] if ph == "whole run" else x["phases"].get(ph, (0, 0))[0]
        ty = y["wall"] if ph == "whole run" else y["phases"].get(ph, (0, 0))[0]
        return math.log(ty / tx) / math.log(y["stays"] / x["stays"]) if tx > 0 and ty > 0 else float("nan")
    print(f"\ngrowth from {a['stays']} to {b['stays']} stays" +
          (f" ({low[0]['stays']} to {low[1]['stays']} in brackets)" if low else "") +
          f", extrapolated to MIMIC-IV v3.1's {MIMIC_IV_ICU_STAYS} stays (2.2's {MIMIC_IV_2_2_ICU_STAYS} in brackets):")
    scale, scale_22 = MIMIC_IV_ICU_STAYS / b["stays"], MIMIC_IV_2_2_ICU_STAYS / b["stays"]
    total = total_22 = 0.0
    out = {}
    for ph in PHASES + ("whole run",):
        ta = a["wall"] if ph == "whole run" else a["phases"].get(ph, (0, 0))[0]
        tb = b["wall"] if ph == "whole run" else b["phases"].get(ph, (0, 0))[0]
        if ta <= 0 or tb <= 0:
            continue
        e = exponent(a, b, ph)
        first = f" ({exponent(*low, ph):5.2f})" if low else ""
        full, full_22 = tb * scale ** max(e, 0.0), tb * scale_22 ** max(e, 0.0)
        total += full if ph != "whole run" else 0.0
        total_22 += full_22 if ph != "whole run" else 0.0
        out[ph] = (e, full)
        print(f"  {ph:14s} exponent {e:5.2f}{first}   {tb:8.1f} s -> {full / 60:7.1f} min at 100 % "
              f"({full_22 / 60:.1f})")
    print(f"  the phases' extrapolations summed: {total / 3600:.2f} h ({total_22 / 3600:.2f} h for 2.2); the goal, "
          f"2 h on 2 cores: {'met' if total <= 7200 else f'missed by {(total - 7200) / 3600:.2f} h'} (the cohort "
          f"memory runs beside scoring: counted apart, the sum is an upper bound)")
    print(f"  peak RSS: {a['peak']:.2f} GiB at {a['stays']} stays, {b['peak']:.2f} GiB at {b['stays']} stays")
    return out


def scale_out(full: dict, process: dict, dask: dict, cores=(16, 64)) -> None:
    """All of v3.1 on more cores, from the extrapolations ``full`` (phase -> (exponent, seconds on 2 cores)): only
    scoring leaves the flow's machine; it is divided over the workers, times the measured cost of separate
    Dask worker processes against the process pool at one size (``dask`` and ``process`` at the same stays).
    The other phases are taken as measured on 2 cores (DuckDB's extraction would use more of the flow
    machine's cores; not measured here)."""
    if "scoring" not in full or "scoring" not in dask["phases"] or "scoring" not in process["phases"]:
        return
    overhead = dask["phases"]["scoring"][0] / process["phases"]["scoring"][0]
    stay = sum(s for ph, (_, s) in full.items() if ph not in ("scoring", "whole run"))
    print(f"\nscale-out: scoring on a Dask cluster of separate worker processes took {overhead:.2f}x the process "
          f"pool's time at {dask['stays']} stays (2 workers each); the other phases stay on the flow's machine "
          f"({stay / 60:.0f} min extrapolated on 2 cores)")
    for c in cores:
        scoring = full["scoring"][1] * 2 / c * overhead
        print(f"  {c:3d} cores: scoring {scoring / 60:6.1f} min + flow machine {stay / 60:.0f} min = "
              f"{(scoring + stay) / 3600:.2f} h for all of v3.1 (assumes scoring's chunks keep every worker busy)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fractions", default="0.01,0.03", help="fractions of MIMIC-IV's ICU stays (0.1 for the note)")
    ap.add_argument("--dask-at", type=float, default=0.03, help="the fraction also run on a local Dask cluster "
                                                                "(0: none)")
    ap.add_argument("--clones", type=int, default=None, help="run at this many demo copies instead of --fractions")
    ap.add_argument("--batch", type=int, default=10, help="patients of the batch deletion")
    ap.add_argument("--no-delete", action="store_true", help="skip timing forgetful delete at the largest size")
    ap.add_argument("--no-reruns", action="store_true", help="skip the two incremental reruns")
    ap.add_argument("--delete-only", type=Path, default=None, help="only time forgetful delete on this workspace")
    ap.add_argument("--work", type=Path, default=None, help="where sources and workspaces go (default: a temp dir)")
    ap.add_argument("--demo", type=Path, default=DEMO, help="the MIMIC-IV demo (CSV layout) to clone")
    a = ap.parse_args(argv)
    if not a.demo.exists():
        print(f"skipped: the MIMIC-IV demo is not at {a.demo} (see shared/data/README.md)")
        return
    work = a.work or Path(tempfile.mkdtemp(prefix="forgetful-scale-"))
    env = bench_env(work)
    if a.delete_only:
        time_deletions(a.delete_only, env, float("nan"), a.batch)
        return
    fractions = sorted(float(f) for f in a.fractions.split(","))
    results = [run_size(a.demo, f, work, env, reruns=not a.no_reruns) for f in fractions] if a.clones is None else \
        [run_size(a.demo, 0.0, work, env, reruns=not a.no_reruns, clones=a.clones)]
    if not a.no_delete:
        print(f"\ndeletion at {results[-1]['stays']} stays:")
        results[-1]["deletions"] = time_deletions(results[-1]["ws"], env, results[-1]["wall"], a.batch)
    dask = run_size(a.demo, a.dask_at, work, env, task_runner="dask", reruns=False) if a.dask_at else None
    full = growth(results)
    same = next((r for r in results if dask is not None and r["stays"] == dask["stays"]), None)
    if same is not None:
        scale_out(full, same, dask)
    saved = work / "scale_results.json"
    saved.write_text(json.dumps([{**r, "ws": str(r["ws"])} for r in results + ([dask] if dask else [])], indent=1))
    print(f"\nthe figures above, as JSON: {saved}")


if __name__ == "__main__":
    main()
