"""The chunked, cached hourly-token run: equal to the whole cohort in memory, incremental, bounded statistics."""
import gzip
import shutil

import numpy as np
import polars as pl
import pytest

from cohorts import evaluation
from cohorts.definitions import load_config
from cohorts.evaluation import aggregate, bootstrap_ci, sign_flip_p
from cohorts.protocols import score_token_streams
from run.reference import prepare_token_streams
from run.steps import label_phase, score_pending, token_phase
from run.token_run import ScoringPlan
from pipeline.extract import extract
from pipeline.generate import GeneratorConfig, generate
from pipeline.privacy import id_refs, load_key, subject_ref
from pipeline.workspace import Workspace
from tests.builders import edited_config

BUDGETS, FRACTIONS = (8, 32), (0.1,)
SORT = ["stay_ref", "protocol", "keys", "label", "budget", "policy", "metric"]


def _run(ws, cfg, chunk_stays=3):
    index = token_phase(ws, cfg, chunk_stays=chunk_stays)
    summary = label_phase(ws, index, cfg, chunk_stays=chunk_stays)

    def score(batch, advance):
        return score_token_streams(batch, BUDGETS, FRACTIONS, index.settings, cfg.fixed_context,
                                   memory_budget=32, fraction_cap=max(BUDGETS))
    score_pending(ws, index, cfg, ScoringPlan(BUDGETS, FRACTIONS, 32, max(BUDGETS)), score, batch_stays=5)
    return index, summary, pl.read_parquet(ws.results).sort(SORT)


def _workspace(tmp_path, name, source):
    ws = Workspace(tmp_path / name)
    extract(source, ws.store, key=load_key())
    return ws


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("src") / "source", GeneratorConfig(n_patients=24))


def test_the_chunked_run_equals_the_whole_cohort_in_memory(source, tmp_path):
    cfg = load_config()
    ws = _workspace(tmp_path, "ws", source)
    index, summary, rows = _run(ws, cfg)
    streams, settings, reference = prepare_token_streams(ws.store, cfg, labels_dir=tmp_path / "labels")
    assert (index.settings.nu, index.settings.sigma) == (settings.nu, settings.sigma)
    assert index.settings.selection == settings.selection
    assert {k: v for k, v in summary.items() if k != "computed_stays"} == reference
    expected = score_token_streams(streams, BUDGETS, FRACTIONS, settings, cfg.fixed_context,
                                   fraction_cap=max(BUDGETS))
    assert rows.equals(id_refs(pl.DataFrame(expected), load_key()).select(rows.columns).sort(SORT))
    for f in sorted((tmp_path / "labels").glob("*.parquet")):
        assert pl.read_parquet(ws.labels / f.name).sort("subject_id", "prediction_time").equals(
            pl.read_parquet(f).sort("subject_id", "prediction_time"))
    # the caches name no stay or patient
    ids = {str(s) for s in index.cohort["stay_id"].to_list() + index.cohort["subject_id"].to_list()}
    assert not set(rows.columns) & {"stay_id", "subject_id"}         # the results name stays by reference
    for f in ws.cache.rglob("*"):
        if f.is_file():
            text = f.read_bytes()
            assert not any(i.encode() in text for i in ids), f


def _with_new_rows(source, tmp_path, n_patients=26):
    """The source of 24 patients grown to ``n_patients`` (new stays), plus late chart rows for one existing
    stay."""
    grown = generate(tmp_path / f"grown-{n_patients}", GeneratorConfig(n_patients=n_patients))
    chart = grown / "icu" / "chartevents.csv.gz"
    rows = pl.read_csv(chart, infer_schema=False)
    first_stay = rows["stay_id"][0]
    late = (rows.filter(pl.col("stay_id") == first_stay).slice(5, 10)
            .with_columns((pl.col("charttime").str.to_datetime() + pl.duration(minutes=1))
                          .dt.strftime("%Y-%m-%d %H:%M:%S").alias("charttime")))
    chart.write_bytes(gzip.compress(pl.concat([rows, late]).write_csv().encode()))
    return grown


