"""What a cohort config reads from a dataset: no run succeeds on nothing.

A config names its vital-sign channels and deterioration criteria by code; a dataset written with other code
conventions (the MIMIC-IV MEDS ETL's ``LAB//220045//bpm`` for this product's ``CHART//220045``) matches none of
them, and a run then scored zero tokens and wrote a report that looked normal. Here each channel must match a
code of the dataset, the run must have tokens and evaluation stays, and a MEDS source without a config gets the
shipped config whose codes it carries.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pathlib import Path

import polars as pl

from .definitions import DEFAULT_CONFIG, load_config
from .errors import EmptyRunError
from .predicates import code_expr, code_spec

if TYPE_CHECKING:
    from .config import CohortConfig

TOP_CODES = 8       # the dataset's most frequent codes shown beside a config that reads nothing


def code_counts(shards: list[Path]) -> pl.DataFrame:
    """(code, count) of MEDS data shards, most frequent first (one pass over the code column)."""
    return (pl.scan_parquet([str(p) for p in shards]).group_by("code").len("count")
            .sort(["count", "code"], descending=[True, False]).collect())


def unread_channels(cfg: CohortConfig, counts: pl.DataFrame) -> list[tuple[str, object]]:
    """(channel, its code predicate) of each token channel that no code of ``counts`` matches."""
    out = []
    for ch in cfg.section("tokens").get("channels") or []:
        spec = code_spec(ch, f"token channel {ch.get('name')!r}")
        if counts.filter(code_expr(spec)).height == 0:
            out.append((ch["name"], spec))
    return out


def top_codes(counts: pl.DataFrame, n: int = TOP_CODES) -> str:
    return ", ".join(f"{c} ({k:,})" for c, k in counts.head(n).iter_rows())


def check_channels_read(cfg: CohortConfig, counts: pl.DataFrame, config_name: str, dataset: str) -> None:
    """EmptyRunError when a token channel of the config matches no code of the dataset, naming the config, what
    it looked for and the dataset's most frequent codes."""
    unread = unread_channels(cfg, counts)
    if unread:
        looked = "; ".join(f"{name}: {spec}" for name, spec in unread)
        hint = suggest_config(counts)
        raise EmptyRunError(f"cohort config {config_name} reads nothing of {dataset}: no code matches its channel(s) "
                            f"{looked}. The dataset's most frequent codes: {top_codes(counts)}"
                            + (f". Its codes follow the conventions of the shipped config {hint!r}: pass --config "
                               f"{hint}" if hint and hint != config_name else ""))


def shipped_configs() -> dict[str, Path]:
    return {p.stem: p for p in sorted(DEFAULT_CONFIG.parent.glob("*.yaml"))}


def suggest_config(counts: pl.DataFrame) -> str | None:
    """The shipped config (``default`` first) every token channel of which matches a code of ``counts``."""
    names = sorted(shipped_configs(), key=lambda n: n != DEFAULT_CONFIG.stem)
    for name in names:
        if not unread_channels(load_config(shipped_configs()[name]), counts):
            return name
    return None


def check_run_has_data(summary: dict, cfg_path: Path | str) -> None:
    """After a run's labels: every channel read, tokens made, stays to evaluate; EmptyRunError otherwise."""
    unread = [c for c, n in summary.get("readings_by_channel", {}).items() if n == 0]
    if unread:
        raise EmptyRunError(f"cohort config {cfg_path}: channel(s) {unread} read no plausible value in any stay of "
                            f"the cohort; check their codes and plausible ranges against the store's codes "
                            f"(store/metadata/codes.parquet)")
    if summary.get("tokens", 0) == 0:
        raise EmptyRunError(f"cohort config {cfg_path}: the cohort's {summary.get('stays', 0)} stays gave no "
                            f"tokens (no channel reading inside any stay)")
    if summary.get("eval_stays", 0) == 0:
        raise EmptyRunError(f"cohort config {cfg_path}: no evaluation stays to score (of {summary.get('stays', 0)} "
                            f"cohort stays; split.eval_fraction and the cohort's criteria decide)")
