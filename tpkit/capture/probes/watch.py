"""``tp.watch``: any iterable's ``next()`` (and ``iter()``), or each call of a function that
makes a batch, timed as ``data_wait`` while a slice runs."""

from __future__ import annotations

import functools
import inspect
import operator
import threading
from typing import Any, Callable

from torch.utils.data.dataloader import _BaseDataLoaderIter

from ..recorder import Recorder
from .batches import handed_out


def watch(iterable: Any, name: str = "watch") -> Any:
    """Time ``next()`` on any iterable as ``data_wait`` while a slice runs; free otherwise.
    Its ``iter()``, where a loader starts its pipeline each epoch, is ``data_wait`` too, as a
    DataLoader's (``_wrap_iter``; a torchdata.nodes Loader's ~50 ms each epoch had been other).

    >>> for batch in tp.watch(my_generator()): ...

    A function that is not iterable (nanoGPT's ``get_batch(split)``: random slices of a memmap,
    no loader) is wrapped instead: each of its calls in the loop's thread is a ``data_wait`` and
    its result a batch handed out (its samples counted; evaluation's told apart as a loader's
    are), with whatever arguments; outside a slice the call goes straight through.

    >>> get_batch = tp.watch(get_batch)

    A callable that has ``__iter__`` is iterated; one that has ``__getitem__`` and no
    ``__iter__`` (a batch maker that also looks up its settings by key) is wrapped as a batch
    function: its calls are what a loop makes batches with (iterating it by the old
    ``__getitem__`` protocol had given a generator that could not be called). The wrapper is a
    function: index the object itself. A generator function (``def gen(): ... yield batch``) is
    refused with a ``TypeError``: its calls make generators, not batches, and timing them times
    nothing; pass the generator it makes, ``tp.watch(gen(...))``.
    """
    if inspect.isgeneratorfunction(iterable) or inspect.isasyncgenfunction(iterable):
        name_of = getattr(iterable, "__name__", "the function")
        raise TypeError(
            f"tp.watch({name_of}) got a generator function: calling it makes a generator, not a batch, so tpkit "
            f"would time nothing; pass the generator it makes: tp.watch({name_of}(...))")
    if callable(iterable) and not hasattr(iterable, "__iter__"):
        return _timed_call(iterable, name)
    rec = _loop_reading()
    if rec is None:
        return _timed_iter(iter(iterable), name, id(iterable))
    token = rec.enter("data_wait", f"{name}.__iter__")
    try:
        it = iter(iterable)
    finally:
        rec.exit(token)
    rec.source_loaders[id(it)] = id(iterable)  # the next epoch's reads are this iterable's too
    return _timed_iter(it, name, id(iterable))


def _timed_call(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` with each call in the loop's thread timed as ``data_wait`` and its result handed out."""

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        rec = _loop_reading()
        if rec is None:
            return fn(*args, **kwargs)
        if rec.batch_coming is not None:
            rec.batch_coming()
        source = _call_source(fn, args, kwargs)
        if rec.stop_pending is not None:
            rec.stop_before_read(source)  # the slice is full: the loop stops before this batch
        token = rec.enter("data_wait", name)
        try:
            batch = fn(*args, **kwargs)
        finally:
            rec.exit(token)
        handed_out(rec, batch, source=source)
        return batch

    return timed


def _call_source(fn: Callable[..., Any], args: tuple, kwargs: dict) -> int:
    """The source a call's batch came from: the function and its string arguments, so that
    ``get_batch("train")`` and ``get_batch("val")`` are two sources, as a training and an
    evaluation loader are (capture/evaluation.py tells an evaluation's batches by their source);
    other arguments (an index, a generator) leave the source the function's."""
    split = tuple(a for a in args if isinstance(a, str)) + tuple(
        (k, v) for k, v in sorted(kwargs.items()) if isinstance(v, str))
    return (hash((id(fn), split)) if split else id(fn)) or 1


def _loop_reading() -> Recorder | None:
    """The active slice's recorder where a read in this thread is the loop's own wait for data
    (not another thread's, not inside a wait already open); None otherwise."""
    from ..recorder import active

    rec = active()
    if rec is None or threading.get_ident() != rec.thread_id or rec.is_open("data_wait"):
        return None
    return rec


def _timed_iter(it: Any, name: str, owner: int) -> Any:
    """``it``'s items, each read timed; ``owner``: the id of the iterable ``it`` reads."""
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
            if rec.stop_pending is not None and not _handed_all(it):
                rec.stop_before_read(id(it), owner)  # the slice is full: the loop stops before this read
            token = rec.enter("data_wait", name)
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                rec.exit(token)
            handed_out(rec, item, source=id(it))
        yield item


def _handed_all(it: Any) -> bool:
    """Whether ``it`` is known to hold nothing more (a list's iterator at its end): its next read
    ends the loop. A torch DataLoader's says so itself, inside the read (phases._wrap_next)."""
    if isinstance(it, _BaseDataLoaderIter):
        return True
    return operator.length_hint(it, 1) == 0
