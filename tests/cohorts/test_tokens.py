"""Hourly patient-state tokens, their labels and the two scoring protocols, on hand-made stays."""
import hashlib
from datetime import datetime, timedelta

import numpy as np
import polars as pl
import pytest

from cohorts.definitions import is_eval_subject
from cohorts.endpoints import endpoints_from_config
from cohorts.evaluation import aggregate, holm
from cohorts.protocols import (StreamingSettings, exact_alpha, fixed_context_selections, h2o_proxy_kept, retrieval,
                               score_fixed_context, streaming_sv, token_streams)
from cohorts.tokens import build_tokens, label_tokens
from memory.kernels import rbf
from memory.libsvm import sklearn_fit
from pipeline.meds import shard_path, write_frame_shard
from pipeline.sharding import Sharding
from tests.builders import edited_config

T0 = datetime(2150, 1, 1, 8, 0, 0)
VITAL = {"hr": "CHART//220045", "sbp": "CHART//220179", "dbp": "CHART//220180", "rr": "CHART//220210",
         "spo2": "CHART//220277", "temp": "CHART//223762", "tempf": "CHART//223761", "map": "CHART//220052"}


def _subject(split, cfg, start):
    """The first subject id from ``start`` on that the configured split puts in ``split``."""
    s = start
    while is_eval_subject(s, cfg) != (split == "eval"):
        s += 1
    return s


def _write_store(root, stays, events):
    """A store as extraction writes it: stays.parquet and its MEDS shards data/K.parquet."""
    pl.DataFrame(stays).write_parquet(root / "stays.parquet")
    ev = pl.DataFrame(events).with_columns(
        pl.col("time").cast(pl.Datetime("us")),
        pl.lit(None, dtype=pl.String).alias("text_value"), pl.lit(None, dtype=pl.Int64).alias("hadm_id"),
        pl.lit("chartevents").alias("source_table"), pl.lit(None, dtype=pl.String).alias("unit"))
    ev = ev.with_columns(pl.Series("event_hash", [hashlib.sha256(f"{i}".encode()).hexdigest()[:32]
                                                  for i in range(ev.height)]), pl.lit(0).alias("occurrence"))
    for k, shard in ev.with_columns(Sharding.of_store(root).expr(pl.col("subject_id")).alias("k")).group_by("k"):
        write_frame_shard(shard, shard_path(root, k[0]))
    return root


def _reading(stay, subject, hours, name, value):
    return {"stay_id": stay, "subject_id": subject, "time": T0 + timedelta(hours=hours), "code": VITAL[name],
            "numeric_value": float(value)}


def _normal_hour(stay, subject, h, **over):
    vals = {"hr": 80, "sbp": 120, "dbp": 70, "rr": 16, "spo2": 97, "temp": 37.0} | over
    return [_reading(stay, subject, h + 0.1, k, v) for k, v in vals.items() if v is not None]


@pytest.fixture()
def store(tmp_path):
    cfg = edited_config(lambda raw: raw["tokens"].update(scaling="training_split"))  # tests fitted statistics
    train, ev = _subject("train", cfg, 1000), _subject("eval", cfg, 1000)
    stays = {"stay_id": [1, 2], "subject_id": [train, ev], "hadm_id": [10, 20], "first_careunit": ["MICU"] * 2,
             "intime": [T0, T0], "outtime": [T0 + timedelta(hours=24)] * 2, "anchor_age": [60, 70]}
    events = []
    for h in range(6):   # training stay: hours 0-5, every channel but an implausible HR at hour 4
        events += _normal_hour(1, train, h, hr=500 if h == 4 else 80 + h, temp=None)
    events.append(_reading(1, train, 2.2, "tempf", 98.6))           # degF -> 37.0 degC
    # evaluation stay: HR at hours 2 and 5 only; SpO2 low at hour 3; no temperature at all; MAP < 65 at hour 3
    events += [_reading(2, ev, 2.5, "hr", 135), _reading(2, ev, 5.5, "hr", 100)]
    events += [_reading(2, ev, h + 0.3, "spo2", 85 if h == 3 else 97) for h in range(6)]
    events += [_reading(2, ev, h + 0.3, c, v) for h in range(6) for c, v in (("sbp", 120), ("dbp", 70),
                                                                                ("rr", 16))]
    events.append(_reading(2, ev, 3.4, "map", 60))
    return _write_store(tmp_path, stays, events), cfg, train, ev


