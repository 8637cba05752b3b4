"""The hourly-token run over a workspace, chunk by chunk and cached per stay.

Phases (each reports progress; memory grows with the largest chunk of stays, not with the cohort):

1. **tokens** (:func:`stay_facts`): per chunk of whole subjects of one shard (:mod:`cohorts.stay_chunks`),
   each stay's content key; for stays whose key is not cached, their filled tokens, per-channel reading
   counts, the hours each deterioration criterion fires, a death flag and their per-code event counts, into
   the per-stay caches (:mod:`run.stay_cache`). A shard whose file, stays, config and code are unchanged
   since the last run is not read at all.
2. **labels** (:func:`label_run`): the rare-code vocabulary from the cached training-split code counts; the
   hours holding a rare code (cached per stay and vocabulary); token scaling (declared in the config, or
   fitted on the cached training tokens); then shard by shard the labelled tokens: MEDS label files, the
   cohort table's counts, and the training stays' streaming-setting scores (cached per stream).
3. **scoring**: :func:`pending_streams` yields the evaluation streams whose scores are not cached, in
   batches the flow maps over its task runner; :func:`store_scores` caches their rows.
4. :func:`write_results`: the per-stay result rows of the run, written shard by shard.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb
import numpy as np
import polars as pl
import pyarrow.parquet as pq

from cohorts.characteristics import death_stays, describe_cohort
from cohorts.definitions import build_cohort, deterioration_hours, rare_from_counts
from cohorts.protocols import (StreamingSettings, TokenStream, choose_settings, grid_scores, selects_on,
                               token_streams)
from cohorts.stay_chunks import (STAY_ROW, StayChunk, chunk_digests, chunk_events, chunk_scan, chunks_events,
                                 code_digest, in_windows, plan_chunks, stay_digests)
from cohorts.tokens import (TokenScaling, bin_time, check_scaling, declared_scaling, filled_tokens, reading_spec,
                            threshold_expr)
from pipeline.store_reader import store_codes
from pipeline.extract_rules import sql_literal
from pipeline.meds import LabelFiles, shard_path
from pipeline.privacy import id_refs, keyed_hash, store_key
from pipeline.shard_changes import changed_since, file_state
from pipeline.sharding import Sharding

from .stay_cache import StayCache

if TYPE_CHECKING:
    from cohorts.config import CohortConfig
    from collections.abc import Callable, Iterator

    from pipeline.workspace import Workspace

INDEX = "index"


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


@dataclass
class StayIndex:
    """The cohort's stays with their shard and content key (``key``), and what the run derived globally."""
    cohort: pl.DataFrame                  # build_cohort's rows + shard, key
    sharding: Sharding                    # the store's
    rare: set = field(default_factory=set)
    rare_threshold: float = 0.0
    scaling: TokenScaling | None = None
    settings: StreamingSettings | None = None
    computed: dict = field(default_factory=dict)   # per phase: stays computed (the rest came from the cache)

    def shard_rows(self, shard: int) -> pl.DataFrame:
        return self.cohort.filter(pl.col("shard") == shard)


def _shard_fingerprint(store: Path, shard: int, stays: pl.DataFrame, cfg_key: str) -> str:
    rows = stays.drop("split").sort("stay_id").rows() if stays.height else []
    return _digest(shard, file_state(shard_path(store, shard)), rows, cfg_key)


def _index_path(ws: Workspace, shard: int) -> Path:
    return ws.cache / INDEX / f"{shard}.json"


def _load_index(ws: Workspace, shard: int) -> dict:
    p = _index_path(ws, shard)
    return json.loads(p.read_text()) if p.exists() else {}


def _save_index(ws: Workspace, shard: int, fingerprint: str, keys: dict[str, str], cfg_key: str,
                state: list[int] | None, rows: dict[str, str]) -> None:
    """The shard's index: per stay (by opaque reference) its content key and a digest of its stay-table row,
    and the shard's file as it was read (``state``, what its splice records are followed from)."""
    p = _index_path(ws, shard)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps({"fingerprint": fingerprint, "keys": keys, "config": cfg_key, "state": state,
                               "rows": rows}))
    tmp.replace(p)


def _row_digests(rows: pl.DataFrame, refs: list[str]) -> dict[str, str]:
    """Per stay reference a digest of its stay-table row (what its content key reads of the row)."""
    cols = [c for c in STAY_ROW if c in rows.columns]
    return {ref: _digest(row) for ref, row in zip(refs, rows.select(cols).iter_rows())}


def _unchanged_stays(store: Path, shard: int, rows: pl.DataFrame, refs: list[str], row_digests: dict[str, str],
                     index: dict, cfg_key: str) -> dict[int, str]:
    """The shard's stays indexed before under this config and code whose content is the same now, with their
    keys (stay_id -> key): their subject's rows unchanged since the file the index read (the shard's splice
    records, :mod:`pipeline.shard_changes`) and every stay-table row of that subject the same. A stay's events
    are its subject's rows in its own window, so its digest is then the one indexed. Empty when the records
    cannot tell."""
    if index.get("config") != cfg_key:
        return {}
    changed = changed_since(store, shard, index.get("state"))
    if changed is None:
        return {}
    keys, before = index.get("keys", {}), index.get("rows", {})
    subjects = rows["subject_id"].to_list()
    for subject, ref in zip(subjects, refs):
        if ref not in keys or before.get(ref) != row_digests[ref]:
            changed.add(subject)
    return {s: keys[r] for s, subject, r in zip(rows["stay_id"].to_list(), subjects, refs) if subject not in changed}


