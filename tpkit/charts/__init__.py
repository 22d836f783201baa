"""Chart builders: pure functions from frames to ``altair.Chart``. They never measure."""

from .clocks import clock_traces, clocks_with_timeline
from .memory import memory_by_step, memory_waterfall
from .ranks import rank_step_times
from .style import PHASE_COLORS, PHASE_ORDER, phase_scale
from .timeline import stall_timeline, step_breakdown
from .tuning import tradeoff

__all__ = ["PHASE_COLORS", "PHASE_ORDER", "clock_traces", "clocks_with_timeline", "memory_by_step", "memory_waterfall",
           "phase_scale", "rank_step_times", "stall_timeline",
           "step_breakdown", "tradeoff"]
