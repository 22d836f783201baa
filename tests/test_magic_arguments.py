"""Property: whatever the %%tp_profile line holds, the magic either refuses it with a UsageError
before the cell runs, or runs the cell; never another exception, never a hook left behind."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from IPython.core.error import UsageError
from leftovers import diff, snapshot

VALUES = st.sampled_from(["0", "1", "3", "-1", "2.5", "auto", "x", "1e9", "nan", "''", "200", "201", "on", "ab",
                          "maybe", "/proc/x", "'a b'", "--"])
OPTIONS = st.sampled_from(["--steps", "--warmup", "--name", "--clock-hz", "--samples-per-step", "--kernels",
                           "--no-stop", "--no-memory", "--memory-detail", "--unknown", "-s", "steps"])
LINES = st.lists(st.tuples(OPTIONS, st.one_of(st.none(), VALUES)), max_size=4).map(
    lambda parts: " ".join(o if v is None else f"{o} {v}" for o, v in parts))


class CellRan(Exception):
    pass


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(line=LINES)
def test_any_line_is_refused_before_the_cell_or_runs_it(ip, line):
    ip.user_ns["CellRan"] = CellRan
    before = snapshot()
    try:
        ip.run_cell_magic("tp_profile", f"{line} --quiet", "raise CellRan()")
    except UsageError as e:
        assert str(e).strip()  # says what is wrong
    except CellRan:
        pass  # a valid line: the cell ran (and stopped at once)
    assert diff(before, snapshot()) == {}
