"""Where a run's pending stays are scored: a handful in the run's own process (a worker would take longer to
start than to score them), more through the run's map; the same rows either way."""
import polars as pl

import run.evaluate as evaluate_module
from cohorts.definitions import load_config
from pipeline.extract import extract
from pipeline.generate import GeneratorConfig, generate
from pipeline.privacy import load_key
from pipeline.workspace import Workspace
from run.evaluate import IN_PROCESS_BELOW, evaluate, in_process_map
from run.params import RunParams

PARAMS = RunParams(budgets=(8,), fractions=(), cohort_budget=16, chunk_stays=4, source="the generator")


def _scored(tmp_path, name, source):
    ws = Workspace(tmp_path / name)
    extract(source, ws.store, key=load_key())
    mapped = []

    def recording_map(fn, parts, advance, **common):
        mapped.extend(s.stay_id for p in parts for s in p)
        return in_process_map(fn, parts, advance, **common)
    result = evaluate(ws, PARAMS, recording_map, load_config())
    return mapped, result, pl.read_parquet(ws.results)


def test_a_handful_of_stays_is_scored_in_process_and_more_through_the_map(tmp_path, monkeypatch):
    source = generate(tmp_path / "source", GeneratorConfig(n_patients=16, seed=5))
    mapped, result, rows = _scored(tmp_path, "few", source)
    scored = rows["stay_ref"].n_unique()
    assert 0 < scored < IN_PROCESS_BELOW and mapped == []
    monkeypatch.setattr(evaluate_module, "IN_PROCESS_BELOW", 1)
    mapped, result_mapped, rows_mapped = _scored(tmp_path, "mapped", source)
    assert len(mapped) == scored
    assert rows_mapped.equals(rows)
    assert result_mapped.summary == result.summary
