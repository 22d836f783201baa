"""Kernels A/B: run the same slice twice, without and with tpkit's kernels, from the same
starting state and on the same batches, and put step time, memory and the loss side by side.

"The same state" is found where a loop keeps it: from the namespace the slice runs in, tpkit
follows dicts, lists, tuples, deques and the attributes of objects (not those of torch, numpy,
pandas, IPython or the standard library) up to ``_DEPTH`` levels below a name, each object
once and at most ``_MAX_OBJECTS`` objects (``_MAX_ITEMS`` items of one container), so a huge
namespace costs milliseconds. Before run B it puts back:

- every object with ``state_dict``/``load_state_dict`` it reaches (models, with their
  gradients, optimizers, LR schedulers, GradScalers, tpkit loaders, an EMA helper...), from a
  deep copy taken before run A, wherever it was reached (a Lightning trainer's model too);
- every binding of the user's own it walked: the namespace's names, and the dict entries, list
  items and attributes of the user's objects (their classes defined in the notebook, in
  ``__main__`` or in a module outside site-packages) and of the containers reached through
  them, rebound to what they held before A (a ``global_step`` counter, ``state['opt']``,
  ``trainer.step``, a history list's items); entries and attributes that A added are removed.
  A library's objects (wandb's run, a Lightning trainer, a transformers config, an omegaconf
  node) are walked only to find what has a state_dict: their attributes are theirs to keep (a
  wandb run's step counter put back had B's logs rejected, and the objects deeper than the
  walk kept A's state: two states mixed);
- the RNGs: torch's CPU generator, every CUDA device's, numpy's, Python's ``random``, and every
  ``torch.Generator`` reached (a DataLoader's or its sampler's included), so a loader that the
  cell iterates afresh yields the same batches in the same order.

What it cannot put back it reports instead of blaming the kernels: an iterator made before the
cell (it cannot be rewound), a tensor outside those state dicts changed in place during A (seen
by its version counter; tensors are not copied, a dataset's could be gigabytes), an object
whose ``state_dict()`` or ``load_state_dict()`` fails (a module that registered a buffer in its
first forward is loaded with ``strict=False`` and said to keep run A's new keys; a lazy module
materialised in A, an object that refuses a second load: said, and run B goes on from A's end
state for them), and a walk cut short by its bounds.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import itertools
import operator
import random
import re
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import pandas as pd
import torch

if TYPE_CHECKING:
    from ..run import Run

_DEPTH = 4  # a name is depth 0; state['opt'] and trainer.opt are depth 1
_MAX_OBJECTS = 20_000  # objects looked at, at most
_MAX_ITEMS = 100  # items of one container followed further (all of them are put back)
_PLAIN = (int, float, bool, str, bytes, complex, type(None))
_NOT_STATE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
# IPython's own names: input/output history and dunders; they do not change inside a cell
_IPYTHON_NAME = re.compile(r"_+|_i+|_i\d+|_\d+|_ih|_oh|_dh|In|Out|__\w+__")
# packages whose objects' attributes are theirs to manage, not the loop's state
_LIBRARIES = frozenset({"torch", "numpy", "pandas", "IPython", "ipykernel", "ipywidgets", "traitlets", "zmq",
                        "tpkit", "kernels", "triton", "altair", "matplotlib", "pyarrow", "tqdm"}
                       | set(sys.stdlib_module_names))


def _is_stateful(obj: Any) -> bool:
    """Has ``state_dict`` and ``load_state_dict`` (a module, optimizer, scheduler, GradScaler...)."""
    kind = type(obj)
    return callable(getattr(kind, "state_dict", None)) and callable(getattr(kind, "load_state_dict", None))


def _users_object(obj: Any) -> bool:
    """An instance of a class outside torch, numpy, IPython, the standard library... whose
    attributes are plain Python state (a trainer, a config, a state holder, a library's object)."""
    return type(getattr(obj, "__dict__", None)) is dict and type(obj).__module__.split(".")[0] not in _LIBRARIES


_OWN_MODULES: dict[str, bool] = {}  # module name -> whether its classes are the user's own


def _users_own(obj: Any) -> bool:
    """Whether ``obj``'s class is the user's own: defined in the notebook or ``__main__``, or in
    a module not installed in site-packages (a ``train_utils.py`` beside the notebook)."""
    name = type(obj).__module__
    own = _OWN_MODULES.get(name)
    if own is None:
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None) if module is not None else None
        own = name == "__main__" or module is None or not file or not any(
            part in ("site-packages", "dist-packages") for part in re.split(r"[\\/]", file))
        _OWN_MODULES[name] = own
    return own


