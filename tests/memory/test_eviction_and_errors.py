"""Certified eviction (bit-for-bit unchanged outputs) and the memory's error paths."""
import numpy as np
import pytest

from memory import (InfeasibleError, InvalidKeyError, NotCertifiableError, SolverError, SVMemory, UnknownTokenError,
                    verify_against_refit)


@pytest.fixture
def filled():
    rng = np.random.default_rng(11)
    mem = SVMemory(C=1 / 6, gamma=0.6)
    X = rng.standard_normal((60, 3))
    V = rng.standard_normal((60, 2))
    ids = [mem.add(x, v) for x, v in zip(X, V)]
    return mem, ids, rng


def test_evicting_a_reserve_token_changes_no_output_bit_for_bit(filled):
    mem, ids, rng = filled
    Q = rng.standard_normal((40, 3))
    reserve = sorted(mem.partition().reserve)
    assert len(reserve) > 10
    for tid in reserve[:10]:
        before_read, before_g = mem.read(Q), mem.decision_function(Q)
        cert = mem.certify_eviction(tid)
        assert cert.alpha == 0.0 and cert.decision_value >= 0.0 and cert.rho_pinned
        assert cert.kkt_residual_after <= 1e-10
        assert cert.digest_before != cert.digest_after
        mem.evict(tid, cert)
        assert tid not in mem
        assert np.array_equal(mem.read(Q), before_read)
        assert np.array_equal(mem.decision_function(Q), before_g)
        assert mem.state_digest() == cert.digest_after
    rep = verify_against_refit(mem)
    assert rep.max_dev <= 1e-8 and rep.nondegenerate_mismatches == 0


def test_an_eviction_without_digests_checks_the_same_and_leaves_the_same_state():
    """A policy's evictions skip the state digests (hashed lazily, per changed atom): the certificate's other
    fields, the state after and every later digest are those of an eviction with digests."""
    rng = np.random.default_rng(5)
    X = rng.standard_normal((50, 3))
    with_digests, without = SVMemory(C=1 / 6, gamma=0.6), SVMemory(C=1 / 6, gamma=0.6)
    for i, x in enumerate(X):
        with_digests.add(x, token_id=i)
        without.add(x, token_id=i)
    for tid in sorted(with_digests.partition().reserve)[:8]:
        full, bare = with_digests.evict(tid), without.evict(tid, digests=False)
        assert bare.digest_before is None and bare.digest_after is None
        assert {k: v for k, v in full.to_dict().items() if not k.startswith("digest")} == \
            {k: v for k, v in bare.to_dict().items() if not k.startswith("digest")}
        assert without.state_digest() == with_digests.state_digest() == full.digest_after
    margin = sorted(without.partition().margin)[0]
    with pytest.raises(NotCertifiableError, match="only reserve tokens"):
        without.evict(margin, digests=False)


def test_only_reserve_tokens_are_certifiable(filled):
    mem, _, _ = filled
    part = mem.partition()
    for tid in list(part.margin)[:3] + list(part.bound)[:3]:
        with pytest.raises(NotCertifiableError, match="only reserve tokens"):
            mem.certify_eviction(tid)


def test_a_certificate_from_another_state_is_refused(filled):
    mem, ids, rng = filled
    r1, r2 = sorted(mem.partition().reserve)[:2]
    cert = mem.certify_eviction(r1)
    mem.add(rng.standard_normal(3) * 5, [0.0, 0.0])  # the state changes
    with pytest.raises(NotCertifiableError, match="does not belong"):
        mem.evict(r1, cert)
    with pytest.raises(NotCertifiableError):
        mem.evict(r2, cert)
    assert r1 in mem and r2 in mem


def test_constructor_rejects_bad_C():
    for C in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InfeasibleError, match="C must be a positive finite number"):
            SVMemory(C=C)
    with pytest.raises(ValueError, match="kernel"):
        SVMemory(C=0.5, kernel="linear")
    with pytest.raises(ValueError, match="gamma"):
        SVMemory(C=0.5, gamma=-1)


def test_infeasible_until_enough_tokens_and_removals_that_would_break_it():
    mem = SVMemory(C=1 / 4)
    for i in range(3):
        mem.add([float(i), 0.0])
    assert not mem.is_feasible
    with pytest.raises(InfeasibleError, match=r"needs at least 4"):
        mem.decision_function([0.0, 0.0])
    last = mem.add([3.0, 0.0])
    assert mem.is_feasible
    assert sum(mem.alpha_.values()) == pytest.approx(1.0)
    with pytest.raises(InfeasibleError, match="would leave 3 tokens"):
        mem.remove(last)
    with pytest.raises(InfeasibleError):
        mem.remove_many([last])
    assert mem.n_tokens == 4 and mem.kkt_residual() <= 1e-12


