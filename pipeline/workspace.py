"""Where a Forgetful deployment keeps everything (one folder, the ``--out`` of the CLI)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .privacy import stay_ref


@dataclass(frozen=True)
class Workspace:
    root: Path
    # A deletion's view of a workspace (deletion.derived): the per-stay memory files the view did not write are
    # looked up in this folder, the workspace's own, instead of being linked one by one (thousands of links at
    # 10 % of MIMIC-IV, for the few stays a deletion rescores).
    stay_memories_of: Path | None = None

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root).resolve())

    source = property(lambda self: self.root / "source")            # the embedded generator's output
    store = property(lambda self: self.root / "store")              # parquet event store
    results = property(lambda self: self.root / "results" / "per_stay.parquet")
    labels = property(lambda self: self.root / "labels")                # MEDS label files of the last run
    stay_memories = property(lambda self: self.root / "memories" / "stays")
    cohort_memories = property(lambda self: self.root / "memories" / "cohort")
    cohort_checkpoints = property(lambda self: self.cohort_memories / "checkpoints")
    # the cohort memory as it was part way through a feed: where a replay deletion or a rebuild starts from
    cohort_snapshots = property(lambda self: self.cohort_memories / "snapshots")
    encoder = property(lambda self: self.root / "models" / "encoder.pt")  # learned event keys
    report_html = property(lambda self: self.root / "report.html")
    report_json = property(lambda self: self.root / "report.json")
    ledger = property(lambda self: self.root / "ledger.jsonl")
    certificates = property(lambda self: self.root / "certificates")
    generation_file = property(lambda self: self.store / "generation.json")
    run_params = property(lambda self: self.root / "run.json")          # the last run's parameters (RunParams)
    phases = property(lambda self: self.root / "run_phases.json")       # the last run's steps and their times
    cache = property(lambda self: self.root / "cache")                  # per-stay caches, content-keyed
    statistics = property(lambda self: self.cache / "statistics.json")  # the last run's aggregates
    config = property(lambda self: self.root / "config.yaml")           # the workspace's cohort config
    desk = property(lambda self: self.root / "deletion_desk")           # requests to the serving process

    def stay_memory(self, stay_id: int, key: bytes) -> Path:
        """Per-stay memory file, named by a keyed hash of the stay id (no identifier in file names)."""
        return self.stay_memories / f"{stay_ref(stay_id, key)}.npz"

    def has_stay_memory(self, stay_id: int, key: bytes) -> bool:
        """Whether the stay's memory file exists here (or, for a view, in the workspace it views)."""
        own = self.stay_memory(stay_id, key)
        return own.exists() or (self.stay_memories_of is not None and (self.stay_memories_of / own.name).exists())

    def checkpoints(self) -> list:
        """Cohort-memory checkpoints, oldest first."""
        d = self.cohort_checkpoints
        return sorted((p for p in d.iterdir() if p.is_dir() and not p.name.endswith(".tmp")),
                      key=lambda p: p.name) if d.exists() else []

    def snapshots(self) -> list:
        """Cohort-memory snapshots (``snapshots/<checkpoint>/<NNNNNN>``), in the order they were written."""
        d = self.cohort_snapshots
        return sorted(p for p in d.glob("*/*") if p.is_dir() and not p.name.endswith(".tmp")) if d.exists() else []

    def generation(self) -> int:
        """Bumped by every deletion: part of every cache key over the store's content."""
        f = self.generation_file
        return json.loads(f.read_text())["generation"] if f.exists() else 0
