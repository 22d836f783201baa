"""How many samples a batch holds (``batches.batch_size_of``), for the shapes loaders hand out.

Truth: the batch size each batch was built with.
"""

from __future__ import annotations

import dataclasses
from collections import UserDict
from typing import NamedTuple

import numpy as np
import pytest
import torch
from graph_store import Storage, StoredAttributes

from tpkit.capture.probes.batches import batch_size_of

B = 4


@dataclasses.dataclass
class Batch:
    """A batch class of the loop's own, as a custom ``collate_fn`` returns it."""

    ids: torch.Tensor | None
    labels: torch.Tensor


@dataclasses.dataclass
class Tagged:
    """A name first, and a field set later (unset, reading it raises)."""

    task: str
    x: torch.Tensor
    extra: torch.Tensor = dataclasses.field(init=False)


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class Holder:
    """Any object with its tensors as attributes."""

    def __init__(self) -> None:
        self.name = "batch"
        self.inputs = torch.zeros(B, 8)


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
    [(torch.zeros(8), torch.zeros(1)) for _ in range(B)],  # collate_fn=lambda b: b (it read 8)
    Batch(None, torch.zeros(B)),  # its first field that is set (it read 0)
    Pair(torch.zeros(B, 8), torch.zeros(B)),
    Holder(),
    Tagged("caption", torch.zeros(B, 8)),  # a name before the tensors, a field never set
    # list(zip(*batch)): columns (images, per-sample targets), not samples
    list(zip(*[(torch.zeros(3, 10, 10), {"boxes": torch.zeros(2, 4)}) for _ in range(B)])),
    {"tokens": [["a", "b"], ["c", "d", "e"], ["f"], ["g", "h"]]},  # pre-tokenized (it read 2 words)
    {"tokens": [["a", "b"], ["c", "d", "e"], ["f"], ["g", "h"]], "labels": torch.zeros(B)},
    (["q1", "q2", "q3", "q4"], ["a1", "a2", "a3", "a4"]),  # two text columns
    ("task", {"x": torch.zeros(B, 8), "y": torch.zeros(B)}),  # a name first (it read 2)
    {"audio": [torch.zeros(n) for n in (50, 31, 44, 12)], "labels": torch.zeros(B)},  # clips (it read 50)
    {"audio": [torch.zeros(n) for n in (50, 31, 44, 12)]},
    {"num_tokens": torch.tensor(123), "ids": torch.zeros(B, 16)},  # a 0-dim count first (it read 1)
], ids=["tensor", "tuple", "list", "dict", "mapping", "texts", "nested", "numpy", "detection", "records",
        "uncollated", "dataclass", "namedtuple", "attributes", "tagged", "detection-list",
        "words", "words-labels", "text-columns", "named", "clips-labels", "clips", "count-first"])
def test_samples_in_a_batch(batch):
    assert batch_size_of(batch) == B


@pytest.mark.parametrize("batch", [
    (torch.zeros(B, 3, 8, 8), torch.zeros(11, 6)),  # YOLO: images, then every image's boxes in one tensor
    (torch.zeros(B, 16), torch.zeros(1, 16)),  # ids, then position ids shared by the batch
    (torch.zeros(B, 20, 8), torch.zeros(37), torch.zeros(B), torch.zeros(B)),  # CTC: feats, targets, lengths
], ids=["yolo", "shared-positions", "ctc"])
def test_collated_columns_of_different_lengths_are_columns(batch):
    """Tensors of different lengths side by side at the top of a batch are its columns: the
    first one's leading dimension (the rule for per-sample clips under a key had read 2 or 4)."""
    assert batch_size_of(batch) == B


def test_a_batch_tpkit_cannot_read_is_no_error_in_the_loop():
    """A strided nested tensor has no sizes (reading ``.shape`` raises): the batch is uncounted,
    never an error in the loop's ``next()``."""
    import tpkit as tp

    nested = torch.nested.nested_tensor([torch.zeros(3), torch.zeros(5)])
    loader = torch.utils.data.DataLoader(range(40), batch_size=B, collate_fn=lambda b: (nested, torch.zeros(B)))
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with tp.profile(steps=3, warmup=0, progress=False, clock_hz=0, memory=False) as prof:
        for _, y in loader:
            model(y[:, None]).sum().backward()
            opt.step()
            opt.zero_grad()
    assert len(prof.run.steps) == 3


def test_a_detection_batch_of_one_image():
    """``tuple(zip(*batch))`` at batch size 1: one image, one target mapping (it read the
    image's 3 channels)."""
    assert batch_size_of(((torch.zeros(3, 10, 10),), ({"boxes": torch.zeros(2, 4)},))) == 1


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


def test_a_batch_it_cannot_count_is_said_with_its_type():
    """A graph batch that does not say its size and whose stored tensors differ in length (nodes,
    edges): samples/s is unknown, and the run says why (it had said "no batch seen" of batches it
    had seen) and what to do, not to read them through a DataLoader they came from."""
    import tpkit as tp

    class GraphBatch:
        def __init__(self) -> None:
            self._store = {"x": torch.zeros(3 * B, 8), "edge_index": torch.zeros(2, 40, dtype=torch.long)}

    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(range(40), batch_size=B, collate_fn=lambda _: GraphBatch())

    def train(prof_kwargs: dict) -> tp.Run:
        with tp.profile(steps=3, warmup=1, progress=False, clock_hz=0, memory=False, **prof_kwargs) as prof:
            for batch in loader:
                model(batch._store["x"][:B]).sum().backward()
                opt.step()
                opt.zero_grad()
        return prof.run

    run = train({})
    assert run.steps["samples"].tolist() == [0, 0, 0, 0]
    assert any(n.startswith("4 batch(es) read in the slice held samples tpkit could not count (a "
                            "test_a_batch_it_cannot_count_is_said_with_its_type.<locals>.GraphBatch")
               and "samples_per_step=N" in n for n in run.meta["notes"])
    text = run.summary().to_text()
    assert "samples/s unknown (no samples counted: tpkit saw the batches but could not count their samples" in text
    assert "through a DataLoader" not in text
    given = train({"samples_per_step": B})
    assert given.steps["samples"].tolist() == [B] * 4
    assert not any("could not count" in n for n in given.meta["notes"])