def _children(obj: Any, path: str) -> Iterator[tuple[Any, str]]:
    """What a walked object holds, with paths; nothing for stateful objects, tensors, iterators."""
    if isinstance(obj, dict):
        for i, (k, v) in enumerate(obj.items()):
            if i == _MAX_ITEMS:
                return
            yield v, f"{path}[{k!r}]"
    elif isinstance(obj, (list, tuple, collections.deque)):
        for i, v in enumerate(obj):
            if i == _MAX_ITEMS:
                return
            yield v, f"{path}[{i}]"
    elif _users_object(obj) and not _is_stateful(obj) and not isinstance(obj, Iterator):
        for k, v in list(vars(obj).items())[:_MAX_ITEMS]:
            yield v, f"{path}.{k}"


def _holds_state_past(container: Any) -> bool:
    """Whether a container holds anything but plain values past its ``_MAX_ITEMS``-th item (a
    scan of type checks: ~50 ns an item)."""
    items = itertools.islice(container.values() if isinstance(container, dict) else container, _MAX_ITEMS, None)
    return any(type(v) not in _PLAIN and not isinstance(v, _NOT_STATE) for v in items)


def reachable(ns: dict[str, Any], owned: list[bool] | None = None,
              truncated: list[str] | None = None) -> tuple[list[tuple[Any, str]], bool]:
    """Objects reachable from a namespace (breadth first, each once, within the bounds) with
    the path of their first sighting, and whether the bounds cut the walk short. ``owned``, if
    given, is filled with whether each was reached through the user's own bindings only (the
    namespace, containers, the user's own objects: ``_users_own``), not through a library's
    object; ``truncated`` with the paths of the containers whose items past the ``_MAX_ITEMS``-th
    were not looked into (a model in a dict's 140th entry had been left as run A left it, unsaid)."""
    seen: set[int] = set()
    out: list[tuple[Any, str]] = []
    mine: list[bool] = []
    level = [(v, k, True) for k, v in ns.items() if not _IPYTHON_NAME.fullmatch(k)]
    for depth in range(_DEPTH + 1):
        below: list[tuple[Any, str, bool]] = []
        for obj, path, own in level:
            if type(obj) in _PLAIN or isinstance(obj, _NOT_STATE) or id(obj) in seen:
                continue
            if len(out) == _MAX_OBJECTS:
                if owned is not None:
                    owned[:] = mine
                return out, True
            seen.add(id(obj))
            out.append((obj, path))
            mine.append(own)
            if depth < _DEPTH:
                if truncated is not None and isinstance(obj, (dict, list, tuple, collections.deque)) \
                        and len(obj) > _MAX_ITEMS and _holds_state_past(obj):
                    truncated.append(path)
                own_below = own and (isinstance(obj, (dict, list, tuple, collections.deque)) or _users_own(obj))
                below += ((v, p, own_below) for v, p in _children(obj, path))
        level = below
    if owned is not None:
        owned[:] = mine
    return out, False