def test_reruns_recompute_only_what_changed_and_equal_a_fresh_run(source, tmp_path):
    cfg = load_config()
    ws = _workspace(tmp_path, "ws", source)
    first, _, _ = _run(ws, cfg)
    assert first.computed["tokens"] == first.cohort.height
    again, _, rows_again = _run(ws, cfg)
    assert again.computed == {"tokens": 0, "rare": 0, "labels": 0, "grid": 0, "streams": 0, "scores": 0}
    assert rows_again.equals(_run(ws, cfg)[2])
    grown = _with_new_rows(source, tmp_path)
    extract(grown, ws.store, key=load_key())
    later, summary, rows = _run(ws, cfg)
    new_stays = later.cohort.height - first.cohort.height
    assert new_stays > 0
    assert new_stays < later.computed["tokens"] < later.cohort.height     # the new stays and the late rows' stay
    # the new patients change the rare vocabulary; only the stays holding a changed code, or changed rows, get
    # their rare hours and streams again
    assert later.rare != first.rare
    assert later.computed["rare"] < later.cohort.height
    assert later.computed["streams"] < int((later.cohort["split"] == "eval").sum())
    assert later.computed["labels"] < later.cohort.height
    fresh_ws = _workspace(tmp_path, "fresh", grown)
    fresh, fresh_summary, fresh_rows = _run(fresh_ws, cfg)
    assert rows.equals(fresh_rows)
    for f in sorted(fresh_ws.labels.glob("*.parquet")):     # the labels cached per stay give the same files
        assert pl.read_parquet(ws.labels / f.name).equals(pl.read_parquet(f)), f.name
    assert summary["characteristics"] == fresh_summary["characteristics"]
    assert (later.settings.nu, later.settings.sigma) == (fresh.settings.nu, fresh.settings.sigma)


def test_after_late_rows_of_one_stay_only_its_stream_is_built_again(source, tmp_path):
    cfg = load_config()
    ws = _workspace(tmp_path, "ws", source)
    first, _, _ = _run(ws, cfg)
    late = _with_new_rows(source, tmp_path, n_patients=24)
    extract(late, ws.store, key=load_key())
    later, _, rows = _run(ws, cfg)
    assert later.computed["tokens"] == 1 and later.computed["streams"] <= 1 and later.computed["labels"] == 1
    assert first.computed["streams"] == int((first.cohort["split"] == "eval").sum())
    assert rows.equals(_run(_workspace(tmp_path, "fresh", late), cfg)[2])


def test_after_late_rows_only_the_touched_subjects_stays_are_digested(source, tmp_path, monkeypatch):
    """A night's splices record the subjects they changed: a rerun digests those subjects' stays only (not every
    stay of each touched shard), and equals a fresh run; where the records cannot tell (here: removed), the
    shard is digested whole and the rerun is the same."""
    import run.token_run as token_run
    from pipeline.shard_changes import change_files
    cfg = load_config()
    ws = _workspace(tmp_path, "ws", source)
    _run(ws, cfg)
    late = _with_new_rows(source, tmp_path, n_patients=24)
    copy = Workspace(tmp_path / "copy")
    shutil.copytree(ws.root, copy.root)
    digested = []
    real = token_run.chunk_digests

    def counting(store, chunk):
        digested.extend(chunk.stays["stay_id"].to_list())
        return real(store, chunk)
    monkeypatch.setattr(token_run, "chunk_digests", counting)
    extract(late, ws.store, key=load_key())
    assert change_files(ws.store)
    later, _, rows = _run(ws, cfg)
    touched = later.cohort.filter(pl.col("stay_id").is_in(digested))["subject_id"].unique()
    assert len(touched) == 1 and later.computed["tokens"] == 1
    assert len(digested) == later.cohort.filter(pl.col("subject_id") == touched[0]).height
    assert rows.equals(_run(_workspace(tmp_path, "fresh", late), cfg)[2])

    digested.clear()
    extract(late, copy.store, key=load_key())
    for f in change_files(copy.store):
        f.unlink()
    whole, _, rows_whole = _run(copy, cfg)
    shard = whole.cohort.filter(pl.col("subject_id") == touched[0])["shard"][0]
    mine = whole.cohort.filter(pl.col("subject_id") == touched[0]).height
    assert len(digested) == whole.shard_rows(shard).height > mine and whole.computed["tokens"] == 1
    assert rows_whole.equals(rows)
    # the records name subjects: a deletion takes its patient's out with their shard's rows
    from deletion import delete_subject
    from pipeline.shard_changes import named_subjects
    sid = int(touched[0])
    assert any(sid in named_subjects(f) for f in change_files(ws.store))
    cert, _ = delete_subject(ws, sid, mode="decrement")
    assert not any(sid in named_subjects(f) for f in change_files(ws.store))
    assert "shard_change_records" in cert.residual_scan["scanned"]


def _one_matrix_bootstrap(x, n_boot=10_000, seed=0):
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(n_boot, len(x)))].mean(1)
    return tuple(np.quantile(means, [0.025, 0.975]))


def _one_matrix_sign_flip(d, n_perm=10_000, seed=0):
    rng = np.random.default_rng(seed)
    flips = rng.choice([-1.0, 1.0], size=(n_perm, len(d)))
    return ((np.abs((flips * d).mean(1)) >= abs(d.mean()) - 1e-15).sum() + 1) / (n_perm + 1)


