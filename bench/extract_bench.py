"""Extraction throughput at scale, and coverage and speed against the community MEDS ETL on the demo.

    python bench/extract_bench.py [--events 20000000] [--memory-limit LIMIT]
    python bench/extract_bench.py --demo [--etl-command CMD]

``--demo``: extracts ``shared/data/mimic-iv-demo`` (wall time and peak RSS in a child process) and counts its
events per code family against a reference MEDS dataset, by default the demo's published MEDS conversion
(``shared/data/mimic-iv-demo-meds``), each family mapped to the reference's names. ``--etl-command`` runs the
community ETL (MIMIC-IV-MEDS with meds-extract; it pins polars < 2, so it lives in its own environment) side by
side: a shell command with ``{src}`` and ``{out}`` placeholders, timed on the same machine in the same run, whose
output then becomes the reference. Without it that side is skipped, saying so.

The small tables (patients, admissions, icustays, d_items, ...) come from the embedded generator; chartevents
and labevents are then replaced by DuckDB-synthesised tables of the requested size over the same stays (the
Python generator is far too slow for tens of millions of rows). Extraction runs in a child process so that
its peak resident memory is measured on its own.
"""
import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.extract import DEFAULT_MEMORY_LIMIT  # noqa: E402
from pipeline.generate import GeneratorConfig, generate  # noqa: E402

CHART_ITEMS = [220045, 220179, 220180, 220052, 220210, 220277, 223762]
# per chart item: a physiological centre and half-range, so the hourly-token channels get plausible readings
CHART_CENTRE = [85, 120, 65, 80, 18, 96, 37.0]
CHART_SPREAD = [30, 30, 15, 15, 8, 4, 1.5]
LAB_ITEMS = [50813, 50912, 51265, 50885, 50971, 50983, 51301, 51222]


def synthesize(src, n_events, patients):
    generate(src, GeneratorConfig(n_patients=patients, seed=7))
    con = duckdb.connect()
    con.execute("SET preserve_insertion_order=false")
    stays = f"read_csv('{src}/icu/icustays.csv.gz', header=true)"
    n_chart = int(n_events * 0.8)
    n_lab = n_events - n_chart
    chart_items = "[" + ",".join(map(str, CHART_ITEMS)) + "]"
    centres = "[" + ",".join(map(str, CHART_CENTRE)) + "]"
    spreads = "[" + ",".join(map(str, CHART_SPREAD)) + "]"
    lab_items = "[" + ",".join(map(str, LAB_ITEMS)) + "]"
    con.execute(f"CREATE TABLE s AS SELECT row_number() OVER () - 1 AS k, * FROM {stays}")
    n_stays = con.execute("SELECT count(*) FROM s").fetchall()[0][0]
    con.execute(f"""COPY (
        SELECT s.subject_id, s.hadm_id, s.stay_id, 1000 + i % 9000 AS caregiver_id,
               strftime(s.intime + to_seconds(CAST((i // {n_stays}) * 37 % greatest(1, epoch(s.outtime) -
                        epoch(s.intime)) AS BIGINT)), '%Y-%m-%d %H:%M:%S') AS charttime,
               NULL AS storetime, {chart_items}[1 + i % {len(CHART_ITEMS)}] AS itemid,
               round({centres}[1 + i % {len(CHART_ITEMS)}] + {spreads}[1 + i % {len(CHART_ITEMS)}]
                     * ((hash(i) % 1000) / 500.0 - 1), 2) AS value,
               round({centres}[1 + i % {len(CHART_ITEMS)}] + {spreads}[1 + i % {len(CHART_ITEMS)}]
                     * ((hash(i) % 1000) / 500.0 - 1), 2) AS valuenum,
               'unit' AS valueuom, 0 AS warning
        FROM range({n_chart}) t(i) JOIN s ON s.k = i % {n_stays})
        TO '{src}/icu/chartevents.csv.gz' (HEADER, COMPRESSION gzip)""")
    con.execute(f"""COPY (
        SELECT i AS labevent_id, s.subject_id, s.hadm_id, i AS specimen_id,
               {lab_items}[1 + i % {len(LAB_ITEMS)}] AS itemid, NULL AS order_provider_id,
               strftime(s.intime + to_seconds(CAST((i // {n_stays}) * 53 % greatest(1, epoch(s.outtime) -
                        epoch(s.intime)) AS BIGINT)), '%Y-%m-%d %H:%M:%S') AS charttime,
               NULL AS storetime, round((hash(i) % 1000) / 100.0, 2) AS value,
               round((hash(i) % 1000) / 100.0, 2) AS valuenum, 'mg/dL' AS valueuom, NULL AS ref_range_lower,
               NULL AS ref_range_upper, NULL AS flag, 'ROUTINE' AS priority, NULL AS comments
        FROM range({n_lab}) t(i) JOIN s ON s.k = i % {n_stays})
        TO '{src}/hosp/labevents.csv.gz' (HEADER, COMPRESSION gzip)""")
    con.close()


