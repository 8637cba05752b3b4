"""Declared endpoints: the paired comparisons (SV minus a baseline on the same stays) that a cohort config names
before the run, in a *primary* and a *secondary* family. Holm adjusts within each family; every other comparison
of the run is *exploratory*: shown with its unadjusted p and labelled so. A family of m comparisons gets enough
sign-flip resamples that the Monte Carlo floor of its adjusted p, m / (resamples + 1), sits a tenth below its
alpha, so a p-value's resolution never decides a finding."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import CohortConfigError
from .results import PairedRow
from .stream_mode import StreamMode

FAMILIES = ("primary", "secondary")
EXPLORATORY = "exploratory"
PROTOCOL_BASELINES = {"fixed_context": ("recency", "random", "h2o_proxy", "softmax_h2o", "residual_delta"),
                      "streaming": ("recency", "random", "softmax_h2o", "residual_delta")}
TOKENS = tuple(m.value for m in StreamMode)
METRICS = ("retention", "retrieval", "retention_hour_end")
DEFAULT_ALPHA = 0.05
MIN_RESAMPLES = 10_000


@dataclass(frozen=True)
class Endpoint:
    """One declared comparison: SV minus ``baseline`` on ``metric`` of ``label`` at ``budget``."""
    family: str
    protocol: str
    tokens: str
    label: str
    budget: str
    baseline: str
    metric: str = "retention"

    def matches(self, row: PairedRow) -> bool:
        return (row.protocol, row.tokens.value, row.label, str(row.budget), row.baseline, row.metric) \
            == (self.protocol, self.tokens, self.label, self.budget, self.baseline, self.metric)

    def describe(self) -> str:
        budget = "k = |S u E|" if self.budget == "k" else f"B = {self.budget}"
        return (f"{self.protocol.replace('_', ' ')}, {self.tokens} tokens, {self.label} {self.metric} at {budget}: "
                f"SV vs {self.baseline}")


@dataclass(frozen=True)
class Endpoints:
    """The config's families (in order) and the family-wise alpha."""
    declared: tuple
    alpha: float = DEFAULT_ALPHA

    def family_of(self, row: PairedRow) -> str:
        return next((e.family for e in self.declared if e.matches(row)), EXPLORATORY)

    def size(self, family: str) -> int:
        return sum(e.family == family for e in self.declared)

    def resamples(self, family: str) -> int:
        """Sign-flip resamples for a comparison of ``family``: the adjusted p's floor ten times below alpha."""
        if family == EXPLORATORY:
            return MIN_RESAMPLES
        return max(MIN_RESAMPLES, math.ceil(10 * self.size(family) / self.alpha))

    def as_settings(self) -> dict:
        """The families as the report's settings print them."""
        return {"alpha": self.alpha, "adjustment": "Holm within each family; every other comparison is "
                                                   "exploratory (unadjusted p)",
                **{f: [e.describe() for e in self.declared if e.family == f] for f in FAMILIES}}


NO_ENDPOINTS = Endpoints(())


def endpoint_of(row: PairedRow) -> Endpoint:
    """The comparison a paired row of :func:`cohorts.evaluation.aggregate` holds, as an endpoint record."""
    return Endpoint(row.family, row.protocol, row.tokens.value, row.label, str(row.budget), row.baseline, row.metric)


def _listed(value) -> list:
    return [str(v) for v in (value if isinstance(value, list) else [value])]


def _budget(entry: dict, protocol: str, where: str) -> str:
    budget = str(entry.get("budget", ""))
    if protocol == "fixed_context" and budget != "k":
        raise CohortConfigError(f"{where}: the fixed-context protocol's budget is k (|S u E| per stay), not {budget!r}")
    if protocol == "streaming":
        number = budget[1:] if budget.startswith("f") else budget
        try:
            ok = float(number) > 0 and (budget.startswith("f") or float(number).is_integer())
        except ValueError:
            ok = False
        if not ok:
            raise CohortConfigError(f"{where}: budget {budget!r} is neither a positive integer nor a fraction fN")
    return budget


# the labels of events mode, scored whatever the config's token labels
EVENT_LABELS = ("clinical_criteria", "rare_items")


def endpoints_from_config(cfg: dict) -> Endpoints:
    """The ``endpoints`` section of a cohort config as typed records, over the labels a run can score (the
    config's token labels and events mode's).

    Each family is a list of entries ``{protocol, label, budget, baselines, tokens: hourly, metric: retention}``;
    ``label`` and ``baselines`` take one name or a list. An unknown protocol, label, budget, policy, tokens or
    metric is one :class:`CohortConfigError` naming the entry."""
    section = cfg.get("endpoints") or {}
    labels = set(cfg.get("token_labels") or {}) | set(EVENT_LABELS)
    unknown = set(section) - set(FAMILIES) - {"alpha"}
    if unknown:
        raise CohortConfigError(f"endpoints: unknown key(s) {sorted(unknown)}; expected primary, secondary, alpha")
    alpha = float(section.get("alpha", DEFAULT_ALPHA))
    if not 0.0 < alpha < 1.0:
        raise CohortConfigError(f"endpoints.alpha must lie in (0, 1), not {alpha}")
    declared, seen = [], set()
    for family in FAMILIES:
        for i, entry in enumerate(section.get(family) or []):
            where = f"endpoints.{family}[{i}]"
            protocol, tokens = entry.get("protocol"), entry.get("tokens", StreamMode.HOURLY.value)
            metric = entry.get("metric", "retention")
            if protocol not in PROTOCOL_BASELINES:
                raise CohortConfigError(f"{where}: unknown protocol {protocol!r}; one of {sorted(PROTOCOL_BASELINES)}")
            for name, value, allowed in (("tokens", tokens, TOKENS), ("metric", metric, METRICS)):
                if value not in allowed:
                    raise CohortConfigError(f"{where}: unknown {name} {value!r}; one of {list(allowed)}")
            budget = _budget(entry, protocol, where)
            for label in _listed(entry.get("label", [])):
                if label not in labels:
                    raise CohortConfigError(f"{where}: unknown label {label!r}; one of {sorted(labels)}")
                for baseline in _listed(entry.get("baselines", [])):
                    if baseline not in PROTOCOL_BASELINES[protocol]:
                        raise CohortConfigError(f"{where}: unknown baseline {baseline!r} for {protocol}; one of "
                                                f"{list(PROTOCOL_BASELINES[protocol])}")
                    e = Endpoint(family, protocol, tokens, label, budget, baseline, metric)
                    if e.describe() in seen:
                        raise CohortConfigError(f"{where}: {e.describe()} is declared twice")
                    seen.add(e.describe())
                    declared.append(e)
    return Endpoints(tuple(declared), alpha)
