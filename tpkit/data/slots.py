"""Shared-memory slot rings and the batch layout that lives in them.

A worker owns one ring: a single shared-memory file holding ``n_slots`` equal slots. It
creates the file after its first batch (so the slot size fits the batch), writes every later
batch's tensor bytes into the slot the main process names, and sends only a small
*skeleton* over its pipe: the batch's structure plus, per tensor, (offset, bytes, dtype,
shape). No tensor data is pickled and no segment is created per batch. A batch larger than
the slot makes the worker open a bigger ring (a new *generation*), which is rare.

What is not a dense CPU tensor or a numeric array travels in the skeleton, pickled as torch's
DataLoader would: numbers and strings as they are, anything else (a sparse tensor, an object
array, a user's class) as ``pickle`` bytes. A batch with no tensor at all (e.g. only strings)
needs no ring: the skeleton is the whole batch.

The main process maps a ring the first time a message names it and unlinks the file right
away: the mapping stays valid and nothing is left in /dev/shm even if the process dies
later. Segment names are deterministic (``tpk-<main pid>-<loader id>-w<worker>.<life>-g<gen>``)
so the main process can also remove files whose worker died before it saw them.

Slot reuse rule: a slot returns to its worker's free list only when every tensor viewing it
has been freed. Each handed-out batch views its slot through one fresh numpy array (the
*lease*); a weak reference to that array fires when the last view dies (CPython frees on
the last reference), see ``process_pool``. The loader copies a batch out instead of viewing it when the training
loop already holds too many slots of that worker, so the ring never blocks.
"""

from __future__ import annotations

import functools
import glob
import mmap
import os
import pickle
import tempfile
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from .collate import Stack
from .errors import UnsupportedBatchError

ALIGN_BYTES = 64
PAGE_BYTES = 4096
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def segment_prefix(main_pid: int, loader_id: int) -> str:
    """Path prefix of every segment file of one loader of one main process."""
    return os.path.join(SHM_DIR, f"tpk-{main_pid}-{loader_id}-")


def segment_path(prefix: str, worker: int, life: int, gen: int) -> str:
    """Path of one ring: worker ``worker`` in its ``life``-th start, ``gen``-th size."""
    return f"{prefix}w{worker}.{life}-g{gen}"


def remove_segments(prefix: str) -> int:
    """Unlink every segment file of one loader (safe to call twice); returns how many."""
    n = 0
    for path in glob.glob(glob.escape(prefix) + "*"):
        try:
            os.unlink(path)
            n += 1
        except FileNotFoundError:
            pass
    return n


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


# -- flattening a batch into leaves + skeleton ------------------------------------------------
#
# A skeleton is made of plain tuples, ints, strings and type references only, so that pickle
# writes and reads it in C: a worker pickles one for every batch it makes, and placeholder
# objects with a ``__reduce__`` (a Python call each) cost the tiny workload 3-7% of its
# samples/s (docs/OVERHEAD.md, "Fewer messages for small batches"). Its nodes:
#
#   (LEAF, kind, offset, nbytes, dtype, shape)  a tensor or array in the slot ("torch"/"numpy");
#                                               while flattening, (LEAF, index into leaves)
#   (PICKLED, bytes)                            anything a slot cannot hold, as pickle bytes
#   (MAP, type, [(key, node), ...]), (NAMEDTUPLE, type, [node, ...]), (SEQ, type, [node, ...])
#                                               (type: 0, 1, 2 for list, tuple, dict: a type
#                                               reference costs pickle an import lookup,
#                                               four times the rest of a small skeleton)
#   anything else                               a plain value (number, string, bytes, None,
#                                               numpy scalar) as it is
#
# A plain value is never a tuple (tuples are SEQ nodes), so a tuple is always a node.
LEAF, PICKLED, MAP, NAMEDTUPLE, SEQ = 0, 1, 2, 3, 4
_BUILTIN_TYPES = (list, tuple, dict)
_BUILTIN_CODES: dict[type, int] = {t: i for i, t in enumerate(_BUILTIN_TYPES)}


