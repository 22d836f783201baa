"""Launching a worker script under torchrun from a test: ``torchrun(script, nproc, *args)``; or by
plain ``python`` (``python_script``), where the script's framework starts the other ranks.

torchrun is ``python -m torch.distributed.run`` of the test's own interpreter, ``--standalone``
(a free rendezvous port on localhost, so launches never collide), gloo on the CPU. The run store
is off in the workers; DeepSpeed's CPU ops are built into build/torch_extensions, as
tests/test_offload_deepspeed.py does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


class LaunchError(AssertionError):
    pass


def torchrun(script: str, nproc: int, *args: str, timeout_s: float = 300, **env: str) -> tuple[str, float]:
    """Run ``tests/ranks/<script>`` on ``nproc`` ranks; returns (output, seconds). Raises
    LaunchError with the output when the launch fails or runs past ``timeout_s``."""
    full_env = dict(os.environ, TPKIT_RUNS="off", PYTHONUNBUFFERED="1",
                    TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR",
                                                        str(ROOT / "build" / "torch_extensions")), **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(HERE / script), *args]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, env=full_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise LaunchError(f"{script} ran past {timeout_s} s:\n{(e.output or '')[-4000:]}") from None
    took = time.monotonic() - t0
    if p.returncode != 0:
        raise LaunchError(f"{script} {' '.join(args)} failed ({p.returncode}):\n{p.stdout[-6000:]}")
    return p.stdout, took


def python_script(script: str, *args: str, timeout_s: float = 120) -> str:
    """Run ``python tests/ranks/<script>`` in a session of its own; returns its output. On a
    timeout every process of the session (the ranks it started) is killed; raises LaunchError
    when it fails, runs past ``timeout_s``, or leaves a process of its session running."""
    # the checkout's tpkit (the script's own folder comes first on its path, not the checkout)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TPKIT_RUNS="off", PYTHONUNBUFFERED="1", PYTHONPATH=path)
    p = subprocess.Popen([sys.executable, str(HERE / script), *args], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_session(p.pid)
        out, _ = p.communicate()
        raise LaunchError(f"{script} ran past {timeout_s} s:\n{out[-4000:]}") from None
    finally:
        left = _session(p.pid, wait_s=10)
        if left:
            _kill_session(p.pid)
    if left:
        raise LaunchError(f"{script} left processes running: {left}\n{out[-4000:]}")
    if p.returncode != 0:
        raise LaunchError(f"{script} {' '.join(args)} failed ({p.returncode}):\n{out[-6000:]}")
    return out


def _session(sid: int, wait_s: float) -> list[int]:
    """Processes of session ``sid`` still alive after up to ``wait_s`` (multiprocessing's resource
    tracker ends a moment after the process that started it)."""
    import psutil

    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for proc in psutil.process_iter():
            try:
                if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc.pid)
            except (ProcessLookupError, psutil.Error, PermissionError):
                continue
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _kill_session(sid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(sid, signal.SIGKILL)