# our code family -> the community ETL's (a family: the code up to its first "//"; MIMIC-IV-MEDS names)
FAMILY_TO_ETL = {
    "CHART": "LAB", "LAB": "LAB", "EMAR": "MEDICATION", "PRESCRIPTION": "MEDICATION", "INPUT": "INFUSION_START",
    "INPUT_END": "INFUSION_END", "WEIGHT_AT_INFUSION": "SUBJECT_WEIGHT_AT_INFUSION", "OUTPUT": "SUBJECT_FLUID_OUTPUT",
    "DIAGNOSIS": "DIAGNOSIS", "PROCEDURE": "PROCEDURE", "PROCEDURE_END": "PROCEDURE", "TRANSFER": "TRANSFER_TO",
    "OMR": "OMR", "DRG": "DRG", "HOSPITAL_ADMISSION": "HOSPITAL_ADMISSION", "HOSPITAL_DISCHARGE": "HOSPITAL_DISCHARGE",
    "ED_REGISTRATION": "ED_REGISTRATION", "ED_OUT": "ED_OUT", "ICU_ADMISSION": "ICU_ADMISSION",
    "ICU_DISCHARGE": "ICU_DISCHARGE", "GENDER": "GENDER", "MEDS_BIRTH": "MEDS_BIRTH", "MEDS_DEATH": "MEDS_DEATH",
    "HCPCS": "HCPCS",
}
# the ETL writes outpatient measurements (omr) under their result names
ETL_OMR = ("Blood Pressure", "Weight (Lbs)", "BMI (kg/m2)", "Height (Inches)", "eGFR")


def _families(frame, column, mapping=None):
    import polars as pl
    fam = pl.col(column).str.split("//").list.first()
    if mapping is None:   # the reference's own names, its omr result names folded into one family
        fam = pl.when(pl.col(column).str.starts_with(ETL_OMR[0]) | pl.col(column).is_in(ETL_OMR[1:])) \
            .then(pl.lit("OMR")).otherwise(fam)
    else:
        fam = fam.replace_strict(mapping, default="(ours only)")
    return frame.group_by(fam.alias("family")).agg(pl.len().alias("events"), pl.col(column).n_unique().alias("codes"))


def _extract_in_child(src, out, memory_limit):
    """Extraction in its own process, so that its peak resident memory is its own: (its figures, wall
    seconds), or (None, the exit code) after printing what failed."""
    code = (f"import json,sys,resource; sys.path.insert(0, {str(ROOT)!r}); from pipeline.extract import extract; "
            f"s = extract({str(src)!r}, {str(out)!r}, memory_limit={memory_limit!r}); "
            f"print(json.dumps({{'events': s.total_events, "
            f"'rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "
            f"'quarantined': {{t: v.get('quarantined', {{}}) for t, v in s.tables.items()}}}}))")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        print(proc.stderr, file=sys.stderr)
        return None, proc.returncode
    return json.loads(proc.stdout.strip().splitlines()[-1]), wall


