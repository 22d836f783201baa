"""The three loader benchmark workloads, as map-style datasets (deterministic per index).

- ``TinySamples``: overhead-bound: an 8-float tensor and an int per sample, almost no work.
  Measures what a loader costs per batch.
- ``NumpyWork``: ``cpu_ms`` of single-threaded numpy per sample (``burn_cpu``: a fixed number
  of iterations calibrated to take ``cpu_ms`` on an idle core, so a loader that shares a core
  between threads pays for it in time), returning a small float tensor. Measures how well
  workers are kept busy.
- ``Images``: 3x224x224 uint8 images with a light transform (random crop after padding,
  horizontal flip). Measures moving large batches between processes.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from . import cost


class TinySamples(Dataset):
    """``(FloatTensor[8], int)`` per index."""

    def __init__(self, n: int = 100_000) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((8,), float(i)), i % 10


class NumpyWork(Dataset):
    """``{"x": FloatTensor[16], "y": int}`` after ``cpu_ms`` of numpy work (fixed, calibrated)."""

    def __init__(self, n: int = 10_000, cpu_ms: float = 1.0) -> None:
        cost.check_cost(cpu_ms, 0.0)
        self.n, self.cpu_ms = n, cpu_ms

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        cost.burn_cpu(self.cpu_ms / 1e3)
        x = np.sin(np.arange(16, dtype=np.float32) + i)
        return {"x": torch.from_numpy(x), "y": i % 1000}


class Images(Dataset):
    """``(uint8[3, size, size], label)``: a stored image, padded by 8, randomly cropped back to
    ``size`` and flipped with probability 1/2 (the randomness is seeded by index)."""

    def __init__(self, n: int = 2_000, size: int = 224, n_distinct: int = 16) -> None:
        self.n, self.size = n, size
        rng = np.random.default_rng(0)
        # A few distinct source images, reused: generating 150 KB of noise per sample would
        # make this a random-number benchmark.
        self.sources = rng.integers(0, 256, size=(n_distinct, 3, size + 16, size + 16), dtype=np.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(i)
        dy, dx = (int(v) for v in rng.integers(0, 17, size=2))
        img = self.sources[i % len(self.sources), :, dy: dy + self.size, dx: dx + self.size]
        if rng.random() < 0.5:
            img = img[:, :, ::-1]
        return torch.from_numpy(np.ascontiguousarray(img)), i % 1000
