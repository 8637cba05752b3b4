"""What a run hands on to its report: aggregates only, no patient-level row."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from cohorts.results import PairedRow, SummaryRow

if TYPE_CHECKING:
    from .provenance import Provenance


@dataclass(frozen=True)
class RunResult:
    """A run's statistics (``summary``: mean and interval per policy and budget; ``paired``: SV minus each
    baseline on the same stays), the cohort's counts and table (``cohort``), how the numbers were made
    (``metadata``: parameters, rules, code, the cohort memory) and where the data came from (``provenance``)."""
    summary: tuple[SummaryRow, ...]
    paired: tuple[PairedRow, ...]
    cohort: dict
    metadata: dict
    provenance: Provenance | None = None

    def with_metadata(self, **entries) -> RunResult:
        return replace(self, metadata={**self.metadata, **entries})

    def as_json(self) -> dict:
        """report.json's document."""
        return {"summary": [r.as_json() for r in self.summary], "paired": [r.as_json() for r in self.paired],
                "cohort": self.cohort, "metadata": self.metadata,
                "provenance": dataclasses.asdict(self.provenance) if self.provenance is not None else None}