def _stay_refs(stay_ids: list[int], key: bytes) -> list[str]:
    """Opaque per-stay names for the cache's index (keyed hashes, as the per-stay memory files)."""
    return [keyed_hash(f"stay:{int(s)}", key)[:32] for s in stay_ids]


def _chunk_facts(events: pl.DataFrame, stays: pl.DataFrame, keys: dict[int, str], cfg: CohortConfig,
                 spec: pl.DataFrame, names: list[str]) -> dict[str, pl.DataFrame]:
    """The cached facts of ``stays`` (the stays to compute, with ``events``, theirs), keyed by content key."""
    hours_per_bin = cfg.bin_hours
    key_of = pl.DataFrame({"stay_id": list(keys), "key": list(keys.values())},
                          schema={"stay_id": pl.Int64, "key": pl.String})
    filled, counts = filled_tokens(events.lazy(), spec, stays, names, hours_per_bin)
    tokens = (filled.join(key_of, on="stay_id")
              .with_columns(pl.col("event_hash").list.min().alias("first_hash"))
              .select("key", "hour", *names, "readings", "first_hash"))
    fired = deterioration_hours(events, cfg)
    with_event = events.select("stay_id", "hour").unique().with_columns(pl.lit(True).alias("has_event"))
    fired = (fired.join(with_event, on=["stay_id", "hour"], how="left")
             .with_columns(pl.col("has_event").fill_null(False)).join(key_of, on="stay_id")
             .select("key", "hour", "criterion", "has_event"))
    died = death_stays(events, cfg)
    per_channel = counts.join(key_of, on="stay_id").select("key", "channel", "readings", "artifacts")
    facts = key_of.with_columns(pl.col("stay_id").is_in(died.implode()).alias("died")).drop("stay_id")
    codes = (events.group_by("stay_id", "code").agg(pl.len().cast(pl.Int64).alias("n")).join(key_of, on="stay_id")
             .select("key", "code", "n"))
    return {"tokens": tokens, "facts": facts.join(per_channel, on="key", how="left"), "fired": fired, "codes": codes}


class _ChangedFacts:
    """The facts of the changed stays of shards computed before, gathered across shards and computed together,
    at most ``chunk_stays`` stays at a time: a night changes a stay or two in most shards, and computing them
    shard by shard paid a query's fixed cost per shard. A shard's caches are updated and its index saved
    (``finish``) only once its stays' facts are appended."""

    def __init__(self, store: Path, caches: dict[str, StayCache], chunk_stays: int, facts: Callable):
        self.store, self.caches, self.chunk_stays, self.facts = store, caches, chunk_stays, facts
        self.parts: list[tuple[StayChunk, dict[int, str]]] = []
        self.waiting: list[Callable[[], None]] = []

    def add(self, part: StayChunk, keys: dict[int, str]) -> None:
        self.parts.append((part, keys))

    def finish(self, done: Callable[[], None]) -> None:
        """``done`` now when nothing is pending, else once the pending facts are appended."""
        if not self.parts:
            done()
            return
        self.waiting.append(done)
        if sum(len(p) for p, _ in self.parts) >= self.chunk_stays:
            self.flush()

    def flush(self) -> None:
        if self.parts:
            events = chunks_events(self.store, [p for p, _ in self.parts])
            stays = pl.concat([p.stays for p, _ in self.parts])
            keys = {s: k for _, todo in self.parts for s, k in todo.items()}
            shard_of = {k: p.shard for p, todo in self.parts for k in todo.values()}
            for kind, frame in self.facts(events, stays, keys).items():
                frame = frame.with_columns(pl.col("key").replace_strict(shard_of, return_dtype=pl.Int64)
                                           .alias("_shard"))
                for (shard,), part in frame.group_by(["_shard"]):
                    self.caches[kind].append(int(shard), [part.drop("_shard")])
            self.parts = []
        waiting, self.waiting = self.waiting, []
        for done in waiting:
            done()


@dataclass(frozen=True)
class _ShardSeen:
    """One shard's cohort stays as this run reads them: their rows, keyed references and row digests, and the
    fingerprint and file state its index is saved under."""
    shard: int
    rows: pl.DataFrame
    refs: list[str]
    row_digests: dict[str, str]
    fingerprint: str
    state: list[int] | None


@dataclass
class _FactsRun:
    """What phase 1 holds for every shard: the workspace, the config and its key, the channels' reading spec,
    the caches and the gathered changes, how many stays a chunk holds, the progress callback."""
    ws: Workspace
    cfg: CohortConfig
    cfg_key: str
    spec: object
    names: list[str]
    caches: dict[str, StayCache]
    changed: _ChangedFacts
    chunk_stays: int
    on_chunk: Callable | None
    computed: int = 0

    def tick(self, n: int) -> None:
        if self.on_chunk is not None and n:
            self.on_chunk(n)


def _finish_shard(run: _FactsRun, seen: _ShardSeen, shard_keys: dict[int, str]) -> None:
    """A shard's caches compacted to its stays' keys, then its index saved."""
    wanted = set(shard_keys.values())
    for cache in run.caches.values():
        cache.update(seen.shard, wanted)
    _save_index(run.ws, seen.shard, seen.fingerprint,
                dict(zip(seen.refs, [shard_keys[s] for s in seen.rows["stay_id"].to_list()])), run.cfg_key,
                seen.state, seen.row_digests)