def test_bad_keys_values_and_ids():
    mem = SVMemory(C=0.5)
    mem.add([0.0, 1.0])
    with pytest.raises(InvalidKeyError, match="non-finite"):
        mem.add([np.nan, 1.0])
    with pytest.raises(InvalidKeyError, match="non-finite"):
        mem.add([np.inf, 1.0])
    with pytest.raises(InvalidKeyError, match="dimension 3"):
        mem.add([0.0, 1.0, 2.0])
    with pytest.raises(InvalidKeyError, match="1-D"):
        mem.add([[0.0, 1.0]])
    with pytest.raises(InvalidKeyError, match="numeric"):
        mem.add(["a", "b"])
    with pytest.raises(InvalidKeyError, match="value"):
        mem.add([1.0, 1.0], value=[np.nan])
    with pytest.raises(ValueError, match="already stored"):
        mem.add([2.0, 2.0], token_id=0)
    with pytest.raises(UnknownTokenError, match="unknown token id 99"):
        mem.remove(99)
    with pytest.raises(UnknownTokenError):
        mem.certify_eviction("nope")
    assert mem.n_tokens == 1


def test_a_block_of_keys_checked_at_once_feeds_the_memory_as_keys_checked_one_by_one(tmp_path):
    """The cohort memory checks a block of keys once (memory.check_keys) and adds its rows unchecked; the saved
    state, the certified evictions and the history digest (of the keys as given, -0.0 included) equal a feed that
    checks every key."""
    from memory.cohort import DIGEST_MOD, CohortMemory, row_hashes
    rng = np.random.default_rng(7)
    keys = np.round(rng.normal(size=(300, 4)), 1)
    keys[[3, 40, 41]] = keys[[2, 39, 39]]          # duplicate keys
    keys[7, 1] = -0.0
    ids, order = [f"s:{i}" for i in range(300)], [f"{i:05d}" for i in range(300)]
    block = CohortMemory(budget=16, gamma=0.5)
    block.feed(keys, ids, order)
    each = CohortMemory(budget=16, gamma=0.5)
    for key, tid, ok in zip(keys, ids, order):
        each.policy.learn_one(key, None, tid)
        each.history = (each.history + next(row_hashes([ok], np.array([key])))) % DIGEST_MOD
    block.memory.save(tmp_path / "block.npz")
    each.memory.save(tmp_path / "each.npz")
    assert (tmp_path / "block.npz").read_bytes() == (tmp_path / "each.npz").read_bytes()
    assert block.policy.certified_ids == each.policy.certified_ids and block.history == each.history
    bad = keys.copy()
    bad[5, 2] = np.nan
    with pytest.raises(InvalidKeyError, match="key 5 of the block has non-finite"):
        CohortMemory(budget=16).feed(bad, ids, order)
    with pytest.raises(InvalidKeyError, match="dimension 3"):
        block.feed(keys[:, :3], ids, [f"x{i}" for i in range(300)])


def _row_hash(order_key, key):
    """A row's digest term as the definition states it: sha256 of the order key's and the fp64 key's bytes."""
    import hashlib
    return int.from_bytes(hashlib.sha256(order_key.encode() + np.asarray(key, dtype=np.float64).tobytes())
                          .digest()[:8], "big")


def test_the_history_digests_at_many_marks_in_one_pass_equal_each_prefix_summed_alone():
    from memory.cohort import DIGEST_MOD, CohortMemory, prefix_digests
    rng = np.random.default_rng(3)
    keys = rng.normal(size=(200, 3))
    order = sorted(f"{int(t):04d}|{i}" for i, t in enumerate(rng.integers(0, 500, 200)))
    marks = ["", "0000", order[0], order[57], order[57], order[-1], "9999", f"{order[120]}~"]
    blocks = [(order[lo:lo + 33], keys[lo:lo + 33]) for lo in range(0, 200, 33)]
    got = prefix_digests(blocks, marks)
    assert set(got) == set(marks)
    for mark in marks:
        assert got[mark] == sum(_row_hash(o, k) for o, k in zip(order, keys) if o <= mark) % DIGEST_MOD
    fed = CohortMemory(budget=16)
    fed.feed(keys[:58], [f"s:{i}" for i in range(58)], order[:58])
    assert got[order[57]] == fed.history          # what a memory fed up to the mark records
    assert prefix_digests([], ["a"]) == {"a": 0}
    # told what saved memories hold at each mark, the pass stops at the first mark none of them matches
    saved = {m: {got[m]} for m in marks}
    assert prefix_digests(blocks, marks, saved) == got
    saved[order[57]] = {got[order[57]] + 1, 5}
    stopped = prefix_digests(blocks, marks, saved)
    assert stopped == {m: got[m] for m in marks if m <= order[57]}
    saved[order[57]].add(got[order[57]])            # another memory at that mark holds the digest: no stop
    saved["9999"] = {0}
    assert prefix_digests(blocks, marks, saved) == got


