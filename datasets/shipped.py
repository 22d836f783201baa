"""Small samples shipped inside the package, and reference runs measured on real GPUs.

    tp.datasets.samples()                  # ['images', 'tabular', 'tokens']
    arrays = tp.datasets.load_sample("tabular")     # {"x": float32[256, 8], "y": float32[256, 2]}
    ds = tp.datasets.sample_dataset("images")       # a map-style Dataset of {"x", "y"} tensors
    tp.datasets.reference_runs()           # names of the GPU runs shipped (empty when none is)
    run = tp.datasets.load_reference_run(name)

Everything is read through ``importlib.resources``, so it works from an installed wheel as
well as from a checkout. ``write_samples()`` rewrites the sample files from the generators
(they are deterministic, so the files only change when a generator does).
"""

from __future__ import annotations

import io
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset

if TYPE_CHECKING:
    from tpkit.run import Run

PACKAGE = "tpkit.datasets"


def _folder(name: str) -> "resources.abc.Traversable":
    return resources.files(PACKAGE) / name


def samples() -> list[str]:
    """Names of the shipped samples."""
    return sorted(f.name[:-4] for f in _folder("samples").iterdir() if f.name.endswith(".npz"))


def load_sample(name: str) -> dict[str, np.ndarray]:
    """The arrays of one shipped sample (a few KB each)."""
    f = _folder("samples") / f"{name}.npz"
    if not f.is_file():
        raise FileNotFoundError(f"no shipped sample {name!r}; samples are {samples()}")
    with np.load(io.BytesIO(f.read_bytes())) as z:
        return {k: z[k] for k in z.files}


class ArrayDataset(Dataset):
    """``{"x": x[i], "y": y[i]}`` over equal-length arrays."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        lengths = {len(a) for a in arrays.values()}
        if len(lengths) != 1:
            raise ValueError(f"arrays of different lengths: { {k: len(a) for k, a in arrays.items()} }")
        self.arrays = {k: torch.from_numpy(np.ascontiguousarray(a)) for k, a in arrays.items()}
        self.n = lengths.pop()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: a[i] for k, a in self.arrays.items()}


def sample_dataset(name: str) -> ArrayDataset:
    """A shipped sample as a map-style Dataset of ``{"x", "y"}`` tensors."""
    return ArrayDataset(load_sample(name))


def reference_runs() -> list[str]:
    """Names of the runs saved under ``reference_runs/`` (each a folder that ``run.save`` wrote,
    measured on a real GPU with the machine named in its meta). Empty when none was measured."""
    root = _folder("reference_runs")
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if d.is_dir() and (d / "meta.json").is_file())


def load_reference_run(name: str) -> "Run":
    """A reference run as a tpkit Run (clocks, power, energy, memory as measured)."""
    from tpkit.run import Run

    if name not in reference_runs():
        raise FileNotFoundError(f"no reference run {name!r}; reference runs are {reference_runs() or 'none yet'}")
    with resources.as_file(_folder("reference_runs") / name) as path:
        return Run.load(path)


# -- writing the shipped samples --------------------------------------------------------------
def make_samples() -> dict[str, dict[str, np.ndarray]]:
    """The shipped samples, made by the generators (deterministic: seed 0)."""
    from .images import SyntheticImages
    from .tabular import SyntheticTabular
    from .tokens import SyntheticTokens

    def stack(ds: Dataset) -> dict[str, np.ndarray]:
        items = [ds[i] for i in range(len(ds))]
        return {k: torch.stack([it[k] for it in items]).numpy() for k in items[0]}

    return {
        "tokens": stack(SyntheticTokens(n=32, seq_len=32, vocab_size=256)),
        "images": stack(SyntheticImages(n=16, size=16, dtype=torch.uint8)),
        "tabular": stack(SyntheticTabular(n=256, n_features=8, n_targets=2)),
    }


def write_samples(folder: str | Path | None = None) -> list[Path]:
    """Write the shipped samples (deterministic) into ``folder`` (default: ``samples/`` beside this file)."""
    folder = Path(folder) if folder is not None else Path(__file__).with_name("samples")
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, arrays in make_samples().items():
        path = folder / f"{name}.npz"
        np.savez_compressed(path, **arrays)
        written.append(path)
    return written

