"""Hold Ctrl-C while the loader stops its workers, and deliver it right after.

A KeyboardInterrupt that lands inside a shutdown (between two ``join``s, or inside the
``weakref.finalize`` that runs it once) would leave worker processes, threads or segment files
behind for good. While ``held_sigint()`` is active, SIGINT only sets a flag; on exit the
previous handler runs (so the KeyboardInterrupt is raised where it would have been, just
later). Outside the main thread, where Python delivers no signal, it does nothing.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Any, Iterator


@contextmanager
def held_sigint() -> Iterator[None]:
    """Within the block SIGINT is recorded, not raised; on exit it is delivered (see above)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[Any] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: got.append(frame))
    except (ValueError, OSError, TypeError):  # not the main interpreter, or no signal support
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if got:
            if callable(previous):
                previous(signal.SIGINT, got[0])
            elif previous == signal.SIG_DFL:
                raise KeyboardInterrupt
