"""Step: the cohort memory without the subject, by exact decrement (verified against a refit) or by replay."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from memory.cohort import CohortMemory
from memory.errors import InfeasibleError
from memory.refit import verify_against_refit
from run.cohort_memory import (CohortRows, SnapshotWriter, StreamMode, checkpoint_tokens, copy_checkpoint_extras,
                               load_scaler, memory_info, save_scaler, scaler_file)

from .plan import DeletionFailed, owner

if TYPE_CHECKING:
    from pathlib import Path

    from pipeline.transaction import Transaction
    from pipeline.workspace import Workspace
    from cohorts.definitions import CohortConfig
    from collections.abc import Callable

    from run.cohort_memory import TokenScaling

VERIFY_MAX_DEV = 1e-8


def _subjects_rows(ws, cfg, ckpt, sids, cache):
    """The subjects' rows as checkpoint ``ckpt`` was fed them (its stream mode and key statistics), read from
    the store before the deletion commits: (order keys, keys). ``cache``: by mode and key statistics."""
    mode = checkpoint_tokens(ckpt)
    stats = scaler_file(ckpt).read_bytes()
    if (mode, stats) not in cache:
        cache[(mode, stats)] = CohortRows(ws, mode, load_scaler(ckpt), cfg).of_subjects(sids)
    return cache[(mode, stats)]


def _first_order_keys(ws: Workspace, cfg: CohortConfig, sids: frozenset, cache: dict) -> dict:
    """Per stream mode of the workspace's snapshots in which the subjects have rows, their first order key (an
    order key does not depend on the key statistics); ``cache``: :func:`_subjects_rows`'s."""
    out = {}
    for s in ws.snapshots():
        order, _ = _subjects_rows(ws, cfg, s, sids, cache)
        if order:
            mode, first = checkpoint_tokens(s), min(order)
            out[mode] = min(out.get(mode, first), first)
    return out


def _drop_snapshots_that_saw(ws: Workspace, txn: Transaction, refs: dict, first: dict) -> None:
    """Snapshots holding a subject's tokens, or fed past a subject's first row, go; those before every subject's
    first row stay (they are replay bases that never saw them)."""
    for s in ws.snapshots():
        cm, mode = CohortMemory.load(s), checkpoint_tokens(s)
        if any(cm.tokens_of(r) for r in refs) or (mode in first and cm.watermark >= first[mode]):
            txn.delete(s)


def _verify(cm, removed_keys, n_jitter):
    if not cm.memory.is_feasible:
        return {"passed": True, "note": "memory below ceil(1/C) tokens: no solution to verify", "tokens":
                cm.memory.n_tokens}
    rep = verify_against_refit(cm.memory, probes=removed_keys, n_jitter=n_jitter)
    passed = rep.max_dev <= VERIFY_MAX_DEV and rep.nondegenerate_mismatches == 0
    return {"passed": bool(passed), "max_decision_deviation": rep.max_dev, "median_decision_deviation":
            rep.median_dev, "partition_agreement": rep.partition_agreement,
            "nondegenerate_mismatches": rep.nondegenerate_mismatches,
            "kkt_residual": rep.kkt_residual_memory, "tolerance": VERIFY_MAX_DEV, "tokens": rep.n_tokens}


def _stage(txn, ckpt, cm):
    staged = txn.stage(ckpt)
    cm.save(staged)
    copy_checkpoint_extras(ckpt, staged)
    return staged