@dataclass
class Snapshot:
    """Everything a training cell changes that run B must start from again."""

    states: list[tuple[Any, str, Any]] = field(default_factory=list)  # (object, path, state_dict copy)
    grads: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = field(default_factory=list)
    generators: list[tuple[torch.Generator, torch.Tensor]] = field(default_factory=list)
    bindings: list[tuple[Any, str, Any]] = field(default_factory=list)  # (container, path, shallow copy)
    tensors: list[tuple[torch.Tensor, str, int]] = field(default_factory=list)  # (tensor, path, _version)
    torch_rng: torch.Tensor | None = None
    cuda_rng: list[torch.Tensor] | None = None  # None: CUDA not initialised before run A
    numpy_rng: Any = None
    python_rng: Any = None
    iterators: list[str] = field(default_factory=list)  # paths of live iterators (cannot rewind)
    cut_short: bool = False  # the walk hit _MAX_OBJECTS
    truncated: list[str] = field(default_factory=list)  # containers whose items past _MAX_ITEMS were not walked
    unsaved: list[str] = field(default_factory=list)  # stateful objects whose state_dict() failed
    rebound: list[str] = field(default_factory=list)  # filled by restore(): bindings put back

    @classmethod
    def take(cls, ns: dict[str, Any]) -> "Snapshot":
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        snap = cls(torch_rng=torch.get_rng_state(), cuda_rng=torch.cuda.get_rng_state_all() if cuda else None,
                   numpy_rng=np.random.get_state(), python_rng=random.getstate())
        snap.bindings.append((ns, "", {k: v for k, v in ns.items() if not _IPYTHON_NAME.fullmatch(k)}))
        owned: list[bool] = []
        objects, snap.cut_short = reachable(ns, owned, snap.truncated)
        restored_tensors: set[int] = set()
        for (obj, path), own in zip(objects, owned):
            if isinstance(obj, torch.Tensor):
                version = _version(obj)
                if version is not None:
                    snap.tensors.append((obj, path, version))
            elif type(obj) is torch.Generator:  # (isinstance on it costs 6 us)
                snap.generators.append((obj, obj.get_state()))
            elif isinstance(obj, torch.utils.data.DataLoader):
                for gen in (obj.generator, getattr(obj.sampler, "generator", None)):
                    if isinstance(gen, torch.Generator):
                        snap.generators.append((gen, gen.get_state()))
            elif _is_stateful(obj):
                try:
                    snap.states.append((obj, path, copy.deepcopy(obj.state_dict())))
                except Exception as e:  # noqa: BLE001 - a state_dict that fails; said after run A
                    snap.unsaved.append(f"{path}'s state_dict() raised {type(e).__name__}: it was not put back")
                    continue
                if isinstance(obj, torch.nn.Module):  # state_dict leaves out .grad
                    snap.grads += [(p, None if p.grad is None else p.grad.detach().clone()) for p in obj.parameters()]
                    restored_tensors.update(id(t) for t in [*obj.parameters(), *obj.buffers()])
            elif isinstance(obj, Iterator):  # a DataLoader iterator, a generator, iter(list)...
                snap.iterators.append(path)
            elif not own:  # inside a library's object: its to keep (only what has a state_dict is put back)
                continue
            elif isinstance(obj, dict):
                snap.bindings.append((obj, path, dict(obj)))
            elif isinstance(obj, (list, collections.deque)):
                snap.bindings.append((obj, path, list(obj)))
            elif _users_object(obj) and _users_own(obj):
                snap.bindings.append((obj, path, dict(vars(obj))))
        snap.tensors = [t for t in snap.tensors  # a view of a parameter shares its version counter
                        if id(t[0]) not in restored_tensors and id(t[0]._base) not in restored_tensors]
        return snap

    def restore(self) -> list[str]:
        """Put the state back; returns what changed in run A and could not be put back."""
        lost = list(self.unsaved) + [
            f"tensor {path} was changed in place by run A (tpkit copies no tensor outside a state_dict): "
            "run B started from its new value" for t, path, v in self.tensors if _version(t) != v]
        self.rebound = []
        for obj, path, saved in self.bindings:
            try:
                self.rebound += _rebind(obj, path, saved)
            except Exception as e:  # noqa: BLE001 - a container that refuses; said, not raised
                lost.append(f"{path or 'the namespace'} could not be put back ({type(e).__name__}: {e})")
        for obj, path, state in self.states:
            said = _load(obj, path, state)
            if said:
                lost.append(said)
        for param, grad in self.grads:
            try:
                param.grad = None if grad is None else grad.clone()
            except Exception:  # noqa: BLE001 - a parameter run A reshaped (a lazy one): said with its module
                pass
        for gen, state in self.generators:
            gen.set_state(state)
        if self.torch_rng is not None:
            torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        elif torch.cuda.is_available() and torch.cuda.is_initialized():  # run A initialised CUDA:
            for gen in torch.cuda.default_generators:  # its generators started from their seed
                gen.manual_seed(gen.initial_seed())
        np.random.set_state(self.numpy_rng)
        random.setstate(self.python_rng)
        if self.cut_short:
            lost.append(f"the namespace holds more than {_MAX_OBJECTS:,} objects within {_DEPTH} levels: "
                        "state beyond them was not looked for")
        if self.truncated:
            shown = ", ".join(self.truncated[:3]) + (f" and {len(self.truncated) - 3} more" if len(self.truncated) > 3 else "")
            lost.append(f"only the first {_MAX_ITEMS} items of {shown} were looked into (each binding is put back; a "
                        "model, optimizer or object of yours past them keeps run A's state)")
        return lost

    def describe(self) -> str:
        """What restore() put back, in words."""
        kinds = collections.Counter(_kind(obj) for obj, _, _ in self.states)
        parts = [f"{n} {k}{'s' if n > 1 else ''}" for k, n in kinds.items()]
        if self.rebound:
            shown = ", ".join(self.rebound[:5]) + (f" and {len(self.rebound) - 5} more" if len(self.rebound) > 5 else "")
            parts.append(f"{len(self.rebound)} binding{'s' if len(self.rebound) > 1 else ''} run A had changed ({shown})")
        rngs = "torch CPU" + (", CUDA" if self.cuda_rng is not None or torch.cuda.is_initialized() else "")
        parts.append(f"the RNGs ({rngs}, numpy, random" + (f", {len(self.generators)} torch.Generator"
                                                            if self.generators else "") + ")")
        return ", ".join(parts)


