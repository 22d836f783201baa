"""``tp.watch``: any iterable's ``next()`` (and ``iter()``) timed as ``data_wait`` while a slice runs."""

from __future__ import annotations

import threading
from typing import Any

from ..recorder import Recorder
from .batches import handed_out


def watch(iterable: Any, name: str = "watch") -> Any:
    """Time ``next()`` on any iterable as ``data_wait`` while a slice runs; free otherwise.
    Its ``iter()``, where a loader starts its pipeline each epoch, is ``data_wait`` too, as a
    DataLoader's (``_wrap_iter``; a torchdata.nodes Loader's ~50 ms each epoch had been other).

    >>> for batch in tp.watch(my_generator()): ...
    """
    rec = _loop_reading()
    if rec is None:
        return _timed_iter(iter(iterable), name)
    token = rec.enter("data_wait", f"{name}.__iter__")
    try:
        it = iter(iterable)
    finally:
        rec.exit(token)
    return _timed_iter(it, name)


def _loop_reading() -> Recorder | None:
    """The active slice's recorder where a read in this thread is the loop's own wait for data
    (not another thread's, not inside a wait already open); None otherwise."""
    from ..recorder import active

    rec = active()
    if rec is None or threading.get_ident() != rec.thread_id or rec.is_open("data_wait"):
        return None
    return rec


def _timed_iter(it: Any, name: str) -> Any:
    while True:
        rec = _loop_reading()
        if rec is None:
            try:
                item = next(it)
            except StopIteration:
                return
        else:
            if rec.batch_coming is not None:
                rec.batch_coming()
            token = rec.enter("data_wait", name)
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                rec.exit(token)
            handed_out(rec, item, source=id(it))
        yield item
