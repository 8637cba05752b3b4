"""The cohort memory over a workspace: its checkpoints (memory, stream mode, key statistics), its input in global
time order, and its update after a run. A deletion reads the same input without its patients
(:meth:`CohortRows.feed` with ``exclude``) and their own rows (:meth:`CohortRows.of_subjects`)."""
from __future__ import annotations

import functools
import json
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cohorts.definitions import workspace_config
from cohorts.stream_mode import StreamMode
from cohorts.streams import CohortStream, cohort_stream, hour_token_names
from cohorts.tokens import TokenScaling, declared_scaling
from memory.cohort import CohortMemory, prefix_digests
from pipeline.keys import EventKeyer
from pipeline.privacy import store_key

from .token_run import OrderedTokens, StayIndex, fit_scaling, stay_facts

if TYPE_CHECKING:
    from cohorts.config import CohortConfig
    from collections.abc import Callable

    import numpy as np

    from pipeline.workspace import Workspace

STREAM_FILE = "stream.json"          # a checkpoint's stream mode
SCALER_FILES = {StreamMode.EVENTS: "keyer.parquet", StreamMode.HOURLY: "token_scaling.json"}
FEED_BLOCK = 2048                    # tokens fed between progress reports
SNAPSHOTS_PER_FEED = 16              # a feed saves the memory this many times at most (replay bases)
SNAPSHOT_MIN_TOKENS = 4 * FEED_BLOCK # and never more often than this
SNAPSHOTS_KEPT = 64                  # the newest snapshots kept (each is one budgeted memory, ~100 KB)
# the newest checkpoints kept per stream mode: a deletion rewrites every checkpoint fed the patient, so with
# one checkpoint a night and none pruned its cost grew with the nights; snapshots are the rebuild bases
CHECKPOINTS_KEPT = 8


def checkpoint_tokens(ckpt: Path) -> StreamMode:
    """The stream mode a cohort-memory checkpoint was fed (events for checkpoints from before token mode)."""
    f = Path(ckpt) / STREAM_FILE
    return StreamMode(json.loads(f.read_text())["tokens"]) if f.exists() else StreamMode.EVENTS


def scaler_file(ckpt: Path) -> Path:
    """The file of a checkpoint's key statistics."""
    return Path(ckpt) / SCALER_FILES[checkpoint_tokens(ckpt)]


def load_scaler(ckpt: Path) -> TokenScaling | EventKeyer:
    """The key statistics persisted with a checkpoint: an EventKeyer or a TokenScaling."""
    path = scaler_file(ckpt)
    return EventKeyer.load(path) if checkpoint_tokens(ckpt) is StreamMode.EVENTS else TokenScaling.load(path)


def save_scaler(scaler: TokenScaling | EventKeyer, ckpt: Path, tokens: StreamMode) -> None:
    tokens = StreamMode(tokens)
    scaler.save(Path(ckpt) / SCALER_FILES[tokens])
    (Path(ckpt) / STREAM_FILE).write_text(json.dumps({"tokens": tokens.value}))


def copy_checkpoint_extras(src: Path, dst: Path) -> None:
    """Carry a checkpoint's key statistics and stream mode into a rewritten copy of it."""
    for f in Path(src).iterdir():
        if f.is_file() and f.name not in ("memory.npz", "meta.json"):
            shutil.copyfile(f, Path(dst) / f.name)


def cohort_memory_gamma(cfg: CohortConfig, tokens: StreamMode) -> float:
    """Kernel width of the cohort memory: the fixed-context sigma on token keys, 0.5 on 13-d event keys."""
    hourly = StreamMode(tokens) is StreamMode.HOURLY
    return 1.0 / cfg.fixed_context.sigma ** 2 if hourly else 0.5


