"""Solver properties of the exact SV memory, checked against an independent scikit-learn refit.

Tolerances (fp64): KKT residual <= 1e-10 after every operation; decision values vs the refit snapped to an
exact KKT point: median <= 1e-10, max <= 1e-8; vs sklearn's raw solution (tol=1e-12): max <= 1e-4 (libsvm's
own accuracy on clustered keys). Where the keys' Gram matrix is numerically singular (an eigenvalue below
1e-12: dozens of keys on a line) no exact reference exists; there the memory must still hold its own KKT
residual, or refuse with SolverError.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from memory import InvalidKeyError, SolverError, SVMemory, verify_against_refit
from memory.kernels import rbf
from memory.kkt import solve_exact
from memory.policies import SVSelection

KKT_TOL = 1e-10


def make_keys(rng, regime, n, d):
    """Keys of one regime. Clustered and near-duplicate keys on a line (d = 1) give Gram matrices past fp64's
    conditioning (an RBF Gram matrix of tens of points on a line has eigenvalues below 1e-16), where no
    fp64 reference can be computed to 1e-8; those regimes use at least two dimensions."""
    if regime != "random":
        d = max(d, 2)
    if regime == "random":
        return rng.standard_normal((n, d))
    centers = rng.standard_normal((max(2, n // 6), d)) * 2.0
    base = centers[rng.integers(0, len(centers), n)]
    if regime == "clustered":
        return base + 0.05 * rng.standard_normal((n, d))
    if regime == "near_duplicate":
        X = base + 0.3 * rng.standard_normal((n, d))
        half = n // 2
        X[half:] = X[rng.integers(0, half, n - half)] + 1e-3 * rng.standard_normal((n - half, d))
        return X
    if regime == "duplicated":
        X = base + 0.3 * rng.standard_normal((n, d))
        half = n // 2
        X[half:] = X[rng.integers(0, half, n - half)]
        return X
    raise ValueError(regime)


def numerically_singular(mem):
    """The stored keys' Gram matrix has an eigenvalue at rounding level: no fp64 solver, ours or the reference,
    can be held to 1e-10 there (keys on a line past a few dozen points; design note 4.6)."""
    X = np.unique(np.stack([mem.key_of(t) for t in mem.token_ids()]), axis=0)
    return np.linalg.eigvalsh(rbf(X, X, mem.gamma))[0] <= 1e-12


def check_maintained_g(mem):
    """The solver leaves its maintained g within its stated error bound of the coefficients' fp64 g (exact
    summation-order differences aside: 1e-13), and whatever reads g gets it exact."""
    live = mem._state.live_slots()
    exact = mem._solver.exact_g()[live]
    assert np.all(np.abs(mem._state.buf.g[live] - exact) <= mem._state.g_err + 1e-13)
    tid = mem.token_ids()[0]
    slot = mem._state.atoms.slot_of(tid)
    assert abs(mem.decision_value_of(tid) - exact[list(live).index(slot)]) <= 1e-13 and mem._state.g_err == 0


def check_refit(mem, probes=None):
    rep = verify_against_refit(mem, probes=probes)
    assert rep.kkt_residual_memory <= KKT_TOL
    if rep.kkt_residual_refit > 1e-12:
        # No exact reference to compare with: allowed only where the problem is past fp64.
        assert numerically_singular(mem), rep
        return rep
    if numerically_singular(mem):
        # The reference solved to rounding, but on a Gram matrix past fp64 (module docstring) two points with
        # KKT residuals within tolerance can differ by far more than 1e-10 in decision value: the memory is
        # held to its own residual (above) only.
        return rep
    assert rep.nondegenerate_mismatches == 0, rep
    assert rep.median_dev <= 1e-10, rep
    assert rep.max_dev <= 1e-8, rep
    if rep.rho_pinned:
        assert rep.max_dev_raw <= 1e-4, rep  # libsvm stops at its own tolerance; ill-conditioned keys amplify it
    return rep


scenario = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1),
    "regime": st.sampled_from(["random", "clustered", "near_duplicate", "duplicated"]),
    "n": st.integers(8, 36),
    "d": st.integers(1, 4),  # near-duplicate and clustered regimes use d >= 2 (see make_keys)
    "inv_c": st.one_of(st.integers(2, 8).map(float), st.floats(1.5, 8.0)),  # integer 1/C hits empty margins
    "gamma": st.floats(0.2, 3.0),
    "ops": st.lists(st.booleans(), min_size=5, max_size=30),  # True: add a new key, False: remove one
})


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario)
# Near-duplicate keys whose margin set needs more than one step of iterative refinement (sum(a) was 1 - 3e-11).
@example({"seed": 3, "regime": "near_duplicate", "n": 8, "d": 1, "inv_c": 2.0, "gamma": 1.0, "ops": [True] * 5})
# Keys on a line whose maintained inverse drifted to |R M - I| ~ 1e-3: refinement alone did not converge.
@example({"seed": 25, "regime": "random", "n": 25, "d": 1, "inv_c": 5.0, "gamma": 2.0740701153763217,
          "ops": [False, False, True, True, True, False, True, True, False, True]})
# Near-duplicates whose decrement ended off the optimum and whose repair from those coefficients did not converge.
@example({"seed": 8, "regime": "near_duplicate", "n": 8, "d": 1, "inv_c": 6.0, "gamma": 1.0,
          "ops": [False, False, False, True, False]})
# 36 keys on a line at gamma 2.7: the Gram matrix is numerically indefinite (eigenvalue -2e-15); the memory's
# repair and the reference batch solve both end at residual 1.8e3, so the memory raises SolverError.
@example({"seed": 259, "regime": "random", "n": 34, "d": 1, "inv_c": 2.0, "gamma": 2.695888979272055,
          "ops": [False] * 6 + [True] * 8 + [False] * 3 + [True] * 3 + [False] * 2})
@example({"seed": 1301702, "regime": "random", "n": 30, "d": 1, "inv_c": 2.0, "gamma": 1.91015625,
          "ops": [False] * 5})  # 30 keys on a line (eigenvalue -6e-16): a repair ended at 7.8e-10
# 36 keys on a line (eigenvalue -1.6e-15): the reference's residual is 1e-15, yet the memory's point (residual
# 8e-11) differs from it by 1e-8 in decision value; the same on the code before the solver-state refactor.
@example({"seed": 102338, "regime": "random", "n": 36, "d": 1, "inv_c": 2.0, "gamma": 2.189834519288686,
          "ops": [False] * 5})
# Removing one copy of a duplicated margin atom whose coefficient was its new box less one ulp: it stayed in the
# margin set, pinning rho at one end of its interval instead of the midpoint (the atom is on its bound).
@example({"seed": 153132, "regime": "duplicated", "n": 8, "d": 1, "inv_c": 4.0, "gamma": 2.0, "ops": [False] * 7})
def test_random_add_remove_sequences_stay_exact(sc):
    rng = np.random.default_rng(sc["seed"])
    X = make_keys(rng, sc["regime"], sc["n"] + len(sc["ops"]), sc["d"])
    mem = SVMemory(C=1.0 / sc["inv_c"], gamma=sc["gamma"])
    try:
        ids = [mem.add(x) for x in X[:sc["n"]]]
        nxt = sc["n"]
        assert mem.kkt_residual() <= KKT_TOL
        for is_add in sc["ops"]:
            if is_add or (len(ids) - 1) * mem.C < 1.0:
                ids.append(mem.add(X[nxt]))
                nxt += 1
                assert mem.kkt_residual() <= KKT_TOL
            else:
                tid = ids.pop(int(rng.integers(len(ids))))
                removed_key = mem.key_of(tid)
                mem.remove(tid)
                check_maintained_g(mem)
                check_refit(mem, probes=removed_key[None, :])
    except SolverError:
        # The memory refuses (a clear error) only where the reference batch solve fails as well.
        assert numerically_singular(mem)
        return
    assert sum(mem.alpha_.values()) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("regime", ["random", "clustered", "near_duplicate", "duplicated"])
def test_incremental_build_equals_batch_solution(regime):
    rng = np.random.default_rng(7)
    X = make_keys(rng, regime, 80, 3)
    mem = SVMemory(C=1 / 10, gamma=0.7)
    for x in X:
        mem.add(x)
    rep = check_refit(mem)
    assert rep.max_alpha_dev <= 1e-9 or regime == "duplicated"
    assert rep.partition_agreement == 1.0 or rep.nondegenerate_mismatches == 0


def test_adds_then_removes_return_to_the_original_state():
    rng = np.random.default_rng(3)
    X = rng.standard_normal((50, 2))
    mem = SVMemory(C=1 / 6, gamma=1.0)
    for x in X[:40]:
        mem.add(x)
    before = mem.alpha_
    rho = mem.rho_
    extra = [mem.add(x) for x in X[40:]]
    for t in extra:
        mem.remove(t)
    after = mem.alpha_
    assert max(abs(before[t] - after[t]) for t in before) <= 1e-12
    assert abs(rho - mem.rho_) <= 1e-12


def test_exact_duplicates_split_mass_equally_and_readout_uses_their_mean():
    mem = SVMemory(C=1 / 3, gamma=1.0)
    far = [np.array([3.0, 0.0]), np.array([-3.0, 0.0]), np.array([0.0, 3.0])]
    for k in far:
        mem.add(k, value=[0.0])
    a = mem.add([0.0, -3.0], value=[1.0])
    b = mem.add([0.0, -3.0], value=[3.0])
    alpha = mem.alpha_
    assert alpha[a] == alpha[b]
    assert mem.n_atoms == 4 and mem.n_tokens == 5
    # the readout at the duplicated key is dominated by that atom, whose value is the mean of its copies
    q = np.array([0.0, -3.0])
    w = {t: alpha[t] * np.exp(-np.sum((mem.key_of(t) - q) ** 2)) for t in alpha}
    expect = sum(w[t] * mem.value_of(t) for t in w) / sum(w.values())
    np.testing.assert_allclose(mem.read(q), expect, rtol=1e-13, atol=1e-15)
    check_refit(mem)


def test_readout_is_the_alpha_weighted_kernel_average():
    rng = np.random.default_rng(1)
    X = rng.standard_normal((30, 3))
    V = rng.standard_normal((30, 2))
    mem = SVMemory(C=1 / 5, gamma=0.5)
    ids = [mem.add(x, v) for x, v in zip(X, V)]
    Q = rng.standard_normal((7, 3))
    alpha = np.array([mem.alpha_[t] for t in ids])
    W = rbf(Q, X, 0.5) * alpha
    np.testing.assert_allclose(mem.read(Q), (W @ V) / W.sum(1, keepdims=True), rtol=1e-12)
    # far from every key the kernel underflows; the log-domain readout still answers
    assert np.all(np.isfinite(mem.read(np.full(3, 100.0))))


def test_decision_function_matches_its_definition():
    rng = np.random.default_rng(2)
    X = rng.standard_normal((25, 2))
    mem = SVMemory(C=1 / 4, gamma=2.0)
    ids = [mem.add(x) for x in X]
    alpha = np.array([mem.alpha_[t] for t in ids])
    Q = rng.standard_normal((5, 2))
    g = mem.rho_ - 1.0 + 2.0 * rbf(Q, X, 2.0) @ alpha
    np.testing.assert_allclose(mem.decision_function(Q), g, atol=1e-14)
    part = mem.partition()
    for t in part.reserve:
        assert mem.alpha_[t] == 0.0 and mem.decision_value_of(t) >= -KKT_TOL
    for t in part.bound:
        assert mem.alpha_[t] == mem.C and mem.decision_value_of(t) <= KKT_TOL
    for t in part.margin:
        assert 0.0 < mem.alpha_[t] < mem.C and abs(mem.decision_value_of(t)) <= KKT_TOL


def test_snap_reaches_exact_kkt_from_a_rough_guess():
    rng = np.random.default_rng(5)
    X = rng.standard_normal((40, 3))
    K = rbf(X, X, 0.8)
    box = np.full(40, 1 / 7)
    sol = solve_exact(K, box, np.full(40, 1 / 40))
    assert sol.residual <= 1e-12


@pytest.mark.parametrize("regime", ["random", "near_duplicate"])
def test_single_precision_rates_are_within_their_stated_bound(regime):
    """The sweep locates events from rates computed on single-precision margin rows; its correctness rests on
    ``_rate_error`` bounding their distance to the fp64 rates for every atom (checked on each atom as the
    swept one, well- and ill-conditioned margin sets)."""
    from memory import solver_core as core
    rng = np.random.default_rng(5)
    mem = SVMemory(C=1 / 24, gamma=0.7)
    for x in make_keys(rng, regime, 300, 4):
        mem.add(x)
    n, m = mem._state.n, int(mem._state.buf.ints[0])
    S = mem._state.buf.S[:m]
    assert m > 10
    worst = 0.0
    for c in np.flatnonzero(mem._state.buf.status[:n] != 1)[:40]:
        _, beta = core._border_solve(mem._state.buf.K, mem._state.buf.S, m, mem._state.buf.R, c)
        for s in (1.0, -1.0):
            w = (2.0 * s) * beta[1:]
            approx = s * (2.0 * mem._state.buf.K[c, :n] + beta[0])
            core._accumulate_rows(mem._state.buf.KS32, np.arange(m), w, m, n, approx)
            exact = s * (2.0 * mem._state.buf.K[c, :n] + beta[0]) + mem._state.buf.K[:n, S] @ w
            bound = core._rate_error(w, m, 1.0, beta[0])
            gap = np.abs(approx - exact).max()
            assert gap <= bound
            worst = max(worst, gap / bound)
    assert worst > 1e-2  # the bound is not vacuous: the gap reaches a visible share of it (measured 0.14-0.25)


def test_refactorisation_falls_back_to_the_pseudo_inverse_on_a_singular_margin_set():
    """Two margin atoms with the same kernel column make the bordered matrix exactly singular; the rebuild must
    then take the pseudo-inverse (counted) instead of failing or returning non-finite entries."""
    from memory import solver_core as core
    from memory.kkt import bordered_matrix
    from memory.solver_state import GUARD, GUARDS, SolverBuffers
    X = np.array([[0.0, 0.0], [0.0, 0.0], [1.0, 0.5]])  # rows 0 and 1 equal: K's rows 0 and 1 are equal
    K = np.zeros((4, 4))
    K[:3, :3] = rbf(X, X, 0.8)
    S = np.array([0, 1, 2, 0])
    KSS, R = np.zeros((4, 4)), np.zeros((5, 5))
    ints, guards = np.array([3, 7]), np.zeros(len(GUARDS), dtype=np.int64)
    core.refactor(SolverBuffers(K=K, g=np.zeros(4), alpha=np.zeros(4), status=np.zeros(4, dtype=np.int8),
                                box=np.zeros(4), S=S, KSS=KSS, KS32=np.zeros((4, 4), dtype=np.float32), ints=ints,
                                R=R, guards=guards))
    assert guards[GUARD["pinv"]] == 1 and ints[1] == 0
    M, Rm = bordered_matrix(K, S[:3]), R[:4, :4]
    assert np.all(np.isfinite(Rm)) and np.array_equal(Rm, Rm.T)
    assert np.abs(M @ Rm @ M - M).max() <= 1e-12
    assert np.abs(Rm - np.linalg.pinv(M)).max() <= 1e-10


def test_the_maintained_g_stays_within_its_error_bound_between_operations():
    """A decrement ends without recomputing every g (``solver_core.finish``); the g it leaves must be within the
    bound it states, that bound under ``_G_RESYNC``, the next operations exact from it, and any read exact."""
    from memory import solver_core as core
    rng = np.random.default_rng(11)
    mem = SVMemory(C=1 / 24, gamma=0.7)
    for x in make_keys(rng, "random", 300, 4):
        mem.add(x)
    stale, worst = 0, 0.0
    for _ in range(60):
        part = mem.partition()
        mem.remove(sorted(part.margin | part.bound)[int(rng.integers(len(part.margin | part.bound)))])
        live = mem._state.live_slots()
        gap = np.abs(mem._state.buf.g[live] - mem._solver.exact_g()[live]).max()
        assert gap <= mem._state.g_err + 1e-13 and mem._state.g_err <= core._G_RESYNC
        if mem._state.g_err:
            stale += 1
            worst = max(worst, gap / mem._state.g_err)
        mem.add(rng.standard_normal(4) * 1.5)  # some land outside: solver-path adds from a stale g as well
    assert stale >= 50  # the decrement left g to the bound, not recomputed, in (nearly) every operation
    assert worst > 1e-3  # and the bound is not vacuous (measured: the gap reaches a visible share of it)
    assert mem.kkt_residual() <= KKT_TOL and verify_against_refit(mem).max_dev <= 1e-8


def test_a_margin_set_that_outgrows_its_buffers_takes_the_same_path_in_larger_ones(monkeypatch):
    """The margin buffers (inverse, K_SS, single-precision rows) are sized by the margin set and start small; a
    sweep whose margin set outgrows them goes on in doubled ones. The path, and so every bit of the result, must
    be the one taken in buffers large enough from the start (here they start at 2 atoms and double many times)."""
    import memory.exact_solver as solver
    rng = np.random.default_rng(3)
    X = rng.standard_normal((80, 3)) * 1.5
    roomy = SVMemory(C=1 / 12, gamma=0.5, capacity=128)  # a declared capacity sizes the margin buffers too
    monkeypatch.setattr(solver, "MARGIN_CAPACITY_START", 2)
    small = SVMemory(C=1 / 12, gamma=0.5)
    for x in X:
        roomy.add(x)
        small.add(x)
    assert small.state_digest() == roomy.state_digest() and small.kkt_residual() <= KKT_TOL
    margin_rows = small._state.buf.KSS.shape[0]
    assert 2 < margin_rows < small._state.cap and len(small.partition().margin) > margin_rows // 2
    for _ in range(10):
        part = small.partition()
        removed = sorted(part.margin | part.bound)[int(rng.integers(len(part.margin | part.bound)))]
        key = small.key_of(removed)
        small.remove(removed)
        roomy.remove(removed)
        assert small.state_digest() == roomy.state_digest()
        check_refit(small, probes=key[None, :])


def test_near_atoms_are_re_evaluated_exactly_or_every_g_is_left_for_a_full_recompute():
    """``finish``'s residual re-evaluates the atoms whose maintained g is within its bound of the wrong side of 0;
    with more of them than ``_NEAR_EXACT`` it must change nothing and ask for a full recompute (-1)."""
    from memory import solver_core as core
    from memory.kkt import RESERVE
    rng = np.random.default_rng(2)
    mem = SVMemory(C=1 / 10, gamma=0.5)
    for x in rng.standard_normal((60, 3)):
        mem.add(x)
    n, exact = mem._state.n, mem._solver.exact_g()
    reserve = np.flatnonzero(mem._state.buf.status[:n] == RESERVE)
    assert len(reserve) > core._NEAR_EXACT + 1
    g_err = 1e-3
    g = exact.copy()
    g[reserve[:3]] = [-5e-4, 0.0, 5e-4]  # three near atoms, their maintained g off by up to the bound
    buf = mem._state.buf
    worst = core._refresh_near(buf.K, buf.alpha, g, buf.status, n, -1, mem.rho_, 1.0, g_err)
    assert np.array_equal(g[reserve[:3]], [core._exact_g_one(buf.K, buf.alpha, n, mem.rho_, 1.0, i)
                                           for i in reserve[:3]])
    assert worst == max(0.0, -g[reserve[:3]].min()) and worst <= 1e-15
    g = exact.copy()
    g[reserve[:core._NEAR_EXACT + 1]] = 0.0
    before = g.copy()
    assert core._refresh_near(buf.K, buf.alpha, g, buf.status, n, -1, mem.rho_, 1.0, g_err) == -1.0
    assert np.array_equal(g, before)


fit_scenario = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1),
    "regime": st.sampled_from(["random", "clustered", "duplicated"]),
    "n": st.integers(4, 60),
    "d": st.integers(2, 6),
    "inv_c": st.floats(1.2, 12.0),
    "gamma": st.floats(0.2, 3.0),
})


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(fit_scenario)
def test_a_batch_fit_is_the_state_adding_one_by_one_reaches(sc):
    """``fit`` (one Gram matrix, one QP, snapped) ends where the maintained path ends: the same partition, the
    same coefficients to 1e-12, and exact zeros, whatever the keys' duplicates."""
    X = make_keys(np.random.default_rng(sc["seed"]), sc["regime"], sc["n"], sc["d"])
    C = 1.0 / sc["inv_c"]
    one_by_one = SVMemory(C=C, gamma=sc["gamma"])
    for i, x in enumerate(X):
        one_by_one.add(x, token_id=i)
    batch = SVMemory(C=C, gamma=sc["gamma"]).fit(X)
    assert batch.token_ids() == one_by_one.token_ids() == list(range(len(X)))
    assert batch.n_atoms == one_by_one.n_atoms
    if not one_by_one.is_feasible:
        assert not batch.is_feasible  # too few tokens for C: stored, unsolved, as add leaves them
        return
    if numerically_singular(one_by_one):
        return  # past fp64 (see check_refit): each is held to its own residual only
    assert batch.kkt_residual() <= KKT_TOL
    a, b = one_by_one.alpha_, batch.alpha_
    assert max(abs(a[t] - b[t]) for t in a) <= 1e-12
    assert {t for t in a if a[t] > 0} == {t for t in b if b[t] > 0}
    assert [batch.status_of(t) for t in b] == [one_by_one.status_of(t) for t in a]


