"""The paper's synthetic rare-item set (Forgetful Attention, arXiv:2607.12204, section 5; design note 9.6), under
the paper's protocol: does each policy, at the SV memory's own budget, keep the items that occur once?

    python bench/rare_items_bench.py [--trials 300] [--seed 0] [--resamples 10000]

Per trial (d = 4): 12 group centres c_g ~ 1.5 N(0, I); 6 rare groups of one key and 6 common groups of 10
near-duplicates, keys c_g + 0.15 N(0, I). The stream holds the rare keys first, then the common groups' keys in
random order (so a recency window sees only common ones). Two queries per group at c_g + 0.05 N(0, I); the
second is held out. SV keeps S u E of the exact solve with C = 1/(nu n), nu = 0.45, k(a, b) = exp(-||a - b||^2 /
1.2^2); every other policy keeps k = |S u E| keys.

Recall: over the 6 held-out rare-group queries, the fraction whose readout names the query's group.
- ``uniform_rbf`` (the paper's readout): prediction = argmax over groups of sum_j k(q, x_j) onehot(group_j) over
  the kept keys; a query whose group has no kept key, or with no kept weight at all, is a miss.
- ``nearest_token`` (the product's earlier readout, kept for comparison): the group of the kept key nearest to q.

Heavy hitters: the paper's oracle ranks keys by kernel mass over all 24 queries, held-out ones included;
``warmup_heavy_hitter`` ranks by the 12 first queries only (what a deployed policy could see). ``full_context``
keeps every key (the ceiling). Each figure is the mean over trials with a 95 % percentile bootstrap CI over
trials. Paper (uniform RBF): SV 0.861, oracle heavy hitter 0.319, random 0.472, recency 0.
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
GAMMA = 1.0 / SIGMA ** 2
PAPER = {"sv_certified": 0.861, "oracle_heavy_hitter": 0.319, "random": 0.472, "recency": 0.0}
TOLERANCE = 0.03


def trial(rng):
    """(keys, group of each key, warm-up queries, held-out queries) of one trial; groups 0..5 are rare."""
    centres = rng.normal(0.0, CENTRE_SCALE, (N_RARE + N_COMMON, D))
    rare = centres[:N_RARE] + rng.normal(0.0, DUPE_NOISE, (N_RARE, D))
    common_groups = rng.permutation(np.repeat(np.arange(N_RARE, N_RARE + N_COMMON), DUPES))
    common = centres[common_groups] + rng.normal(0.0, DUPE_NOISE, (len(common_groups), D))
    X = np.vstack([rare, common])
    groups = np.concatenate([np.arange(N_RARE), common_groups])
    queries = centres[:, None, :] + rng.normal(0.0, QUERY_NOISE, (len(centres), 2, D))
    return X, groups, queries[:, 0], queries[:, 1]


def top_by_mass(X, queries, k):
    return np.argsort(-rbf(queries, X, GAMMA).sum(0), kind="stable")[:k]


def selections(X, warmup, heldout, rng):
    """Budget k = |S u E| and each policy's kept keys."""
    n = len(X)
    sv = np.flatnonzero(exact_alpha(X, 1.0 / (NU * n), GAMMA) > 0.0)
    k = len(sv)
    return k, {"sv_certified": sv,
               "oracle_heavy_hitter": top_by_mass(X, np.vstack([warmup, heldout]), k),
               "warmup_heavy_hitter": top_by_mass(X, warmup, k),
               "random": rng.choice(n, k, replace=False), "recency": np.arange(n - k, n),
               "softmax_h2o": online_kept("softmax_h2o", X, k, 0),
               "residual_delta": online_kept("residual_delta", X, k, 0),
               "full_context": np.arange(n)}


def uniform_rbf_recall(kept, X, groups, heldout):
    """The paper's readout: per query, kernel weight summed per group over the kept keys; the argmax group."""
    weight = rbf(heldout[:N_RARE], X[kept], GAMMA) @ np.eye(N_RARE + N_COMMON)[groups[kept]]
    hit = (np.argmax(weight, axis=1) == np.arange(N_RARE)) & (weight[np.arange(N_RARE), np.arange(N_RARE)] > 0.0)
    return float(hit.mean())


def nearest_token_recall(kept, X, groups, heldout):
    nearest = np.argmax(rbf(heldout[:N_RARE], X[kept], GAMMA), axis=1)
    return float((groups[kept][nearest] == np.arange(N_RARE)).mean())


READOUTS = {"uniform_rbf": uniform_rbf_recall, "nearest_token": nearest_token_recall}


def bootstrap_ci(values, rng, resamples):
    v = np.asarray(values)
    means = v[rng.integers(0, len(v), (resamples, len(v)))].mean(1)
    return np.quantile(means, [0.025, 0.975])


def run(trials: int, seed: int):
    """Per readout and policy, the recall of every trial; and the budget fraction of every trial."""
    rng = np.random.default_rng(seed)
    recall = {r: {} for r in READOUTS}
    budgets = []
    for _ in range(trials):
        X, groups, warmup, heldout = trial(rng)
        k, kept = selections(X, warmup, heldout, rng)
        budgets.append(k / len(X))
        for readout, score in READOUTS.items():
            for name, idx in kept.items():
                recall[readout].setdefault(name, []).append(score(np.asarray(idx), X, groups, heldout))
    return recall, np.asarray(budgets)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resamples", type=int, default=10_000)
    args = ap.parse_args(argv)
    recall, budgets = run(args.trials, args.seed)
    boot = np.random.default_rng(args.seed + 1)
    print(f"{args.trials} trials, n = {N_RARE + N_COMMON * DUPES} keys, budget k = |S u E| = {budgets.mean():.1%} "
          f"of the stream on average (paper: 56 %)")
    for readout, by_policy in recall.items():
        print(f"\nreadout: {readout}{'  (the paper' + chr(39) + 's)' if readout == 'uniform_rbf' else ''}")
        print(f"{'policy':<22}{'rare recall':>12}{'95% CI':>18}{'paper':>8}{'|diff|':>8}")
        for name, v in sorted(by_policy.items(), key=lambda kv: -np.mean(kv[1])):
            lo, hi = bootstrap_ci(v, boot, args.resamples)
            paper = PAPER.get(name) if readout == "uniform_rbf" else None
            cmp = (f"{paper:>8.3f}{abs(np.mean(v) - paper):>7.3f}{'' if abs(np.mean(v) - paper) <= TOLERANCE else '!'}"
                   if paper is not None else "")
            print(f"{name:<22}{np.mean(v):>12.3f}   [{lo:.3f}, {hi:.3f}]{cmp}")
    sv = np.asarray(recall["uniform_rbf"]["sv_certified"])
    for other in ("oracle_heavy_hitter", "random"):
        lo, hi = bootstrap_ci(sv - np.asarray(recall["uniform_rbf"][other]), boot, args.resamples)
        print(f"SV minus {other} (uniform RBF, paired over trials): "
              f"{np.mean(sv - recall['uniform_rbf'][other]):+.3f} [{lo:+.3f}, {hi:+.3f}]")
    print(f"'!' marks a figure more than {TOLERANCE} from the paper's")


if __name__ == "__main__":
    main()
