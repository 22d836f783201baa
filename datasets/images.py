"""Synthetic labelled images with a controllable cost per sample.

Each image is a deterministic function of (seed, index): a smooth blob whose position and
colour depend on its class, plus noise, so a small CNN can learn the labels. The cost knobs
stand in for JPEG decoding and augmentation (``cpu_ms``) and a slow disk (``sleep_ms``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from .cost import check_cost, spend


class SyntheticImages(Dataset):
    """Map-style dataset of ``{"x": Tensor[C, size, size], "y": int64 label}``.

    size: side in pixels (bytes per sample = channels * size * size, times 4 for float32).
    dtype: ``torch.uint8`` (as decoded from disk) or ``torch.float32`` (normalised to [0, 1]).
    cpu_ms, sleep_ms: per-sample cost (see ``tpkit.datasets.cost``).
    """

    def __init__(self, n: int = 10_000, size: int = 32, channels: int = 3, n_classes: int = 10, seed: int = 0,
                 cpu_ms: float = 0.0, sleep_ms: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        if n <= 0 or size <= 0 or channels <= 0 or n_classes <= 1:
            raise ValueError("SyntheticImages needs n > 0, size > 0, channels > 0 and n_classes > 1")
        if dtype not in (torch.uint8, torch.float32):
            raise ValueError(f"dtype must be torch.uint8 or torch.float32, got {dtype}")
        check_cost(cpu_ms, sleep_ms)
        self.n, self.size, self.channels, self.n_classes, self.seed = n, size, channels, n_classes, seed
        self.cpu_ms, self.sleep_ms, self.dtype = cpu_ms, sleep_ms, dtype
        # One colour and one centre per class, drawn once from the seed.
        rng = np.random.default_rng((seed, 1))  # class-level draws; samples use (seed, 0, i)
        self.colours = rng.uniform(0.2, 1.0, size=(n_classes, channels))
        self.centres = rng.uniform(0.25, 0.75, size=(n_classes, 2)) * size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for {self.n} samples")
        rng = np.random.default_rng((self.seed, 0, i))
        label = int(rng.integers(0, self.n_classes))
        cy, cx = self.centres[label] + rng.normal(0, self.size / 16, size=2)
        yy, xx = np.mgrid[0:self.size, 0:self.size]
        blob = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * (self.size / 6) ** 2))  # [S, S]
        img = self.colours[label][:, None, None] * blob + rng.normal(0, 0.1, size=(self.channels, self.size, self.size))
        img = np.clip(img, 0.0, 1.0)  # [C, S, S] in [0, 1]
        spend(self.cpu_ms, self.sleep_ms)
        if self.dtype == torch.uint8:
            x = torch.from_numpy((img * 255).astype(np.uint8))
        else:
            x = torch.from_numpy(img.astype(np.float32))
        return {"x": x, "y": torch.tensor(label, dtype=torch.int64)}
