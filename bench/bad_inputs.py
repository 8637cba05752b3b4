"""Every bad input an audit tried, through the CLI as a user meets it: each one's exit status, how many lines it
printed and its last line.

    python bench/bad_inputs.py [--work DIR]

Sources are the embedded generator's MIMIC-IV-shaped data and MEDS datasets built from it, each damaged one way;
the deletion-evidence cases damage a workspace that has issued a certificate. A case passes when the command says
what went wrong in exactly one line, its last (a run may have printed its progress before), with no traceback, and
exits with the status a user can act on: 2 (0 for "nothing to do"; 1 for verify's verdict that the log it read is
corrupt or tampered with, a finding rather than an input it could not read). A case marked "completes" (a
malformed row, a lost store) passes when the command completes (exit 0) without a traceback and, where it names
one, says the line it must (the deleted patients it left out).
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scale_bench import FORGETFUL, ROOT, bench_env  # noqa: E402

from cohorts.definitions import DEFAULT_CONFIG  # noqa: E402
from pipeline.generate import GeneratorConfig, generate  # noqa: E402


def cli(args: list[str], env: dict) -> tuple[int, list[str]]:
    p = subprocess.run(FORGETFUL + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return p.returncode, [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]


def damaged_copy(src: Path, dest: Path, edit) -> Path:
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest)
    edit(dest)
    return dest


def config_with(work: Path, name: str, edit) -> str:
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    edit(cfg)
    path = work / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def meds_dataset(dest: Path, frame, metadata: bool = True) -> Path:
    (dest / "data").mkdir(parents=True, exist_ok=True)
    frame.write_parquet(dest / "data" / "0.parquet")
    if metadata:
        (dest / "metadata").mkdir(exist_ok=True)
        (dest / "metadata" / "dataset.json").write_text(json.dumps({"dataset_name": "t", "meds_version": "0.4.0"}))
    return dest


def cases(work: Path, env: dict) -> list[tuple[str, list[str], dict]]:
    import polars as pl
    src = generate(work / "source", GeneratorConfig(n_patients=8, seed=3))

    def truncate(d):
        data = (d / "icu" / "chartevents.csv.gz").read_bytes()
        (d / "icu" / "chartevents.csv.gz").write_bytes(data[: len(data) // 2])

    def drop_column(d):
        rows = gzip.decompress((d / "icu" / "chartevents.csv.gz").read_bytes()).decode().splitlines()
        (d / "icu" / "chartevents.csv.gz").write_bytes(gzip.compress(
            "\n".join(",".join(r.split(",")[:8] + r.split(",")[9:]) for r in rows).encode()))

    out = [("a source folder that does not exist", ["run", "--source", str(work / "nowhere")], {}),
           ("icu/icustays missing", ["run", "--source", str(damaged_copy(
               src, work / "no-icustays", lambda d: (d / "icu" / "icustays.csv.gz").unlink()))], {}),
           ("chartevents without its valuenum column", ["run", "--source", str(damaged_copy(
               src, work / "no-valuenum", drop_column))], {}),
           ("a truncated chartevents.csv.gz", ["run", "--source", str(damaged_copy(src, work / "truncated", truncate))],
            {}),
           ("an empty chartevents.csv.gz", ["run", "--source", str(damaged_copy(
               src, work / "empty", lambda d: (d / "icu" / "chartevents.csv.gz").write_bytes(gzip.compress(b""))))],
            {}),
           ("an unknown config name", ["run", "--config", "no-such-config"], {}),
           ("a config that is not YAML", ["run", "--config", str(_write(work / "configs" / "bad.yaml", "a: [1,\n"))],
            {})]
    out += config_cases(work, src)
    events = pl.DataFrame({"subject_id": [1, 1], "time": [None, None], "code": ["A", "B"]},
                          schema={"subject_id": pl.Int64, "time": pl.Datetime("us"), "code": pl.String})
    out += [("MEDS: no metadata/dataset.json", ["run", "--source", str(meds_dataset(work / "meds-nometa", events,
                                                                                   metadata=False))], {}),
            ("MEDS: subject_id of the wrong type", ["run", "--source", str(meds_dataset(
                work / "meds-type", events.with_columns(pl.col("subject_id").cast(pl.String))))], {}),
            ("MEDS: ETL codes with --config default", ["run", "--source", str(_etl_meds(work, pl)), "--config",
                                                       "default"], {}),
            ("MEDS: no ICU admission code (refused inside the flow)", ["run", "--source",
                                                                       str(_etl_meds(work, pl, icu=False)),
                                                                       "--config", "mimic-iv-meds"], {}),
            ("--out is a file", ["run", "--out", str(_write(work / "a-file", "x"))], {}),
            ("no hash key", ["run"], {"FORGETFUL_HASH_KEY_FILE": None}),
            ("keygen over an existing key", ["keygen", env["FORGETFUL_HASH_KEY_FILE"]], {}),
            ("the temporary server's start past its setting (1 s)", ["run"],
             {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "1"}),
            ("delete from a workspace without a store", ["delete", "--out", str(work / "no-store"), "--subject-id",
                                                         "1"], {})]
    out += audit_cases(work, src)
    return out


def config_cases(work: Path, src: Path) -> list[tuple]:
    """A cohort config damaged one way each."""
    fixed = lambda c: c["protocols"]["fixed_context"]     # noqa: E731
    streaming = lambda c: c["protocols"]["streaming"]     # noqa: E731
    edits = {"nu: 0": lambda c: fixed(c).update(nu=0),
             "sigma: 0": lambda c: fixed(c).update(sigma=0),
             "a misspelled nested key (nuu)": lambda c: fixed(c).update(nuu=fixed(c).pop("nu")),
             "an unknown label in the streaming selection": lambda c: streaming(c).update(
                 select_label="composite_vital"),
             "an infeasible nu grid (1.5)": lambda c: streaming(c).update(nu_grid=[0.3, 1.5]),
             "a negative nu": lambda c: streaming(c).update(nu_grid=[-0.3]),
             "an unknown held-out channel": lambda c: c["token_labels"]["heldout_spo2"].update(heldout_channel="sp02"),
             "an unknown threshold channel": lambda c: c["token_labels"]["composite_vitals"]["thresholds"].update(
                 hrr={"above": 1}),
             "a small-cell threshold of 0": lambda c: c["report"].update(small_cell_threshold=0),
             "a channel whose codes match nothing": lambda c: c["tokens"]["channels"][0].update(
                 codes=["CHART//999999"])}
    return [(f"config: {name}", ["run", "--source", str(src), "--config", config_with(work, f"c{i}", e)], {})
            for i, (name, e) in enumerate(edits.items())]


def audit_cases(work: Path, src: Path) -> list[tuple]:
    """The boundary audit's cases (issue 44): options checked before anything is written, short keys, an API
    that does not answer, a malformed source row (completes: quarantined), a request of 100,000 ids."""
    import socket

    def bad_rows(d):
        p = d / "icu" / "chartevents.csv.gz"
        rows = gzip.decompress(p.read_bytes()).decode().splitlines()
        first = rows[1].split(",")
        rows += [",".join(["abc"] + first[1:]), rows[0]]        # a non-numeric subject_id, a repeated header
        p.write_bytes(gzip.compress(("\n".join(rows) + "\n").encode()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    return [("--workers -3", ["run", "--workers", "-3"], {}),
            ("--workers 0", ["run", "--workers", "0"], {}),
            ("--memory-limit abc", ["run", "--memory-limit", "abc"], {}),
            ("--max-events 0", ["run", "--max-events", "0"], {}),
            ("--cohort-budget 0", ["serve", "--cohort-budget", "0"], {}),
            ("FORGETFUL_HASH_KEY of 3 characters", ["run"], {"FORGETFUL_HASH_KEY": "abc"}),
            ("PREFECT_API_URL on a closed port", ["run"], {"PREFECT_API_URL": f"http://127.0.0.1:{closed}/api"}),
            ("a chartevents row with a non-numeric subject_id and a repeated header", ["run", "--source", str(
                damaged_copy(src, work / "bad-rows", bad_rows)), "--budgets", "8", "--fractions", ""], {},
             "completes")]


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _etl_meds(work: Path, pl, icu: bool = True) -> Path:
    """A MEDS dataset in the MIMIC-IV MEDS ETL's conventions (LAB//<item>//<unit>; ICU stays by codes)."""
    from datetime import datetime, timedelta
    codes = ["LAB//220045//bpm", "LAB//220050//mmHg", "LAB//220051//mmHg", "LAB//220210//insp/min", "LAB//220277//%",
             "LAB//223762//°C"]
    t0 = datetime(2150, 1, 1)
    rows = [(s, t0 + timedelta(hours=h), c, 80.0) for s in (1, 2) for h in range(1, 20) for c in codes]
    if icu:
        rows += [(s, t0, "ICU_ADMISSION//MICU", None) for s in (1, 2)]
        rows += [(s, t0 + timedelta(hours=30), "ICU_DISCHARGE//MICU", None) for s in (1, 2)]
    frame = pl.DataFrame(rows, schema={"subject_id": pl.Int64, "time": pl.Datetime("us"), "code": pl.String,
                                       "numeric_value": pl.Float32}, orient="row").sort("subject_id", "time")
    return meds_dataset(work / ("meds-etl" if icu else "meds-etl-no-icu"), frame)


