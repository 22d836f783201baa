"""What the main process's cheaper hand-out is worth (session 28): tpkit's loader as it is against
the same loader with the four methods it changed put back as they were after session 27,
switched block by block inside one loader, on the tiny workload of ``benchmarks/loader.py``
(64 samples of 8 floats and an int a batch, 2 workers).

The peer (``Before``, rebuilt here from session 27's code):

- ``_pick`` listed the workers with room and took ``min`` with a key function, at every pass of
  ``_dispatch`` (about two a batch, most of them sending nothing);
- ``_send`` pickled ``Task`` named tuples (a class lookup when pickled, a Python call when read);
- ``_help_ahead`` (asked before each batch the main process makes) ran a generator;
- ``_poller`` built a tuple over the workers at every wait to see whether they had changed.

Each method is looked up on the class at every call, so one loader runs both, in turns
(``loader_blocks.py``: > 1, the current one is faster). Printed: the median of the cycles'
ratios with its 95% bootstrap interval, with the main process helping (the default) and
waiting.

    python benchmarks/loader_dispatch.py [--cycles 300] [--block 150]
"""

from __future__ import annotations

import pickle
import select
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loader_blocks import block_args, compare  # noqa: E402

CHANGED = ("_pick", "_send", "_help_ahead", "_poller")


class Before:
    """The four methods as session 27 left them (the peer)."""

    def _pick(self: Any) -> Any:
        ws = self.workers
        parked = self._parked()
        if parked is not None:
            ok = [w for w in ws if w.id != parked and self._has_room(w)]
            return min(ok, key=lambda w: len(w.inflight) + w.buffered) if ok else None
        if not self.in_order:
            if self.tasks is None and all(w.exhausted for w in ws):
                self.tasks_done = True
                return None
            ok = [w for w in ws if self._has_room(w)]
            return min(ok, key=lambda w: len(w.inflight) + w.buffered) if ok else None
        if self.tasks is not None:
            w = ws[(self._next_id - self.epoch_first_id) % len(ws)]
            return w if self._has_room(w) else None
        for k in range(len(ws)):
            w = ws[(self.rr + k) % len(ws)]
            if not w.exhausted:
                if self._has_room(w):
                    self.rr = (w.id + 1) % len(ws)
                    return w
                return None
        self.tasks_done = True
        return None

    @staticmethod
    def _send(w: Any, msg: Any) -> None:
        try:
            w.conn.send_bytes(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL))  # Task named tuples
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _help_ahead(self: Any) -> int:
        return max(self._depth(w) for w in self.workers) * self.num_workers

    def _poller(self: Any) -> Any:
        key = tuple((w.id, w.life) for w in self.workers if w.proc is not None)
        if key != self._poll_key:
            poller, where = select.poll(), {}
            for w in self.workers:
                if w.proc is not None:
                    for fd, dead in ((w.conn.fileno(), False), (w.proc.sentinel, True)):
                        poller.register(fd, select.POLLIN)
                        where[fd] = (dead, w)
            self._poll_key, self._polling = key, (poller, where)
        return self._polling


def main() -> None:
    args = block_args(__doc__)
    from tpkit.data.process_pool import ProcessPool

    now = {name: ProcessPool.__dict__[name] for name in CHANGED}
    before = {name: Before.__dict__[name] for name in CHANGED}

    def use(methods: dict[str, Any]) -> Callable[[], None]:
        def switch() -> None:
            for name, method in methods.items():
                setattr(ProcessPool, name, method)
        return switch

    compare("loader_dispatch", f"the main process's {', '.join(CHANGED)} as now (current) against as "
            "after session 27 (peer)", args.cycles, args.block, peer=use(before), current=use(now))


if __name__ == "__main__":
    main()
