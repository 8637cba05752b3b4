"""No run succeeds on nothing: a config whose channels match no code of the data is one error naming the config,
what it looked for and the data's most frequent codes; a MEDS source gets the shipped config it follows."""
from pathlib import Path

import polars as pl
import pytest

from cohorts.coverage import check_channels_read, code_counts, suggest_config
from cohorts.definitions import load_config
from cohorts.errors import EmptyRunError
from run.steps import label_phase, token_phase
from pipeline.extract import extract
from pipeline.generate import GeneratorConfig, generate
from pipeline.privacy import load_key
from pipeline.workspace import Workspace
from tests.builders import edited_config, meds_dataset

DEMO_MEDS = Path(__file__).resolve().parents[3] / "shared" / "data" / "mimic-iv-demo-meds" / \
    "mimic_iv_demo_meds_events.parquet"


def _counts(codes):
    return pl.DataFrame({"code": codes, "count": list(range(len(codes), 0, -1))})


def test_each_convention_gets_its_shipped_config_and_a_mismatch_names_config_codes_and_hint():
    etl = _counts(["LAB//220045//bpm", "LAB//220050//mmHg", "LAB//220051//mmHg", "LAB//220210//insp/min",
                   "LAB//220277//%", "LAB//223762//°C", "ICU_ADMISSION//MICU"])
    ours = _counts(["CHART//220045", "CHART//220050", "CHART//220051", "CHART//220210", "CHART//220277",
                    "CHART//223762"])
    assert suggest_config(etl) == "mimic-iv-meds" and suggest_config(ours) == "default"
    assert suggest_config(_counts(["X", "Y"])) is None
    with pytest.raises(EmptyRunError) as e:
        check_channels_read(load_config(), etl, "default", "the MEDS dataset D")
    msg = str(e.value)
    assert msg.startswith("cohort config default reads nothing of the MEDS dataset D: no code matches its channel(s)")
    assert "hr: ['CHART//220045']" in msg and "LAB//220045//bpm (7)" in msg and "pass --config mimic-iv-meds" in msg
    check_channels_read(load_config(), ours, "default", "ours")       # reads every channel: no error


def test_a_channel_that_reads_nothing_ends_the_run_after_its_labels(tmp_path):
    source = generate(tmp_path / "source", GeneratorConfig(n_patients=6))
    ws = Workspace(tmp_path / "ws")
    extract(source, ws.store, key=load_key())
    cfg = edited_config(lambda raw: raw["tokens"]["channels"][0].update(codes=["CHART//999999"]))
    with pytest.raises(EmptyRunError, match=r"channel\(s\) \['hr'\] read no plausible value"):
        label_phase(ws, token_phase(ws, cfg), cfg)
    cfg = edited_config(lambda raw: raw["split"].update(eval_fraction=0.0))
    with pytest.raises(EmptyRunError, match="no evaluation stays to score"):
        label_phase(ws, token_phase(ws, cfg), cfg)


@pytest.mark.skipif(not DEMO_MEDS.exists(), reason="the MIMIC-IV demo's MEDS conversion is not in shared/data")
def test_the_demo_meds_conversion_without_a_config_gets_mimic_iv_meds(tmp_path):
    from flows.cli import _check_meds_codes
    meds_dataset(tmp_path / "meds", pl.read_parquet(DEMO_MEDS).select(
        "subject_id", "time", "code", numeric_value=pl.col("value").cast(pl.Float32)))
    assert code_counts(sorted((tmp_path / "meds" / "data").glob("*.parquet")))["count"].sum() == 916_166
    assert _check_meds_codes(str(tmp_path / "meds"), None, Workspace(tmp_path / "ws")) == "mimic-iv-meds"
    with pytest.raises(EmptyRunError, match="cohort config default reads nothing of the MEDS dataset"):
        _check_meds_codes(str(tmp_path / "meds"), "default", Workspace(tmp_path / "ws"))
