"""Evaluation streams: the labelled, keyed events of each evaluation stay, ready for the budget sweep."""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import polars as pl

from memory.cohort import token_id
from pipeline.store_reader import scan_events_in
from pipeline.keys import EventKeyer
from pipeline.meds import shard_path
from pipeline.privacy import stay_ref, subject_ref
from pipeline.sharding import Sharding

from .characteristics import death_stays, describe_cohort
from .definitions import build_cohort, deterioration_hours, label_events, stay_events
from .evaluation import EventStream
from .stream_mode import StreamMode
from .tokens import TokenScaling, build_tokens

if TYPE_CHECKING:
    from .config import CohortConfig
    from collections.abc import Callable
    from pathlib import Path

    from memory.encoder import EventEncoder


def evaluation_streams(store: Path, cfg: CohortConfig, max_events: int | None = None,
                       encoder: EventEncoder | None = None) -> tuple[list[EventStream], dict]:
    """(streams, cohort summary): one :class:`EventStream` per evaluation stay, with learned keys when a
    trained ``encoder`` (memory.encoder.EventEncoder) is given.

    Keys are standardised with statistics of the training split only. ``max_events`` keeps the first events
    of each stay (for quick runs); None keeps all.
    """
    if encoder is not None:
        from .encoder_data import encode            # torch: ~1.5 s to import, for learned keys only
    cohort = build_cohort(store, cfg)
    raw = stay_events(store, cohort)
    events = label_events(raw, cohort, cfg)
    subject_of_stay = dict(zip(cohort["stay_id"].to_list(), cohort["subject_id"].to_list()))
    train_ids = cohort.filter(pl.col("split") == "train")["stay_id"].implode()
    keyer = EventKeyer().fit(events.filter(pl.col("stay_id").is_in(train_ids)))
    ev = events.filter(~pl.col("stay_id").is_in(train_ids))
    streams = []
    for (stay_id,), g in ev.group_by(["stay_id"], maintain_order=True):
        g = g.sort(["time", "code", "event_hash", "occurrence"])
        if max_events:
            g = g.head(max_events)
        streams.append(EventStream(
            stay_id=int(stay_id), subject_id=int(subject_of_stay[stay_id]), keys=keyer.transform(g),
            hours=g["hour"].to_numpy(), deteriorating=g["deteriorating"].to_numpy(), rare=g["rare"].to_numpy(),
            learned_keys=None if encoder is None else encode(encoder, g, keyer)))
    streams.sort(key=lambda s: s.stay_id)
    summary = {
        "stays": int(cohort.height), "train_stays": int(cohort.height - len(streams)),
        "eval_stays": len(streams), "events": int(events.height),
        "eval_events": int(sum(len(s) for s in streams)),
        "deterioration_hours": int(sum(len(np.unique(s.hours[s.deteriorating])) for s in streams)),
        "eval_stays_with_deterioration": int(sum(bool(s.deteriorating.any()) for s in streams)),
        "rare_events": int(sum(int(s.rare.sum()) for s in streams)),
        "characteristics": describe_cohort(store, cfg, cohort, death_stays(raw, cfg), deterioration_hours(raw, cfg)),
    }
    return streams, summary


def _cohort_of(store, cfg, subject_ids):
    cohort = build_cohort(store, cfg)
    return cohort if subject_ids is None else cohort.filter(pl.col("subject_id").is_in(_ids(subject_ids)))


def _ids(subject_ids) -> pl.Series:
    return pl.Series(sorted(int(s) for s in subject_ids), dtype=pl.Int64).implode()


def _owners(subjects, key: bytes) -> dict:
    return {s: subject_ref(s, key) for s in set(subjects)}


class CohortStream(NamedTuple):
    """The cohort memory's input in global time order (order-key order): the key statistics it was keyed under,
    and per token its key, id (keyed references, no identifier), order key and subject."""
    scaler: TokenScaling | EventKeyer
    keys: np.ndarray
    token_ids: list[str]
    order_keys: list[str]
    subject_ids: np.ndarray


