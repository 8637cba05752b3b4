"""What a stay's stream is made of (standard library only: the CLI offers the choices before heavy imports)."""
from __future__ import annotations

from enum import Enum


class StreamMode(str, Enum):
    """Hourly patient-state tokens (the default) or raw events. A ``str`` enum: it is its value in JSON, in the
    per-stay results' ``tokens`` column and in Prefect's parameters."""
    HOURLY = "hourly"
    EVENTS = "events"

    def __str__(self) -> str:
        return self.value