def test_removing_the_last_token_is_refused():
    mem = SVMemory(C=1.0)
    t = mem.add([0.0])
    with pytest.raises(InfeasibleError, match="last token"):
        mem.remove(t)
    assert mem.n_tokens == 1


def test_user_token_ids_and_duplicate_copies_are_removed_exactly():
    mem = SVMemory(C=1 / 4, gamma=1.0)
    rng = np.random.default_rng(4)
    X = rng.standard_normal((12, 2))
    for i, x in enumerate(X):
        mem.add(x, token_id=f"e{i}")
    for i in range(6):  # copies of keys already stored
        mem.add(X[i], token_id=f"dup{i}")
    assert mem.n_atoms == 12 and mem.n_tokens == 18
    for i in range(6):
        mem.remove(f"e{i}")
        rep = verify_against_refit(mem)
        assert rep.max_dev <= 1e-8 and rep.kkt_residual_memory <= 1e-10
    assert mem.n_atoms == 12 and mem.n_tokens == 12


def test_save_and_load_round_trip_bit_for_bit_and_resume(filled, tmp_path):
    mem, ids, rng = filled
    mem.remove(sorted(mem.partition().margin)[0])
    path = tmp_path / "m.npz"
    mem.save(path)
    back = SVMemory.load(path)
    Q = rng.standard_normal((10, 3))
    assert back.state_digest() == mem.state_digest()
    assert np.array_equal(back.read(Q), mem.read(Q))
    assert np.array_equal(back.decision_function(Q), mem.decision_function(Q))
    # both continue identically
    x, v = rng.standard_normal(3) * 3, rng.standard_normal(2)
    assert mem.add(x, v) == back.add(x, v)
    victim = sorted(mem.partition().bound | mem.partition().margin)[0]
    mem.remove(victim)
    back.remove(victim)
    assert back.state_digest() == mem.state_digest()
    assert verify_against_refit(back).max_dev <= 1e-8


def test_deleted_atoms_leave_free_slots_that_no_saved_state_or_new_atom_keeps_a_trace_of(filled, tmp_path):
    """A deleted atom's slot is left free (no kernel column is moved); its key must not survive in the saved
    state, and the next new atom takes the slot without changing what a memory without the hole computes."""
    mem, ids, rng = filled
    twin = SVMemory(C=mem.C, gamma=mem.gamma)  # the same tokens, never deleted from
    victims = ids[5:25:4]
    kept = [t for t in ids if t not in set(victims)]
    for t in kept:
        twin.add(mem.key_of(t), mem.value_of(t), token_id=t)
    keys = [mem.key_of(t) for t in victims]
    for t in victims:
        mem.remove(t)
    assert mem.n_atoms == len(kept) == twin.n_atoms and mem._state.atoms.free
    mem.save(tmp_path / "m.npz")
    with np.load(tmp_path / "m.npz") as z:
        for k in keys:
            assert not np.any(np.all(z["X"] == k, axis=1))
        free = np.array(sorted(SVMemory.load(tmp_path / "m.npz")._state.atoms.free))
        assert np.all(z["K"][free] == 0.0) and np.all(z["K"][:, free] == 0.0) and np.all(z["X"][free] == 0.0)
    x = rng.standard_normal(3)
    slot_before = sorted(mem._state.atoms.free)
    mem.add(x, np.ones(2), token_id="new")
    twin.add(x, np.ones(2), token_id="new")
    assert mem._state.atoms.slot_of("new") in slot_before
    Q = rng.standard_normal((30, 3))
    assert np.max(np.abs(mem.decision_function(Q) - twin.decision_function(Q))) <= 1e-10
    assert mem.partition() == twin.partition()
    assert mem.kkt_residual() <= 1e-10 and verify_against_refit(mem).max_dev <= 1e-8


def test_preallocated_capacity_changes_no_result_and_digest_tracks_the_state():
    rng = np.random.default_rng(11)
    X = rng.standard_normal((40, 3))
    grown, sized = SVMemory(C=1 / 8, gamma=0.5), SVMemory(C=1 / 8, gamma=0.5, capacity=41)
    for x in X:
        grown.add(x)
        sized.add(x)
    assert sized._state.cap == 41 and grown._state.cap == 64
    assert sized.state_digest() == grown.state_digest()
    before = grown.state_digest()
    victim = sorted(grown.partition().margin)[0]
    grown.remove(victim)
    assert grown.state_digest() != before  # coefficients moved
    # a token id is part of the state: the same keys under other ids digest differently
    renamed = SVMemory(C=1 / 8, gamma=0.5)
    for i, x in enumerate(X):
        renamed.add(x, token_id=f"t{i}")
    assert renamed.state_digest() != sized.state_digest()