def evidence_cases(work: Path, env: dict) -> list[tuple[str, list[str], dict]]:
    """A workspace with a certificate, then each piece of its evidence damaged."""
    import polars as pl
    ws = work / "ws-evidence"
    code, lines = cli(["run", "--out", str(ws), "--budgets", "8,32", "--fractions", ""], env)
    if code != 0:
        raise SystemExit("the evidence workspace could not be built:\n" + "\n".join(lines[-20:]))
    sid, other = (str(s) for s in pl.read_parquet(ws / "store" / "stays.parquet")["subject_id"].unique().sort()[:2])
    cli(["delete", "--out", str(ws), "--subject-id", sid], env)
    cert = ws / "certificates" / "000000.json"
    out = [("delete: an unknown subject", ["delete", "--out", str(ws), "--subject-id", "123"], {}),
           ("delete: a subject deleted already", ["delete", "--out", str(ws), "--subject-id", sid], {}),
           ("delete: an unknown id among known ones", ["delete", "--out", str(ws), "--subject-id", other,
                                                       "--subject-id", "123"], {}),
           ("delete: a subjects file with a line that is no id", ["delete", "--out", str(ws), "--subjects-file",
                                                                 str(_write(work / "ids.txt", f"{other}\nabc\n"))],
            {}),
           ("delete: a subjects file that does not exist", ["delete", "--out", str(ws), "--subjects-file",
                                                            str(work / "no-such-ids.txt")], {})]
    damage = {"verify: a truncated checkpoint.json": lambda d: _cut(d / "checkpoint.json"),
              "verify: an empty checkpoint.json": lambda d: _write(d / "checkpoint.json", ""),
              "verify: an empty certificate": lambda d: _write(d / "certificates" / "000000.json", ""),
              "verify: a certificate that is a JSON list": lambda d: _write(d / "certificates" / "000000.json", "[1]"),
              "verify: a truncated receipt": lambda d: _cut(d / "certificates" / "proofs" / "000000.json"),
              "verify: a ledger line that is not JSON": lambda d: (d / "ledger.jsonl").open("a").write("garbage\n")}
    for i, (name, edit) in enumerate(damage.items()):
        d = damaged_copy(ws, work / f"ws-damaged-{i}", edit)
        out.append((name, ["verify", str(d / "certificates" / cert.name)], {}))
    out.append(("verify: --checkpoint that is not JSON", ["verify", str(cert), "--checkpoint",
                                                          str(_write(work / "saved.json", "{"))], {}))
    d = damaged_copy(ws, work / "ws-damaged-delete", lambda d: _cut(d / "checkpoint.json"))
    out.append(("delete: a truncated checkpoint.json", ["delete", "--out", str(d), "--subject-id", other], {}))
    # the boundary audit's (issue 44)
    ids = _write(work / "100k-ids.txt", "\n".join(str(900_000_000 + i) for i in range(100_000)) + "\n")
    out.append(("delete: a subjects file of 100,000 unknown ids", ["delete", "--out", str(ws), "--subjects-file",
                                                                   str(ids)], {}))
    for name, edit in {"verify: a ledger line `5`": lambda d: (d / "ledger.jsonl").open("a").write("5\n"),
                       "verify: a receipt without its checkpoint": lambda d: _write(
                           d / "certificates" / "proofs" / "000000.json", '{"index": 1, "proof": {}}')}.items():
        d = damaged_copy(ws, work / f"ws-damaged-{len(out)}", edit)
        out.append((name, ["verify", str(d / "certificates" / cert.name)], {}))
    d = damaged_copy(ws, work / "ws-damaged-fingerprint", lambda d: _write(d / "store" / "key_fingerprint.json",
                                                                           "{}"))
    out.append(("run: a damaged key_fingerprint.json", ["run", "--out", str(d)], {}))
    # the store lost; the run rebuilds it from a source that still holds the deleted patient (a hospital's does:
    # here the embedded data generated anew)
    d = damaged_copy(ws, work / "ws-lost-store", lambda d: shutil.rmtree(d / "store"))
    hospital = generate(work / "hospital-source", GeneratorConfig())
    out.append(("run: the store lost (rm -rf WS/store), the source still holding the deleted patient",
                ["run", "--out", str(d), "--source", str(hospital)], {}, "completes", "left out"))
    auditor = work / "auditor"
    shutil.rmtree(auditor, ignore_errors=True)
    shutil.copytree(ws / "certificates", auditor / "certificates")
    for f in ("ledger.jsonl", "checkpoint.json"):
        shutil.copy(ws / f, auditor / f)
    out.append(("verify: an auditor's copy without the store", ["verify", str(auditor / "certificates" / cert.name)],
                {}, "completes"))
    return out


