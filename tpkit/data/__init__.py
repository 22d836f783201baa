"""tpkit.data: a shared-memory DataLoader that explains its own stalls.

``Loader`` takes torch DataLoader's arguments; ``loader_verdict`` reads ``run.loader``.
"""

from .analysis import LoaderVerdict, loader_verdict
from .errors import LoaderError, LoaderTimeoutError, UnsupportedBatchError, WorkerDiedError, WorkerError
from .loader import Loader

__all__ = ["Loader", "LoaderVerdict", "loader_verdict", "LoaderError", "LoaderTimeoutError",
           "UnsupportedBatchError", "WorkerDiedError", "WorkerError"]
