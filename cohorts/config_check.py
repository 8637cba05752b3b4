"""The whole cohort config checked when it is loaded: every key known, every number in its range, every name
it refers to defined, each problem one :class:`CohortConfigError` naming the key's path.

A run used to meet most of these only inside its flow (``nu: 0`` as a ZeroDivisionError, a misspelled key as a
bare KeyError, an unknown label after ten tracebacks); here they end before anything starts.
"""
from __future__ import annotations

import difflib
from typing import Any

from .errors import CohortConfigError

# The keys each part of a config may hold ("*": a mapping whose keys are names the user chooses).
CODE_AND_VALUE = {"codes", "code", "below", "above", "value_min", "value_max", "value_min_inclusive",
                  "value_max_inclusive"}
SECTIONS: dict[str, set[str]] = {
    "": {"cohort", "deterioration", "rare_items", "split", "tokens", "token_labels", "protocols", "endpoints",
         "report", "meds_source"},
    "cohort": {"min_age", "min_stay_hours", "death_codes"},
    "deterioration": {"criteria"},
    "deterioration.criteria[]": CODE_AND_VALUE | {"name", "first_event", "sofa_rise", "window_hours", "components",
                                                  "citation"},
    "deterioration.criteria[].components.*": CODE_AND_VALUE | {"lower_is_worse", "cutoffs", "any_event_scores"},
    "rare_items": {"quantile"},
    "split": {"eval_fraction", "salt"},
    "tokens": {"bin_hours", "scaling", "channels"},
    "tokens.channels[]": {"name", "unit", "codes", "code", "plausible", "reference", "convert"},
    "tokens.channels[].reference": {"median", "mean", "sd"},
    "token_labels.*": {"thresholds", "heldout_channel", "from", "citation"},
    "token_labels.*.thresholds.*": {"above", "below"},
    "protocols": {"fixed_context", "streaming"},
    "protocols.fixed_context": {"nu", "sigma", "citation"},
    "protocols.streaming": {"nu", "sigma", "nu_grid", "sigma_grid", "select_budget", "select_label", "min_certified",
                            "select_max_stays", "citation"},
    "report": {"small_cell_threshold"},
    "meds_source": {"admission", "discharge", "birth", "sex"},
}


def _unknown_keys(node: Any, schema_path: str, where: str) -> None:
    """Recursively: every mapping under a known section holds only known keys (with a close match suggested)."""
    if isinstance(node, list) and f"{schema_path}[]" in SECTIONS:
        for i, item in enumerate(node):
            _unknown_keys(item, f"{schema_path}[]", f"{where}[{i}]")
        return
    if not isinstance(node, dict):
        return
    if f"{schema_path}.*" in SECTIONS:
        for name, child in node.items():
            _unknown_keys(child, f"{schema_path}.*", f"{where}.{name}")
        return
    allowed = SECTIONS.get(schema_path)
    if allowed is None:
        return
    for key, child in node.items():
        if key not in allowed:
            close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(sorted(allowed))}"
            raise CohortConfigError(f"{_path(where, key)}: unknown key{hint}")
        _unknown_keys(child, _path(schema_path, key), _path(where, key))


def _path(parent: str, key: str) -> str:
    return f"{parent}.{key}" if parent else str(key)


def _number(section: dict, key: str, where: str, lo: float, hi: float, lo_open: bool = False,
            integer: bool = False, required: bool = True) -> None:
    """``section[key]`` is a finite number in [lo, hi] (or (lo, hi] with ``lo_open``), an integer if asked."""
    if key not in section:
        if required:
            raise CohortConfigError(f"{where}.{key} is missing")
        return
    v = section[key]
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    inside = ok_type and not isinstance(v, bool) and (lo < v if lo_open else lo <= v) and v <= hi
    if not inside:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if hi != float("inf") else \
            f"{'>' if lo_open else '>='} {lo:g}"
        raise CohortConfigError(f"{where}.{key} must be {'an integer' if integer else 'a number'} "
                                f"{'in ' if hi != float('inf') else ''}{rng}, not {v!r}")


def _grid(section: dict, key: str, where: str, hi: float) -> None:
    values = section.get(key)
    if not isinstance(values, list) or not values:
        raise CohortConfigError(f"{where}.{key} must be a non-empty list of numbers, not {values!r}")
    for i, _ in enumerate(values):
        _number({f"{key}[{i}]": values[i]}, f"{key}[{i}]", where, 0.0, hi, lo_open=True)


