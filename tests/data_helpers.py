"""Datasets and checks shared by the tpkit.data tests."""

from __future__ import annotations

import glob
import os
from typing import NamedTuple

import numpy as np
import psutil
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from tpkit.data.slots import SHM_DIR


class Pair(NamedTuple):
    a: torch.Tensor
    b: int


class Mixed(Dataset):
    """Every kind of leaf default_collate handles: tensors, arrays, ints, floats, strings,
    dicts, tuples, namedtuples."""

    def __init__(self, n: int = 37) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.arange(6, dtype=torch.float32).reshape(2, 3) + i,
                "arr": np.full(4, i, dtype=np.int16),
                "i": i, "f": i / 2, "name": f"s{i}",
                "t": (torch.tensor([i, -i]), i % 3),
                "p": Pair(torch.tensor(i, dtype=torch.bfloat16), i)}


class Shards(IterableDataset):
    """Yields 0..n-1 split between workers by get_worker_info (as users shard)."""

    def __init__(self, n: int = 23) -> None:
        self.n = n

    def __iter__(self):
        wi = get_worker_info()
        k, m = (wi.id, wi.num_workers) if wi else (0, 1)
        for i in range(k, self.n, m):
            yield {"i": torch.tensor(i), "v": torch.full((3,), float(i))}


class RandomAug(Dataset):
    """A sample plus torch-RNG noise: equal batches need equal worker seeding."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)]) + torch.rand(1)


def as_lists(batches: list) -> list:
    """Comparable plain-Python form of batches (tensor values, dtypes and types kept)."""
    def conv(x):
        if isinstance(x, torch.Tensor):
            return ("T", str(x.dtype), tuple(x.shape), x.float().tolist())
        if isinstance(x, np.ndarray):
            return ("A", str(x.dtype), x.tolist())
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, [conv(v) for v in x])
        return x
    return [conv(b) for b in batches]


def shm_files() -> list[str]:
    return glob.glob(os.path.join(SHM_DIR, f"tpk-{os.getpid()}-*"))


def _is_mp_helper(p: psutil.Process) -> bool:
    """multiprocessing's own resource tracker / forkserver (started once per process by
    spawn or forkserver contexts; not a loader worker)."""
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return "resource_tracker" in cmd or "forkserver" in cmd


def live_children() -> list:
    return [p for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and not _is_mp_helper(p)]
