"""Ctrl-C held while tpkit takes its probes out and keeps the run.

A KeyboardInterrupt can land at any bytecode. Landing inside a slice's teardown it would
leave hooks installed (every later loop would see a slice that is no longer there) and lose
the run. ``held_sigint()`` defers SIGINT for the few milliseconds of teardown: the signal is
remembered, the teardown finishes, and the KeyboardInterrupt is raised right after, so the
user's Ctrl-C still stops their cell.

Only the main thread can install a signal handler; elsewhere (a loop run in a thread) the
block runs as is, and Python delivers SIGINT to the main thread anyway.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator


class Held:
    """What happened while SIGINT was held: ``pending`` once a Ctrl-C arrived."""

    def __init__(self) -> None:
        self.pending = False


@contextmanager
def held_sigint() -> Iterator[Held]:
    """Within the block SIGINT is remembered, not raised; after it, the handler that was in place
    runs (Python's raises KeyboardInterrupt; IPython's or the user's does what it does)."""
    held = Held()
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    frames: list[Any] = []

    def remember(signum: int, frame: Any) -> None:
        held.pending = True
        frames.append(frame)

    try:
        previous = signal.signal(signal.SIGINT, remember)
    except (ValueError, OSError, TypeError):  # not the main interpreter, or no signal support
        yield held
        return
    try:
        yield held
    finally:
        signal.signal(signal.SIGINT, previous)
    if held.pending:
        if callable(previous):
            previous(signal.SIGINT, frames[0])
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt("interrupted while tpkit was removing its probes (they are all removed)")
