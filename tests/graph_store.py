"""A graph library's store, as PyG's ``GlobalStorage`` (for tests of batches that keep their
tensors in one): a ``MutableMapping`` over its ``_mapping`` dict, with bookkeeping of its own
beside it (PyG's ``_slice_dict``)."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import torch


class Storage(MutableMapping):
    def __init__(self, **values: Any) -> None:
        self.__dict__["_mapping"] = dict(values)
        self.__dict__["_slice_dict"] = {k: torch.zeros(3, dtype=torch.long) for k in values}

    def __getitem__(self, key: str) -> Any:
        return self._mapping[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._mapping[key] = value

    def __delitem__(self, key: str) -> None:
        del self._mapping[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._mapping)

    def __len__(self) -> int:
        return len(self._mapping)


class StoredAttributes:
    """A batch object whose tensors are read as attributes from its ``_store`` (a ``Storage``), as
    PyG's ``Data`` / ``Batch`` reads them."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self.__dict__["_store"][key]
        except KeyError:
            raise AttributeError(key) from None
