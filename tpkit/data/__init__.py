"""tpkit.data: a shared-memory DataLoader that explains its own stalls.

    from tpkit.data import Loader
    loader = Loader(ds, batch_size=64, shuffle=True, num_workers=4, seed=0)  # torch's args
    for batch in loader: ...
    state = loader.state_dict()          # resume later at the exact next batch
    Loader(ds, ..., workers="auto")      # worker count measured on this machine

How batches travel (process mode): each worker owns a ring of preallocated shared-memory
slots (``slots``); it collates straight into a slot and sends a few hundred bytes describing
the batch over its pipe. The main process hands out zero-copy views; a slot is reused only
after every view of it has been freed (``process_pool`` explains the rule). Worker deaths
are seen at once through process sentinels (``restart_workers=True`` replaces the worker and
re-sends its batches); segment files are unlinked as soon as they are mapped, so /dev/shm is
left clean even after a crash.

While a tpkit profile runs, each ``next()`` records a ``data_wait`` span, the batch's sample
count, and a ``run.loader`` row (worker, fetch_s, collate_s, queue_wait_s, transfer_s);
``tpkit.analysis.loader.loader_verdict`` turns those rows into a verdict and a worker count.
"""

from .errors import LoaderError, LoaderTimeoutError, UnsupportedBatchError, WorkerDiedError, WorkerError
from .loader import Loader

__all__ = ["Loader", "LoaderError", "LoaderTimeoutError",
           "UnsupportedBatchError", "WorkerDiedError", "WorkerError"]
