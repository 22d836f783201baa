"""Synthetic data with a controllable cost per sample, small shipped samples and reference
runs measured on real GPUs. Installed as ``tpkit.datasets``."""

from .loader_workloads import Images, NumpyWork, TinySamples
from .tokens import SyntheticTokens, burn_cpu

__all__ = ["SyntheticTokens", "burn_cpu", "TinySamples", "NumpyWork", "Images"]