def test_tokens_fill_forward_then_backward_then_training_median(store):
    root, cfg, _, _ = store
    table = build_tokens(root, cfg)
    tok = table.tokens.sort("stay_id", "hour")
    ev = tok.filter(pl.col("stay_id") == 2)
    assert ev["hour"].to_list() == list(range(6))
    # HR observed at hours 2 (135) and 5 (100): back-filled to 0-1, forward-filled to 3-4
    assert ev["hr"].to_list() == [135, 135, 135, 135, 135, 100]
    # no temperature in the stay: the training split's median, not a statistic of this stay
    train_temp = tok.filter(pl.col("stay_id") == 1)["temp"]
    assert ev["temp"].to_list() == [pytest.approx(float(train_temp.median()))] * 6


def test_plausibility_filter_and_fahrenheit_conversion(store):
    root, cfg, _, _ = store
    table = build_tokens(root, cfg)
    tr = table.tokens.filter(pl.col("stay_id") == 1).sort("hour")
    assert table.artifacts["hr"] == 1 and table.readings["hr"] == 8
    assert tr["hr"].to_list() == [80, 81, 82, 83, 83, 85]          # hour 4's 500 bpm dropped, hour 3 carried
    assert tr["temp"].to_list() == [pytest.approx(37.0)] * 6       # 98.6 degF at hour 2, filled both ways
    assert tr.filter(pl.col("hour") == 4)["readings"].item() == 4  # 5 readings, the artifact not among them
    assert tr.filter(pl.col("hour") == 2)["event_hash"].list.len().item() == 6


def test_scaling_uses_the_training_split_only(store):
    root, cfg, _, _ = store
    table = build_tokens(root, cfg)
    tr = table.tokens.filter(pl.col("split") == "train")
    assert table.scaling.mean[0] == pytest.approx(tr["hr"].mean())
    assert table.scaling.sd[0] == pytest.approx(tr["hr"].std())
    keys = table.scaling.keys(table.tokens.filter(pl.col("stay_id") == 2).sort("hour"))
    assert keys[0, 0] == pytest.approx((135 - tr["hr"].mean()) / tr["hr"].std())
    # the same statistics when given back (a persisted cohort memory): the evaluation stay changes nothing
    again = build_tokens(root, cfg, scaling=table.scaling)
    assert np.array_equal(again.scaling.keys(again.tokens), table.scaling.keys(table.tokens))


def test_each_label_on_hand_made_stays(store):
    root, cfg, _, _ = store
    table = build_tokens(root, cfg)
    tok = label_tokens(table, root, cfg).filter(pl.col("stay_id") == 2).sort("hour")
    assert tok["composite_vitals"].to_list() == [True] * 5 + [False]   # HR 135 (filled) > 130; then 100
    assert tok["heldout_spo2"].to_list() == [False, False, False, True, False, False]
    assert tok["clinical_criteria"].to_list() == [False, False, False, True, False, False]  # MAP 60 at hour 3
    streams = token_streams(label_tokens(table, root, cfg), table.scaling, cfg)
    (s,) = streams
    assert s.keys["all_channels"].shape == (6, 6) and s.keys["without_spo2"].shape == (6, 5)
    assert s.label_keyset == {"composite_vitals": "all_channels", "heldout_spo2": "without_spo2",
                              "clinical_criteria": "all_channels", "rare_items": "all_channels"}
    spo2 = table.scaling.channels.index("spo2")
    assert np.array_equal(np.delete(s.keys["all_channels"], spo2, axis=1), s.keys["without_spo2"])


def test_a_channel_without_training_readings_is_a_clear_error(store):
    root, cfg, _, _ = store
    cfg = edited_config(lambda raw: raw["tokens"]["channels"].append(
        {"name": "lactate", "codes": ["LAB//50813"], "plausible": [0, 30]}), cfg)
    with pytest.raises(ValueError, match="lactate.*no plausible reading in any training-split stay"):
        build_tokens(root, cfg)


