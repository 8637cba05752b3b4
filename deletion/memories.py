"""Step: the cohort memory without the subject, by exact decrement (verified against a refit) or by replay."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cohorts.definitions import workspace_config
from cohorts.runs import FEED_BLOCK, SCALER_FILES, checkpoint_tokens, copy_checkpoint_extras, load_scaler
from cohorts.streams import cohort_stream, hour_token_names
from cohorts.token_run import OrderedTokens, stay_facts
from memory.cohort import CohortMemory
from memory.errors import InfeasibleError
from memory.refit import verify_against_refit
from pipeline.privacy import store_key

from .plan import DeletionFailed, owner

if TYPE_CHECKING:
    from pipeline.transaction import Transaction
    from pipeline.workspace import Workspace

VERIFY_MAX_DEV = 1e-8


def _subject_rows(ws, ckpt, sid, cache):
    """The subject's rows as checkpoint ``ckpt`` was fed them (its stream mode and key statistics), read from
    the store before the deletion commits: (order keys, keys). ``cache``: by mode and key statistics."""
    mode = checkpoint_tokens(ckpt)
    stats = (ckpt / SCALER_FILES[mode]).read_bytes()
    if (mode, stats) not in cache:
        _, keys, _, order, _ = cohort_stream(ws.store, workspace_config(ws.root), mode,
                                             store_key(ws.store, ws.root), scaler=load_scaler(ckpt), subject_id=sid)
        cache[(mode, stats)] = (order, keys)
    return cache[(mode, stats)]


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


def decrement(ws: Workspace, txn: Transaction, sid: int, n_jitter: int) -> tuple | None:
    """Every checkpoint holding the subject's tokens, exactly decremented and verified; every checkpoint that
    was fed their rows takes them out of its history digest. Returns (tokens removed, verification, digests)
    per checkpoint."""
    memories, verification, digests, rows_of, ref = {}, {}, {}, {}, owner(ws, sid)
    for c in ws.checkpoints():
        cm = CohortMemory.load(c)
        tokens = cm.tokens_of(ref)
        order, keys = _subject_rows(ws, c, sid, rows_of)
        if not tokens and not any(o <= cm.watermark for o in order):
            continue
        cm.forget_history(order, keys)
        if tokens:                                   # else: fed and evicted, only the digest changes
            before = cm.memory.state_digest()
            removed_keys = np.stack([cm.memory.key_of(t) for t in tokens])
            try:
                cm.memory.remove_many(tokens)
            except InfeasibleError as e:
                raise DeletionFailed(f"checkpoint {c.name}: {e}; the fixed-C memory cannot lose that many tokens "
                                     f"by decrement -- use mode 'replay'") from None
            memories[c.name] = len(tokens)
            digests[c.name] = {"before": before, "after": cm.memory.state_digest()}
            verification[c.name] = _verify(cm, removed_keys, n_jitter)
        _stage(txn, c, cm)
    return memories, verification, digests


def _others_feed(ws, tokens, scaler, sid):
    """(the subject's first order key or None, feed(memory, upto): every other patient's rows after the
    memory's watermark and up to ``upto``, in order). Hourly tokens stream from the run's token cache; raw
    events (small stores) are keyed in memory."""
    cfg, key = workspace_config(ws.root), store_key(ws.store, ws.root)
    _, _, _, own, _ = cohort_stream(ws.store, cfg, tokens, key, scaler=scaler, subject_id=sid)
    first = min(own) if own else None
    if tokens == "hourly":
        index, names = stay_facts(ws, cfg), hour_token_names(key)

        def feed(mem, upto):
            for b in OrderedTokens(ws, index, cfg, scaler, names, after=mem.watermark, upto=upto,
                                   exclude_subject=sid).batches(FEED_BLOCK):
                mem.feed(b.keys, b.token_ids, b.order_keys)
        return first, feed
    _, K, ids, order, subjects = cohort_stream(ws.store, cfg, tokens, key, scaler=scaler)

    def feed(mem, upto):
        sel = [i for i, (o, s) in enumerate(zip(order, subjects)) if int(s) != sid and mem.watermark < o <= upto]
        mem.feed(K[sel], [ids[i] for i in sel], [order[i] for i in sel])
    return first, feed


def replay(ws: Workspace, txn: Transaction, sid: int, n_jitter: int) -> tuple:
    """Re-stream the cohort memory without the subject from the last checkpoint that never saw them."""
    ckpts = ws.checkpoints()
    if not ckpts:
        return {}, {}, {}
    latest = CohortMemory.load(ckpts[-1])
    tokens = checkpoint_tokens(ckpts[-1])
    first, feed = _others_feed(ws, tokens, load_scaler(ckpts[-1]), sid)
    ref = owner(ws, sid)
    # the checkpoints that saw the subject: their watermark is at or past the subject's first event; a
    # checkpoint of the other stream mode is never a replay base
    clean = [c for c in ckpts if checkpoint_tokens(c) == tokens and (first is None or
                                                                      CohortMemory.load(c).watermark < first)]
    base = CohortMemory.load(clean[-1]) if clean else CohortMemory(budget=latest.policy.budget,
                                                                   gamma=latest.gamma, nu=latest.policy.nu)
    before = latest.memory.state_digest()
    feed(base, latest.watermark)
    # the other mode's checkpoints are history: removed only where they hold the subject
    tainted = [c for c in ckpts if c not in clean and (checkpoint_tokens(c) == tokens or
                                                       CohortMemory.load(c).tokens_of(ref))]
    for c in tainted:
        txn.delete(c)
    target = ckpts[-1]
    _stage(txn, target, base)
    verification = {target.name: _verify(base, None, n_jitter)}
    verification[target.name]["replayed_from"] = clean[-1].name if clean else "empty memory"
    verification[target.name]["checkpoints_removed"] = [c.name for c in tainted if c != target]
    return ({target.name: len(latest.tokens_of(ref))}, verification,
            {target.name: {"before": before, "after": base.memory.state_digest()}})


def rewrite_memories(ws: Workspace, txn: Transaction, sid: int, mode: str, n_jitter: int) -> tuple[dict, dict, dict]:
    memories, verification, digests = (decrement if mode == "decrement" else replay)(ws, txn, sid, n_jitter)
    failed = [n for n, v in verification.items() if not v["passed"]]
    if failed:
        raise DeletionFailed(f"refit verification failed for cohort memory checkpoint(s) {failed}: "
                             f"{[verification[n] for n in failed]}")
    return memories, verification, digests
