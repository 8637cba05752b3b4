"""Cohort, deterioration hours, rare items and the subject-level split, from a declarative YAML config."""
from __future__ import annotations

import hashlib
from pathlib import Path

import meds
import polars as pl
import yaml

from pipeline.store_reader import scan_events
from pipeline.meds import stays_path

from .config import DEFAULT_SMALL_CELL_THRESHOLD, CohortConfig
from .config_check import check_config
from .endpoints import endpoints_from_config
from .errors import CohortConfigError
from .predicates import PredicateError, code_expr, code_spec, has_value_bounds, value_expr
from .stay_chunks import in_windows

DEFAULT_CONFIG = Path(__file__).parent / "config" / "default.yaml"


def load_config(path: Path | None = None) -> CohortConfig:
    """The cohort config at ``path`` (default: the shipped default), checked whole and typed, or one
    :class:`CohortConfigError` naming the file and the problem."""
    where = Path(path or DEFAULT_CONFIG)
    try:
        cfg = yaml.safe_load(where.read_text())
    except OSError as e:
        raise CohortConfigError(f"cohort config {where} cannot be read: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise CohortConfigError(f"cohort config {where} is not valid YAML{at}: "
                                f"{getattr(e, 'problem', None) or e}") from None
    if not isinstance(cfg, dict):
        raise CohortConfigError(f"cohort config {where} is not a YAML mapping of sections")
    try:
        _check_sections(cfg)
    except CohortConfigError as e:
        # every problem names the file it is in (a run's config is WS/config.yaml, copied from --config)
        raise CohortConfigError(str(e) if str(e).startswith("cohort config ") else f"cohort config {where}: {e}") \
            from None
    except (TypeError, AttributeError, KeyError) as e:     # a section of the wrong shape (a list for a mapping...)
        raise CohortConfigError(f"cohort config {where}: a section has the wrong shape ({type(e).__name__}: {e}); "
                                f"compare it with the shipped {DEFAULT_CONFIG.name}") from None
    return CohortConfig.from_raw(cfg, where)


def _check_sections(cfg: dict) -> None:
    for section, keys in (("cohort", ("min_age", "min_stay_hours")), ("deterioration", ("criteria",)),
                          ("rare_items", ("quantile",)), ("split", ("eval_fraction", "salt"))):
        for k in keys:
            if k not in (cfg.get(section) or {}):
                raise CohortConfigError(f"lacks {section}.{k}")
    check_config(cfg)
    for c in cfg["deterioration"]["criteria"]:
        where = f"criterion {c.get('name')!r}"
        rules = [k for k in ("first_event", "sofa_rise") if k in c] + (["value bounds"] if has_value_bounds(c) else [])
        if len(rules) != 1:
            raise CohortConfigError(f"{where} needs exactly one rule: value bounds (below/above or value_min/"
                                    f"value_max), first_event or sofa_rise")
        _checked_codes(c, where)
        if "sofa_rise" in c:
            if not (c.get("components") and c.get("window_hours")):
                raise CohortConfigError(f"{where} (sofa_rise) needs components and window_hours")
            for name, comp in c["components"].items():
                _checked_codes(comp, f"{where}, component {name!r}")
    _checked_codes({"codes": cfg["cohort"].get("death_codes", [meds.death_code])}, "cohort.death_codes")
    endpoints_from_config(cfg)
    _check_small_cell_threshold(cfg)


def _check_small_cell_threshold(cfg: dict) -> None:
    """The smallest count of people a shared report shows (``report.small_cell_threshold``): a positive integer."""
    t = (cfg.get("report") or {}).get("small_cell_threshold", DEFAULT_SMALL_CELL_THRESHOLD)
    if not isinstance(t, int) or isinstance(t, bool) or t < 1:
        raise CohortConfigError(f"report.small_cell_threshold must be a positive integer, not {t!r}")
    return t


def _checked_codes(entry: dict, where: str) -> None:
    try:
        code_spec(entry, where)
    except PredicateError as e:
        raise CohortConfigError(str(e)) from None


WORKSPACE_CONFIG = "config.yaml"


