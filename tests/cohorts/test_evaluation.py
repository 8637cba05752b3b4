"""Policies on hand-built streams, metrics on hand-built cases, and the HTML report."""
import json
from dataclasses import replace
from html.parser import HTMLParser

import numpy as np
import pytest

from cohorts.evaluation import EventStream, aggregate, bootstrap_ci, run_sweep, score_stay, sign_flip_p
from memory.policies import POLICIES, Recency, ReservoirRandom, ResidualRetention, SoftmaxHeavyHitter, SVSelection
from reports.html import render_report
from run.result import RunResult
from tests.builders import hand_stay


def cloud_with_outliers(n=200, d=4, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d)) * 0.5
    outliers = [40, 90, 150]
    X[outliers] += 6.0 * rng.standard_normal((3, d))
    return X, outliers


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_respects_its_budget(name):
    X, _ = cloud_with_outliers()
    pol = POLICIES[name](16)
    for i, x in enumerate(X):
        pol.learn_one(x, x, i)
        assert len(pol.kept()) <= 16
        assert pol.kept() <= set(range(i + 1))
    assert len(pol.kept()) == 16


def test_recency_keeps_the_last_events():
    pol = Recency(5)
    for i in range(20):
        pol.learn_one(np.zeros(2), np.zeros(2), i)
    assert pol.kept() == set(range(15, 20))


def test_sv_selection_keeps_outliers_and_certifies_its_evictions():
    X, outliers = cloud_with_outliers()
    pol = SVSelection(32, gamma=0.5)
    for i, x in enumerate(X):
        pol.learn_one(x, x, i)
    assert set(outliers) <= pol.kept()
    assert pol.certified + pol.uncertified == len(X) - 32
    assert pol.certified > 0
    assert pol.memory.kkt_residual() <= 1e-10


def test_sv_selection_rejects_an_infeasible_rule():
    with pytest.raises(ValueError, match="infeasible"):
        SVSelection(8, nu=1.5)


def test_h2o_protects_recent_events_and_reservoir_is_seeded():
    X, _ = cloud_with_outliers()
    pol = SoftmaxHeavyHitter(10)
    for i, x in enumerate(X):
        pol.learn_one(x, x, i)
    assert set(range(len(X) - 5, len(X))) <= pol.kept()
    a, b = ReservoirRandom(10, seed=3), ReservoirRandom(10, seed=3)
    for i, x in enumerate(X):
        a.learn_one(x, x, i)
        b.learn_one(x, x, i)
    assert a.kept() == b.kept()


def test_residual_retention_keeps_the_worst_predicted():
    pol = ResidualRetention(3)
    base = np.array([1.0, 0.0, 0.0])
    for i in range(30):
        pol.learn_one(base, base, i)  # learned quickly: residuals shrink
    novel = np.array([0.0, 1.0, 0.0])
    pol.learn_one(novel, novel * 5, 30)
    assert 30 in pol.kept()


def test_metrics_on_a_hand_built_stay():
    stay = hand_stay()
    m = score_stay(stay, 3, ("recency",))["recency"]
    # recency of 3 keeps hour 3 only: 1 of 2 deterioration hours at the end; each hour held at its own end
    assert m["det_retention_end"] == 0.5
    assert m["det_retention_hour_end"] == 1.0
    assert m["rare_recall"] == 0.0
    m_all = score_stay(stay, 12, ("recency",))["recency"]
    assert m_all["det_retention_end"] == 1.0 and m_all["rare_recall"] == 1.0
    assert m_all["output_deviation"] == pytest.approx(0.0, abs=1e-12)


def test_learned_key_row_runs_only_with_learned_keys():
    stay = hand_stay()
    assert "sv_learned" not in score_stay(stay, 4)
    with_keys = score_stay(replace(stay, learned_keys=stay.keys * 3.0), 4)
    assert with_keys["sv_learned"]["kept"] == 4


def test_aggregate_pairs_sv_with_each_baseline():
    rows = []
    for s in range(10):
        rows.append({"stay_id": s, "budget": "8", "policy": "sv_certified", "rare_recall": 1.0})
        rows.append({"stay_id": s, "budget": "8", "policy": "recency", "rare_recall": 0.0 if s < 8 else 1.0})
    summary, paired = aggregate(rows)
    d = [p for p in paired if p.baseline == "recency"][0]
    assert d.mean_diff == pytest.approx(0.8) and d.n == 10 and d.p_value < 0.05
    lo, hi = bootstrap_ci([1.0] * 5)
    assert lo == hi == 1.0
    assert sign_flip_p([0.0, 0.0]) == 1.0


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.external = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for k, v in attrs:
            if k in ("src", "href") and v and not v.startswith("#"):
                self.external.append(v)