def cohort_event_stream(store: Path, cfg: CohortConfig, key: bytes, keyer: EventKeyer | None = None,
                        subject_ids: frozenset | None = None) -> CohortStream:
    """The whole cohort's events in global time order, keyed, for the cohort memory.

    The keyer is fitted on the training split when none is given (and then persisted with the memory).
    ``subject_ids``: those subjects' rows only (a deletion takes them out of the memory's history digest).
    Token ids name their patient by a keyed hash under ``key``, never by id.
    """
    if keyer is None and subject_ids is not None:
        raise ValueError("some subjects' stream needs the persisted keyer")
    cohort = _cohort_of(store, cfg, subject_ids)
    ev = stay_events(store, cohort)
    if keyer is None:
        train_ids = cohort.filter(pl.col("split") == "train")["stay_id"].implode()
        keyer = EventKeyer().fit(ev.filter(pl.col("stay_id").is_in(train_ids)))
    order = (pl.col("time").dt.strftime("%Y-%m-%dT%H:%M:%S%.6f") + "|" + pl.col("event_hash") + "|" +
             pl.col("occurrence").cast(pl.String).str.zfill(6))
    ev = ev.with_columns(order.alias("order_key")).sort("order_key")
    owner = _owners(ev["subject_id"].to_list(), key)
    ids = [token_id(owner[s], h, o) for s, h, o in zip(ev["subject_id"], ev["event_hash"], ev["occurrence"])]
    return CohortStream(keyer, keyer.transform(ev), ids, ev["order_key"].to_list(), ev["subject_id"].to_numpy())


def hour_token_names(key: bytes) -> Callable:
    """(subject_id, stay_id, hour) -> the hourly token's id in the cohort memory: its owner's and its stay's
    keyed references and the hour, each reference computed once."""
    owners, stays = {}, {}

    def name(subject_id, stay_id, hour):
        if subject_id not in owners:
            owners[subject_id] = subject_ref(subject_id, key)
        if stay_id not in stays:
            stays[stay_id] = stay_ref(stay_id, key)
        return token_id(owners[subject_id], f"{stays[stay_id]}-h{int(hour)}", 0)
    return name


def cohort_token_stream(store: Path, cfg: CohortConfig, key: bytes, scaling: TokenScaling | None = None,
                        subject_ids: frozenset | None = None) -> CohortStream:
    """The whole cohort's hourly tokens in global time order, for the cohort memory (hourly mode).

    ``scaling`` (training-split statistics) is fitted when none is given and then persisted with the memory.
    Order key: the bin's start time, then the stay's smallest event hash (a content hash already in the store,
    no identifier) to order tokens of different stays in the same hour.
    """
    if scaling is None and subject_ids is not None:
        raise ValueError("some subjects' stream needs the persisted token statistics")
    # a subject's rows lie in their shard: only the subjects' shards are read
    events = None
    if subject_ids is not None:
        sharding = Sharding.of_store(store)
        shards = sorted(p for p in {shard_path(store, sharding.shard(s)) for s in subject_ids} if p.exists())
        events = scan_events_in(shards).filter(pl.col("subject_id").is_in(_ids(subject_ids)))
    table = build_tokens(store, cfg, scaling=scaling, cohort=_cohort_of(store, cfg, subject_ids), events=events)
    tok = table.tokens
    tie = pl.col("event_hash").list.min().min().over("stay_id")
    order = pl.col("time").dt.strftime("%Y-%m-%dT%H:%M:%S%.6f") + "|" + tie
    tok = tok.with_columns(order.alias("order_key")).sort("order_key")
    names = hour_token_names(key)
    ids = [names(s, st, h) for s, st, h in zip(tok["subject_id"], tok["stay_id"], tok["hour"])]
    return CohortStream(table.scaling, table.scaling.keys(tok), ids, tok["order_key"].to_list(),
                        tok["subject_id"].to_numpy())


def cohort_stream(store: Path, cfg: CohortConfig, tokens: StreamMode, key: bytes,
                  scaler: TokenScaling | EventKeyer | None = None,
                  subject_ids: frozenset | None = None) -> CohortStream:
    """The cohort memory's input in either stream mode."""
    if StreamMode(tokens) is StreamMode.HOURLY:
        return cohort_token_stream(store, cfg, key, scaling=scaler, subject_ids=subject_ids)
    return cohort_event_stream(store, cfg, key, keyer=scaler, subject_ids=subject_ids)
