"""A run's parameters: one typed value, saved with the workspace, the defaults of every later run."""
import json

import pytest

from run.params import RunParams, StreamMode


def test_given_parameters_win_then_the_last_run_s_then_the_defaults(tmp_path):
    path = tmp_path / "run.json"
    assert RunParams.load(path) is None
    last = RunParams(budgets=(8, 16), tokens="events", source="/data/mimic")
    last.save(path)
    saved = RunParams.load(path)
    assert saved == last and saved.tokens is StreamMode.EVENTS
    rerun = RunParams.resolve(saved, budgets=None, cohort_budget=64, source=None)
    assert rerun.budgets == (8, 16) and rerun.cohort_budget == 64 and rerun.source == "/data/mimic"
    assert RunParams.resolve(None, fractions=(0.5,)) == RunParams(fractions=(0.5,))


def test_bad_parameters_and_a_damaged_file_are_refused_in_one_line(tmp_path):
    for bad in (dict(budgets=()), dict(budgets=(0,)), dict(fractions=(1.5,)), dict(tokens="minutes"),
                dict(task_runner="cluster")):
        with pytest.raises(ValueError):
            RunParams(**bad)
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"budgets": [8], "budgetz": [16]}))
    with pytest.raises(ValueError, match="budgetz"):
        RunParams.load(path)
    path.write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        RunParams.load(path)


def test_the_persisted_memory_budget_is_the_headline_one_when_the_run_has_it():
    assert RunParams(budgets=(8, 64, 256)).memory_budget == 64
    assert RunParams(budgets=(8, 16)).memory_budget == 16
