"""What a loader handed out: how many samples a batch holds, and telling the recorder."""

from __future__ import annotations

import dataclasses
from collections import UserDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..recorder import Recorder


def batch_size_of(batch: Any) -> int | None:
    """Samples in a (nested) batch; None if it cannot tell.

    The leading dimension of the first tensor-like (not a 0-dim one: a token count beside the
    batch), found through mappings (a dict, HF's ``BatchEncoding``, a ``UserDict``: their first
    such tensor, before any list among them), sequences (past a name or a number before the
    batch: ``("task", batch)``) and dataclasses (a ``Batch`` class of the loop's own; other
    objects: ``_object_sized``, the size they say of themselves, a PyG ``Batch``'s
    ``num_graphs``), except where a sequence holds one record
    per sample: strings or numbers, mappings with the same keys, columns of equal length one of
    which holds mappings (a detection loader's ``tuple(zip(*batch))``: per-sample targets next
    to a tuple of images whose first dimension is their channels, at any batch size), a list of
    tuples (the samples as a dataset returns them, with ``collate_fn=lambda b: b``), lists of
    words of different lengths (pre-tokenized texts), or tensors of different lengths (audio clips)."""
    return _sized(batch)[0]


def identity(tensor: Any) -> int:
    """A cheap identity of the batch ``tensor`` leads (``_sized``'s tensor): its data's address,
    the same in the forward the batch is given to unless the loop made a new tensor of it (moved
    it to another device, cast it); 0 where it has none (no tensor, an array of another library,
    a tensor without storage)."""
    if not isinstance(tensor, torch.Tensor):
        return 0
    try:
        return int(tensor.data_ptr())
    except Exception:  # noqa: BLE001 - a tensor subclass without storage: no identity
        return 0


def batch_identity(batch: Any) -> int:
    """``identity`` of ``batch``'s leading tensor (a loader that counts its own samples)."""
    try:
        return identity(_sized(batch)[1])
    except Exception:  # noqa: BLE001 - a batch tpkit cannot read: no identity
        return 0


def forward_identity(args: tuple, kwargs: dict) -> int:
    """``identity`` of the batch a forward was given: its first argument's leading tensor
    (``model(x)``, ``model(batch)``), or its keywords' (``model(**inputs)``)."""
    try:
        return identity(_sized(args[0] if args else kwargs)[1])
    except Exception:  # noqa: BLE001 - an argument tpkit cannot read: no identity
        return 0


def _sized(batch: Any) -> tuple[int | None, Any]:
    """``batch_size_of``'s answer and the tensor it read it from (None: none, or a count of
    records)."""
    # the usual batches first, without a frame of tpkit's more (a tensor; a dict led by one, as a
    # Trainer's): what the walk below answers for them
    if type(batch) is torch.Tensor and not batch.is_nested:
        return (int(batch.shape[0]) if batch.dim() else 1), batch
    if type(batch) is dict and batch:
        first = next(iter(batch.values()))
        if type(first) is torch.Tensor and not first.is_nested and first.dim():
            return int(first.shape[0]), first
    in_mapping = False  # the sequence at hand is a mapping's value (a list of per-sample tensors there)
    for _ in range(8):  # bounded descent into nested containers
        if _is_array(batch):
            return (int(batch.shape[0]) if _ndim(batch) > 0 else 1), batch
        if isinstance(batch, (dict, Mapping)):
            if not batch:
                return None, None
            values = list(batch.values())
            array = next((v for v in values if _is_array(v) and _ndim(v) > 0), None)
            if array is not None:
                return int(array.shape[0]), array
            batch, in_mapping = next((v for v in values if not _is_scalar(v)), None), True
            continue
        if isinstance(batch, (list, tuple)):
            if not batch:
                return None, None
            if all(isinstance(e, (str, bytes, int, float)) for e in batch):
                return len(batch), None  # texts, numbers: one per sample
            n = _per_sample(batch, in_mapping)
            if n is not None:
                return n, None
            batch, in_mapping = next((e for e in batch if not _is_scalar(e)), None), False
        elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
            fields = [getattr(batch, f.name, None) for f in dataclasses.fields(batch)]  # (init=False, unset)
            batch, in_mapping = next((v for v in fields if v is not None and not _is_scalar(v)), None), False
        else:
            return _object_sized(batch)
    return None, None


#: Attributes by which a batch object says how many samples it holds: a PyG ``Batch``'s
#: ``num_graphs`` (its ``batch_size`` too), the seed nodes of a PyG ``NeighborLoader``'s ``Data``
#: (``batch_size``), a batch class of the loop's own.
SIZE_ATTRIBUTES = ("batch_size", "num_graphs")


