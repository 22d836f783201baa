"""Attribute patches that come off exactly: what a class held itself is put back, and an
attribute it only inherited is deleted again (so the base class shows through as before)."""

from __future__ import annotations

from typing import Any


class Patches:
    """Attribute patches that are undone exactly, in reverse order, however often ``undo`` is called."""
    def __init__(self) -> None:
        self._done: list[tuple[Any, str, Any]] = []  # (owner, attribute, original or None)

    def __bool__(self) -> bool:
        return bool(self._done)

    def set(self, owner: Any, attr: str, new: Any) -> None:
        orig = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
        self._done.append((owner, attr, orig))
        setattr(owner, attr, new)

    def restore(self) -> None:
        """Undo every patch, newest first. Idempotent."""
        while self._done:
            owner, attr, orig = self._done.pop()
            if orig is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, orig)
