"""Exceptions of tpkit.data: each says what happened, where, and what to do."""

from __future__ import annotations

from typing import Any

from .slots import UnsupportedBatchError


class LoaderError(RuntimeError):
    """Base class of the loader's own failures."""


class WorkerError(LoaderError):
    """A dataset or collate_fn raised inside a worker; carries the worker's traceback."""

    def __init__(self, worker: int, batch: int, index: Any, exc_type: str, message: str,
                 worker_traceback: str) -> None:
        self.worker, self.batch, self.index = worker, batch, index
        self.exc_type, self.worker_traceback = exc_type, worker_traceback
        where = ("while starting (worker_init_fn or the dataset's __iter__)" if batch < 0
                 else "in collate_fn" if index is None else f"on sample index {index!r}")
        super().__init__(
            f"{exc_type} in loader worker {worker} {where}"
            f"{'' if batch < 0 else f' (batch {batch})'}: {message}\n"
            f"--- traceback in the worker ---\n{worker_traceback.rstrip()}")


class WorkerDiedError(LoaderError):
    """A worker process vanished (a signal, the OOM killer, os._exit)."""


class LoaderTimeoutError(LoaderError, TimeoutError):
    """No batch arrived within ``timeout`` seconds."""


__all__ = ["LoaderError", "WorkerError", "WorkerDiedError", "LoaderTimeoutError",
           "UnsupportedBatchError"]
