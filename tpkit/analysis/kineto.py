"""One rank's Run as a Kineto-style trace (the JSON ``torch.profiler`` writes), so that Holistic
Trace Analysis can read a folder of them: ``TraceAnalysis(trace_dir=DIR)`` with its temporal
breakdown, idle-time breakdown and communication/computation overlap.

A pure function of the Run's frames (pandas only): ``run_to_kineto(steps, spans, meta, rank,
world_size) -> dict``; ``kineto_json(doc)`` writes it the way HTA can find the rank.
``RankRuns.to_traces(dir)`` (tpkit/ranks.py) writes one per rank.

What HTA 0.5.0 needs, and how tpkit's spans fill it (measured in tests/ranks/hta_check.py):

- ``distributedInfo`` with ``rank`` and ``world_size``, **before** ``traceEvents``: HTA finds a
  file's rank with the regex ``"rank":\\s+(\\d+)`` over the file's lines and takes the first
  match, so the key must come first and be written with a space after the colon (json.dumps'
  default). Without it every file is rank 0.
- ``traceEvents`` of complete events (``ph: "X"``) with ``ts``/``dur`` in microseconds and a
  ``cat`` (events without ``dur`` or ``cat`` are dropped). Integer microseconds here: HTA rounds
  float timestamps inwards (ceil start, floor end).
- Device work: events whose ``args.stream`` is an integer >= 0 and whose ``args.correlation``
  matches a host event's (``stream`` absent, i.e. -1). Only device events launched before the
  last ``ProfilerStep#N`` starts are kept (the last step is dropped), and at least two
  ``ProfilerStep`` names must exist for that filter to apply.
- Kernel kinds come from names alone: ``^nccl.*Kernel`` is communication, ``Memcpy``/``Memset``
  is memory, anything else is computation. The idle-time breakdown reads ``cat`` in
  ``kernel``/``gpu_memcpy``/``gpu_memset`` and compares each kernel's start with its launch's.
- ``deviceProperties`` is not read by these analyses (kept empty on a CPU run: there is no GPU).

What is emitted, and why it is honest:

- Host lane (pid ``host_pid``, tid 1): one ``ProfilerStep#k`` per measured step (k counts from 0)
  and every tpkit span as a ``user_annotation`` with its phase name, as recorded.
- "Device" lanes (pid 0): tpkit measured no GPU kernels, so the lanes hold the training
  thread's phases, clearly named ``tpkit_<phase>`` and described in ``tpkit.device_lanes``:
  stream 7 holds the compute phases (forward, backward, optimizer, offload and user phases)
  with the exposed communication cut out of them, and ``h2d`` as ``Memcpy HtoD (tpkit h2d)``;
  data_wait, tpkit's own work and gaps are left empty, so HTA's "idle" is the time the loop was
  not computing. Stream 8 holds communication: exposed waits (phase ``comm``) named
  ``ncclKernel_<op> (tpkit exposed wait)`` and, when the Run has them, the overlapped in-flight
  intervals (phase ``comm_overlapped``) as ``ncclKernel_<op> (tpkit in flight)``. HTA's
  overlap is then the share of communication time that ran behind compute.
- Each lane event has a host ``cuda_runtime`` event named ``tpkit_launch`` at its start with the
  same correlation (HTA ties device work to its launch by it); on the CPU, launch and start are
  the same instant, so HTA's idle breakdown calls every gap "host wait", which is what it is.

Time base: ``meta["start_unix_ns"]`` when the Run has it (ranks line up to the microsecond),
else ``meta["start_time"]`` (ISO, whole seconds: each rank's analyses are right, the ranks'
relative placement is not), else 0.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
from typing import Any

import pandas as pd

from ..intervals import merge, subtract

#: Phases that are the device lane's "compute".
NOT_COMPUTE = frozenset({"data_wait", "h2d", "tpkit", "comm", "comm_overlapped", "gc"})
COMPUTE_STREAM = 7
COMM_STREAM = 8
DEVICE_PID = 0
HOST_TID = 1


def _base_us(meta: dict[str, Any]) -> int:
    ns = meta.get("start_unix_ns")
    if isinstance(ns, (int, float)) and not isinstance(ns, bool) and math.isfinite(ns):
        return int(ns) // 1000
    iso = meta.get("start_time")
    if isinstance(iso, str):
        try:
            return int(_dt.datetime.fromisoformat(iso).timestamp() * 1e6)
        except ValueError:
            pass
    return 0


def run_to_kineto(steps_df: pd.DataFrame, spans_df: pd.DataFrame, meta: dict[str, Any], rank: int,
                  world_size: int, *, include_warmup: bool = False) -> dict[str, Any]:
    """The trace document of one rank (see the module docstring). Warmup steps and their spans
    are left out unless ``include_warmup``."""
    base = _base_us(meta)
    host_pid = int(meta.get("pid") or 100_000 + int(rank))

    def us(seconds: float) -> int:
        return base + int(round(float(seconds) * 1e6))

    steps = steps_df if include_warmup or "warmup" not in steps_df else steps_df[~steps_df["warmup"].astype(bool)]
    keep = set(int(s) for s in steps["step"])
    spans = spans_df[spans_df["step"].isin(keep)] if len(spans_df) else spans_df

    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": host_pid, "tid": 0, "args": {"name": f"tpkit rank {rank} (host)"}},
        {"ph": "M", "name": "thread_name", "pid": host_pid, "tid": HOST_TID, "args": {"name": "training thread"}},
        {"ph": "M", "name": "process_name", "pid": DEVICE_PID, "tid": 0,
         "args": {"name": f"tpkit rank {rank} lanes (host-measured phases, not GPU kernels)"}},
        {"ph": "M", "name": "thread_name", "pid": DEVICE_PID, "tid": COMPUTE_STREAM,
         "args": {"name": f"stream {COMPUTE_STREAM} compute phases"}},
        {"ph": "M", "name": "thread_name", "pid": DEVICE_PID, "tid": COMM_STREAM,
         "args": {"name": f"stream {COMM_STREAM} collectives"}},
    ]
    for i, r in enumerate(steps.sort_values("start_s").itertuples(index=False)):
        ts = us(r.start_s)
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "pid": host_pid,
                       "tid": HOST_TID, "ts": ts, "dur": max(1, us(r.end_s) - ts),
                       "args": {"tpkit_step": int(r.step), "warmup": bool(r.warmup)}})
    rows = list(spans.sort_values(["start_s", "depth"]).itertuples(index=False)) if len(spans) else []
    for r in rows:
        ts = us(r.start_s)
        events.append({"ph": "X", "cat": "user_annotation", "name": str(r.phase), "pid": host_pid, "tid": HOST_TID,
                       "ts": ts, "dur": max(0, us(r.end_s) - ts),
                       "args": {"tpkit_step": int(r.step), "source": str(r.source), "depth": int(r.depth)}})

    # the lanes: compute phases with exposed communication cut out; communication on its own
    exposed = merge([(us(r.start_s), us(r.end_s)) for r in rows if r.phase == "comm"])
    lane: list[tuple[int, int, int, str, str, dict]] = []  # (ts, end, stream, cat, name, args)
    for r in rows:
        s, e = us(r.start_s), us(r.end_s)
        if int(r.depth) == 0 and r.phase not in NOT_COMPUTE:
            for a, b in subtract(s, e, exposed):
                lane.append((a, b, COMPUTE_STREAM, "kernel", f"tpkit_{r.phase}", {"tpkit_step": int(r.step)}))
        elif int(r.depth) == 0 and r.phase == "h2d":
            lane.append((s, e, COMPUTE_STREAM, "gpu_memcpy", "Memcpy HtoD (tpkit h2d)", {"tpkit_step": int(r.step)}))
        elif r.phase in ("comm", "comm_overlapped"):
            how = "exposed wait" if r.phase == "comm" else "in flight"
            op = str(r.source).split(":")[-1].strip() or "collective"
            lane.append((s, e, COMM_STREAM, "kernel", f"ncclKernel_{op} (tpkit {how})", {"tpkit_step": int(r.step)}))
    for corr, (s, e, stream, cat, name, args) in enumerate(sorted(lane), start=1):
        if e <= s:
            continue
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "tpkit_launch", "pid": host_pid, "tid": HOST_TID,
                       "ts": s, "dur": 0, "args": {"correlation": corr}})
        events.append({"ph": "X", "cat": cat, "name": name, "pid": DEVICE_PID, "tid": stream, "ts": s, "dur": e - s,
                       "args": {"stream": stream, "correlation": corr, "device": 0, **args}})

    devices = [d for d in meta.get("devices", []) if isinstance(d, str) and d.startswith("cuda")]
    return {
        "distributedInfo": {"backend": str(meta.get("backend", "gloo" if not devices else "nccl")),
                            "rank": int(rank), "world_size": int(world_size)},
        "schemaVersion": 1,
        "deviceProperties": [{"id": i, "name": d.split(":", 1)[-1].strip()} for i, d in enumerate(devices)],
        "traceName": f"tpkit {meta.get('name', 'run')} rank {rank}",
        "displayTimeUnit": "ms",
        "baseTimeNanoseconds": base * 1000,
        "tpkit": {"run": meta.get("name"), "rank": int(rank), "world_size": int(world_size),
                  "time_base": "start_unix_ns" if "start_unix_ns" in meta else
                  ("start_time (whole seconds)" if "start_time" in meta else "slice start"),
                  "device_lanes": "phases of the training thread as measured by tpkit on the host clock; "
                                  "no GPU kernel was recorded"},
        "traceEvents": events,
    }


def kineto_json(doc: dict[str, Any]) -> str:
    """The document as JSON HTA can read: default separators (``"rank": 0`` with its space) and
    ``distributedInfo`` first, as ``run_to_kineto`` orders it."""
    return json.dumps(doc)

