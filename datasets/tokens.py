"""Synthetic token streams for the built-in model, with a controllable cost per sample.

Samples are a deterministic function of (seed, index), so two loaders (or two runs) see the
same data; the "language" is a noisy periodic pattern, so a model can actually learn it and
its loss falls.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from .cost import burn_cpu, check_cost, spend


class SyntheticTokens(Dataset):
    """Map-style dataset of ``{"x": LongTensor[T], "y": LongTensor[T]}`` (y is x shifted by one).

    cpu_ms: busy numpy work per sample (a transform that holds the CPU).
    sleep_ms: idle wait per sample (IO latency: a disk or network read).
    """

    def __init__(self, n: int = 10_000, seq_len: int = 64, vocab_size: int = 512, seed: int = 0,
                 cpu_ms: float = 0.0, sleep_ms: float = 0.0) -> None:
        if n <= 0 or seq_len <= 0 or vocab_size <= 1:
            raise ValueError("SyntheticTokens needs n > 0, seq_len > 0 and vocab_size > 1")
        check_cost(cpu_ms, sleep_ms)
        self.n, self.seq_len, self.vocab_size, self.seed = n, seq_len, vocab_size, seed
        self.cpu_ms, self.sleep_ms = cpu_ms, sleep_ms

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for {self.n} samples")
        rng = np.random.default_rng((self.seed, i))
        period = int(rng.integers(2, 9))
        base = rng.integers(0, self.vocab_size, size=period)
        seq = np.resize(base, self.seq_len + 1)
        noise = rng.random(self.seq_len + 1) < 0.1
        seq[noise] = rng.integers(0, self.vocab_size, size=int(noise.sum()))
        spend(self.cpu_ms, self.sleep_ms)
        t = torch.from_numpy(seq.astype(np.int64))
        return {"x": t[:-1], "y": t[1:]}


__all__ = ["SyntheticTokens", "burn_cpu"]  # burn_cpu lives in .cost; kept importable from here