class SnapshotWriter:
    """Saves the memory being fed every ``1 / SNAPSHOTS_PER_FEED`` of the feed (at least SNAPSHOT_MIN_TOKENS
    apart) into ``folder/NNNNNN`` with its key statistics: the bases a replay deletion starts from, the latest
    before the deleted patients' first token, instead of re-feeding the cohort from the start. ``stage(path)``:
    where a snapshot of ``path`` is written (a deletion's transaction stages it)."""

    def __init__(self, folder: Path, scaler: TokenScaling | EventKeyer, tokens: StreamMode,
                 stage: Callable[[Path], Path] | None = None):
        self.folder, self.scaler, self.tokens, self.stage = folder, scaler, StreamMode(tokens), stage
        taken = [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.exists() else []
        self.count, self.since, self.every = max(taken, default=-1) + 1, 0, SNAPSHOT_MIN_TOKENS

    def set_total(self, total: int) -> None:
        self.every = max(SNAPSHOT_MIN_TOKENS, -(-total // SNAPSHOTS_PER_FEED))

    def __call__(self, mem: CohortMemory, fed: int) -> None:
        self.since += fed
        if self.since < self.every:
            return
        self.since = 0
        final = self.folder / f"{self.count:06d}"
        target = self.stage(final) if self.stage is not None else final
        mem.save(target)
        save_scaler(self.scaler, target, self.tokens)
        self.count += 1


class CohortRows:
    """The cohort memory's input over a workspace in one stream mode, under key statistics ``scaler`` (fitted on
    the training split when None: :attr:`scaler` then holds them). Hourly tokens stream in order from the run's
    token cache, never all at once; raw events (small stores) are keyed in memory. Each is read on first use."""

    def __init__(self, ws: Workspace, tokens: StreamMode, scaler: TokenScaling | EventKeyer | None = None,
                 cfg: CohortConfig | None = None, index: StayIndex | None = None):
        self.ws, self.tokens, self._scaler, self._index = ws, StreamMode(tokens), scaler, index
        self.cfg = cfg or workspace_config(ws.root)
        self.key = store_key(ws.store, ws.root)

    @property
    def hourly(self) -> bool:
        return self.tokens is StreamMode.HOURLY

    @functools.cached_property
    def index(self) -> StayIndex:
        """The run's index of stays when one was given (its tokens cached), else :func:`stay_facts`'."""
        return self._index if self._index is not None else stay_facts(self.ws, self.cfg)

    @functools.cached_property
    def events(self) -> CohortStream:
        return cohort_stream(self.ws.store, self.cfg, self.tokens, self.key, scaler=self._scaler)

    @functools.cached_property
    def scaler(self) -> TokenScaling | EventKeyer:
        if self._scaler is not None:
            return self._scaler
        if not self.hourly:
            return self.events.scaler
        names = [c.name for c in self.cfg.channels]
        return declared_scaling(self.cfg, names) or fit_scaling(self.ws, self.index, names)

    def _ordered(self, after: str = "", upto: str | None = None, exclude: frozenset = frozenset()) -> OrderedTokens:
        return OrderedTokens(self.ws, self.index, self.cfg, self.scaler, hour_token_names(self.key), after=after,
                             upto=upto, exclude_subjects=exclude)

    def histories(self, saved: dict[str, set[int]]) -> dict[str, int]:
        """The digest of the rows up to each order key of ``saved`` (watermark -> the digests saved memories
        record at it: what they were fed), in one pass, which stops at the first mark whose rows' digest is none
        of those saved (the rows after it are re-fed, not hashed twice)."""
        if not saved:
            return {}
        if not self.hourly:
            blocks = [(self.events.order_keys, self.events.keys)]
        else:
            blocks = ((b.order_keys, b.keys) for b in self._ordered(upto=max(saved)).batches(names=False))
        return prefix_digests(blocks, saved, saved)

    def feed(self, mem: CohortMemory, upto: str | None = None, exclude: frozenset = frozenset(),
             snapshots: SnapshotWriter | None = None) -> None:
        """Feed ``mem`` the rows after its watermark (and at or before ``upto``), without the subjects in
        ``exclude``, in order. ``snapshots``: saves the memory along the way (told the total first)."""
        if not self.hourly:
            ev = self.events
            todo = [i for i, (o, s) in enumerate(zip(ev.order_keys, ev.subject_ids))
                    if o > mem.watermark and (upto is None or o <= upto) and int(s) not in exclude]
            blocks = ((ev.keys[b], [ev.token_ids[i] for i in b], [ev.order_keys[i] for i in b])
                      for b in (todo[lo:lo + FEED_BLOCK] for lo in range(0, len(todo), FEED_BLOCK)))
            total = len(todo)
        else:
            rows = self._ordered(after=mem.watermark, upto=upto, exclude=exclude)
            blocks = ((b.keys, b.token_ids, b.order_keys) for b in rows.batches(FEED_BLOCK))
            total = rows.count() if snapshots is not None else 0
        if snapshots is not None:
            snapshots.set_total(total)
        for keys, ids, order in blocks:
            mem.feed(keys, ids, order)
            if snapshots is not None:
                snapshots(mem, len(order))

    def of_subjects(self, subject_ids: frozenset) -> tuple[list[str], np.ndarray]:
        """Those subjects' rows as this input holds them, in order: (order keys, keys), read from their shards."""
        own = cohort_stream(self.ws.store, self.cfg, self.tokens, self.key, scaler=self.scaler,
                            subject_ids=frozenset(subject_ids))
        return own.order_keys, own.keys


def _unchanged_base(saved: list[Path], digests: dict[str, int]) -> Path | None:
    """The saved memory (checkpoint or snapshot) with the latest watermark whose fed history is still the store's
    history up to it, among those ``digests`` reach (None: none)."""
    unchanged = [s for s in saved if CohortMemory.saved_history(s) == digests.get(CohortMemory.saved_watermark(s))]
    return max(unchanged, key=CohortMemory.saved_watermark, default=None)


def update_cohort_memory(ws: Workspace, cfg: CohortConfig | None = None, budget: int = 128,
                         tokens: StreamMode = StreamMode.HOURLY, index: StayIndex | None = None) -> dict:
    """Resume the cohort memory from its latest checkpoint of the same stream mode, feed what it has not
    seen, checkpoint it. A run in the other mode starts a new memory (its checkpoints follow the old ones).

    Rows dated before the memory's watermark that arrived since (late rows, or changed ones) change the
    store's history up to the watermark: the memory is then rebuilt from the latest checkpoint whose history
    is unchanged (or from empty), as if the rows had arrived in time order, and the result says so.
    ``index``: the run's index of stays, their tokens cached (default: :func:`stay_facts`' over the
    workspace)."""
    tokens = StreamMode(tokens)
    cfg = cfg or workspace_config(ws.root)
    ckpts = ws.checkpoints()
    same = [c for c in ckpts if checkpoint_tokens(c) is tokens]
    if same:
        mem, scaler = CohortMemory.load(same[-1]), load_scaler(same[-1])
    else:
        mem, scaler = CohortMemory(budget=budget, gamma=cohort_memory_gamma(cfg, tokens)), None
    rows = CohortRows(ws, tokens, scaler, cfg, index)
    history = ({"checked": mem.history is not None, "changed_before_watermark": False} if same else
               {"checked": False, "new_memory": True})
    if same and mem.history is not None:
        # one pass over the store's rows gives the digest at every saved memory's watermark up to the first
        # that changed: whether the latest is unchanged and, if not, the latest base before the change (a pass
        # per checkpoint grew with the nights; a pass to the end hashed again what the rebuild feeds)
        saved = [s for s in [*same[:-1], *ws.snapshots()]
                 if checkpoint_tokens(s) is tokens and CohortMemory.saved_history(s) is not None]
        held = {mem.watermark: {mem.history}}
        for s in saved:
            held.setdefault(CohortMemory.saved_watermark(s), set()).add(CohortMemory.saved_history(s))
        digests = rows.histories(held)
        if digests.get(mem.watermark) != mem.history:
            base = _unchanged_base(saved, digests)
            history = {"checked": True, "changed_before_watermark": True, "rebuilt_from":
                       "empty memory" if base is None else str(base.relative_to(ws.cohort_memories))}
            mem = (CohortMemory.load(base) if base is not None else
                   CohortMemory(budget=mem.policy.budget, gamma=mem.gamma, nu=mem.policy.nu))
            for stale in ws.snapshots():     # fed rows that are no longer the store's (or past the change)
                if CohortMemory.saved_history(stale) != digests.get(CohortMemory.saved_watermark(stale)):
                    shutil.rmtree(stale)
    fed_before = mem.fed
    seq = int(ckpts[-1].name.split("-")[0]) + 1 if ckpts else 0
    target = ws.cohort_checkpoints / f"{seq:06d}-{time.strftime('%Y%m%dT%H%M%S')}"
    rows.feed(mem, snapshots=SnapshotWriter(ws.cohort_snapshots / target.name, rows.scaler, tokens))
    target.parent.mkdir(parents=True, exist_ok=True)
    mem.save(target)
    save_scaler(rows.scaler, target, tokens)
    for old in ws.snapshots()[:-SNAPSHOTS_KEPT]:
        shutil.rmtree(old)
    for old in [c for c in ws.checkpoints() if checkpoint_tokens(c) is tokens][:-CHECKPOINTS_KEPT]:
        shutil.rmtree(old)
    return memory_info(mem, target.name, tokens, mem.fed - fed_before, history)


def memory_info(mem: CohortMemory, checkpoint: str, tokens: StreamMode, fed: int, history: dict) -> dict:
    """What the report says of the cohort memory after a run fed it ``fed`` tokens (or a deletion replayed it)."""
    return {"checkpoint": checkpoint, "tokens_mode": StreamMode(tokens).value, "fed": int(fed),
            "tokens": mem.memory.n_tokens, "certified_evictions": mem.policy.certified,
            "uncertified_evictions": mem.policy.uncertified, "history": history}
