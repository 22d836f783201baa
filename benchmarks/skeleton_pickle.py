"""What a loader worker's answer costs to pickle: tpkit's slot skeleton (plain tuples, since
session 27) against the same skeleton built from placeholder objects with a ``__reduce__`` and
type references, as tpkit sent it before (rebuilt here as the peer: that code is gone).

A worker pickles one answer for every batch it makes (tpkit/data/worker_loop.py,
``done_to_wire``). Both are timed on the same batches in turns, best of ``--rounds``: the tiny
workload's batch of benchmarks/loader.py (64 samples of 8 floats and an int) and a dict batch
of four tensors and a list of strings.

    python benchmarks/skeleton_pickle.py [--rounds 7] [--number 20000]
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import load_avg, machine, versions, write_rows  # noqa: E402


class _Leaf:
    """The pre-session-27 placeholder of a tensor in a skeleton."""

    __slots__ = ("spec",)

    def __init__(self, spec: tuple) -> None:
        self.spec = spec

    def __reduce__(self):
        return (_Leaf, (self.spec,))


class _Tag:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self):
        return (_tag, (self.name,))


def _tag(name: str) -> _Tag:
    return _TAGS[name]


_TAGS = {n: _Tag(n) for n in ("map", "nt", "seq")}
_BUILTIN = {0: list, 1: tuple, 2: dict}


def as_objects(node):
    """The same skeleton with the old placeholders and type references."""
    if type(node) is not tuple:
        return node
    tag = node[0]
    if tag == 0:  # LEAF
        return _Leaf(node[1:])
    if tag == 1:  # PICKLED: unchanged in kind (bytes), kept as it is
        return node
    typ = _BUILTIN.get(node[1], node[1]) if type(node[1]) is int else node[1]
    name = {2: "map", 3: "nt", 4: "seq"}[tag]
    items = [(k, as_objects(v)) for k, v in node[2]] if tag == 2 else [as_objects(v) for v in node[2]]
    return (_TAGS[name], typ, items)


def answer(skel) -> bytes:
    """A worker's answer as ``done_to_wire`` writes it, with ``skel`` as its skeleton."""
    return pickle.dumps((12, 3, 0, 4096, pickle.dumps(skel, pickle.HIGHEST_PROTOCOL), 1e-4, 2e-5, 3e-5,
                         123456789012345, 64), pickle.HIGHEST_PROTOCOL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--number", type=int, default=20000, help="answers pickled per round")
    args = ap.parse_args()
    from tpkit.data.collate import deferred_collate
    from tpkit.data.slots import WorkerRing, remove_segments
    from tpkit.datasets import TinySamples

    ds = TinySamples(64)
    batches = {
        "tiny (float[8], int) x 64": deferred_collate([ds[i] for i in range(64)]),
        "dict of 4 tensors + 4 strings": {"x": torch.ones(4, 8), "y": torch.zeros(4, dtype=torch.long),
                                          "mask": torch.ones(4, 8, dtype=torch.bool), "w": torch.rand(4),
                                          "names": ["a", "b", "c", "d"]},
    }
    prefix = str(Path(tempfile.gettempdir()) / f"tpk-skeleton-bench-{id(ds)}-")
    ring = WorkerRing(prefix, 0, 0, 1)
    print(f"{machine()}; load average at start {' / '.join(f'{x:.2f}' for x in load_avg())}; {versions()}")
    print(f"a worker's answer pickled, best of {args.rounds} rounds of {args.number:,}")
    rows = []
    try:
        for name, batch in batches.items():
            skel, _, _ = ring.write(0, batch)
            old = as_objects(skel)
            assert pickle.loads(pickle.dumps(old)) is not None
            best = {"tpkit (plain tuples)": float("inf"), "placeholder objects (before)": float("inf")}
            for _ in range(args.rounds):
                for label, s in (("tpkit (plain tuples)", skel), ("placeholder objects (before)", old)):
                    t = timeit.timeit(lambda s=s: answer(s), number=args.number) / args.number
                    best[label] = min(best[label], t)
            new_us, old_us = best["tpkit (plain tuples)"] * 1e6, best["placeholder objects (before)"] * 1e6
            print(f"  {name:32s} tpkit {new_us:5.2f} us, placeholder objects {old_us:5.2f} us: "
                  f"{new_us / old_us:.2f}x their time")
            rows.append({"batch": name, "tpkit_us": new_us, "placeholders_us": old_us,
                         "ratio": new_us / old_us})
    finally:
        ring.close()
        ring.unlink()
        remove_segments(prefix)
    print(f"wrote {len(rows)} rows to {write_rows('skeleton_pickle', rows)}")


if __name__ == "__main__":
    main()
