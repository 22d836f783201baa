"""One factory for hand-made Runs, shared by the tests: columns by name, so a new column in
``tpkit.schema`` (with its default) never breaks a test that does not care about it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from tpkit.run import Run
from tpkit.schema import SCHEMAS, frame

#: What a column holds when a test does not say.
DEFAULTS: dict[str, Any] = {"int64": 0, "float64": 0.0, "bool": False, "object": ""}


def table(name: str, **columns: Any) -> pd.DataFrame:
    """A ``name`` table (``steps``, ``spans``, ...) from columns given by name; the rest take
    their dtype's default (``loss`` NaN)."""
    n = max((len(v) for v in columns.values() if np.ndim(v) > 0), default=0)
    data = {}
    for col, dtype in SCHEMAS[name].items():
        if col in columns:
            data[col] = columns[col]
        else:
            data[col] = [float("nan") if col == "loss" else DEFAULTS[dtype]] * n
    return frame(name, data)


def steps_frame(durations: Any, samples: int = 10, warmup: int = 0, data_share: float = 0.25,
                loss: Any = None) -> pd.DataFrame:
    """``run.steps`` for the given step times: ``data_share`` of each step waiting for data,
    the rest split evenly between forward and backward; step numbers from ``-warmup``."""
    d = np.asarray(durations, dtype="float64")
    n = len(d)
    return table(
        "steps", step=np.arange(n) - warmup, warmup=np.arange(n) < warmup, start_s=np.cumsum(d) - d,
        end_s=np.cumsum(d), duration_s=d, samples=[samples] * n, data_wait_s=d * data_share,
        forward_s=d * (1 - data_share) / 2, backward_s=d * (1 - data_share) / 2, throughput=samples / d,
        loss=loss if loss is not None else np.linspace(2.0, 1.0, n))


def make_run(name: str, durations: Any, samples: int = 10, warmup: int = 0, data_share: float = 0.25,
             loss: Any = None, memory: pd.DataFrame | None = None, clocks: pd.DataFrame | None = None,
             spans: pd.DataFrame | None = None, loader: pd.DataFrame | None = None, **meta: Any) -> Run:
    """A Run named ``name`` with one step per duration (see ``steps_frame``) and ``meta``."""
    steps = steps_frame(durations, samples, warmup, data_share, loss)
    return Run(steps=steps, spans=spans, memory=memory, clocks=clocks, loader=loader, meta={"name": name, **meta})
