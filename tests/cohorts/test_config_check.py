"""The whole cohort config is checked when it is loaded: each problem one CohortConfigError naming the file and
the key's path (the audit met these inside the flow as ZeroDivisionError, bare KeyErrors and tracebacks)."""
import copy

import pytest
import yaml

from cohorts.definitions import DEFAULT_CONFIG, CohortConfigError, load_config, resolve_config


def _set(path, value):
    def edit(cfg):
        *parents, last = path
        node = cfg
        for p in parents:
            node = node[p]
        node[last] = value
    return edit


def _rename(path, new):
    def edit(cfg):
        *parents, last = path
        node = cfg
        for p in parents:
            node = node[p]
        node[new] = node.pop(last)
    return edit


CASES = [
    (_set(["protocols", "fixed_context", "nu"], 0), r"protocols\.fixed_context\.nu must be a number in \(0, 1\], not 0"),
    (_set(["protocols", "fixed_context", "sigma"], 0), r"protocols\.fixed_context\.sigma must be a number > 0"),
    (_rename(["protocols", "fixed_context", "nu"], "nuu"), r"protocols\.fixed_context\.nuu: unknown key; did you mean 'nu'"),
    (_rename(["protocols"], "protocol"), r"^cohort config .*: protocol: unknown key; did you mean 'protocols'"),
    (_set(["protocols", "streaming", "select_label"], "composite_vital"),
     r"protocols\.streaming\.select_label 'composite_vital' is not a token label"),
    (_set(["protocols", "streaming", "nu_grid"], [0.3, 1.5]), r"nu_grid\[1\] must be a number in \(0, 1\], not 1\.5"),
    (_set(["protocols", "streaming", "nu_grid"], [-0.3]), r"nu_grid\[0\] must be a number in \(0, 1\]"),
    (_set(["protocols", "streaming", "nu_grid"], []), r"nu_grid must be a non-empty list"),
    (_set(["protocols", "streaming", "select_budget"], 0), r"select_budget must be an integer >= 1, not 0"),
    (_set(["token_labels", "heldout_spo2", "heldout_channel"], "sp02"),
     r"token_labels\.heldout_spo2\.heldout_channel 'sp02' is not a channel"),
    (_set(["token_labels", "composite_vitals", "thresholds", "hrr"], {"above": 1}),
     r"token_labels\.composite_vitals\.thresholds name unknown channel\(s\) \['hrr'\]"),
    (_set(["token_labels", "composite_vitals", "thresholds", "hr", "abve"], 1),
     r"thresholds\.hr\.abve: unknown key; did you mean 'above'"),
    (_set(["deterioration", "criteria"], {"a": 1}), r"deterioration\.criteria must be a list"),
    (_set(["tokens", "bin_hours"], 0), r"tokens\.bin_hours must be a number > 0, not 0"),
    (_set(["split", "eval_fraction"], "half"), r"split\.eval_fraction must be a number in \[0, 1\], not 'half'"),
    (_set(["rare_items", "quantile"], 2), r"rare_items\.quantile must be a number in \[0, 1\]"),
]


@pytest.mark.parametrize("edit, message", CASES)
def test_a_bad_value_is_one_error_naming_the_file_and_key(tmp_path, edit, message):
    cfg = yaml.safe_load(DEFAULT_CONFIG.read_text())
    edit(cfg)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(CohortConfigError, match=message) as e:
        load_config(path)
    assert str(e.value).startswith(f"cohort config {path}: ") and "\n" not in str(e.value)


def test_a_reference_sd_of_zero_is_refused_and_the_shipped_configs_pass(tmp_path):
    for name in ("default", "mimic-iv-meds"):
        load_config(resolve_config(name))
    cfg = copy.deepcopy(yaml.safe_load(DEFAULT_CONFIG.read_text()))
    cfg["tokens"]["channels"][0]["reference"]["sd"] = 0
    (tmp_path / "sd.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(CohortConfigError, match=r"tokens\.channels\[0\] \('hr'\)\.reference\.sd must be a number > 0"):
        load_config(tmp_path / "sd.yaml")
