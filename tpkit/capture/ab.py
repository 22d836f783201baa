"""Kernels A/B: run the same slice twice, without and with tpkit's kernels, from the same
starting state and on the same batches, and put step time, memory and the loss side by side.

"The same state" is taken from the namespace the slice runs in: every model, optimizer and
LR scheduler is copied with ``state_dict`` before run A and put back before run B; torch's,
numpy's and Python's RNGs and every DataLoader's generator are restored too, so a loader
that the cell iterates afresh yields the same batches in the same order. (An iterator made
before the cell cannot be rewound: the A/B notes say so when one is found.)
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import pandas as pd
import torch

if TYPE_CHECKING:
    from ..run import Run

_STATEFUL = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)


@dataclass
class Snapshot:
    """Everything a training cell changes that run B must start from again."""

    states: list[tuple[Any, Any]] = field(default_factory=list)  # (object, state_dict copy)
    grads: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = field(default_factory=list)
    generators: list[tuple[torch.Generator, torch.Tensor]] = field(default_factory=list)
    torch_rng: torch.Tensor | None = None
    numpy_rng: Any = None
    python_rng: Any = None
    iterators: list[str] = field(default_factory=list)  # names of live iterators (cannot rewind)

    @classmethod
    def take(cls, ns: dict[str, Any]) -> "Snapshot":
        snap = cls(torch_rng=torch.get_rng_state(), numpy_rng=np.random.get_state(), python_rng=random.getstate())
        seen: set[int] = set()
        for name, obj in list(ns.items()):
            if name.startswith("_") or id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, _STATEFUL) or _is_tpkit_loader(obj):
                snap.states.append((obj, copy.deepcopy(obj.state_dict())))
            if isinstance(obj, torch.nn.Module):  # state_dict leaves out .grad
                snap.grads += [(p, None if p.grad is None else p.grad.detach().clone()) for p in obj.parameters()]
            gen = getattr(obj, "generator", None)
            if isinstance(obj, torch.utils.data.DataLoader) and isinstance(gen, torch.Generator):
                snap.generators.append((gen, gen.get_state()))
            if isinstance(obj, Iterator):  # a DataLoader iterator, a generator, iter(list)...
                snap.iterators.append(name)
        return snap

    def restore(self) -> None:
        for obj, state in self.states:
            obj.load_state_dict(copy.deepcopy(state))
        for param, grad in self.grads:
            param.grad = None if grad is None else grad.clone()
        for gen, state in self.generators:
            gen.set_state(state)
        if self.torch_rng is not None:
            torch.set_rng_state(self.torch_rng)
        np.random.set_state(self.numpy_rng)
        random.setstate(self.python_rng)


def _is_tpkit_loader(obj: Any) -> bool:
    return type(obj).__module__.startswith("tpkit.data") and hasattr(obj, "load_state_dict")


def models_in(ns: dict[str, Any]) -> list[torch.nn.Module]:
    """Top-level models of a namespace (not submodules of another one found there)."""
    mods = [v for k, v in ns.items() if not k.startswith("_") and isinstance(v, torch.nn.Module)]
    inner = {id(m) for top in mods for m in top.modules() if m is not top}
    out, seen = [], set()
    for m in mods:
        if id(m) not in inner and id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


@dataclass
class ABResult:
    """Run A and run B of ``--kernels ab`` on the same batches, with their loss comparison."""
    a: "Run"
    b: "Run"
    losses: pd.DataFrame  # kernels/ab.py COLUMNS: step, loss_a, loss_b, diff, abs_diff, rel_diff, within_tol
    verdict: Any  # kernels.ab.LossVerdict
    swapped: list[str]
    notes: list[str]

    def to_text(self) -> str:
        sa, sb = self.a.summary(), self.b.summary()
        speed = sb.throughput / sa.throughput if sa.throughput else float("nan")
        (a25, a75), (b25, b75) = _quartiles_ms(self.a), _quartiles_ms(self.b)
        apart = a75 < b25 or b75 < a25  # A's and B's middle halves of step times do not overlap
        lines = [f"kernels A/B: A '{self.a.name}' (off) vs B '{self.b.name}' (on: {len(self.swapped)} modules swapped)",
                 f"  throughput {sa.throughput:,.1f} -> {sb.throughput:,.1f} samples/s ({speed:.2f}x)",
                 f"  step p50 {sa.step_p50_s * 1e3:.2f} [{a25:.2f}-{a75:.2f}] -> {sb.step_p50_s * 1e3:.2f} "
                 f"[{b25:.2f}-{b75:.2f}] ms (p25-p75): "
                 + ("apart" if apart else "they overlap: within the noise of A and B running one after the other"),
                 f"  loss: {self.verdict.message}"]
        notes = list(self.notes)
        if self.swapped and _interpreted():
            notes.append("B's kernels ran in Triton's interpreter (TRITON_INTERPRET=1, no GPU): its speed checks "
                         "correctness only and says nothing of a GPU's")
        return "\n".join(lines + [f"  note: {n}" for n in notes])


def _quartiles_ms(run: "Run") -> tuple[float, float]:
    d = run.measured_steps["duration_s"] * 1e3
    return (float(d.quantile(0.25)), float(d.quantile(0.75))) if len(d) else (float("nan"), float("nan"))


def _interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


def run_ab(run_slice: Callable[[str, dict[str, Any]], "Run"], ns: dict[str, Any], name: str) -> ABResult:
    """Run A with kernels off, restore the starting state, run B with kernels on.

    ``run_slice(name, knobs)`` profiles one slice of the user's code and returns its Run
    (raising what the code raised). Kernels are unpatched again after B.
    """
    from tpkit.kernels import patch, patched, unpatch
    from tpkit.kernels.ab import compare_losses

    models = models_in(ns)
    if not models:
        raise ValueError("--kernels ab found no torch.nn.Module in the notebook's variables: "
                         "define the model before the cell (e.g. model = MyModel())")
    already = [m for m in models if patched(m)]
    for m in already:  # run A is the plain model
        unpatch(m)
    snap = Snapshot.take(ns)
    notes = [f"iterator {n!r} was made before the cell and cannot be rewound: run B reads on from where A stopped"
             for n in snap.iterators]
    run_a = run_slice(f"{name}-A", {"kernels": "off"})
    snap.restore()
    swapped = [f"{type(m).__name__}.{s.name} ({s.kind})" for m in models for s in patch(m)]
    try:
        run_b = run_slice(f"{name}-B", {"kernels": "on"})
    finally:
        for m in models:
            unpatch(m)
        for m in already:
            patch(m)
    if not swapped:
        notes.append("no module matched a kernel: runs A and B ran the same code")
    losses, verdict = compare_losses(run_a.steps[["step", "loss"]].dropna(), run_b.steps[["step", "loss"]].dropna())
    if snap.iterators and not verdict.ok:  # different batches, not different numerics
        names = ", ".join(repr(n) for n in snap.iterators)
        verdict = dataclasses.replace(verdict, message=(
            f"NOT COMPARABLE: run B read other batches than run A (iterator {names} was made before the cell; "
            f"make it inside the cell, or iterate a DataLoader there) - {verdict.message}"))
    return ABResult(run_a, run_b, losses, verdict, swapped, notes)
