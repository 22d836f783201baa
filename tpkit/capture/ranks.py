"""Capture in several processes: every rank of a ``torchrun`` / ``deepspeed`` launch records
its own Run.

Each rank's slice is an ordinary slice; what is added here:

- ``rank_meta()``: rank, local rank and world size (from ``torch.distributed`` when it is
  initialised, else from the launcher's ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``), written
  into ``run.meta``.
- ``finish_rank_run(run, save_dir)``: called by the profiler when a slice ends, however it
  ends. With ``tp.profile(..., save_dir=DIR)`` or ``TPKIT_SAVE_DIR=DIR`` in the launch
  environment, the Run goes to ``DIR/rank<k>`` (``DIR/<name>`` for a single process). A rank
  whose slice ended by an error (a peer died and the collective timed out) is saved the same
  way, marked ``complete: false`` with the error, so the survivors' runs are never lost (a
  launcher's SIGTERM to the survivors waits for the run to be kept: ``interrupts.TermGuard``).
- ``rank_watchdog``: a thread that saves a rank's partial Run while a collective hangs.

Loading and merging the ranks' runs is ``tpkit.ranks``; the arithmetic is ``tpkit.analysis.ranks``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..schema import ENV_SAVE_DIR

if TYPE_CHECKING:  # both import pandas: never at a slice's start (slice.py, _collect_startup)
    from ..run import Run


def rank_meta() -> dict[str, Any]:
    """``{"rank", "local_rank", "world_size"}`` of this process, or ``{}`` when it is not part of
    a multi-process launch."""
    rank = world = None
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # a broken process group must not stop the run from being kept
        pass
    env = os.environ
    if rank is None and "RANK" in env and "WORLD_SIZE" in env:
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        except ValueError:
            return {}
    if rank is None:
        return {}
    local = env.get("LOCAL_RANK")
    return {"rank": int(rank), "world_size": int(world or 0),
            "local_rank": int(local) if local is not None and local.isdigit() else None}


#: The launch's environment that ``launch_env`` records (what the launcher set).
LAUNCH_ENV = {"run_id": "TORCHELASTIC_RUN_ID", "restart": "TORCHELASTIC_RESTART_COUNT", "master_addr": "MASTER_ADDR",
              "master_port": "MASTER_PORT", "slurm_job_id": "SLURM_JOB_ID"}

def launch_env() -> dict[str, Any]:
    """What the launcher set that tells this launch from another (``meta["launch"]``): torchrun's
    run id and restart count, the rendezvous address, SLURM's job id; only those set."""
    return {k: os.environ[v] for k, v in LAUNCH_ENV.items() if os.environ.get(v) not in (None, "", "none")}


