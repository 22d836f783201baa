"""Exceptions of tpkit.data: each says what happened, where, and what to do.

All derive from ``tpkit.errors.TpkitError`` (``except tp.TpkitError`` catches them) and keep
the builtin base a caller of torch's DataLoader would catch (RuntimeError, TimeoutError,
TypeError, ValueError).
"""

from __future__ import annotations

import builtins
from typing import Any

from ..errors import TpkitError


class LoaderError(TpkitError, RuntimeError):
    """Base class of the loader's own failures."""


class LoaderArgumentError(TpkitError, ValueError):
    """A Loader argument (or a state dict given to it) that cannot work; says what to pass."""


class UnsupportedBatchError(TpkitError, TypeError):
    """A batch held something the process workers cannot hand over (e.g. a CUDA tensor, or an
    object that cannot be pickled)."""


class WorkerError(LoaderError):
    """A dataset or collate_fn raised inside a worker; carries the worker's traceback."""

    def __init__(self, worker: int, batch: int, index: Any, exc_type: str, message: str,
                 worker_traceback: str) -> None:
        self.worker, self.batch, self.index = worker, batch, index
        self.exc_type, self.worker_traceback = exc_type, worker_traceback
        where = ("while starting (worker_init_fn or the dataset's __iter__)" if batch < 0
                 else "in collate_fn" if index is None else f"on sample index {index!r}")
        who = f"loader worker {worker}" if worker >= 0 else "the loader's main process"
        super().__init__(
            f"{exc_type} in {who} {where}"
            f"{'' if batch < 0 else f' (batch {batch})'}: {message}\n"
            f"--- traceback in the worker ---\n{worker_traceback.rstrip()}")


_AS: dict[type, type] = {}  # the exception's class -> WorkerError that is one too


def worker_error(worker: int, batch: int, index: Any, exc_type: str, message: str, worker_traceback: str,
                 cls: type | None = None) -> WorkerError:
    """A ``WorkerError`` that is also an instance of the exception the dataset raised (``cls``, or
    the builtin named ``exc_type`` when it crossed a process), as torch's DataLoader re-raises the
    worker's own type: a loop's ``except KeyError`` keeps catching it (it stopped at tpkit's
    loader). A class whose instances cannot share a layout with RuntimeError's (OSError's) gives
    a plain ``WorkerError``."""
    base = cls if cls is not None else getattr(builtins, exc_type, None)
    kind: type = WorkerError
    if isinstance(base, type) and issubclass(base, Exception) and not issubclass(WorkerError, base):
        kind = _AS.get(base) or WorkerError
        if base not in _AS:
            try:  # the message as Exception says it (KeyError's own __str__ would quote it)
                kind = type("WorkerError", (WorkerError, base), {"__module__": __name__, "__str__": Exception.__str__,
                                                                 "__qualname__": f"WorkerError[{base.__name__}]"})
            except TypeError:  # instance lay-out conflict
                kind = WorkerError
            _AS[base] = kind
    return kind(worker, batch, index, exc_type, message, worker_traceback)


class WorkerDiedError(LoaderError):
    """A worker process vanished (a signal, the OOM killer, os._exit)."""


class LoaderTimeoutError(LoaderError, TimeoutError):
    """No batch arrived within ``timeout`` seconds."""


__all__ = ["LoaderError", "LoaderArgumentError", "WorkerError", "WorkerDiedError", "LoaderTimeoutError",
           "UnsupportedBatchError", "worker_error"]