def test_fixed_context_support_is_the_exact_solve_and_baselines_keep_k():
    rng = np.random.default_rng(0)
    X = np.vstack([rng.normal(0, 0.3, (30, 2)), [[3.0, 3.0], [-3.0, 2.5]]])
    gamma, nu = 1 / 9, 0.3
    alpha = exact_alpha(X, 1 / (nu * len(X)), gamma)
    ref = sklearn_fit(rbf(X, X, gamma), 1 / (nu * len(X)))[0]
    assert np.array_equal(np.flatnonzero(alpha > 0), np.flatnonzero(ref > 1e-8))
    assert alpha[-2] > 0 and alpha[-1] > 0                           # both outliers are support
    k, sel = fixed_context_selections(X, nu, gamma, seed=1)
    assert k == int((alpha > 0).sum()) and 0 < k < len(X)
    assert all(len(kept) == k for kept in sel.values())
    assert sel["recency"].tolist() == list(range(len(X) - k, len(X)))
    # h2o_proxy keeps the densest tokens: never the two outliers
    assert not set(sel["h2o_proxy"]) & {len(X) - 2, len(X) - 1}
    assert h2o_proxy_kept(np.array([[0.0], [0.1], [5.0]]), 2, 1.0).tolist() == [0, 1]


def test_fixed_context_drops_stays_at_the_support_boundary():
    from cohorts.protocols import TokenStream
    X = np.zeros((3, 2)) + np.arange(3)[:, None] * 10.0   # far apart: every token is support, k = n
    s = TokenStream(1, 1, {"all_channels": X}, {"composite_vitals": np.array([True, False, False])},
                    {"composite_vitals": "all_channels"})
    rows = score_fixed_context(s, nu=0.3, sigma=3.0)
    assert [(r["metric"], r["value"]) for r in rows] == [("support_size_boundary", 3.0)]


def test_retrieval_is_the_nearest_kept_token():
    X = np.array([[0.0], [0.2], [5.0], [5.1]])
    y = np.array([True, False, True, False])
    assert retrieval(np.array([1, 3]), y, X, 1.0) == 0.0
    assert retrieval(np.array([0, 3]), y, X, 1.0) == 0.5
    assert retrieval(np.array([0, 2]), y, X, 1.0) == 1.0


def test_certificate_expiry_on_the_papers_counterexample():
    X = np.array([[-1.0, 0.0], [1.0, 0.0], [0.0, 0.9], [0.0, -10.0]])
    gamma = 1 / 25
    a3 = exact_alpha(X[:3], 1.0, gamma)
    assert a3.tolist() == [pytest.approx(0.5), pytest.approx(0.5), 0.0]   # the third key is reserve
    full = exact_alpha(X, 1.0, gamma)
    assert full[2] == pytest.approx(0.03327001, abs=1e-7)                 # ... and active in the full history
    # streamed at B = 2 with C = 1/(nu B) = 1: the third key is evicted as reserve (certified) before the fourth
    # arrives; the fourth then forces an uncertified eviction. The one certificate has expired.
    kept, extra = streaming_sv(X, 2, StreamingSettings(nu=0.5, sigma=5.0))
    assert 2 not in kept.tolist()
    assert extra == {"certified_fraction": 0.5, "certificate_expiry": 1.0}


def test_aggregate_long_rows_pairs_within_protocol_and_label_with_holm():
    rows = []
    for s in range(12):
        for pol, v in (("sv_certified", 1.0), ("recency", 0.0 if s < 10 else 1.0), ("random", 1.0)):
            rows.append({"stay_id": s, "protocol": "streaming", "tokens": "hourly", "keys": "all_channels",
                         "label": "composite_vitals", "budget": "32", "policy": pol, "metric": "retention",
                         "value": v})
    declared = endpoints_from_config({"token_labels": {"composite_vitals": {}}, "endpoints": {"primary": [
        {"protocol": "streaming", "label": "composite_vitals", "budget": 32, "baselines": ["recency", "random"]}]}})
    summary, paired = aggregate(rows, endpoints=declared)
    d = {p.baseline: p for p in paired}
    assert d["recency"].mean_diff == pytest.approx(10 / 12) and d["recency"].p_value < 0.01
    assert d["random"].p_value == 1.0 and d["recency"].p_holm == pytest.approx(2 * d["recency"].p_value)
    assert {r.family for r in paired} == {"primary"}
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