def test_fit_replaces_the_contents_and_falls_back_to_adding_when_the_batch_solve_misses_tol(monkeypatch):
    import memory.exact_solver as exact_solver
    X = make_keys(np.random.default_rng(5), "clustered", 50, 3)
    reference = SVMemory(C=0.1, gamma=0.8)
    for i, x in enumerate(X):
        reference.add(x, token_id=f"t{i}")
    mem = SVMemory(C=0.1, gamma=0.8)
    mem.add(np.ones(3), token_id="old")
    real = exact_solver.solve_exact

    def off_by_far(K, *args, **kwargs):
        # the whole batch's solve ends above tol (as on keys past fp64's conditioning); add's seed of the first
        # ten does not
        sol = real(K, *args, **kwargs)
        if len(K) > 20:
            sol.residual = 1.0
        return sol

    monkeypatch.setattr(exact_solver, "solve_exact", off_by_far)
    mem.fit(X, token_ids=[f"t{i}" for i in range(len(X))])
    assert "old" not in mem and mem.n_tokens == len(X)
    assert mem.kkt_residual() <= KKT_TOL
    a, b = reference.alpha_, mem.alpha_
    assert max(abs(a[t] - b[t]) for t in a) <= 1e-12
    with pytest.raises(ValueError, match="one distinct token id per row"):
        mem.fit(X, token_ids=["same"] * len(X))
    with pytest.raises(InvalidKeyError, match="non-finite"):
        mem.fit(np.array([[0.0, np.nan]]))
    with pytest.raises(InvalidKeyError, match="2-D array of keys"):
        mem.fit(np.zeros(3))
    assert mem.n_tokens == len(X)  # a refused fit leaves the memory as it was