def test_report_is_self_contained_and_covers_every_policy_and_budget(tmp_path):
    stays = [replace(hand_stay(), stay_id=i, keys=hand_stay().keys + i * 0.1,
                     learned_keys=2.0 * hand_stay().keys - i * 0.1) for i in range(4)]
    rows = run_sweep(stays, budgets=(4, 8), fractions=(0.5,), workers=1)
    summary, paired = aggregate(rows)
    result = RunResult(tuple(summary), tuple(paired), {"stays": 4, "eval_stays": 4},
                       {"data_source": "hand-built", "code_version": "test"})
    path = render_report(result, tmp_path)
    text = path.read_text()
    p = _Collect()
    p.feed(text)
    assert p.external == [] and "script" not in p.tags
    assert p.tags.count("svg") >= 3
    for pol in POLICIES:
        assert pol in text
    assert "4 events" in text and "8 events" in text and "50% of stream" in text
    data = json.loads((tmp_path / "report.json").read_text())
    assert {r["policy"] for r in data["summary"]} == set(POLICIES)
    assert "stay_id" not in text


def test_fraction_budgets_are_capped_at_the_largest_fixed_budget():
    from cohorts.evaluation import fraction_budget
    assert fraction_budget(0.1, 300, cap=64) == 30
    assert fraction_budget(0.2, 40_000, cap=256) == 256
    assert fraction_budget(0.01, 100, cap=256) == 4
    assert fraction_budget(0.2, 40_000, cap=None) == 8000
    rng = np.random.default_rng(0)
    n = 400
    stay = EventStream(stay_id=1, subject_id=1, keys=rng.standard_normal((n, 3)), hours=np.arange(n) // 20,
                       deteriorating=np.zeros(n, dtype=bool), rare=np.zeros(n, dtype=bool))
    rows = run_sweep([stay], budgets=(8, 16), fractions=(0.5,), policies=("recency",), workers=1)
    assert {r["budget"]: r["kept"] for r in rows} == {"8": 8, "16": 16, "f0.5": 16}


def test_balanced_chunks_spread_the_work_and_keep_every_stay():
    from cohorts.evaluation import balanced_chunks
    sizes = [40_000, 3000, 2500, 2000, 1500, 1000, 900, 800, 700]
    stays = [replace(hand_stay(), stay_id=i, keys=np.zeros((n, 1))) for i, n in enumerate(sizes)]
    chunks = balanced_chunks(stays, 4)
    assert sorted(s.stay_id for c in chunks for s in c) == list(range(len(sizes)))
    loads = [sum(len(s) for s in c) for c in chunks]
    assert loads == sorted(loads, reverse=True) and loads[0] == 40_000  # the long stay alone, first
    assert max(loads[1:]) - min(loads[1:]) <= 1500
    assert len(balanced_chunks(stays[:2], 8)) == 2


def test_a_fraction_point_on_a_fixed_budget_is_scored_once(monkeypatch):
    import cohorts.evaluation as ev
    calls = []
    real = ev.score_stay
    monkeypatch.setattr(ev, "score_stay", lambda stay, budget, *a, **k: calls.append(budget) or real(stay, budget,
                                                                                                       *a, **k))
    rng = np.random.default_rng(1)
    n = 200
    stay = EventStream(stay_id=7, subject_id=7, keys=rng.standard_normal((n, 3)), hours=np.arange(n) // 10,
                       deteriorating=np.arange(n) % 17 == 0, rare=np.arange(n) % 31 == 0)
    rows = ev.run_sweep([stay], budgets=(8, 20), fractions=(0.1, 0.5), policies=("sv_certified", "random"),
                        workers=1)
    assert sorted(calls) == [8, 20]  # f0.1 -> 20 (a fixed budget), f0.5 -> 100 capped at 20
    by = {(r["budget"], r["policy"]): r for r in rows}
    assert set(b for b, _ in by) == {"8", "20", "f0.1", "f0.5"}
    for label in ("f0.1", "f0.5"):
        assert {k: v for k, v in by[(label, "sv_certified")].items() if k != "budget"} == \
               {k: v for k, v in by[("20", "sv_certified")].items() if k != "budget"}


def test_a_policy_takes_only_the_options_it_names_and_a_misspelled_one_is_refused():
    from memory.policies import make_policy
    assert make_policy("random", 4, seed=3, gamma=0.5).rng.integers(10**6) == \
        ReservoirRandom(4, seed=3).rng.integers(10**6)                  # gamma is SV's, not the reservoir's
    with pytest.raises(TypeError):
        Recency(4, seed=1)
    with pytest.raises(TypeError, match="gama"):
        make_policy("sv_certified", 4, gama=0.5)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_policy_keeps_every_event_of_a_stream_no_longer_than_its_budget(name):
    """What token scoring skips running (``cohorts.protocols.score_streaming``): a policy evicts only past its
    budget, so a stream that never exceeds it is kept whole, with no eviction."""
    X = cloud_with_outliers()[0][:16]
    pol = POLICIES[name](16)
    for i, x in enumerate(X):
        pol.learn_one(x, x, i)
    assert pol.kept() == set(range(16))
    if isinstance(pol, SVSelection):
        assert pol.certified + pol.uncertified == 0


