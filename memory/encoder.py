"""Learned event keys: a small encoder trained so that SV selection keeps the events that matter.

The encoder maps an event (code, standardised value, has-value flag, time features) to a key: a code
embedding and the numeric features pass through a two-layer MLP (the windows and features come from
:mod:`cohorts.encoder_data`: this module sees arrays, never a data frame). Training streams windows of consecutive
events of the training stays through the batched SV solver (``memory.torch_layer.batched_sv_coefficients``)
and maximises the coefficient mass on flagged events (deterioration hours or rare items), i.e. it learns keys
under which those events are support vectors and the routine ones are reserve. Runs on CUDA when present.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .torch_layer import batched_sv_coefficients, rbf_torch

if TYPE_CHECKING:
    import numpy as np

N_FEATURES = 5  # standardised value, has-value, hours/24, sin and cos of the hour of day


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class EventEncoder(torch.nn.Module):
    def __init__(self, codes: list, key_dim: int = 8, code_dim: int = 8, hidden: int = 32):
        super().__init__()
        self.codes = sorted(set(codes))
        self.index = {c: i + 1 for i, c in enumerate(self.codes)}  # 0: a code unseen in training
        self.config = {"key_dim": key_dim, "code_dim": code_dim, "hidden": hidden}
        self.embedding = torch.nn.Embedding(len(self.codes) + 1, code_dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(code_dim + N_FEATURES, hidden), torch.nn.Tanh(),
                                       torch.nn.Linear(hidden, key_dim))

    def code_indices(self, codes: list) -> torch.Tensor:
        return torch.tensor([self.index.get(c, 0) for c in codes], dtype=torch.long)

    def forward(self, code_idx: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([self.embedding(code_idx), features], dim=-1))

    def save(self, path: Path) -> None:
        torch.save({"state": self.state_dict(), "codes": self.codes, "config": self.config}, Path(path))

    @classmethod
    def load(cls, path: Path, map_location: str = "cpu") -> EventEncoder:
        blob = torch.load(Path(path), map_location=map_location, weights_only=True)
        enc = cls(blob["codes"], **blob["config"])
        enc.load_state_dict(blob["state"])
        return enc


def selection_loss(encoder: EventEncoder, code_idx: torch.Tensor, feats: torch.Tensor, flags: torch.Tensor, C: float,
                   gamma: float, iters: int) -> torch.Tensor:
    keys = encoder(code_idx, feats)
    alpha = batched_sv_coefficients(rbf_torch(keys, keys, gamma), C, iters=iters)
    flagged_mass = (alpha * flags).sum(-1)
    best = torch.clamp(flags.sum(-1) * C, max=1.0)  # the most mass a window's flagged events can carry
    has = best > 0
    return (1.0 - flagged_mass[has] / best[has]).mean() if has.any() else alpha.sum() * 0.0


@dataclass(frozen=True)
class EncoderTraining:
    """The training's hyper-parameters: the SV problem's box ``C`` and kernel width ``gamma``, Adam's ``steps``
    and learning rate ``lr``, windows per ``batch``, the batched solver's ``iters`` and the ``seed``."""
    C: float = 1 / 8
    gamma: float = 0.5
    steps: int = 100
    lr: float = 0.03
    batch: int = 32
    iters: int = 30
    seed: int = 0


def train_encoder(codes: list, feats: np.ndarray, flags: np.ndarray, training: EncoderTraining = EncoderTraining(),
                  device: torch.device | None = None, encoder: EventEncoder | None = None) -> tuple:
    """Adam on the selection loss; returns (encoder, loss per step)."""
    device = device or default_device()
    C, gamma, steps, lr, batch, iters, seed = (training.C, training.gamma, training.steps, training.lr,
                                               training.batch, training.iters, training.seed)
    torch.manual_seed(seed)
    encoder = (encoder or EventEncoder([c for w in codes for c in w])).to(device)
    idx = torch.stack([encoder.code_indices(w) for w in codes]).to(device)
    X = torch.as_tensor(feats, dtype=torch.float32, device=device)
    Y = torch.as_tensor(flags, dtype=torch.float32, device=device)
    opt = torch.optim.Adam(encoder.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    history = []
    for _ in range(steps):
        pick = torch.randint(0, len(idx), (min(batch, len(idx)),), generator=gen).to(device)
        loss = selection_loss(encoder, idx[pick], X[pick], Y[pick], C, gamma, iters)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(float(loss.detach()))
    return encoder.cpu(), history


def evaluate_loss(encoder: EventEncoder, codes: list, feats: np.ndarray, flags: np.ndarray, C: float = 1 / 8,
                  gamma: float = 0.5, iters: int = 30) -> float:
    with torch.no_grad():
        idx = torch.stack([encoder.code_indices(w) for w in codes])
        return float(selection_loss(encoder, idx, torch.as_tensor(feats, dtype=torch.float32),
                                    torch.as_tensor(flags, dtype=torch.float32), C, gamma, iters))
