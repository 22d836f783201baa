"""The built-in training slice: the tiny transformer on synthetic tokens, on the CPU.

``make demo`` profiles it; notebooks and the tuner build on ``make_training`` and ``train``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .models import TinyConfig, TinyTransformer


@dataclass
class DemoKnobs:
    """The demo's knobs (batch size, loader workers, a slow transform), as the CLI and tuner set them."""
    batch_size: int = 16
    num_workers: int = 0
    cpu_ms: float = 0.0  # busy work per sample in the dataset (a slow transform)
    sleep_ms: float = 0.0  # idle wait per sample (slow storage)
    lr: float = 3e-3
    seed: int = 0
    n_samples: int = 20_000
    config: TinyConfig | None = None


def make_training(knobs: DemoKnobs | None = None, **overrides: Any) -> tuple[torch.nn.Module, Any, torch.optim.Optimizer]:
    """(model, loader, optimizer) for the built-in slice."""
    from ..datasets import SyntheticTokens

    k = knobs or DemoKnobs()
    for key, value in overrides.items():
        if not hasattr(k, key):
            raise TypeError(f"unknown knob {key!r}; knobs are {sorted(DemoKnobs.__dataclass_fields__)}")
        setattr(k, key, value)
    torch.manual_seed(k.seed)
    cfg = k.config or TinyConfig()
    model = TinyTransformer(cfg)
    data = SyntheticTokens(n=k.n_samples, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size, seed=k.seed,
                           cpu_ms=k.cpu_ms, sleep_ms=k.sleep_ms)
    loader = torch.utils.data.DataLoader(data, batch_size=k.batch_size, shuffle=True,
                                         num_workers=k.num_workers, drop_last=True,
                                         generator=torch.Generator().manual_seed(k.seed),
                                         persistent_workers=k.num_workers > 0)
    opt = torch.optim.AdamW(model.parameters(), lr=k.lr, weight_decay=0.01)
    return model, loader, opt


def train(model: torch.nn.Module, loader: Any, opt: torch.optim.Optimizer, epochs: int = 1_000) -> None:
    """An ordinary training loop: tpkit needs nothing added to it."""
    model.train()
    for _ in range(epochs):
        for batch in loader:
            loss = model(batch["x"], batch["y"])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