def test_streaming_rows_of_a_stream_within_the_budget_are_those_of_running_every_policy(tmp_path):
    from cohorts.protocols import STREAMING_POLICIES, StreamingSettings, TokenStream, score_streaming
    rng = np.random.default_rng(4)
    X = rng.standard_normal((20, 3))
    y = np.arange(20) % 3 == 0
    stream = TokenStream(5, 5, {"all_channels": X}, {"composite_vitals": y}, {"composite_vitals": "all_channels"},
                         memory_path=str(tmp_path / "m.npz"))
    settings = StreamingSettings(nu=0.5, sigma=3.0)
    skipped = score_streaming(stream, [("32", 32)], settings)
    assert not (tmp_path / "m.npz").exists()
    run = score_streaming(stream, [("32", 32)], settings, memory_budget=32)  # its memory is kept: every policy runs
    assert (tmp_path / "m.npz").exists()
    assert skipped == run
    assert {r["policy"] for r in run} == set(STREAMING_POLICIES)
    assert all(r["value"] == 1.0 for r in run if r["metric"] == "retention")


def test_the_compiled_resampling_means_are_numpys_to_the_bit():
    """``cohorts.resampling`` sums each resample in numpy's pairwise order instead of materialising it: every
    length a run meets (below 8, one block of 128, split halves) gives numpy's numbers exactly."""
    from cohorts.resampling import flipped_means, resampled_means
    rng = np.random.default_rng(2)
    for n in [1, 2, 7, 8, 9, 15, 16, 17, 127, 128, 129, 255, 256, 257, 300, 777, 1370, 2000]:
        x = rng.standard_normal(n) * rng.uniform(0.01, 100.0)
        draws = rng.integers(0, n, size=(30, n)).astype(np.int16)
        assert np.array_equal(resampled_means(x, draws), x[draws].mean(1))
        flips = rng.choice([-1.0, 1.0], size=(30, n)).astype(np.int8)
        assert np.array_equal(flipped_means(x, flips), (flips * x).mean(1))
        # several samples of one size as a matrix's columns: each column's means are numpy's of that sample
        X = rng.standard_normal((n, 5)) * rng.uniform(0.01, 100.0, 5)
        resampled, flipped = resampled_means(X, draws), flipped_means(X, flips)
        assert resampled.shape == flipped.shape == (30, 5)
        for g in range(5):
            assert np.array_equal(resampled[:, g], X[:, g][draws].mean(1))
            assert np.array_equal(flipped[:, g], (flips * X[:, g]).mean(1))


def test_samples_tested_together_give_each_sample_s_numbers_alone():
    """bootstrap_cis and sign_flip_ps resample the samples of one size together (one matrix, its columns split
    over threads); each sample's CI and p equal those it gets alone, whatever the sizes, resample counts and
    degenerate samples (empty, all zero, above the normal limit) among them."""
    from cohorts.evaluation import RESAMPLE_MAX_N, bootstrap_cis, sign_flip_ps
    rng = np.random.default_rng(5)
    samples = [rng.standard_normal(n) + rng.uniform(-0.3, 0.3) for n in (40, 40, 40, 7, 40, 7, 300)]
    samples += [np.zeros(40), np.array([]), rng.standard_normal(RESAMPLE_MAX_N + 1)]
    perms = [1000, 1000, 500, 1000, 1000, 1000, 1000, 1000, 1000, 1000]
    together_ci, together_p = bootstrap_cis(samples, n_boot=2000), sign_flip_ps(samples, perms)
    for x, n_perm, ci, p in zip(samples, perms, together_ci, together_p):
        alone_ci = bootstrap_cis([x], n_boot=2000)[0]
        assert ci == alone_ci or (np.isnan(ci).all() and np.isnan(alone_ci).all())
        assert p == sign_flip_p(x, n_perm=n_perm)
    assert together_p[7] == 1.0 and 0 < together_p[0] <= 1


def test_tests_run_side_by_side_give_the_numbers_one_at_a_time_gives(monkeypatch):
    """The bootstrap CIs and paired tests run one thread per core; every number equals a single thread's."""
    import cohorts.evaluation as evaluation
    rng = np.random.default_rng(3)
    rows = [{"stay_id": s, "subject_id": s, "protocol": "streaming", "tokens": "hourly", "keys": "k",
             "label": "clinical_criteria", "budget": b, "policy": p, "metric": "retention",
             "value": float(rng.uniform())}
            for s in range(60) for b in (8, 16, 32) for p in ("sv_certified", "recency", "random")
            if s % (b // 8) == 0]
    together = aggregate(rows)
    monkeypatch.setattr(evaluation.os, "cpu_count", lambda: 1)
    evaluation._resample_indices.cache_clear()
    evaluation._sign_flips.cache_clear()
    assert aggregate(rows) == together and len(together[1]) == 6
