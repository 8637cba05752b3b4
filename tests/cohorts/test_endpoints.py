"""Declared endpoints: the config's families, one clear error for an unknown name, Holm within a family only, and
a strong primary effect that stays significant however large the exploratory grid."""
import numpy as np
import pytest

from cohorts.definitions import CohortConfigError, load_config, resolve_config
from cohorts.endpoints import EXPLORATORY, endpoints_from_config
from cohorts.evaluation import aggregate, holm

LABELS = {"token_labels": {"composite_vitals": {}, "heldout_spo2": {}}}
PRIMARY = {"protocol": "fixed_context", "label": "composite_vitals", "budget": "k", "baselines": "h2o_proxy"}


def _declared(**families):
    return endpoints_from_config({**LABELS, "endpoints": families})


@pytest.mark.parametrize("entry, message", [
    ({**PRIMARY, "protocol": "fixed"}, "unknown protocol 'fixed'"),
    ({**PRIMARY, "label": "sepsis"}, "unknown label 'sepsis'"),
    ({**PRIMARY, "budget": 32}, "budget is k"),
    ({**PRIMARY, "protocol": "streaming", "budget": "lots"}, "budget 'lots'"),
    ({**PRIMARY, "baselines": ["h2o"]}, "unknown baseline 'h2o'"),
    ({**PRIMARY, "protocol": "streaming", "budget": 32, "baselines": "h2o_proxy"}, "unknown baseline 'h2o_proxy'"),
    ({**PRIMARY, "metric": "auroc"}, "unknown metric 'auroc'"),
])
def test_an_unknown_protocol_label_budget_policy_or_metric_is_one_clear_error(entry, message):
    with pytest.raises(CohortConfigError, match=message):
        _declared(primary=[entry])


def test_a_comparison_declared_twice_or_an_unknown_family_is_refused():
    with pytest.raises(CohortConfigError, match="declared twice"):
        _declared(primary=[PRIMARY], secondary=[PRIMARY])
    with pytest.raises(CohortConfigError, match="unknown key"):
        _declared(tertiary=[PRIMARY])


def test_the_shipped_configs_declare_a_small_primary_family():
    for name in ("default", "mimic-iv-meds"):
        e = load_config(resolve_config(name)).endpoints
        assert 1 <= e.size("primary") <= 6 and e.size("secondary") >= 1
        assert e.as_settings()["primary"][0].startswith("fixed context, hourly tokens, composite_vitals")


def _rows(n_stays=30, grid=700, seed=0):
    """One strong primary comparison (SV keeps 0.9, h2o_proxy 0.1, with noise) and a large null grid: 700
    streaming budgets where SV and recency differ by noise only."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(n_stays):
        for pol, mean in (("sv_certified", 0.9), ("h2o_proxy", 0.1)):
            rows.append({"stay_id": s, "protocol": "fixed_context", "tokens": "hourly", "keys": "all_channels",
                         "label": "composite_vitals", "budget": "k", "policy": pol, "metric": "retention",
                         "value": float(np.clip(mean + rng.normal(0, 0.1), 0, 1))})
        for b in range(grid):
            for pol in ("sv_certified", "recency"):
                rows.append({"stay_id": s, "protocol": "streaming", "tokens": "hourly", "keys": "all_channels",
                             "label": "composite_vitals", "budget": str(b + 1), "policy": pol,
                             "metric": "retention", "value": float(rng.random())})
    return rows


def test_a_strong_primary_effect_is_significant_however_large_the_exploratory_grid():
    rows = _rows()
    _, paired = aggregate(rows, endpoints=_declared(primary=[PRIMARY]))
    primary = [d for d in paired if d.family == "primary"]
    assert len(primary) == 1 and len(paired) == 701
    assert primary[0].p_holm == primary[0].p_value < 0.001 and primary[0].p_wilcoxon < 1e-5
    assert all(d.p_holm is None for d in paired if d.family == EXPLORATORY)
    # what Holm over the whole run gave: 701 comparisons with a sign-flip floor of 1/10001 -> never below 0.07
    assert holm([d.p_value for d in paired])[paired.index(primary[0])] > 0.05


def test_holm_runs_within_each_family_and_resamples_suffice_for_its_alpha():
    e = _declared(primary=[PRIMARY], secondary=[{**PRIMARY, "label": "heldout_spo2",
                                                 "baselines": ["h2o_proxy", "recency", "random"]}], alpha=0.001)
    assert e.size("primary") == 1 and e.size("secondary") == 3
    assert 3 / (e.resamples("secondary") + 1) <= 0.001 / 10
    rows = [r for r in _rows(grid=0)]
    rows += [{**r, "label": "heldout_spo2", "keys": "without_spo2"} for r in rows]
    rows += [{**r, "policy": p} for r in rows if r["policy"] == "h2o_proxy" for p in ("recency", "random")]
    _, paired = aggregate(rows, endpoints=e)
    sec = [d for d in paired if d.family == "secondary"]
    assert len(sec) == 3
    assert [d.p_holm for d in sec] == pytest.approx(holm([d.p_value for d in sec]))