def demo(args):
    import polars as pl
    src = ROOT.parent / "shared" / "data" / "mimic-iv-demo"
    if not src.exists():
        print(f"skipped: {src} is not present on this machine")
        return 0
    work = Path(args.workdir or tempfile.mkdtemp(prefix="extract-demo-"))
    out = work / "store"
    ours, ours_s = _extract_in_child(src, out, args.memory_limit)
    if ours is None:
        return ours_s
    ref_events, ref_name, etl_s = _reference(args, src, work)
    mine = pl.scan_parquet(out / "data" / "*.parquet").select("code").collect()
    table = _families(mine, "code", FAMILY_TO_ETL).join(
        _families(ref_events, "code"), on="family", how="full", suffix="_ref", coalesce=True).sort("family")
    print(f"ours: {ours['events']:,} events, {mine['code'].n_unique():,} codes in {ours_s:.1f} s wall, "
          f"peak RSS {ours['rss_mb']:,.0f} MiB")
    print(f"reference ({ref_name}): {ref_events.height:,} events, {ref_events['code'].n_unique():,} codes"
          + (f" in {etl_s:.1f} s wall: ours is {etl_s / ours_s:.1f}x faster" if etl_s else ""))
    print(f"{'family (reference name)':32s} {'ours':>9s} {'reference':>10s} {'ours/ref':>9s}")
    for r in table.iter_rows(named=True):
        ratio = f"{r['events'] / r['events_ref']:.3f}" if r["events"] and r["events_ref"] else "-"
        print(f"{r['family']:32s} {r['events'] or 0:>9,} {r['events_ref'] or 0:>10,} {ratio:>9s}")
    q = {f"{table}:{reason}": n for table, v in ours["quarantined"].items() for reason, n in v.items() if n}
    print("quarantined (explains ours < reference):", ", ".join(f"{k} {n:,}" for k, n in sorted(q.items())) or "none")
    return 0


def _reference(args, src, work):
    """(reference events with a code column, its name, the ETL's wall seconds or None)."""
    import polars as pl
    if args.etl_command:
        etl_out = work / "etl"
        t0 = time.perf_counter()
        subprocess.run(args.etl_command.format(src=src, out=etl_out), shell=True, check=True)
        etl_s = time.perf_counter() - t0
        return (pl.scan_parquet(etl_out / "data" / "**" / "*.parquet").select("code").collect(),
                "the community ETL, run now", etl_s)
    print("the community ETL was not run (no --etl-command: MIMIC-IV-MEDS with meds-extract pins polars < 2 and "
          "needs its own environment); comparing with the demo's published MEDS conversion instead")
    ref = ROOT.parent / "shared" / "data" / "mimic-iv-demo-meds" / "mimic_iv_demo_meds_events.parquet"
    return pl.read_parquet(ref, columns=["code"]), "the demo's published MEDS conversion", None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--demo", action="store_true", help="coverage and speed against the community ETL on the demo")
    ap.add_argument("--etl-command", default=None, help="shell command running the community ETL ({src}, {out})")
    ap.add_argument("--events", type=int, default=20_000_000)
    ap.add_argument("--patients", type=int, default=2000)
    ap.add_argument("--memory-limit", default=DEFAULT_MEMORY_LIMIT)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args(argv)
    if args.demo:
        return demo(args)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="extract-bench-"))
    src, out = work / "src", work / "store"
    t0 = time.perf_counter()
    synthesize(src, args.events, args.patients)
    t_gen = time.perf_counter() - t0
    res, wall = _extract_in_child(src, out, args.memory_limit)
    if res is None:
        return wall
    peak_mb = res["rss_mb"]
    print(f"synthesised {args.events:,} lab+chart rows over {args.patients} patients in {t_gen:.1f} s ({work})")
    print(f"extracted {res['events']:,} events in {wall:.1f} s: {res['events'] / wall:,.0f} events/s, "
          f"peak RSS {peak_mb:,.0f} MiB (DuckDB memory_limit {args.memory_limit})")
    # hourly tokens of every cohort stay from that store (Polars, lazy), in its own process for its peak RSS
    code = (f"import json,sys,time; sys.path.insert(0, {str(ROOT)!r}); from cohorts.definitions import load_config; "
            f"from cohorts.tokens import build_tokens; t = time.perf_counter(); "
            f"tt = build_tokens({str(out)!r}, load_config()); "
            f"import resource; print(json.dumps({{'tokens': tt.tokens.height, "
            f"'readings': sum(tt.readings.values()), 'seconds': time.perf_counter() - t, "
            f"'rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode:
        print(proc.stderr, file=sys.stderr)
        return proc.returncode
    tok = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"hourly tokens: {tok['tokens']:,} tokens from {tok['readings']:,} channel readings in "
          f"{tok['seconds']:.1f} s: {tok['tokens'] / tok['seconds']:,.0f} tokens/s, "
          f"{tok['seconds'] / tok['tokens'] * 1e6:.1f} us per token, {tok['readings'] / tok['seconds']:,.0f} "
          f"readings/s, peak RSS {tok['rss_mb']:,.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
