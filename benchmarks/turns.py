"""Processes that take turns on the machine, one block of steps at a time.

A profiler that only runs through its own launcher (TraceML: ``traceml run``, an aggregator
process and torchrun around the script) cannot be switched on and off inside one training run,
so its cost could only be read over whole runs, minutes apart. On this VM whole runs of the same
loop move by 0.87-1.56x from one to the next (docs/OVERHEAD.md): the host's speed changes under
the guest. Here every contender runs at once, in a process tree of its own, and they take turns:
the parent wakes one tree (``SIGCONT``), tells its script to run one block of steps, and freezes
the tree again (``SIGSTOP``) when the block's step times come back. A frozen tree runs nothing,
its background threads and helper processes included, so each block pays only its own
profiler's costs, and blocks next to each other in time meet the same host: they can be paired
as the in-process modes are (benchmarks/interleave.py).

The parent (``Turns``) and each script (``TurnTaker``) talk through named pipes in a folder of
the parent's: the script reads ``go`` or ``stop`` from the pipe named after it and writes one
JSON line (``ready``, then the step times of each block) to the pipe named ``parent``.
``Turns.close`` thaws and stops every tree, and kills what has not ended, on any exit of the
parent but a ``SIGKILL`` (then ``pkill -CONT -f overhead.py`` and kill them by hand).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Callable

import psutil
from interleave import BASE, Block, schedule

PARENT = "parent"


def free_port() -> int:
    """A TCP port nothing listens on now: launches that run at once each need their own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tree(pid: int) -> list[psutil.Process]:
    """A process and all its descendants (launchers start helpers: every one must freeze)."""
    try:
        p = psutil.Process(pid)
        return [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal_tree(pid: int, sig: int) -> None:
    for p in _tree(pid):
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _freeze(pid: int, timeout_s: float = 2.0) -> None:
    """Stop a tree and wait until every process in it is stopped (a signal lands a moment
    later on a process that is running): the next block must not overlap this one's tail."""
    _signal_tree(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    for p in _tree(pid):
        try:
            while p.status() not in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"process {p.pid} did not stop")
                time.sleep(0.0001)
        except psutil.NoSuchProcess:
            pass


class Turns:
    """The parent's side: starts ``cmds`` (name -> argv; each script gets ``--turns DIR
    --turn-name NAME`` appended), waits until each said ``ready`` (freezing it then), and runs
    blocks by name with ``block``. A context manager: leaving it ends every tree."""

    def __init__(self, cmds: dict[str, list[str]], env: dict[str, str], cwd: Path, log_dir: Path) -> None:
        self.cmds, self.env, self.cwd, self.log_dir = cmds, env, cwd, log_dir
        self.dir = Path(tempfile.mkdtemp(prefix="tpkit-turns-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self._pipes: dict[str, int] = {}
        self._inbox = b""
        self._old_term: Any = None

    def __enter__(self) -> "Turns":
        self._old_term = signal.signal(signal.SIGTERM, _raise_exit)
        try:
            for name in [PARENT, *self.cmds]:
                os.mkfifo(self.dir / name)
                self._pipes[name] = os.open(self.dir / name, os.O_RDWR)  # never blocks, never sees EOF
            for name, argv in self.cmds.items():
                log = open(self.log_dir / f"{name.replace(' ', '_').replace(',', '')}.log", "w")  # noqa: SIM115
                self.procs[name] = subprocess.Popen([*argv, "--turns", str(self.dir), "--turn-name", name],
                                                    cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT)
                log.close()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def wait_ready(self, timeout_s: float) -> None:
        """Every script set up and warm, each frozen as soon as it says so."""
        waiting = set(self.cmds)
        deadline = time.monotonic() + timeout_s
        while waiting:
            msg = self._receive(deadline)
            if msg.get("ready"):
                waiting.discard(msg["name"])
                _freeze(self.procs[msg["name"]].pid)

    def block(self, name: str, timeout_s: float = 120.0) -> list[float]:
        """One block of ``name``'s steps, the others frozen; its kept step times (s)."""
        pid = self.procs[name].pid
        _signal_tree(pid, signal.SIGCONT)
        os.write(self._pipes[name], b"go\n")
        msg = self._receive(time.monotonic() + timeout_s)
        _freeze(pid)
        if msg.get("name") != name or "steps" not in msg:
            raise RuntimeError(f"{name}'s block came back as {msg}")
        return [float(x) for x in msg["steps"]]

    def _receive(self, deadline: float) -> dict:
        """The next JSON line from any script; a script that ended or a deadline passed raises."""
        fd = self._pipes[PARENT]
        while b"\n" not in self._inbox:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} ended with exit code {proc.returncode} (log: {self.log_dir})")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no word from the scripts in time (logs: {self.log_dir})")
            if select.select([fd], [], [], min(left, 1.0))[0]:
                self._inbox += os.read(fd, 65536)
        line, self._inbox = self._inbox.split(b"\n", 1)
        return json.loads(line)

    def run(self, who: dict[str, str], budget_s: float, min_cycles: int = 3) -> tuple[list[Block], int, float]:
        """Blocks in ``schedule``'s rotating order (``BASE`` between every two others) until the
        first whole cycle past ``budget_s`` (``min_cycles`` at least). ``who``: mode -> the name
        of the script that runs it, ``BASE`` included. Returns the blocks, the whole cycles and
        the seconds they took."""
        others = [m for m in who if m != BASE]
        cycle_len = 2 * len(others)
        blocks: list[Block] = []
        done = 0
        t0 = time.perf_counter()
        for i, mode in enumerate(schedule(others, 10_000)):
            blocks.append(Block(mode, max(i - 1, 0) // cycle_len, steps=self.block(who[mode])))
            done = i // cycle_len if i % cycle_len == 0 else 0
            if done >= min_cycles and time.perf_counter() - t0 > budget_s:
                break
        return blocks, done, time.perf_counter() - t0

    def close(self, timeout_s: float = 60.0) -> None:
        """Thaw every tree, tell its script to stop, wait, then kill what is left of the trees
        as they were (a launcher's helpers outlive it, no longer under it)."""
        trees = [p for proc in self.procs.values() if proc.poll() is None for p in _tree(proc.pid)]
        for name, proc in self.procs.items():
            if proc.poll() is None:
                _signal_tree(proc.pid, signal.SIGCONT)
                try:
                    os.write(self._pipes[name], b"stop\n")
                except OSError:
                    pass
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for p in trees:
            try:
                if p.is_running():  # the same process (psutil checks its start time), not a reused pid
                    p.kill()
            except psutil.NoSuchProcess:
                pass
        for fd in self._pipes.values():
            os.close(fd)
        self._pipes.clear()
        for name in [PARENT, *self.cmds]:
            (self.dir / name).unlink(missing_ok=True)
        self.dir.rmdir()
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None


def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


class TurnTaker:
    """A script's side, shaped like overhead.py's ``BlockRunner`` (``block_steps``, ``start()``
    before the first step, ``step_end()`` after each, False to stop), so a loop that can run
    blocks can take turns. Each block is ``skip`` dropped steps and ``block`` kept ones, timed on
    ``clock`` from the moment the parent said go. ``each_block``: a context (a profiler) entered
    when a block starts and left when it ends, as overhead.py's in-process blocks do."""

    def __init__(self, folder: str, name: str, skip: int, block: int, clock: Callable[[], float],
                 each_block: Callable[[], AbstractContextManager] | None = None) -> None:
        self.name, self.skip, self.block_steps, self.clock = name, skip, skip + block, clock
        self.each_block = each_block
        self._ctx: AbstractContextManager | None = None
        self._go = os.open(Path(folder) / name, os.O_RDWR)
        self._out = os.open(Path(folder) / PARENT, os.O_RDWR)
        self._ends: list[float] = []
        self._stopped = False
        self.blocks = 0

    def _send(self, msg: dict) -> None:
        os.write(self._out, (json.dumps({"name": self.name, **msg}) + "\n").encode())

    def _wait(self) -> bool:
        """Blocks until the parent says go (True) or stop (False)."""
        word = os.read(self._go, 16)
        if word.startswith(b"go"):
            if self.each_block is not None:
                self._ctx = self.each_block()
                self._ctx.__enter__()
            self._ends = [self.clock()]
            return True
        return False

    def _end_block(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    def start(self) -> None:
        """Say ready, then wait for the first turn (told to stop instead: the first step ends it)."""
        self._send({"ready": True})
        self._stopped = not self._wait()

    def step_end(self) -> bool:
        if self._stopped:
            return False
        self._ends.append(self.clock())
        if len(self._ends) <= self.block_steps:
            return True
        self._end_block()  # a profiler's teardown, in this script's turn but after its block's steps
        e = self._ends[self.skip:]
        self._send({"steps": [b - a for a, b in zip(e, e[1:])]})
        self.blocks += 1
        self._stopped = not self._wait()
        return not self._stopped