def test_evicting_one_copy_of_a_duplicated_reserve_key_and_with_rho_unpinned():
    rng = np.random.default_rng(4)
    mem = SVMemory(C=1 / 6, gamma=0.5)
    for x in rng.standard_normal((30, 2)) * 2:
        mem.add(x)
    inner = min(mem.partition().reserve, key=lambda t: -mem.decision_value_of(t))
    copy = mem.add(mem.key_of(inner))  # a second token on the same atom: reserve, box 2 C
    assert mem.status_of(copy) == "reserve" and mem.n_atoms == mem.n_tokens - 1
    Q = rng.standard_normal((20, 2))
    before = mem.read(Q)
    cert = mem.certify_eviction(copy)
    assert cert.kkt_residual_after <= 1e-10
    mem.evict(copy, cert)
    assert mem.state_digest() == cert.digest_after and np.array_equal(mem.read(Q), before)
    assert inner in mem and copy not in mem

    # Four tokens at n C = 1 are all bound: no margin set, rho only bounded. A key inside is a reserve token.
    square = SVMemory(C=1 / 4, gamma=0.5)
    for x in ([1, 1], [1, -1], [-1, 1], [-1, -1]):
        square.add(np.array(x, dtype=float))
    centre = square.add(np.zeros(2))
    assert square.status_of(centre) == "reserve" and not square.partition().margin
    before = square.read(Q)
    cert = square.certify_eviction(centre)
    assert not cert.rho_pinned and cert.kkt_residual_after <= 1e-10
    square.evict(centre, cert)
    assert square.state_digest() == cert.digest_after and np.array_equal(square.read(Q), before)


@pytest.mark.parametrize("failure, message", [("SWEPT_ITERATION_CAP", "did not terminate"),
                                              ("SWEPT_NO_EVENT", "no reachable bookkeeping event")])
def test_a_failed_solve_leaves_the_memory_as_it_was_before_the_add_or_remove(filled, monkeypatch, failure, message):
    """A SolverError mid-operation (here injected: the compiled path step reports that it did not terminate, or
    found no event, after it has moved coefficients and the inverse) must leave the memory as before the call:
    the same state digest and outputs, the token kept (remove) or not stored (add), and every later operation
    exact."""
    import memory.svmemory as svm
    mem, ids, rng = filled
    real = svm.core.move_coefficient

    def fails(*args):
        outcome, *rest = real(*args)
        return getattr(svm.core, failure), *rest

    Q = rng.standard_normal((20, 3))
    digest, out, n_tokens = mem.state_digest(), mem.decision_function(Q), mem.n_tokens
    victim = sorted(mem.partition().margin)[0]
    outside = rng.standard_normal(3) * 4.0  # far outside the description: its add takes the solver path
    monkeypatch.setattr(svm.core, "move_coefficient", fails)
    with pytest.raises(SolverError, match=message):
        mem.remove(victim)
    with pytest.raises(SolverError, match=message):
        mem.add(outside, rng.standard_normal(2), token_id="outside")
    monkeypatch.undo()
    assert mem.state_digest() == digest and mem.n_tokens == n_tokens
    assert victim in mem and "outside" not in mem
    assert np.max(np.abs(mem.decision_function(Q) - out)) <= 1e-12
    mem.remove(victim)
    mem.add(outside, rng.standard_normal(2), token_id="outside")
    assert mem.kkt_residual() <= 1e-10 and verify_against_refit(mem).max_dev <= 1e-8


def test_a_failed_first_fit_leaves_the_memory_as_it_was_and_a_later_add_fits(monkeypatch):
    """The add that makes the memory feasible seeds it with a batch solve; when that solve fails (injected: a
    residual above tol) the add must raise, store nothing, and leave the memory unfitted with its tokens."""
    import dataclasses

    import memory.exact_solver as svm
    rng = np.random.default_rng(4)
    mem = SVMemory(C=1 / 4, gamma=0.5)
    first = [mem.add(x) for x in rng.standard_normal((3, 2))]
    real = svm.solve_exact

    def inexact(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), residual=1.0)

    monkeypatch.setattr(svm, "solve_exact", inexact)
    with pytest.raises(SolverError, match="could not seed"):
        mem.add(rng.standard_normal(2), token_id="fourth")
    monkeypatch.undo()
    assert not mem.is_feasible and mem.token_ids() == first and "fourth" not in mem and mem.n_atoms == 3
    mem.add(rng.standard_normal(2), token_id="fourth")
    assert mem.is_feasible and mem.kkt_residual() <= 1e-10 and verify_against_refit(mem).max_dev <= 1e-8