def test_a_given_samples_per_step_the_batches_contradict_is_kept_and_said():
    """``samples_per_step`` overrides the count (documented), but where the batches tpkit counted
    held another number the run says so: a given 5 for 16-row batches had read 237 samples/s for
    759 with no word. Two 16-row batches a step (accumulation) are 32 a step; a figure that agrees
    with them says nothing. Truth: the batch size the loader was built with."""
    import tpkit as tp

    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(torch.zeros(400, 8), batch_size=16)

    def train(given: int | None, per_step: int = 1) -> tp.Run:
        with tp.profile(steps=3, warmup=1, progress=False, clock_hz=0, memory=False, samples_per_step=given) as prof:
            for i, x in enumerate(loader):
                model(x).sum().backward()
                if i % per_step == per_step - 1:
                    opt.step()
                    opt.zero_grad()
        return prof.run

    run = train(5)
    assert run.steps["samples"].tolist() == [5] * 4  # the given figure is used
    assert ("samples_per_step=5 given, and samples/s counts it; the batches handed out held 16 samples a step: "
            "leave samples_per_step out for tpkit to count them") in run.meta["notes"]
    run = train(5, per_step=2)
    assert any("held 32 samples a step (batches of 16)" in n for n in run.meta["notes"])
    for given, per_step in ((16, 1), (32, 2)):
        assert not any(n.startswith("samples_per_step=") for n in train(given, per_step).meta["notes"])
    assert not any(n.startswith("samples_per_step=") for n in train(None).meta["notes"])


def test_two_different_mappings_are_not_records():
    """(inputs, targets) as two mappings with different keys: the inputs' leading dimension."""
    assert batch_size_of(({"ids": torch.zeros(B, 16)}, {"labels": torch.zeros(B)})) == B


class GraphBatch(StoredAttributes):
    """A batch of graphs, as PyG's ``Batch``: its tensors (node-, edge- and graph-level) in a
    ``_store``, read as attributes; the graphs it holds said by ``num_graphs``."""

    def __init__(self, graphs: int, nodes: int = 10, said: bool = True) -> None:
        self.__dict__["_store"] = Storage(
            x=torch.zeros(graphs * nodes, 16), edge_index=torch.zeros(2, graphs * 3 * nodes, dtype=torch.long),
            y=torch.zeros(graphs, dtype=torch.long), batch=torch.arange(graphs).repeat_interleave(nodes),
            ptr=torch.arange(graphs + 1) * nodes)
        self.__dict__["_said"] = said

    @property
    def num_graphs(self) -> int:
        if not self._said:
            raise AttributeError("num_graphs")
        return int(self.y.shape[0])


class Records:
    """A batch object of records whose tensors sit in a store and agree in length."""

    def __init__(self) -> None:
        self.store = Storage(x=torch.zeros(B, 8), y=torch.zeros(B))


def test_a_batch_that_says_its_size_is_counted_by_it():
    """A graph batch is as many samples as it says it holds (PyG's ``num_graphs``), not its
    node count (its first tensor's leading dimension); one that says nothing, with tensors in a
    store that differ in length, cannot be told; one whose stored tensors agree is their length.
    Truth: the graphs each batch was built of."""
    assert batch_size_of(GraphBatch(B)) == B
    assert batch_size_of(GraphBatch(B, said=False)) is None
    assert batch_size_of(Records()) == B


def test_a_graph_loop_counts_its_graphs():
    """A DataLoader of graph batches (PyG's DataLoader is a torch one): samples are the graphs
    (it had read 0 a step, samples/s unknown, and said to read batches through a DataLoader).
    Truth: the loop's own count of graphs."""
    import tpkit as tp

    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(range(40), batch_size=B, collate_fn=lambda items: GraphBatch(len(items)))
    seen = []
    with tp.profile(steps=3, warmup=1, progress=False, clock_hz=0, memory=False) as prof:
        for batch in loader:
            seen.append(batch.num_graphs)
            model(batch.x).sum().backward()
            opt.step()
            opt.zero_grad()
    assert prof.run.steps["samples"].tolist() == seen[:4] == [B] * 4
    assert not any("could not count" in n for n in prof.run.meta["notes"])


class LoopBatch:
    """A batch class of the loop's own, given the loader's nominal batch size."""

    def __init__(self, x: torch.Tensor, batch_size: int) -> None:
        self.x, self.y, self.batch_size = x, x.sum(1), batch_size


class Task:
    """A task object a multitask loader hands out before the batch: settings, no tensor."""

    batch_size = 256


def test_a_batch_object_is_its_rows_and_an_object_without_tensors_is_no_batch():
    """A loop's own batch class is as many samples as its tensors' rows: the last batch of 40
    in 16s is 8, whatever nominal ``batch_size`` it was given (it had read 16); an object
    holding no tensor says no size (a task's settings before the batch had read 256 for 16;
    unknown, as before the stores were read). Truth: the rows the loop made."""
    assert batch_size_of(LoopBatch(torch.zeros(8, 4), batch_size=16)) == 8
    assert batch_size_of((Task(), torch.zeros(16, 4))) is None
