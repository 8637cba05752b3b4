"""The learned-key encoder's data: windows of the training stays' labelled events and their numeric features.

The model and its training loop live in :mod:`memory.encoder` and see arrays only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import polars as pl
import torch

from memory.encoder import N_FEATURES
from pipeline.keys import EventKeyer

from .definitions import build_cohort, label_events, stay_events

if TYPE_CHECKING:
    from .config import CohortConfig
    from pathlib import Path

    from memory.encoder import EventEncoder


def event_features(events: pl.DataFrame, keyer: EventKeyer) -> np.ndarray:
    """(n, N_FEATURES) numeric features of labelled events, standardised with the keyer's training statistics."""
    full = keyer.transform(events)
    # EventKeyer's layout: [code embedding | z, has | t, sin, cos]
    return full[:, -N_FEATURES:]


def make_windows(events: pl.DataFrame, keyer: EventKeyer, window: int = 64, stride: int | None = None) -> tuple:
    """Windows of consecutive events per stay: codes (list of lists), features (W, n, F), flags (W, n)."""
    stride = stride or window
    codes, feats, flags = [], [], []
    # A total order (time, code, value): with ties in time left to the sort, windows (and so the trained
    # encoder) differed between runs on the same data.
    order = ["stay_id", "time", "code", "numeric_value"]
    for (_,), g in events.sort(order, nulls_last=True, maintain_order=True).group_by(["stay_id"],
                                                                                    maintain_order=True):
        if g.height < window:
            continue
        f = event_features(g, keyer)
        y = (g["deteriorating"] | g["rare"]).to_numpy()
        c = g["code"].to_list()
        for s in range(0, g.height - window + 1, stride):
            codes.append(c[s:s + window])
            feats.append(f[s:s + window])
            flags.append(y[s:s + window])
    if not codes:
        raise ValueError(f"no stay has {window} events: no training window")
    return codes, np.stack(feats), np.stack(flags).astype(np.float64)


def encode(encoder: EventEncoder, events: pl.DataFrame, keyer: EventKeyer) -> np.ndarray:
    """fp64 learned keys of labelled events (for the exact memory)."""
    with torch.no_grad():
        idx = encoder.code_indices(events["code"].to_list())
        f = torch.as_tensor(event_features(events, keyer), dtype=torch.float32)
        return encoder(idx, f).double().numpy()


def training_windows(store: Path, cfg: CohortConfig, window: int = 64) -> tuple:
    """Windows of the training split's stays, and the keyer fitted on them."""
    cohort = build_cohort(store, cfg)
    events = label_events(stay_events(store, cohort), cohort, cfg)
    train = events.filter(pl.col("stay_id").is_in(cohort.filter(pl.col("split") == "train")["stay_id"].implode()))
    keyer = EventKeyer().fit(train)
    return make_windows(train, keyer, window=window), keyer, events
