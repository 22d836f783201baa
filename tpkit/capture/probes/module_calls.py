"""How the phase probe sees the forward of any model without touching it: ``nn.Module.__call__``
is replaced while a probe is installed. Every module call of the process then comes here; an
outermost call of the loop's thread goes to the probe (``PhaseProbe._outer_call``), which opens
the ``forward`` span, and every other call (the modules inside it, other threads' modules inside
theirs) passes straight on to torch's own call.

Not torch's global module hooks: those take every module call off ``_call_impl``'s fast path
(1.4-2.2 us a call, docs/OVERHEAD.md).

Two routes, one behaviour:

- **C** (``module_calls.c``, the default): ``nn.Module``'s dict holds a ``Route`` object, a
  method descriptor written in C. A call ``module(x)`` reaches it with the module first and is
  passed on without a Python frame of tpkit's: +0.03 us a call over torch's own, where the
  Python route adds 0.53 warm and ~4 inside a real step (31 calls a step in a 2-layer GPT-2,
  151 in a 12-layer one; docs/OVERHEAD.md, "Module calls in C").
- **Python** (``_module_call``): where the C route cannot be built (no C compiler), and as the
  benchmark's peer (``C_ROUTE = False``). The run says which route ran and why.

What torch.compile sees is the same for both: reading ``nn.Module.__call__`` (dynamo does, for
each module it traces) gives the Python function ``_module_call``, whose first line returns
torch's call while dynamo traces (``_compiling`` folds to a constant there). Dynamo inlines it
as before: no graph break, no guard on tpkit's state, no recompile when the slice ends. (Had
dynamo met the C object itself it would guard on it, and a model compiled inside a slice would
recompile after it.)

``release`` and the probe's patches put torch's call back; code made during the slice that kept
``nn.Module.__call__`` (``_module_call``) only passes on afterwards.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from . import native
from .compiling import compiling, skipped_by_dynamo
from .patching import Patches

#: Use the C route when it can be built; False: the Python route (the benchmark's peer).
C_ROUTE = True
#: The C route's source and its extension's name (``native.py`` builds and caches it).
SOURCE = Path(__file__).with_name("module_calls.c")
EXTENSION_NAME = "tpkit_module_calls"

#: True while torch.compile works in this thread: the route then returns torch's call at once.
_compiling = compiling

#: ``nn.Module.__call__`` as it was when a probe took it over (torch's own, unless something else
#: had replaced it): every call the probe does not handle goes there.
_torch_call: Any = torch.nn.Module.__call__
_owner: Any = None  # the installed phase probe (one slice at a time), or None
_outer: Callable[..., Any] | None = None  # its handler of an outermost call, on the Python route
_inside: int | None = None  # the Python route: the thread whose outermost call runs
_route: Any = None  # the C route's object while (or since) it was taken; None: the Python route
_ext: Any = None  # the C route's extension, once loaded
_route_object: Any = None  # its one Route (made once per process)


def _module_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``nn.Module.__call__`` while a phase probe is installed, as Python and dynamo see it.

    On the C route only code that reads the attribute runs this (dynamo, ``module.__call__(x)``
    spelled out); it hands the call to the route. ``__tracebackhide__``: IPython and pytest
    leave this frame out of tracebacks."""
    __tracebackhide__ = True  # noqa: F841 - read by IPython's and pytest's traceback formatters
    if _compiling():
        return _torch_call(self, *args, **kwargs)
    if _route is not None:
        return _route(self, *args, **kwargs)
    outer = _outer
    if outer is None or _inside == threading.get_ident():
        return _torch_call(self, *args, **kwargs)
    return outer(self, *args, **kwargs)


skipped_by_dynamo(_module_call)


def _c_route() -> tuple[Any, str | None]:
    """The C route's object (built and loaded once per process), or None and why not."""
    global _ext, _route_object
    if _ext is None:
        ext, why, _ = native.load(EXTENSION_NAME, SOURCE)
        if ext is None:
            return None, why
        _ext, _route_object = ext, ext.Route(_module_call)
    return _route_object, None


def take(owner: Any, outer: Callable[..., Any], patches: Patches) -> str | None:
    """Route ``nn.Module.__call__`` for ``owner`` (a phase probe): an outermost call of the loop's
    thread goes to ``outer(module, *args, **kwargs)``. Undone by ``patches`` and ``release``.
    Returns None on the C route, else why the Python route is used."""
    global _torch_call, _owner, _outer, _inside, _route
    if _owner is not None and _owner.installed:
        raise RuntimeError("another tpkit phase probe is installed: one slice at a time")
    current = torch.nn.Module.__dict__["__call__"]
    if current is not _module_call and current is not _route_object:
        _torch_call = current  # (a route left behind cannot become the inner call)
    if C_ROUTE:
        route, why = _c_route()
    else:
        route, why = None, "the Python route was asked for (module_calls.C_ROUTE = False)"
    if route is not None:
        _ext.route(_torch_call, outer, vars(torch.compiler), compiling)
        _ext.inside(None)
    _route, _outer, _inside, _owner = route, outer, None, owner
    patches.set(torch.nn.Module, "__call__", route if route is not None else _module_call)
    return why


def release(owner: Any) -> None:
    """No module call goes to ``owner``'s handler from now on (``nn.Module.__call__`` itself is
    put back by the probe's patches)."""
    global _owner, _outer, _inside
    if _owner is not owner:
        return
    _owner, _outer, _inside = None, None, None
    if _ext is not None:
        _ext.route(_torch_call, None, vars(torch.compiler), compiling)


def _released_in_child() -> None:
    """A process forked while a probe holds the route (patching.py puts torch's call back on
    ``nn.Module`` there): the route is the child's no more, and a slice of its own may take it."""
    if _owner is None:
        return
    try:
        release(_owner)
    except Exception:  # noqa: BLE001 - a fork's child must never fail for tpkit
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_released_in_child)


def set_inside(tid: int | None) -> None:
    """The thread whose outermost call runs now (its inner calls go straight to torch), or None."""
    global _inside
    if _route is not None:
        _ext.inside(tid)
    else:
        _inside = tid


def inside_setter() -> Callable[[int | None], None]:
    """``set_inside`` as the route taken now has it: the C route's own setter (an outermost call
    sets and resets it, and a Python frame of tpkit's each time was two a step), else
    ``set_inside``. Asked after ``take``."""
    return _ext.inside if _route is not None else set_inside


def inside() -> int | None:
    """The thread whose outermost call runs now, or None."""
    if _route is not None:
        tid: int | None = _ext.state()[1]
        return tid
    return _inside
