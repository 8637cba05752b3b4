"""The paper's synthetic rare-item set (Forgetful Attention, arXiv:2607.12204, section 5; design note 9.6):
does each policy, at the SV memory's own budget, keep the items that occur once?

    python bench/rare_items_bench.py [--trials 60] [--seed 0]

Per trial (d = 4): 12 group centres ~ N(0, 1.5^2 I); 6 rare groups of one token and 6 common groups of 10
near-duplicates (centre + N(0, 0.15^2 I)). The stream holds the rare tokens first, then the common groups'
tokens in random order (a recency window sees only the latest, common ones). Two queries per group at its centre
+ N(0, 0.05^2 I): one is the oracle's (the heavy-hitter oracle ranks tokens by summed kernel similarity to these),
the other is held out for scoring. SV keeps S u E of the exact solve with C = 1/(nu n), nu = 0.45,
k(a, b) = exp(-||a - b||^2 / 1.2^2); every other policy keeps k = |S u E| tokens. Recall: the fraction of held-out
rare-group queries whose uniform RBF readout argmax over the kept tokens is that group's token.
Paper: SV 0.861, oracle heavy hitter 0.319, random 0.472, recency 0.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cohorts.protocols import exact_alpha, online_kept  # noqa: E402
from memory.kernels import rbf  # noqa: E402

D, N_RARE, N_COMMON, DUPES = 4, 6, 6, 10
CENTRE_SCALE, DUPE_NOISE, QUERY_NOISE, SIGMA, NU = 1.5, 0.15, 0.05, 1.2, 0.45


def trial(rng):
    """(keys, group of each key, oracle queries, held-out queries) of one trial; groups 0..5 are rare."""
    centres = rng.normal(0.0, CENTRE_SCALE, (N_RARE + N_COMMON, D))
    rare = centres[:N_RARE] + rng.normal(0.0, DUPE_NOISE, (N_RARE, D))
    common_groups = np.repeat(np.arange(N_RARE, N_RARE + N_COMMON), DUPES)
    order = rng.permutation(len(common_groups))
    common_groups = common_groups[order]
    common = centres[common_groups] + rng.normal(0.0, DUPE_NOISE, (len(common_groups), D))
    X = np.vstack([rare, common])
    groups = np.concatenate([np.arange(N_RARE), common_groups])
    queries = centres[:, None, :] + rng.normal(0.0, QUERY_NOISE, (len(centres), 2, D))
    return X, groups, queries[:, 0], queries[:, 1]


def selections(X, oracle_queries, rng):
    gamma = 1.0 / SIGMA ** 2
    n = len(X)
    sv = np.flatnonzero(exact_alpha(X, 1.0 / (NU * n), gamma) > 0.0)
    k = len(sv)
    mass = rbf(oracle_queries, X, gamma).sum(0)
    return k, {"sv_certified": sv, "oracle_heavy_hitter": np.argsort(-mass, kind="stable")[:k],
               "random": rng.choice(n, k, replace=False), "recency": np.arange(n - k, n),
               "softmax_h2o": online_kept("softmax_h2o", X, k, 0),
               "residual_delta": online_kept("residual_delta", X, k, 0)}


def rare_recall(kept, X, groups, heldout):
    gamma = 1.0 / SIGMA ** 2
    hits = groups[kept][np.argmax(rbf(heldout[:N_RARE], X[kept], gamma), axis=1)] == np.arange(N_RARE)
    return float(hits.mean())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trials", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(args.seed)
    recall, budgets = {}, []
    for _ in range(args.trials):
        X, groups, oracle, heldout = trial(rng)
        k, sel = selections(X, oracle, rng)
        budgets.append(k / len(X))
        for name, kept in sel.items():
            recall.setdefault(name, []).append(rare_recall(np.asarray(kept), X, groups, heldout))
    print(f"{args.trials} trials, n = {N_RARE + N_COMMON * DUPES} tokens, budget k = |S u E| = "
          f"{np.mean(budgets):.1%} of the stream on average")
    print(f"{'policy':<22}{'rare recall':>12}{'sd over trials':>16}")
    for name, v in sorted(recall.items(), key=lambda kv: -np.mean(kv[1])):
        print(f"{name:<22}{np.mean(v):>12.3f}{np.std(v):>16.3f}")
    best_other = max(np.mean(v) for n, v in recall.items() if n != "sv_certified")
    print(f"SV minus the best other policy: {np.mean(recall['sv_certified']) - best_other:+.3f}")


if __name__ == "__main__":
    main()