def test_the_compiled_kernel_row_and_decision_value_equal_numpys_bit_for_bit():
    from memory import solver_core as core
    from memory.kernels import squared_distances
    rng = np.random.default_rng(11)
    for d in (1, 5, 6, 9, 33):
        X = rng.standard_normal((70, d)) * rng.uniform(0.1, 10.0)
        x = rng.standard_normal(d)
        out = np.empty(70)
        core.squared_distances_to(x, X, 70, out)
        assert np.array_equal(out, squared_distances(x, X)[0])
    K = rbf(X, X, 0.3)
    alpha = rng.uniform(size=70) * (rng.uniform(size=70) < 0.3)
    act = np.flatnonzero(alpha)
    for slot in range(70):
        assert core.decision_value_of(K, alpha, slot, 70, 0.25, 1.0) == 0.25 - 1.0 + 2.0 * (K[slot, act] @ alpha[act])


def _stream_both_ways(X, budget, gamma, folder):
    """A budgeted SV stream over X with tokens passing through, and with every token added then evicted (an
    ``offer`` that adds): the two policies, their saved states' bytes, and how many tokens passed through."""
    real = SVMemory.offer
    passed = []

    def counted(self, key, value, token_id, check_input=True):
        through = real(self, key, value, token_id, check_input)
        passed.append(through)
        return through

    def adds(self, key, value, token_id, check_input=True):
        self.add(key, value, token_id, check_input)
        return False

    policies, saved = [], []
    for offer in (counted, adds):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(SVMemory, "offer", offer)
            pol = SVSelection(budget, gamma=gamma)
            for i, x in enumerate(X):
                pol.learn_one(x, None, i)
        path = folder / f"{len(policies)}.npz"
        pol.memory.save(path)
        policies.append(pol)
        saved.append(path.read_bytes())
    return policies, saved, sum(passed)