def decrement(ws: Workspace, cfg: CohortConfig, txn: Transaction, sids: frozenset, n_jitter: int,
              compare: bool = True) -> tuple:
    """Every checkpoint holding the subjects' tokens, exactly decremented (all of them at once) and verified;
    every checkpoint that was fed their rows takes them out of its history digest. Returns, per checkpoint, the
    tokens removed of each subject, the verification and the digests before and after."""
    memories, verification, digests, rows_of = {}, {}, {}, {}
    refs = {owner(ws, sid): sid for sid in sids}
    _drop_snapshots_that_saw(ws, txn, refs, _first_order_keys(ws, cfg, sids, rows_of))
    ckpts = ws.checkpoints()
    for c in ckpts:
        cm = CohortMemory.load(c)
        tokens = {sid: cm.tokens_of(ref) for ref, sid in refs.items()}
        every = [t for sid in sorted(tokens) for t in tokens[sid]]
        order, keys = _subjects_rows(ws, cfg, c, sids, rows_of)
        if not every and not any(o <= cm.watermark for o in order):
            continue
        cm.forget_history(order, keys)
        if every:                                    # else: fed and evicted, only the digest changes
            before = cm.memory.state_digest()
            removed_keys = np.stack([cm.memory.key_of(t) for t in every])
            try:
                cm.memory.remove_many(every)
            except InfeasibleError as e:
                raise DeletionFailed(f"checkpoint {c.name}: {e}; the fixed-C memory cannot lose that many tokens "
                                     f"by decrement -- use mode 'replay'") from None
            memories[c.name] = {sid: len(t) for sid, t in tokens.items()}
            digests[c.name] = {"before": before, "after": cm.memory.state_digest()}
            verification[c.name] = _verify(cm, removed_keys, n_jitter)
            if c == ckpts[-1]:
                verification[c.name]["never_saw_difference"] = never_saw_difference(ws, cfg, sids, cm, removed_keys) \
                    if compare else {"not_measured": "asked not to (it costs a replay of the cohort memory)"}
        _stage(txn, c, cm)
    return memories, verification, digests


def _replayed(ws: Workspace, cfg: CohortConfig, sids: frozenset, scaler: TokenScaling | None,
              snapshots: Callable | None = None) -> tuple:
    """The latest checkpoint re-streamed without the subjects, from the latest checkpoint or snapshot that saw
    none of them (or from empty): (checkpoints, the latest as it is, its stream mode, the scaling, the clean
    checkpoints, the base, the replayed memory). Feeding the same rows in the same order from a saved state
    gives the memory feeding them from the start gives, bit for bit. ``snapshots(folder, scaler, tokens)``: a
    :class:`SnapshotWriter` for the re-feed (a deletion stages the replayed memory's new snapshots)."""
    ckpts = ws.checkpoints()
    latest = CohortMemory.load(ckpts[-1])
    tokens = checkpoint_tokens(ckpts[-1])
    hourly = tokens is StreamMode.HOURLY
    scaler = scaler if scaler is not None and hourly else load_scaler(ckpts[-1])
    rows = CohortRows(ws, tokens, scaler, cfg)
    own, _ = rows.of_subjects(sids)
    first = min(own) if own else None
    # the checkpoints that saw a subject: their watermark is at or past the subjects' first event; a
    # checkpoint of the other stream mode is never a replay base, nor one keyed under other scaling
    same_keys = [c for c in ckpts if checkpoint_tokens(c) is tokens and
                 (not hourly or load_scaler(c).as_dict() == scaler.as_dict())]
    clean = [c for c in same_keys if first is None or CohortMemory.saved_watermark(c) < first]
    bases = clean + [s for s in ws.snapshots() if checkpoint_tokens(s) is tokens and
                     (not hourly or load_scaler(s).as_dict() == scaler.as_dict()) and
                     (first is None or CohortMemory.saved_watermark(s) < first)]
    start = max(bases, key=CohortMemory.saved_watermark, default=None)
    base = CohortMemory.load(start) if start is not None else \
        CohortMemory(budget=latest.policy.budget, gamma=latest.gamma, nu=latest.policy.nu)
    writer = snapshots(ws.cohort_snapshots / ckpts[-1].name, scaler, tokens) if snapshots is not None else None
    rows.feed(base, upto=latest.watermark, exclude=frozenset(sids), snapshots=writer)
    return ckpts, latest, tokens, scaler, clean, start, base


