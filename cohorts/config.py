"""A cohort config as typed records, made once when its YAML is loaded and checked
(:func:`cohorts.definitions.load_config`), then passed down: no step re-reads the file or indexes its sections.

The sections with structure of their own (deterioration criteria, token channels and labels, the MEDS source's
codes) keep their parsed YAML in :attr:`CohortConfig.raw`; their modules read them into their own records
(:func:`cohorts.tokens.channels_from_config`, :func:`cohorts.tokens.label_specs`, ...). ``raw`` is also what a
cache key digests.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import meds

from .channels import Channel, channels_of
from .config_check import check_token_labels
from .endpoints import Endpoints, endpoints_from_config

DEFAULT_SMALL_CELL_THRESHOLD = 11    # MIMIC-IV's data use agreement: no published count of fewer than 11 people


@dataclass(frozen=True)
class CohortRules:
    """Who is in the cohort: adults of ``min_age`` and more, ICU stays of ``min_stay_hours`` or longer; the codes
    whose events are deaths."""
    min_age: int | float
    min_stay_hours: int | float
    death_codes: tuple[str, ...]


@dataclass(frozen=True)
class Split:
    """The subject-level split: a keyed hash of the subject id under ``salt`` puts ``eval_fraction`` of the
    patients in the evaluation split."""
    eval_fraction: float
    salt: str


@dataclass(frozen=True)
class FixedContext:
    """The paper's protocol: per stay, the exact solve with C = 1/(nu n) and kernel width ``sigma``."""
    nu: float
    sigma: float


@dataclass(frozen=True)
class StreamingProtocol:
    """Streaming: nu_B and sigma declared (``nu``, ``sigma``), or chosen on at most ``select_max_stays`` training
    stays over the grids at ``select_budget`` by ``select_label``'s retention among settings certified at
    ``min_certified``."""
    nu_grid: tuple[float, ...]
    sigma_grid: tuple[float, ...]
    select_budget: int
    select_label: str
    min_certified: float
    select_max_stays: int | None = None
    nu: float | None = None
    sigma: float | None = None

    @property
    def declared(self) -> bool:
        return self.nu is not None and self.sigma is not None


@dataclass(frozen=True)
class CohortConfig:
    """A checked cohort config: its file (``path``), its typed sections and its parsed YAML (``raw``)."""
    raw: dict = field(repr=False, hash=False, compare=True)
    path: Path | None
    cohort: CohortRules
    split: Split
    rare_quantile: float
    bin_hours: float
    fixed_context: FixedContext
    streaming: StreamingProtocol
    endpoints: Endpoints
    small_cell_threshold: int

    @classmethod
    def from_raw(cls, raw: dict, path: Path | None = None) -> CohortConfig:
        """The typed view of a parsed config that passed the checks (:func:`cohorts.definitions.load_config`)."""
        st = raw["protocols"]["streaming"]
        fixed = raw["protocols"]["fixed_context"]
        cohort = raw["cohort"]
        return cls(
            raw=raw, path=path,
            cohort=CohortRules(cohort["min_age"], cohort["min_stay_hours"],
                               tuple(cohort.get("death_codes", [meds.death_code]))),
            split=Split(float(raw["split"]["eval_fraction"]), str(raw["split"]["salt"])),
            rare_quantile=float(raw["rare_items"]["quantile"]),
            bin_hours=float((raw.get("tokens") or {}).get("bin_hours", 1)),
            fixed_context=FixedContext(float(fixed["nu"]), float(fixed["sigma"])),
            streaming=StreamingProtocol(
                tuple(float(v) for v in st["nu_grid"]), tuple(float(v) for v in st["sigma_grid"]),
                int(st["select_budget"]), str(st["select_label"]), float(st["min_certified"]),
                int(st["select_max_stays"]) if st.get("select_max_stays") is not None else None,
                float(st["nu"]) if "nu" in st else None, float(st["sigma"]) if "sigma" in st else None),
            endpoints=endpoints_from_config(raw),
            small_cell_threshold=int((raw.get("report") or {}).get("small_cell_threshold",
                                                                   DEFAULT_SMALL_CELL_THRESHOLD)))

    @functools.cached_property
    def channels(self) -> tuple[Channel, ...]:
        """The token channels (read on first use: a raw-events config may have none)."""
        return channels_of(self.section("tokens"))

    @functools.cached_property
    def labels(self) -> dict:
        """The token labels by name, checked (:func:`cohorts.config_check.check_token_labels`)."""
        self.channels
        return check_token_labels(self.raw)

    def section(self, name: str) -> dict:
        """A section with structure of its own, as parsed (empty when the config has none)."""
        return self.raw.get(name) or {}

    @property
    def digest(self) -> str:
        """A digest of everything the config says (part of every per-stay cache key)."""
        return hashlib.sha256(json.dumps(self.raw, sort_keys=True, default=str).encode()).hexdigest()[:32]
