"""Synthetic tabular data with a known answer and a controllable cost per sample.

Features are standard normal; the target comes from a fixed random linear map plus a little
noise (``task="regression"``) or its argmax (``task="classification"``), so a small MLP can
fit it and a falling loss means the loop really trains.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from .cost import check_cost, spend


class SyntheticTabular(Dataset):
    """Map-style dataset of ``{"x": float32[n_features], "y": ...}``: ``y`` is float32
    ``[n_targets]`` for regression, an int64 class for classification.

    cpu_ms, sleep_ms: per-sample cost (feature engineering, a database read).
    """

    def __init__(self, n: int = 10_000, n_features: int = 32, n_targets: int = 4, seed: int = 0,
                 task: Literal["regression", "classification"] = "regression", noise: float = 0.1,
                 cpu_ms: float = 0.0, sleep_ms: float = 0.0) -> None:
        if n <= 0 or n_features <= 0 or n_targets <= 0:
            raise ValueError("SyntheticTabular needs n > 0, n_features > 0 and n_targets > 0")
        if task not in ("regression", "classification"):
            raise ValueError(f"task must be 'regression' or 'classification', got {task!r}")
        if task == "classification" and n_targets < 2:
            raise ValueError("classification needs n_targets >= 2 (the number of classes)")
        check_cost(cpu_ms, sleep_ms)
        self.n, self.n_features, self.n_targets, self.seed = n, n_features, n_targets, seed
        self.task, self.noise, self.cpu_ms, self.sleep_ms = task, noise, cpu_ms, sleep_ms
        rng = np.random.default_rng((seed, 1))  # class-level draws; samples use (seed, 0, i)
        self.weight = rng.normal(0, 1 / np.sqrt(n_features), size=(n_features, n_targets))  # [F, K]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for {self.n} samples")
        rng = np.random.default_rng((self.seed, 0, i))
        x = rng.standard_normal(self.n_features)  # [F]
        target = x @ self.weight + rng.normal(0, self.noise, size=self.n_targets)  # [K]
        spend(self.cpu_ms, self.sleep_ms)
        if self.task == "classification":
            y = torch.tensor(int(np.argmax(target)), dtype=torch.int64)
        else:
            y = torch.from_numpy(target.astype(np.float32))
        return {"x": torch.from_numpy(x.astype(np.float32)), "y": y}