stream_scenario = st.fixed_dictionaries({
    "seed": st.integers(0, 2**31 - 1),
    "regime": st.sampled_from(["random", "clustered", "duplicated", "near_duplicate"]),
    "n": st.integers(20, 160),
    "d": st.integers(2, 5),
    "budget": st.integers(4, 24),
    "gamma": st.floats(0.02, 3.0),   # a wide kernel puts most new keys inside the description: they pass
})


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(stream_scenario)
def test_a_budgeted_stream_passing_tokens_through_ends_in_the_state_add_and_evict_reach_to_the_byte(tmp_path_factory, sc):
    """``offer`` passing a token through (a new reserve atom with the largest slack, added and evicted at once)
    leaves what ``add``, ``reserve_with_largest_slack`` and a certified ``evict`` leave, and one that adds adds as
    ``add`` does: the same evictions in the same order and the same saved state, byte for byte (keys, Gram matrix,
    g and the stale rows of free slots included)."""
    X = make_keys(np.random.default_rng(sc["seed"]), sc["regime"], sc["n"], sc["d"])
    (fast, slow), (a, b), _ = _stream_both_ways(X, sc["budget"], sc["gamma"], tmp_path_factory.mktemp("pass"))
    assert fast.certified_ids == slow.certified_ids and fast.uncertified == slow.uncertified
    assert a == b
    x = X[len(X) // 2] + 0.5      # and they go on in step
    fast.learn_one(x, None, "next")
    slow.learn_one(x, None, "next")
    assert fast.memory.state_digest() == slow.memory.state_digest()


def test_most_tokens_of_a_wide_kernels_stream_pass_through_and_end_where_adding_them_ends(tmp_path):
    X = make_keys(np.random.default_rng(3), "random", 400, 3)
    (fast, slow), (a, b), passed = _stream_both_ways(X, 16, 0.05, tmp_path)
    assert passed > 200 and a == b and fast.certified_ids == slow.certified_ids
