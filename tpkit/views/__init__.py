"""Views: what a person sees. The HTML report and fragments (``html``), exports, the
ipywidgets dashboard and tuner, the magics and the command line. Views compose charts and
analysis; they never measure.

``dashboard`` and ``tune`` are imported on first use (ipywidgets is heavy).
"""

from __future__ import annotations

import importlib
from typing import Any

_WIDGETS = {"dashboard": "dashboard", "Dashboard": "dashboard", "tune": "tuner", "Tuner": "tuner"}


def __getattr__(name: str) -> Any:
    if name in _WIDGETS:
        return getattr(importlib.import_module(f".{_WIDGETS[name]}", __name__), name)
    raise AttributeError(f"module 'tpkit.views' has no attribute {name!r}")


__all__ = ["Dashboard", "Tuner", "dashboard", "tune"]