def stay_facts(ws: Workspace, cfg: CohortConfig, chunk_stays: int = 256, on_chunk: Callable | None = None,
               removed_from: Path | None = None) -> StayIndex:
    """Phase 1: every cohort stay's content key, and the per-stay facts of the stays not yet cached.

    ``on_chunk(n)`` is told the stays of every chunk done (progress). ``removed_from``: the store that ``ws``'s
    was made from by removing whole subjects (a deletion's view): a shard whose index was made from that store
    keeps the keys of the stays still there, whose events are the same rows, instead of reading the shard's
    events again to recompute them."""
    store = ws.store
    sharding = Sharding.of_store(store)
    cohort = _with_shard(build_cohort(store, cfg), sharding)
    before = _with_shard(build_cohort(removed_from, cfg), sharding) if removed_from is not None else None
    cfg_key = _digest(cfg.digest, code_digest())
    names = [c.name for c in cfg.channels]
    spec = reading_spec(cfg.channels, store_codes(store))
    secret = store_key(store, ws.root)
    caches = {k: StayCache(ws, k) for k in ("tokens", "facts", "fired", "codes")}
    changed = _ChangedFacts(store, caches, chunk_stays,
                            lambda events, part, todo: _chunk_facts(events, part, todo, cfg, spec, names))
    run = _FactsRun(ws, cfg, cfg_key, spec, names, caches, changed, chunk_stays, on_chunk)
    keys_all = {}
    for shard in sharding.shards():
        rows = cohort.filter(pl.col("shard") == shard).drop("shard")
        refs = _stay_refs(rows["stay_id"].to_list(), secret)
        seen = _ShardSeen(shard, rows, refs, _row_digests(rows, refs), _shard_fingerprint(store, shard, rows, cfg_key),
                          file_state(shard_path(store, shard)))
        index = _load_index(ws, shard)
        present = caches["facts"].keys(shard)
        known = all(index.get("keys", {}).get(r) in present for r in refs)
        if known and index.get("fingerprint") == seen.fingerprint:
            keys_all.update({s: index["keys"][r] for s, r in zip(rows["stay_id"].to_list(), refs)})
            run.tick(rows.height)
            continue
        if known and before is not None and index.get("fingerprint") == _shard_fingerprint(
                removed_from, shard, before.filter(pl.col("shard") == shard).drop("shard"), cfg_key):
            # indexed from the shard before whole subjects left it: the stays still there are the same rows
            shard_keys = {s: index["keys"][r] for s, r in zip(rows["stay_id"].to_list(), refs)}
            run.tick(rows.height)
        else:
            shard_keys = _shard_keys(run, seen, index, present, sharding)
        changed.finish(partial(_finish_shard, run, seen, shard_keys))
        keys_all.update(shard_keys)
    changed.flush()
    key_col = pl.Series("key", [keys_all[s] for s in cohort["stay_id"].to_list()], dtype=pl.String)
    return StayIndex(cohort.with_columns(key_col), sharding, computed={"tokens": run.computed})


def _shard_keys(run: _FactsRun, seen: _ShardSeen, index: dict, present: set, sharding: Sharding) -> dict[int, str]:
    """A shard's stays' content keys, computing the facts of the stays not cached. A shard computed before
    under this config and code (late rows, new patients) mostly keeps its stays: those of subjects its splices
    did not touch keep their keys; the others' digests from the columns they read, then whole events for the
    changed stays only."""
    store, shard, rows = run.ws.store, seen.shard, seen.rows
    light = index.get("config") == run.cfg_key and bool(present)
    shard_keys = {s: k for s, k in _unchanged_stays(store, shard, rows, seen.refs, seen.row_digests, index,
                                                      run.cfg_key).items() if k in present} if light else {}
    todo_rows = rows.filter(~pl.col("stay_id").is_in(pl.Series(list(shard_keys), dtype=pl.Int64).implode()))
    run.tick(len(shard_keys))
    for chunk in plan_chunks(todo_rows, sharding, run.chunk_stays) if todo_rows.height else []:
        events = None if light else chunk_events(store, chunk)
        digests = chunk_digests(store, chunk) if light else stay_digests(events, chunk.stays)
        keys = {s: _digest(d, run.cfg_key) for s, d in digests.items()}
        shard_keys.update(keys)
        todo = {s: k for s, k in keys.items() if k not in present}
        if todo:     # a first run's appended chunk by chunk; a rerun's gathered, chunk_stays at most
            mine = pl.Series(list(todo), dtype=pl.Int64).implode()
            part = StayChunk(shard, chunk.stays.filter(pl.col("stay_id").is_in(mine)))
            if light:
                run.changed.add(part, todo)
            else:
                for kind, frame in _chunk_facts(events.filter(pl.col("stay_id").is_in(mine)), part.stays, todo,
                                                run.cfg, run.spec, run.names).items():
                    run.caches[kind].append(shard, [frame])
            run.computed += len(todo)
        run.tick(len(chunk))
    return shard_keys


def _with_shard(cohort: pl.DataFrame, sharding: Sharding) -> pl.DataFrame:
    return cohort.with_columns(sharding.expr(pl.col("subject_id")).alias("shard"))


def _rare_vocabulary(ws: Workspace, index: StayIndex, cfg: CohortConfig) -> None:
    """The rare codes of the run, from the cached per-stay code counts: the training split's counts and every
    code of the cohort's stays."""
    codes = StayCache(ws, "codes").scan()
    if codes is None:
        index.rare, index.rare_threshold = set(), 0.0
        return
    keys = index.cohort.select("key", "split")
    per_code = codes.join(keys.lazy(), on="key")
    train = (per_code.filter(pl.col("split") == "train").group_by("code").agg(pl.col("n").sum().alias("len"))
             .sort("code").collect(engine="streaming"))
    every = set(per_code.select("code").unique().collect(engine="streaming")["code"].to_list())
    index.rare, index.rare_threshold = rare_from_counts(train, every, cfg)


