"""The statistics of a run as typed rows: a policy's mean at a budget (:class:`SummaryRow`) and SV minus a baseline
on the same stays (:class:`PairedRow`), each at a :class:`Budget`. Reports, the CLI and deletion read them by
attribute; JSON (report.json, the statistics cache) holds them as :meth:`as_json` writes them."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .stream_mode import StreamMode


@dataclass(frozen=True)
class Budget:
    """How many tokens a policy keeps: ``k`` (the fixed-context support size |S u E| of each stay's exact solve),
    a fixed number of tokens, or a fraction of each stream. Written as "k", "32" and "f0.1" (the per-stay
    results' ``budget`` column)."""
    kind: str                 # "support", "tokens" or "fraction"
    value: float | None = None

    KINDS = ("support", "tokens", "fraction")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"budget kind must be one of {self.KINDS}, got {self.kind!r}")

    @classmethod
    def parse(cls, text: str | int) -> Budget:
        text = str(text)
        if text == "k":
            return cls("support")
        if text.startswith("f"):
            return cls("fraction", float(text[1:]))
        return cls("tokens", int(text))

    @property
    def is_fixed(self) -> bool:
        return self.kind == "tokens"

    @property
    def is_fraction(self) -> bool:
        return self.kind == "fraction"

    @property
    def axis_value(self) -> float:
        """Its place on a chart's budget axis (tokens, or the fraction)."""
        return float(self.value) if self.value is not None else float("nan")

    def __str__(self) -> str:
        if self.kind == "support":
            return "k"
        return f"f{self.value:g}" if self.kind == "fraction" else str(int(self.value))


SUPPORT = Budget("support")


@dataclass(frozen=True)
class _Row:
    protocol: str            # "fixed_context" or "streaming"
    tokens: StreamMode
    keys: str                # the key set the policies read (a channel set, event keys, learned keys)
    label: str               # the token label retained ("none": a label-free metric)
    budget: Budget
    metric: str

    def __post_init__(self):
        object.__setattr__(self, "tokens", StreamMode(self.tokens))
        if not isinstance(self.budget, Budget):
            object.__setattr__(self, "budget", Budget.parse(self.budget))

    @property
    def group(self) -> tuple:
        """Where the row sits in the report: protocol, stream, key set, label."""
        return self.protocol, self.tokens, self.keys, self.label

    def as_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["tokens"], out["budget"] = self.tokens.value, str(self.budget)
        return out

    @classmethod
    def from_json(cls, row: dict):
        return cls(**row)


@dataclass(frozen=True)
class SummaryRow(_Row):
    """One policy's per-stay metric over the evaluation stays: mean, 95% bootstrap interval, stays (``n``; a
    string such as "<11" once small counts are hidden for a shared report)."""
    policy: str = ""
    mean: float = float("nan")
    ci_low: float = float("nan")
    ci_high: float = float("nan")
    n: int | str = 0


@dataclass(frozen=True)
class PairedRow(_Row):
    """SV minus ``baseline`` on the same stays: mean difference, its interval, the sign-flip p (``p_value``) and
    the Wilcoxon p beside it, the declared ``family`` and the Holm-adjusted p within it (None: exploratory)."""
    baseline: str = ""
    mean_diff: float = float("nan")
    ci_low: float = float("nan")
    ci_high: float = float("nan")
    p_value: float = 1.0
    p_wilcoxon: float = 1.0
    n: int | str = 0
    family: str = "exploratory"
    p_holm: float | None = None
