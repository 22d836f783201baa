"""Synthetic data with a controllable cost per sample, small shipped samples and reference
runs measured on real GPUs. Installed as ``tpkit.datasets``.

    SyntheticTokens / SyntheticImages / SyntheticTabular(n, ..., seed, cpu_ms=, sleep_ms=)
    samples(), load_sample(name), sample_dataset(name)
    reference_runs(), load_reference_run(name)
"""

from .cost import burn_cpu, spend
from .images import SyntheticImages
from .loader_workloads import Images, NumpyWork, TinySamples
from .shipped import ArrayDataset, load_reference_run, load_sample, reference_runs, sample_dataset, samples
from .tabular import SyntheticTabular
from .tokens import SyntheticTokens

__all__ = ["SyntheticTokens", "burn_cpu", "TinySamples", "NumpyWork", "Images",
           "SyntheticImages", "SyntheticTabular", "spend", "ArrayDataset", "samples", "load_sample",
           "sample_dataset", "reference_runs", "load_reference_run"]