def _rare_keys(ws: Workspace, index: StayIndex) -> pl.Series:
    """Per cohort stay its rare key: its content key and the rare codes among its own (the cached per-stay
    code counts). A stay's rare hours are read from its events of those codes only, so the key, its cached
    hours and its stream's digest stay the same when a night's patients change the vocabulary in codes the
    stay does not hold (a key of the whole vocabulary changed every stay's)."""
    codes = StayCache(ws, "codes").scan()
    held = {}
    if codes is not None and index.rare:
        rare = pl.Series(sorted(index.rare), dtype=pl.String).implode()
        frame = (codes.filter(pl.col("code").is_in(rare)).join(index.cohort.select("key").lazy(), on="key")
                 .group_by("key").agg(pl.col("code").unique().sort()).collect(engine="streaming"))
        held = dict(zip(frame["key"].to_list(), frame["code"].to_list()))
    return pl.Series("rare_key", [_digest(k, held.get(k, [])) for k in index.cohort["key"].to_list()],
                     dtype=pl.String)


def _rare_hours(ws: Workspace, index: StayIndex, chunk_stays: int) -> None:
    """Phase 2a: per stay the hours holding a rare code, cached under the stay's rare key."""
    cache = StayCache(ws, "rare")
    index.cohort = index.cohort.with_columns(_rare_keys(ws, index))
    rare = pl.Series(sorted(index.rare), dtype=pl.String).implode()
    computed = 0
    for shard in index.sharding.shards():
        rows = index.shard_rows(shard)
        present = cache.keys(shard)
        todo = rows.filter(~pl.col("rare_key").is_in(pl.Series(list(present), dtype=pl.String).implode()))
        new = []
        for chunk in plan_chunks(todo.drop("key", "rare_key", "shard"), index.sharding, chunk_stays) if todo.height else []:
            events = chunk_scan(ws.store, chunk).filter(pl.col("code").is_in(rare))
            hours = in_windows(events, chunk.stays).select("stay_id", "hour").unique().collect()
            keys = chunk.stays.join(todo.select("stay_id", "rare_key"), on="stay_id").select("stay_id", "rare_key")
            marker = keys.select(pl.col("rare_key").alias("key"), pl.lit(None, dtype=pl.Int64).alias("hour"))
            new += [marker, hours.join(keys, on="stay_id").select(pl.col("rare_key").alias("key"), "hour")]
            computed += chunk.stays.height
        cache.update(shard, set(rows["rare_key"].to_list()) & present, new)
    index.computed["rare"] = computed


def fit_scaling(ws: Workspace, index: StayIndex, names: list[str]) -> TokenScaling:
    """Training-split statistics per channel from the cached tokens (as :meth:`TokenScaling.fit`), in a fixed
    row order so a cached and a fresh run agree to the last bit."""
    tokens = StayCache(ws, "tokens").scan()
    train = index.cohort.filter(pl.col("split") == "train").select("stay_id", "key")
    frame = (tokens.join(train.lazy(), on="key").sort("stay_id", "hour").select(names).collect()
             if tokens is not None else pl.DataFrame(schema={n: pl.Float64 for n in names}))
    return TokenScaling.fit(frame, names)