def _pickled(obj: Any, where: Any) -> tuple:
    """``obj`` as a PICKLED node: plain ``pickle``, not the pipe's ForkingPickler, so a tensor
    inside is copied as bytes, never handed over as a shared-memory file descriptor (what
    torch's DataLoader does with every batch)."""
    try:
        return (PICKLED, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as e:
        raise UnsupportedBatchError(
            f"{place(where)} is a {type(obj).__module__}.{type(obj).__qualname__} that cannot be pickled "
            f"({type(e).__name__}: {e}); process workers hand over tensors and numpy arrays through "
            f"shared memory and pickle everything else. Make it picklable (e.g. a module-level "
            f"class), convert it in collate_fn (e.g. torch.as_tensor(...) or a dict of tensors), "
            f"or use mode='thread'.") from e


_SCALARS = (int, float, bool, complex, str, bytes, type(None))


def place(where: Any) -> str:
    """A place in a batch as text (``batch['x'][0]``) from ``flatten``'s lazy path: the text
    is made only for an error message, never for every node of every batch."""
    if type(where) is str:
        return where
    parent, kind, key = where
    return f"{place(parent)}.{key}" if kind == "." else f"{place(parent)}[{key!r}]"


def flatten(obj: Any, leaves: list, where: Any = "batch") -> Any:
    """Replace tensors/arrays (and deferred ``Stack``s) in ``obj`` by (LEAF, index into
    ``leaves``) nodes; returns the skeleton. Other objects stay in the skeleton (PICKLED when
    not a plain number or string). Raises UnsupportedBatchError naming the place of a device
    tensor or of an object that cannot be pickled (``where``: that place, as ``place`` reads it).
    """
    t = type(obj)  # the usual nodes first, by exact type (an ABC's isinstance costs ~0.3 us)
    if t is Stack:
        leaves.append(obj)
        return (LEAF, len(leaves) - 1)
    if t is tuple or t is list:
        return (SEQ, _BUILTIN_CODES[t], [flatten(v, leaves, (where, "[]", i)) for i, v in enumerate(obj)])
    if t is dict:
        return (MAP, _BUILTIN_CODES[t], [(k, flatten(v, leaves, (where, "[]", k))) for k, v in obj.items()])
    if isinstance(obj, Stack):
        leaves.append(obj)
        return (LEAF, len(leaves) - 1)
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise UnsupportedBatchError(
                f"{place(where)} is a {obj.device.type} tensor; workers can only hand over CPU tensors. "
                f"Build CPU tensors in collate_fn and move them to the device in the training loop "
                f"(or pass device= / pin_memory=True to the Loader).")
        if obj.layout != torch.strided or obj.is_quantized or obj.is_nested:
            return _pickled(obj, where)
        leaves.append(obj)
        return (LEAF, len(leaves) - 1)
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            return _pickled(obj, where)
        leaves.append(obj)
        return (LEAF, len(leaves) - 1)
    if isinstance(obj, _SCALARS) or isinstance(obj, np.generic):
        return obj
    if isinstance(obj, Mapping):
        return (MAP, _BUILTIN_CODES.get(type(obj), type(obj)),
                [(k, flatten(v, leaves, (where, "[]", k))) for k, v in obj.items()])
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return (NAMEDTUPLE, type(obj), [flatten(v, leaves, (where, ".", f)) for f, v in zip(obj._fields, obj)])
    if isinstance(obj, (list, tuple)):
        return (SEQ, _BUILTIN_CODES.get(type(obj), type(obj)),
                [flatten(v, leaves, (where, "[]", i)) for i, v in enumerate(obj)])
    return _pickled(obj, where)


def unflatten(skel: Any, make_leaf: Callable[[tuple], Any]) -> Any:
    """Rebuild a batch from its skeleton; ``make_leaf(node)`` gives each tensor or array from
    its (LEAF, kind, offset, nbytes, dtype, shape) node."""
    if type(skel) is not tuple:
        return skel
    tag = skel[0]
    if tag == LEAF:
        return make_leaf(skel)
    if tag == PICKLED:
        return pickle.loads(skel[1])
    _, typ, items = skel
    if type(typ) is int:
        typ = _BUILTIN_TYPES[typ]
    if tag == MAP:
        d = {k: unflatten(v, make_leaf) for k, v in items}
        if typ is dict:
            return d
        try:
            return typ(d)
        except Exception:  # a Mapping type that cannot be built from a dict
            return d
    vals = [unflatten(v, make_leaf) for v in items]
    if tag == NAMEDTUPLE:
        return typ(*vals)
    return vals if typ is list else (tuple(vals) if typ is tuple else typ(vals))


def leaf_nbytes(leaves: list) -> int:
    """Bytes a slot needs for these leaves, each aligned to ALIGN_BYTES."""
    total = 0
    for x in leaves:
        n = x.numel() * x.element_size() if isinstance(x, torch.Tensor) else x.nbytes  # Stack too
        total = _round_up(total, ALIGN_BYTES) + n
    return total


# -- the worker side ------------------------------------------------------------------------

class _Plan(NamedTuple):
    """A slot's layout for batches like the one it was made from (``WorkerRing._plan``)."""

    layout: list  # (type, dtype, shape) of each leaf
    skel: Any  # the skeleton with (LEAF, index) nodes, as flatten made it
    targets: list  # per leaf: the tensor or array in the slot it is copied to (None: empty)
    wire_skel: Any  # the skeleton the main process gets, each leaf's place in the slot filled in


def _reusable(skel: Any) -> bool:
    """Whether a later skeleton equal to ``skel`` (``==``) can be sent as ``skel``'s: true
    unless a plain value in it equals one of another type or value (``1 == True == 1.0``,
    ``0.0 == -0.0``), so only strings, bytes and None may be in it as plain values."""
    if type(skel) is not tuple:
        return skel is None or type(skel) in (str, bytes)
    tag = skel[0]
    if tag in (LEAF, PICKLED):
        return True
    if tag == MAP:
        return all(_reusable(k) and _reusable(v) for k, v in skel[2])
    return all(_reusable(v) for v in skel[2])


class WorkerRing:
    """A worker's ring: created lazily on the first batch, regrown if a batch does not fit."""

    def __init__(self, prefix: str, worker: int, life: int, n_slots: int) -> None:
        self.prefix, self.worker, self.life, self.n_slots = prefix, worker, life, n_slots
        self.gen = -1
        self.slot_bytes = 0
        self._mm: mmap.mmap | None = None
        self._u8: torch.Tensor | None = None
        # (slot, offset, dtype, shape) -> the slot's bytes viewed as that tensor: a batch of
        # the same layout as an earlier one in that slot reuses it (three torch calls saved)
        self._views: dict[tuple, torch.Tensor] = {}
        # slot -> how its last batch was laid out: the next batch of the same layout and
        # skeleton is copied straight to the same places (no offsets, views or skeleton to
        # make again: a third of a tiny batch's write, benchmarks/loader_write.py)
        self._plans: dict[int, _Plan] = {}

    def _view(self, slot: int, off: int, n: int, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        key = (slot, off, dtype, shape)
        v = self._views.get(key)
        if v is None:
            assert self._u8 is not None
            base = slot * self.slot_bytes + off
            v = self._u8[base: base + n].view(dtype).view(shape)
            if len(self._views) >= 4096:  # batches of ever new shapes: do not grow without end
                self._views.clear()
            self._views[key] = v
        return v

    def _grow(self, need_bytes: int) -> None:
        self.close()
        self.gen += 1
        # First ring: exactly the first batch (fixed-size batches never grow); a regrow leaves
        # 25% headroom so variable-size batches settle after a few generations.
        grow = 1.25 if self.gen > 0 else 1.0
        self.slot_bytes = _round_up(max(int(need_bytes * grow), PAGE_BYTES), PAGE_BYTES)
        path = segment_path(self.prefix, self.worker, self.life, self.gen)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.slot_bytes * self.n_slots)
            self._mm = mmap.mmap(fd, self.slot_bytes * self.n_slots)
        finally:
            os.close(fd)
        self._u8 = torch.frombuffer(self._mm, dtype=torch.uint8)

    def write(self, slot: int, batch: Any) -> tuple[Any, int, int]:
        """Copy ``batch``'s tensors into ``slot``; returns (skeleton, gen, slot_bytes). A batch
        without tensors or arrays leaves the ring alone: (skeleton, -1, 0)."""
        leaves: list = []
        skel = flatten(batch, leaves)
        if not leaves:
            return skel, -1, 0
        layout = [(type(x), x.dtype, x.shape) for x in leaves]
        plan = self._plans.get(slot)
        if plan is None or plan.layout != layout or plan.skel != skel:
            plan = self._plan(slot, skel, leaves, layout)
        # samples that require grad still copy into plain memory; torch's own switch, not the
        # no_grad context (2.2 against 0.2 us, a tenth of a tiny batch's write)
        grad = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            for x, out in zip(leaves, plan.targets):
                if out is None:  # an empty tensor: nothing to copy
                    continue
                if type(x) is Stack:
                    x.into(out)  # collate straight into the slot
                elif isinstance(x, torch.Tensor):
                    out.copy_(x)
                else:
                    out[...] = x
        finally:
            torch._C._set_grad_enabled(grad)
        return plan.wire_skel, self.gen, self.slot_bytes

    def _plan(self, slot: int, skel: Any, leaves: list, layout: list) -> "_Plan":
        """Where each leaf goes in ``slot`` and the skeleton the main process reads it by;
        kept for the slot's next batch of the same layout when ``_reusable(skel)``."""
        need = leaf_nbytes(leaves)
        if need > self.slot_bytes:
            self._grow(need)
        assert self._u8 is not None
        base = slot * self.slot_bytes
        off = 0
        targets: list = []
        specs = []
        for x in leaves:
            off = _round_up(off, ALIGN_BYTES)
            if isinstance(x, (Stack, torch.Tensor)):
                n = x.nbytes if isinstance(x, Stack) else x.numel() * x.element_size()
                shape = tuple(x.shape)
                targets.append(self._view(slot, off, n, x.dtype, shape) if n else None)
                specs.append((LEAF, "torch", off, n, str(x.dtype)[6:], shape))
            else:
                n = x.nbytes
                arr = self._u8[base + off: base + off + n].numpy()
                targets.append(arr.view(x.dtype).reshape(x.shape) if n else None)
                specs.append((LEAF, "numpy", off, n, x.dtype.str, tuple(x.shape)))
            off += n
        plan = _Plan(layout, skel, targets, _respec(skel, specs))
        if _reusable(skel):
            self._plans[slot] = plan
        return plan

    def unlink(self) -> None:
        """Remove this ring's current file (the main process died before mapping it)."""
        if self.gen >= 0:
            try:
                os.unlink(segment_path(self.prefix, self.worker, self.life, self.gen))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self._views = {}
        self._plans = {}
        self._u8 = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view still exported; the GC will unmap it
                pass
            self._mm = None


def _respec(skel: Any, specs: list) -> Any:
    """The skeleton with each (LEAF, index) node replaced by its (LEAF, kind, ...) node."""
    if type(skel) is not tuple:
        return skel
    tag = skel[0]
    if tag == LEAF:
        return specs[skel[1]]
    if tag == PICKLED:
        return skel
    _, typ, items = skel
    if tag == MAP:
        return (tag, typ, [(k, _respec(v, specs)) for k, v in items])
    return (tag, typ, [_respec(v, specs) for v in items])


# -- the main-process side ------------------------------------------------------------------

def map_segment(path: str) -> mmap.mmap:
    """Map a worker's segment and unlink its file at once (the mapping outlives the name)."""
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size)
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    return mm