def check_protocols(cfg: dict) -> None:
    """Kernel widths positive; nu in (0, 1] (C = 1/(nu n) is feasible, sum(alpha) = 1 with alpha <= C, exactly
    when nu <= 1, and nu = 0 has no C); the streaming choice's label a token label."""
    protocols = cfg.get("protocols")
    if not isinstance(protocols, dict):
        raise CohortConfigError("protocols is missing (fixed_context and streaming)")
    inf = float("inf")
    fixed = protocols.get("fixed_context")
    if not isinstance(fixed, dict):
        raise CohortConfigError("protocols.fixed_context is missing (nu, sigma)")
    _number(fixed, "nu", "protocols.fixed_context", 0.0, 1.0, lo_open=True)
    _number(fixed, "sigma", "protocols.fixed_context", 0.0, inf, lo_open=True)
    st = protocols.get("streaming")
    if not isinstance(st, dict):
        raise CohortConfigError("protocols.streaming is missing")
    where = "protocols.streaming"
    if ("nu" in st) != ("sigma" in st):
        raise CohortConfigError(f"{where}: a declared setting needs both nu and sigma (or neither, to choose one "
                                f"from nu_grid and sigma_grid)")
    if "nu" in st:
        _number(st, "nu", where, 0.0, 1.0, lo_open=True)
        _number(st, "sigma", where, 0.0, inf, lo_open=True)
        return
    _grid(st, "nu_grid", where, 1.0)
    _grid(st, "sigma_grid", where, inf)
    _number(st, "select_budget", where, 1, inf, integer=True)
    _number(st, "min_certified", where, 0.0, 1.0)
    _number(st, "select_max_stays", where, 1, inf, integer=True, required=False)
    labels = cfg.get("token_labels") or {}
    if st.get("select_label") not in labels:
        raise CohortConfigError(f"{where}.select_label {st.get('select_label')!r} is not a token label "
                                f"({', '.join(sorted(labels)) or 'token_labels is empty'})")


def check_tokens(cfg: dict) -> None:
    """Bin width, channel plausible ranges and declared references: what the token builder divides by."""
    tokens = cfg.get("tokens") or {}
    inf = float("inf")
    _number(tokens, "bin_hours", "tokens", 0.0, inf, lo_open=True, required=False)
    for i, ch in enumerate(tokens.get("channels") or []):
        where = f"tokens.channels[{i}] ({ch.get('name')!r})"
        plausible = ch.get("plausible")
        if not (isinstance(plausible, list) and len(plausible) == 2 and
                all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in plausible) and
                plausible[0] < plausible[1]):
            raise CohortConfigError(f"{where}.plausible must be [lo, hi] with lo < hi, not {plausible!r}")
        if isinstance(ch.get("reference"), dict):
            _number(ch["reference"], "sd", f"{where}.reference", 0.0, inf, lo_open=True)
            for k in ("median", "mean"):
                _number(ch["reference"], k, f"{where}.reference", -inf, inf)


def check_token_labels(cfg: dict) -> dict:
    """The token labels (``token_labels``): each by thresholds on known channels or from deterioration or rare
    items; a held-out channel must be a channel. Returns them."""
    specs = cfg.get("token_labels") or {}
    if not specs:
        raise CohortConfigError("cohort config lacks token_labels (needed for hourly tokens)")
    names = {c.get("name") for c in (cfg.get("tokens") or {}).get("channels") or []}
    for name, s in specs.items():
        if not isinstance(s, dict):
            raise CohortConfigError(f"token_labels.{name} must be a mapping (thresholds or from), not {s!r}")
        if "thresholds" in s:
            unknown = set(s["thresholds"] or {}) - names
            if unknown or not s["thresholds"]:
                raise CohortConfigError(f"token_labels.{name}.thresholds name unknown channel(s) {sorted(unknown)}; "
                                        f"channels: {sorted(names)}")
        elif s.get("from") not in ("deterioration", "rare_items"):
            raise CohortConfigError(f"token_labels.{name} needs thresholds or from: deterioration | rare_items")
        if s.get("heldout_channel") and s["heldout_channel"] not in names:
            raise CohortConfigError(f"token_labels.{name}.heldout_channel {s['heldout_channel']!r} is not a channel "
                                    f"({', '.join(sorted(names))})")
    return specs


def check_config(cfg: dict) -> None:
    """Everything :func:`cohorts.definitions.load_config` does not check section by section already."""
    for section, key in (("deterioration", "criteria"), ("tokens", "channels")):
        if not isinstance((cfg.get(section) or {}).get(key, []), list):
            raise CohortConfigError(f"{section}.{key} must be a list (entries beginning with '-')")
    _unknown_keys(cfg, "", "")
    for section, key, hi in (("cohort", "min_age", 200), ("cohort", "min_stay_hours", float("inf")),
                             ("rare_items", "quantile", 1.0), ("split", "eval_fraction", 1.0)):
        _number(cfg[section], key, section, 0.0, hi)
    check_tokens(cfg)
    if cfg.get("token_labels") is not None:
        check_token_labels(cfg)
    check_protocols(cfg)
