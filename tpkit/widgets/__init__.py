"""Widgets: the dashboard panel and the tuner. They compose charts and controls and never
measure."""

from .dashboard import Dashboard, dashboard

__all__ = ["Dashboard", "dashboard"]
from .tuner import Tuner, tune  # noqa: E402

__all__ += ["Tuner", "tune"]