def _no_leaf(node: tuple) -> Any:
    raise AssertionError(f"a skeleton without a ring names a slot leaf {node}")


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


@functools.cache
def _numpy_twin(name: str) -> np.dtype | None:
    """The numpy dtype with torch dtype ``name``'s bytes (None where numpy has none: bfloat16,
    the float8s, complex32...). A slot's tensor is shaped in numpy when it has one (numpy's
    views cost ~0.3 us, torch's ~3 us a call)."""
    try:
        return torch.empty(0, dtype=_torch_dtype(name)).numpy().dtype
    except (TypeError, RuntimeError):
        return None


def read_slot(mm: mmap.mmap | None, slot: int, slot_bytes: int, skel: Any, copy: bool,
              on_release: Callable[[Any], Any] | None) -> Any:
    """Rebuild a batch from a slot: zero-copy views or, with ``copy=True``, private copies (the
    slot is free on return). With views, ``on_release(lease)`` is called with the array they
    all view, for the caller to learn when the last one dies (a weak reference). ``mm`` is
    None for a batch without tensors (nothing in the slot; ``copy`` must be True)."""
    if mm is None:
        return unflatten(skel, _no_leaf)
    # Views read the slot through one array (the lease) that all of them keep alive; a copy
    # reads the mapping itself. Each leaf is one numpy array made straight over that buffer
    # (not a slice, a dtype view and a reshape: a tiny batch copied out in 8.2 us against 11.2,
    # benchmarks/loader_read.py).
    if copy:
        lease, start = None, slot * slot_bytes
    else:
        lease, start = np.frombuffer(mm, dtype=np.uint8, count=slot_bytes, offset=slot * slot_bytes), 0
    buf = mm if lease is None else lease

    def make(node: tuple) -> Any:
        _, kind, off, n, dtype, shape = node
        if kind == "torch":
            twin = _numpy_twin(dtype)
            if twin is not None:
                t = torch.from_numpy(np.ndarray(shape, twin, buf, start + off))
            else:  # no numpy dtype of its bytes (bfloat16...): raw bytes, viewed in torch
                t = torch.from_numpy(np.ndarray((n,), np.uint8, buf, start + off)).view(_torch_dtype(dtype)).view(shape)
            return t.clone() if copy else t
        a = np.ndarray(shape, np.dtype(dtype), buf, start + off)
        return a.copy() if copy else a

    batch = unflatten(skel, make)
    if not copy and on_release is not None:
        on_release(lease)
    return batch
