"""Hand-built inputs the tests of several packages share: a small events-mode stream, a report's result, a MEDS
dataset folder."""
import copy
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from cohorts.config import CohortConfig
from cohorts.definitions import load_config
from cohorts.evaluation import EventStream, aggregate, run_sweep
from run.result import RunResult


def hand_stay():
    # 12 events over 4 hours; hours 1 and 3 deteriorate; event 5 is rare.
    keys = np.zeros((12, 2))
    keys[:, 0] = np.arange(12) * 0.01
    hours = np.repeat(np.arange(4), 3)
    det = np.isin(hours, [1, 3])
    rare = np.zeros(12, dtype=bool)
    rare[5] = True
    return EventStream(stay_id=1, subject_id=None, keys=keys, hours=hours, deteriorating=det, rare=rare)


def hand_result():
    stays = [replace(hand_stay(), stay_id=i, keys=hand_stay().keys + i * 0.1) for i in range(4)]
    summary, paired = aggregate(run_sweep(stays, budgets=(4, 8, 32), fractions=(0.5,), workers=1))
    return RunResult(tuple(summary), tuple(paired), {"stays": 4, "eval_stays": 4}, {"data_source": "hand-built"})


def edited_config(edit, cfg: CohortConfig | None = None) -> CohortConfig:
    """A config's parsed YAML (the shipped default's unless ``cfg``), changed in place by ``edit(raw)``, typed
    again: a config as a hand-edited file would give it, without the load's checks (the tests of a run's own
    checks need what the load would refuse)."""
    raw = copy.deepcopy((cfg or load_config()).raw)
    edit(raw)
    return CohortConfig.from_raw(raw)


def meds_dataset(root: Path, frame) -> Path:
    """A MEDS dataset at ``root``: ``frame`` (a Polars frame of MEDS columns) as its one data shard, and the
    minimal ``metadata/dataset.json``."""
    (root / "data").mkdir(parents=True)
    (root / "metadata").mkdir()
    frame.write_parquet(root / "data" / "0.parquet")
    (root / "metadata" / "dataset.json").write_text(json.dumps({"dataset_name": root.name, "meds_version": "0.4.0"}))
    return root