def labelled_shard(ws: Workspace, index: StayIndex, cfg: CohortConfig, shard: int,
                   split: str | None = None, stay_ids: list[int] | None = None) -> pl.DataFrame:
    """The labelled, imputed tokens of one shard's cohort stays (of ``split`` only, and of ``stay_ids`` only,
    when given), in stay and hour order: the frame :func:`cohorts.tokens.label_tokens` gives for those stays."""
    hours_per_bin = cfg.bin_hours
    rows = index.shard_rows(shard)
    if split is not None:
        rows = rows.filter(pl.col("split") == split)
    if stay_ids is not None:
        rows = rows.filter(pl.col("stay_id").is_in(pl.Series(stay_ids, dtype=pl.Int64).implode()))
    tokens = StayCache(ws, "tokens").read(shard, rows["key"].to_list())
    if tokens is None or rows.height == 0:
        return pl.DataFrame()
    tok = tokens.join(rows.select("key", "stay_id", "subject_id", "split", "intime"), on="key") \
        .with_columns(bin_time(hours_per_bin))
    tok = index.scaling.impute(tok)
    specs = cfg.labels
    tok = tok.with_columns(threshold_expr(s["thresholds"]).alias(n) for n, s in specs.items() if "thresholds" in s)
    bins = {}
    fired = StayCache(ws, "fired").read(shard, rows["key"].to_list())
    if fired is not None:
        bins["deterioration"] = (fired.filter(pl.col("has_event")).join(rows.select("key", "stay_id"), on="key")
                                 .select("stay_id", "hour"))
    rare = StayCache(ws, "rare").read(shard, rows["rare_key"].to_list())
    if rare is not None:
        bins["rare_items"] = (rare.drop_nulls("hour").join(rows.select(pl.col("rare_key").alias("key"), "stay_id"),
                                                           on="key").select("stay_id", "hour"))
    for n, s in specs.items():
        if "thresholds" in s:
            continue
        b = bins.get(s["from"])
        if b is None or b.height == 0:
            tok = tok.with_columns(pl.lit(False).alias(n))
            continue
        b = (b.with_columns((pl.col("hour") // hours_per_bin).cast(pl.Int64).alias("hour")).unique()
             .with_columns(pl.lit(True).alias(n)))
        tok = tok.join(b, on=["stay_id", "hour"], how="left").with_columns(pl.col(n).fill_null(False))
    return tok.drop("key", "intime", "first_hash").sort("stay_id", "hour")


def stream_digest(stream: TokenStream, labels: list[str] | None = None) -> str:
    """A digest of what scoring reads of a stream: its stay's seed, every key set's keys and every label (of
    ``labels`` only, and only their key sets, when given)."""
    keysets = sorted(stream.keys) if labels is None else sorted({stream.label_keyset[n] for n in labels})
    labels = sorted(stream.labels) if labels is None else labels
    h = hashlib.sha256(str(int(stream.stay_id)).encode())
    for name in keysets:
        h.update(name.encode() + np.ascontiguousarray(stream.keys[name], dtype=np.float64).tobytes())
    for name in labels:
        h.update(name.encode() + stream.label_keyset[name].encode() + np.asarray(stream.labels[name]).tobytes())
    return h.hexdigest()[:32]


def _selection_sample(index: StayIndex, cfg: CohortConfig) -> set[int]:
    """The training stays the streaming setting is chosen on: all of them, or the first ``select_max_stays``
    in a keyed order of their ids (a fixed, data-independent subsample that bounds the choice's cost)."""
    train = index.cohort.filter(pl.col("split") == "train")["stay_id"].to_list()
    cap = cfg.streaming.select_max_stays
    if cap is None or len(train) <= cap:
        return set(train)
    salt = cfg.split.salt
    rank = sorted(train, key=lambda s: hashlib.sha256(f"{salt}:select:{int(s)}".encode()).digest())
    return set(rank[:cap])


def declared_settings(cfg: CohortConfig) -> StreamingSettings | None:
    """nu_B and sigma declared in the config (``protocols.streaming.nu`` and ``sigma``), else None (chosen on
    the training split)."""
    st = cfg.streaming
    return StreamingSettings(st.nu, st.sigma) if st.declared else None


def _grid_rows(cache: StayCache, shard: int, selects: dict[int, str], streams: dict[int, TokenStream],
               cfg: CohortConfig, grid_cfg_key: str) -> tuple[list, int]:
    """Per selecting training stay (``selects``: stay_id -> the digest of what the grid reads of its stream) its
    grid scores, from the cache or computed now from its stream in ``streams`` (and cached): (stay_id, scores)."""
    present = cache.keys(shard)
    keys = {sid: _digest(d, grid_cfg_key) for sid, d in selects.items()}
    known = cache.read(shard, [k for k in keys.values() if k in present])
    known = {} if known is None else {k: list(zip(g.sort("j")["retention"], g.sort("j")["certified"]))
                                      for (k,), g in known.group_by(["key"])}
    out, new = [], []
    for sid in sorted(selects):
        scores = known.get(keys[sid])
        if scores is None:
            scores = grid_scores(streams[sid], cfg.streaming)
            new.append(pl.DataFrame({"key": [keys[sid]] * len(scores), "j": list(range(len(scores))),
                                     "retention": [r for r, _ in scores], "certified": [c for _, c in scores]}))
        out.append((sid, scores))
    cache.update(shard, set(keys.values()), new)
    return out, len(new)


def _label_keys(index: StayIndex, rows: pl.DataFrame) -> dict[int, str]:
    """Per stay of ``rows`` (one shard's) the key of its labelled tokens: its rare key (its rows, config, code and
    rare codes) and the token scaling, what :func:`labelled_shard` makes them from."""
    scaling = _digest(index.scaling.as_dict())
    return {sid: _digest(rk, scaling) for sid, rk in zip(rows["stay_id"].to_list(), rows["rare_key"].to_list())}


@dataclass
class _ShardLabels:
    """One shard's label rows (stay_id, subject_id, split, hour, time and a column per label), the streaming
    grid's scores of its selecting training stays, and how many stays were labelled now."""
    rows: pl.DataFrame
    grid: list
    labelled: int
    grid_computed: int


def _shard_labels(ws: Workspace, index: StayIndex, cfg: CohortConfig, shard: int, sample: set[int] | None,
                  grid_cfg_key: str) -> _ShardLabels:
    """The shard's label rows from the ``labelled`` cache (per stay its hours' labels, by :func:`_label_keys`,
    and a marker row holding the digest the streaming grid reads of its stream, when it is a training stay the
    setting is chosen on), labelling only the stays missing there: a night's run or a deletion labels the stays
    it changed, not the cohort. ``sample``: the training stays the setting is chosen on (None: it is declared)."""
    specs = list(cfg.labels)
    rows = index.shard_rows(shard)
    cache, grid_cache = StayCache(ws, "labelled"), StayCache(ws, "grid")
    keys = _label_keys(index, rows)
    known = cache.read(shard, set(keys.values())) if rows.height else None
    marked = {} if known is None else dict(known.filter(pl.col("hour").is_null()).select("key", "select").iter_rows())
    chosen_on = [sid for sid in keys if sample is not None and sid in sample]
    grid_present = grid_cache.keys(shard) if chosen_on else set()
    # a selecting stay is labelled again when the digest its grid scores are cached under is unknown or unscored
    need = {sid for sid, k in keys.items() if k not in marked}
    need |= {sid for sid in chosen_on if marked.get(keys[sid]) is None or
             (marked[keys[sid]] and _digest(marked[keys[sid]], grid_cfg_key) not in grid_present)}
    tok = labelled_shard(ws, index, cfg, shard, stay_ids=sorted(need)) if need else pl.DataFrame()
    streams = {s.stay_id: s for s in token_streams(tok.filter(pl.col("stay_id").is_in(
        pl.Series(chosen_on, dtype=pl.Int64).implode())), index.scaling, cfg, split="train")} \
        if tok.height and chosen_on else {}
    label = cfg.streaming.select_label
    fresh_selects = {sid: stream_digest(streams[sid], [label]) if sid in streams and
                     selects_on(streams[sid], cfg.streaming) else "" for sid in chosen_on if sid in need}
    new = [pl.DataFrame({"key": [keys[sid] for sid in sorted(need)], "hour": [None] * len(need),
                         "select": [fresh_selects.get(sid) for sid in sorted(need)]},
                        schema={"key": pl.String, "hour": pl.Int64, "select": pl.String})]
    keyed = pl.DataFrame({"stay_id": list(keys), "key": list(keys.values())},
                         schema={"stay_id": pl.Int64, "key": pl.String})
    columns = ["stay_id", "subject_id", "split", "hour", "time", *specs]
    parts = []
    if tok.height:
        parts.append(tok.select(columns))
        new.append(tok.join(keyed, on="stay_id").select("key", "hour", *specs))
    kept = set(keys.values()) - {keys[sid] for sid in need}
    if known is not None and kept:
        cached = (known.filter(pl.col("hour").is_not_null() & pl.col("key").is_in(
            pl.Series(sorted(kept), dtype=pl.String).implode()))
                  .join(keyed, on="key").join(rows.select("stay_id", "subject_id", "split", "intime"), on="stay_id")
                  .with_columns(bin_time(cfg.bin_hours)))
        parts.append(cached.select(columns))
    cache.update(shard, kept, new)
    selects = {sid: fresh_selects[sid] if sid in need else marked[keys[sid]] for sid in chosen_on}
    # (a shard without selecting stays keeps no grid scores: those of stays that left the sample go)
    grid, computed = _grid_rows(grid_cache, shard, {sid: d for sid, d in selects.items() if d}, streams, cfg,
                                grid_cfg_key) if sample is not None and (chosen_on or grid_cache.parts(shard)) \
        else ([], 0)
    frame = pl.concat(parts, how="vertical_relaxed") if parts else pl.DataFrame()
    return _ShardLabels(frame, grid, len(need), computed)


def label_run(ws: Workspace, index: StayIndex, cfg: CohortConfig, chunk_stays: int = 256,
              on_shard: Callable | None = None) -> dict:
    """Phase 2: rare vocabulary and hours, token scaling, MEDS label files, the streaming setting and the
    cohort's summary (aggregates only), shard by shard. ``on_shard(n)``: stays of each shard done."""
    channels = cfg.channels
    names = [c.name for c in channels]
    _rare_vocabulary(ws, index, cfg)
    _rare_hours(ws, index, chunk_stays)
    index.scaling = declared_scaling(cfg, names) or fit_scaling(ws, index, names)
    check_scaling(index.scaling, names)
    specs = cfg.labels
    files = LabelFiles({n: ws.labels / f"{n}.parquet" for n in specs})
    settings = declared_settings(cfg)
    sample = _selection_sample(index, cfg) if settings is None else set()
    grid_cfg_key = _digest(asdict(replace(cfg.streaming, select_max_stays=None)),
                           code_digest())
    grid, per_stay, computed, labelled = [], [], 0, 0
    for shard in index.sharding.shards():
        part = _shard_labels(ws, index, cfg, shard, sample if settings is None else None, grid_cfg_key)
        tok = part.rows
        if tok.height:
            ends = tok.with_columns((pl.col("time") + pl.duration(
                microseconds=round(cfg.bin_hours * 3_600_000_000))).alias("prediction_time"))
            for n in specs:
                files.write(n, ends.select("subject_id", "prediction_time", pl.col(n).alias("boolean_value")))
            per_stay.append(tok.group_by("stay_id", "split").agg(pl.len().alias("tokens"),
                                                                 *[pl.col(n).cast(pl.Int64).sum() for n in specs]))
        grid += part.grid
        computed += part.grid_computed
        labelled += part.labelled
        if on_shard is not None:
            on_shard(index.shard_rows(shard).height)
    files.close()
    index.computed["grid"] = computed
    index.computed["labels"] = labelled
    index.settings = settings or choose_settings([s for _, s in sorted(grid)], cfg.streaming)
    return _summary(ws, index, cfg, pl.concat(per_stay) if per_stay else None)


def _summary(ws: Workspace, index: StayIndex, cfg: CohortConfig, per_stay: pl.DataFrame | None) -> dict:
    specs = cfg.labels
    cohort = index.cohort
    facts = StayCache(ws, "facts").scan()
    fired = StayCache(ws, "fired").scan()
    keys = cohort.select("key", "stay_id").lazy()
    facts = facts.join(keys, on="key").collect() if facts is not None else pl.DataFrame(
        schema={"key": pl.String, "stay_id": pl.Int64, "died": pl.Boolean, "channel": pl.String,
                "readings": pl.Int64, "artifacts": pl.Int64})
    fired = (fired.join(keys, on="key").select("stay_id", "hour", "criterion").collect() if fired is not None else
             pl.DataFrame(schema={"stay_id": pl.Int64, "hour": pl.Int64, "criterion": pl.String}))
    names = index.scaling.channels
    by_channel = (facts.drop_nulls("channel").group_by("channel")
                  .agg(pl.col("readings").sum(), pl.col("artifacts").sum()))
    idx = {r["channel"]: r for r in by_channel.iter_rows(named=True)}
    per_stay = per_stay if per_stay is not None else pl.DataFrame(
        schema={"stay_id": pl.Int64, "split": pl.String, "tokens": pl.Int64, **{n: pl.Int64 for n in specs}})
    ev = per_stay.filter(pl.col("split") == "eval")
    n_eval = int(cohort.filter(pl.col("split") == "eval").join(ev.select("stay_id"), on="stay_id").height)
    summary = {"stays": int(cohort.height), "train_stays": int(cohort.height - n_eval), "eval_stays": n_eval,
               "stays_without_vitals": int(cohort.height - per_stay.height),
               "tokens": int(per_stay["tokens"].sum()), "eval_tokens": int(ev["tokens"].sum()),
               "bin_hours": cfg.bin_hours,
               "readings_by_channel": {c: int(idx.get(c, {}).get("readings", 0)) for c in names},
               "artifacts_by_channel": {c: int(idx.get(c, {}).get("artifacts", 0)) for c in names}}
    for name in specs:
        summary[f"eval_tokens_{name}"] = int(ev[name].sum())
        summary[f"eval_stays_with_{name}"] = int((ev[name] > 0).sum())
    deaths = facts.filter(pl.col("died"))["stay_id"].unique()
    cohort_rows = cohort.drop("shard", "key", "rare_key")
    summary["characteristics"] = describe_cohort(ws.store, cfg, cohort_rows, deaths, fired, per_stay)
    return summary


@dataclass(frozen=True)
class ScoringPlan:
    """What a stay's scores depend on besides its stream (part of every score's cache key)."""
    budgets: tuple
    fractions: tuple
    memory_budget: int | None
    fraction_cap: int | None

    def key(self, index: StayIndex, cfg: CohortConfig, digest: str) -> str:
        """The score key of a stream whose :func:`stream_digest` is ``digest``."""
        return _digest(digest, index.settings.nu, index.settings.sigma,
                       asdict(cfg.fixed_context), list(self.budgets), list(self.fractions),
                       self.memory_budget, self.fraction_cap, code_digest())


NO_STREAM = ""     # a stay whose labelled tokens give no stream (the streams cache records that too)


def _stream_digests(ws: Workspace, index: StayIndex, cfg: CohortConfig, shard: int, rows: pl.DataFrame
                    ) -> tuple[dict[int, str], Callable, int]:
    """Per evaluation stay of ``rows`` (one shard's) its :func:`stream_digest` (NO_STREAM: it has no stream),
    from the ``streams`` cache, keyed by the stay's rare key (its rows, config, code and rare codes) and the
    token scaling: what its labelled stream is built from. A stream is built only for a stay missing there, so
    a night's run builds the changed stays' streams, not the cohort's. Returns the digests, ``streams(stay_ids)``,
    those stays' streams (each built once), and how many stays' streams were built for their digest."""
    cache = StayCache(ws, "streams")
    keys = _label_keys(index, rows)
    known = cache.read(shard, set(keys.values()))
    known = {} if known is None else dict(zip(known["key"].to_list(), known["digest"].to_list()))
    digests = {sid: known[k] for sid, k in keys.items() if k in known}
    missing = [sid for sid in keys if sid not in digests]

    def build(stay_ids: list[int]) -> list[TokenStream]:
        return token_streams(labelled_shard(ws, index, cfg, shard, split="eval", stay_ids=stay_ids), index.scaling,
                             cfg, split="eval") if stay_ids else []

    made = {st.stay_id: st for st in build(missing)}
    digests.update({sid: stream_digest(made[sid]) if sid in made else NO_STREAM for sid in missing})
    cache.update(shard, set(keys.values()), [pl.DataFrame({"key": [keys[sid] for sid in missing],
                                                           "digest": [digests[sid] for sid in missing]},
                                                          schema={"key": pl.String, "digest": pl.String})])

    def streams(stay_ids: list[int]) -> list[TokenStream]:
        out = [made[sid] for sid in stay_ids if sid in made] + build([sid for sid in stay_ids if sid not in made])
        return sorted(out, key=lambda st: st.stay_id)

    return digests, streams, len(missing)


def pending_streams(ws: Workspace, index: StayIndex, cfg: CohortConfig, plan: ScoringPlan, batch_stays: int = 2048,
                    on_cached: Callable | None = None) -> Iterator[list[TokenStream]]:
    """The evaluation streams whose scores are not cached (or whose per-stay memory file is gone), in
    batches of at most ``batch_stays``, each stream with its memory path and score key (``score_key``).
    Every evaluation stay's score key is recorded in ``index.cohort`` (column ``score_key``) as a side effect,
    for :func:`write_results`. ``on_cached(n)``: stays found in the cache (progress)."""
    secret = store_key(ws.store, ws.root)
    ws.stay_memories.mkdir(parents=True, exist_ok=True)
    cache = StayCache(ws, "scores")
    batch, score_keys = [], {}
    for shard in index.sharding.shards():
        rows = index.shard_rows(shard).filter(pl.col("split") == "eval")
        if rows.height == 0:
            continue
        digests, build, built = _stream_digests(ws, index, cfg, shard, rows)
        index.computed["streams"] = index.computed.get("streams", 0) + built
        present = cache.keys(shard)
        hits, todo = 0, []
        for sid in sorted(digests):
            if digests[sid] == NO_STREAM:
                continue
            score_keys[sid] = plan.key(index, cfg, digests[sid])
            if score_keys[sid] in present and (plan.memory_budget is None or ws.has_stay_memory(sid, secret)):
                hits += 1
            else:
                todo.append(sid)
        for s in build(todo):
            s.memory_path = str(ws.stay_memory(s.stay_id, secret))
            s.score_key = score_keys[s.stay_id]
            batch.append(s)
            if len(batch) >= batch_stays:
                yield batch
                batch = []
        if on_cached is not None and hits:
            on_cached(hits)
    if batch:
        yield batch
    index.cohort = index.cohort.with_columns(
        pl.col("stay_id").replace_strict(score_keys, default=None, return_dtype=pl.String).alias("score_key"))


def store_scores(ws: Workspace, streams: list[TokenStream], rows: list[dict]) -> None:
    """Cache the per-stay long rows of scored ``streams`` under their score keys (no identifier kept)."""
    key_of = {s.stay_id: s.score_key for s in streams}
    sharding = Sharding.of_store(ws.store)
    shard_of_stay = {s.stay_id: sharding.shard(s.subject_id) for s in streams}
    frame = pl.DataFrame(rows, infer_schema_length=None)
    frame = frame.with_columns(pl.col("stay_id").replace_strict(key_of, return_dtype=pl.String).alias("key"),
                               pl.col("stay_id").replace_strict(shard_of_stay, return_dtype=pl.Int64).alias("_shard"))
    cache = StayCache(ws, "scores")
    for (shard,), part in frame.group_by(["_shard"]):
        part = part.drop("stay_id", "subject_id", "_shard")
        present = cache.keys(int(shard))
        again = present & set(part["key"].to_list())      # rescored (its memory file was gone): replace
        if again:
            cache.update(int(shard), present - again, [part])
        else:
            cache.append(int(shard), [part])


# a stay and its patient by keyed reference (pipeline.privacy.id_refs), never by id
RESULT_COLUMNS = ["stay_ref", "subject_ref", "protocol", "tokens", "keys", "label", "budget", "policy", "metric",
                  "value"]


def write_results(ws: Workspace, index: StayIndex) -> Path:
    """The run's per-stay result rows (patient-level: they stay in the workspace), shard by shard from the
    score cache, which is compacted to the evaluation stays' current keys on the way."""
    cache, secret = StayCache(ws, "scores"), store_key(ws.store, ws.root)
    target = ws.results
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    writer = None
    for shard in index.sharding.shards():
        rows = index.shard_rows(shard).drop_nulls("score_key")
        wanted = set(rows["score_key"].to_list())
        cache.update(shard, wanted)
        part = cache.read(shard, wanted)
        if part is None or part.height == 0:
            continue
        part = id_refs(part.join(rows.select(pl.col("score_key").alias("key"), "stay_id", "subject_id"), on="key"),
                       secret).select(RESULT_COLUMNS).sort("stay_ref", maintain_order=True)
        table = part.to_arrow()
        if writer is None:
            writer = pq.ParquetWriter(tmp, table.schema)
        writer.write_table(table.cast(writer.schema))
    if writer is None:
        pl.DataFrame(schema={c: pl.String for c in RESULT_COLUMNS}).write_parquet(tmp)
    else:
        writer.close()
    tmp.replace(target)
    return target


@dataclass
class CohortBatch:
    """A block of the cohort's tokens in global time order (the cohort memory's input)."""
    keys: np.ndarray
    token_ids: list[str] | None      # None: not named (:meth:`OrderedTokens.batches`)
    order_keys: list[str]
    subject_ids: np.ndarray


class OrderedTokens:
    """The cohort's cached tokens ordered by order key (the bin's start, then the stay's smallest event hash),
    those after ``after`` (and at or before ``upto``), without the subjects in ``exclude_subjects``. DuckDB sorts
    out of core, so :meth:`batches` holds one block whatever the cohort's size. ``name(subject_id, stay_id, hour)``: a
    token's id (keyed references, no identifier)."""

    def __init__(self, ws: Workspace, index: StayIndex, cfg: CohortConfig, scaling: TokenScaling, name: Callable,
                 after: str = "", upto: str | None = None, exclude_subjects: frozenset = frozenset()):
        self.parts = sorted(StayCache(ws, "tokens").dir.glob("*/*.parquet"))
        self.scaling, self.name = scaling, name
        self.cohort = index.cohort.select("key", "stay_id", "subject_id", "intime").to_arrow()
        files = "[" + ", ".join(map(sql_literal, self.parts)) + "]"
        secs = int(3600 * cfg.bin_hours)
        where = ["order_key > ?"] + (["order_key <= ?"] if upto is not None else []) + \
            (["NOT list_contains(?::BIGINT[], subject_id)"] if exclude_subjects else [])
        self.params = [after] + ([upto] if upto is not None else []) + \
            ([sorted(int(s) for s in exclude_subjects)] if exclude_subjects else [])
        cols = ", ".join(f'"{n}"' for n in scaling.channels)
        self.rows = f"""
            WITH t AS (SELECT * FROM read_parquet({files})),
                 tie AS (SELECT key, min(first_hash) AS tie FROM t GROUP BY key),
                 rows AS (SELECT c.stay_id, c.subject_id, t.hour, {cols},
                                 strftime(c.intime + to_seconds(t.hour * {secs}), '%Y-%m-%dT%H:%M:%S.%f') || '|' ||
                                     tie.tie AS order_key
                          FROM t JOIN cohort c USING (key) JOIN tie USING (key))
            SELECT * FROM rows WHERE {' AND '.join(where)}"""

    def _connect(self):
        con = duckdb.connect()
        con.register("cohort", self.cohort)
        return con

    def count(self) -> int:
        if not self.parts:
            return 0
        con = self._connect()
        try:
            return int(con.sql(f"SELECT count(*) FROM ({self.rows})", params=self.params).fetchall()[0][0])
        finally:
            con.close()

    def batches(self, batch_rows: int = 65_536, names: bool = True) -> Iterator[CohortBatch]:
        """The rows in order, ``batch_rows`` at a time; ``names=False``: without token ids (None), for a pass
        that only hashes the rows (naming them was half of reading them)."""
        if not self.parts:
            return
        con = self._connect()
        try:
            for batch in con.sql(f"{self.rows} ORDER BY order_key", params=self.params).to_arrow_reader(batch_rows):
                frame = self.scaling.impute(pl.from_arrow(batch))
                subjects = frame["subject_id"].to_numpy()
                ids = [self.name(int(s), st, h) for s, st, h in zip(subjects, frame["stay_id"], frame["hour"])] \
                    if names else None
                yield CohortBatch(self.scaling.keys(frame), ids, frame["order_key"].to_list(), subjects)
        finally:
            con.close()