def _load(obj: Any, path: str, state: Any) -> str:
    """Put ``obj``'s state back from ``state`` (its copy before run A); what could not be, in
    words ("" where it all was). A module whose only difference is keys run A added (a buffer
    registered in its first forward) is loaded with ``strict=False``, and its new keys keep A's
    values; any other failure (a lazy module materialised in A, an object that refuses a second
    load) leaves it as A ended, said: the A/B goes on."""
    try:
        obj.load_state_dict(copy.deepcopy(state))
        return ""
    except Exception as e:  # noqa: BLE001 - said in the A/B's result, never raised
        error = e
    kind = type(obj).__name__
    if isinstance(obj, torch.nn.Module) and isinstance(state, dict):
        try:
            added = [k for k in obj.state_dict() if k not in state]
            if added and all(k in obj.state_dict() for k in state):
                obj.load_state_dict(copy.deepcopy(state), strict=False)
                keys = ", ".join(added[:5]) + (f" and {len(added) - 5} more" if len(added) > 5 else "")
                return (f"{path} ({kind}) gained state in run A ({keys}: registered during its run): the rest was put "
                        "back with load_state_dict(strict=False), and those keep run A's values in run B")
        except Exception as e:  # noqa: BLE001 - as below, with this error
            error = e
    first = str(error).strip().splitlines()[0][:160] if str(error).strip() else ""
    return (f"{path} ({kind}) could not be put back: its load_state_dict() raised {type(error).__name__}"
            + (f" ({first})" if first else "") + ": run B went on from the state run A left it in")


def _version(t: torch.Tensor) -> int | None:
    try:
        return int(t._version)
    except RuntimeError:  # inference tensors keep no version counter
        return None


def _kind(obj: Any) -> str:
    if isinstance(obj, torch.nn.Module):
        return "model"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return "LR scheduler"
    return type(obj).__name__


def _rebind(obj: Any, path: str, saved: Any) -> list[str]:
    """Put a container's (or an object's attributes') bindings back; the paths that changed."""
    if isinstance(obj, (list, collections.deque)):
        if len(obj) == len(saved) and all(map(operator.is_, obj, saved)):
            return []
        obj.clear()
        obj.extend(saved)
        return [path]
    current = obj if isinstance(obj, dict) else vars(obj)
    changed = [k for k, v in saved.items() if k not in current or current[k] is not v]
    added = [k for k in current if k not in saved] if path else []  # the namespace keeps A's new names
    for k in changed:
        current[k] = saved[k]
    for k in added:
        del current[k]
    sep = "." if path and not isinstance(obj, dict) else ""
    return [f"{path}[{k!r}]" if isinstance(obj, dict) and path else f"{path}{sep}{k}" for k in changed + added]


def models_in(ns: dict[str, Any]) -> list[torch.nn.Module]:
    """The models reachable from a namespace (``model``, ``state['model']``, ``trainer.model``;
    see ``reachable``), not submodules of another one found there."""
    mods = [obj for obj, _ in reachable(ns)[0] if isinstance(obj, torch.nn.Module)]
    inner = {id(m) for top in mods for m in top.modules() if m is not top}
    return [m for m in mods if id(m) not in inner]


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
    lost = snap.restore()
    notes += lost
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
    elif not verdict.ok and (lost or not swapped):  # the difference cannot be, or need not be, the kernels
        why = ("runs A and B ran the same code (no module matched a kernel), so the difference is state that run B "
               "did not start from again, not the kernels: " + ("; ".join(lost) if lost else
               "look for state the loop keeps where tpkit does not look (a tensor or numpy array changed in place "
               f"outside a state_dict, a global of another module, a file, more than {_DEPTH} levels below a name)")
               if not swapped else
               f"run A changed what tpkit could not put back ({'; '.join(lost)}), so the kernels need not be the cause")
        verdict = dataclasses.replace(verdict, message=(
            f"NOT THE SAME START: {why}. tpkit restored {snap.describe()}. {_difference(losses, verdict)}"))
    return ABResult(run_a, run_b, losses, verdict, swapped, notes)


def _difference(losses: pd.DataFrame, verdict: Any) -> str:
    """The loss difference of a failed verdict, in words that blame nothing."""
    if verdict.n_steps == 0:
        return "No step in common between run A and run B."
    parts = []
    if verdict.first_bad_step is not None:
        row = losses.loc[losses["step"] == verdict.first_bad_step].iloc[0]
        n_bad = int((~losses["within_tol"]).sum())
        parts.append(f"Step {verdict.first_bad_step}: loss {row.loss_b:.6g} in run B vs {row.loss_a:.6g} in run A; "
                     f"{n_bad} of {len(losses)} steps beyond tolerance")
    if verdict.missing_steps:
        parts.append(f"steps in only one run: {list(verdict.missing_steps)}")
    return "; ".join(parts) + "."
