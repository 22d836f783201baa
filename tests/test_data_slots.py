"""The slot ring's batch layout: what a worker writes is what the main process reads back, and
the skeleton sent for every batch pickles in C (plain tuples, no class to look up)."""

from __future__ import annotations

import collections
import os
import pickle
import pickletools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpkit.data.slots import WorkerRing, read_slot, remove_segments, segment_prefix

Point = collections.namedtuple("Point", "x y")

_DTYPES = [torch.float32, torch.float64, torch.int64, torch.int8, torch.bool, torch.bfloat16]
tensors = st.builds(
    lambda dt, shape, seed: (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 10).to(dt),
    st.sampled_from(_DTYPES), st.lists(st.integers(0, 4), max_size=3).map(tuple), st.integers(0, 99))
arrays = st.builds(lambda n, k: np.arange(n, dtype=np.int16) * k, st.integers(0, 6), st.integers(-3, 3))
plain = st.one_of(st.integers(-2**40, 2**40), st.floats(allow_nan=False), st.text(max_size=5),
                  st.none(), st.booleans(), st.binary(max_size=4))
batches = st.recursive(
    st.one_of(tensors, arrays, plain),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=3), inner, max_size=3),
        st.dictionaries(st.text(max_size=3), inner, max_size=3).map(collections.OrderedDict),
        st.tuples(inner, inner).map(lambda t: Point(*t))),
    max_leaves=8)


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def ring():
    prefix = segment_prefix(os.getpid(), 990_001)  # a loader id no test loader reaches
    r = WorkerRing(prefix, 0, 0, 2)
    yield r
    r.close()
    r.unlink()
    remove_segments(prefix)


@settings(max_examples=150, deadline=None)
@given(batch=batches, copy=st.booleans())
def test_a_batch_read_back_from_its_slot_is_the_batch_written(ring, batch, copy):
    skel, gen, slot_bytes = ring.write(1, batch)
    wire = pickle.loads(pickle.dumps(skel, pickle.HIGHEST_PROTOCOL))  # as the pipe carries it
    mm = ring._mm if gen >= 0 else None
    got = read_slot(mm, 1, slot_bytes, wire, copy=copy or mm is None, on_release=None)
    assert same(got, batch)


def test_a_skeleton_of_builtin_containers_pickles_without_a_single_global(ring):
    """A worker pickles a skeleton for every batch: a class reference costs pickle an import
    lookup (four times the rest of a small skeleton), a ``__reduce__`` a Python call."""
    batch = {"x": torch.ones(4, 3), "y": [np.zeros(2), (1, "a", None)], "z": [torch.zeros(2)]}
    skel, _, _ = ring.write(0, batch)
    ops = {op.name for op, _, _ in pickletools.genops(pickle.dumps(skel, pickle.HIGHEST_PROTOCOL))}
    assert not ops & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "NEWOBJ", "BUILD"}, ops
    # a user's own container type is kept, by reference
    skel, _, _ = ring.write(0, Point(torch.ones(1), 2))
    assert "STACK_GLOBAL" in {op.name for op, _, _ in pickletools.genops(pickle.dumps(skel, 5))}


# -- a slot's layout kept for its next batch ----------------------------------------------------
_counter = iter(range(10**9))


def _t(*shape, dtype=torch.float32):
    """A tensor of fresh values (a stale copy from an earlier batch would not equal it)."""
    return (torch.arange(int(np.prod(shape)), dtype=torch.float64) + next(_counter)).reshape(shape).to(dtype)


VARIANTS = [  # batches whose layouts differ from one another in one thing each
    lambda: (_t(4, 3), True),
    lambda: (_t(4, 3), 1),  # == True, and == 1.0: must come back an int
    lambda: (_t(4, 3), 1.0),
    lambda: (_t(4, 3), -0.0),
    lambda: (_t(4, 3), 0.0),
    lambda: {"x": _t(4, 3), "name": "a"},
    lambda: {"x": _t(4, 3), "name": "b"},
    lambda: {"name": "a", "x": _t(4, 3)},  # the same keys in another order
    lambda: {"x": _t(2, 3), "name": "a"},  # another shape
    lambda: {"x": _t(4, 3, dtype=torch.float64), "name": "a"},  # another dtype
    lambda: {"x": _t(4, 3), "name": "a", "ids": np.arange(3, dtype=np.int16) + next(_counter) % 100},
    lambda: [_t(4, 3), _t(0)],  # an empty tensor: nothing to copy
    lambda: Point(_t(4, 3), b"k"),
]


def _samples() -> list:
    k = next(_counter)
    return [(torch.full((8,), float(k + i)), k + i) for i in range(5)]


@settings(max_examples=60, deadline=None)
@given(seq=st.lists(st.tuples(st.integers(0, len(VARIANTS)), st.integers(0, 1)), min_size=2, max_size=14))
def test_every_batch_reads_back_right_whether_its_slot_held_the_same_layout_or_another(ring, seq):
    """A slot keeps the layout of its last batch, and the next batch of that layout (same
    skeleton, leaf types, dtypes and shapes) is copied straight into place. A value that only
    compares equal (``True == 1 == 1.0``, ``-0.0 == 0.0``) is another layout: without that rule
    ``1`` came back ``True``. The last variant is what a worker writes: a deferred collate."""
    from tpkit.data.collate import deferred_collate

    for k, slot in seq:
        if k == len(VARIANTS):
            samples = _samples()
            batch, want = deferred_collate(samples), torch.utils.data.default_collate(samples)
        else:
            batch = want = VARIANTS[k]()
        skel, gen, slot_bytes = ring.write(slot, batch)
        wire = pickle.loads(pickle.dumps(skel, pickle.HIGHEST_PROTOCOL))
        got = read_slot(ring._mm, slot, slot_bytes, wire, copy=True, on_release=None)
        assert same(got, want), (k, got, want)


def test_a_slots_next_batch_of_the_same_layout_is_written_without_laying_it_out_again(monkeypatch):
    from tpkit.data.collate import deferred_collate

    prefix = segment_prefix(os.getpid(), 990_002)
    ring = WorkerRing(prefix, 0, 0, 2)
    plans = []
    real = WorkerRing._plan
    monkeypatch.setattr(WorkerRing, "_plan", lambda self, *a: plans.append(a[0]) or real(self, *a))
    for _ in range(5):
        ring.write(0, deferred_collate(_samples()))
        ring.write(1, deferred_collate(_samples()))
    ring.write(0, {"x": _t(4, 3), "name": "a"})
    ring.write(0, {"x": _t(4, 3), "name": "a"})
    ring.write(0, {"x": _t(4, 3), "flag": 1})  # a plain number: laid out every time
    ring.write(0, {"x": _t(4, 3), "flag": 1})
    ring.close()
    remove_segments(prefix)
    assert plans == [0, 1, 0, 0, 0]


def test_an_unsupported_object_deep_in_a_batch_is_named_by_its_place():
    from tpkit.data.errors import UnsupportedBatchError
    from tpkit.data.slots import flatten

    class Box:
        pass

    with pytest.raises(UnsupportedBatchError, match=r"^batch\['a'\]\[1\]\.y is a .*Box that cannot be pickled"):
        flatten({"a": [1, Point(torch.zeros(1), Box())]}, [])