def _cut(path: Path) -> None:
    text = path.read_text()
    path.write_text(text[: len(text) // 2])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=None)
    a = ap.parse_args(argv)
    work = a.work or Path(tempfile.mkdtemp(prefix="forgetful-bad-inputs-"))
    env = bench_env(work)
    results = []
    for name, args, extra, *expect in cases(work, env) + evidence_cases(work, env):
        run_env = {k: v for k, v in (env | extra).items() if v is not None}
        if "--out" not in args and args[0] in ("run", "delete", "serve"):
            args = args + ["--out", str(work / f"ws-{len(results)}")]
        code, lines = cli(args, run_env)
        if expect and expect[0] == "completes":
            must = expect[1] if len(expect) > 1 else None
            ok = code == 0 and not any("Traceback" in x for x in lines) and (
                must is None or any(x.startswith("forgetful:") and must in x for x in lines))
            shown = next((x for x in lines if must and must in x), lines[-1] if lines else "")
            results.append((name, code, len(lines), shown, ok))
            continue
        said = [x for x in lines if x.startswith(("forgetful:", "FAILED:")) or "Traceback" in x or "| ERROR" in x]
        one = said == lines[-1:] and bool(said)
        verdict = code == 1 and args[0] == "verify" and said and said[0].startswith("FAILED:")
        results.append((name, code, len(lines), lines[-1] if lines else "", one and (code in (0, 2) or verdict)))
    for name, code, n, last, ok in results:
        print(f"{'ok  ' if ok else 'FAIL'} exit {code}, {n} line(s)  {name}\n        {last[:300]}")
    print(f"\n{sum(r[-1] for r in results)} of {len(results)} bad inputs end in one line saying what went wrong, with "
          f"the exit status to act on")
    os.environ.pop("FORGETFUL_HASH_KEY_FILE", None)


if __name__ == "__main__":
    main()
