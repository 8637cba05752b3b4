"""The paper's rare-item protocol as the bench runs it: the readouts' rules, and the paper's ordering on a few
trials (the full comparison with the paper's figures is the bench's own output)."""
import importlib.util
from pathlib import Path

import numpy as np

spec = importlib.util.spec_from_file_location(
    "rare_items_bench", Path(__file__).resolve().parents[2] / "bench" / "rare_items_bench.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _toy():
    """Rare group 0 at the origin; common group 6 near it, ten keys strong; the other groups far away."""
    X = np.zeros((11, bench.D))
    X[1:] = 0.6
    groups = np.array([0] + [6] * 10)
    heldout = np.full((bench.N_RARE + bench.N_COMMON, bench.D), 50.0)
    heldout[0] = 0.0
    return X, groups, heldout


def test_uniform_rbf_sums_weight_per_group_where_nearest_token_does_not():
    X, groups, heldout = _toy()
    kept = np.arange(11)
    # nearest token: the rare key itself; summed per group: ten common keys outweigh it -> a miss
    assert bench.nearest_token_recall(kept, X, groups, heldout) == 1 / bench.N_RARE
    assert bench.uniform_rbf_recall(kept, X, groups, heldout) == 0.0
    assert bench.uniform_rbf_recall(kept[:2], X, groups, heldout) == 1 / bench.N_RARE


def test_a_group_without_a_kept_key_is_a_miss_even_when_the_argmax_ties_at_zero():
    X, groups, heldout = _toy()
    assert bench.uniform_rbf_recall(np.array([], dtype=int), X, groups, heldout) == 0.0


def test_the_protocol_orders_the_policies_as_the_paper_does():
    recall, budgets = bench.run(trials=30, seed=3)
    mean = {k: np.mean(v) for k, v in recall["uniform_rbf"].items()}
    assert 0.45 < budgets.mean() < 0.65
    assert mean["recency"] == 0.0
    assert mean["sv_certified"] > mean["random"] > mean["oracle_heavy_hitter"]
    assert mean["full_context"] < mean["sv_certified"]
