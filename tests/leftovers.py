"""What a slice must leave as it found: every place tpkit hooks or patches, its threads, child
processes, shared-memory segments and the SIGINT and SIGTERM handlers. ``snapshot()`` before, ``snapshot()``
after, compare with ``diff``."""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import warnings
from types import CodeType, ModuleType
from typing import Any

import psutil
import torch
import torch.nn.modules.module as mm
import torch.optim.optimizer as oo
import torch.utils.data.dataloader as dl

from tpkit.capture import recorder
from tpkit.capture.probes import allocator_counter, patching

#: Classes and modules whose attributes tpkit patches while a slice runs (any of them, now or
#: later): every attribute's identity is compared.
PATCHED_PLACES: list[Any] = [torch.Tensor, torch.optim.Optimizer, torch.nn.Module, torch.autograd,
                             torch.autograd.profiler, torch.autograd.profiler_legacy,
                             dl._BaseDataLoaderIter, dl.DataLoader, torch.amp.GradScaler, torch.distributed,
                             torch.distributed.distributed_c10d,
                             torch.UntypedStorage]


def _shm() -> set[str]:
    """Segments named after this process (tpkit's loader names its segments ``tpk-<pid>-...``);
    other processes on the machine make and remove their own meanwhile."""
    mine = str(os.getpid())
    names = os.listdir("/dev/shm") if os.path.isdir("/dev/shm") else []
    return {n for n in names if mine in n.split("-")}


def snapshot() -> dict[str, Any]:
    out: dict[str, Any] = {
        "fwd_pre": len(mm._global_forward_pre_hooks), "fwd": len(mm._global_forward_hooks),
        "fwd_always": len(mm._global_forward_hooks_always_called),
        "bwd": len(mm._global_backward_hooks), "bwd_pre": len(mm._global_backward_pre_hooks),
        "opt_pre": len(oo._global_optimizer_pre_hooks), "opt_post": len(oo._global_optimizer_post_hooks),
        "gc_callbacks": len(gc.callbacks),
        "threads": sorted(t.name for t in threading.enumerate() if t.is_alive()),
        "children": sorted(p.pid for p in psutil.Process().children(recursive=True)),
        "shm": _shm(),
        "sigint": signal.getsignal(signal.SIGINT),
        # tpkit's SIGTERM guard (capture/interrupts.py) goes in as the probes do and must come out
        "sigterm": signal.getsignal(signal.SIGTERM),
        "active": recorder.active(),
        "autograd_profiler": torch.autograd.profiler._is_profiler_enabled,
        # tpkit's CPU allocation counter stays in front of the allocator once in (its module
        # docstring), passing through: no thread may still record after a slice
        "cpu_counter_recording": allocator_counter._module is not None and allocator_counter._module.recording(),
        "dynamo_compile_callbacks": _dynamo_callbacks(),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.distributed's deprecated aliases warn when touched
        for place in PATCHED_PLACES:
            name = getattr(place, "__name__", repr(place))
            out.update({f"{name}.{k}": id(v) for k, v in list(vars(place).items()) if callable(v)})
    return out


def _dynamo_handler() -> Any:
    """dynamo's compile callback handler, or None where dynamo is not imported."""
    callback = sys.modules.get("torch._dynamo.callback")
    return None if callback is None else callback.callback_handler


def _dynamo_callbacks() -> int:
    """dynamo's compile start and end callbacks (0 where dynamo is not imported)."""
    handler = _dynamo_handler()
    return 0 if handler is None else len(handler.start_callbacks) + len(handler.end_callbacks)


def diff(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The entries that changed (``{}`` when the slice left nothing behind). tpkit's own threads
    are named ``tpkit-*``; other threads (torch's, pytest's) are ignored."""
    changed = {}
    for key in set(before) | set(after):
        b, a = before.get(key), after.get(key)
        if key == "threads":
            b = [t for t in b or [] if t.startswith("tpkit")]
            a = [t for t in a or [] if t.startswith("tpkit")]
        if b != a:
            changed[key] = (b, a)
    return changed


def _owner_module(fn: Any) -> str:
    """tpkit's module that made ``fn`` ("" where none did): a function's code's file (a wrapper
    that copied the wrapped one's ``__module__``, as ``functools.wraps`` does, is still tpkit's),
    a bound method's or a partial's function, a bound method's object's class, a C object's type."""
    for obj in (fn, getattr(fn, "__func__", None), getattr(fn, "func", None),
                type(getattr(fn, "__self__", None)), type(fn)):
        code = getattr(obj, "__code__", None)
        if isinstance(code, CodeType) and f"{os.sep}tpkit{os.sep}" in code.co_filename:
            return code.co_filename.rsplit(f"{os.sep}tpkit{os.sep}", 1)[1]
        mod = getattr(obj, "__module__", None)
        if isinstance(mod, str) and mod.startswith("tpkit"):
            return mod
    return ""


def _name(owner: Any) -> str:
    """A class's or module's name, else the object's class and id."""
    if isinstance(owner, (type, ModuleType)):
        return getattr(owner, "__qualname__", owner.__name__)
    return f"{type(owner).__qualname__} object {id(owner):#x}"


def tpkit_hooks() -> list[str]:
    """Every hook or patch of tpkit's in torch's global places now (none outside a slice): the
    global module, optimizer and collector hooks, dynamo's compile callbacks (and tpkit's
    ``clear`` on its handler), the SIGINT and SIGTERM handlers, the allocation counter recording,
    every patch a probe's ``Patches`` holds in place (a framework's classes, a loader's fetcher, an
    instance), and the callables of ``PATCHED_PLACES`` and of ``torch`` itself.
    Unlike ``snapshot``, it needs no before: what a test registers of its own is not tpkit's."""
    found = []
    registries: dict[str, Any] = {
        "module forward pre-hook": mm._global_forward_pre_hooks, "module forward hook": mm._global_forward_hooks,
        "module backward pre-hook": mm._global_backward_pre_hooks, "module backward hook": mm._global_backward_hooks,
        "module forward hook (always called)": mm._global_forward_hooks_always_called,
        "optimizer pre-hook": oo._global_optimizer_pre_hooks, "optimizer post-hook": oo._global_optimizer_post_hooks,
    }
    for name, hooks in registries.items():
        found += [f"{name} {fn!r}" for fn in list(hooks.values()) if callable(fn) and _owner_module(fn)]
    found += [f"gc callback {fn!r}" for fn in list(gc.callbacks) if _owner_module(fn)]
    handler = _dynamo_handler()
    if handler is not None:
        found += [f"dynamo compile callback {fn!r}" for fn in [*handler.start_callbacks, *handler.end_callbacks]
                  if _owner_module(fn)]
        found += [f"dynamo handler's {k}" for k, v in vars(handler).items() if callable(v) and _owner_module(v)]
    found += [f"{signal.Signals(sig).name} handler {fn!r}" for sig in (signal.SIGINT, signal.SIGTERM)
              if callable(fn := signal.getsignal(sig)) and _owner_module(fn)]
    if allocator_counter._module is not None and allocator_counter._module.recording():
        found.append("the CPU allocation counter still recording")
    found += [f"{_name(owner)}.{attr} still patched (patching.in_place)" for owner, attr in patching.in_place()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.distributed's deprecated aliases warn when touched
        for place in [torch, *PATCHED_PLACES]:
            name = getattr(place, "__name__", repr(place))
            found += [f"{name}.{k} is tpkit's ({_owner_module(v)})" for k, v in list(vars(place).items())
                      if callable(v) and not isinstance(v, type) and _owner_module(v)]
    return found
