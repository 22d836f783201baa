"""tpkit's collate of plain numbers is torch's default_collate, only faster: same tensors, same
dtypes, same errors, for every mix of ints, floats and bools a batch field can hold."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import default_collate

from tpkit.data.collate import deferred_collate, fast_default_collate
from tpkit.data.slots import flatten

INT64_MAX = 2**63 - 1
number = st.one_of(
    st.integers(min_value=-(2**63), max_value=INT64_MAX),
    st.integers(min_value=INT64_MAX + 1, max_value=2**70),  # past int64: torch raises
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
)
field = st.one_of(
    st.lists(st.integers(min_value=-(2**63), max_value=INT64_MAX), min_size=1, max_size=70),
    st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=70),
    st.lists(number, min_size=1, max_size=70),
)


def outcome(fn, samples):
    try:
        return fn(samples)
    except Exception as e:  # the same error type as torch's, or the test fails
        return type(e)


def same(a, b) -> bool:
    if isinstance(a, type) or isinstance(b, type):
        return a is b
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:  # bit for bit, NaN and infinities included
        return torch.equal(a.view(torch.int64 if a.element_size() == 8 else torch.int32),
                           b.view(torch.int64 if b.element_size() == 8 else torch.int32))
    return torch.equal(a, b)


@settings(max_examples=300, deadline=None)
@given(field, field)
def test_fast_collate_gives_torchs_tensors_for_any_mix_of_numbers(xs, ys):
    n = min(len(xs), len(ys))
    samples = [(torch.full((2,), float(k)), xs[k], ys[k]) for k in range(n)]
    assert same(outcome(fast_default_collate, samples), outcome(default_collate, samples))


def test_plain_ints_and_floats_come_out_as_int64_and_float64_owned_by_torch():
    labels, weights = [3, -1, 7], [0.5, 1.0, -2.25]
    out = fast_default_collate([{"y": y, "w": w} for y, w in zip(labels, weights)])
    assert out["y"].dtype == torch.int64 and out["y"].tolist() == labels
    assert out["w"].dtype == torch.float64 and out["w"].tolist() == weights
    out["y"].resize_(10)  # torch's CPU allocator owns the storage, as with torch.tensor
    assert out["y"].shape == (10,)


def test_a_float_among_ints_or_a_bool_field_keeps_torchs_inference():
    for batch in ([1, 2.5], [True, False], [1, True], [2**63]):
        assert same(outcome(fast_default_collate, batch), outcome(default_collate, batch))


def test_workers_collate_numbers_the_same_way_into_the_slot():
    samples = [(torch.ones(3), k, k / 4) for k in range(5)]
    leaves: list = []
    flatten(deferred_collate(samples), leaves)
    ints, floats = leaves[1], leaves[2]
    assert ints.dtype == torch.int64 and ints.tolist() == [0, 1, 2, 3, 4]
    assert floats.dtype == torch.float64 and floats.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize("batch", [[2**63 - 1, -(2**63)], [0]])
def test_int64_limits_are_exact(batch):
    assert fast_default_collate(batch).tolist() == batch
