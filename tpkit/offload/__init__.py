"""Optimizer offload: ``CPUOffloadAdamW`` (host master weights and moments, streaming or
delayed host step) and the probe that shows offload and DeepSpeed engines in a slice.

    opt = tp.offload.CPUOffloadAdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

DeepSpeed is never imported here: its CPU Adam is loaded when a kernel is selected, and the
DeepSpeed probe only looks at ``deepspeed`` when the user's code has imported it.
"""

from .adamw import CPUOffloadAdamW
from .errors import ExtraBackwardError, GradientChangedError, OffloadArgumentError, OffloadError, StateDictLayoutError
from .kernels import extensions_dir, select_kernel

__all__ = ["CPUOffloadAdamW", "ExtraBackwardError", "GradientChangedError", "OffloadArgumentError",
           "OffloadError", "StateDictLayoutError", "extensions_dir", "select_kernel"]
