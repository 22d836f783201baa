"""Launching a worker script under torchrun from a test: ``torchrun(script, nproc, *args)``.

torchrun is ``python -m torch.distributed.run`` of the test's own interpreter, ``--standalone``
(a free rendezvous port on localhost, so launches never collide), gloo on the CPU. The run store
is off in the workers; DeepSpeed's CPU ops are built into build/torch_extensions, as
tests/test_offload_deepspeed.py does.
"""

from __future__ import annotations

import os
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