def replay(ws: Workspace, cfg: CohortConfig, txn: Transaction, sids: frozenset, n_jitter: int,
           scaler: TokenScaling | None = None) -> tuple:
    """Re-stream the cohort memory without the subjects from the last checkpoint that saw none of them; hourly
    tokens under ``scaler`` when given (token scaling recomputed without the subjects), else under the scaling
    persisted with the memory."""
    if not ws.checkpoints():
        return {}, {}, {}
    refs = {owner(ws, sid): sid for sid in sids}
    first = _first_order_keys(ws, cfg, sids, {})
    # snapshots that saw a subject go (those before every subject's first row stay: replay bases)
    _drop_snapshots_that_saw(ws, txn, refs, first)
    ckpts, latest, tokens, scaler, clean, start, base = _replayed(
        ws, cfg, sids, scaler, lambda folder, sc, mode: SnapshotWriter(folder, sc, mode, stage=txn.stage))
    before = latest.memory.state_digest()
    # the other mode's checkpoints are history: removed only where they hold a subject
    tainted = [c for c in ckpts if c not in clean and (checkpoint_tokens(c) is tokens or
                                                       any(CohortMemory.load(c).tokens_of(r) for r in refs))]
    for c in tainted:
        txn.delete(c)
    target = ckpts[-1]
    save_scaler(scaler, _stage(txn, target, base), tokens)
    verification = {target.name: _verify(base, None, n_jitter)}
    verification[target.name]["replayed_from"] = _base_name(start, clean)
    verification[target.name]["checkpoints_removed"] = [c.name for c in tainted if c != target]
    return ({target.name: {sid: len(latest.tokens_of(ref)) for ref, sid in refs.items()}}, verification,
            {target.name: {"before": before, "after": base.memory.state_digest()}})


def _base_name(start: Path | None, clean: list[Path]) -> str:
    """What a replay started from: a checkpoint, a snapshot (``checkpoint/NNNNNN``) or the empty memory."""
    if start is None:
        return "empty memory"
    return start.name if start in clean else f"snapshot {start.parent.name}/{start.name}"


def never_saw_difference(ws: Workspace, cfg: CohortConfig, sids: frozenset, decremented: CohortMemory,
                         removed_keys: np.ndarray) -> dict:
    """How far the decremented latest checkpoint is from the memory a replay without the subjects gives: the
    tokens only one of them holds, and the deviation of their decision functions on probe queries (every
    token key either holds, and the subjects' removed keys)."""
    *_, replayed = _replayed(ws, cfg, sids, None)
    a, b = set(decremented.memory.token_ids()), set(replayed.memory.token_ids())
    probes = [decremented.memory.key_of(t) for t in a] + [replayed.memory.key_of(t) for t in b]
    probes = np.vstack(probes + ([removed_keys] if len(removed_keys) else [])) if probes else np.empty((0, 0))
    dev = (np.abs(decremented.memory.decision_function(probes) - replayed.memory.decision_function(probes))
           if len(probes) and decremented.memory.is_feasible and replayed.memory.is_feasible else np.array([np.nan]))
    return {"tokens_only_in_decremented": len(a - b), "tokens_only_in_replayed": len(b - a),
            "probe_queries": int(len(probes)), "max_output_deviation": float(np.max(dev)),
            "median_output_deviation": float(np.median(dev))}


def replayed_memory_info(ws: Workspace, txn: Transaction) -> dict | None:
    """What a report says of the cohort memory as the deletion staged it (its latest checkpoint)."""
    ckpts = ws.checkpoints()
    staged = {op["final"]: ws.root / op["staged"] for op in txn.ops if op["op"] == "replace"}
    path = staged.get(str(ckpts[-1].relative_to(ws.root))) if ckpts else None
    if path is None:
        return None
    mem = CohortMemory.load(path)
    return memory_info(mem, ckpts[-1].name, checkpoint_tokens(path), mem.fed,
                       {"checked": False, "replayed_without_a_deleted_patient": True})


def rewrite_memories(ws: Workspace, cfg: CohortConfig, txn: Transaction, sids: frozenset, mode: str, n_jitter: int,
                     scaler: TokenScaling | None = None, compare: bool = True) -> tuple[dict, dict, dict]:
    """The cohort memory without the subject: ``decrement`` (``compare``: measure its distance to a replay) or
    ``replay`` (under ``scaler`` when the deletion recomputed the token scaling)."""
    memories, verification, digests = decrement(ws, cfg, txn, sids, n_jitter, compare) if mode == "decrement" else \
        replay(ws, cfg, txn, sids, n_jitter, scaler)
    failed = [n for n, v in verification.items() if not v["passed"]]
    if failed:
        raise DeletionFailed(f"refit verification failed for cohort memory checkpoint(s) {failed}: "
                             f"{[verification[n] for n in failed]}")
    return memories, verification, digests
