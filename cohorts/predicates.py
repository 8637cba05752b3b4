"""Code and value predicates of a cohort config, in ACES's predicate form as well as plain code lists.

Code conventions differ between sources (this product's extraction writes ``CHART//220045``; the MIMIC-IV MEDS
ETL writes ``LAB//220045//bpm``), so a config names codes by one of:

* ``codes: [A, B]`` -- exact codes (the plain form);
* ``code: A`` -- one exact code (ACES);
* ``code: {regex: "^LAB//220045//"}`` -- every code the regular expression matches (ACES; Rust regex syntax,
  searched anywhere in the code, so anchor it);
* ``code: {any: [A, B]}`` -- any of several exact codes (ACES);

and, in a ``codes`` list, an entry may itself be ``{regex: ...}``. Values are bounded, ACES-style, by
``value_min`` / ``value_max`` with ``value_min_inclusive`` / ``value_max_inclusive`` (default inclusive), or by
this product's ``below`` / ``above`` (strict).

ACES itself (es-aces) is not used: it pins polars < 2 and this project runs on polars 2; the predicates it would
evaluate here are a code match and a value range, a few Polars expressions.
"""
from __future__ import annotations

from typing import Any

import polars as pl

from pipeline.errors import InputError

CODE_KEYS = ("codes", "code")


class PredicateError(InputError):
    """A code or value predicate of the cohort config is malformed."""


def _code_terms(spec: Any, where: str) -> list[tuple[str, str]]:
    """A code spec as ('exact' | 'regex', text) terms."""
    if isinstance(spec, str):
        return [("exact", spec)]
    if isinstance(spec, dict):
        if set(spec) == {"regex"} and isinstance(spec["regex"], str):
            return [("regex", spec["regex"])]
        if set(spec) == {"any"} and isinstance(spec["any"], list):
            return [t for s in spec["any"] for t in _code_terms(s, where)]
        raise PredicateError(f"{where}: a code predicate is a code, {{regex: ...}} or {{any: [...]}}, got {spec!r}")
    if isinstance(spec, (list, tuple)) and spec:
        return [t for s in spec for t in _code_terms(s, where)]
    raise PredicateError(f"{where}: no codes given ({spec!r})")


def code_spec(entry: dict, where: str) -> Any:
    """The code predicate of a config entry (its ``codes`` or ``code``), checked."""
    present = [k for k in CODE_KEYS if k in entry]
    if len(present) != 1:
        raise PredicateError(f"{where}: give the codes as exactly one of codes: [...] or code: ...")
    spec = entry[present[0]]
    _code_terms(spec, where)
    return spec


def code_expr(spec: Any, column: str = "code") -> pl.Expr:
    """Boolean expression: the code column matches ``spec``."""
    terms = _code_terms(spec, "code predicate")
    exact = [t for kind, t in terms if kind == "exact"]
    expr = pl.col(column).is_in(exact) if exact else pl.lit(False)
    for kind, text in terms:
        if kind == "regex":
            expr = expr | pl.col(column).str.contains(text)
    return expr


def matching_codes(spec: Any, vocabulary: list[str]) -> list[str]:
    """The codes of ``vocabulary`` that ``spec`` matches, sorted (exact codes absent from it are kept: a source
    may simply lack them)."""
    frame = pl.DataFrame({"code": sorted(set(vocabulary))}, schema={"code": pl.String})
    hits = set(frame.filter(code_expr(spec))["code"].to_list())
    hits |= {t for kind, t in _code_terms(spec, "code predicate") if kind == "exact"}
    return sorted(hits)


def value_expr(entry: dict, column: str = "numeric_value") -> pl.Expr | None:
    """Boolean expression of the entry's value bounds (None when it has none)."""
    v = pl.col(column)
    parts = []
    if "below" in entry:
        parts.append(v < float(entry["below"]))
    if "above" in entry:
        parts.append(v > float(entry["above"]))
    if "value_min" in entry:
        lo = float(entry["value_min"])
        parts.append(v >= lo if entry.get("value_min_inclusive", True) else v > lo)
    if "value_max" in entry:
        hi = float(entry["value_max"])
        parts.append(v <= hi if entry.get("value_max_inclusive", True) else v < hi)
    if not parts:
        return None
    expr = parts[0]
    for p in parts[1:]:
        expr = expr & p
    return expr


def has_value_bounds(entry: dict) -> bool:
    return any(k in entry for k in ("below", "above", "value_min", "value_max"))


def describe_codes(spec: Any) -> str:
    """A code spec in words: its exact codes, and its patterns as 'codes matching /.../'."""
    return ", ".join(text if kind == "exact" else f"codes matching /{text}/"
                     for kind, text in _code_terms(spec, "code predicate"))
