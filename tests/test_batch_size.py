"""How many samples a batch holds (``phases.batch_size_of``), for the shapes loaders hand out.

Truth: the batch size each batch was built with.
"""

from __future__ import annotations

from collections import UserDict

import numpy as np
import pytest
import torch

from tpkit.capture.probes.phases import batch_size_of

B = 4


@pytest.mark.parametrize("batch", [
    torch.zeros(B, 3),
    (torch.zeros(B, 8), torch.zeros(B)),
    [torch.zeros(B, 8), torch.zeros(B)],
    {"input": torch.zeros(B, 8), "label": torch.zeros(B)},
    UserDict({"input_ids": torch.zeros(B, 16, dtype=torch.long)}),  # a Mapping that is no dict
    (["a", "b", "c", "d"], torch.zeros(B)),  # texts, then labels
    ((torch.zeros(B, 16), torch.zeros(B, 16)), torch.zeros(B)),  # (ids, mask), labels
    np.zeros((B, 5)),
    # a detection loader's tuple(zip(*batch)): per-sample images (channels first) and targets
    (tuple(torch.zeros(3, 10, 10) for _ in range(B)), tuple({"boxes": torch.zeros(2, 4), "labels": torch.zeros(2)}
                                                            for _ in range(B))),
    [{"x": torch.zeros(8), "y": 1.0} for _ in range(B)],  # records, not collated
], ids=["tensor", "tuple", "list", "dict", "mapping", "texts", "nested", "numpy", "detection", "records"])
def test_samples_in_a_batch(batch):
    assert batch_size_of(batch) == B


def test_hugging_face_batch_encoding():
    """What a tokenizer or an HF data collator returns: a ``UserDict``, not a dict (it counted
    0 samples, and samples/s was unknown)."""
    transformers = pytest.importorskip("transformers")
    batch = transformers.BatchEncoding({"input_ids": torch.zeros(B, 16, dtype=torch.long),
                                        "attention_mask": torch.ones(B, 16, dtype=torch.long)})
    assert batch_size_of(batch) == B


@pytest.mark.parametrize("batch", [[], {}, (), object(), [None]], ids=["list", "dict", "tuple", "object", "none"])
def test_what_it_cannot_tell_is_none(batch):
    assert batch_size_of(batch) is None


def test_two_different_mappings_are_not_records():
    """(inputs, targets) as two mappings with different keys: the inputs' leading dimension."""
    assert batch_size_of(({"ids": torch.zeros(B, 16)}, {"labels": torch.zeros(B)})) == B
