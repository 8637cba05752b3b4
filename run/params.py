"""A run's parameters as one typed value, saved with the workspace (``WS/run.json``).

Every default lives here. The CLI, the scheduled flow, the deployment and a replay deletion take the
parameters they were not given from the workspace's last run, else from these defaults
(:meth:`RunParams.resolve`), so a rerun or a recomputation repeats the run the workspace holds. Standard library
only: the CLI reads the defaults before it imports anything heavy.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from cohorts.stream_mode import StreamMode
from pipeline.errors import InputError

DEFAULT_CRON = "0 2 * * *"          # the deployment's nightly schedule (prefect.yaml says the same; a test checks)
STAY_MEMORY_BUDGET = 64             # per-stay SV memories are persisted at this budget when the run has it
TASK_RUNNERS = ("process", "thread", "dask")
# DuckDB's memory sizes ("4GB", "512 MiB", "4 gigabytes") and a share of the machine's memory ("80%")
_MEMORY = re.compile(r"\s*(\d+(?:\.\d*)?)\s*(%|[kmgt]i?b?|(?:kilo|mega|giga|tera)bytes?)\s*", re.IGNORECASE)
_UNIT_BYTES = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
MIN_MEMORY_LIMIT = 64 * 2**20      # below it DuckDB cannot hold one source file's read buffers


class RunParamsError(InputError):
    """A run parameter out of its range: the same one-line refusal from the CLI, ``WS/run.json`` and a
    deployment's parameters, before anything is written."""


def check_memory_limit(text: str) -> str:
    """``text`` when DuckDB takes it as the extraction's memory limit, else RunParamsError."""
    m = _MEMORY.fullmatch(str(text))
    amount = float(m.group(1)) if m else 0.0
    unit = m.group(2).lower() if m else ""
    too_small = amount <= 0 or (unit == "%" and amount > 100) or (
        unit != "%" and amount * _UNIT_BYTES[unit[0]] < MIN_MEMORY_LIMIT)
    if m is None or too_small:
        raise RunParamsError(f"memory limit {text!r} is not a size DuckDB can run in: give e.g. 4GB, 512MiB or 50% "
                             f"(at least {MIN_MEMORY_LIMIT // 2**20} MiB)")
    return str(text)


def _at_least(name: str, value, low) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < low):
        raise RunParamsError(f"{name} must be {'a whole number' if isinstance(low, int) else 'a number'} of at "
                             f"least {low}, got {value!r}")


@dataclass(frozen=True)
class RunParams:
    """What a scheduled run does, besides the cohort config (``WS/config.yaml``) and the data.

    ``budgets``: fixed memory budgets; ``fractions``: budgets as fractions of each stream (capped at the largest
    fixed budget); ``tokens``: the stream mode; ``max_events``: the first N events of each stay (events mode);
    ``cohort_budget``: the cohort memory's budget; ``encoder_steps``: learned-key encoder training steps (events
    mode; 0: none); ``source``: the data (None: the embedded generator); ``memory_limit``: DuckDB's limit of the
    extraction (None: the extraction's default); ``task_runner``/``workers``: where per-stay scoring runs;
    ``lock_wait_seconds``: how long a run waits for a deletion holding the workspace; ``chunk_stays``: stays the
    token phases read at a time (their memory grows with it).
    """
    budgets: tuple[int, ...] = (8, 16, 32, 64, 128, 256)
    fractions: tuple[float, ...] = (0.05, 0.1, 0.2)
    tokens: StreamMode = StreamMode.HOURLY
    max_events: int | None = None
    cohort_budget: int = 128
    encoder_steps: int = 100
    source: str | None = None
    memory_limit: str | None = None     # None: pipeline.extract.DEFAULT_MEMORY_LIMIT
    task_runner: str = "process"
    workers: int | None = None
    lock_wait_seconds: float = 600.0
    chunk_stays: int = 256

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "budgets", tuple(int(b) for b in self.budgets))
        set_(self, "fractions", tuple(float(f) for f in self.fractions))
        set_(self, "tokens", StreamMode(self.tokens))
        if not self.budgets or any(b < 1 for b in self.budgets):
            raise RunParamsError(f"budgets must be positive integers, at least one, got {list(self.budgets)}")
        if any(not 0.0 < f <= 1.0 for f in self.fractions):
            raise RunParamsError(f"fractions must lie in (0, 1], got {list(self.fractions)}")
        if self.task_runner not in TASK_RUNNERS:
            raise RunParamsError(f"task runner must be one of {TASK_RUNNERS}, got {self.task_runner!r}")
        for name, low in (("max_events", 1), ("cohort_budget", 1), ("encoder_steps", 0), ("workers", 1),
                          ("chunk_stays", 1), ("lock_wait_seconds", 0.0)):
            _at_least(name.replace("_", " "), getattr(self, name), low)
        if self.memory_limit is not None:
            check_memory_limit(self.memory_limit)
        if self.source is not None:
            set_(self, "source", str(self.source))

    @property
    def memory_budget(self) -> int:
        """The budget whose per-stay SV memory a run persists (:data:`STAY_MEMORY_BUDGET` when the run has it)."""
        return STAY_MEMORY_BUDGET if STAY_MEMORY_BUDGET in self.budgets else max(self.budgets)

    @property
    def fraction_cap(self) -> int:
        return max(self.budgets)

    def as_json(self) -> dict:
        out = asdict(self)
        out["tokens"] = self.tokens.value
        out["budgets"], out["fractions"] = list(self.budgets), list(self.fractions)
        return out

    def save(self, path: Path) -> None:
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(self.as_json(), indent=1))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> RunParams | None:
        """The parameters saved at ``path``, or None when there are none (a workspace before its first run);
        keys this release does not know are refused, as the cohort config's are."""
        path = Path(path)
        if not path.exists():
            return None
        try:
            saved = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise RunParamsError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); remove it to use the "
                             f"defaults") from None
        if not isinstance(saved, dict):
            raise RunParamsError(f"{path}: not an object of run parameters; remove it to use the defaults")
        unknown = sorted(set(saved) - {f.name for f in fields(cls)})
        if unknown:
            raise RunParamsError(f"{path}: unknown run parameter(s) {unknown}; remove them to use the defaults")
        try:
            return cls(**saved)
        except (TypeError, ValueError) as e:
            raise RunParamsError(f"{path}: {e}; correct or remove it (a run given the option anew replaces "
                                 f"it)") from None

    @classmethod
    def resolve(cls, saved: RunParams | None = None, **given) -> RunParams:
        """The parameters of a run: each given one (None: not given), else the workspace's last run's
        (``saved``), else the default."""
        base = saved if saved is not None else cls()
        return replace(base, **{k: v for k, v in given.items() if v is not None})