def resolve_config(name_or_path: str | None) -> Path:
    """A shipped config by name (``cohorts/config/NAME.yaml``) or a YAML path; None: the default."""
    if name_or_path is None:
        return DEFAULT_CONFIG
    shipped = DEFAULT_CONFIG.parent / f"{name_or_path}.yaml"
    path = shipped if shipped.exists() else Path(name_or_path)
    if not path.is_file():
        names = sorted(p.stem for p in DEFAULT_CONFIG.parent.glob("*.yaml"))
        raise CohortConfigError(f"cohort config {name_or_path!r} is neither a shipped config ({', '.join(names)}) "
                                f"nor a YAML file")
    return path


def install_config(root: Path, name_or_path: str | None) -> CohortConfig:
    """Validate a cohort config and make it the workspace's (``WS/config.yaml``), which every later step of
    the workspace reads (runs, deletions); without one the workspace keeps the config it has. Returns the
    workspace's config as installed."""
    target = Path(root) / WORKSPACE_CONFIG
    if name_or_path is not None or not target.exists():
        path = resolve_config(name_or_path)
        load_config(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    return load_config(target)


def workspace_config_path(root: Path) -> Path:
    """The file of the workspace's cohort config (the shipped default when the workspace has none yet)."""
    path = Path(root) / WORKSPACE_CONFIG
    return path if path.exists() else DEFAULT_CONFIG


def workspace_config(root: Path) -> CohortConfig:
    """The workspace's cohort config (the default when the workspace has none yet)."""
    return load_config(workspace_config_path(root))


def is_eval_subject(subject_id: int, cfg: CohortConfig) -> bool:
    """Stable subject-level split: a keyed hash of the subject id, never Python's salted hash()."""
    h = hashlib.sha256(f"{cfg.split.salt}:{int(subject_id)}".encode()).digest()
    return int.from_bytes(h[:8], "big") % 10_000 < cfg.split.eval_fraction * 10_000


def build_cohort(store: Path, cfg: CohortConfig) -> pl.DataFrame:
    """ICU stays of adults lasting at least ``min_stay_hours``, with their split."""
    stays = pl.read_parquet(stays_path(store))
    hours = (pl.col("outtime") - pl.col("intime")).dt.total_seconds() / 3600.0
    stays = stays.with_columns(hours.alias("stay_hours")).filter(
        (pl.col("anchor_age") >= cfg.cohort.min_age) & (pl.col("stay_hours") >= cfg.cohort.min_stay_hours))
    split = [("eval" if is_eval_subject(s, cfg) else "train") for s in stays["subject_id"]]
    return stays.with_columns(pl.Series("split", split, dtype=pl.String)).sort("stay_id")


def stay_events(store: Path, cohort: pl.DataFrame) -> pl.DataFrame:
    """Every event inside each cohort stay's window, in time order, with its hour of stay (the whole cohort at
    once: for small stores and one subject's rows; a run reads :func:`cohorts.stay_chunks.chunk_events`).

    Events carrying the stay's id are kept as they are; hospital-level events without one (deaths, transfers)
    are attached to the stay whose window contains them.
    """
    ev = scan_events(store).filter(pl.col("subject_id").is_in(cohort["subject_id"].implode()))
    return in_windows(ev, cohort).sort(["stay_id", "time", "code", "event_hash", "occurrence"]).collect()


def deterioration_hours(events: pl.DataFrame, cfg: CohortConfig) -> pl.DataFrame:
    """(stay_id, hour, criterion) rows: the hours in which each criterion fires."""
    frames = []
    for c in cfg.section("deterioration")["criteria"]:
        sel = events.filter(code_expr(code_spec(c, c["name"])))
        if has_value_bounds(c):
            sel = sel.filter(value_expr(c))
        elif "sofa_rise" in c:
            sel = _sofa_rise_hours(events, c)
        else:
            sel = sel.sort("time").group_by("stay_id").first()
        frames.append(sel.select("stay_id", "hour", pl.lit(c["name"]).alias("criterion")))
    return pl.concat(frames).unique().sort(["stay_id", "hour", "criterion"])


def _component_points(values, comp):
    """SOFA points of each value for one component (0..len(cutoffs)), from its ordered cutoffs."""
    if "any_event_scores" in comp:
        return pl.lit(comp["any_event_scores"], dtype=pl.Int64)
    cut = comp["cutoffs"]
    points = pl.lit(0, dtype=pl.Int64)
    for k, thr in enumerate(cut, start=1):
        worse = values < thr if comp.get("lower_is_worse") else values >= thr
        points = pl.when(worse).then(pl.lit(k, dtype=pl.Int64)).otherwise(points)
    return points


def hourly_sofa(events: pl.DataFrame, c: dict) -> pl.DataFrame:
    """(stay_id, hour, sofa): each component's worst points over the trailing window, summed, on every hour
    from the stay's first to its last event."""
    w = int(c["window_hours"])
    parts = []
    for name, comp in c["components"].items():
        sel = events.filter(code_expr(code_spec(comp, name)))
        if "any_event_scores" not in comp:
            sel = sel.filter(pl.col("numeric_value").is_not_null())
        parts.append(sel.select("stay_id", "hour", _component_points(pl.col("numeric_value"), comp)
                                .alias("points"), pl.lit(name).alias("component")))
    pts = pl.concat(parts).group_by("stay_id", "hour", "component").agg(pl.col("points").max())
    grid = (events.group_by("stay_id").agg(pl.int_ranges(pl.col("hour").min(), pl.col("hour").max() + 1)
                                           .alias("hour")).explode("hour"))
    comps = pl.DataFrame({"component": list(c["components"])})
    full = (grid.join(comps, how="cross").join(pts, on=["stay_id", "hour", "component"], how="left")
            .with_columns(pl.col("points").fill_null(0)).sort("stay_id", "component", "hour"))
    full = full.with_columns(pl.col("points").rolling_max(window_size=w, min_samples=1)
                             .over("stay_id", "component").alias("worst"))
    return full.group_by("stay_id", "hour").agg(pl.col("worst").sum().alias("sofa")).sort("stay_id", "hour")


def _sofa_rise_hours(events, c):
    w = int(c["window_hours"])
    sofa = hourly_sofa(events, c)
    baseline = pl.col("sofa").shift(1).rolling_min(window_size=w, min_samples=1).over("stay_id")
    risen = (pl.col("sofa") - pl.col("baseline")) >= c["sofa_rise"]
    # only the onset hour of each rise: the score stays high for a window after it, which is not new news
    return (sofa.with_columns(baseline.alias("baseline")).with_columns(risen.alias("risen"))
            .filter(pl.col("risen") & ~pl.col("risen").shift(1).over("stay_id").fill_null(False)))


def rare_codes(events: pl.DataFrame, cohort: pl.DataFrame, cfg: CohortConfig) -> tuple:
    """Codes rare in the training split: count <= the configured quantile of per-code counts."""
    train = cohort.filter(pl.col("split") == "train")["stay_id"]
    counts = events.filter(pl.col("stay_id").is_in(train.implode())).group_by("code").len()
    return rare_from_counts(counts, set(events["code"].unique()), cfg)


def rare_from_counts(train_counts: pl.DataFrame, codes: set, cfg: CohortConfig) -> tuple:
    """(rare codes, threshold) from the training split's per-code event counts (code, len) and every code of
    the cohort's stays: the codes at or below the configured quantile of the counts, and the codes never seen
    in training."""
    if train_counts.height == 0:
        return set(), 0.0
    threshold = float(train_counts["len"].quantile(cfg.rare_quantile, interpolation="lower"))
    rare = set(train_counts.filter(pl.col("len") <= threshold)["code"])
    unseen = set(codes) - set(train_counts["code"])
    return rare | unseen, threshold


def label_events(events: pl.DataFrame, cohort: pl.DataFrame, cfg: CohortConfig) -> pl.DataFrame:
    """Events with their ``deteriorating`` (the flag of their hour) and ``rare`` flags."""
    hours = deterioration_hours(events, cfg).select("stay_id", "hour").unique().with_columns(
        pl.lit(True).alias("deteriorating"))
    rare, _ = rare_codes(events, cohort, cfg)
    return (events.join(hours, on=["stay_id", "hour"], how="left")
            .with_columns(pl.col("deteriorating").fill_null(False),
                          pl.col("code").is_in(list(rare)).alias("rare")))