def _object_sized(batch: Any) -> tuple[int | None, Any]:
    """``_sized`` of an object that is no container: its first tensor attribute's leading
    dimension (a batch class of the loop's own: a ``batch_size`` it was given says the nominal
    size, and its last batch's rows are fewer), else, where its tensors sit in mapping stores
    (``stored_tensors``: a graph library's batch; PyG's had read no tensor at all, samples 0),
    the size it says of itself (``SIZE_ATTRIBUTES``: a PyG ``Batch``'s ``num_graphs``; its
    store mixes node-, edge- and graph-level tensors), else their leading dimension where they
    all agree. An object holding no tensor is no batch, whatever it says (a task object before
    the batch in ``(task, batch)`` with a ``batch_size`` of its settings had read 256 for 16).
    The tensor returned is its first either way (``identity``)."""
    attrs = getattr(batch, "__dict__", None)
    if not isinstance(attrs, dict):
        return None, None
    direct = next((v for v in attrs.values() if isinstance(v, torch.Tensor)), None)
    if direct is not None:
        return _sized(direct)[0], direct
    tensors = stored_tensors(batch)
    if not tensors:
        return None, None
    for name in SIZE_ATTRIBUTES:
        try:
            value = getattr(batch, name, None)
        except Exception:  # noqa: BLE001 - a property that raises: it says nothing
            value = None
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value, tensors[0]
    dims = {int(t.shape[0]) for t in tensors if t.dim() > 0}
    return (dims.pop() if len(dims) == 1 else None), tensors[0]


def held_values(mapping: Mapping) -> Iterable[Any]:
    """The values a ``Mapping`` that is no dict holds, read from the dict it keeps them in (an
    attribute dict with its keys: a ``UserDict``'s ``data``, a PyG storage's ``_mapping``), never
    through its ``__getitem__``: a lazy one (a datasets ``LazyBatch``) formats or stacks at each
    read there, and its dict holds only what was read. Nothing where no such dict is found."""
    if isinstance(mapping, UserDict):
        return mapping.data.values()
    attrs = getattr(mapping, "__dict__", None)
    if not isinstance(attrs, dict):
        return ()
    dicts = [v for v in attrs.values() if type(v) is dict]
    if not dicts:  # (before its len(): an h5py group's reads its file)
        return ()
    try:
        n = len(mapping)
        for v in dicts:
            if len(v) == n and all(k in v for k in mapping):
                return v.values()
    except Exception:  # noqa: BLE001 - a mapping tpkit cannot read holds nothing it sees
        pass
    return ()