def _group() -> tuple[Any, int, int] | None:
    """(the default process group's store, rank, world size) where a group of several ranks is up."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        return dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - no store, no check: the slice runs as before
        return None


def start_check(steps: int, warmup: Any, stop: bool) -> dict[str, Any]:
    """At a slice's start, where a process group of several ranks is up: the launch's id, the
    same on every rank of this launch and new at each launch (the first rank to ask sets it in
    the group's store: one store round trip, no wait), into ``meta["launch"]`` with
    ``launch_env()``, so ``tpkit.ranks.load_ranks`` tells one launch's runs from another's left in
    the same folder. Returns meta to add.

    Ranks' ``steps`` and ``warmup`` are not compared here: a comparison through the store had to
    wait for every rank (30 s at each slice of a rank that profiles alone, stalling the job, since
    the others wait in their next collective), and slices a rank ran alone shifted which slice it
    compared (a launch given the same values on every rank was refused). The merged view says
    when the ranks' values differ (``tpkit.ranks``)."""
    import uuid

    del steps, warmup, stop  # (kept in the signature: the slice passes its config)
    launch = launch_env()
    out: dict[str, Any] = {"launch": launch} if launch else {}
    group = _group()
    if group is None:
        return out
    store, _rank, world = group
    launch["world_size"] = world
    out["launch"] = launch
    try:
        key = f"tpkit/launch/{launch.get('restart', '0')}"
        launch["id"] = bytes(store.compare_set(key, "", uuid.uuid4().hex)).decode()
    except Exception as e:  # noqa: BLE001 - a store without compare_set: the runs say what the launcher set
        out["notes"] = [f"the launch's id was not set ({e!r}): its runs are told apart by the launcher's "
                        "environment only"]
    return out


def rank_folder(save_dir: str | os.PathLike, meta: dict[str, Any]) -> Path:
    """Where a rank's Run is saved under ``save_dir``."""
    if meta.get("world_size") is not None and meta.get("rank") is not None:
        return Path(save_dir) / f"rank{int(meta['rank'])}"
    return Path(save_dir) / str(meta.get("name", "run"))


def finish_rank_run(run: Run, save_dir: str | os.PathLike | None = None) -> Path | None:
    """Put rank facts into ``run.meta`` and, when a save folder is given (argument or
    ``TPKIT_SAVE_DIR``), save the Run there. Never raises: a failed save is a note on the run."""
    try:
        info = rank_meta()
        run.meta.update(info)
        if info.get("world_size", 0) > 1 and "launch" not in run.meta:
            # no process group of several ranks at the slice's start (one came up inside it, or
            # none): what the launcher set (no store round trip here: a peer may be dead)
            run.meta["launch"] = {**launch_env(), "world_size": info["world_size"]}
        if info.get("world_size", 0) > 1 and run.steps["loss"].notna().any():
            run.meta.setdefault("notes", []).append(
                f"the loss is rank {info['rank']}'s own, on its own batches; a data-parallel trainer logs the "
                f"mean over its {info['world_size']} ranks (python -m tpkit ranks DIR shows that mean)")
        if info and not run.complete:
            run.meta["rank_status"] = "failed"
            if run.meta.get("rank_watchdog_fired"):
                run.meta["stopped_by"] = "stalled"
                # the watchdog's KeyboardInterrupt is how the stall ended the slice, not a Ctrl-C
                if str(run.meta.get("error", "")).startswith("KeyboardInterrupt"):
                    run.meta["error"] = run.meta.get("rank_watchdog_error") or run.meta["error"]
        target = save_dir if save_dir is not None else os.environ.get(ENV_SAVE_DIR) or None
        if target is None:
            return None
        return run.save(rank_folder(target, run.meta))
    except Exception as e:
        run.meta.setdefault("notes", []).append(f"saving the rank's run failed: {e!r}")
        return None


# -- the stall watchdog -----------------------------------------------------------------------
ENV_TIMEOUT = "TPKIT_RANK_TIMEOUT_S"


class RankWatchdog:
    """In a multi-process launch, saves this rank's partial Run if no step ends for
    ``timeout_s`` (a peer died and a collective hangs instead of failing), marked
    ``stopped_by: "stalled"``, then raises KeyboardInterrupt in the main thread so the slice
    ends as soon as control returns to Python. A collective that fails by itself (gloo sees
    the peer's socket close) ends the slice through the normal error path first.

    Daemon thread, stop event, ``remove`` idempotent; nothing runs outside a launch."""

    def __init__(self, rec: Any, save_dir: str | os.PathLike, timeout_s: float, warmup_steps: int = 0,
                 poll_s: float = 0.2) -> None:
        import threading

        self.rec, self.save_dir, self.timeout_s, self.poll_s = rec, save_dir, float(timeout_s), poll_s
        self.warmup_steps = warmup_steps
        self.fired = False
        self.message = ""
        self.stall: dict[str, Any] = {}  # where the loop was when it fired (``where_stalled``)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tpkit-rank-watchdog", daemon=True)

    def install(self) -> "RankWatchdog":
        self._thread.start()
        return self

    def remove(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def meta(self) -> dict[str, Any]:
        if not self.fired:
            return {}
        return {"rank_watchdog_fired": True, "rank_watchdog_error": self.message, "stall": dict(self.stall)}

    def _loop(self) -> None:
        from time import perf_counter_ns

        while not self._stop.wait(self.poll_s):
            ends = self.rec.step_ends
            last_ns = ends[-1][0] if ends else self.rec.t0_ns
            if (perf_counter_ns() - last_ns) / 1e9 >= self.timeout_s:
                self._fire()
                return

    def _fire(self) -> None:
        import _thread

        self.fired = True
        rec = self.rec
        try:
            snap = rec.snapshot()  # the main thread may still append to the originals
            snap.cuda_timer = None  # CUDA events are resolved by the main thread only
            snap.step_events = {}
            # A loss still on the GPU cannot be read: on a rank stalled in NCCL the stream never
            # drains and reading it would block this thread forever (the case it exists for).
            on_host = [(s, v) for s, v in snap.losses if not getattr(v, "is_cuda", False)]
            if len(on_host) < len(snap.losses):
                snap.notes.append(f"{len(snap.losses) - len(on_host)} losses were on the GPU, which is stalled: "
                                  "left out of the stalled rank's run")
            snap.losses = on_host
            self.stall = where_stalled(rec.thread_id)
            msg = self.message = stall_message(self.timeout_s, self.stall)
            snap.notes.append(msg)
            warmup = min(self.warmup_steps, len(snap.step_ends))
            from .build import build_run

            run = build_run(snap, warmup, {"complete": False, "stopped_by": "stalled", "error": msg,
                                           "stall": dict(self.stall)})
            finish_rank_run(run, self.save_dir)
        finally:
            _thread.interrupt_main()  # ends the slice once the main thread is back in Python


def where_stalled(thread_id: int) -> dict[str, Any]:
    """Where the loop's thread is as a stall is declared: ``in_collective`` (True: blocked in a
    collective, waiting for a peer; False: in its own code, what the other ranks would wait for;
    None: collectives are not timed in this slice, unknown), the collective and for how long, and
    ``at``, the innermost line of the loop's code outside torch and tpkit. Read once, by the
    watchdog's thread, from the communication probe (``CommProbe.blocked``) and the thread's stack."""
    import sys
    import traceback
    from time import perf_counter_ns

    from .probes import comm

    out: dict[str, Any] = {"in_collective": None}
    probe = comm._ACTIVE
    if probe is not None and probe.installed:
        now = probe.blocked(thread_id)
        out["in_collective"] = now is not None
        if now is not None:
            out.update(collective=now[1], waiting_s=round((perf_counter_ns() - now[0]) / 1e9, 3))
    frame = sys._current_frames().get(thread_id)
    if frame is not None:
        skip = (os.sep + "torch" + os.sep, os.sep + "tpkit" + os.sep, os.sep + "lightning" + os.sep,
                os.sep + "transformers" + os.sep, os.sep + "accelerate" + os.sep, os.sep + "deepspeed" + os.sep)
        for fs in reversed(traceback.extract_stack(frame)):
            if not any(p in fs.filename for p in skip):
                out["at"] = f"{fs.filename}:{fs.lineno} in {fs.name}" + (f": {fs.line}" if fs.line else "")
                break
    return out


def stall_message(timeout_s: float, stall: dict[str, Any]) -> str:
    """The stalled rank's error line, from ``where_stalled``."""
    head = f"no step ended for {timeout_s:g} s: "
    at = f" (at {stall['at']})" if stall.get("at") else ""
    tail = "; the Run holds the steps before the stall"
    if stall.get("in_collective"):
        return (head + f"this rank stalled, blocked in a collective ({stall.get('collective')}) for "
                f"{stall.get('waiting_s', 0.0):.1f} s, waiting for a peer that died or hangs{at}" + tail)
    if stall.get("in_collective") is False:
        return (head + f"this rank stalled in its own code, not waiting in any collective{at}: the other ranks "
                "would wait for it in their next collective" + tail)
    return head + f"this rank stalled (a peer died or hangs, or this rank's own code){at}" + tail


def rank_watchdog(rec: Any, cfg: Any) -> RankWatchdog | None:
    """Factory for ``PROBE_FACTORIES``: only in a multi-process launch with a save folder and a
    timeout (``TPKIT_RANK_TIMEOUT_S``)."""
    timeout = os.environ.get(ENV_TIMEOUT)
    save_dir = getattr(cfg, "save_dir", None) or os.environ.get(ENV_SAVE_DIR)
    if not timeout or not save_dir or int(rank_meta().get("world_size") or 1) < 2:
        return None
    warmup = cfg.warmup if isinstance(getattr(cfg, "warmup", None), int) else 0
    return RankWatchdog(rec, save_dir, float(timeout), warmup)
