"""A cohort config's token channels as records: which codes measure each, their unit conversions and the
channel's plausible range (read once, when the config is loaded: :class:`cohorts.config.CohortConfig`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import CohortConfigError
from .predicates import PredicateError, code_spec

# name -> (scale, offset): unit = raw * scale + offset
CONVERSIONS = {"fahrenheit_to_celsius": (5.0 / 9.0, -32.0 * 5.0 / 9.0)}


@dataclass(frozen=True)
class Channel:
    """One token channel: the codes that measure it, their conversions and its plausible range."""
    name: str
    codes: tuple  # exact codes and {regex: ...} patterns (cohorts.predicates)
    lo: float
    hi: float
    convert: dict = field(default_factory=dict)   # code -> (scale, offset)


def channels_of(tokens_section: dict) -> tuple[Channel, ...]:
    """The ``tokens.channels`` of a config as records (raises CohortConfigError for a malformed one)."""
    spec = tokens_section or {}
    if not spec.get("channels"):
        raise CohortConfigError("cohort config lacks tokens.channels (needed for hourly tokens)")
    out = []
    for c in spec["channels"]:
        if not c.get("name") or len(c.get("plausible") or ()) != 2:
            raise CohortConfigError(f"token channel {c.get('name')!r} needs name, codes and plausible: [lo, hi]")
        try:
            codes = code_spec(c, f"token channel {c['name']!r}")
        except PredicateError as e:
            raise CohortConfigError(str(e)) from None
        conv = {}
        for code, how in (c.get("convert") or {}).items():
            if isinstance(how, str):
                if how not in CONVERSIONS:
                    raise CohortConfigError(f"token channel {c['name']!r}: unknown conversion {how!r} "
                                            f"(known: {sorted(CONVERSIONS)}, or {{scale, offset}})")
                conv[code] = CONVERSIONS[how]
            else:
                conv[code] = (float(how["scale"]), float(how.get("offset", 0.0)))
        lo, hi = (float(v) for v in c["plausible"])
        out.append(Channel(c["name"], tuple(codes) if isinstance(codes, list) else (codes,), lo, hi, conv))
    return tuple(out)
