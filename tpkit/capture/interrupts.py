"""Ctrl-C held while tpkit takes its probes out and keeps the run.

A KeyboardInterrupt can land at any bytecode. Landing inside a slice's teardown it would
leave hooks installed (every later loop would see a slice that is no longer there) and lose
the run. ``held_sigint()`` defers SIGINT for the few milliseconds of teardown: the signal is
remembered, the teardown finishes, and the KeyboardInterrupt is raised right after, so the
user's Ctrl-C still stops their cell.

Only the main thread can install a signal handler; elsewhere (a loop run in a thread) the
block runs as is, and Python delivers SIGINT to the main thread anyway.

SIGTERM, while a slice runs and is taken down (``TermGuard``): torchrun stops every surviving
rank with it the moment one rank fails, and a rank stopped inside tpkit's teardown lost its run
(3 of 3 launches: the healthy rank's run was the one missing). Where SIGTERM has Python's
default action, a slice holds it: in the loop it ends the slice through the error path
(``SystemExit``), in the teardown it waits for the end; once the probes are out and the run is
kept, the process gets its SIGTERM again and ends as it would have. A handler installed over
tpkit's meanwhile (Lightning's, at fit) decides: called by it as the handler it replaced, tpkit's
does what the default action would have there, nothing. A process forked meanwhile
(a loader's worker) gets the default action back as it starts; one signalled in the
microseconds before that loses the signal, as with any Python handler.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator


class Held:
    """What happened while SIGINT was held: ``pending`` once a Ctrl-C arrived."""

    def __init__(self) -> None:
        self.pending = False


@contextmanager
def held_sigint(doing: str = "removing its probes (they are all removed)") -> Iterator[Held]:
    """Within the block SIGINT is remembered, not raised; after it, the handler that was in place
    runs (Python's raises KeyboardInterrupt; IPython's or the user's does what it does). Where the
    handler was ``SIG_DFL`` the KeyboardInterrupt says "interrupted while tpkit was ``doing``"."""
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
            raise KeyboardInterrupt(f"interrupted while tpkit was {doing}")


class TermGuard:
    """SIGTERM held for a slice (see the module's docstring). ``install`` once the probes are in,
    ``tearing_down`` before they come out, ``release`` after the run is kept."""

    def __init__(self) -> None:
        self.pending = False
        self._tearing_down = False
        self._installed = False
        self._pid = os.getpid()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                return  # the loop's own handler (Lightning's on a cluster, a user's) stays in charge
            signal.signal(signal.SIGTERM, self._on_term)
        except (ValueError, OSError, TypeError, AttributeError):  # no SIGTERM here, or not the main interpreter
            return
        self._installed = True

    def tearing_down(self) -> None:
        self._tearing_down = True

    def _on_term(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a process forked during the slice (a loader's worker): SIGTERM ends it
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if signal.getsignal(signal.SIGTERM) != self._on_term:
            # a handler installed over this one (Lightning's, at fit) is calling it as the one it
            # replaced: where that was the default action, it would have called nothing
            return
        self.pending = True
        if not self._tearing_down:
            raise SystemExit("tpkit: SIGTERM: the slice was ended and its run kept; the process now ends "
                             "as SIGTERM ends it")

    def release(self) -> None:
        """Put the default action back; a SIGTERM that came meanwhile is delivered again now."""
        if not self._installed:
            return
        self._installed = False
        try:
            if signal.getsignal(signal.SIGTERM) == self._on_term:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except (ValueError, OSError, TypeError):
            return
        if self.pending:
            os.kill(os.getpid(), signal.SIGTERM)


def _default_term_in_child() -> None:
    """A process forked while a slice holds SIGTERM (a loader's worker) gets SIGTERM's default
    action back at once: its parent ends it with SIGTERM, and it has no slice to keep."""
    try:
        handler = signal.getsignal(signal.SIGTERM)
        if isinstance(getattr(handler, "__self__", None), TermGuard):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError, TypeError):
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_default_term_in_child)
