"""Hooks a third-party package put on the trained model: a tracker's (``wandb.watch(model,
log="all")``: a forward hook logging every parameter's histogram, a gradient hook on every
parameter) runs inside the model's forward and backward, and its time is theirs. Found once,
after the slice, on the trained models: nothing runs per module call or per tensor.

Only the packages of ``schema.TRACKERS`` are called a tracker and get advice (wandb's by its
watch's ``log_freq``, read from its hooks: the default, every 1000th call, costs nothing
measurable and had been told to log "less often" with ``log_freq=100``). Any other package's hooks
(a ZeRO-style parameter gather, a compression library's) may be how the model trains: a note
names them and says where their time is, and advises nothing.

Without a word a watched model read COMPUTE-BOUND "forward+backward 83%" (forward 128-144 ms,
backward 132-134 ms a step, 11 and 19 ms unwatched: the hooks were nine tenths of them), and
its hooks' buffers read as activations and temporaries in memory.

Whose a hook is: the module its function was defined in (``__module__``; a ``functools.partial``'s
or a bound method's function). Torch's own, tpkit's and the user's (``__main__``, a file of their
own) are not noted, nor the packages whose hooks are how the model trains (``TRAINING``: ZeRO-3's
parameter gathering, a PEFT adapter's, Opacus' per-sample gradients). A package is third-party
where its files lie in a site-packages folder or an installed distribution provides it.
"""

from __future__ import annotations

import functools
import sys
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch

from ..schema import TRACKERS, hooks_phrase, hooks_remedy

#: Packages whose hooks on a model are how it trains, not an observer's: never noted.
TRAINING: frozenset[str] = frozenset({
    "torch", "tpkit", "deepspeed", "accelerate", "transformers", "peft", "lightning", "pytorch_lightning",
    "lightning_fabric", "keras", "fairscale", "opacus", "torchao", "bitsandbytes", "apex", "torch_xla", "torchvision",
})
#: Where the hook's function comes from the user's own code.
_OWN = frozenset({"__main__", "builtins", "functools", "__mp_main__"})
#: torch's global module hooks (``register_module_forward_hook`` and its kin), every module's.
_GLOBAL_TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
                  "_global_backward_hooks")
_MODULE_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
#: A leaf tensor's ``register_hook`` and ``register_post_accumulate_grad_hook`` tables.
_TENSOR_TABLES = ("_backward_hooks", "_post_accumulate_grad_hooks")


def find(models: Iterable[torch.nn.Module]) -> dict[str, int]:
    """Hooks of third-party packages on ``models`` (their modules' forward, pre-forward and
    backward hooks, their parameters' gradient and post-accumulate hooks) and torch's global
    module hooks, counted by top-level package. O(modules + parameters), once."""
    counts = Counter(_package(h) for h in _hooks(models))
    dists: list[set[str]] = []  # the installed distributions' names, read at most once
    return {name: n for name, n in sorted(counts.items()) if name and _third_party(name, dists)}


def log_freq(models: Iterable[torch.nn.Module]) -> dict[str, int]:
    """How often the trackers' hooks log, by package, where their own objects tell it: wandb's
    (``wandb.watch(model, log_freq=N)``) keep ``[count, N]`` in each hook's closure
    (wandb/integration/torch/wandb_torch.py's ``log_track_init``); the smallest N of them."""
    out: dict[str, int] = {}
    for hook in _hooks(models):
        fn = _unwrap(hook)
        if _package(fn) != "wandb":
            continue
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, list) and len(value) == 2 and all(type(v) is int for v in value):
                every = max(value[1], 1)  # (log_freq=0 logs every call)
                out["wandb"] = min(out.get("wandb", every), every)
    return out


def _hooks(models: Iterable[torch.nn.Module]) -> list[Any]:
    """The hook functions on ``models`` and, where there are any, torch's global module hooks."""
    hooks: list[Any] = []
    seen: set[int] = set()
    for model in models:
        for module in model.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for table in _MODULE_TABLES:
                hooks += (getattr(module, table, None) or {}).values()
            for p in module.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                for table in _TENSOR_TABLES:
                    hooks += (getattr(p, table, None) or {}).values()
    if hooks:
        table_module = sys.modules["torch.nn.modules.module"]
        for table in _GLOBAL_TABLES:
            hooks += (getattr(table_module, table, None) or {}).values()
    return hooks


def _unwrap(hook: Any) -> Any:
    """The function inside a hook's wrappers."""
    fn = hook
    for _ in range(8):  # a partial of a bound method of a wrapper...
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__func__"):
            fn = fn.__func__
        elif type(fn).__name__ == "_WrappedHook" and hasattr(fn, "hook"):  # torch's wrapper (module=True hooks)
            fn = fn.hook
        else:
            break
    return fn


def _package(hook: Any) -> str:
    """The top-level package the hook's function was defined in ("" where none is told)."""
    fn = _unwrap(hook)
    name = getattr(fn, "__module__", None)
    if not isinstance(name, str):
        name = type(fn).__module__
    return name.split(".")[0] if isinstance(name, str) else ""


def _third_party(package: str, dists: list[set[str]]) -> bool:
    """Whether ``package`` is an installed third-party package (not torch's, tpkit's, the user's);
    ``dists``: empty, or the installed distributions' names once read (``packages_distributions``
    takes 0.15 s with a few hundred installed: read once for all the packages)."""
    if package in _OWN or package in TRAINING or package.startswith("_"):
        return False
    module = sys.modules.get(package)
    where = str(getattr(module, "__file__", None) or "")
    if "site-packages" in where or "dist-packages" in where:
        return True
    if not dists:
        dists.append(_distributions())
    return package in dists[0]


def _distributions() -> set[str]:
    """Top-level names the installed distributions provide (read only where a hook's package is
    in no site-packages folder: a ``pip install --target`` on PYTHONPATH)."""
    from importlib.metadata import packages_distributions

    try:
        return set(packages_distributions())
    except Exception:  # noqa: BLE001 - a broken distribution's metadata: tell nothing
        return set()


def note(hooks: dict[str, int], every: dict[str, int], steps: int) -> str:
    """The run's note on them (``hooks``: ``find``'s counts; ``every``: ``log_freq``'s; ``steps``:
    the slice's). A tracker's are called so; advice only where ``hooks_remedy`` has some."""
    trackers = sorted(name for name in hooks if name in TRACKERS)
    whose = f" (module or gradient hooks: {' and '.join(trackers)}'s, a tracker's)" if trackers else ""
    rare = [f"{name} logs every {n} call(s) (log_freq={n}), at most once in the {steps} steps profiled"
            for name, n in sorted(every.items()) if n > steps]
    remedy = hooks_remedy(hooks, every, steps)
    return (f"{hooks_phrase(hooks)}{whose} ran in the steps: their time is inside forward_s and backward_s, "
            "and what they allocate there reads as activations and temporaries in memory"
            + "".join(f"; {text}" for text in [*rare, remedy] if text))
