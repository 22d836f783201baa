"""Whether the calling thread is inside torch.compile: tpkit's hooks then do nothing at all.

Two cases. While dynamo traces a hook (inlined into a compiled frame), nothing of tpkit's may
enter the graph: ``torch.compiler.is_dynamo_compiling()`` reads True there (dynamo folds it to a
constant: the test below it is never traced). While a compile session runs Python eagerly
(AOTAutograd's dispatch, a backend's tracing), torch holds ``torch.compiler._is_compiling_flag``
True, and ``torch.compiler.is_compiling()`` reads it. That flag is the process's, not the
thread's: a model compiled in another thread while the loop trained had turned every hook off
for the loop too (a background compile of 12-14 s left 4 of 40 steps recorded, and the slice
never ended).

So the sessions are followed per thread: dynamo enters ``torch.compiler._compile_session_context``
for each (looked up at each compilation), which ``watch_sessions`` wraps while a slice runs.
The flag then counts for the thread that holds a session; for any other thread only where it
cannot be explained (a session already under way when the slice began, in a thread not known,
counts as another thread's until the flag drops; a flag set by ``torch.export``, which opens no
session, counts for every thread, as before).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Callable

import torch

_dynamo_traces = torch.compiler.is_dynamo_compiling
_compiler: Any = torch.compiler
_get_ident = threading.get_ident

#: Open compile sessions by thread ident (a session can nest: a lazy backward compiled inside a
#: forward's compilation).
_sessions: dict[int, int] = {}
#: A session was under way in some thread when the slice began (not the loop's: the loop was
#: starting the slice); it explains the flag until the flag drops.
_foreign_at_start = False
_lock = threading.Lock()


def compiling() -> bool:
    """True where tpkit's hooks must do nothing: inside dynamo's trace, or in a thread that runs
    a compile session (or wherever the process's flag is up and no known session explains it).
    The phase probe's hottest hooks write its first tests out where they are called (a frame
    less a hook in an eager step, capture/probes/phases.py): a change to this rule goes there too."""
    global _foreign_at_start
    if _dynamo_traces():
        return True
    if not _compiler._is_compiling_flag:
        if _foreign_at_start:
            _foreign_at_start = False
        return False
    if _get_ident() in _sessions:
        return True
    return not (_sessions or _foreign_at_start)


def skipped_by_dynamo(fn: Callable[..., Any], callees: bool = False) -> Callable[..., Any]:
    """Dynamo compiles no frame of ``fn``'s own when it runs (the frames it calls are compiled as
    ever; with ``callees``, none of theirs either). While a compiled module runs, its
    ``super().__call__`` (torch.compile's wrapper, an FX ``GraphModule``) reads
    ``nn.Module.__call__`` and runs ``_module_call``: dynamo took it for user code and compiled
    it, a graph of its own (aot_eager: 2 graphs for 1, 4 for 1 with 12 layers, seconds of
    compiling). Torch's own call is skipped so. Likewise tpkit's wrappers of torch's functions run
    at dynamo's graph breaks (``Tensor.backward`` calls ``torch.autograd.backward`` eagerly, a
    ``zero_grad()`` that dynamo does not trace is called so): dynamo had compiled each as a frame
    of user code, a frame and a graph break more than without tpkit, and folded its bookkeeping
    away (the backward went unseen). Inlining while dynamo traces a caller is not affected: a
    wrapper inlined there returns torch's function at once (``compiling``) and breaks where it
    would. Set through torch's C hook (no import of ``torch._dynamo``). Returns ``fn``."""
    _skip_code(fn.__code__, callees)
    return fn


#: Code objects whose strategy is set already, with how: a wrapper made anew at each call (an
#: optimizer's closure, every step) shares its code with the last one, set once.
_skipped_codes: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _skip_code(code: Any, callees: bool) -> None:
    """Dynamo's frame strategy for ``code``: skipped, and its callees too where ``callees``."""
    if _skipped_codes.get(code) == callees:
        return
    _skipped_codes[code] = callees
    try:
        from torch._C._dynamo import eval_frame as ef

        action = ef._FrameAction
        ef.set_code_exec_strategy(code, ef._FrameExecStrategy(action.SKIP, action.SKIP if callees else action.DEFAULT))
    except Exception:  # noqa: BLE001 - another torch: the frame is compiled as before
        pass


def skip_own_frames(*owners: Any) -> None:
    """Every function of ``owners`` (modules or classes: their functions, methods and properties,
    and the functions nested in them) runs with no frame compiled by dynamo, its callees' neither
    (``skipped_by_dynamo(fn, callees=True)``): tpkit's bookkeeping, which a wrapper run eagerly at a
    graph break calls, had been compiled frame by frame (``Recorder.enter``, the loss's
    ``_add_losses``: 8 frames and 2 graph breaks more in a compiled training step). A wrapper that
    calls the loop's own code (torch's function, a module, a closure) is marked afterwards with
    ``skipped_by_dynamo(fn)``, whose callees dynamo compiles as without tpkit."""
    seen: set[int] = set()

    def mark(code: Any) -> None:
        if id(code) in seen:
            return
        seen.add(id(code))
        _skip_code(code, callees=True)
        for const in code.co_consts:
            if hasattr(const, "co_consts"):
                mark(const)

    for owner in owners:
        for value in vars(owner).values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            parts = (value.fget, value.fset) if isinstance(value, property) else (value,)
            for part in parts:
                code = getattr(part, "__code__", None)
                # a module's own functions (not those it imported); a class's every method
                if code is not None and (isinstance(owner, type) or code.co_filename == owner.__file__):
                    mark(code)


# its own frame is run eagerly by hooks between compiled graphs: dynamo had compiled it as a frame
# of user code, and torch.compiler's function it calls (a frame more each in its counters:
# tests/integrations/test_compile.py)
skipped_by_dynamo(compiling, callees=True)


def _watched(context: Any) -> Any:
    """``torch.compiler._compile_session_context``, noting which thread holds each session."""

    @contextlib.contextmanager
    def session() -> Iterator[None]:
        me = _get_ident()
        with _lock:
            _sessions[me] = _sessions.get(me, 0) + 1
        try:
            with context():
                yield
        finally:
            with _lock:
                left = _sessions.get(me, 1) - 1
                if left > 0:
                    _sessions[me] = left
                else:
                    _sessions.pop(me, None)

    session.__wrapped__ = context  # type: ignore[attr-defined]
    session.__doc__ = context.__doc__
    return session


def watch_sessions(patches: Any) -> None:
    """Wrap torch's compile session context with ``patches`` (a ``patching.Patches``: undone
    with the probe) and note whether a session is already under way."""
    global _foreign_at_start
    context = getattr(_compiler, "_compile_session_context", None)
    if not callable(context):
        return  # another torch: the flag counts for every thread, as is_compiling() reads it
    with _lock:
        _sessions.clear()
    _foreign_at_start = bool(_compiler._is_compiling_flag)
    patches.set(_compiler, "_compile_session_context", _watched(context))