def test_blocked_resampling_agrees_with_one_resampling_matrix(monkeypatch):
    monkeypatch.setattr(evaluation, "RESAMPLE_CELLS", 4096)        # many blocks even at 400 stays
    x = np.random.default_rng(3).normal(0.1, 1.0, size=400)
    lo, hi = bootstrap_ci(x)
    ref_lo, ref_hi = _one_matrix_bootstrap(x)
    # Monte Carlo error of a 2.5 % quantile of 10,000 resampled means (sd 0.05): ~0.0015
    assert abs(lo - ref_lo) < 0.006 and abs(hi - ref_hi) < 0.006
    p, ref_p = sign_flip_p(x), _one_matrix_sign_flip(x)
    assert abs(p - ref_p) < 4 * np.sqrt(ref_p * (1 - ref_p) / 10_000) + 1e-4


@pytest.mark.parametrize("shift", [0.0, 0.03, 0.06])
def test_above_the_resampling_limit_the_normal_limit_agrees_with_resampling(monkeypatch, shift):
    x = np.random.default_rng(5).exponential(1.0, size=3000) - 1.0 + shift       # skewed, as retention differences
    limit = bootstrap_ci(x), sign_flip_p(x)
    monkeypatch.setattr(evaluation, "RESAMPLE_MAX_N", 10 ** 9)
    (lo, hi), p = bootstrap_ci(x), sign_flip_p(x)
    se = x.std() / np.sqrt(len(x))
    # Monte Carlo error of a 2.5 % quantile of 10,000 resampled means: ~0.027 se; of p: sqrt(p (1 - p) / 10,000)
    assert abs(limit[0][0] - lo) < 0.1 * se and abs(limit[0][1] - hi) < 0.1 * se
    assert abs(limit[1] - p) < 4 * np.sqrt(p * (1 - p) / 10_000) + 2e-4


def test_statistics_from_a_results_file_equal_those_from_rows(tmp_path):
    rng = np.random.default_rng(0)
    rows = [{"stay_id": s, "subject_id": s, "protocol": "streaming", "tokens": "hourly", "keys": "k", "label": "y",
             "budget": "32", "policy": p, "metric": "retention", "value": float(rng.random())}
            for s in range(30) for p in ("sv_certified", "recency")]
    pl.DataFrame(rows).write_parquet(tmp_path / "r.parquet")
    assert aggregate(rows) == aggregate(pl.scan_parquet(tmp_path / "r.parquet"))


def test_a_deletion_drops_the_patient_s_cache_and_the_next_run_equals_one_that_never_saw_them(tmp_path):
    from deletion import delete_subject
    cfg = load_config()
    ws = Workspace(tmp_path / "ws")
    generate(ws.source, GeneratorConfig(n_patients=16, seed=9))
    extract(ws.source, ws.store, key=load_key())
    index, _, _ = _run(ws, cfg)
    # an evaluation-split patient: nothing computed from the training split depends on them
    sid = int(index.cohort.filter(pl.col("split") == "eval")["subject_id"][0])
    shard = sid % 16
    assert (ws.root / "cache" / "tokens" / str(shard)).exists()
    delete_subject(ws, sid, mode="replay")
    assert not any((ws.root / "cache").glob(f"*/{shard}"))
    assert not (ws.root / "cache" / "index" / f"{shard}.json").exists()
    extract(ws.source, ws.store, key=load_key())
    after, _, rows = _run(ws, cfg)
    assert after.computed["tokens"] == index.shard_rows(shard).height - index.cohort.filter(
        pl.col("subject_id") == sid).height
    assert subject_ref(sid, load_key()) not in rows["subject_ref"].to_list()
    never = Workspace(tmp_path / "never")
    shutil.copytree(ws.source, never.source)
    extract(never.source, never.store, key=load_key())
    _, _, never_rows = _run(never, cfg)
    assert rows.equals(never_rows)


def test_declared_scaling_and_streaming_setting_are_used_as_given(source, tmp_path):
    
    from cohorts.definitions import CohortConfigError
    def declared(raw):
        raw["tokens"]["scaling"] = "reference"
        for i, ch in enumerate(raw["tokens"]["channels"]):
            ch["reference"] = {"median": 50.0 + i, "mean": 60.0 + i, "sd": 10.0}
        raw["protocols"]["streaming"].update(nu=0.5, sigma=3.0)
    cfg = edited_config(declared)
    ws = _workspace(tmp_path, "ws", source)
    index, _, rows = _run(ws, cfg)
    assert index.scaling.median.tolist() == [50.0 + i for i in range(len(cfg.channels))]
    assert (index.settings.nu, index.settings.sigma, index.settings.selection) == (0.5, 3.0, [])
    assert index.computed["grid"] == 0 and rows.height
    cfg = edited_config(lambda raw: raw["tokens"]["channels"][0].pop("reference"), cfg)
    with pytest.raises(CohortConfigError, match="lack reference"):
        _run(_workspace(tmp_path, "ws2", source), cfg)
    cfg = edited_config(lambda raw: raw["tokens"].update(scaling="per_run"), cfg)
    with pytest.raises(CohortConfigError, match="tokens.scaling must be one of"):
        _run(_workspace(tmp_path, "ws3", source), cfg)