def stored_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors an object that is no container keeps in mapping stores among its attributes
    (``held_values``; a dict of such stores too), three levels down: PyG's ``Data``/``Batch``
    keep theirs in ``_store``, a ``MutableMapping``, ``HeteroData`` in dicts of them. Not its
    lists, plain dicts of other things or other objects (a vocabulary, a config, a model it
    refers to: no batch; a config's 1 MiB of class weights and a 50,000-word list had read
    data, 6.4 ms a batch to walk)."""
    attrs = getattr(obj, "__dict__", None)
    out: list[torch.Tensor] = []
    if isinstance(attrs, dict):
        for v in attrs.values():
            if isinstance(v, Mapping) and type(v) is not dict:
                _store_tensors(v, 0, out)
            elif type(v) is dict:
                for store in v.values():
                    if isinstance(store, Mapping) and type(store) is not dict:
                        _store_tensors(store, 1, out)
    return out


#: Values with no tensor inside.
_PLAIN = frozenset({str, bytes, int, float, bool, type(None)})


def _store_tensors(value: Any, depth: int, out: list[torch.Tensor]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif depth < 3 and isinstance(value, Mapping) and type(value) is not dict:
        for v in held_values(value):
            _store_tensors(v, depth + 1, out)


def _is_array(x: Any) -> bool:
    """A tensor, or an array with a shape and a dtype (numpy and friends)."""
    return isinstance(x, torch.Tensor) or (hasattr(x, "shape") and hasattr(x, "dtype"))


def _ndim(x: Any) -> int:
    """Dimensions of a tensor or array; -1 where it cannot say (a strided nested tensor has no
    sizes: reading ``.shape`` raises)."""
    try:
        return len(x.shape)
    except Exception:  # noqa: BLE001 - never an error in the loop's batch
        return -1


def _is_scalar(x: Any) -> bool:
    """A name, a number, or a 0-dim tensor: beside a batch, never its samples."""
    return isinstance(x, (str, bytes, int, float, bool)) or x is None or (_is_array(x) and _ndim(x) == 0)


def _per_sample(seq: list | tuple, in_mapping: bool = False) -> int | None:
    """``len(seq)`` (or its columns' length) where ``seq`` holds one record per sample.
    ``in_mapping``: ``seq`` is a mapping's value, where a list of tensors of different lengths is
    one per sample (audio clips); at the top they are columns ((images, boxes of all images))."""
    for part in (seq, *(p for p in seq if isinstance(p, (list, tuple)))):
        if _records(part):  # (before the columns: list(zip(*batch)) with per-sample targets)
            return len(part)
    if len(seq) > 1 and all(isinstance(c, (list, tuple)) for c in seq):
        n = len(seq[0])
        if n and all(len(c) == n for c in seq) and any(all(isinstance(e, (dict, Mapping)) for e in c) for c in seq):
            return n  # columns, one of per-sample mappings (a detection batch of one image too)
    if type(seq) is list and all(type(e) is tuple for e in seq):  # uncollated samples
        return len(seq)
    if len(seq) > 1 and all(isinstance(e, (list, tuple)) and e and all(isinstance(w, str) for w in e) for e in seq) \
            and len({len(e) for e in seq}) > 1:
        return len(seq)  # lists of words of different lengths: one per sample (text columns share theirs)
    if in_mapping and len(seq) > 1 and all(_is_array(e) and _ndim(e) > 0 for e in seq) \
            and len({int(e.shape[0]) for e in seq}) > 1:
        return len(seq)  # tensors of different lengths under a key: one per sample
    return None


def _records(seq: list | tuple) -> bool:
    """Whether ``seq`` is one mapping per sample: two or more, all with the same keys."""
    if len(seq) < 2 or not all(isinstance(e, (dict, Mapping)) for e in seq):
        return False
    keys = set(seq[0])
    return all(set(e) == keys for e in seq)


def loader_key(loader_or_iterator: Any) -> int:
    """Which torch DataLoader a batch or an epoch comes from, the same across its epochs: the id
    of its index sampler (the ``batch_sampler``, or the ``sampler`` without batching), which the
    loader makes once and hands to each epoch's iterator (``_index_sampler``), with its
    Dataset's (both in one int, never an id: ``id(sampler) << 64 | id(dataset)``); else its
    Dataset's id. Keyed by the Dataset alone, two loaders over one Dataset (a train/val split by
    samplers, a train-accuracy pass) were one source: an evaluation with grad on the other
    loader stopped a full slice's loop, and the loader settings read were either's. Keyed by
    the sampler alone, loaders sharing one sampler object over different Datasets were one: every
    fastai DataLoader's iterator has the same ``_index_sampler`` (its ``_FakeLoader``'s class
    attribute), so its validation loader was the training source (eval_s 0.13 s of 0.23 s, the
    rest other, "between evaluation calls"). Two live loaders with one sampler object over one
    Dataset hand out the same batches: one source (an iterator does not know its loader)."""
    sampler = getattr(loader_or_iterator, "_index_sampler", None)
    if sampler is not None:
        return id(sampler) << 64 | loader_dataset(loader_or_iterator)
    return loader_dataset(loader_or_iterator)


def loader_dataset(loader_or_iterator: Any) -> int:
    """The id of a torch DataLoader's (or its iterator's) Dataset."""
    ds = getattr(loader_or_iterator, "_dataset", None)
    return id(ds if ds is not None else getattr(loader_or_iterator, "dataset", loader_or_iterator))


def loader_settings(loader: Any) -> dict[str, Any]:
    """A torch DataLoader's settings the advice depends on (``meta["torch_loader"]``): advice had
    asked a loader with ``persistent_workers=True`` to set it, its epochs' first batch read as a
    restart of its workers."""
    out: dict[str, Any] = {}
    for name in ("num_workers", "persistent_workers", "pin_memory", "prefetch_factor", "batch_size"):
        value = getattr(loader, name, None)
        if value is None or isinstance(value, (bool, int)):
            out[name] = value
    return out


def handed_out(rec: Recorder, batch: Any, workers: int = -1, source: int = 0) -> None:
    """A loader gave ``batch`` to the loop: count its samples, tell the batch listeners.
    ``workers``: a torch DataLoader's ``num_workers`` (-1: another loader); ``source``: the key of
    the source it came from (a DataLoader's ``loader_key``, else the id of the iterator; 0: not known)."""
    try:
        n, lead = _sized(batch)
    except Exception:  # noqa: BLE001 - a batch tpkit cannot read is uncounted, never the loop's error
        n, lead = None, None
    if n is None and rec.uncounted is None:
        rec.uncounted = type(batch).__qualname__
    if type(lead) is torch.Tensor:  # (identity, inlined for a plain tensor: a frame less a batch)
        try:
            ident = int(lead.data_ptr())
        except Exception:  # noqa: BLE001 - a tensor without storage: no identity
            ident = 0
    else:
        ident = identity(lead)
    rec.handed_out(n or 0, workers, source, ident)
    if rec.batch_listeners:
        rec.yielded(batch)
